"""Combine per-device partial results into the single-device value."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dpcompile.runtime.comm import DeviceLike


def reduce_add(partials: Sequence[torch.Tensor], device: DeviceLike) -> torch.Tensor:
    """The sum of per-device partial sums, on ``device`` (Python numbers, an exported loss's element
    counts, summed as numbers)."""
    if not any(isinstance(p, torch.Tensor) for p in partials):
        return sum(partials)  # type: ignore[return-value]
    device = torch.device(device)
    total = partials[0].to(device)
    for p in partials[1:]:
        total = total + p.to(device)
    return total


def mean_of_partials(
    partial_sums: Sequence[torch.Tensor], counts: Sequence[torch.Tensor | int | float], device: DeviceLike
) -> torch.Tensor:
    """``sum(partial_sums) / sum(counts)``: the mean over the whole batch, exact for uneven splits."""
    total = reduce_add(partial_sums, device)
    denominator = sum(c.to(total.device) if isinstance(c, torch.Tensor) else c for c in counts)
    mean = total / denominator
    if total.is_floating_point() and mean.dtype != total.dtype:  # a float16 loss stays float16, as on one device
        mean = mean.to(total.dtype)
    return mean


def numel(x: torch.Tensor) -> int:
    """How many elements a mean over ``x`` divides by."""
    return x.numel()


def numel_over(x: torch.Tensor, dims: Sequence[int] | int) -> int:
    """How many elements a mean over ``dims`` of ``x`` divides by."""
    dims = [dims] if isinstance(dims, int) else list(dims)
    n = 1
    for d in dims:
        n *= x.size(d)
    return n


def target_weight(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """The denominator of ``cross_entropy`` / ``nll_loss`` with ``reduction='mean'``.

    The count of targets not equal to ``ignore_index``, each weighted by ``weight[target]``.
    Class-probability targets (floating point) count one per sample.
    """
    if target.is_floating_point():
        n = target.numel() // target.size(1) if target.dim() > 1 else 1
        return torch.tensor(float(n), device=target.device)
    valid = target != ignore_index
    if weight is None:
        return valid.sum().to(torch.get_default_dtype())
    safe = torch.where(valid, target, torch.zeros_like(target))
    return (weight.to(target.device)[safe] * valid).sum()


def max_length(lengths: torch.Tensor | list[int]) -> int:
    """The longest sequence of a batch: what ``pad_packed_sequence`` pads the whole batch to."""
    if isinstance(lengths, torch.Tensor):
        return int(lengths.max())
    return int(max(lengths))
