"""Batch norm over chunks rounds as ATen's single-device kernel does: judged against float64."""

import copy

import pytest
import torch
from torch import nn

from dpcompile.runtime.batchnorm import batch_norm


def _grads(
    bn: nn.BatchNorm2d, x: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype, split: bool
) -> list[torch.Tensor]:
    bn = copy.deepcopy(bn).to(dtype)
    x = x.detach().to(dtype).clone().requires_grad_()
    y = torch.cat(batch_norm(bn, x.split([3, 3, 1]))) if split else bn(x)
    (y * weights.to(dtype)).sum().backward()
    return [x.grad.double(), bn.weight.grad.double(), bn.bias.grad.double()]


def _rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt())


def test_gradients_over_chunks_are_as_close_to_float64_as_the_single_device_kernel():
    """A late, small feature map (4 values per channel) whose values barely vary: the per-channel
    sums cancel, and autograd through the statistics rounded 2.5 times farther than ATen."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(64).train()
    x = torch.randn(7, 64, 2, 2) * 0.01 + torch.randn(1, 64, 1, 1)
    weights = torch.randn(7, 64, 2, 2)
    reference = _grads(bn, x, weights, torch.float64, split=False)
    ours = _grads(bn, x, weights, torch.float32, split=True)
    eager = _grads(bn, x, weights, torch.float32, split=False)
    for name, o, e, r in zip(("input", "weight", "bias"), ours, eager, reference):
        assert _rms(o, r) <= 1.5 * _rms(e, r) + 1e-7, name
    for o, r in zip(_grads(bn, x, weights, torch.float64, split=True), reference):
        torch.testing.assert_close(o, r, rtol=1e-10, atol=1e-10)


def test_second_derivative_through_chunked_batch_norm_is_refused():
    bn = nn.BatchNorm1d(4).train()
    x = torch.randn(6, 4, requires_grad=True)
    y = torch.cat(batch_norm(bn, x.split([3, 3])))
    (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        g.sum().backward()
