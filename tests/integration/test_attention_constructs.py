"""Attention constructs of transformers decoders that used to run whole: each runs split and equals eager.

BLOOM's ALiBi (a bias built from the attention mask, folded with the heads into a ``B*H``
leading dim and added by ``baddbmm``), Gemma 2's sliding-window mask (``x.new_ones(())`` of a
split tensor: a scalar that carries no batch), and Falcon's fused heads (``qkv[:, :, [-2]]``:
integer indices on dims other than the batch, then ``broadcast_to``). One toy per construct, on a batch of 5 over
2 virtual devices (chunks of 3 and 2), both frontends: forward and every gradient against
eager, and ``explain`` finds nothing running whole.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dpcompile
from tests.helpers import assert_weighted_gradients_equal

H = 2  # heads


class Alibi(nn.Module):
    """BLOOM's attention: ALiBi from the mask's cumsum, scores by ``baddbmm`` over ``B*H``."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.o = nn.Linear(8, 8)
        self.register_buffer("slopes", torch.tensor([0.5, 0.25]))

    def forward(self, x, mask):
        b, t, _ = x.shape
        positions = ((mask.cumsum(dim=-1) - 1) * mask)[:, None, :]
        alibi = (self.slopes[..., None] * positions).reshape(b * H, 1, t)
        q, k, v = self.qkv(x).view(b, t, 3, H, 4).permute(2, 0, 3, 1, 4)
        q, k, v = q.reshape(b * H, t, 4), k.reshape(b * H, t, 4), v.reshape(b * H, t, 4)
        scores = alibi.baddbmm(batch1=q, batch2=k.transpose(-1, -2), beta=1.0, alpha=0.5)
        scores = scores.view(b, H, t, t) + (1.0 - mask[:, None, None, :].float()) * -1e4
        probs = scores.softmax(-1).view(b * H, t, t)
        context = torch.bmm(probs, v).view(b, H, t, 4).permute(0, 2, 1, 3).reshape(b, t, 8)
        return self.o(context)


class ScalarNewOnes(nn.Module):
    """Gemma 2's mask functions: ``h.new_ones(())`` of a split ``h`` and'ed with a mask of it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        keep = h.new_ones((), dtype=torch.bool) & (h > 0)
        return self.b(h.masked_fill(~keep, 0.0))


class FusedHeads(nn.Module):
    """Falcon's multi-query split: ``qkv[:, :, :-2]``, ``qkv[:, :, [-2]]`` broadcast to the query's
    shape, ``qkv[:, :, [-1]]``."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 16)
        self.o = nn.Linear(8, 8)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, H + 2, 4)
        q, k, v = qkv[:, :, :-2], qkv[:, :, [-2]], qkv[:, :, [-1]]
        k = torch.broadcast_to(k, q.shape)
        scores = (q.transpose(1, 2) @ k.permute(0, 2, 3, 1)).softmax(-1)
        context = scores @ v.transpose(1, 2)
        return self.o(context.transpose(1, 2).reshape(b, t, 8))


class ApartIndices(nn.Module):
    """Indices on two dims apart (``h[:, i, :, [1, 3, 0]]``, buffers and lists): their result dim goes first."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.o = nn.Linear(6, 8)
        self.register_buffer("i", torch.tensor([0, 5, 2]))

    def forward(self, x):
        b, t, _ = x.shape
        h = self.a(x).view(b, t, 4, 4)
        h = h[:, self.i, :, [1, 3, 0]] + h[:, [1, 0, 4], :, [2, 2, 3]]  # (3, b, 4)
        return self.o(h.permute(1, 2, 0).reshape(b, 4, 3).repeat(1, 1, 2))


def _inputs(name: str, b: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(b)
    x = torch.randn(b, 6, 8, generator=g)
    if name == "alibi":
        mask = torch.ones(b, 6, dtype=torch.long)
        mask[0, 4:] = 0
        mask[-1, 2:] = 0
        return (x, mask)
    return (x,)


CASES = {"alibi": Alibi, "scalar_new_ones": ScalarNewOnes, "fused_heads": FusedHeads, "apart_indices": ApartIndices}


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_construct_runs_split_and_equals_eager(name, frontend):
    """Forward and every gradient equal eager on uneven chunks, and nothing runs whole."""
    torch.manual_seed(0)
    model = CASES[name]()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend=frontend, example_inputs=_inputs(name, 4))
    inputs = _inputs(name, 5)
    out, expected = pm(*inputs), eager(*inputs)
    torch.testing.assert_close(out, expected)
    assert_weighted_gradients_equal(model, eager, out, expected)
    report = dpcompile.explain(pm, *inputs)
    assert report.split_flop_fraction == 1.0
    assert [w for w in report.whole if not w["reason"].startswith("recomputed")] == []
