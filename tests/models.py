"""Small models the tests share."""

from __future__ import annotations

import collections
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out or d_in)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class BNNet(nn.Module):
    """Linear(8, 6) then BatchNorm1d(6): one BatchNorm sync under data parallelism."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn(self.fc(x))


class CNN(nn.Module):
    def __init__(self, batch_norm: bool = True):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6) if batch_norm else nn.Identity()
        self.conv2 = nn.Conv2d(6, 8, 3, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.fc(torch.flatten(self.pool(x), 1))


class ResidualBlock(nn.Module):
    def __init__(self, d: int = 12):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.fc2(F.gelu(self.fc1(self.norm(x))))
        return x + h


class ResNetish(nn.Module):
    def __init__(self, d: int = 12, depth: int = 3):
        super().__init__()
        self.blocks = nn.Sequential(*[ResidualBlock(d) for _ in range(depth)])
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.blocks(x).mean(dim=1))


Pair = collections.namedtuple("Pair", ["logits", "features"])


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    extra: dict
    note: str = "ok"


class NestedIO(nn.Module):
    """Dict and tuple inputs, kwargs, and namedtuple / dict / None / scalar outputs."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(4, 5)

    def forward(self, batch, pair, scale: float = 1.0, mask=None):
        h = self.a(batch["x"]) + self.b(pair[1])
        if mask is not None:
            h = h * mask
        return {"out": Pair(h * scale, [pair[0], None]), "count": 3, "name": "nested"}


class DataclassOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        y = self.fc(x)
        return Output(logits=y, extra={"sq": y * y})


class Classifier(nn.Module):
    """Returns the single-device cross-entropy loss: what DataParallel gets wrong."""

    def __init__(self):
        super().__init__()
        self.net = MLP(8, 16, 5)

    def forward(self, x, target):
        logits = self.net(x)
        return F.cross_entropy(logits, target), logits


class SeqEncoder(nn.Module):
    """Sequence-first LSTM: the batch is dim 1 of the input."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 6)
        self.rnn = nn.LSTM(6, 8, num_layers=2)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        out, (h, c) = self.rnn(self.emb(tokens))
        return self.head(out[-1]), h


class Attention(nn.Module):
    """Multi-head self-attention written with view/transpose/matmul/softmax (heads sharded by TP)."""

    def __init__(self, d: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, c = x.shape
        q = self.q(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = self.v(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
        att = ((q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.out(y)


class NormAfterColumn(nn.Module):
    """A LayerNorm between two Linears: a column output must be gathered before it."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))


class Shared(nn.Module):
    """One Linear called twice."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(self.fc(x))


class Tied(nn.Module):
    """A Linear whose weight is also read directly."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) @ self.fc.weight


class Departures(nn.Module):
    """A forward that departs on what it reads as Python: its mode (dropout with
    ``self.training``), an optional argument (``if scale is not None``) and a flag (``if double``)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x, scale=None, double: bool = False):
        h = F.dropout(F.gelu(self.fc1(x)), 0.5, self.training)
        y = self.fc2(h)
        if scale is not None:
            y = y * scale
        if double:
            y = y * 2
        return y


class OptionalScale(nn.Module):
    """forward branches on an optional argument and on self.training."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x, scale=None):
        h = self.fc2(F.gelu(self.fc1(x)))
        if scale is not None:
            h = h * scale
        return h + 1 if self.training else h


class CellLoop(nn.Module):
    """A hand-rolled recurrence whose state starts as torch.zeros(x.size(0), hidden)."""

    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(4, 6)
        self.fc = nn.Linear(6, 2)

    def forward(self, x):
        h = torch.zeros(x.size(0), 6, device=x.device)
        for t in range(3):
            h = self.cell(x[:, t], h)
        return self.fc(h)


class Masked(nn.Module):
    """A bool buffer (a mask) beside a linear."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tensor([True, False, True, True]))

    def forward(self, x):
        return self.fc(x) * self.mask
