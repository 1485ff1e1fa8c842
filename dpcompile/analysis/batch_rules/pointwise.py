"""Element-wise ops (with broadcasting): the result is split as its batch-carrying inputs are."""

from __future__ import annotations

import torch
import torch.fx as fx

from dpcompile.analysis import ops
from dpcompile.analysis.batch_rules.context import RuleContext, node_shape, target_name
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.placement import (
    Placement,
    Replicated,
    Split,
    Tuple,
)


def _origin(splits: list[Split]) -> str | None:
    origins = {s.origin for s in splits}
    return origins.pop() if len(origins) == 1 else None


def pointwise(ctx: RuleContext) -> Placement | None:
    """Element-wise ops (with broadcasting): every batch-carrying input split on the same dim."""
    if len(ctx.node.args) == 1 and not ctx.node.kwargs and target_name(ctx.node) == "where":
        return None  # where(cond): the indices of the whole tensor's true elements
    return _broadcast_split(ctx, ctx.node.all_input_nodes, ctx.out_ndim(), node_shape(ctx.node))


def broadcast_tensors(ctx: RuleContext) -> Placement | None:
    """``broadcast_tensors(x, y, ...)``: each output split as an element-wise op of them would be."""
    value = ctx.node.meta.get("val")
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, torch.Tensor) for v in value):
        return None
    out = _broadcast_split(ctx, ctx.node.all_input_nodes, value[0].dim(), tuple(value[0].shape))
    return None if out is None else Tuple((out,) * len(value))


def _broadcast_split(ctx: RuleContext, inputs: list[fx.Node], out_ndim: int | None, out_shape: tuple | None) -> Placement | None:
    splits: list[tuple[Split, fx.Node]] = []
    for n in inputs:
        p = ctx.p(n)
        if isinstance(p, Split):
            splits.append((p, n))
        elif not isinstance(p, Replicated):
            return None
    if out_ndim is None:
        dims = {p.dim for p, _ in splits}
        if len(dims) != 1:
            return None
        return Split(dims.pop(), _origin([p for p, _ in splits]))
    aligned = set()
    for p, n in splits:
        nd = ctx.ndim(n)
        if nd is None:
            return None
        aligned.add(p.dim + out_ndim - nd)
    if len(aligned) != 1:
        return None
    out_dim = aligned.pop()
    if out_dim < 0:
        return None  # an input of higher rank than the output (not broadcasting): no dim lines up
    for n in inputs:
        if isinstance(ctx.p(n), Replicated):
            shape = node_shape(n)
            if shape is not None and len(shape) > out_ndim - 1 - out_dim and len(shape) > 0:
                at = out_dim - (out_ndim - len(shape))
                if at >= 0 and shape[at] != 1 and out_shape is not None and shape[at] == out_shape[out_dim]:
                    return None  # a replicated operand lines up with the batch: the batch is not per-sample here
    keep_origin = all(ctx.ndim(n) == out_ndim for _, n in splits)
    return Split(out_dim, _origin([p for p, _ in splits]) if keep_origin else None)


def to_method(ctx: RuleContext) -> Placement | None:
    """``x.to(dtype)`` / ``x.to(y)`` / ``x.to(y.device)`` / ``x.to(y.dtype)``: element-wise. What it
    takes from ``y`` (its dtype and device) is the same for each device's chunk as for the whole,
    and a device's chunk of ``y`` lives on that device, so each chunk stays where it runs. A
    device spelled out (``x.to("cuda:0")``) would move every chunk to one device: whole."""
    values = list(ctx.node.args[1:]) + list(ctx.node.kwargs.values())
    if any(isinstance(a, (str, torch.device)) for a in values):
        return None
    for a in values:
        if isinstance(a, fx.Node) and not (_same_on_each_device(ctx, a) or isinstance(ctx.p(a), Split)):
            return None
    first = ctx.node.args[1] if len(ctx.node.args) > 1 else ctx.node.kwargs.get("other")
    p = ctx.p(ctx.tensor_arg())
    if isinstance(p, Split) and isinstance(first, fx.Node) and isinstance(ctx.p(first), Split):
        return p  # x.to(y): only y's dtype and device are read; x keeps its own split
    if any(isinstance(a, fx.Node) and isinstance(ctx.p(a), Split) for a in values):
        return None  # a replicated x moved to the device of a split y: each device's own copy
    return pointwise(ctx)


def type_as(ctx: RuleContext) -> Placement | None:
    """``x.type_as(y)``: ``x`` in ``y``'s type. Only ``y``'s type is read, the same for a chunk as
    for the whole, so ``x`` keeps its own placement whatever ``y``'s rank: split (Funnel's
    ``attention_mask.type_as(inputs_embeds)``) or replicated (PEGASUS-X's
    ``torch.arange(d).type_as(inputs_embeds)``, each device's own copy)."""
    x, y = ctx.tensor_arg(), ctx.arg(1, "other")
    p = ctx.p(x)
    if isinstance(p, (Split, Replicated)) and isinstance(ctx.p(y), (Split, Replicated)):
        return p
    return pointwise(ctx)


def _same_on_each_device(ctx: RuleContext, node: fx.Node) -> bool:
    """``y.dtype``, or ``y.device`` of a chunk or of a parameter (each device's replica's own
    device): what ``x.to`` takes from them moves no chunk to another device."""
    if not (node.op == "call_function" and node.target is getattr and isinstance(node.args[0], fx.Node)):
        return False
    if node.args[1] == "dtype":
        return True
    base = node.args[0]
    return node.args[1] == "device" and (isinstance(ctx.p(base), Split) or base.op == "get_attr")


BATCH_RULES.register_family(ops.POINTWISE, pointwise)
BATCH_RULES.register("to", to_method)
for _target in (torch.broadcast_tensors, torch.ops.aten.broadcast_tensors):
    BATCH_RULES.register(_target, broadcast_tensors)
BATCH_RULES.register("type_as", type_as, replace=True)  # a binary op of ops.POINTWISE that reads only y's type
for _name in ("__radd__", "__rsub__", "__rmul__", "__rdiv__", "__rtruediv__", "__rpow__", "__rmod__", "__rfloordiv__"):
    _fn = getattr(torch.Tensor, _name, None)  # 2 + x called as a function (fx records operator.add)
    if callable(_fn) and _fn not in BATCH_RULES.functions:  # __rtruediv__ is __rdiv__
        BATCH_RULES.register(_fn, pointwise)
