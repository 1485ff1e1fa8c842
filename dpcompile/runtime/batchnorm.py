"""BatchNorm over a batch split across devices, with single-device semantics.

In training mode the statistics are those of the whole batch (per-device sums combined, as
SyncBatchNorm does) and the running statistics are updated once; in eval mode each chunk is
normalised with the running statistics. Everything is written in differentiable tensor ops,
so autograd gives exactly the gradients of the single-device module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

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
    home = chunks[0].device
    dtype = chunks[0].dtype
    if dtype in _LOW_PRECISION:  # statistics accumulate in float32, as cuDNN's and ATen's kernels do
        chunks = [x.float() for x in chunks]
    dims = [d for d in range(chunks[0].dim()) if d != 1]
    count = sum(x.numel() // x.size(1) for x in chunks)
    if count <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input of {count} values per channel")
    mean = sum(x.sum(dims).to(home) for x in chunks) / count
    means = [mean.to(x.device) for x in chunks]
    var = sum(((x - m.view(_channel_shape(x))) ** 2).sum(dims).to(home) for x, m in zip(chunks, means)) / count
    invstd = torch.rsqrt(var + bn.eps)
    outputs = []
    for x, m in zip(chunks, means):
        shape = _channel_shape(x)
        y = (x - m.view(shape)) * invstd.to(x.device).view(shape)
        if bn.weight is not None:
            y = y * bn.weight.to(x.device, y.dtype).view(shape)
        if bn.bias is not None:
            y = y + bn.bias.to(x.device, y.dtype).view(shape)
        outputs.append(y.to(dtype))
    if bn.training and bn.track_running_stats:
        _update_running_stats(bn, mean.detach(), var.detach(), count)
    return tuple(outputs)


def _channel_shape(x: torch.Tensor) -> tuple[int, ...]:
    return (1, x.size(1)) + (1,) * (x.dim() - 2)


@torch.no_grad()
def _update_running_stats(bn: nn.modules.batchnorm._BatchNorm, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
    if bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
    if bn.running_mean is None:
        return
    if bn.momentum is None:
        factor = 1.0 / float(bn.num_batches_tracked)
    else:
        factor = bn.momentum
    unbiased = var * (count / (count - 1))
    bn.running_mean.mul_(1 - factor).add_(mean.to(bn.running_mean.device), alpha=factor)
    bn.running_var.mul_(1 - factor).add_(unbiased.to(bn.running_var.device), alpha=factor)


def functional_batch_norm(
    chunks: Sequence[torch.Tensor],
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, ...]:
    """``F.batch_norm(x, running_mean, running_var, weight, bias, training=True, momentum, eps)``
    of the concatenation of ``chunks``, per chunk: statistics of the whole batch, the running
    statistics (if given) updated once with ``momentum`` (timm's ``BatchNormAct2d`` counts its
    own batches)."""
    from types import SimpleNamespace

    state = SimpleNamespace(
        training=True, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias, eps=eps,
        momentum=0.0 if momentum is None else momentum, track_running_stats=running_mean is not None,
        num_batches_tracked=None,
    )  # fmt: skip
    return batch_norm(state, chunks)  # type: ignore[arg-type]
