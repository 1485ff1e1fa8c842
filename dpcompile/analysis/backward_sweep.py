"""What each unit's backward holds beside the activations saved for it, from a fake backward of the
planner's profile run (``FakeTensorMode``: no memory, no compute).

A unit's backward makes two kinds of tensors: the gradients of its values (what flows from one op's
backward to the next: the gradient of its output arriving, of each value in between, of its input
leaving) and its parameters' gradients; as it goes, it frees the values its forward saved. Predicting
a whole unit's gradients beside every saved value from the start of its backward counted its
parameters' gradients too early (a BERT pipeline's last stage 11% over), and the gradients of its
widest values not at all (a residual MLP's ReLU block holds the gradient of its 4x-wide value twice,
as the Linear after it and the ReLU make one each: tensor parallelism's second device 12% under).

:func:`backward_moments` runs backward once on the profile's fake loss and, for every unit, the
moments of its backward as ``(flowing, gradients)``: the bytes of value gradients held less those of
its saved values freed so far (over the profiled batch: they scale with a device's share), and the
bytes of its own parameters' gradients made so far (they do not). Only the moments no other moment
of the unit exceeds in both are kept.

    a residual block x + down(relu(up(norm(x)))), 64 -> 256 -> 64, batch 8 x 32 rows:
    (576K, 64K) as the ReLU's backward makes the gradient of its input: the gradient of the block's
    output (64K) and two of the 256-wide value (256K each: the down layer's, the ReLU's), the down layer's
    weight gradient (64K); ...; (-128K, 130K) at its end, its saved values gone, every gradient made

:func:`backward_moments` also gives the moments of the backward a program that splits the batch runs
(``split_batch``): there a training BatchNorm is ``dpcompile.runtime.batch_norm`` (the whole batch's
statistics over the devices' or micro-batches' chunks), whose backward formula makes the input's gradient
as ``(dy - mean_dy - centred * projection) * scale``: three values of its input's size at once where
ATen's kernel makes one, two more beside the moment ATen's makes it (a conv-BN-ReLU net under data
parallel was 12% under its measured peak without them, 27% with its blocks recomputed).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["UNIT_KEY", "backward_moments", "follow_saved", "stamp_unit"]

UNIT_KEY = "dpcompile_profile_unit"  # on an autograd node's metadata: the unit whose forward made it
#: ATen's batch-norm backwards: where the program's own formula (``runtime.batch_norm``) holds two more
#: values of the input's gradient's size
_BATCH_NORM_BACKWARDS = {
    getattr(torch.ops.aten, name).default
    for name in ("native_batch_norm_backward", "cudnn_batch_norm_backward", "miopen_batch_norm_backward")
    if hasattr(torch.ops.aten, name)
}
#: an event's allocation number for the two values a split batch's BatchNorm backward holds in passing
_SPLIT_BATCH_NORM = -2


def stamp_unit(values: Any, unit: str) -> None:
    """Name ``unit`` on every autograd node ``values`` reach that no earlier call named (the nodes the
    unit's forward made, up to those of the units before it)."""
    todo = [t.grad_fn for t in tree_leaves(values) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if UNIT_KEY in node.metadata:
            continue
        node.metadata[UNIT_KEY] = unit
        todo += [f for f, _ in node.next_functions if f is not None]


def _running_unit() -> str | None:
    node = torch._C._current_autograd_node()
    return None if node is None else node.metadata.get(UNIT_KEY)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Allocations(TorchDispatchMode):
    """Every new storage backward makes, numbered, with the unit running and a finalizer when it is freed."""

    def __init__(self, events: list[tuple[str | None, int, int]]) -> None:
        super().__init__()
        # (unit, allocation number, +bytes / -bytes); number -1: a saved value released, -2: the bytes a split
        # batch's BatchNorm backward holds beside its input's gradient as it makes it (none freed)
        self.events = events
        self.live: dict[int, int] = {}  # storage -> its allocation's number

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        inputs = {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _key(t) not in self.live and _key(t) not in inputs:
                storage = t.untyped_storage()
                key, size, number = _key(t), storage.nbytes(), len(self.events)
                self.live[key] = number
                self.events.append((_running_unit(), number, size))
                weakref.finalize(storage, self._freed, key, number, size)
        if func in _BATCH_NORM_BACKWARDS and isinstance(out, tuple) and isinstance(out[0], torch.Tensor):
            self.events.append((_running_unit(), _SPLIT_BATCH_NORM, 2 * out[0].untyped_storage().nbytes()))
        return out

    def _freed(self, key: int, number: int, size: int) -> None:
        if self.live.get(key) == number:
            del self.live[key]
        self.events.append((_running_unit(), number, -size))


def follow_saved(t: torch.Tensor, unit: str, events: list[tuple[str | None, int, int]]) -> None:
    """Record the release of ``t``'s storage, a value ``unit``'s forward saved for backward, in ``events``
    as ``(unit, -1, -its bytes)``."""
    storage = t.untyped_storage()
    weakref.finalize(storage, events.append, (unit, -1, -storage.nbytes()))


def backward_moments(loss: torch.Tensor, params: Iterable[torch.Tensor], events: list[tuple[str | None, int, int]],
                     units: Iterable[str]) -> tuple[dict[str, list[tuple[int, int]]], dict[str, list[tuple[int, int]]]]:  # fmt: skip
    """Run ``loss``'s backward (fake) and return each unit's moments (see the module's docstring), and
    those of the program that splits the batch (``split_batch``: a BatchNorm's backward holds two values more
    in passing). ``events``: the list :func:`follow_saved` records the saved values' releases into."""
    events.clear()
    allocations = _Allocations(events)
    grads: set[int] = set()  # the allocation numbers that are parameters' gradients

    def is_grad(g: torch.Tensor) -> None:
        number = allocations.live.get(_key(g))
        if number is not None:
            grads.add(number)

    params = [p for p in params if p.requires_grad]
    handles = [p.register_hook(is_grad) for p in params]
    try:
        with allocations:  # the gradients returned, not accumulated: a model on meta reaches its own parameters
            kept = torch.autograd.grad(loss, params, allow_unused=True)  # noqa: F841 - held to the end, as .grad
    finally:
        for h in handles:
            h.remove()
    moments: dict[str, list[tuple[int, int]]] = {u: [] for u in units}
    split_batch = {u: [] for u in moments}
    flowing, own_grads, freed = 0, dict.fromkeys(moments, 0), dict.fromkeys(moments, 0)
    made_in: dict[int, str | None] = {}  # allocation number -> the unit whose backward made it
    for unit, number, size in list(events):
        if number == _SPLIT_BATCH_NORM:
            if unit in moments:
                split_batch[unit].append((flowing + size - freed[unit], own_grads[unit]))
            continue
        if number == -1:  # a saved value of `unit` released
            freed[unit] = freed.get(unit, 0) - size
        elif number in grads:
            maker = made_in.setdefault(number, unit)
            own_grads[maker] = own_grads.get(maker, 0) + size
        else:
            flowing += size
        if size > 0 and unit in moments:
            moments[unit].append((flowing - freed[unit], own_grads[unit]))
            split_batch[unit].append(moments[unit][-1])
    return ({u: _frontier(points) for u, points in moments.items()},
            {u: _frontier(points) for u, points in split_batch.items()})  # fmt: skip


def _frontier(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The points no other point exceeds in both coordinates."""
    out: list[tuple[int, int]] = []
    for a, g in sorted(set(points), key=lambda p: (-p[0], -p[1])):
        if not out or g > out[-1][1]:
            out.append((a, g))
    return out
