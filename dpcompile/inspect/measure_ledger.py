"""``measure``'s count of each device's bytes on virtual devices, without changing what autograd does.

A ``TorchDispatchMode`` sees every tensor an op returns; :class:`Ledger` counts each new storage on
the slot of the node that made it until it is freed. Two things a real device does not see would
change the step measured, and are kept out of it:

- any dispatch mode on the stack turns off autograd's in-place sums of gradients (``InputBuffer``'s
  ``can_accumulate_inplace`` asks ``isTensorSubclassLike``, true whenever a mode is active): a second
  gradient of a parameter or of a value read twice would be summed out of place, one gradient more.
  So backward runs with the mode off, and each autograd node's hooks turn it on for that node's own
  backward only (:class:`BackwardWindows`); the sums between nodes run with no mode, in place where a
  real device sums in place;
- a storage's Python object, once made (``tensor.untyped_storage()``), holds the storage until it
  is freed: autograd then sees a second owner and sums out of place too. A gradient (a tensor a
  node's backward makes) is therefore followed by the tensors that hold its storage (a finalizer on
  each, the storage freed with the last); only what forward and recompute make, which autograd never
  sums into, is followed by its storage (what autograd saves of an output is a second tensor of the
  same storage, made where no mode sees it).

A sum autograd makes out of place all the same (a Linear's weight: its gradients are views) is a
tensor no mode saw: the next node's pre-hook finds it among its inputs and counts it where it was
made, at the post-hook of the node whose gradient was the buffer's second (that node's other outputs
and the summed buffer still held; the later ones are added into it in place).
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SLOT_KEY", "SPREAD_KEY", "BackwardWindows", "Ledger", "address"]

SLOT_KEY = "dpcompile_slot"  # on an autograd node's metadata: the slot of the forward node that made it
SPREAD_KEY = "dpcompile_spread"  # on an autograd node's metadata: made by a node of no one device (Ledger.spread_slot)
_HOOKED = "dpcompile_measure_hooked"  # on an autograd node's metadata: hooked by this BackwardWindows
_SUMMED_AT = "dpcompile_summed_at"  # [(the ledger's position, slot)] where its input buffer received each gradient


def address(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage (its views share it), without making the storage's Python
    object; None where it has none."""
    try:
        ptr = t.data_ptr()
    except RuntimeError:  # no storage (a sparse tensor, a wrapper)
        return None
    return ptr - t.storage_offset() * t.element_size() if ptr else None


def _extent(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (t.storage_offset() + span + 1) * t.element_size()


class _Held:
    __slots__ = ("holders", "size", "slots")

    def __init__(self, slots: tuple[int, ...], size: int, holders: int) -> None:
        self.slots, self.size, self.holders = slots, size, holders  # holders: 0 for a storage followed itself


class Ledger:
    """Bytes allocated and freed per device slot, in the order they were; the peaks replayed from them."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.events: list[tuple[int, int]] = []  # (slot, +bytes allocated / -bytes freed)
        self.earlier: dict[int, list[tuple[int, int]]] = {}  # found later, allocated before events[position]
        self.held: dict[int, _Held] = {}  # storage address -> what is counted of it
        self.slot = 0  # the device slot of the node now running
        self.recomputing = 0  # a checkpointed region running again in backward: its nodes name their slots
        self.in_backward_node = 0  # inside an autograd node's own backward (BackwardWindows)
        self.spread = False  # the node now running runs on no one device (spread_slot)

    def position(self) -> int:
        return len(self.events)

    def count(
        self, t: torch.Tensor, inputs: Collection[int] = (), slot: int | None = None, at: int | None = None,
        also: Collection[int] = (),
    ) -> None:  # fmt: skip
        """Count ``t``'s storage, if new (not one of ``inputs``' addresses, none counted already), on
        ``slot`` (default: the running node's) and the slots ``also`` names until it is freed: from now,
        or from before the event at position ``at``. A tensor of a storage followed by its tensors holds
        it too."""
        key = address(t)
        if key is None:
            return
        entry = self.held.get(key)
        if entry is not None:
            if entry.holders:
                entry.holders += 1
                weakref.finalize(t, self._drop, key, entry)
            more = sorted(set(also) - set(entry.slots))
            if more:  # a sum made in place into one device's gradient: the others hold it too
                entry.slots = (*entry.slots, *more)
                self._add([(s, entry.size) for s in more], at)
            return
        by_tensor = self.in_backward_node > 0 and not self.recomputing
        size = _extent(t) if by_tensor else t.untyped_storage().nbytes()
        if key in inputs or not size:
            return
        first = self.current_slot() if slot is None else slot
        entry = _Held((first, *sorted(set(also) - {first})), size, 1 if by_tensor else 0)
        self.held[key] = entry
        self._add([(s, size) for s in entry.slots], at)
        weakref.finalize(t if by_tensor else t.untyped_storage(), self._drop if by_tensor else self._free, key, entry)

    def _add(self, events: list[tuple[int, int]], at: int | None) -> None:
        if at is None or at >= len(self.events):
            self.events += events
        else:
            self.earlier.setdefault(at, []).extend(events)

    def _drop(self, key: int, entry: _Held) -> None:
        entry.holders -= 1
        if entry.holders == 0:
            self._free(key, entry)

    def _free(self, key: int, entry: _Held) -> None:
        if self.held.get(key) is entry:
            del self.held[key]
        self.events += [(s, -entry.size) for s in entry.slots]

    @property
    def peak(self) -> list[int]:
        live, peak = [0] * self.n, [0] * self.n
        for i, event in enumerate(self.events):
            for slot, size in [*self.earlier.get(i, ()), event]:
                live[slot] += size
                peak[slot] = max(peak[slot], live[slot])
        return peak

    def spread_slot(self, t: torch.Tensor, inputs: Sequence[torch.Tensor]) -> int | None:
        """Where a node of no one device makes ``t``, where it computes per device (a whole-batch
        BatchNorm over every dp copy's chunk, forward and backward): the one slot that holds the
        inputs of ``t``'s shape (``x_k - mean`` is chunk ``k``'s), as a real device computes where its
        operands are; None (the node's own slot) where none or several do (a sum of every device's
        partials, a concatenation). Counted on the first device, BatchNorm's chunks put data
        parallel's first device 30-50% over its prediction and the others 60-75% under."""
        node = torch._C._current_autograd_node() if self.in_backward_node and not self.recomputing else None
        if not (node.metadata.get(SPREAD_KEY, False) if node is not None else self.spread):
            return None
        slots = set()
        for x in inputs:
            entry = self.held.get(address(x)) if x.shape == t.shape else None
            if entry is not None:
                slots.add(entry.slots[0])
        return slots.pop() if len(slots) == 1 else None

    def current_slot(self) -> int:
        node = torch._C._current_autograd_node()
        if node is None or self.recomputing:
            return self.slot
        todo, seen = [node], set()
        while todo:  # the nearest autograd node a forward node made (a gradient's own device)
            n = todo.pop(0)
            if SLOT_KEY in n.metadata:
                return n.metadata[SLOT_KEY]
            seen.add(n)
            todo += [f for f, _ in getattr(n, "next_functions", ()) if f is not None and f not in seen][:4]
            if len(seen) > 64:
                break
        return 0


class BackwardWindows:
    """``backward(tensors, grads)`` as ``torch.autograd.backward``, with ``mode`` (active when it is
    called, the top of the stack) on only inside each autograd node's own backward."""

    def __init__(self, mode: TorchDispatchMode, ledger: Ledger) -> None:
        self.mode = mode
        self.ledger = ledger
        self.handles: list[Any] = []
        self.token = object()  # marks the nodes this instance hooked (a graph may outlive one measure)

    def backward(self, tensors: Any, grads: Any = None) -> None:
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        self._hook([t.grad_fn for t in roots if t.grad_fn is not None])
        self.mode.__exit__(None, None, None)
        try:
            torch.autograd.backward(tensors, grads)
        finally:
            self.mode.__enter__()

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _hook(self, roots: Sequence[Any]) -> None:
        todo = list(roots)
        while todo:
            node = todo.pop()
            if node.metadata.get(_HOOKED) is self.token:
                continue
            node.metadata[_HOOKED] = self.token
            self.handles += [node.register_prehook(self._before), node.register_hook(self._after)]
            todo += [f for f, _ in node.next_functions if f is not None]

    def _before(self, grad_outputs: Sequence[Any]) -> None:
        self.mode.__enter__()
        self.ledger.in_backward_node += 1
        node = torch._C._current_autograd_node()
        # two gradients in one buffer are summed out of place at most once, when the second arrives; later
        # ones are added in place into that sum
        marks = node.metadata.pop(_SUMMED_AT, []) if node is not None else []
        at, slot = marks[min(1, len(marks) - 1)] if marks else (None, None)
        # a parameter's gradient summed from several devices' (replicas on virtual devices share the
        # parameter), out of place or in place into the first: on real devices each holds its own, so
        # each of them holds the sum
        also = {s for _, s in marks} if hasattr(node, "variable") else ()
        for g in grad_outputs:
            if isinstance(g, torch.Tensor):  # a sum made out of place between two nodes: no mode saw it
                self.ledger.count(g, slot=slot, at=at, also=also)

    def _after(self, grad_inputs: Sequence[Any], grad_outputs: Sequence[Any]) -> None:
        node = torch._C._current_autograd_node()
        if node is not None:
            mark = (self.ledger.position(), self.ledger.current_slot())
            for f, _ in node.next_functions:
                if f is not None:
                    f.metadata.setdefault(_SUMMED_AT, []).append(mark)
        self.ledger.in_backward_node -= 1
        self.mode.__exit__(None, None, None)
