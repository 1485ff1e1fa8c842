"""FSDP's gather in one process: a parameter stored as pieces, read whole (a parametrization), and
saved for backward as how to gather it again (:func:`regathered`). See :mod:`dpcompile.modules.fsdp_one_process`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from dpcompile.runtime.tensor_parallel import ShardSpec, shard_of, unshard


class GatherShards(nn.Module):
    """``weight = cat(pieces moved to device)``: the whole parameter a call reads; its gradient
    flows back into each piece."""

    #: a program traced from the sharded model reads the parameter (``get_attr``), not this gather's call
    #: (``dpcompile.capture.fx``): the same program whether its pieces exist (here) or not (export)
    reads_as_the_parameter = True

    def __init__(self, spec: ShardSpec, piece_devices: Sequence[str], device: str):
        super().__init__()
        self.spec, self.piece_devices, self.device = spec, tuple(piece_devices), device

    def forward(self, *pieces: torch.Tensor) -> torch.Tensor:
        whole = unshard(pieces, self.spec, self.device)
        GATHERED[whole] = (self, pieces)  # backward gathers it again instead of keeping it (see regathered)
        return whole

    def right_inverse(self, whole: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(shard_of(whole.detach(), self.spec, r).to(d).clone() for r, d in enumerate(self.piece_devices))


#: each whole parameter a gather made and autograd may save: ``{tensor: (its gather, its pieces)}``
GATHERED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _pack(t: torch.Tensor) -> Any:
    """Autograd saves a gathered parameter (or a view of one, ``weight.t()``) as how to gather it."""
    found = GATHERED.get(t if t._base is None else t._base)
    if found is None:
        return t
    return (*found, t.size(), t.stride(), t.storage_offset())


def _unpack(saved: Any) -> torch.Tensor:
    if isinstance(saved, torch.Tensor):
        return saved
    gather, pieces, size, stride, offset = saved
    with torch.no_grad():
        whole = unshard([p.detach() for p in pieces], gather.spec, gather.device)
    return whole.as_strided(size, stride, offset)


def regathered() -> Any:
    """Within a call: a whole parameter autograd saves for backward is freed after forward and
    gathered again where backward needs it (ZeRO-3's second all-gather), not kept for the step."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


__all__ = ["GATHERED", "GatherShards", "regathered"]
