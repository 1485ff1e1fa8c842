"""Communication cost under ring algorithms, in elements each device sends.

For a collective over ``n`` devices on a tensor of ``size`` elements (the full, unsharded
tensor):

=================  ===================
all_reduce         ``2 (n-1)/n * size``
all_gather         ``(n-1)/n * size``
reduce_scatter     ``(n-1)/n * size``
scatter, gather,   ``(n-1)/n * size``  (one device sends or receives all but its own share)
broadcast, reduce
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

For ``explain``: :func:`comm_elements` gives a communication node's ``(forward,
backward)`` elements per device. It reads the node's ``dpcompile.infra.Comm`` stamp
(``node.meta["dpcompile_comm"]``: ``kind`` forward, ``backward`` the collective autograd
runs, ``io`` for input/output moves) and the full size ``S`` from
``node.meta["dpcompile_comm_numel"]`` when the pass recorded it, else from shapes
(``node.meta["val"]`` fake tensors, e.g. after ``FakeTensorProp``): the node's own value
for ``all_reduce``, ``all_gather``, ``gather``, ``reduce``; its first argument's for
``identity``, ``split``, ``scatter``, ``broadcast``, ``reduce_scatter`` (a list or tuple
counts as one tensor when the kind copies or reduces, as the sum of its parts otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "reduce": lambda n: (n - 1) / n,
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


_OWN_VALUE_KINDS = ("all_reduce", "all_gather", "gather", "reduce")
_WHOLE_LIST_KINDS = ("identity", "broadcast", "all_reduce", "reduce")


def _numel_of(value: Any, kind: str) -> int | None:
    if hasattr(value, "numel") and callable(value.numel):
        return int(value.numel())
    if isinstance(value, (list, tuple)) and value:
        parts = [_numel_of(v, kind) for v in value]
        if any(p is None for p in parts):
            return None
        return int(parts[0]) if kind in _WHOLE_LIST_KINDS else int(sum(parts))  # type: ignore[arg-type]
    return None


def comm_numel(node: Any) -> int | None:
    """The full tensor size ``S`` a communication node moves, or None if shapes are unknown."""
    if "dpcompile_comm_numel" in node.meta:
        return int(node.meta["dpcompile_comm_numel"])
    comm = node.meta.get("dpcompile_comm")
    if comm is None:
        return None
    if comm.kind in _OWN_VALUE_KINDS:
        source = node.meta.get("val")
    else:
        first = node.args[0] if node.args else None
        source = first.meta.get("val") if hasattr(first, "meta") else None
    return None if source is None else _numel_of(source, comm.kind)


def comm_elements(node: Any, n: int) -> tuple[float, float] | None:
    """``(forward, backward)`` elements each of ``n`` devices sends for a stamped node.

    None when the node is not a communication node or its size is unknown.
    """
    comm = node.meta.get("dpcompile_comm")
    size = comm_numel(node)
    if comm is None or size is None:
        return None
    return ring_elements(comm.kind, size, n), ring_elements(comm.backward, size, n)
