"""Reading parts of values: ``x[...]`` (tensors, tuples, an input's containers) and ``getattr``."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from dpcompile.analysis import ops
from dpcompile.analysis.batch_positions import table_rows
from dpcompile.analysis.batch_rules.context import RuleContext
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.batch_rules.shape import matrix_transpose
from dpcompile.analysis.batch_rules.sizes import is_whole_split_size
from dpcompile.analysis.placement import (
    REPLICATED,
    BatchSize,
    Packed,
    Placement,
    Replicated,
    Split,
    Tuple,
)


def getitem(ctx: RuleContext) -> Placement | None:
    base, index = ctx.node.args
    rows = table_rows(ctx.node, ctx.placements)  # table[:n] of a split size n: each device's own rows
    if rows is not None:
        return Split(rows[0])
    p = ctx.p(base)
    if isinstance(p, Tuple):
        if isinstance(index, int) and -len(p.items) <= index < len(p.items):
            return p.items[index]
        return None
    if isinstance(p, BatchSize):
        if p.shape_of_dim is None:
            return None
        return _index_shape(ctx, base, p.shape_of_dim, index)
    if not isinstance(p, Split):
        return None
    if is_container_access(ctx.node):
        return p
    return _index_tensor(ctx, p, _batch_prefix_as_whole(ctx, base, p, index))


def _batch_prefix_as_whole(ctx: RuleContext, base: Any, p: Split, index: Any) -> Any:
    """``index`` with ``x[:batch_size]`` on the split dim written ``x[:]``: the batch size read
    from the input (:func:`is_whole_split_size`) is each device's whole chunk."""
    items = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis in items or None in items[: p.dim + 1] or len(items) <= p.dim:
        return index
    item = items[p.dim]
    if not (isinstance(item, slice) and item.start in (None, 0) and item.step in (None, 1)):
        return index
    if not isinstance(base, fx.Node) or not is_whole_split_size(ctx, base, p, item.stop):
        return index
    items[p.dim] = slice(None)
    return tuple(items) if isinstance(index, tuple) else items[0]


def _index_shape(ctx: RuleContext, shape: Any, at: int, index: Any) -> Placement | None:
    """``x.shape[i]`` and ``x.size()[:-1]`` (a shape whose entry ``at`` is the batch size): a
    negative index or bound counts from the rank, which must then be known (or bounded)."""
    tensor = shape.args[0] if isinstance(shape, fx.Node) and shape.args else None
    nd = ctx.ndim(tensor)
    low = ctx.min_ndim(tensor)
    if isinstance(index, int):
        if index >= 0:
            return BatchSize() if index == at else REPLICATED
        if nd is not None:
            return BatchSize() if index + nd == at else REPLICATED
        return REPLICATED if low is not None and index + low > at else None
    if isinstance(index, slice) and index.step in (None, 1):
        start, stop = index.start or 0, index.stop
        if not isinstance(start, int) or (stop is not None and not isinstance(stop, int)):
            return None
        if start < 0 or (stop is not None and stop < 0):
            if nd is None:
                # x.size()[:-k]: keeps the batch entry (at the front) when the rank is surely above at + k
                if start == 0 and stop is not None and stop < 0 and low is not None and stop + low > at:
                    return BatchSize(shape_of_dim=at)
                # x.shape[-2:] (DeepLab's output size): only entries after the batch's
                if start < 0 and stop is None and low is not None and start + low > at:
                    return REPLICATED
                return None
            start = start + nd if start < 0 else start
            stop = stop + nd if stop is not None and stop < 0 else stop
        if start <= at and (stop is None or at < stop):
            return BatchSize(shape_of_dim=at - start)
        return REPLICATED
    return None


def is_container_access(node: fx.Node) -> bool:
    """Whether ``node`` (a getitem or getattr) reads an element of an input's container.

    Inputs may be dicts, tuples or dataclasses of tensors; an element keeps the split of
    its container. Known example values decide; without them a string key, or a value used
    only through element access, is a container.
    """
    base, key = node.args[0], node.args[1]
    if not isinstance(base, fx.Node):
        return False
    example = base.meta.get("val", ...)
    if example is not ...:
        return not isinstance(example, torch.Tensor)
    if base.op != "placeholder" and not (base.op == "call_function" and base.target in (operator.getitem, getattr) and is_container_access(base)):
        return False
    if isinstance(key, str) and node.target is operator.getitem:
        return True
    return all(user.op == "call_function" and user.target in (operator.getitem, getattr) for user in base.users) and (
        node.target is operator.getitem or key not in ops.TENSOR_ATTRIBUTES
    )


def _index_tensor(ctx: RuleContext, p: Split, index: Any) -> Placement | None:
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(i, fx.Node) and not isinstance(ctx.p(i), Replicated) for i in items):
        return None
    if any(isinstance(i, fx.Node) for i in items):
        return None  # advanced indexing: keep it simple and correct
    lists = [i for i in items if isinstance(i, list)]
    if len(lists) > 1 or any(isinstance(v, list) for i in lists for v in i):
        return None  # several index lists (x[:, [0, 2], :, [1, 3]] puts their dim first) or nested ones
    if Ellipsis in items:
        at = items.index(Ellipsis)
        before = items[:at]
        after = items[at + 1 :]
        if not before and all(i is None or i == slice(None, None, None) for i in after):
            return p  # x[..., None]: new or whole dims at the end leave the leading dims where they are
        if sum(1 for i in before if i is not None) > p.dim:
            return _walk_index(p, before)
        return None
    return _walk_index(p, items)


def _walk_index(p: Split, items: list[Any]) -> Placement | None:
    in_dim, out_dim = 0, 0
    for item in items:
        if item is None:
            out_dim += 1
            continue
        if in_dim == p.dim:
            if isinstance(item, slice) and item == slice(None, None, None):
                return Split(out_dim)
            return None
        if isinstance(item, int):
            in_dim += 1
        elif isinstance(item, slice):
            in_dim += 1
            out_dim += 1
        else:
            return None
    return Split(out_dim + (p.dim - in_dim))


def tensor_attribute(ctx: RuleContext) -> Placement | None:
    base, name = ctx.node.args[0], ctx.node.args[1]
    p = ctx.p(base)
    if isinstance(p, Split) and name not in ops.TENSOR_ATTRIBUTES and is_container_access(ctx.node):
        return p
    if name in ("dtype", "device", "ndim", "is_cuda", "requires_grad", "layout") and isinstance(p, (Split, Packed)):
        return REPLICATED
    if name == "shape" and isinstance(p, Split):
        return BatchSize(shape_of_dim=p.dim)
    if name == "T" and isinstance(p, Split):
        return matrix_transpose(ctx)
    if name == "data" and isinstance(p, Split):
        return p
    if isinstance(p, Packed) and name in ("data", "batch_sizes", "sorted_indices", "unsorted_indices"):
        return None
    return None


def rank(ctx: RuleContext) -> Placement | None:
    """``x.dim()`` / ``x.ndimension()``: a chunk has the whole's rank, as ``x.ndim`` (torchvision's
    ``assert x.dim() == 3`` needs no gather)."""
    return REPLICATED if isinstance(ctx.p(ctx.tensor_arg()), (Split, Packed)) else None


BATCH_RULES.register(operator.getitem, getitem)
BATCH_RULES.register(getattr, tensor_attribute)
for _target in ("dim", "ndimension", torch.Tensor.dim, torch.Tensor.ndimension):
    BATCH_RULES.register(_target, rank)
