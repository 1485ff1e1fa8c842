"""Sharding rules for the shape ops of rotary embeddings and grouped-query attention, and for casts.

Llama's attention, captured by either frontend, runs its head-sharded q and k through
``rotate_half`` (``x[..., :d // 2]`` / ``aten.slice`` on the head dim, ``neg``, ``cat`` on the
head dim), multiplies them by ``cos`` / ``sin`` broadcast over heads (``unsqueeze(1)``), and
repeats the kv heads for grouped-query attention (``k[:, :, None].expand(b, kv, rep, t, d)
.reshape(b, kv * rep, t, d)`` or ``repeat_interleave(rep, dim=1)``). Every one of these keeps a
shard a shard as long as it slices, concatenates or repeats along a dim that is not the sharded
one (or repeats whole heads of it); these rules say so. Casts, copies and dropout leave a
sharded value sharded. Each rule returns ``(layout, replicated args that need f)`` or raises
:class:`NeedsWhole`, as in :mod:`dpcompile.analysis.sharding_rules`.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from dpcompile.analysis.sharding_layout import (
    Layout,
    LayoutContext,
    NeedsWhole,
    Sharded,
    from_end,
    node_arg,
    tensor_ndim,
    tensor_shape,
)

Rule = tuple[Layout, list[fx.Node]]


def _sharded_input(ctx: LayoutContext, node: fx.Node) -> tuple[fx.Node, Sharded]:
    x = node.args[0]
    layout = ctx.layout(x)
    if not isinstance(layout, Sharded):
        raise NeedsWhole("only its first argument may be sharded")
    return x, layout


def cast(ctx: LayoutContext, node: fx.Node) -> Rule:
    """``x.to(dtype)``, ``clone``, ``contiguous``, ``detach``, ``alias``, ``dropout``: the same layout.

    A move to a device is not a cast: each shard lives on its own device."""
    _, layout = _sharded_input(ctx, node)
    extra = [*node.args[1:], *node.kwargs.values()]
    if any(isinstance(a, (torch.device, str, fx.Node)) for a in extra) or node.kwargs.get("device") is not None:
        raise NeedsWhole("a cast that moves the value to a device, or takes another tensor")
    return layout, []


def tuple_dropout(ctx: LayoutContext, node: fx.Node) -> Rule:
    """``aten.native_dropout`` (training): the output and its mask, both laid out as the input."""
    layout = cast(ctx, node)[0]
    ctx.mark_tuple(node)
    return layout, []


def type_as(ctx: LayoutContext, node: fx.Node) -> Rule:
    """``x.type_as(other)``: ``other`` only gives the dtype, whatever its layout."""
    return _sharded_input(ctx, node)[1], []


def _full_dim(start: Any, end: Any, step: Any, extent: int) -> bool:
    return start in (None, 0) and (end is None or (isinstance(end, int) and end >= extent)) and step in (None, 1)


def slice_(ctx: LayoutContext, node: fx.Node) -> Rule:
    """``aten.slice(x, dim, start, end)``: along another dim the shard stays; along the sharded dim only the whole of it."""
    x, layout = _sharded_input(ctx, node)
    dim = from_end(node_arg(node, 1, "dim", 0), tensor_ndim(x))
    if dim != layout.dim:
        return layout, []
    if _full_dim(node_arg(node, 2, "start"), node_arg(node, 3, "end"), node_arg(node, 4, "step", 1), sum(layout.sizes)):
        return layout, []
    raise NeedsWhole("slices the sharded dim")


def getitem(ctx: LayoutContext, node: fx.Node) -> Rule:
    """``x[..., :d // 2]`` (basic indexing: slices, ints, ``None``, ``...``): the sharded dim must be
    taken whole (``:``); the others may be sliced, indexed or added."""
    x, layout = _sharded_input(ctx, node)
    nd = tensor_ndim(x)
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if nd is None or any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) for i in index):
        raise NeedsWhole("indexing with a tensor, or of unknown rank")
    consumed = sum(1 for i in index if isinstance(i, (int, slice)))
    rest = [slice(None)] * (nd - consumed)  # the dims the index leaves implicit: taken whole
    items = [j for i in index for j in (rest if i is Ellipsis else [i])] if Ellipsis in index else [*index, *rest]
    sharded_at, in_dim, out_dim, out_pos = nd + layout.dim, 0, 0, None
    for i in items:
        if i is None:
            out_dim += 1
            continue
        if in_dim == sharded_at:
            if not (isinstance(i, slice) and _full_dim(i.start, i.stop, i.step, sum(layout.sizes))):
                raise NeedsWhole("indexes or slices the sharded dim")
            out_pos = out_dim
        out_dim += 0 if isinstance(i, int) else 1
        in_dim += 1
    assert out_pos is not None
    return dataclasses.replace(layout, dim=out_pos - out_dim), []


def cat(ctx: LayoutContext, node: fx.Node) -> Rule:
    """``torch.cat([a, b], dim)``: every part sharded alike, joined along another dim."""
    parts = node_arg(node, 0, "tensors")
    layouts = [ctx.layout(p) for p in parts] if isinstance(parts, (list, tuple)) else []
    if not layouts or not all(isinstance(la, Sharded) for la in layouts):
        raise NeedsWhole("concatenates sharded and whole tensors")
    ref = layouts[0]
    assert isinstance(ref, Sharded)
    if any(not ref.same_split(la) for la in layouts):  # type: ignore[arg-type]
        raise NeedsWhole("concatenates tensors sharded differently")
    if from_end(node_arg(node, 1, "dim", 0), tensor_ndim(parts[0])) == ref.dim:
        raise NeedsWhole("concatenates along the sharded dim")
    origins = frozenset().union(*(la.origins for la in layouts))  # type: ignore[union-attr]
    return dataclasses.replace(ref, origins=origins), []


def unsqueeze(ctx: LayoutContext, node: fx.Node) -> Rule:
    """``x.unsqueeze(d)``: the sharded dim moves one further from the end when the new dim is after it."""
    x, layout = _sharded_input(ctx, node)
    nd, d = tensor_ndim(x), node_arg(node, 1, "dim")
    if not isinstance(d, int):
        raise NeedsWhole("unsqueeze of a computed dim")
    new = from_end(d, None if nd is None else nd + 1) if d >= 0 else d  # the new dim, counted from the end of the result
    return dataclasses.replace(layout, dim=layout.dim - (1 if new >= layout.dim else 0)), []


def expand(ctx: LayoutContext, node: fx.Node) -> Rule:
    """``x.expand(b, kv, rep, t, d)``: broadcasts other dims; the sharded extent becomes this shard's."""
    x, layout = _sharded_input(ctx, node)
    sizes = node.args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
        sizes = tuple(sizes[0])
    shape = tensor_shape(x)
    position = len(sizes) + layout.dim
    if shape is None or position < 0:
        raise NeedsWhole("an expand of unknown shape; pass example_inputs=", problem=True)
    extent = sizes[position]
    if extent != -1:
        if extent != sum(layout.sizes):
            raise NeedsWhole("an expand of the sharded dim", problem=True)
        ctx.rewrite_view(node, position, layout.sizes)
    return layout, []


def repeat_interleave(ctx: LayoutContext, node: fx.Node) -> Rule:
    """``k.repeat_interleave(rep, dim=1)`` on kv heads: each shard repeats its own heads, in order."""
    x, layout = _sharded_input(ctx, node)
    repeats, dim = node_arg(node, 1, "repeats"), node_arg(node, 2, "dim")
    if not isinstance(repeats, int) or not isinstance(dim, int) or node.kwargs.get("output_size") is not None:
        raise NeedsWhole("a repeat_interleave with tensor repeats, no dim or an output size")
    if from_end(dim, tensor_ndim(x)) != layout.dim:
        return layout, []
    sizes = tuple(size * repeats for size in layout.sizes)
    return dataclasses.replace(layout, sizes=sizes, unit=max(1, layout.unit // repeats)), []


def is_basic_getitem(node: fx.Node) -> bool:
    """``x[..., :n]``-style indexing: slices, ints, ``None`` and ``...``, no tensors."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return False
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    return any(isinstance(i, slice) or i is None or i is Ellipsis for i in index) and all(
        i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in index
    )
