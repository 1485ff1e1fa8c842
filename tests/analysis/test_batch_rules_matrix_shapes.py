"""Rules for matrix ops (addmm, bmm, baddbmm, einsum), shape arithmetic on ``x.size()`` slices,
masks built from input shapes, unfold/roll: a model per rule, split with no op whole, exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dpcompile


class Conv1D(torch.nn.Module):
    """GPT-2's Conv1D: ``addmm`` on the rows of a flattened ``(B, T, D)``."""

    def __init__(self, nx: int = 8, nf: int = 12):
        super().__init__()
        self.nf = nf
        self.weight = torch.nn.Parameter(torch.randn(nx, nf))
        self.bias = torch.nn.Parameter(torch.randn(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class Attention(torch.nn.Module):
    """bmm / baddbmm / einsum attention with a padding mask built from the input's shape."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = torch.baddbmm(torch.zeros(b, t, t), q, k.transpose(1, 2)) / d**0.5
        mask = torch.ones(x.shape[:2]).bool()[:, None, :]
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.bmm(scores.softmax(-1), v)
        return torch.einsum("btd,de->bte", out, self.qkv.weight[:d, :d]) + torch.einsum("btd,btd->bt", out, v)[..., None]


class Windows(torch.nn.Module):
    """Swin-style cyclic shift and window partitioning, sliding windows with unfold."""

    def forward(self, x):  # (B, H, W, C)
        x = torch.roll(x, shifts=(-1, -1), dims=(1, 2))
        b, h, w, c = x.shape
        windows = x.view(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 2 * 2, c)
        patches = F.unfold(x.permute(0, 3, 1, 2), kernel_size=2).sum(-1)
        return windows.sum(1).view(b, -1).sum(-1) + patches.sum(-1) + x.unfold(1, 2, 1).sum((1, 2, 3, 4))


@pytest.mark.parametrize(
    "make",
    [lambda: (Conv1D(), torch.randn(5, 3, 8)), lambda: (Attention(), torch.randn(5, 4, 8)), lambda: (Windows(), torch.randn(5, 4, 4, 3))],
    ids=["addmm_size_slices", "bmm_baddbmm_einsum_mask", "roll_windows_unfold"],
)
@pytest.mark.parametrize("shapes", [True, False], ids=["example_inputs", "no_examples"])
def test_batch_rules_model_runs_split_exact(make, shapes):
    """No op runs whole; outputs and gradients match eager."""
    model, x = make()
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,) if shapes else None)
    whole = dpcompile.explain(pm, x).whole
    if shapes or isinstance(model, Attention):  # without shapes, x.size()[:-1] of an input may be () and
        # a window partition view may pair rows of samples: they run whole (see docs/data_parallel.md)
        assert whole == [], whole
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.testing.assert_close(pm(x1), model(x2))
    pm(x1).sum().backward()
    model(x2).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
