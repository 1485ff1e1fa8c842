"""Constructs of real models that used to run whole: each runs split and equals eager.

One toy per construct, on a batch of 5 over 2 virtual devices (chunks of 3 and 2): forward and
every gradient against eager, and ``explain`` finds nothing running whole. The fx frontend is
given example inputs (shapes decide what a negative dim names); the export frontend is run on
the constructs it spells differently.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from tests.helpers import assert_weighted_gradients_equal
from tests.thirdparty import import_or_skip


class SDPA(nn.Module):
    """F.scaled_dot_product_attention, which the fx frontend keeps as the function."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.o = nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(x.shape[0], x.shape[1], 8))


class TopK(nn.Module):
    def __init__(self):
        super().__init__()
        self.r = nn.Linear(8, 4)
        self.e = nn.Linear(8, 8)

    def forward(self, x):
        w, idx = torch.topk(F.softmax(self.r(x), -1), 2, dim=-1)
        return self.e(x) * w.sum(-1, keepdim=True) + idx.float().sum(-1, keepdim=True)


class Inplace(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h = F.silu(h).mul_(2)
        return self.b(h.relu_())


class StepSlice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        x1, x2 = h[..., ::2], h[..., 1::2]
        return torch.cat([-x2, x1], -1) + h


class ZerosBool(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        m = torch.zeros(x.shape[:2]).to(torch.bool)
        return self.a(x).masked_fill(m[..., None], 0.0)


class WeightLeft(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 8))
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return (self.w @ self.a(x).transpose(1, 2)).sum(1)


class RepeatPos(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Embedding(10, 8)
        self.register_buffer("pos", torch.arange(6)[None])

    def forward(self, x):
        pos = self.pos.repeat(x.shape[0], 1)
        return x + self.p(pos)


class GatherBuf(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("tab", torch.randn(6, 8))
        self.a = nn.Linear(8, 8)

    def forward(self, x, i):
        g = torch.gather(self.tab.expand(x.shape[0], -1, -1), 1, i[..., None].expand(-1, -1, 8))
        return self.a(x) + g


class PadSlice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return F.pad(h[:, 1:], (0, 0, 0, 1)) + h


class NewOnes(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        m = x.new_ones(x.shape[0], x.shape[1])
        return self.a(x) * m[..., None]


class BatchProd(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        b, t, d = x.shape
        return self.a(x.reshape(b * t, d)).view(b, t, d)


def _inputs(name: str, b: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(b)
    x = torch.randn(b, 6, 8, generator=g)
    if name == "gather_buffer":
        return (x, torch.randint(0, 6, (b, 6), generator=g))
    return (x,)


def _conv1d() -> nn.Module:
    import_or_skip("transformers")
    from transformers.pytorch_utils import Conv1D

    class TransformersConv1D(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = Conv1D(16, 8)
            self.d = Conv1D(8, 16)

        def forward(self, x):
            return self.d(F.gelu(self.c(x)))

    return TransformersConv1D()


CASES = {
    "sdpa": SDPA,
    "conv1d": _conv1d,
    "topk_router": TopK,
    "inplace_activation": Inplace,
    "step_slice": StepSlice,
    "zeros_to_bool": ZerosBool,
    "weight_on_the_left": WeightLeft,
    "repeat_positions": RepeatPos,
    "gather_buffer": GatherBuf,
    "pad_of_slice": PadSlice,
    "new_ones_mask": NewOnes,
    "batch_size_product": BatchProd,
}
RUNS = [(name, "fx") for name in CASES] + [
    (name, "export") for name in ("conv1d", "topk_router", "gather_buffer", "batch_size_product", "inplace_activation")
]


@pytest.mark.parametrize(("name", "frontend"), RUNS)
def test_construct_runs_split_and_equals_eager(name, frontend):
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
    assert report.split_flop_fraction in (None, 1.0)
    assert [w for w in report.whole if not w["reason"].startswith("recomputed")] == []


class MaskPassedThrough(nn.Module):
    """timm's ViT: ``forward(x, attn_mask=None)`` hands the mask to SDPA without branching on it."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.o = nn.Linear(8, 8)

    def forward(self, x, attn_mask=None):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.o(a.transpose(1, 2).reshape(b, t, 8))


@pytest.mark.parametrize("training", [False, True])
def test_optional_argument_the_examples_leave_out_is_traced_as_none(training):
    """The program serves calls without the mask, all split; a call with a per-sample mask is
    traced again and equals eager; a (L, S) mask no example gave is refused, naming the argument."""
    torch.manual_seed(0)
    model = MaskPassedThrough().train(training)
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 3, example_inputs=(torch.randn(4, 6, 8),))
    x = torch.randn(5, 6, 8)
    assert pm.program_cache.main_key.none_args == frozenset({"attn_mask"})
    report = dpcompile.explain(pm, x)
    assert report.split_flop_fraction == 1.0
    assert report.whole == []
    per_sample = torch.randn(5, 1, 6, 6)
    for kwargs in ({}, {"attn_mask": per_sample}):
        model.zero_grad()
        eager.zero_grad()
        out, expected = pm(x, **kwargs), eager(x, **kwargs)
        torch.testing.assert_close(out, expected)
        weights = torch.linspace(0.5, 1.5, out.numel()).view(out.shape)
        (out * weights).sum().backward()
        (expected * weights).sum().backward()
        grads = dict(eager.named_parameters())
        for key, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[key].grad, msg=lambda m, key=key: f"{key}: {m}")
    with pytest.raises(ValueError, match="'attn_mask' has batch size 6 on dim 0"):
        pm(x, attn_mask=torch.randn(6, 6))


def test_optional_argument_given_by_the_examples_is_traced_with_it():
    """A (L, S) mask in the examples is replicated: the program serves it split, and equals eager
    for it and for a call without it."""
    torch.manual_seed(0)
    model = MaskPassedThrough().eval()
    square = torch.randn(6, 6)
    pm = dpcompile.transform(model, ["cpu"] * 3, example_inputs=(torch.randn(4, 6, 8), square))
    x = torch.randn(5, 6, 8)
    assert dpcompile.explain(pm, x, square).split_flop_fraction == 1.0
    torch.testing.assert_close(pm(x, square), model(x, square))
    torch.testing.assert_close(pm(x), model(x))
