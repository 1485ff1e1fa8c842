"""Values made from the batch size and writes into tensors, split over uneven chunks, both frontends.

Each model is run on a batch of 5 over 2 virtual devices (chunks of 3 and 2), against eager, and
checked to run split (``explain(...).whole`` empty).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile.runtime import batch_arange, local_positions, written


class LastTokenPool(nn.Module):
    """``h[arange(b), last]``: the pooling of CLIP's text model and of ``*ForSequenceClassification``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, ids):
        h = self.emb(ids)
        last = (ids != 0).sum(-1) - 1
        return self.fc(h[torch.arange(h.shape[0], device=h.device), last])


class ArangeValues(nn.Module):
    """``arange(b)`` used as values, not as an index: it must gather to ``arange(B)``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        positions = torch.arange(x.shape[0], device=x.device)
        return self.fc(x) * positions[:, None], positions


class ShiftTokensRight(nn.Module):
    """transformers' ``shift_tokens_right``: a tensor from the input's shape, written through slices."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)

    def forward(self, labels):
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1].clone()
        shifted[:, 0] = 2
        shifted.masked_fill_(shifted == -100, 1)
        return self.emb(shifted).sum(-1)


class Writes(nn.Module):
    """In-place activations, ``copy_``/``fill_`` through a view, and a masked write on split values."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = F.silu(self.fc(x), inplace=True)
        h = h.relu_()
        z = torch.zeros_like(h)
        z[:, :2].copy_(h[:, 2:])
        z[:, 3].fill_(0.5)
        z[z > 1.0] = 1.0
        return self.out(h + z)


class ContrastiveLoss(nn.Module):
    """``cross_entropy(a @ b.T, arange(B))``: labels are positions in the whole batch."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x, y):
        logits = self.a(x) @ self.b(y).T
        return F.cross_entropy(logits, torch.arange(x.shape[0], device=x.device))


def _ids(b: int) -> torch.Tensor:
    ids = torch.randint(1, 20, (b, 6), generator=torch.Generator().manual_seed(b))
    ids[0, 4:] = 0
    ids[-1, 2:] = 0
    return ids


CASES = {
    "last_token_pool": (LastTokenPool, lambda b: (_ids(b),), True),
    "arange_values": (ArangeValues, lambda b: (torch.randn(b, 4),), True),
    "shift_tokens_right": (ShiftTokensRight, lambda b: (_ids(b).masked_fill(_ids(b) == 0, -100),), True),
    "writes": (Writes, lambda b: (torch.randn(b, 4),), True),
    "contrastive_loss": (ContrastiveLoss, lambda b: (torch.randn(b, 8), torch.randn(b, 8)), False),
}


def _flat(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_batch_values_equal_eager_on_uneven_chunks(name, frontend):
    """Forward and every gradient equal eager on a batch of 5 over 2 devices; it runs split where it can."""
    cls, make, runs_split = CASES[name]
    torch.manual_seed(0)
    model = cls()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend=frontend, example_inputs=make(4))
    inputs = make(5)
    ours, theirs = _flat(pm(*inputs)), _flat(eager(*inputs))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)
    sum(o.float().sum() for o in ours if o.is_floating_point()).backward()
    sum(o.float().sum() for o in theirs if o.is_floating_point()).backward()
    grads = dict(eager.named_parameters())
    for key, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[key].grad, msg=lambda m, key=key: f"{key}: {m}")
    if runs_split:
        assert dpcompile.explain(pm, *inputs).whole == []


def test_batch_arange_holds_the_positions_of_the_device_rows():
    """Device 1 of a batch of 5 split 3/2 holds positions [3, 4], and reads them as its rows 0, 1."""
    assert batch_arange([3, 2], 1).tolist() == [3, 4]
    assert batch_arange([3, 2], 0).tolist() == [0, 1, 2]
    assert local_positions(torch.tensor([3, 4]), [3, 2], 1).tolist() == [0, 1]


def test_written_leaves_its_input_alone():
    """``written`` returns the written copy and leaves the tensor it was given as it was."""
    base = torch.zeros(2, 3)
    out = written(base, [("__getitem__", ((slice(None), slice(1, None)),))], "fill_", 4.0)
    assert out.tolist() == [[0.0, 4.0, 4.0], [0.0, 4.0, 4.0]]
    assert base.abs().sum() == 0


def test_arange_gathers_to_the_whole_batch_positions():
    """An ``arange(b)`` returned from forward is ``arange(B)``, not each chunk's local ``0..b-1``."""
    pm = dpcompile.transform(ArangeValues(), ["cpu"] * 2, frontend="export", example_inputs=(torch.randn(4, 4),))
    assert pm(torch.randn(5, 4))[1].tolist() == [0, 1, 2, 3, 4]
