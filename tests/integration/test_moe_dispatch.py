"""A mixture-of-experts token dispatch (sort by expert, grouped matmul, unsort) runs split per device.

The model reproduces transformers' grouped experts (``grouped_mm_experts_forward``): each device
sorts its own tokens (``batch_rules.local_order``). Batches of 5 over 3 virtual devices (chunks
2, 2, 1) against eager: outputs, and in training every gradient. Where a device-local order would
be read whole (returned, or its positions used as numbers) the sort runs whole instead.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile


@torch.library.custom_op("dpcompile_tests::grouped_mm", mutates_args=())
def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[g-1]:offs[g]`` of ``input`` times ``weight[g]`` (transformers' ``grouped_mm_fallback``)."""
    out = input.new_zeros(input.shape[0], weight.shape[2])
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = input[start:end] @ weight[g]
        start = end
    return out


@grouped_mm.register_fake
def _(input, weight, offs):
    return input.new_empty(input.shape[0], weight.shape[2])


def _backward(ctx, grad):
    input, weight = ctx.saved_tensors
    grad_input, grad_weight = torch.zeros_like(input), torch.zeros_like(weight)
    start = 0
    for g, end in enumerate(ctx.offs.tolist()):
        grad_input[start:end] = grad[start:end] @ weight[g].T
        grad_weight[g] = input[start:end].T @ grad[start:end]
        start = end
    return grad_input, grad_weight, None


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]


grouped_mm.register_autograd(_backward, setup_context=_setup)


class SortedExperts(nn.Module):
    """Top-2 routing over 4 experts; tokens sorted by expert, one grouped matmul per projection."""

    def __init__(self, leak: str | None = None, descending: bool = False):
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.router = nn.Linear(8, 4, bias=False)
        self.gate_up = nn.Parameter(torch.randn(4, 8, 16) * 0.3)
        self.down = nn.Parameter(torch.randn(4, 8, 8) * 0.3)
        self.out = nn.Linear(8, 3)
        self.leak, self.descending = leak, descending

    def forward(self, x):
        b, t, _ = x.shape
        h = self.emb(x)
        flat = h.view(-1, h.shape[-1])
        weights, index = torch.topk(self.router(flat).softmax(-1), 2, dim=-1)
        weights /= weights.sum(-1, keepdim=True)
        ids, perm = torch.sort(index.reshape(-1), descending=self.descending)
        rows = flat[perm // 2]
        offsets = torch.cumsum(torch.histc(ids.float(), bins=4, min=0, max=3), dim=0, dtype=torch.int32)
        gate, up = grouped_mm(rows, self.gate_up, offsets).chunk(2, dim=-1)
        y = grouped_mm(F.silu(gate) * up, self.down, offsets) * weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.size(0), device=perm.device)
        moe = y[inverse].view(b * t, 2, -1).sum(1).view(b, t, -1)
        out = self.out(h + moe)
        if self.leak == "sorted ids":
            return out, ids
        if self.leak == "positions as numbers":
            return out + perm.float().mean()
        return out


class BatchedExperts(nn.Module):
    """transformers' ``batched_mm`` experts: every token repeated top-k times, each row times the
    weights of its expert (``W[ids]``), one batched matmul."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.router = nn.Linear(8, 4, bias=False)
        self.up = nn.Parameter(torch.randn(4, 8, 8) * 0.3)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        b, t, _ = x.shape
        flat = self.emb(x).view(-1, 8)
        weights, index = torch.topk(self.router(flat).softmax(-1), 2, dim=-1)
        rows = flat.repeat_interleave(2, dim=0)
        y = torch.bmm(self.up[index.reshape(-1)], rows.unsqueeze(-1)).squeeze(-1) * weights.reshape(-1, 1)
        return self.out(y.view(b * t, 2, 8).sum(1).view(b, t, 8))


def _run(model: nn.Module, training: bool) -> tuple[Any, list[str]]:
    torch.manual_seed(0)
    eager = copy.deepcopy(model)
    model.train(training)
    eager.train(training)
    pm = dpcompile.transform(model, ["cpu"] * 3, frontend="export", example_inputs=(torch.randn(4, 3, 4),))
    x = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(5))
    ours, theirs = pm(x), eager(x)
    ours, theirs = (ours, theirs) if isinstance(ours, tuple) else ((ours,), (theirs,))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)
    if training:
        r = torch.randn(ours[0].shape, generator=torch.Generator().manual_seed(1))
        (ours[0] * r).sum().backward()
        (theirs[0] * r).sum().backward()
        grads = dict(eager.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, msg=lambda m, name=name: f"{name}: {m}")
    explanation = dpcompile.explain(pm, x)
    return explanation, [w["node"] for w in explanation.whole]


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_sorted_expert_dispatch_runs_split_and_equals_eager(training):
    """Each device sorts, groups and unsorts its own tokens: nothing runs whole, a device with one sample included."""
    explanation, whole = _run(SortedExperts(), training)
    assert whole == []
    assert explanation.split_flop_fraction == 1.0


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_batched_expert_weights_per_token_run_split(training):
    """``repeat_interleave`` of the tokens and a replicated table indexed by split ids run per device."""
    _, whole = _run(BatchedExperts(), training)
    assert whole == []


@pytest.mark.parametrize("leak", ["sorted ids", "positions as numbers"])
def test_a_device_local_order_read_whole_makes_the_sort_run_whole(leak):
    """Sorted values returned, or positions used as numbers, would show the device's own order:
    the sort runs on the gathered batch, and the results equal eager."""
    _, whole = _run(SortedExperts(leak=leak), training=False)
    assert "sort" in whole


def test_groups_of_a_descending_sort_are_not_taken_for_the_experts():
    """``histc`` offsets describe ascending groups; after a descending sort they do not: it runs whole."""
    _, whole = _run(SortedExperts(descending=True), training=False)
    assert "sort" in whole
