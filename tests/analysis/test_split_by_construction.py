"""Ops that third-party models run and that used to run whole now run split, in both frontends.

Each toy holds one construct (issue 30): ``torch.tensor_split`` (a state-space scan's chunks),
``F.pad`` of a slice (shifted copies, the pad naming the batch dim by zeros), ``reshape_as`` /
``view_as``, ``zeros(...).to(x)`` and the dtype/device conversions, ``Tensor.norm`` and
``linalg.vector_norm``, ``Tensor.unfold`` and ``F.unfold``, ``argsort``, ``baddbmm`` with a
bias broadcast over the batch, an ``einsum`` whose batch sits on dim 1 (sequence-first
internals), and arithmetic on the batch size (``b * k``, ``n // k``, ``b + 0``, Swin's window
partition and reverse, heads and frames folded into the batch). Each is captured by fx and by
torch.export (its default, training, IR: ``aten.tensor_split.indices``, ``aten.pad``,
``aten.linalg_vector_norm``, ``aten.einsum``, ...) on a batch of 4, run on a batch of 5 over 3
virtual devices (uneven chunks), and checked against eager, forward and every gradient; and
``explain`` lists nothing that runs whole.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import assert_runs_split_like_eager


class _Head(nn.Module):
    """A linear layer after the construct, so that there are FLOPs to count and gradients to compare."""

    def __init__(self, d: int):
        super().__init__()
        self.head = nn.Linear(d, d)


class TensorSplit(_Head):
    def __init__(self):
        super().__init__(4)

    def forward(self, x):  # (B, L, D): a scan over chunks of the sequence
        a, b, c = torch.tensor_split(self.head(x), [2, 5], dim=1)
        left, right = x.tensor_split(2, dim=2)
        return a.sum(1) + b.sum(1) + c.sum(1) + (left * right).sum((1, 2))[:, None]


class PadSlice(_Head):
    def __init__(self):
        super().__init__(16)

    def forward(self, x):  # (B, L, 8): neighbours concatenated, the batch dim padded by nothing
        ahead = F.pad(x[:, 1:], (0, 0, 0, 1, 0, 0))
        behind = F.pad(x[:, :-1], (0, 0, 1, 0))
        return self.head(torch.cat([ahead, behind], dim=2)) + x.repeat(1, 1, 2)


class ReshapeAs(_Head):
    def __init__(self):
        super().__init__(8)

    def forward(self, x):  # (B, 2, 4)
        y = self.head(x.reshape(x.shape[0], -1))
        return y.reshape_as(x) + y.view_as(x) * 2


class Conversions(_Head):
    def __init__(self):
        super().__init__(8)

    def forward(self, x):  # (B, L, 8)
        z = torch.zeros(x.shape[0], x.shape[1]).to(x)
        w = torch.ones(x.size(0), 8).to(x.device)
        h = self.head(x).double().to(x.dtype) + x.float() + x.to(torch.float32)
        return h + z[..., None] + w[:, None, :].to(x.dtype)


class Norms(_Head):
    def __init__(self):
        super().__init__(8)

    def forward(self, x):  # (B, L, 8)
        h = self.head(x)
        return (
            h / h.norm(dim=-1, keepdim=True)
            + torch.norm(h, p=2, dim=-1, keepdim=True)
            + torch.linalg.vector_norm(h, dim=(1, 2))[:, None, None]
        )


class Unfold(_Head):
    def __init__(self):
        super().__init__(8)

    def forward(self, x):  # (B, L, 8): windows along the sequence, and im2col
        h = self.head(x)
        return h.unfold(1, 2, 1).sum((1, 3)) + F.unfold(h[:, None], kernel_size=(2, 1)).sum((1, 2))[:, None]


class Argsort(_Head):
    def __init__(self):
        super().__init__(8)

    def forward(self, x):  # (B, L, 8)
        h = self.head(x)
        order = torch.argsort(h, dim=-1)
        return torch.gather(h, -1, order) + h.argsort(dim=1, descending=True).to(h.dtype)


class Baddbmm(_Head):
    def __init__(self):
        super().__init__(5)
        self.register_buffer("bias", torch.randn(1, 5, 5))

    def forward(self, x):  # (B, 5, 5): a bias broadcast over the batch, and a split one
        h = self.head(x)
        return torch.baddbmm(self.bias, h, h.transpose(1, 2), alpha=0.5) + x.baddbmm(h, h)


class SequenceFirstEinsum(_Head):
    def __init__(self):
        super().__init__(8)

    def forward(self, x):  # (B, L, D), attention written on (L, B, D)
        t = self.head(x).transpose(0, 1)
        scores = torch.einsum("lbd,mbd->blm", t, t).softmax(-1)
        return torch.einsum("blm,mbd->lbd", scores, t).transpose(0, 1)


class BatchProducts(_Head):
    def __init__(self):
        super().__init__(4)

    def forward(self, x):  # (B, 8, 4)
        n = x.size(0) * 2
        y = self.head(x.reshape(n, 4, 4))
        z = torch.zeros(n, 4, 4).to(x) + y
        return z.reshape(n // 2, 8, 4) + y.reshape(x.shape[0] + 0, -1, 4)


class Windows(_Head):
    """Swin's window partition (``view(-1, ws, ws, C)``, ``B * nW`` rows) and reverse."""

    def __init__(self):
        super().__init__(3)

    def forward(self, x):  # (B, H, W, C)
        B, H, W, C = x.shape
        ws = 2
        w = x.view(B, H // ws, ws, W // ws, ws, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws, ws, C)
        w = self.head(w).view(B * (H // ws) * (W // ws), ws * ws, C)
        w = w.view(-1, H // ws, W // ws, ws, ws, C).permute(0, 1, 3, 2, 4, 5)
        return w.reshape(B, H, W, C)


class HeadsInBatch(_Head):
    def __init__(self):
        super().__init__(8)

    def forward(self, x):  # (B, L, 8), heads folded into the batch for bmm
        B, L, D = x.shape
        q = self.head(x).view(B, L, 2, 4).transpose(1, 2).reshape(B * 2, L, 4)
        a = torch.bmm(q, q.transpose(1, 2)).softmax(-1)
        return torch.bmm(a, q).view(B, 2, L, 4).transpose(1, 2).reshape(B, L, D)


class FramesInBatch(nn.Module):
    """A video model's per-frame convolution: frames folded into the batch and back."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):  # (B, T, C, H, W)
        B, T = x.shape[0], x.shape[1]
        y = self.conv(x.reshape(B * T, x.shape[2], x.shape[3], x.shape[4]))
        y = y.view(B, T, y.shape[1], y.shape[2], y.shape[3])
        return y.mean((2, 3, 4)) + self.conv(x.flatten(0, 1)).reshape(B, T, -1).mean(-1)


CASES = {
    "tensor_split": (TensorSplit, (7, 4)),
    "pad_slice": (PadSlice, (5, 8)),
    "reshape_as": (ReshapeAs, (2, 4)),
    "conversions": (Conversions, (6, 8)),
    "norm": (Norms, (6, 8)),
    "unfold": (Unfold, (6, 8)),
    "argsort": (Argsort, (6, 8)),
    "baddbmm": (Baddbmm, (5, 5)),
    "einsum_batch_on_dim1": (SequenceFirstEinsum, (6, 8)),
    "batch_products": (BatchProducts, (8, 4)),
    "windows": (Windows, (4, 4, 3)),
    "heads_in_batch": (HeadsInBatch, (6, 8)),
    "frames_in_batch": (FramesInBatch, (3, 3, 5, 5)),
}


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_construct_runs_split_and_equals_eager(name, frontend):
    """Forward and every gradient equal eager on uneven chunks; nothing runs whole (not even a
    size recomputed on the gathered batch), and every FLOP runs split."""
    assert_runs_split_like_eager(*CASES[name], frontend)
