"""Values made from the batch size, indices of batch positions, and functional writes.

* ``arange(b)`` of a batch size is split on dim 0; each device holds the global positions of its
  rows (:mod:`dpcompile.analysis.batch_positions`), so it gathers to ``arange(B)``.
* ``h[positions, i]`` (``aten.index``) of a tensor split on dim 0 runs per device, each reading its
  own rows; other index tensors must be split the same way (after broadcasting) or replicated.
* ``written(base, steps, op, ...)`` (:func:`dpcompile.runtime.written`, what
  ``passes.functionalize`` makes of ``x[:, 1:] = y`` and ``x.copy_(y)``) is split as ``base``
  where the written view keeps the batch dim whole and what is written lines up with it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from dpcompile.analysis.batch_positions import INT64_MAX, batch_arange_size, index_positions
from dpcompile.analysis.batch_rules.context import RuleContext, node_shape
from dpcompile.analysis.batch_rules.indexing import getitem
from dpcompile.analysis.batch_rules.local_order import local_arange
from dpcompile.analysis.batch_rules.model_constructs import (
    aten_index_other_dims,
    getitem_other_dims,
    index_replicated_by_split,
    last_dims_slice,
)
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.batch_rules.shape import matrix_transpose
from dpcompile.analysis.placement import BatchSize, Placement, Replicated, Split
from dpcompile.runtime import written

aten = torch.ops.aten


def arange(ctx: RuleContext) -> Placement | None:
    """``arange(b)`` of a batch size: split on dim 0, each device holding its rows' positions;
    ``arange(b * t)`` of a row count: each device's own positions (:func:`local_arange`)."""
    if batch_arange_size(ctx.node, ctx.placements) is None:
        return local_arange(ctx)
    kwargs_ok = all(not isinstance(v, fx.Node) or isinstance(ctx.p(v), Replicated) for v in ctx.node.kwargs.values())
    return Split(0) if kwargs_ok else None


def _rank(value: Any) -> int | None:
    shape = node_shape(value) if isinstance(value, fx.Node) else None
    return None if shape is None else len(shape)


def index_by_positions(ctx: RuleContext) -> Placement | None:
    """``x[positions, i1, ...]`` of ``x`` split on dim 0: per device, where every index tensor is
    split on the dim the batch takes after broadcasting (or replicated), and shapes are known."""
    found = index_positions(ctx.node, ctx.placements)
    if found is None:
        return None
    x, indices = ctx.node.args[0], list(ctx.node.args[1])
    px = ctx.p(x)
    if not isinstance(px, Split) or px.dim != 0:
        return None
    tensors = [i for i in indices if isinstance(i, fx.Node)]
    if any(not (isinstance(i, int) and not isinstance(i, bool)) for i in indices if not isinstance(i, fx.Node)):
        return None  # slices or None among advanced indices move the result's dims around
    ranks = [_rank(i) for i in tensors]
    if any(r is None for r in ranks):
        return None
    out_rank = max(ranks)
    dims = set()
    for i, r in zip(tensors, ranks):
        p = ctx.p(i)
        if isinstance(p, Split):
            dims.add(p.dim + out_rank - r)
        elif not isinstance(p, Replicated):
            return None
        elif (
            (shape := node_shape(i)) is not None and out_rank - r <= 0 < len(shape) and shape[0] != 1 and r == out_rank
        ):
            return None  # a replicated index as long as the batch lines up with it
    return Split(dims.pop()) if len(dims) == 1 else None


def fx_getitem(ctx: RuleContext) -> Placement | None:
    """``x[...]``: by positions where :func:`index_by_positions` applies, else as indexing says."""
    if index_positions(ctx.node, ctx.placements) is not None and isinstance(ctx.node.args[1], tuple):
        return index_by_positions(ctx)
    return getitem(ctx) or last_dims_slice(ctx) or getitem_other_dims(ctx)


def aten_index(ctx: RuleContext) -> Placement | None:
    """``aten.index(x, indices)``: by batch positions, by index tensors that carry no batch on the
    other dims (any other index along the batch would read rows another device holds), or rows of
    a replicated table by split indices."""
    if index_positions(ctx.node, ctx.placements) is not None:
        found = index_by_positions(ctx)
        if found is not None:
            return found
    return aten_index_other_dims(ctx) or index_replicated_by_split(ctx)


def _nodes_in(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return found


def _view_split(ctx: RuleContext, p: Split, rank: int | None, steps: Any) -> tuple[int, int | None] | None:
    """The split dim (and rank) of ``base`` seen through ``steps``, where every step keeps the batch whole."""
    d = p.dim
    for step, args in steps:
        args = list(args)
        if _is_reshape(step):
            sizes = _leading_batch_sizes(ctx, d, args)
            if sizes is None:
                return None
            rank = len(sizes)
            continue
        if _nodes_in(args):
            return None
        if step == "__getitem__" or step is operator.getitem:
            walked = _walk_basic_index(d, rank, args[0])
            if walked is None:
                return None
            d, rank = walked
        elif step in (aten.slice.Tensor, "narrow") or (
            isinstance(step, torch._ops.OpOverload) and step.overloadpacket is aten.slice
        ):
            dim = args[0] if args else 0
            dim = dim + rank if isinstance(dim, int) and dim < 0 and rank is not None else dim
            if not isinstance(dim, int) or dim < 0:
                return None
            if dim == d:
                rest = [*args[1:], None, None, None][:3]
                if step == "narrow" or not (
                    rest[0] in (None, 0) and rest[1] in (None, INT64_MAX) and rest[2] in (None, 1)
                ):
                    return None
        elif step == "select" or (isinstance(step, torch._ops.OpOverload) and step.overloadpacket is aten.select):
            dim = args[0]
            dim = dim + rank if isinstance(dim, int) and dim < 0 and rank is not None else dim
            if not isinstance(dim, int) or dim < 0 or dim == d:
                return None
            d, rank = (d - 1 if dim < d else d), (rank - 1 if rank is not None else None)
        else:
            return None
    return d, rank


def _is_reshape(step: Any) -> bool:
    if isinstance(step, str):
        return step in ("view", "reshape")
    packet = getattr(step, "overloadpacket", None)
    return packet in (aten.view, aten.reshape, aten._unsafe_view)


def _leading_batch_sizes(ctx: RuleContext, d: int, args: list) -> list | None:
    """The sizes of ``view(b, *rest)`` / ``reshape([b, *rest])`` of a tensor split on dim 0 where
    ``b`` is the chunk's own batch size and ``rest`` the same on every device: the batch stays on
    dim 0 (as the ``reshape`` batch rule decides); None otherwise."""
    sizes = list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    if d != 0 or not sizes or not isinstance(sizes[0], fx.Node) or ctx.p(sizes[0]) not in (BatchSize(), BatchSize(rows=True)):
        return None
    if any(isinstance(s, fx.Node) and not isinstance(ctx.p(s), Replicated) for s in sizes[1:]):
        return None
    return sizes


def _walk_basic_index(d: int, rank: int | None, index: Any) -> tuple[int, int | None] | None:
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(i, fx.Node) or not (i is None or isinstance(i, (int, slice))) for i in items):
        return None
    in_dim = out_dim = 0
    for item in items:
        if item is None:
            out_dim += 1
            continue
        if in_dim == d:
            if item != slice(None):
                return None
            return out_dim, _indexed_rank(rank, items)
        in_dim += 1
        if isinstance(item, slice):
            out_dim += 1
    return out_dim + (d - in_dim), _indexed_rank(rank, items)


def _indexed_rank(rank: int | None, items: list) -> int | None:
    if rank is None:
        return None
    return rank - sum(1 for i in items if isinstance(i, int)) + sum(1 for i in items if i is None)


# writes that act on each element of the written view alone (what is written lines up with it)
_ELEMENTWISE_WRITES = frozenset(
    {"__setitem__", "copy_", "fill_", "zero_", "masked_fill_", "index_put_", "add_", "sub_", "mul_", "div_",
     "clamp_", "clamp_min_", "clamp_max_", "pow_", "neg_", "abs_", "exp_", "log_", "sqrt_", "rsqrt_", "relu_",
     "sigmoid_", "tanh_", "silu_", "gelu_", "hardtanh_", "leaky_relu_", "elu_", "hardswish_", "floor_", "round_"}
)  # fmt: skip
# random fills (``y.normal_()``, ``y[:, :4].uniform_()``): a draw per element (exact_random draws each
# device's slice of the whole fill), where the view keeps the batch dim where its tensor has it
_RANDOM_FILLS = frozenset({"normal_", "uniform_", "bernoulli_", "exponential_", "random_"})


def _dtype(node: fx.Node) -> torch.dtype | None:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return value.dtype
    tm = node.meta.get("tensor_meta")
    return getattr(tm, "dtype", None)


def written_rule(ctx: RuleContext) -> Placement | None:
    """``written(base, steps, op, *args)``: split as ``base`` where the written view keeps the
    batch dim whole and every split argument lines up with the view's batch dim."""
    base, steps, op, *args = ctx.node.args
    p = ctx.p(base)
    name = op if isinstance(op, str) else getattr(getattr(op, "overloadpacket", None), "__name__", None)
    if not isinstance(p, Split) or name not in _ELEMENTWISE_WRITES | _RANDOM_FILLS:
        return None
    if name == "index_put_" and (
        any(_dtype(i) is not torch.bool for i in _nodes_in(args[0]))
        or (isinstance(args[1], fx.Node) and _rank(args[1]) != 0)
    ):
        return None  # integer indices would name rows another device holds; values are taken in order
    rank = _rank(base)
    view = _view_split(ctx, p, rank, steps)
    if view is None or name in _RANDOM_FILLS and view[0] != p.dim:
        return None  # a random fill's draws are sliced on the batch dim of its tensor and of its view alike
    if op == "__setitem__" and isinstance(args[0], fx.Node):  # x[mask] = v: a mask of x's shape, v one value
        mask, value = args[0], args[1]
        q = ctx.p(mask)
        if _dtype(mask) is not torch.bool or not isinstance(q, Split) or q.dim != view[0] or _rank(mask) != view[1]:
            return None
        return (
            Split(p.dim)
            if not isinstance(value, fx.Node) or (_rank(value) == 0 and isinstance(ctx.p(value), Replicated))
            else None
        )
    if op == "__setitem__":
        view = _walk_basic_index(view[0], view[1], args[0])
        if view is None:
            return None
        args = args[1:]
    d, view_rank = view
    for value in [*args, *ctx.node.kwargs.values()]:
        for n in _nodes_in(value):
            q = ctx.p(n)
            if isinstance(q, Replicated):
                continue
            r = _rank(n)
            if not isinstance(q, Split) or (r is None) != (view_rank is None):
                return None
            if q.dim + ((view_rank - r) if r is not None and view_rank is not None else 0) != d:
                return None
    return Split(p.dim)


BATCH_RULES.register(torch.arange, arange)
BATCH_RULES.register(operator.getitem, fx_getitem, replace=True)
BATCH_RULES.register(written, written_rule)
BATCH_RULES.register(aten.numpy_T, matrix_transpose)  # ``x.T`` in an exported graph
