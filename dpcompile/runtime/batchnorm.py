"""BatchNorm over a batch split across devices, with single-device semantics.

In training mode the statistics are those of the whole batch (per-device sums combined, as
SyncBatchNorm does) and the running statistics are updated once; in eval mode each chunk is
normalised with the running statistics. In training the backward is batch norm's own formula
over every chunk (``_WholeBatchNorm``), its per-channel sums accumulated in float64, so the
gradients round as closely to the float64 values as ATen's single-device kernel does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.function import once_differentiable

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _uses_batch_statistics(bn: nn.modules.batchnorm._BatchNorm) -> bool:
    return bn.training or bn.running_mean is None or bn.running_var is None


def batch_norm(bn: nn.modules.batchnorm._BatchNorm, chunks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``bn`` applied to the concatenation of ``chunks`` (split on dim 0), returned per chunk."""
    if not _uses_batch_statistics(bn):
        return tuple(
            F.batch_norm(
                x,
                bn.running_mean.to(x.device),
                bn.running_var.to(x.device),
                None if bn.weight is None else bn.weight.to(x.device),
                None if bn.bias is None else bn.bias.to(x.device),
                False,
                0.0,
                bn.eps,
            )
            for x in chunks
        )
    dtype = chunks[0].dtype
    if dtype in _LOW_PRECISION:  # statistics accumulate in float32, as cuDNN's and ATen's kernels do
        chunks = [x.float() for x in chunks]
    count = sum(x.numel() // x.size(1) for x in chunks)
    if count <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input of {count} values per channel")
    *outputs, mean, var = _WholeBatchNorm.apply(bn.eps, bn.weight, bn.bias, *chunks)
    outputs = [y.to(dtype) for y in outputs]
    if bn.training and bn.track_running_stats:
        _update_running_stats(bn, mean.detach(), var.detach(), count)
    return tuple(outputs)


def _channel_sum(parts: Sequence[torch.Tensor], dims: list[int], home: torch.device) -> torch.Tensor:
    """Per channel, the sum over every chunk, accumulated in float64 where the device has it
    (the few values per channel of a late, small feature map cancel: ATen's kernel is as exact)."""
    wide = torch.float64 if home.type != "mps" else torch.float32
    return sum(x.sum(dims, dtype=wide).to(home) for x in parts)


class _WholeBatchNorm(torch.autograd.Function):
    """Batch norm of the concatenation of ``chunks`` with the whole batch's statistics, per chunk;
    the backward is batch norm's own (``dx = w * invstd * (dy - mean(dy) - xhat * mean(dy * xhat))``),
    with its per-channel sums over every chunk, rather than autograd through the statistics
    (which rounds ten times farther from float64 than ATen's kernel in a deep network)."""

    @staticmethod
    def forward(ctx: Any, eps: float, weight: torch.Tensor | None, bias: torch.Tensor | None, *chunks: torch.Tensor) -> Any:
        home, dims = chunks[0].device, [d for d in range(chunks[0].dim()) if d != 1]
        count = sum(x.numel() // x.size(1) for x in chunks)
        mean = _channel_sum(chunks, dims, home) / count
        centred = [x - mean.to(x.device, x.dtype).view(_channel_shape(x)) for x in chunks]
        var = _channel_sum([c * c for c in centred], dims, home) / count
        mean, var = mean.to(chunks[0].dtype), var.to(chunks[0].dtype)
        invstd = torch.rsqrt(var + eps)
        scale = invstd if weight is None else invstd * weight.to(home, invstd.dtype)
        outputs = []
        for c in centred:
            y = c * scale.to(c.device).view(_channel_shape(c))
            outputs.append(y if bias is None else y + bias.to(c.device, y.dtype).view(_channel_shape(c)))
        ctx.save_for_backward(invstd, scale, *centred)
        ctx.count, ctx.dims, ctx.home = count, dims, home
        ctx.affine = [None if p is None else (p.device, p.dtype) for p in (weight, bias)]
        ctx.mark_non_differentiable(mean, var)
        return (*outputs, mean, var)

    @staticmethod
    @once_differentiable  # the saved centred chunks do not remember x: a second derivative would be wrong
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        invstd, scale, *centred = ctx.saved_tensors
        dys = [torch.zeros_like(c) if g is None else g for g, c in zip(grads, centred)]
        sum_dy = _channel_sum(dys, ctx.dims, ctx.home).to(invstd.dtype)
        sum_dy_xmu = _channel_sum([dy * c for dy, c in zip(dys, centred)], ctx.dims, ctx.home).to(invstd.dtype)
        mean_dy = sum_dy / ctx.count
        projection = sum_dy_xmu * invstd * invstd / ctx.count
        dxs = []
        for dy, c in zip(dys, centred):
            shape = _channel_shape(c)
            dev = c.device
            dxs.append((dy - mean_dy.to(dev).view(shape) - c * projection.to(dev).view(shape)) * scale.to(dev).view(shape))
        weight, bias = ctx.affine
        grad_weight = None if weight is None else (sum_dy_xmu * invstd).to(*weight)
        grad_bias = None if bias is None else sum_dy.to(*bias)
        return (None, grad_weight, grad_bias, *dxs)


def _channel_shape(x: torch.Tensor) -> tuple[int, ...]:
    return (1, x.size(1)) + (1,) * (x.dim() - 2)


@torch.no_grad()
def _update_running_stats(bn: nn.modules.batchnorm._BatchNorm, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
    if bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
    if bn.running_mean is None:
        return
    if bn.momentum is None and is_fake(mean):  # shapes worked out on fake tensors (a pipeline over a mesh): the
        factor = 0.5  # count has no value under the fake mode, and the factor's value changes no shape
    elif bn.momentum is None:
        factor = 1.0 / float(bn.num_batches_tracked)
    else:
        factor = bn.momentum
    unbiased = var * (count / (count - 1))
    # through .data, as ATen's kernel writes them: the version counter stays, so a checkpointed region
    # given the statistics as an input (timm's BatchNormAct2d calls F.batch_norm) still unpacks them
    bn.running_mean.data.mul_(1 - factor).add_(mean.to(bn.running_mean.device), alpha=factor)
    bn.running_var.data.mul_(1 - factor).add_(unbiased.to(bn.running_var.device), alpha=factor)


def functional_batch_norm(
    chunks: Sequence[torch.Tensor],
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    momentum: float,
    eps: float,
    training: bool = True,
) -> tuple[torch.Tensor, ...]:
    """``F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)``
    of the concatenation of ``chunks``, per chunk: in training, statistics of the whole batch, the
    running statistics (if given) updated once with ``momentum`` (timm's ``BatchNormAct2d`` counts
    its own batches); otherwise (the export frontend reads the module's mode at run time) each chunk
    normalised with the running statistics."""
    from types import SimpleNamespace

    state = SimpleNamespace(
        training=training, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias, eps=eps,
        momentum=0.0 if momentum is None else momentum, track_running_stats=running_mean is not None,
        num_batches_tracked=None,
    )  # fmt: skip
    return batch_norm(state, chunks)  # type: ignore[arg-type]
