"""What a pipeline program calls between its stages."""

from __future__ import annotations

from typing import Any

import torch

from dpcompile.runtime.comm import DeviceLike, as_device, to_device


def send(value: Any, device: DeviceLike) -> Any:
    """``value`` (any structure) sent to the stage on ``device``: a differentiable device-to-device
    copy (free on a virtual device). A ``torch.device`` read in an earlier stage (``x.device``,
    which code later passes to ``torch.arange(..., device=)``) arrives as ``device``: on one
    device there was only one."""
    device = as_device(device)
    if isinstance(value, torch.device):
        return device
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.device) for v in value):
        value = type(value)(device if isinstance(v, torch.device) else v for v in value)
    return to_device(value, device)


def partial_pair(partial_sum: torch.Tensor, count: torch.Tensor | int | float) -> tuple[torch.Tensor, torch.Tensor]:
    """A mean's partial sum and count as two ``(1,)`` tensors, which a pipeline schedule
    concatenates over micro-batches (``sum(sums) / sum(counts)``: the whole batch's mean)."""
    count = torch.as_tensor(count, dtype=partial_sum.dtype, device=partial_sum.device)
    return partial_sum.reshape(1), count.reshape(1).detach()


__all__ = ["partial_pair", "send"]
