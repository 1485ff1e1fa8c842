"""Per-op rules: how an op maps the placements of its inputs to the placement of its output.

A rule gets a :class:`RuleContext` and returns a :class:`Placement`, or ``None`` when the op
cannot run on chunks of the batch (the propagation then gathers its inputs and runs it once).
Rules only see nodes with at least one batch-carrying input; ``Partial`` and reduced
``Whole`` inputs are shown to them as replicated (they are combined before use).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from dpcompile.analysis.placement import (
    REPLICATED,
    BatchSize,
    Packed,
    Partial,
    Placement,
    Replicated,
    Split,
    Tuple,
    Whole,
)
from dpcompile.runtime import flatten_parameters as runtime_flatten_parameters


@dataclass
class RuleContext:
    node: fx.Node
    placements: Mapping[fx.Node, Placement]
    module: nn.Module | None

    def p(self, value: Any) -> Placement:
        if isinstance(value, fx.Node):
            placement = self.placements[value]
            if isinstance(placement, Partial) or (isinstance(placement, Whole) and not placement.batch):
                return REPLICATED
            return placement
        if isinstance(value, (list, tuple)):
            items = [self.p(v) for v in value]
            if all(isinstance(i, Replicated) for i in items):
                return REPLICATED
            return Tuple(tuple(items))
        return REPLICATED

    def inputs(self) -> list[Placement]:
        return [self.p(n) for n in self.node.all_input_nodes]

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        args = self.node.args  # call_method args start with self, like call_function's tensor
        if index < len(args):
            return args[index]
        return self.node.kwargs.get(name, default)

    def tensor_arg(self) -> Any:
        return self.node.args[0] if self.node.args else None

    def ndim(self, value: Any) -> int | None:
        if isinstance(value, fx.Node):
            shape = node_shape(value)
            return None if shape is None else len(shape)
        return None

    def out_ndim(self) -> int | None:
        return self.ndim(self.node)


def node_shape(node: fx.Node) -> tuple[int, ...] | None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(val.shape)
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return tuple(tm.shape)
    return None


Rule = Callable[[RuleContext], Placement | None]


def _origin(splits: list[Split]) -> str | None:
    origins = {s.origin for s in splits}
    return origins.pop() if len(origins) == 1 else None


def pointwise(ctx: RuleContext) -> Placement | None:
    """Element-wise ops (with broadcasting): every batch-carrying input split on the same dim."""
    splits: list[tuple[Split, fx.Node]] = []
    for n in ctx.node.all_input_nodes:
        p = ctx.p(n)
        if isinstance(p, Split):
            splits.append((p, n))
        elif not isinstance(p, Replicated):
            return None
    out_ndim = ctx.out_ndim()
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
    out_shape = node_shape(ctx.node)
    for n in ctx.node.all_input_nodes:
        if isinstance(ctx.p(n), Replicated):
            shape = node_shape(n)
            if shape is not None and len(shape) > out_ndim - 1 - out_dim and len(shape) > 0:
                at = out_dim - (out_ndim - len(shape))
                if at >= 0 and shape[at] != 1 and out_shape is not None and shape[at] == out_shape[out_dim]:
                    return None  # a replicated operand lines up with the batch: the batch is not per-sample here
    keep_origin = all(ctx.ndim(n) == out_ndim for _, n in splits)
    return Split(out_dim, _origin([p for p, _ in splits]) if keep_origin else None)


def per_sample_dim0(ctx: RuleContext) -> Placement | None:
    """Modules that treat dim 0 as the batch and every sample alike (conv, pooling, ...)."""
    p = ctx.p(ctx.tensor_arg())
    others = [ctx.p(n) for n in ctx.node.all_input_nodes[1:]]
    if isinstance(p, Split) and p.dim == 0 and all(isinstance(o, Replicated) for o in others):
        return p
    return None


def last_dim_op(ctx: RuleContext) -> Placement | None:
    """Ops on the last dims only (Linear, LayerNorm, Embedding lookups): any other dim may be split."""
    p = ctx.p(ctx.tensor_arg())
    others = [ctx.p(n) for n in ctx.node.all_input_nodes[1:]]
    if not isinstance(p, Split) or not all(isinstance(o, Replicated) for o in others):
        return None
    nd = ctx.ndim(ctx.tensor_arg())
    if nd is not None and p.dim >= nd - 1:
        return None
    return p


def embedding(ctx: RuleContext) -> Placement | None:
    p = ctx.p(ctx.tensor_arg())
    if isinstance(p, Split) and all(isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes[1:]):
        return p
    return None


def softmax_like(ctx: RuleContext) -> Placement | None:
    """softmax / log_softmax / cumsum: fine unless the dim is the batch dim."""
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split):
        return None
    if ctx.module is not None:
        dim = getattr(ctx.module, "dim", None)
    else:
        dim = ctx.arg(1, "dim")
    dim = _normalize_dim(dim, ctx.ndim(ctx.tensor_arg()), p.dim)
    if dim is None or dim == p.dim:
        return None
    return p


AFTER_BATCH = 1 << 20  # "some dim after the batch dim", where shapes are unknown


def _normalize_dim(dim: Any, ndim: int | None, batch_dim: int) -> int | None:
    """A non-negative dim, or None if unknown. Without shapes, a negative dim of a tensor
    split on dim 0 names some dim after it (true of every batched tensor of 2+ dims)."""
    if not isinstance(dim, int):
        return None
    if dim >= 0:
        return dim
    if ndim is not None:
        return dim + ndim
    return AFTER_BATCH if batch_dim == 0 else None


def flatten(ctx: RuleContext) -> Placement | None:
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split):
        return None
    if ctx.module is not None:
        start, end = ctx.module.start_dim, ctx.module.end_dim
    else:
        start, end = ctx.arg(1, "start_dim", 0), ctx.arg(2, "end_dim", -1)
    nd = ctx.ndim(ctx.tensor_arg())
    start_n = _normalize_dim(start, nd, p.dim)
    if start_n is None:
        return None
    if p.dim < start_n:
        return p
    if p.dim == start_n:  # rows of a chunk stay contiguous blocks of the flattened whole
        return Split(p.dim)
    end_n = _normalize_dim(end, nd, p.dim)
    if end_n is not None and p.dim > end_n and nd is not None:
        return Split(p.dim - (end_n - start_n))
    return None


def reshape(ctx: RuleContext) -> Placement | None:
    """view / reshape: the batch must stay at the front, as -1 or as the chunk's own size."""
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split) or p.dim != 0:
        return None
    node = ctx.node
    rest = list(node.args[1:]) if node.op == "call_method" else list(node.args[1:])
    if node.op == "call_function":
        rest = list(node.args[1:]) or [node.kwargs.get("shape")]
    if not rest:
        rest = [node.kwargs.get("shape") or node.kwargs.get("size")]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        rest = list(rest[0])
    elif len(rest) == 1 and isinstance(rest[0], fx.Node) and isinstance(ctx.p(rest[0]), BatchSize):
        shape_p = ctx.p(rest[0])
        return Split(0) if shape_p.shape_of_dim == 0 else None
    if not rest:
        return None
    first, tail = rest[0], rest[1:]
    if any(not isinstance(ctx.p(t), Replicated) for t in tail if isinstance(t, fx.Node)):
        return None
    if first == -1 and all(not (isinstance(t, int) and t == -1) for t in tail):
        return Split(0)
    if isinstance(first, fx.Node) and ctx.p(first) == BatchSize():
        return Split(0, p.origin)
    return None


def permute(ctx: RuleContext) -> Placement | None:
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split):
        return None
    node = ctx.node
    dims = list(node.args[1:]) if node.op == "call_method" else [node.args[1]] if len(node.args) > 1 else []
    if not dims:
        dims = [node.kwargs.get("dims")]
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = list(dims[0])
    nd = len(dims)
    dims = [d + nd if isinstance(d, int) and d < 0 else d for d in dims]
    if p.dim in dims:
        return Split(dims.index(p.dim))
    return None


def transpose(ctx: RuleContext) -> Placement | None:
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split):
        return None
    nd = ctx.ndim(ctx.tensor_arg())
    a, b = ctx.arg(1, "dim0"), ctx.arg(2, "dim1")
    if not isinstance(a, int) or not isinstance(b, int):
        return None
    if (a < 0 or b < 0) and nd is None:
        if p.dim == 0 and a != 0 and b != 0:
            return p  # negative dims on a batched tensor do not name dim 0 here (checked with shapes)
        return None
    if nd is not None:
        a, b = a % nd, b % nd
    if p.dim == a:
        return Split(b)
    if p.dim == b:
        return Split(a)
    return p


def matrix_transpose(ctx: RuleContext) -> Placement | None:
    p = ctx.p(ctx.tensor_arg())
    nd = ctx.ndim(ctx.tensor_arg())
    if isinstance(p, Split) and (nd == 2 or nd is None) and p.dim in (0, 1):
        return Split(1 - p.dim)
    return None


def unsqueeze(ctx: RuleContext) -> Placement | None:
    p = ctx.p(ctx.tensor_arg())
    dim = ctx.arg(1, "dim")
    if not isinstance(p, Split) or not isinstance(dim, int):
        return None
    nd = ctx.ndim(ctx.tensor_arg())
    if dim < 0:
        if nd is None:
            return p if p.dim == 0 else None
        dim += nd + 1
    return Split(p.dim + 1 if dim <= p.dim else p.dim)


def squeeze(ctx: RuleContext) -> Placement | None:
    p = ctx.p(ctx.tensor_arg())
    dim = ctx.arg(1, "dim")
    if not isinstance(p, Split) or not isinstance(dim, int):
        return None  # squeeze() could drop a batch of one
    nd = ctx.ndim(ctx.tensor_arg())
    if dim < 0:
        if nd is None:
            return p if p.dim == 0 else None
        dim += nd
    if dim == p.dim:
        return None
    return Split(p.dim - 1 if dim < p.dim else p.dim)


def cat(ctx: RuleContext) -> Placement | None:
    tensors = ctx.node.args[0] if ctx.node.args else ctx.node.kwargs.get("tensors")
    dim = ctx.node.args[1] if len(ctx.node.args) > 1 else ctx.node.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int):
        return None
    placements = [ctx.p(t) for t in tensors]
    if not all(isinstance(q, Split) for q in placements):
        return None
    dims = {q.dim for q in placements}
    if len(dims) != 1:
        return None
    d = dims.pop()
    nd = ctx.ndim(tensors[0])
    stacking = ctx.node.target is torch.stack
    if dim < 0:
        if nd is None:
            return Split(d) if d == 0 else None  # a negative dim lies after dim 0 of a batched tensor
        dim += nd + (1 if stacking else 0)
    if stacking:  # a new dim at `dim`: the batch dim moves right if it was at or after it
        return Split(d + 1 if dim <= d else d)
    return None if dim == d else Split(d)


def getitem(ctx: RuleContext) -> Placement | None:
    base, index = ctx.node.args
    p = ctx.p(base)
    if isinstance(p, Tuple):
        if isinstance(index, int) and -len(p.items) <= index < len(p.items):
            return p.items[index]
        return None
    if isinstance(p, BatchSize):
        if p.shape_of_dim is None:
            return None
        if isinstance(index, int):
            return BatchSize() if index == p.shape_of_dim else REPLICATED
        return None
    if not isinstance(p, Split):
        return None
    if is_container_access(ctx.node):
        return p
    return _index_tensor(ctx, p, index)


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
        node.target is operator.getitem or key not in TENSOR_ATTRIBUTES
    )


TENSOR_ATTRIBUTES = {"dtype", "device", "ndim", "is_cuda", "requires_grad", "layout", "shape", "T", "mT", "data", "grad"}


def _index_tensor(ctx: RuleContext, p: Split, index: Any) -> Placement | None:
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(i, fx.Node) and not isinstance(ctx.p(i), Replicated) for i in items):
        return None
    if any(isinstance(i, fx.Node) for i in items):
        return None  # advanced indexing: keep it simple and correct
    if Ellipsis in items:
        at = items.index(Ellipsis)
        before = items[:at]
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


def size(ctx: RuleContext) -> Placement | None:
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split):
        return None
    dim = ctx.arg(1, "dim")
    if dim is None:
        return BatchSize(shape_of_dim=p.dim)
    nd = ctx.ndim(ctx.tensor_arg())
    if isinstance(dim, int):
        if dim < 0 and nd is not None:
            dim += nd
        if dim == p.dim:
            return BatchSize()
        if dim >= 0 or p.dim == 0:
            return REPLICATED
    return None


def tensor_attribute(ctx: RuleContext) -> Placement | None:
    base, name = ctx.node.args[0], ctx.node.args[1]
    p = ctx.p(base)
    if isinstance(p, Split) and name not in TENSOR_ATTRIBUTES and is_container_access(ctx.node):
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


def factory(ctx: RuleContext) -> Placement | None:
    """torch.zeros(n, b, h): a batch size among the sizes makes a tensor split there."""
    sizes = [a for a in ctx.node.args if not isinstance(a, fx.Node) or True]
    if ctx.node.op == "call_method":
        sizes = sizes[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
        sizes = list(sizes[0])
    batch_at = [i for i, s in enumerate(sizes) if isinstance(s, fx.Node) and ctx.p(s) == BatchSize()]
    rest_ok = all(
        not isinstance(s, fx.Node) or isinstance(ctx.p(s), Replicated)
        for i, s in enumerate(sizes)
        if i not in batch_at
    )
    kwargs_ok = all(
        not isinstance(v, fx.Node) or isinstance(ctx.p(v), Replicated) for v in ctx.node.kwargs.values()
    )
    if len(batch_at) == 1 and rest_ok and kwargs_ok:
        return Split(batch_at[0])
    return None


def _reduction_dims(ctx: RuleContext) -> tuple[Any, bool]:
    dim = ctx.arg(1, "dim")
    keepdim = ctx.arg(2, "keepdim", False)
    return dim, bool(keepdim)


def reduction(kind: str | None) -> Rule:
    """sum/mean (kind) become partial results over the batch; other reductions must avoid it."""

    def rule(ctx: RuleContext) -> Placement | None:
        p = ctx.p(ctx.tensor_arg())
        if not isinstance(p, Split) or any(
            not isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes[1:]
        ):
            return None
        dim, keepdim = _reduction_dims(ctx)
        if isinstance(dim, fx.Node):
            return None
        nd = ctx.ndim(ctx.tensor_arg())
        if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
            return Partial(kind) if kind else None
        dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
        if not all(isinstance(d, int) for d in dims):
            return None
        if any(d < 0 for d in dims):
            if nd is None:
                if p.dim != 0:
                    return None
            else:
                dims = [d % nd for d in dims]
        if p.dim in dims:
            if kind and not keepdim and len(dims) == 1:
                return Partial(kind)
            return None
        if keepdim:
            return p
        shift = sum(1 for d in dims if 0 <= d < p.dim)
        return Split(p.dim - shift)

    return rule


LOSS_FUNCTIONS: dict[Callable, str] = {
    F.mse_loss: "elementwise",
    F.l1_loss: "elementwise",
    F.smooth_l1_loss: "elementwise",
    F.huber_loss: "elementwise",
    F.binary_cross_entropy: "elementwise",
    F.binary_cross_entropy_with_logits: "elementwise",
    F.cross_entropy: "class",
    F.nll_loss: "class",
}

LOSS_MODULES: dict[type[nn.Module], Callable] = {
    nn.MSELoss: F.mse_loss,
    nn.L1Loss: F.l1_loss,
    nn.SmoothL1Loss: F.smooth_l1_loss,
    nn.HuberLoss: F.huber_loss,
    nn.BCELoss: F.binary_cross_entropy,
    nn.BCEWithLogitsLoss: F.binary_cross_entropy_with_logits,
    nn.CrossEntropyLoss: F.cross_entropy,
    nn.NLLLoss: F.nll_loss,
}


def loss_kwargs_of_module(module: nn.Module) -> dict[str, Any]:
    """The functional keyword arguments equivalent to a loss module's attributes."""
    out: dict[str, Any] = {"reduction": module.reduction}
    for name in ("ignore_index", "label_smoothing", "beta", "delta"):
        if hasattr(module, name):
            out[name] = getattr(module, name)
    return out


def bind_loss(fn: Callable, args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound


def loss(ctx: RuleContext) -> Placement | None:
    """Losses: ``reduction='none'`` stays split; ``'mean'``/``'sum'`` become partial sums."""
    if ctx.module is not None:
        fn = LOSS_MODULES[type(ctx.module)]
        settings = loss_kwargs_of_module(ctx.module)
        has_weight = getattr(ctx.module, "weight", None) is not None or getattr(ctx.module, "pos_weight", None) is not None
        bound = bind_loss(fn, tuple(ctx.node.args), dict(ctx.node.kwargs))
        if bound is None:
            return None
        reduction_ = settings["reduction"]
        smoothing = settings.get("label_smoothing", 0.0)
    else:
        fn = ctx.node.target
        bound = bind_loss(fn, tuple(ctx.node.args), dict(ctx.node.kwargs))
        if bound is None:
            return None
        if bound.arguments.get("size_average") is not None or bound.arguments.get("reduce") is not None:
            return None
        reduction_ = bound.arguments.get("reduction", "mean")
        smoothing = bound.arguments.get("label_smoothing", 0.0)
        has_weight = bound.arguments.get("weight") is not None
    first, second = list(bound.arguments.values())[:2]
    p_in, p_target = ctx.p(first), ctx.p(second)
    extra = [
        ctx.p(v) for k, v in bound.arguments.items() if k not in list(bound.arguments)[:2] and isinstance(v, fx.Node)
    ]
    if not (isinstance(p_in, Split) and p_in.dim == 0 and isinstance(p_target, Split) and p_target.dim == 0):
        return None
    if LOSS_FUNCTIONS[fn] == "elementwise" and any(not isinstance(e, Replicated) for e in extra):
        if not all(isinstance(e, (Replicated, Split)) and getattr(e, "dim", 0) == 0 for e in extra):
            return None
    elif any(not isinstance(e, Replicated) for e in extra):
        return None
    if not isinstance(reduction_, str):
        return None
    if reduction_ == "none":
        return Split(0)
    if reduction_ == "sum":
        return Partial("sum")
    if reduction_ == "mean":
        if LOSS_FUNCTIONS[fn] == "class" and has_weight and smoothing:
            return None  # PyTorch's weighted, smoothed mean has no simple partial form
        return Partial("loss_mean")
    return None


def rnn(ctx: RuleContext) -> Placement | None:
    module = ctx.module
    assert isinstance(module, nn.RNNBase)
    x = ctx.tensor_arg()
    p = ctx.p(x)
    hx = ctx.node.args[1] if len(ctx.node.args) > 1 else ctx.node.kwargs.get("hx")
    p_hx = ctx.p(hx) if hx is not None else None
    batch_dim = 0 if module.batch_first else 1
    if isinstance(p, Packed):
        out = Packed(p.dim)
    elif isinstance(p, Split) and p.dim == batch_dim:
        nd = ctx.ndim(x)
        if nd == 2:
            return None  # an unbatched sequence
        out = p
    else:
        return None
    state = Split(1)
    if p_hx is not None:
        # h (and an LSTM's c) split on dim 1, as separate values or as one input holding both
        parts = p_hx.items if isinstance(p_hx, Tuple) and isinstance(module, nn.LSTM) else (p_hx,)
        if not all(isinstance(q, Split) and q.dim == 1 for q in parts):
            return None
    hidden = Tuple((state, state)) if isinstance(module, nn.LSTM) else state
    return Tuple((out, hidden))


def rnn_cell(ctx: RuleContext) -> Placement | None:
    """RNNCell / GRUCell / LSTMCell: one step for a batch of samples, on dim 0 of the input and
    of the state (an LSTMCell's ``(h, c)``)."""
    x = ctx.tensor_arg()
    p = ctx.p(x)
    if not (isinstance(p, Split) and p.dim == 0) or ctx.ndim(x) == 1:
        return None  # a 1-D input is one unbatched sample
    hx = ctx.node.args[1] if len(ctx.node.args) > 1 else ctx.node.kwargs.get("hx")
    if hx is not None:
        p_hx = ctx.p(hx)
        parts = p_hx.items if isinstance(p_hx, Tuple) and isinstance(ctx.module, nn.LSTMCell) else (p_hx,)
        if not all(isinstance(q, Split) and q.dim == 0 for q in parts):
            return None
    return Tuple((Split(0), Split(0))) if isinstance(ctx.module, nn.LSTMCell) else Split(0)


def multihead_attention(ctx: RuleContext) -> Placement | None:
    module = ctx.module
    batch_dim = 0 if module.batch_first else 1
    q, k, v = (ctx.node.args + (None, None, None))[:3]
    for t in (q, k, v):
        if t is None or ctx.p(t) != Split(batch_dim, ctx.p(t).origin if isinstance(ctx.p(t), Split) else None):
            return None
    for name in ("key_padding_mask", "attn_mask"):
        mask = ctx.node.kwargs.get(name)
        if isinstance(mask, fx.Node):
            pm = ctx.p(mask)
            if name == "key_padding_mask" and not (isinstance(pm, Split) and pm.dim == 0):
                return None
            if name == "attn_mask" and not isinstance(pm, Replicated):
                return None
    if len(ctx.node.args) > 3:
        return None
    need_weights = ctx.node.kwargs.get("need_weights", True)
    return Tuple((Split(batch_dim), Split(0) if need_weights else REPLICATED))


def transformer_layer(ctx: RuleContext) -> Placement | None:
    from dpcompile.analysis.batch_dims import batch_first

    batch_dim = 0 if batch_first(ctx.module) else 1
    x = ctx.tensor_arg()
    p = ctx.p(x)
    if not (isinstance(p, Split) and p.dim == batch_dim):
        return None
    for name, value in list(ctx.node.kwargs.items()) + [(f"arg{i}", a) for i, a in enumerate(ctx.node.args[1:])]:
        if isinstance(value, fx.Node):
            q = ctx.p(value)
            if "padding" in name and isinstance(q, Split) and q.dim == 0:
                continue
            if not isinstance(q, Replicated):
                return None
    return p


def pack_padded(ctx: RuleContext) -> Placement | None:
    x, lengths = ctx.node.args[0], ctx.node.args[1] if len(ctx.node.args) > 1 else ctx.node.kwargs.get("lengths")
    batch_first = ctx.arg(2, "batch_first", False)
    p, pl = ctx.p(x), ctx.p(lengths)
    if not isinstance(batch_first, bool):
        return None
    want = 0 if batch_first else 1
    if isinstance(p, Split) and p.dim == want and isinstance(pl, Split) and pl.dim == 0:
        return Packed(want)
    return None


def pad_packed(ctx: RuleContext) -> Placement | None:
    p = ctx.p(ctx.node.args[0])
    batch_first = ctx.arg(1, "batch_first", False)
    if isinstance(p, Packed) and isinstance(batch_first, bool):
        return Tuple((Split(0 if batch_first else 1), Split(0)))
    return None


def matmul(ctx: RuleContext) -> Placement | None:
    a, b = ctx.node.args[0], ctx.node.args[1]
    pa, pb = ctx.p(a), ctx.p(b)
    na, nb = ctx.ndim(a), ctx.ndim(b)
    if isinstance(pa, Split) and isinstance(pb, Replicated):
        if na is None:
            return pa if pa.dim == 0 else None
        if na >= 2 and pa.dim <= na - 2 and (nb is None or nb <= 2 or pa.dim < na - nb):
            return Split(pa.dim)
        return None
    if isinstance(pa, Split) and isinstance(pb, Split) and pa.dim == pb.dim:
        if na is not None and nb is not None and na == nb and na >= 3 and pa.dim < na - 2:
            return Split(pa.dim)
        if na is None and nb is None and pa.dim == 0:
            return None
    return None


def linear_function(ctx: RuleContext) -> Placement | None:
    x = ctx.node.args[0]
    p = ctx.p(x)
    if isinstance(p, Split) and all(isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes if n is not x):
        nd = ctx.ndim(x)
        if nd is not None and p.dim >= nd - 1:
            return None
        return p
    return None


def to_method(ctx: RuleContext) -> Placement | None:
    """``x.to(dtype)`` is element-wise; moving to a device would defeat the placement."""
    for a in list(ctx.node.args[1:]) + list(ctx.node.kwargs.values()):
        if isinstance(a, (str, torch.device)) or (isinstance(a, fx.Node) and ctx.p(a) != REPLICATED):
            return None
        if isinstance(a, fx.Node):
            return None
    return pointwise(ctx)


def expand(ctx: RuleContext) -> Placement | None:
    p = ctx.p(ctx.tensor_arg())
    sizes = list(ctx.node.args[1:])
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
        sizes = list(sizes[0])
    if not isinstance(p, Split) or p.dim >= len(sizes):
        return None
    nd = ctx.ndim(ctx.tensor_arg())
    offset = len(sizes) - (nd if nd is not None else len(sizes))
    at = p.dim + offset
    entry = sizes[at]
    if entry == -1 or (isinstance(entry, fx.Node) and ctx.p(entry) == BatchSize()):
        others_ok = all(not isinstance(s, fx.Node) or isinstance(ctx.p(s), Replicated) for i, s in enumerate(sizes) if i != at)
        return Split(at) if others_ok else None
    return None


def chunk_like(ctx: RuleContext) -> Placement | None:
    """chunk / split / unbind along a non-batch dim: a tuple of equally split pieces."""
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split):
        return None
    name = ctx.node.target if isinstance(ctx.node.target, str) else ctx.node.target.__name__
    if name == "unbind":
        dim = ctx.arg(1, "dim", 0)
    else:
        dim = ctx.arg(2, "dim", 0)
    nd = ctx.ndim(ctx.tensor_arg())
    dim = _normalize_dim(dim, nd, p.dim)
    if dim is None or dim == p.dim:
        return None
    piece = Split(p.dim - 1 if name == "unbind" and dim < p.dim else p.dim)
    return Tuple(tuple([piece] * 64))


# ---------------------------------------------------------------------------- tables

POINTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.pow,
    operator.neg, operator.pos, operator.abs, operator.mod, operator.invert,
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
    operator.and_, operator.or_, operator.xor,
    torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.pow, torch.neg, torch.abs,
    torch.exp, torch.log, torch.log1p, torch.expm1, torch.sqrt, torch.rsqrt, torch.sin, torch.cos,
    torch.tanh, torch.sigmoid, torch.relu, torch.clamp, torch.clip, torch.where, torch.erf,
    torch.maximum, torch.minimum, torch.sign, torch.square, torch.reciprocal, torch.floor,
    torch.ceil, torch.round, torch.masked_fill, torch.zeros_like, torch.ones_like, torch.full_like,
    torch.empty_like, torch.rand_like, torch.randn_like, torch.lerp, torch.addcmul, torch.addcdiv,
    torch.nan_to_num, torch.isnan, torch.isfinite, torch.logical_and, torch.logical_or,
    torch.logical_not, torch.eq, torch.ne, torch.gt, torch.lt, torch.ge, torch.le,
    F.relu, F.relu6, F.gelu, F.silu, F.elu, F.selu, F.celu, F.leaky_relu, F.softplus, F.softsign,
    F.hardtanh, F.hardswish, F.hardsigmoid, F.mish, F.tanhshrink, F.logsigmoid, F.sigmoid,
    F.tanh, F.dropout, F.alpha_dropout, F.threshold, F.glu,
}

POINTWISE_METHODS = {
    "add", "sub", "mul", "div", "pow", "neg", "abs", "exp", "log", "log1p", "sqrt", "rsqrt",
    "sin", "cos", "tanh", "sigmoid", "relu", "clamp", "clip", "float", "double", "half",
    "bfloat16", "int", "long", "bool", "type_as", "contiguous", "clone", "detach", "masked_fill",
    "add_", "sub_", "mul_", "div_", "relu_", "sigmoid_", "tanh_", "clamp_", "masked_fill_",
    "zero_", "fill_", "exp_", "neg_", "pow_", "sqrt_", "square", "reciprocal", "sign",
    "floor", "ceil", "round", "eq", "ne", "gt", "lt", "ge", "le", "logical_not", "isnan",
    "maximum", "minimum", "where", "lerp", "nan_to_num", "requires_grad_", "detach_",
    "new_zeros_like", "expand_as", "softplus", "erf", "masked_scatter",
}

PER_SAMPLE_MODULES: tuple[type[nn.Module], ...] = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.GroupNorm, nn.InstanceNorm1d,
    nn.InstanceNorm2d, nn.InstanceNorm3d, nn.Upsample, nn.PixelShuffle, nn.PixelUnshuffle,
    nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d, nn.ReflectionPad2d, nn.ReplicationPad2d,
    nn.LocalResponseNorm, nn.Dropout2d, nn.Dropout3d, nn.Dropout1d, nn.PReLU,
)

POINTWISE_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.ELU, nn.SELU, nn.CELU, nn.LeakyReLU, nn.Tanh,
    nn.Sigmoid, nn.Softplus, nn.Softsign, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Mish,
    nn.Identity, nn.Dropout, nn.AlphaDropout, nn.Tanhshrink, nn.LogSigmoid, nn.Threshold,
    nn.GLU,
)

LAST_DIM_MODULES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Bilinear, nn.LayerNorm, nn.RMSNorm)

BATCH_NORMS: tuple[type[nn.Module], ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def module_rule(module: nn.Module) -> Rule | None:
    if isinstance(module, BATCH_NORMS):
        return per_sample_dim0
    if isinstance(module, POINTWISE_MODULES):
        return pointwise
    if isinstance(module, LAST_DIM_MODULES):
        return last_dim_op if not isinstance(module, nn.Bilinear) else pointwise
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
        return None  # its running statistics average over the whole batch, updated once: run it whole
    if isinstance(module, PER_SAMPLE_MODULES):
        return per_sample_dim0
    if isinstance(module, nn.Embedding):
        return embedding
    if isinstance(module, (nn.Softmax, nn.LogSoftmax, nn.Softmin)):
        return softmax_like
    if isinstance(module, nn.Flatten):
        return flatten
    if isinstance(module, nn.RNNBase):
        return rnn
    if isinstance(module, nn.RNNCellBase):
        return rnn_cell
    if isinstance(module, nn.MultiheadAttention):
        return multihead_attention
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerEncoder)):
        return transformer_layer
    if type(module) in LOSS_MODULES:
        return loss
    return None


FUNCTION_RULES: dict[Any, Rule] = {
    **{f: pointwise for f in POINTWISE_FUNCTIONS},
    torch.flatten: flatten,
    torch.reshape: reshape,
    torch.permute: permute,
    torch.transpose: transpose,
    torch.swapaxes: transpose,
    torch.t: matrix_transpose,
    torch.unsqueeze: unsqueeze,
    torch.squeeze: squeeze,
    torch.cat: cat,
    torch.concat: cat,
    torch.stack: cat,
    operator.getitem: getitem,
    getattr: tensor_attribute,
    torch.zeros: factory,
    torch.ones: factory,
    torch.empty: factory,
    torch.full: factory,
    torch.randn: factory,
    torch.rand: factory,
    torch.sum: reduction("sum"),
    torch.mean: reduction("mean"),
    torch.amax: reduction(None),
    torch.amin: reduction(None),
    torch.logsumexp: reduction(None),
    torch.softmax: softmax_like,
    torch.log_softmax: softmax_like,
    torch.cumsum: softmax_like,
    F.softmax: softmax_like,
    F.log_softmax: softmax_like,
    F.linear: linear_function,
    F.layer_norm: last_dim_op,
    F.embedding: embedding,
    F.normalize: softmax_like,
    F.conv1d: per_sample_dim0,
    F.conv2d: per_sample_dim0,
    F.conv3d: per_sample_dim0,
    F.max_pool1d: per_sample_dim0,
    F.max_pool2d: per_sample_dim0,
    F.avg_pool1d: per_sample_dim0,
    F.avg_pool2d: per_sample_dim0,
    F.adaptive_avg_pool1d: per_sample_dim0,
    F.adaptive_avg_pool2d: per_sample_dim0,
    F.adaptive_max_pool2d: per_sample_dim0,
    F.interpolate: per_sample_dim0,
    F.pad: per_sample_dim0,
    torch.matmul: matmul,
    operator.matmul: matmul,
    torch.bmm: matmul,
    torch.chunk: chunk_like,
    torch.split: chunk_like,
    torch.unbind: chunk_like,
    torch.nn.utils.rnn.pack_padded_sequence: pack_padded,
    torch.nn.utils.rnn.pad_packed_sequence: pad_packed,
    **{f: loss for f in LOSS_FUNCTIONS},
}

METHOD_RULES: dict[str, Rule] = {
    **{m: pointwise for m in POINTWISE_METHODS},
    "to": to_method,
    "flatten": flatten,
    "view": reshape,
    "reshape": reshape,
    "permute": permute,
    "transpose": transpose,
    "swapaxes": transpose,
    "t": matrix_transpose,
    "unsqueeze": unsqueeze,
    "squeeze": squeeze,
    "size": size,
    "sum": reduction("sum"),
    "mean": reduction("mean"),
    "amax": reduction(None),
    "amin": reduction(None),
    "logsumexp": reduction(None),
    "softmax": softmax_like,
    "log_softmax": softmax_like,
    "cumsum": softmax_like,
    "matmul": matmul,
    "bmm": matmul,
    "expand": expand,
    "chunk": chunk_like,
    "split": chunk_like,
    "unbind": chunk_like,
    "new_zeros": factory,
    "new_ones": factory,
    "new_empty": factory,
    "new_full": factory,
}


def rule_for(node: fx.Node, module: nn.Module | None) -> Rule | None:
    if node.op == "call_module" and module is not None:
        return module_rule(module)
    if node.op == "call_function":
        if node.target is runtime_flatten_parameters:
            return None
        try:
            rule = FUNCTION_RULES.get(node.target)
        except TypeError:  # unhashable target
            return None
        # --- export frontend: ATen ops of exported graphs (dpcompile/analysis/aten_rules.py) ---
        if rule is None:
            from dpcompile.analysis.aten_rules import aten_rule

            rule = aten_rule(node)
        # --- end export frontend ---
        return rule
    if node.op == "call_method":
        return METHOD_RULES.get(node.target)
    return None


__all__ = ["RuleContext", "rule_for", "node_shape", "LOSS_MODULES", "LOSS_FUNCTIONS", "BATCH_NORMS"]
