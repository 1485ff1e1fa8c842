"""FSDP's gather in one process: a parameter stored as pieces, read whole (a parametrization), and
saved for backward as how to gather it again (:func:`regathered`). See :mod:`dpcompile.modules.fsdp_one_process`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from dpcompile.runtime.structures import is_fake
from dpcompile.runtime.tensor_parallel import ShardSpec, shard_of, unshard


class GatherShards(nn.Module):
    """``weight = cat(pieces moved to device)``: the whole parameter a call reads; its gradient
    flows back into each piece."""

    #: a program traced from the sharded model reads the parameter (``get_attr``), not this gather's call
    #: (``dpcompile.capture.fx``): the same program whether its pieces exist (here) or not (export)
    reads_as_the_parameter = True
    #: a replica of the module on copy r's device reads the pieces themselves and gathers them there
    #: (``dpcompile.runtime.replicate``): its ``device`` is the replica's, never copy 0's
    gathers_on_each_replica = True

    def __init__(self, spec: ShardSpec, piece_devices: Sequence[str], device: str):
        super().__init__()
        self.spec, self.piece_devices, self.device = spec, tuple(piece_devices), device

    def forward(self, *pieces: torch.Tensor) -> torch.Tensor:
        key = (*map(id, pieces), self.device)
        if _THIS_CALL is not None and (whole := _THIS_CALL.get(key)) is not None:
            return whole
        whole = unshard(pieces, self.spec, self.device)
        GATHERED[whole] = (self, pieces)  # backward gathers it again instead of keeping it (see regathered)
        if _THIS_CALL is not None and not is_fake(whole):  # a fake run's gather never serves a real one
            _THIS_CALL[key] = whole
        return whole

    def right_inverse(self, whole: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(shard_of(whole.detach(), self.spec, r).to(d).clone() for r, d in enumerate(self.piece_devices))


#: each whole parameter a gather made and autograd may save: ``{tensor: (its gather, its pieces)}``
GATHERED: WeakIdKeyDictionary = WeakIdKeyDictionary()

#: within :func:`gathered_once_per_device`: ``{(ids of the pieces, device): whole}``, else None
_THIS_CALL: dict[tuple, torch.Tensor] | None = None
_CALLS = 0  # the calls inside gathered_once_per_device now
_CALLS_LOCK = threading.Lock()


@contextlib.contextmanager
def gathered_once_per_device() -> Iterator[None]:
    """Within a call: each parameter gathered once on each device that reads it, however many copies
    (the modules replicated onto that device) and micro-batches read it, held until the call returns.

    Not ``parametrize.cached()``: it keys a parametrized weight by the module it was registered on, so
    copy 1's replica (its gather onto ``cuda:1``) would read copy 0's whole weight, on ``cuda:0``."""
    global _THIS_CALL, _CALLS
    with _CALLS_LOCK:  # counted, as parametrize.cached() does: calls that overlap (threads) end in any order
        _CALLS += 1
        if _THIS_CALL is None:
            _THIS_CALL = {}
    try:
        yield
    finally:
        with _CALLS_LOCK:
            _CALLS -= 1
            if _CALLS == 0:  # the last call out: no gather outlives it (an optimizer step may follow)
                _THIS_CALL = None


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


def whole_on_meta(model: nn.Module) -> nn.Module | None:
    """A copy of ``model`` on ``meta`` (no data) whose parameters stored as pieces are whole parameters
    again, tied ones still tied: the model before sharding, as the planner profiles it (a gather read on
    fake pieces is a tensor autograd saves, not a parameter). None where a module holds a parametrization
    other than the gather (the user's own, ``weight_norm``)."""
    import copy

    from torch.nn.utils import parametrize

    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    skeleton = copy.deepcopy(model, memo)
    wholes: dict[int, nn.Parameter] = {}
    for module in list(skeleton.modules()):
        if not parametrize.is_parametrized(module):
            continue
        lists = dict(module.parametrizations.items())
        if not all(len(plist) == 1 and isinstance(plist[0], GatherShards) for plist in lists.values()):
            return None
        for plist in lists.values():
            if id(plist) not in wholes:
                gather: GatherShards = plist[0]
                pieces = [getattr(plist, f"original{r}") for r in range(len(gather.piece_devices))]
                shape = list(pieces[0].shape)
                shape[gather.spec.dim] = sum(p.shape[gather.spec.dim] for p in pieces)
                whole = torch.empty(shape, dtype=pieces[0].dtype, device="meta")
                wholes[id(plist)] = nn.Parameter(whole, requires_grad=pieces[0].requires_grad)
        module.__class__ = type(module).__bases__[0]  # the class parametrize derived it from
        del module._modules["parametrizations"]
        for leaf, plist in lists.items():
            module._parameters[leaf] = wholes[id(plist)]
    return skeleton


__all__ = ["GATHERED", "GatherShards", "gathered_once_per_device", "regathered", "whole_on_meta"]
