"""Positions in the batch: ``torch.arange(x.shape[0])`` and the indices made from it.

In a data-parallel program ``arange(B)`` of the batch size is split like the batch, and device
``k``'s chunk holds the *global* positions of its rows (device 1 of a batch of 5 split 3/2 holds
``[3, 4]``), so the gathered value is ``arange(B)`` and arithmetic on it (contrastive labels,
masks) means what it means on one device. Where such positions index a tensor split along the
batch (``h[torch.arange(h.shape[0]), last_token]``, the pooling of CLIP's text model and of
``*ForSequenceClassification``), each device subtracts its offset and reads its own rows.

These finders tell the batch rules and ``insert_scatter_gather`` which nodes are such values.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from dpcompile.analysis.placement import BatchSize, Placement, Replicated, Split

aten = torch.ops.aten
INT64_MAX = 9223372036854775807

# ops that keep the values of their first argument as they are (a reshape, a copy, a cast to integers)
_KEEP_VALUES_METHODS = frozenset({"unsqueeze", "view", "reshape", "expand", "clone", "contiguous", "long", "int", "to"})
_KEEP_VALUES_ATEN = frozenset(
    {aten.unsqueeze, aten.view, aten.reshape, aten._unsafe_view, aten.expand, aten.clone, aten.contiguous,
     aten._to_copy, aten.to, aten.alias, aten.lift_fresh_copy}
)  # fmt: skip


def batch_arange_size(node: fx.Node, placements: Mapping[fx.Node, Placement]) -> fx.Node | None:
    """The batch size ``b`` where ``node`` is ``arange(b)`` (or ``arange(0, b)``) of one, else None."""
    if node.op != "call_function":
        return None
    target = node.target
    args = list(node.args)
    if target is torch.arange:
        if "end" in node.kwargs and not args:
            args = [node.kwargs["end"]]
        elif node.kwargs.keys() & {"start", "end", "step"}:
            return None
    elif not (isinstance(target, torch._ops.OpOverload) and target.overloadpacket is aten.arange):
        return None
    if len(args) == 2 and args[0] == 0 and not isinstance(args[0], bool):
        args = args[1:]
    if len(args) != 1 or not isinstance(args[0], fx.Node):
        return None
    size = args[0]
    return size if placements.get(size) == BatchSize() else None


def running_sum_dim(node: fx.Node, placements: Mapping[fx.Node, Placement]) -> int | None:
    """The split dim where ``node`` is a ``cumsum`` along it (each device then adds the earlier
    devices' totals, ``runtime.running_sum``), else None."""
    if node.op not in ("call_function", "call_method") or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if node.target not in (torch.cumsum, aten.cumsum.default) and name != "cumsum":
        return None
    p, out = placements.get(node.args[0]), placements.get(node)
    if type(p) is not Split or out != Split(p.dim):
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    rank = _rank(node.args[0])
    if isinstance(dim, int) and dim < 0 and rank is not None:
        dim += rank
    return p.dim if dim == p.dim else None


def _rank(node: fx.Node) -> int | None:
    value = node.meta.get("val", node.meta.get("tensor_meta"))
    shape = getattr(value, "shape", None)
    return len(shape) if shape is not None else None


def table_rows(node: fx.Node, placements: Mapping[fx.Node, Placement]) -> tuple[int, fx.Node] | None:
    """``(dim, size)`` where ``node`` slices a tensor the same on every device from 0 to a split
    size along ``dim`` (``aten.slice(position_ids, 1, 0, seq_len)``): each device's chunk of the
    result is its own rows of the table (``runtime.rows_of_shard``). Else None."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:  # table[:n], table[:, :n]: fx's spelling
        found = _sliced_dim(node.args[1])
        if found is None:
            return None
        table, (dim, start, end, step) = node.args[0], found
    elif isinstance(node.target, torch._ops.OpOverload) and node.target.overloadpacket is aten.slice:
        table, dim, start, end, step = [*node.args, *[None, 0, None, None, 1][len(node.args) :]][:5]
    else:
        return None
    if not isinstance(table, fx.Node) or not isinstance(dim, int) or not isinstance(end, fx.Node):
        return None
    if start not in (None, 0) or step not in (None, 1) or placements.get(end) != BatchSize():
        return None
    if not isinstance(placements.get(table), Replicated):
        return None
    if dim < 0:
        shape = table.meta.get("val")
        if not isinstance(shape, torch.Tensor):
            return None
        dim += shape.dim()
    return dim, end


def _sliced_dim(index: Any) -> tuple[int, Any, Any, Any] | None:
    """``(dim, start, end, step)`` of the one bounded slice in an index of slices (``[:, :n]``)."""
    items = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, slice) for i in items):
        return None
    bounded = [(d, i) for d, i in enumerate(items) if i != slice(None)]
    if len(bounded) != 1:
        return None
    dim, item = bounded[0]
    return dim, item.start, item.stop, item.step


def positions_source(node: Any, placements: Mapping[fx.Node, Placement]) -> fx.Node | None:
    """The ``arange(b)`` whose values ``node`` holds, reshaped or cast (``arange(b)[:, None]``), else None."""
    for _ in range(16):
        if not isinstance(node, fx.Node):
            return None
        if batch_arange_size(node, placements) is not None:
            return node
        if not node.args or not isinstance(node.args[0], fx.Node) or not _keeps_values(node):
            return None
        node = node.args[0]
    return None


def _keeps_values(node: fx.Node) -> bool:
    if node.op == "call_method":
        if node.target == "to":  # a cast to another integer type keeps positions; to float, they are values
            return all(
                a in (torch.long, torch.int64, torch.int32)
                for a in [*node.args[1:], *node.kwargs.values()]
                if isinstance(a, torch.dtype)
            )
        return node.target in _KEEP_VALUES_METHODS
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        index = node.args[1]
        items = index if isinstance(index, tuple) else (index,)
        return all(i is None or i is Ellipsis or i == slice(None) for i in items)
    if isinstance(node.target, torch._ops.OpOverload):
        packet = node.target.overloadpacket
        if packet is aten.slice:
            args = [*node.args, None, None, None, None][:5]
            return args[2] in (None, 0) and args[3] in (None, INT64_MAX) and args[4] in (None, 1)
        return packet in _KEEP_VALUES_ATEN
    return node.target is torch.unsqueeze


def index_positions(node: fx.Node, placements: Mapping[fx.Node, Placement]) -> tuple[int, fx.Node] | None:
    """``(slot, arange node)`` where ``node`` indexes a tensor's first dim with batch positions
    (``h[arange(b), last]``, ``aten.index(h, [arange(b), last])``); the slot is where they sit
    among the indices."""
    if node.op != "call_function" or len(node.args) < 2:
        return None
    if node.target is operator.getitem or (
        isinstance(node.target, torch._ops.OpOverload) and node.target.overloadpacket is aten.index
    ):
        indices = node.args[1]
        if isinstance(indices, (tuple, list)) and indices:
            source = positions_source(indices[0], placements)
            if source is not None:
                return 0, source
    return None
