"""Batch rules for the ATen ops of an exported graph (the export frontend).

``torch.export`` gives ``torch.ops.aten.*`` calls where fx gives modules, functions and
methods. Rules are keyed by op overload *packet* (``aten.view`` covers ``aten.view.default``);
most reuse the fx-level rules of :mod:`~dpcompile.analysis.batch_rules`, whose argument
positions are those of the ATen schemas. Ops without a rule run whole after a gather (correct,
not parallel).

One convention is specific to exported graphs: ``aten.arange(b)`` of a chunk's batch size
``b`` holds that chunk's *local* batch indices, which is what indexing a split tensor along its
batch needs (transformers' attention masks do ``mask[batch_arange, head, q, kv]``); it is split
only where every use is such an index.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dpcompile.analysis.batch_rules.context import Rule, RuleContext, node_shape, normalize_dim
from dpcompile.analysis.batch_rules.matrix import linear_function, matmul
from dpcompile.analysis.batch_rules.modules import pad, per_sample_dim0
from dpcompile.analysis.batch_rules.pointwise import pointwise
from dpcompile.analysis.batch_rules.reductions import reduction, softmax_like
from dpcompile.analysis.batch_rules.shape import expand as expand_split
from dpcompile.analysis.batch_rules.shape import (
    flatten,
    matrix_transpose,
    permute,
    reshape,
    squeeze,
    transpose,
    unsqueeze,
)
from dpcompile.analysis.placement import REPLICATED, BatchSize, Partial, Placement, Replicated, Split, Tuple
from dpcompile.runtime import exported as frontend

aten = torch.ops.aten
INT64_MAX = 9223372036854775807


def _split(ctx: RuleContext, value: Any) -> Split | None:
    p = ctx.p(value)
    return p if isinstance(p, Split) else None


def _others_replicated(ctx: RuleContext, *skip: Any) -> bool:
    return all(isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes if n not in skip)


def addmm(ctx: RuleContext) -> Placement | None:
    """``addmm(bias, x, w)``: rows of ``x`` are samples."""
    x = ctx.node.args[1]
    p = _split(ctx, x)
    if p is not None and p.dim == 0 and _others_replicated(ctx, x):
        return Split(0)
    return None


def embedding(ctx: RuleContext) -> Placement | None:
    """``embedding(weight, indices)``: the output is split as the indices."""
    weight, indices = ctx.node.args[0], ctx.node.args[1]
    p = _split(ctx, indices)
    if p is not None and isinstance(ctx.p(weight), Replicated):
        return Split(p.dim)
    return None


def layer_norm(ctx: RuleContext) -> Placement | None:
    """``layer_norm(x, normalized_shape, w, b)``: any dim before the normalised ones may be split."""
    x = ctx.node.args[0]
    p = _split(ctx, x)
    shape = ctx.node.args[1]
    nd = ctx.ndim(x)
    if p is None or not _others_replicated(ctx, x) or not isinstance(shape, (list, tuple)):
        return None
    if nd is not None and p.dim >= nd - len(shape):
        return None
    return p


def batch_norm(ctx: RuleContext) -> Placement | None:
    """Batch norm with running statistics (eval) is per sample; with batch statistics it needs
    the whole batch (a module call, which the export frontend restores where it can, keeps
    whole-batch statistics across devices instead)."""
    target = ctx.node.target
    if target.overloadpacket is aten._native_batch_norm_legit_no_training:
        training = False
    elif target.overloadpacket is aten.batch_norm:
        training = ctx.node.args[5] if len(ctx.node.args) > 5 else True
    else:
        training = True
    if training:
        return None
    p = per_sample_dim0(ctx)
    if p is None:
        return None
    if target.overloadpacket is aten._native_batch_norm_legit_no_training:
        return Tuple((p, REPLICATED, REPLICATED))
    return p


def sdpa(ctx: RuleContext) -> Placement | None:
    """``scaled_dot_product_attention(q, k, v, mask)``: the same batch dim (before the last two)
    split in q, k, v; the mask split there too or replicated."""
    args = list(ctx.node.args) + [None] * 4
    q, k, v, mask = args[:4]
    mask = ctx.node.kwargs.get("attn_mask", mask)
    ps = [_split(ctx, t) for t in (q, k, v)]
    if any(p is None for p in ps) or len({p.dim for p in ps}) != 1:
        return None
    dim = ps[0].dim
    nd = ctx.ndim(q)
    if nd is not None and dim >= nd - 2:
        return None
    if isinstance(mask, fx.Node):
        pm = ctx.p(mask)
        if isinstance(pm, Split):
            if ctx.ndim(mask) != nd or pm.dim != dim:
                return None
        elif not isinstance(pm, Replicated):
            return None
    for key, value in ctx.node.kwargs.items():
        if key != "attn_mask" and isinstance(value, fx.Node) and not isinstance(ctx.p(value), Replicated):
            return None
    return Split(dim)


def sym_size(ctx: RuleContext) -> Placement | None:
    """``sym_size(x, d)``: the batch size where ``d`` is the split dim."""
    x, dim = ctx.node.args[0], ctx.node.args[1]
    p = _split(ctx, x)
    if p is None or not isinstance(dim, int):
        return None
    nd = ctx.ndim(x)
    if dim < 0 and nd is not None:
        dim += nd
    return BatchSize() if dim == p.dim else REPLICATED


def expand(ctx: RuleContext) -> Placement | None:
    """``expand(x, sizes)``: a split ``x`` keeps its split; a replicated one expanded to the batch
    size (``mask.expand(b, -1, t, t)``) becomes split there."""
    x = ctx.node.args[0]
    sizes = list(ctx.node.args[1]) if len(ctx.node.args) > 1 and isinstance(ctx.node.args[1], (list, tuple)) else None
    if sizes is None:
        return None
    p = ctx.p(x)
    if isinstance(p, Split):
        return expand_split(ctx)
    if not isinstance(p, Replicated):
        return None
    batch_at = [i for i, s in enumerate(sizes) if isinstance(s, fx.Node) and ctx.p(s) == BatchSize()]
    rest = [s for i, s in enumerate(sizes) if i not in batch_at and isinstance(s, fx.Node)]
    if len(batch_at) == 1 and all(isinstance(ctx.p(s), Replicated) for s in rest):
        return Split(batch_at[0])
    return None


def slice_(ctx: RuleContext) -> Placement | None:
    """``slice(x, dim, start, end, step)``: any slice of another dim; all of the batch dim."""
    x = ctx.node.args[0]
    p = _split(ctx, x)
    if p is None or not _others_replicated(ctx, x):
        return None
    args = list(ctx.node.args) + [None] * 5
    dim, start, end, step = (args[1] if args[1] is not None else 0), args[2], args[3], args[4]
    nd = ctx.ndim(x)
    if isinstance(dim, int) and dim < 0 and nd is not None:
        dim += nd
    if not isinstance(dim, int):
        return None
    if dim != p.dim:
        return p
    whole = start in (None, 0) and (end is None or (isinstance(end, int) and end >= INT64_MAX)) and step in (None, 1)
    return p if whole else None


def select(ctx: RuleContext) -> Placement | None:
    """``select(x, dim, i)`` of a non-batch dim."""
    x, dim = ctx.node.args[0], ctx.node.args[1]
    p = _split(ctx, x)
    if p is None or not isinstance(dim, int) or not _others_replicated(ctx, x):
        return None
    nd = ctx.ndim(x)
    if dim < 0:
        if nd is None:
            return None
        dim += nd
    if dim == p.dim:
        return None
    return Split(p.dim - 1 if dim < p.dim else p.dim)


def split_like(ctx: RuleContext) -> Placement | None:
    """``split(x, n, dim)`` / ``split_with_sizes`` / ``chunk`` / ``unbind(x, dim)`` along a non-batch dim."""
    x = ctx.node.args[0]
    p = _split(ctx, x)
    if p is None:
        return None
    unbind = ctx.node.target.overloadpacket is aten.unbind
    dim = ctx.arg(1, "dim", 0) if unbind else ctx.arg(2, "dim", 0)
    dim = normalize_dim(dim, ctx.ndim(x), p.dim)
    if dim is None or dim == p.dim:
        return None
    piece = Split(p.dim - 1 if unbind and dim < p.dim else p.dim)
    return Tuple(tuple([piece] * 64))


def cat(ctx: RuleContext) -> Placement | None:
    """``cat(tensors, dim)`` / ``stack``: every tensor split on the same dim, another dim joined."""
    tensors = ctx.node.args[0]
    dim = ctx.node.args[1] if len(ctx.node.args) > 1 else 0
    if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int):
        return None
    ps = [ctx.p(t) for t in tensors]
    if not all(isinstance(q, Split) for q in ps) or len({q.dim for q in ps}) != 1:
        return None
    d = ps[0].dim
    nd = ctx.ndim(tensors[0])
    stacking = ctx.node.target.overloadpacket is aten.stack
    if dim < 0:
        if nd is None:
            return Split(d) if d == 0 else None
        dim += nd + (1 if stacking else 0)
    if stacking:
        return Split(d + 1 if dim <= d else d)
    return None if dim == d else Split(d)


def new_factory(ctx: RuleContext) -> Placement | None:
    """``x.new_ones(sizes)`` and friends: split where a size is the batch size."""
    sizes = ctx.node.args[1] if len(ctx.node.args) > 1 else None
    if not isinstance(sizes, (list, tuple)):
        return None
    batch_at = [i for i, s in enumerate(sizes) if isinstance(s, fx.Node) and ctx.p(s) == BatchSize()]
    others = [s for i, s in enumerate(sizes) if i not in batch_at and isinstance(s, fx.Node)]
    if len(batch_at) == 1 and all(isinstance(ctx.p(s), Replicated) for s in others):
        return Split(batch_at[0])
    return None


def factory(ctx: RuleContext) -> Placement | None:
    """``full(sizes, v)`` / ``ones`` / ``zeros`` / ``empty``: split where a size is the batch size."""
    sizes = ctx.node.args[0] if ctx.node.args else None
    if not isinstance(sizes, (list, tuple)):
        return None
    batch_at = [i for i, s in enumerate(sizes) if isinstance(s, fx.Node) and ctx.p(s) == BatchSize()]
    others = [s for i, s in enumerate(sizes) if i not in batch_at and isinstance(s, fx.Node)]
    kwargs_ok = all(not isinstance(v, fx.Node) or isinstance(ctx.p(v), Replicated) for v in ctx.node.kwargs.values())
    if len(batch_at) == 1 and kwargs_ok and all(isinstance(ctx.p(s), Replicated) for s in others):
        return Split(batch_at[0])
    return None


_INDEX_PATH = {"unsqueeze", "view", "reshape", "_unsafe_view", "expand", "slice", "clone", "contiguous", "to", "_to_copy"}


def _only_indexes(node: fx.Node, depth: int = 0) -> bool:
    """Whether every use of ``node`` (through reshapes) is as an index of ``aten.index``."""
    if depth > 12 or not node.users:
        return False
    for user in node.users:
        if user.op != "call_function" or not isinstance(user.target, torch._ops.OpOverload):
            return False
        name = user.target.overloadpacket.__name__
        if name == "index" and user.args[0] is not node:
            continue
        if name in _INDEX_PATH and user.args[0] is node:
            if not _only_indexes(user, depth + 1):
                return False
            continue
        return False
    return True


def arange(ctx: RuleContext) -> Placement | None:
    """``arange(b)`` of the batch size: each chunk's local batch indices, where only used as an index."""
    args = ctx.node.args
    end = args[0] if ctx.node.target is aten.arange.default else None
    if isinstance(end, fx.Node) and ctx.p(end) == BatchSize() and len(args) == 1 and _only_indexes(ctx.node):
        return Split(0)
    return None


def index(ctx: RuleContext) -> Placement | None:
    """``x[i0, i1, ...]`` (``aten.index``): ``x`` split on dim 0, indexed on it by local batch
    indices (split) and elsewhere by replicated ones; the result is split where ``i0`` is."""
    x, indices = ctx.node.args[0], ctx.node.args[1]
    p = _split(ctx, x)
    if p is None or p.dim != 0 or not isinstance(indices, (list, tuple)) or not indices:
        return None
    first = indices[0]
    if not isinstance(first, fx.Node):
        return None
    pi = ctx.p(first)
    if not isinstance(pi, Split):
        return None
    if any(isinstance(i, fx.Node) and not isinstance(ctx.p(i), Replicated) for i in indices[1:]):
        return None
    shapes = [node_shape(i) for i in indices if isinstance(i, fx.Node)]
    if any(s is None for s in shapes):
        return None
    nd = max(len(s) for s in shapes)
    return Split(pi.dim + nd - len(shapes[0]))


def reduction_sum(ctx: RuleContext) -> Placement | None:
    return reduction("sum")(ctx)


def reduction_mean(ctx: RuleContext) -> Placement | None:
    return reduction("mean")(ctx)


def reduction_other(ctx: RuleContext) -> Placement | None:
    return reduction(None)(ctx)


def summed_loss(ctx: RuleContext) -> Placement | None:
    """A loss with ``reduction=sum`` (the export frontend writes ``mean`` as ``sum / count``) over
    inputs split on dim 0: partial sums; ``reduction=none`` stays split."""
    target = ctx.node.target
    names = [a.name for a in target._schema.arguments]
    bound = dict(zip(names, ctx.node.args))
    bound.update(ctx.node.kwargs)
    reduction = bound.get("reduction", 1)
    first, second = ctx.node.args[0], ctx.node.args[1]
    p1, p2 = _split(ctx, first), _split(ctx, second)
    if p1 is None or p2 is None or p1.dim != 0 or p2.dim != 0 or not _others_replicated(ctx, first, second):
        return None
    if reduction == 0:
        return Split(0)
    if reduction == 2:
        return Partial("sum")
    return None


def count(ctx: RuleContext) -> Placement | None:
    """The count of a mean loss (``cross_entropy_count``, ``element_count``): summed over chunks."""
    p = _split(ctx, ctx.node.args[0])
    if p is not None and p.dim == 0 and _others_replicated(ctx, ctx.node.args[0]):
        return Partial("sum")
    return None


def diff(ctx: RuleContext) -> Placement | None:
    """``diff(x, n, dim, prepend, append)`` along a non-batch dim."""
    x = ctx.node.args[0]
    p = _split(ctx, x)
    dim = ctx.arg(2, "dim", -1)
    if p is None:
        return None
    dim = normalize_dim(dim, ctx.ndim(x), p.dim)
    if dim is None or dim == p.dim:
        return None
    for extra in ctx.node.all_input_nodes[1:]:
        q = ctx.p(extra)
        if not (isinstance(q, Replicated) or (isinstance(q, Split) and q.dim == p.dim)):
            return None
    return p


def mode_check(ctx: RuleContext) -> Placement | None:
    return REPLICATED


POINTWISE = (
    "add", "sub", "rsub", "mul", "div", "pow", "neg", "abs", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt",
    "sin", "cos", "tanh", "sigmoid", "relu", "gelu", "silu", "elu", "leaky_relu", "hardtanh", "hardswish",
    "hardsigmoid", "mish", "softplus", "erf", "where", "masked_fill", "clamp", "clamp_min", "clamp_max",
    "eq", "ne", "lt", "le", "gt", "ge", "__and__", "__or__", "__xor__", "__invert__", "bitwise_and",
    "bitwise_or", "bitwise_not", "bitwise_xor", "logical_and", "logical_or", "logical_not", "logical_xor",
    "maximum", "minimum", "reciprocal", "square", "sign", "floor", "ceil", "round", "trunc", "isnan",
    "isinf", "isfinite", "nan_to_num", "lerp", "addcmul", "addcdiv", "clone", "contiguous", "detach",
    "alias", "type_as", "to", "_to_copy", "lift_fresh_copy", "zeros_like", "ones_like", "full_like",
    "empty_like", "rand_like", "randn_like", "dropout", "fmod", "remainder", "floor_divide", "bitwise_left_shift",
    "bitwise_right_shift", "relu6", "glu", "prelu", "logsigmoid", "tril", "triu",
)

PER_SAMPLE = (
    "conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
    "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d",
    "max_pool2d_with_indices", "upsample_nearest2d", "upsample_bilinear2d", "upsample_nearest1d",
    "group_norm", "instance_norm", "pixel_shuffle",
    "pixel_unshuffle", "channel_shuffle",
)


def _packet(name: str) -> Any:
    return getattr(aten, name, None)


ATEN_RULES: dict[Any, Rule] = {}


def register_aten_rule(name: str, rule: Rule) -> None:
    """Teach data parallelism an ATen op (by packet name, ``"addmm"``)."""
    packet = _packet(name)
    if packet is not None:
        ATEN_RULES[packet] = rule


for _name in POINTWISE:
    register_aten_rule(_name, pointwise)
for _name in PER_SAMPLE:
    register_aten_rule(_name, per_sample_dim0)
for _name in ("pad", "constant_pad_nd", "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d"):
    register_aten_rule(_name, pad)
for _name, _rule in {
    "linear": linear_function,
    "addmm": addmm,
    "mm": matmul,
    "bmm": matmul,
    "matmul": matmul,
    "embedding": embedding,
    "layer_norm": layer_norm,
    "rms_norm": layer_norm,
    "batch_norm": batch_norm,
    "_native_batch_norm_legit_no_training": batch_norm,
    "scaled_dot_product_attention": sdpa,
    "softmax": softmax_like,
    "_softmax": softmax_like,
    "log_softmax": softmax_like,
    "_log_softmax": softmax_like,
    "cumsum": softmax_like,
    "view": reshape,
    "reshape": reshape,
    "_unsafe_view": reshape,
    "permute": permute,
    "transpose": transpose,
    "t": matrix_transpose,
    "unsqueeze": unsqueeze,
    "squeeze": squeeze,
    "flatten": flatten,
    "expand": expand,
    "slice": slice_,
    "select": select,
    "split": split_like,
    "split_with_sizes": split_like,
    "chunk": split_like,
    "unbind": split_like,
    "cat": cat,
    "stack": cat,
    "sym_size": sym_size,
    "arange": arange,
    "index": index,
    "new_ones": new_factory,
    "new_zeros": new_factory,
    "new_full": new_factory,
    "new_empty": new_factory,
    "full": factory,
    "ones": factory,
    "zeros": factory,
    "empty": factory,
    "sum": reduction_sum,
    "mean": reduction_mean,
    "amax": reduction_other,
    "amin": reduction_other,
    "argmax": reduction_other,
    "argmin": reduction_other,
    "logsumexp": reduction_other,
    "diff": diff,
    "cross_entropy_loss": summed_loss,
    "nll_loss": summed_loss,
    "nll_loss_nd": summed_loss,
    "mse_loss": summed_loss,
    "l1_loss": summed_loss,
    "smooth_l1_loss": summed_loss,
    "huber_loss": summed_loss,
    "binary_cross_entropy": summed_loss,
    "binary_cross_entropy_with_logits": summed_loss,
}.items():
    register_aten_rule(_name, _rule)


def _function_rules() -> dict[Any, Rule]:
    return {
        frontend.cross_entropy_count: count,
        frontend.element_count: count,
        frontend.expect_value: mode_check,
        frontend.expect_mode: mode_check,
    }


_FUNCTIONS: dict[Any, Rule] | None = None


def aten_rule(node: fx.Node) -> Rule | None:
    """The rule for an ATen op (or a helper the export frontend writes into its graphs)."""
    global _FUNCTIONS
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return ATEN_RULES.get(target.overloadpacket)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return ATEN_RULES.get(target)
    if _FUNCTIONS is None:
        _FUNCTIONS = _function_rules()
    try:
        return _FUNCTIONS.get(target)
    except TypeError:
        return None


__all__ = ["ATEN_RULES", "aten_rule", "register_aten_rule"]
