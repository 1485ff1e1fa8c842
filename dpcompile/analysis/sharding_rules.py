"""Per-op sharding rules: how an op maps the layouts of its inputs to the layout of its result.

The tensor-parallel counterpart of :mod:`dpcompile.analysis.batch_rules`. A value of one
shard's program is :class:`Sharded` (split along a dim, counted from the end), replicated
(:data:`~dpcompile.analysis.placement.REPLICATED`, the same whole tensor on every shard),
:class:`Copied` (a replicated value passed through *f* into a sharded region) or
:class:`NotTensor` (a Python value, the same everywhere). A rule returns the layout of the
result and the replicated tensor arguments that need *f*, or raises :class:`NeedsWhole`: the
op then runs on gathered, whole inputs. An op no rule here names is answered by its batch rule
(:mod:`dpcompile.analysis.sharding_batch`: one rule table, the sharded dim as the split dim)::

    torch.cos(column_out)   -> no sharding rule; the pointwise batch rule: Sharded(-1), no gather

:mod:`dpcompile.analysis.sharding` walks a graph with these rules.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from dpcompile import runtime
from dpcompile.analysis import ops
from dpcompile.analysis import sharding_rules_shape as shape_rules
from dpcompile.analysis.placement import REPLICATED, Replicated
from dpcompile.analysis.random_ops import written_fill_method
from dpcompile.analysis.sharding_batch import from_batch_rule, keeps_last_dim_sharded
from dpcompile.analysis.sharding_layout import (  # noqa: F401 - the layouts, re-exported for the analysis and passes
    COPIED,
    NOT_TENSOR,
    Copied,
    Layout,
    LayoutContext,
    NeedsWhole,
    NotTensor,
    Sharded,
    describe_op,
    flat_nodes,
    from_end,
    may_need_grad,
    node_arg,
    node_val,
    tensor_ndim,
    tensor_shape,
)


# ---------------------------------------------------------------------- rules
def apply_rule(ctx: LayoutContext, node: fx.Node, modules: Mapping[str, nn.Module]) -> tuple[Layout, list[fx.Node]]:
    """The layout of ``node``'s result and the replicated tensor args that need *f*; or raise :class:`NeedsWhole`.
    An op no sharding rule names asks its batch rule (:func:`~dpcompile.analysis.sharding_batch.from_batch_rule`)."""
    op, target = node.op, node.target
    if op == "call_module":
        module = modules.get(target)
        if ops.SHARD_UNARY.matches(node, modules):
            return unary(ctx, node)
        if ops.SHARD_SOFTMAX.matches(node, modules):
            return softmax(ctx, node, module.dim)
        return from_batch_rule(ctx, node, modules)  # no sharding rule names it: its batch rule, if any
    if op == "call_function" and target is F.cross_entropy:
        return cross_entropy(ctx, node)
    if op == "call_function" and target in (operator.getitem, getattr) and ctx.is_tuple(node.args[0]):
        return ctx.layout(node.args[0]), []  # one part of a split / unbind (sort(..).values): laid out as every part
    if op == "call_function" and target is runtime.written and not node.args[1] and written_fill_method(node):
        return unary(ctx, node)  # y.normal_() of a whole activation: a draw per element, as y is laid out
    if shape_rules.is_basic_getitem(node):
        return shape_rules.getitem(ctx, node)
    for family, rule in _RULES:
        if family.matches(node):
            return rule(ctx, node)
    if op == "call_function" and target is getattr and len(node.args) > 1:
        if node.args[1] in ("dtype", "ndim"):
            return NOT_TENSOR, []
        if node.args[1] == "shape":
            return shape(ctx, node)
    if op == "call_method" and target == "size":
        return size(ctx, node)
    if op == "call_method" and target == "dim":
        return NOT_TENSOR, []
    return from_batch_rule(ctx, node, modules)  # no sharding rule names it: its batch rule, if any


def unary(ctx: LayoutContext, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
    x, *rest = flat_nodes((node.args, node.kwargs))
    layout = ctx.layout(x)
    if not isinstance(layout, Sharded) or any(not isinstance(ctx.layout(a), NotTensor) for a in rest):
        raise NeedsWhole("an element-wise op with more than one tensor")
    return layout, []


def elementwise(ctx: LayoutContext, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
    operands = flat_nodes((node.args, node.kwargs))
    ref = next(ctx.layout(a) for a in operands if isinstance(ctx.layout(a), Sharded))
    assert isinstance(ref, Sharded)
    origins, copies = set(ref.origins), []
    for a in operands:
        la = ctx.layout(a)
        if isinstance(la, Sharded):
            if not la.same_split(ref):
                raise NeedsWhole("operands sharded differently")
            origins |= la.origins
        elif isinstance(la, (Replicated, Copied)):
            shape = tensor_shape(a)
            if shape is None:
                raise NeedsWhole("a replicated operand of unknown shape")
            if len(shape) >= -ref.dim and shape[len(shape) + ref.dim] != 1:
                raise NeedsWhole("a replicated operand spans the sharded dim")
            copies.append(a)
    return dataclasses.replace(ref, origins=frozenset(origins)), copies


def softmax(ctx: LayoutContext, node: fx.Node, dim: Any) -> tuple[Layout, list[fx.Node]]:
    x = node.args[0]
    layout = ctx.layout(x)
    if not isinstance(layout, Sharded) or not isinstance(dim, int):
        raise NeedsWhole("softmax over an unknown dim")
    if from_end(dim, tensor_ndim(x)) == layout.dim:
        raise NeedsWhole("softmax over the sharded dim")
    return layout, []


def matmul(ctx: LayoutContext, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
    a, b = node.args[0], node.args[1]
    la, lb = ctx.layout(a), ctx.layout(b)
    if isinstance(la, Sharded) and isinstance(lb, Sharded) and la.same_split(lb) and la.sections == 1 and la.dim <= -3:
        return Sharded(la.dim, la.sizes, la.origins | lb.origins, la.unit), []
    raise NeedsWhole("a matmul that contracts or mixes the sharded dim")


def attention(ctx: LayoutContext, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
    q, k, v = node.args[:3]
    lq, lk, lv = ctx.layout(q), ctx.layout(k), ctx.layout(v)
    if not all(isinstance(layout, Sharded) for layout in (lq, lk, lv)):
        raise NeedsWhole("attention with q, k, v not all sharded")
    if len({layout.dim for layout in (lq, lk, lv)}) == 1 and len({layout.sizes for layout in (lq, lk, lv)}) > 1:  # type: ignore[union-attr]
        raise NeedsWhole(
            f"q, k and v hold different heads per shard ({', '.join(str(list(la.sizes)) for la in (lq, lk, lv))}): "  # type: ignore[union-attr]
            "with grouped-query attention each shard needs whole kv heads and their query heads, so "
            "num_key_value_heads must divide by the number of devices",
            problem=True,
        )
    if len({(layout.dim, layout.sizes, layout.sections) for layout in (lq, lk, lv)}) != 1 or lq.dim > -3 or lq.sections > 1:  # type: ignore[union-attr]
        raise NeedsWhole("attention with q, k, v sharded differently or along a sequence/feature dim")
    copies = []
    mask = node_arg(node, 3, "attn_mask")
    if isinstance(mask, fx.Node):
        lm = ctx.layout(mask)
        if isinstance(lm, Sharded):
            if (lm.dim, lm.sizes) != (lq.dim, lq.sizes):  # type: ignore[union-attr]
                raise NeedsWhole("a mask sharded differently")
        else:
            shape = tensor_shape(mask)
            spans = shape is not None and len(shape) >= -lq.dim and shape[len(shape) + lq.dim] != 1  # type: ignore[union-attr]
            if spans and shape[len(shape) + lq.dim] == sum(lq.sizes):  # type: ignore[union-attr,index]
                ctx.split_arg(node, mask, lq.dim, lq.sizes)  # a bias per head (T5's position bias): each shard its heads'
            elif shape is None or spans:
                raise NeedsWhole("a replicated mask that spans the sharded dim")
            else:
                copies.append(mask)
    origins = lq.origins | lk.origins | lv.origins  # type: ignore[union-attr]
    return Sharded(lq.dim, lq.sizes, origins, lq.unit), copies  # type: ignore[union-attr]


def transpose(ctx: LayoutContext, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
    x = node.args[0]
    layout = ctx.layout(x)
    assert isinstance(layout, Sharded)
    a, b = node_arg(node, 1, "dim0"), node_arg(node, 2, "dim1")
    if not (isinstance(a, int) and isinstance(b, int)):
        raise NeedsWhole("transpose with computed dims")
    nd = tensor_ndim(x)
    a, b = from_end(a, nd), from_end(b, nd)
    dim = b if layout.dim == a else a if layout.dim == b else layout.dim
    return dataclasses.replace(layout, dim=dim), []


def permute(ctx: LayoutContext, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
    x = node.args[0]
    layout = ctx.layout(x)
    assert isinstance(layout, Sharded)
    dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
    nd = tensor_ndim(x)
    if nd is None or not all(isinstance(d, int) for d in dims):
        raise NeedsWhole("permute of unknown rank; pass example_inputs=")
    normal = [d % nd for d in dims]
    return dataclasses.replace(layout, dim=normal.index(layout.dim + nd) - nd), []


def size(ctx: LayoutContext, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
    x = node.args[0]
    layout = ctx.layout(x)
    assert isinstance(layout, Sharded)
    dim = node_arg(node, 1, "dim")
    if dim is None:  # x.size(): as x.shape
        return shape(ctx, node)
    if not isinstance(dim, int):
        raise NeedsWhole("reads the size of a computed dim")
    if from_end(dim, tensor_ndim(x)) == layout.dim:
        if node.users and all(ops.VIEW.matches(u) for u in node.users):
            ctx.mark_sharded_size(node)  # only as a view's sharded extent, which the view rewrites per shard
            return NOT_TENSOR, []
        raise NeedsWhole("reads the size of the sharded dim")
    return NOT_TENSOR, []


def shape(ctx: LayoutContext, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
    """``x.shape`` / ``x.size()`` of a sharded ``x``: the local shape, fine while every use
    reads one other dim (``k.shape[-1]``); anything else needs the whole tensor."""
    x = node.args[0]
    layout = ctx.layout(x)
    assert isinstance(layout, Sharded)
    for user in node.users:
        index = user.args[1] if user.op == "call_function" and user.target is operator.getitem and len(user.args) == 2 else None
        if user.args[0] is not node or not isinstance(index, int) or from_end(index, tensor_ndim(x)) == layout.dim:
            raise NeedsWhole("reads the size of the sharded dim")
    return NOT_TENSOR, []


def view(ctx: LayoutContext, node: fx.Node, first: int) -> tuple[Layout, list[fx.Node]]:
    x = node.args[0]
    layout = ctx.layout(x)
    assert isinstance(layout, Sharded)
    shape_args = node.args[first:]
    if len(shape_args) == 1 and isinstance(shape_args[0], (list, tuple)):
        shape_args = tuple(shape_args[0])
    if not shape_args or any(isinstance(s, fx.Node) and not isinstance(ctx.layout(s), NotTensor) for s in shape_args):
        raise NeedsWhole("a view whose shape is a computed tensor", problem=True)
    in_shape, out_shape = tensor_shape(x), tensor_shape(node)
    if in_shape is None or out_shape is None or len(shape_args) != len(out_shape):
        raise NeedsWhole(
            "shapes are unknown (no example_inputs=, or fake-tensor shape propagation failed), so the "
            "sharded constant cannot be checked; pass example_inputs=",
            problem=True,
        )
    d = len(in_shape) + layout.dim
    before, full = math.prod(in_shape[:d]), in_shape[d]
    j = next((i for i in range(len(out_shape) + 1) if math.prod(out_shape[:i]) == before), None)
    while j is not None and j < len(out_shape) and out_shape[j] == 1 and full != 1:
        j += 1
    if j is None or j == len(out_shape):
        raise NeedsWhole("the view mixes the sharded dim with the dims before it", problem=True)
    s = layout.sections
    if out_shape[j] == full:
        sizes, unit = layout.sizes, layout.unit
        if shape_args[j] != -1:
            ctx.rewrite_view(node, j, sizes)
        return dataclasses.replace(layout, dim=j - len(out_shape)), []
    if s > 1:  # a fused projection: (.., 3 * features) -> (.., 3, heads, head_dim), q, k, v each split
        if out_shape[j] != s or j + 1 == len(out_shape):
            raise NeedsWhole(f"a view that does not separate the {s} fused sections first", problem=True)
        j, full = j + 1, full // s
        sizes, unit = tuple(size // s for size in layout.sizes), layout.unit
        if out_shape[j] == full:
            if shape_args[j] != -1:
                ctx.rewrite_view(node, j, sizes)
            return Sharded(j - len(out_shape), sizes, layout.origins, unit), []
        layout = Sharded(layout.dim, sizes, layout.origins, unit)
    if out_shape[j] < full:
        k = next((i for i in range(j + 1, len(out_shape) + 1) if math.prod(out_shape[j:i]) == full), None)
        inner = full // out_shape[j]
        if k is None or full % out_shape[j]:
            raise NeedsWhole("the view splits the sharded dim unevenly", problem=True)
        if s == 1 and 1 < out_shape[j] <= 4 and k >= j + 3:  # (.., 3 * C) -> (.., 3, heads, head_dim): fused qkv
            raise NeedsWhole(f"the view splits a fused projection into {out_shape[j]} sections", problem=True, sections=out_shape[j])
        if any(size % inner for size in layout.sizes):
            raise NeedsWhole(
                f"shard sizes {list(layout.sizes)} of a dim of {full} do not split into {out_shape[j]} x {inner}",
                problem=True,
                granularity=inner * layout.unit,
            )
        sizes, unit = tuple(size // inner for size in layout.sizes), layout.unit * inner
    else:
        m = next((i for i in range(d + 1, len(in_shape) + 1) if math.prod(in_shape[d:i]) == out_shape[j]), None)
        if m is None:
            raise NeedsWhole("the view merges the sharded dim unevenly", problem=True)
        inner = out_shape[j] // full
        sizes, unit = tuple(size * inner for size in layout.sizes), max(1, layout.unit // inner)
    if shape_args[j] != -1:
        ctx.rewrite_view(node, j, sizes)
    return Sharded(j - len(out_shape), sizes, layout.origins, unit), []


def cross_entropy(ctx: LayoutContext, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
    """``F.cross_entropy`` of logits sharded along the vocabulary: a vocab-parallel loss (each
    shard's logsumexp all-gathered, the target logit all-reduced), the full logits never gathered."""
    logits, target = node.args[0], node_arg(node, 1, "target")
    layout = ctx.layout(logits)
    if not isinstance(layout, Sharded) or layout.sections != 1 or tensor_ndim(logits) != 2 or from_end(layout.dim, 2) != -1:
        raise NeedsWhole("a cross-entropy whose logits are not (N, classes) sharded along the classes")
    if not isinstance(target, fx.Node) or isinstance(ctx.layout(target), Sharded):
        raise NeedsWhole("a cross-entropy with a sharded target")
    v = node_val(target)
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        raise NeedsWhole("a cross-entropy with class probabilities as target")
    cross_entropy_options(node)  # raises for class weights, label smoothing, legacy arguments
    ctx.mark_vocab_loss(node, layout.sizes)
    return REPLICATED, [target]


_ATEN_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def cross_entropy_options(node: fx.Node) -> dict[str, Any]:
    """``reduction`` and ``ignore_index`` of an ``F.cross_entropy`` or ``aten.cross_entropy_loss``
    call, as ``F.cross_entropy``'s keywords; :class:`NeedsWhole` for what the vocab-parallel loss lacks."""
    aten = isinstance(node.target, torch._ops.OpOverload)
    names = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing") if aten else (
        "input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")  # fmt: skip
    bound = {**dict(zip(names, node.args)), **node.kwargs}
    if bound.get("weight") is not None or bound.get("label_smoothing", 0.0) != 0.0:
        raise NeedsWhole("a cross-entropy with class weights or label smoothing")
    if bound.get("size_average") is not None or bound.get("reduce") is not None:
        raise NeedsWhole("a cross-entropy with a legacy reduction argument")
    reduction = _ATEN_REDUCTIONS.get(bound.get("reduction", 1)) if aten else bound.get("reduction", "mean")
    if reduction not in ("mean", "sum", "none") or not isinstance(bound.get("ignore_index", -100), int):
        raise NeedsWhole("a cross-entropy with an unknown reduction or a computed ignore_index")
    return {"reduction": reduction, "ignore_index": bound.get("ignore_index", -100)}


def checked_view(ctx: LayoutContext, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
    """:func:`view`, where the size of a sharded dim (``logits.size(-1)``) may only be the extent the view rewrites."""
    result = view(ctx, node, 1)
    shape_args = node.args[1:]
    if len(shape_args) == 1 and isinstance(shape_args[0], (list, tuple)):
        shape_args = tuple(shape_args[0])
    for position, a in enumerate(shape_args):
        if ctx.is_sharded_size(a) and ctx.rewritten_at(node) != position:
            raise NeedsWhole("the size of a sharded dim is used as another extent of a view", problem=True)
    return result


def split(ctx: LayoutContext, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
    """``split`` / ``chunk`` / ``unbind`` of a sharded value: every part laid out alike.

    Along another dim the parts keep the layout (``unbind`` drops the dim). Along the sharded
    dim, a fused projection's ``sections`` equal parts (``qkv.split(C, -1)``) each hold their
    section's slice; an unsectioned value split in 2-4 equal parts asks its origin layers to be
    sharded as that many sections.
    """
    x = node.args[0]
    layout = ctx.layout(x)
    assert isinstance(layout, Sharded)
    target = node.target.overloadpacket if isinstance(node.target, torch._ops.OpOverload) else node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    nd = tensor_ndim(x)
    shape_in = tensor_shape(x)
    dim = from_end(node_arg(node, 1 if name == "unbind" else 2, "dim", 0), nd)
    if not isinstance(dim, int):
        raise NeedsWhole("a split along a computed dim")
    ctx.mark_tuple(node)
    if dim != layout.dim:
        if name == "unbind":
            return dataclasses.replace(layout, dim=layout.dim + (1 if layout.dim < dim else 0)), []
        return layout, []
    if name == "unbind" or shape_in is None:
        raise NeedsWhole("splits the sharded dim")
    full = sum(layout.sizes)  # the whole extent of the sharded dim
    arg = node_arg(node, 1, "split_size_or_sections" if name == "split" else "chunks")
    if name == "chunk" and isinstance(arg, int):
        parts = arg
    elif name == "split" and isinstance(arg, int) and arg > 0 and full % arg == 0:
        parts = full // arg
    else:
        raise NeedsWhole("splits the sharded dim unevenly")
    if parts == layout.sections and parts > 1:
        per = tuple(size // parts for size in layout.sizes)
        if name == "split":
            ctx.rewrite_view(node, 0, per)
        return Sharded(layout.dim, per, layout.origins, layout.unit), []
    if layout.sections == 1 and 1 < parts <= 4:
        raise NeedsWhole(f"splits a fused projection into {parts} sections", problem=True, sections=parts)
    raise NeedsWhole("splits the sharded dim")


def _softmax_over_dim(ctx: LayoutContext, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
    return softmax(ctx, node, node_arg(node, 1, "dim"))


# each op family a sharded value passes through, and its rule (functions and methods)
_RULES: tuple[tuple[ops.OpFamily, Callable[[LayoutContext, fx.Node], tuple[Layout, list[fx.Node]]]], ...] = (
    (ops.SHARD_UNARY, unary),
    (ops.SHARD_RANDOM, unary),
    (ops.SHARD_BINARY, elementwise),
    (ops.SHARD_SOFTMAX, _softmax_over_dim),
    (ops.MATMUL, matmul),
    (ops.SHARD_ATTENTION, attention),
    (ops.VIEW, checked_view),
    (ops.SHARD_TRANSPOSE, transpose),
    (ops.PERMUTE, permute),
    (ops.SHARD_SPLIT, split),
    # the export frontend's ATen overloads of the same ops
    (ops.SHARD_ATEN_UNARY, unary),
    (ops.SHARD_ATEN_BINARY, elementwise),
    (ops.SHARD_ATEN_SOFTMAX, _softmax_over_dim),
    (ops.SHARD_ATEN_MATMUL, matmul),
    (ops.SHARD_ATEN_ATTENTION, attention),
    (ops.SHARD_ATEN_VIEW, checked_view),
    (ops.SHARD_ATEN_TRANSPOSE, transpose),
    (ops.SHARD_ATEN_SPLIT, split),
    (ops.SHARD_ATEN_PERMUTE, permute),
    (ops.SHARD_ATEN_CROSS_ENTROPY, cross_entropy),
    # rotary embeddings, grouped-query attention, casts (both forms)
    (ops.SHARD_CAST, shape_rules.cast),
    (ops.SHARD_TUPLE_DROPOUT, shape_rules.tuple_dropout),
    (ops.SHARD_TYPE_AS, shape_rules.type_as),
    (ops.SHARD_SLICE, shape_rules.slice_),
    (ops.SHARD_CAT, shape_rules.cat),
    (ops.SHARD_UNSQUEEZE, shape_rules.unsqueeze),
    (ops.SHARD_EXPAND, shape_rules.expand),
    (ops.SHARD_REPEAT_INTERLEAVE, shape_rules.repeat_interleave),
)
SHARD_TRANSPARENT = tuple(family for family, _ in _RULES)
RULES = _RULES  # each op family and its rule, as docs/sharding_rules_coverage.md lists them


def is_shard_transparent(node: fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    """True for ops a sharded value can pass through (given matching shapes): element-wise,
    softmax, matmul over batch dims, attention, views, transposes; and an op no sharding rule
    names whose batch rule keeps a last-dim shard sharded (``torch.log``, ``x.flatten(0, 1)``)."""
    return names_a_sharding_rule(node, modules) or keeps_last_dim_sharded(node, modules)


def names_a_sharding_rule(node: fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    """Whether a sharding rule of this module (not the batch-rule table) names ``node``'s op."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        if ops.SHARD_SPLIT.matches(node.args[0], modules) or ops.SHARD_ATEN_SPLIT.matches(node.args[0]):
            return True  # a part of q, k, v
        return shape_rules.is_basic_getitem(node)
    return any(family.matches(node, modules) for family in SHARD_TRANSPARENT)
