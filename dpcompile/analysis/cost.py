"""Communication cost under ring algorithms, in elements each device sends.

For a collective over ``n`` devices on a tensor of ``size`` elements (the full, unsharded
tensor):

=================  ===================
all_reduce         ``2 (n-1)/n * size``
all_gather         ``(n-1)/n * size``
reduce_scatter     ``(n-1)/n * size``
scatter, gather,   ``(n-1)/n * size``  (one device sends or receives all but its own share)
broadcast, reduce
send               ``size``            (point to point: one pipeline stage to the next)
=================  ===================

Tensor parallelism adds two kinds that move nothing: ``identity`` (the forward of Megatron's
*f*, ``copy_to_shards``) and ``split`` (a shard keeping its slice of a replicated tensor).

The per-plan cost model
-----------------------

A tensor-parallel program's communication is the list of its collectives, each a
:class:`CommEstimate` (forward kind, backward kind, full elements ``S``).
:func:`plan_cost` sums them into a :class:`CommCost` (forward, backward, total per device);
the automatic plan minimises ``total``. :func:`linear_cost` gives a lone ``X @ W``'s
figures; the classic ones, ``X[128x1000] @ W[1000x500]`` on 2 devices::

    >>> linear_cost("row", 128 * 1000, 128 * 500, 2).total       # split-add
    128000.0
    >>> linear_cost("column", 128 * 1000, 128 * 500, 2).total    # split-stack
    160000.0

A column layer: *f* on the input (forward nothing, backward all-reduce ``X``), all-gather
of the output. A row layer: the input split (backward all-gather ``X``), all-reduce of the
partial outputs. A column layer feeding a row layer (Megatron) keeps *f* and the
all-reduce and drops both all-gathers.

The size of a collective
------------------------

One rule says how many elements ``S`` a communication node moves: :func:`comm_sizes`.
``explain`` applies it to the values of a run; :func:`comm_numel` and
:func:`comm_elements` to the shapes shape propagation recorded (``node.meta["val"]`` fake
tensors, e.g. after ``FakeTensorProp``). It reads the node's ``dpcompile.infra.Comm`` stamp
(``node.meta["dpcompile_comm"]``: ``kind`` forward, ``backward`` the collective autograd
runs, ``io`` for input/output moves) and takes ``S`` from
``node.meta["dpcompile_comm_numel"]`` when the pass recorded it; else, past the
data-parallel specials (``replicate``, the BatchNorm sync), from the node's own value for
``all_reduce``, ``all_gather``, ``gather``, ``reduce`` and its first argument's for
``identity``, ``split``, ``scatter``, ``broadcast``, ``reduce_scatter`` (a list or tuple
counts as one tensor when the kind copies or reduces, as the sum of its parts otherwise).
:func:`comm_elements` turns ``S`` into the elements each device sends, forward and backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile import runtime
from dpcompile.runtime.structures import children, tensor_leaves

RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "reduce": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,  # each device keeps its own 1/n and sends the rest
    "send": lambda n: 1.0,  # a pipeline stage sends the whole value to the next stage's device
    "identity": lambda n: 0.0,
    "split": lambda n: 0.0,
}


def ring_elements(kind: str | None, size: int, n: int) -> float:
    """Elements each device sends for collective ``kind`` on a ``size``-element tensor.

    >>> ring_elements("all_reduce", 64_000, 2)
    64000.0
    """
    if kind is None or n <= 1:
        return 0.0
    try:
        return RING_FACTOR[kind](n) * size
    except KeyError:
        raise ValueError(f"unknown collective {kind!r}; known: {sorted(RING_FACTOR)}") from None


@dataclass(frozen=True)
class CommEstimate:
    """One collective of a plan: its forward and backward kinds and the full tensor's size."""

    kind: str
    backward: str | None
    numel: int
    where: str = ""

    def elements(self, n: int) -> tuple[float, float]:
        """``(forward, backward)`` elements each of ``n`` devices sends."""
        return ring_elements(self.kind, self.numel, n), ring_elements(self.backward, self.numel, n)


@dataclass(frozen=True)
class CommCost:
    """The elements each device sends, forward and backward, summed over a plan's collectives."""

    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


def plan_cost(comms: Iterable[CommEstimate], n: int) -> CommCost:
    """Sum a plan's collectives on ``n`` devices.

    >>> plan_cost([CommEstimate("all_reduce", None, 64 * 1024)], 2)
    CommCost(forward=65536.0, backward=0.0)
    """
    forward = backward = 0.0
    for c in comms:
        f, b = c.elements(n)
        forward += f
        backward += b
    return CommCost(forward, backward)


def linear_comms(style: str, input_numel: int, output_numel: int) -> list[CommEstimate]:
    """The collectives of one Linear sharded alone (inputs replicated, output needed whole)."""
    if style == "column":
        return [CommEstimate("identity", "all_reduce", input_numel, "input"),
                CommEstimate("all_gather", None, output_numel, "output")]
    if style == "row":
        return [CommEstimate("split", "all_gather", input_numel, "input"),
                CommEstimate("all_reduce", None, output_numel, "output")]
    if style == "replicate":
        return []
    raise ValueError(f"unknown style {style!r}; valid: 'column', 'row', 'replicate'")


def linear_cost(style: str, input_numel: int, output_numel: int, n: int) -> CommCost:
    """Elements per device for ``X @ W`` split ``style``-wise over ``n`` devices, alone."""
    return plan_cost(linear_comms(style, input_numel, output_numel), n)


# ------------------------------------------------------------- the size of a collective
_OWN_VALUE_KINDS = ("all_reduce", "all_gather", "gather", "reduce")
_WHOLE_LIST_KINDS = ("identity", "broadcast", "all_reduce", "reduce")


class _Unknown:
    """A value no shape propagation recorded (an argument node without ``meta["val"]``)."""

    def __repr__(self) -> str:
        return "<unknown>"


_UNKNOWN = _Unknown()


def _has_unknown(value: Any) -> bool:
    return value is _UNKNOWN or any(_has_unknown(kid) for kid in children(value) or ())


def _numel_by_rule(value: Any, kind: str) -> int | None:
    """A tensor's elements; a list or tuple counts once when ``kind`` copies or reduces, as
    the sum of its parts otherwise; any other structure, the sum of its tensors."""
    if value is _UNKNOWN:
        return None
    if isinstance(value, torch.Tensor):
        return int(value.numel())
    if isinstance(value, (list, tuple)) and value:
        parts = [_numel_by_rule(v, kind) for v in value]
        if any(p is None for p in parts):
            return None
        return parts[0] if kind in _WHOLE_LIST_KINDS else sum(parts)  # type: ignore[return-value]
    if _has_unknown(value):
        return None
    return int(sum(t.numel() for _, t in tensor_leaves(value)))


def _param_elements(value: Any, grad_only: bool) -> int | None:
    """Elements of the parameters (and, unless ``grad_only``, buffers) of the modules in ``value``."""
    seen: dict[int, int] = {}
    items = value.values() if isinstance(value, Mapping) else (value if isinstance(value, (list, tuple)) else [value])
    for item in items:
        if item is _UNKNOWN:
            return None
        if isinstance(item, nn.Module):
            tensors = list(item.parameters())
            if not grad_only:
                tensors += list(item.buffers())
            for t in tensors:
                if not grad_only or t.requires_grad:
                    seen[id(t)] = t.numel()
        elif isinstance(item, torch.Tensor):
            seen[id(item)] = item.numel()
    return sum(seen.values())


def comm_sizes(node: fx.Node, args: Sequence[Any], result: Any) -> tuple[int, int] | None:
    """``(S forward, S backward)``: the full tensor's elements a communication node moves.

    The one rule, whether the values are those of a run (``explain`` records ``args`` and
    ``result`` as its interpreter meets the node) or those shape propagation left in
    ``node.meta["val"]`` (:func:`comm_numel`). A size the pass recorded in
    ``node.meta["dpcompile_comm_numel"]`` wins. Data-parallel specials: ``replicate``
    broadcasts parameters and buffers and reduces the parameters' gradients; the BatchNorm
    sync all-reduces a per-channel mean and variance (``2 C``). Otherwise the node's own
    value for ``all_reduce``, ``all_gather``, ``gather``, ``reduce`` and its first argument
    for the other kinds (a list counts once when the kind copies or reduces, as the sum of
    its parts otherwise). None for a node that is not a communication node, or whose size
    depends on a value nobody recorded.
    """
    comm = node.meta.get("dpcompile_comm")
    if comm is None:
        return None
    if "dpcompile_comm_numel" in node.meta:
        size = int(node.meta["dpcompile_comm_numel"])
        return size, size
    if node.target is runtime.replicate:
        forward, backward = _param_elements(args[0], False), _param_elements(args[0], True)
        return None if forward is None or backward is None else (forward, backward)
    if node.target is runtime.batch_norm:
        channels = getattr(args[0], "num_features", None)
        if not channels:
            if _has_unknown(result):
                return None
            leaves = tensor_leaves(result)
            channels = leaves[0][1].size(1) if leaves else 0
        return 2 * int(channels), 2 * int(channels)
    source = result if comm.kind in _OWN_VALUE_KINDS or not args else args[0]
    size = _numel_by_rule(source, comm.kind)
    return None if size is None else (size, size)


def _recorded_values(node: fx.Node) -> tuple[tuple[Any, ...], Any]:
    """``(args, result)`` of ``node`` as shape propagation recorded them: each argument
    node's ``meta["val"]`` (a ``get_attr`` node: the attribute itself), unknown where absent."""
    owner = node.graph.owning_module

    def value(arg: fx.Node) -> Any:
        if arg.op == "get_attr" and owner is not None:
            found: Any = owner
            for part in str(arg.target).split("."):
                found = getattr(found, part, _UNKNOWN)
            return found
        return arg.meta.get("val", _UNKNOWN)

    args = fx.node.map_arg(node.args, value)
    return tuple(args), node.meta.get("val", _UNKNOWN)


def comm_numel(node: fx.Node) -> int | None:
    """The full tensor size ``S`` a communication node moves, or None if shapes are unknown."""
    sizes = comm_sizes(node, *_recorded_values(node))
    return None if sizes is None else sizes[0]


def comm_elements(node: fx.Node, n: int, sizes: tuple[int, int] | None = None) -> tuple[float, float] | None:
    """``(forward, backward)`` elements each of ``n`` devices sends for a stamped node.

    ``sizes`` is ``(S forward, S backward)`` from :func:`comm_sizes` where the caller ran the
    program (``explain``); without it the sizes come from the node's recorded shapes. An
    SPMD node's own process-group size (``node.meta["dpcompile_comm_world"]``) replaces
    ``n``; a kind without a ring formula sends nothing here. None when the node is not a
    communication node or its size is unknown.
    """
    comm = node.meta.get("dpcompile_comm")
    if comm is None:
        return None
    if sizes is None:
        sizes = comm_sizes(node, *_recorded_values(node))
        if sizes is None:
            return None
    n = node.meta.get("dpcompile_comm_world", n)

    def sent(kind: str | None, size: int) -> float:
        return ring_elements(kind, size, n) if kind in RING_FACTOR else 0.0

    return sent(comm.kind, sizes[0]), sent(comm.backward, sizes[1])
