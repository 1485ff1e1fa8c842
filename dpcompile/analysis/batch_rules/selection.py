"""Ops that pick or write elements by index tensors: ``gather``, ``scatter``, ``index_select``,
``index_put``, ``slice_scatter``/``select_scatter``; and ops along named dims (``fft``, ``cdist``).

Each is per sample where the indexed dim is not the batch dim and every batch-carrying tensor is
split on it alike; one whose index picks along the batch dim is per sample only where the picked
table carries no batch (``torch.gather(buffer, 0, ids)``: each row of ``ids`` reads the whole table).
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from dpcompile.analysis.batch_rules.context import RuleContext, node_shape, normalize_dim, target_name
from dpcompile.analysis.placement import REPLICATED, Placement, Replicated, Split


def _dim(ctx: RuleContext, value: Any, dim: Any, batch_dim: int) -> int | None:
    return normalize_dim(dim, ctx.ndim(value), batch_dim, ctx.min_ndim(value))


def gather(ctx: RuleContext) -> Placement | None:
    """``gather(x, dim, index)``: the output has ``index``'s shape and reads ``x`` at the same
    position but along ``dim``. Split as ``index`` where ``x`` is split alike and ``dim`` is another
    dim, or where ``x`` carries no batch and ``dim`` is the batch dim (a lookup table)."""
    x, dim, index = ctx.node.args[0], ctx.arg(1, "dim"), ctx.arg(2, "index")
    px, pi = ctx.p(x), ctx.p(index)
    if not isinstance(pi, Split) or ctx.ndim(x) != ctx.ndim(index) or ctx.ndim(x) is None:
        return None
    d = _dim(ctx, x, dim, pi.dim)
    if d is None:
        return None
    if isinstance(px, Split) and px.dim == pi.dim and d != pi.dim:
        return Split(pi.dim)
    if isinstance(px, Replicated) and d == pi.dim:
        return Split(pi.dim)  # a table without batch: each index reads it along the batch dim
    return None


def scatter(ctx: RuleContext) -> Placement | None:
    """``scatter(x, dim, index, src)`` / ``scatter_add`` / ``scatter_reduce``: writes of each
    sample's ``src`` into the same sample of ``x`` along another dim; ``x``, ``index`` and a tensor
    ``src`` split alike (a scalar ``value`` carries no batch)."""
    x, dim, index = ctx.node.args[0], ctx.arg(1, "dim"), ctx.arg(2, "index")
    src = ctx.arg(3, "src", ctx.node.kwargs.get("value"))
    px = ctx.p(x)
    if not isinstance(px, Split) or not _same_split(ctx.p(index), px):
        return None
    if isinstance(src, fx.Node) and not _same_split(ctx.p(src), px):
        return None
    d = _dim(ctx, x, dim, px.dim)
    return Split(px.dim) if d is not None and d != px.dim else None


def _same_split(q: Placement, p: Split) -> bool:
    return isinstance(q, Split) and q.dim == p.dim


def index_select(ctx: RuleContext) -> Placement | None:
    """``index_select(x, dim, index)``: rows of another dim of a split ``x``; or, of a table that
    carries no batch, the rows a split ``index`` names (an embedding lookup by another name)."""
    x, dim, index = ctx.node.args[0], ctx.arg(1, "dim"), ctx.arg(2, "index")
    px, pi = ctx.p(x), ctx.p(index)
    if isinstance(px, Split) and isinstance(pi, Replicated):
        d = _dim(ctx, x, dim, px.dim)
        return Split(px.dim) if d is not None and d != px.dim else None
    if isinstance(px, Replicated) and isinstance(pi, Split) and pi.dim == 0 and isinstance(dim, int):
        nd = ctx.ndim(x)
        if dim < 0 and nd is None:
            return None
        return Split(dim % nd if nd else dim)
    return None


def index_put(ctx: RuleContext) -> Placement | None:
    """``index_put(x, indices, values)`` (``x[:, i] = v``): writes that leave the batch dim whole
    (``None`` there and before it) with one index tensor that carries no batch; the values carry no
    batch and do not reach the batch dim, or are split there alike."""
    x, indices, values = ctx.node.args[0], ctx.arg(1, "indices"), ctx.arg(2, "values")
    px = ctx.p(x)
    if not isinstance(px, Split) or not isinstance(indices, (list, tuple)):
        return None
    used = [i for i in indices if i is not None]
    if len(used) != 1 or not isinstance(used[0], fx.Node) or not isinstance(ctx.p(used[0]), Replicated):
        return None
    if any(i is not None for i in indices[: px.dim + 1]) or ctx.ndim(used[0]) != 1:
        return None  # the batch dim is indexed, or indexed dims may move in front of it
    pv = ctx.p(values)
    nd, nv = ctx.ndim(x), ctx.ndim(values)
    if isinstance(pv, Split):
        return px if nd is not None and nv == nd and pv.dim == px.dim else None
    if isinstance(pv, Replicated) and nd is not None and nv is not None and nv < nd - px.dim:
        return px
    return None


def slice_scatter(ctx: RuleContext) -> Placement | None:
    """``slice_scatter(x, src, dim, start, end, step)`` / ``select_scatter(x, src, dim, i)``: the
    functional form of ``x[:, 1:] = src``, along a non-batch dim, ``x`` and ``src`` split alike."""
    x, src = ctx.node.args[0], ctx.arg(1, "src")
    px, ps = ctx.p(x), ctx.p(src)
    dim = ctx.arg(2, "dim", 0)
    if not isinstance(px, Split):
        return None
    d = _dim(ctx, x, dim, px.dim)
    if d is None or d == px.dim:
        return None
    want = px.dim - 1 if target_name(ctx.node) == "select_scatter" and d < px.dim else px.dim
    return px if isinstance(ps, Split) and ps.dim == want else None


def along_named_dims(ctx: RuleContext) -> Placement | None:
    """``_fft_r2c(x, dims, ...)`` / ``_fft_c2r``: transforms along the named dims, per sample
    unless one of them is the batch dim."""
    x = ctx.tensor_arg()
    p = ctx.p(x)
    dims = ctx.arg(1, "dim")
    if not isinstance(p, Split) or not isinstance(dims, (list, tuple)):
        return None
    normal = [_dim(ctx, x, d, p.dim) for d in dims]
    return p if all(d is not None and d != p.dim for d in normal) else None


def cdist(ctx: RuleContext) -> Placement | None:
    """``cdist(x1, x2)``: distances from each row of ``x1`` to every row of ``x2``; per row of a
    split ``x1`` against an ``x2`` that carries no batch, or batched (``(B, P, M)``) both split on dim 0."""
    x1, x2 = ctx.node.args[0], ctx.arg(1, "x2")
    p1, p2 = ctx.p(x1), ctx.p(x2)
    n1 = ctx.ndim(x1)
    if not isinstance(p1, Split) or n1 is None:
        return None
    if isinstance(p2, Replicated) and ctx.ndim(x2) == 2 and p1.dim == n1 - 2:
        return p1
    if isinstance(p2, Split) and p2.dim == p1.dim and p1.dim < n1 - 2 and ctx.ndim(x2) == n1:
        return p1
    return None


def stride(ctx: RuleContext) -> Placement | None:
    """``x.stride(d)`` of a contiguous chunk: the same on every device for the split dim and the
    dims after it (their strides do not count the batch)."""
    x, dim = ctx.node.args[0], ctx.arg(1, "dim")
    p = ctx.p(x)
    d = _dim(ctx, x, dim, p.dim) if isinstance(p, Split) else None
    shape = node_shape(x)
    return REPLICATED if d is not None and d >= p.dim and shape is not None else None


__all__ = [
    "gather",
    "scatter",
    "index_select",
    "index_put",
    "slice_scatter",
    "along_named_dims",
    "cdist",
    "stride",
]
