"""Views and shape ops: reshape, flatten, permute/transpose, (un)squeeze, cat/stack, expand,
chunk/split, ``x.size()``, and factories that read a batch size (``torch.zeros(b, h)``)."""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
import torch.fx as fx

from dpcompile.analysis import ops
from dpcompile.analysis.batch_rules.context import (
    RuleContext,
    node_shape,
    normalize_dim,
    target_name,
    unsharded_shape,
    whole_ratio,
)
from dpcompile.analysis.batch_rules.pointwise import pointwise
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.batch_rules.sizes import batch_multiple, joined_shape
from dpcompile.analysis.placement import (
    REPLICATED,
    BatchSize,
    Placement,
    Replicated,
    Split,
    Tuple,
)


def flatten(ctx: RuleContext) -> Placement | None:
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split):
        return None
    if ctx.module is not None:
        start, end = ctx.module.start_dim, ctx.module.end_dim
    else:
        start, end = ctx.arg(1, "start_dim", 0), ctx.arg(2, "end_dim", -1)
    nd = ctx.ndim(ctx.tensor_arg())
    start_n = normalize_dim(start, nd, p.dim, ctx.min_ndim(ctx.tensor_arg()))
    if start_n is None:
        return None
    if p.dim < start_n:
        return p
    if p.dim == start_n:  # rows of a chunk stay contiguous blocks of the flattened whole
        return Split(p.dim)
    end_n = normalize_dim(end, nd, p.dim, ctx.min_ndim(ctx.tensor_arg()))
    if end_n is not None and p.dim > end_n and nd is not None:
        return Split(p.dim - (end_n - start_n))
    return None


def reshape(ctx: RuleContext) -> Placement | None:
    """view / reshape: the batch must stay at the front, as -1 or as the chunk's own size."""
    p = ctx.p(ctx.tensor_arg())
    if isinstance(p, Split) and p.dim != 0:
        return _reshape_inner(ctx, p)
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
        return _rows_of_whole_samples(ctx, tail)
    if isinstance(first, fx.Node) and ctx.p(first) in (BatchSize(), BatchSize(rows=True)):
        return Split(0, p.origin)
    return None


def _rows_of_whole_samples(ctx: RuleContext, tail: list) -> Placement | None:
    """``x.view(-1, *tail)`` of a tensor split on dim 0: each chunk's rows are a contiguous block
    of the whole's, so the chunks' views concatenate to the whole's view, provided every row
    of the result lies within one sample. Otherwise (``h.view(-1, 2, D)`` pairing the rows of a
    ``(B, D)`` batch) a chunk with an odd number of rows cannot be viewed: it runs whole.

    A sample may own several rows, as the example's shapes show (``k = rows / batch``): Swin's
    ``windows.view(-1, H // ws, W // ws, ws, ws, C)`` of ``(B * nW, ws, ws, C)`` puts a sample's
    ``nW`` windows back in one row."""
    from math import prod

    from dpcompile.analysis.placement import Whole

    shape = node_shape(ctx.tensor_arg())
    out_shape = node_shape(ctx.node)
    if out_shape is not None and len(out_shape) == len(tail) + 1:
        known = prod(out_shape[1:])  # the sizes as they came out (traced sizes included)
    elif any(not isinstance(t, int) for t in tail):
        known = None
    else:
        known = prod(tail)
    if shape is not None and known is not None:
        per_sample = prod(shape[1:]) * ctx.rows_per_sample(ctx.tensor_arg(), 0)
        if per_sample % known == 0:
            return Split(0)
        return Whole(reason=f"view(-1, {', '.join(map(str, tail))}) groups rows of several samples ({list(shape)})")
    if len(tail) <= 1:
        return Split(0)  # rows of the trailing size: whole samples unless a sample's size is not a multiple
    return Whole(reason=f"view(-1, {', '.join(str(t) if isinstance(t, int) else '?' for t in tail)}) may group rows of "
                 "several samples; pass example_inputs= so shapes decide")  # fmt: skip


def _view_sizes(ctx: RuleContext) -> list:
    node = ctx.node
    rest = list(node.args[1:]) or [node.kwargs.get("shape") or node.kwargs.get("size")]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        rest = list(rest[0])
    return rest


def _size_of(node: object, tensor: object) -> int | None:
    """``i`` where ``node`` is ``tensor.shape[i]``, ``tensor.size()[i]`` or ``tensor.size(i)``."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method" and node.target == "size" and len(node.args) == 2 and node.args[0] is tensor:
        return node.args[1] if isinstance(node.args[1], int) else None
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        shape, index = node.args
        reads = (shape.op == "call_function" and shape.target is getattr and shape.args[1] == "shape") or (
            shape.op == "call_method" and shape.target == "size" and len(shape.args) == 1
        )
        if reads and shape.args[0] is tensor and isinstance(index, int) and index >= 0:
            return index
    return None


def _keeps_leading_dims(ctx: RuleContext, d: int) -> bool:
    """Without shapes: ``h.view(t, b, ...)`` of ``h`` split on dim ``d``, its first ``d`` sizes read
    from ``h``'s own shape in order and the next the chunk's batch size, keeps the batch at ``d``."""
    sizes = _view_sizes(ctx)
    tensor = ctx.tensor_arg()
    if len(sizes) <= d or not (isinstance(sizes[d], fx.Node) and ctx.p(sizes[d]) == BatchSize()):
        return False
    if any(_size_of(sizes[i], tensor) != i for i in range(d)):
        return False
    return all(not isinstance(x, fx.Node) or isinstance(ctx.p(x), Replicated) for x in sizes[d + 1 :]) and all(
        not (isinstance(x, int) and x == -1) for x in sizes[:d]
    )


def _reshape_inner(ctx: RuleContext, p: Split) -> Placement | None:
    """view / reshape of a tensor split on a dim ``d > 0`` (an RNN's ``(T, B, H)``), from the
    shapes of shape propagation: the split dim must come out whole, with the dims before it
    regrouped among themselves, and its size written as the chunk's (-1 or ``x.size(d)``)."""
    from math import prod

    from dpcompile.analysis.placement import Whole

    d = p.dim
    in_shape, out_shape = node_shape(ctx.tensor_arg()), node_shape(ctx.node)
    if in_shape is None or out_shape is None:  # a view of tensor-parallel shards: the whole tensors' shapes
        in_shape, out_shape = unsharded_shape(ctx.tensor_arg()), unsharded_shape(ctx.node)
    if in_shape is None or out_shape is None:
        if _keeps_leading_dims(ctx, d):
            return Split(d)
        return Whole(reason=f"view of a tensor split on dim {d} needs shapes: pass example_inputs=")
    before = prod(in_shape[:d])
    prefixes = [i for i in range(len(out_shape) + 1) if prod(out_shape[:i]) == before]  # several where sizes are 1
    j = next((i for i in prefixes if i < len(out_shape) and out_shape[i] == in_shape[d]), prefixes[0] if prefixes else None)
    if j is not None and j < len(out_shape) and out_shape[j] != in_shape[d]:
        merged = _heads_folded_in(ctx, p, in_shape, out_shape, j)
        if merged is not None:
            return merged
    if j is None or j >= len(out_shape) or out_shape[j] != in_shape[d]:
        return Whole(reason=f"view merges the split dim {d} with another dim ({list(in_shape)} -> {list(out_shape)})")
    sizes = _view_sizes(ctx)
    if len(sizes) != len(out_shape):
        return None
    entry = sizes[j]
    others = [x for i, x in enumerate(sizes) if i != j]
    chunk_sized = isinstance(entry, fx.Node) and ctx.p(entry) == BatchSize()  # then a -1 elsewhere is the same
    batch_sized = entry == -1 or chunk_sized
    if not batch_sized or any(
        (x == -1 and not chunk_sized) or (isinstance(x, fx.Node) and not isinstance(ctx.p(x), Replicated)) for x in others
    ):
        return Whole(reason=f"view writes the split dim {d}'s size as a number, not the chunk's")
    return Split(j)


def _heads_folded_in(ctx: RuleContext, p: Split, in_shape: tuple, out_shape: tuple, j: int) -> Placement | None:
    """``(T, B, E) -> (T, B * H, E // H)`` (``F.multi_head_attention_forward``'s heads folded into
    the batch): the split dim as the outer factor of dim ``j``, merged with a part of one sample's
    dims after it, its size written as the chunk's batch size times that part (or -1)."""
    from math import prod

    d = p.dim
    rows = whole_ratio(out_shape[j], in_shape[d])
    per_sample = prod(in_shape[d + 1 :])
    if rows is None or rows < 2 or not isinstance(per_sample, int) or per_sample % rows:
        return None
    sizes = _view_sizes(ctx)
    if len(sizes) != len(out_shape):
        return None
    entry, others = sizes[j], [x for i, x in enumerate(sizes) if i != j]
    if any(x == -1 or (isinstance(x, fx.Node) and not isinstance(ctx.p(x), Replicated)) for x in others):
        return None
    if entry != -1:
        multiple = batch_multiple(ctx, entry, depth=1) if isinstance(entry, fx.Node) else None
        if not isinstance(ctx.p(entry), BatchSize) or multiple != rows * ctx.rows_per_sample(ctx.tensor_arg(), d):
            return None
    return Split(j)


def along_dims(ctx: RuleContext) -> Placement | None:
    """flip(dims) / roll(shifts, dims) (Swin's cyclic shift): per sample unless a dim is the split dim."""
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split) or any(not isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes[1:]):
        return None
    name = target_name(ctx.node)
    dims = ctx.arg(2, "dims") if name == "roll" else ctx.arg(1, "dims")
    if name == "flip" and ctx.node.op == "call_method" and len(ctx.node.args) > 2:
        dims = list(ctx.node.args[1:])
    if dims is None:
        return None  # roll without dims rolls the flattened tensor
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    nd = ctx.ndim(ctx.tensor_arg())
    normal = [normalize_dim(x, nd, p.dim, ctx.min_ndim(ctx.tensor_arg())) for x in dims]
    if any(x is None or x == p.dim for x in normal):
        return None
    return p


def along_dims_unfold(ctx: RuleContext) -> Placement | None:
    """``x.unfold(dim, size, step)`` (sliding windows along a dim, as a new last dim): per sample
    unless ``dim`` is the split dim."""
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split) or any(not isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes[1:]):
        return None
    dim = normalize_dim(ctx.arg(1, "dimension"), ctx.ndim(ctx.tensor_arg()), p.dim, ctx.min_ndim(ctx.tensor_arg()))
    return p if dim is not None and dim != p.dim else None


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
        ra, rb = ctx.resolve(a, ctx.tensor_arg(), p.dim), ctx.resolve(b, ctx.tensor_arg(), p.dim)
        if ra is None or rb is None or ra == p.dim or rb == p.dim:
            return None  # a negative dim that may name the split dim (the rank is unknown)
        return p
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
    if isinstance(p, Split) and (nd == 2 or (nd is None and p.dim == 0 and ctx.min_ndim(ctx.tensor_arg()) == 2)) and p.dim in (0, 1):
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
            return p if ctx.resolve(dim, ctx.tensor_arg(), p.dim, extra=1) is not None else None
        dim += nd + 1
    return Split(p.dim + 1 if dim <= p.dim else p.dim)


def squeeze(ctx: RuleContext) -> Placement | None:
    """``squeeze(dim)`` / ``squeeze(dims)``: drops the named dims of size 1 (others stay), never the
    batch dim; ``squeeze()``: see :func:`squeeze_all`."""
    p = ctx.p(ctx.tensor_arg())
    dim = ctx.arg(1, "dim")
    if ctx.node.op == "call_method" and len(ctx.node.args) > 2:
        dim = list(ctx.node.args[1:])
    if dim is None:
        return squeeze_all(ctx)
    if not isinstance(p, Split) or not (isinstance(dim, int) or isinstance(dim, (list, tuple)) and dim):
        return None
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    if not all(isinstance(d, int) for d in dims):
        return None
    shape = node_shape(ctx.tensor_arg())
    nd = ctx.ndim(ctx.tensor_arg())
    if nd is None:
        if len(dims) != 1 or ctx.resolve(dims[0], ctx.tensor_arg(), p.dim) is None:
            return None
        return p if dims[0] < 0 else (Split(p.dim - 1) if dims[0] < p.dim else p)
    dims = [d % nd if nd else d for d in dims]
    if p.dim in dims:
        return None
    removed = [d for d in dims if shape is None or shape[d] == 1]
    return Split(p.dim - sum(1 for d in set(removed) if d < p.dim))


def squeeze_all(ctx: RuleContext) -> Placement | None:
    """``squeeze()`` (no dims) of a tensor split on dim ``d``: the example's shapes show that the
    batch dim survives (the batch is not 1) and which other dims go, so the result is split on
    ``d`` less the size-1 dims before it. A device's chunk of one sample would lose its batch dim
    to ``squeeze()``: ``insert_scatter_gather`` runs :func:`dpcompile.runtime.squeeze_except`
    there (:func:`squeeze_keeps`), which keeps it: transformers' ``shift_tokens_right`` (mBART)
    squeezes ``tokens.gather(1, eos)`` of ``(B, 1)`` to ``(B,)``, and a device of one sample gets ``(1,)``.
    """
    p = ctx.p(ctx.tensor_arg())
    in_shape, out_shape = node_shape(ctx.tensor_arg()), node_shape(ctx.node)
    if not isinstance(p, Split) or in_shape is None or out_shape is None or p.dim >= len(in_shape):
        return None
    ones = [i for i, n in enumerate(in_shape) if isinstance(n, int) and n == 1]
    if p.dim in ones or len(out_shape) != len(in_shape) - len(ones):
        return None  # a batch of one in the example (squeeze() drops it), or a size not known to be 1
    return Split(p.dim - sum(1 for i in ones if i < p.dim))


def squeeze_keeps(node: fx.Node, placements: Mapping[fx.Node, Placement]) -> int | None:
    """The split dim of ``node``'s input where ``node`` is ``squeeze()`` without dims of a split
    tensor (which each device must run keeping that dim), else None."""
    if node.op not in ("call_function", "call_method") or target_name(node) != "squeeze" or not node.args:
        return None
    if len(node.args) > 1 or node.kwargs.get("dim") is not None:
        return None
    if isinstance(node.target, torch._ops.OpOverload) and node.target._overloadname != "default":
        return None
    p = placements.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    return p.dim if isinstance(p, Split) and isinstance(placements.get(node), Split) else None


def narrow(ctx: RuleContext) -> Placement | None:
    """``narrow(x, dim, start, length)`` of a non-batch dim (the batch dim's rows are the chunk's)."""
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split) or any(not isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes[1:]):
        return None
    dim = normalize_dim(ctx.arg(1, "dim"), ctx.ndim(ctx.tensor_arg()), p.dim, ctx.min_ndim(ctx.tensor_arg()))
    return p if dim is not None and dim != p.dim else None


def diagonal(ctx: RuleContext) -> Placement | None:
    """``diagonal(x, offset, dim1, dim2)`` of two non-batch dims: they go, the diagonal comes last."""
    p = ctx.p(ctx.tensor_arg())
    nd = ctx.ndim(ctx.tensor_arg())
    if not isinstance(p, Split) or nd is None:
        return None
    d1, d2 = ctx.arg(2, "dim1", 0), ctx.arg(3, "dim2", 1)
    if not isinstance(d1, int) or not isinstance(d2, int):
        return None
    d1, d2 = d1 % nd, d2 % nd
    if p.dim in (d1, d2):
        return None
    return Split(p.dim - sum(1 for d in (d1, d2) if d < p.dim))


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
    stacking = target_name(ctx.node) == "stack"
    if dim < 0:
        if nd is None:  # a negative dim must surely lie after the split dim
            return Split(d) if ctx.resolve(dim, tensors[0], d, extra=1 if stacking else 0) is not None else None
        dim += nd + (1 if stacking else 0)
    if stacking:  # a new dim at `dim`: the batch dim moves right if it was at or after it
        return Split(d + 1 if dim <= d else d)
    return None if dim == d else Split(d)


def _sizes(ctx: RuleContext) -> list:
    sizes = list(ctx.node.args[1:]) or list(ctx.node.kwargs.get("size", ctx.node.kwargs.get("sizes", ())) or ())
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
        sizes = list(sizes[0])
    return sizes


def _batch_entry(ctx: RuleContext, sizes: list) -> int | None:
    """The one position of ``sizes`` that holds a batch size, or a multiple of it (others carry no
    batch), or None: ``zeros(b * k, d)`` makes ``k`` rows per sample, as the whole does."""
    at = [i for i, s in enumerate(sizes) if isinstance(s, fx.Node) and ctx.p(s) in (BatchSize(), BatchSize(rows=True))]
    others_ok = all(not isinstance(s, fx.Node) or isinstance(ctx.p(s), Replicated) for i, s in enumerate(sizes) if i not in at)
    return at[0] if len(at) == 1 and others_ok else None


def expand_to_batch(ctx: RuleContext) -> Placement | None:
    """``token.expand(b, -1, -1)`` / ``token.repeat(b, 1, 1)`` of a tensor that carries no batch, to a
    chunk's batch size: the result is split there (a ViT's class token becomes per device).
    ``repeat`` tiles with the period of the tensor's size, which every chunk starts on."""
    sizes = _sizes(ctx)
    at = _batch_entry(ctx, sizes)
    if at is None:
        return None
    if target_name(ctx.node) in ("expand", "broadcast_to"):
        nd = ctx.ndim(ctx.tensor_arg())
        shape = node_shape(ctx.tensor_arg())
        offset = len(sizes) - nd if nd is not None else None
        if offset is None or (at >= offset and (shape is None or shape[at - offset] != 1)):
            return None  # expand only grows size-1 (or new) dims; unknown shapes: keep it whole
    return Split(at)


def repeat(ctx: RuleContext) -> Placement | None:
    """``x.repeat(*sizes)``: a split tensor repeated once along its split dim stays split there."""
    p = ctx.p(ctx.tensor_arg())
    if isinstance(p, Replicated):
        return expand_to_batch(ctx)
    sizes = _sizes(ctx)
    nd = ctx.ndim(ctx.tensor_arg())
    if not isinstance(p, Split) or nd is None or any(isinstance(s, fx.Node) for s in sizes):
        return None
    at = p.dim + len(sizes) - nd
    return Split(at) if 0 <= at < len(sizes) and sizes[at] == 1 else None


def shape_concat(ctx: RuleContext) -> Placement | None:
    """Shapes joined with ``+`` keep the batch size where it sits (:func:`joined_shape`: ``x.size()[:-1]
    + (n,)``, timm's ``(x.shape[0],) + (1,) * (x.ndim - 1)``); element-wise ``+`` otherwise."""
    found = joined_shape(ctx)
    return found if found is not None else pointwise(ctx)


def expand(ctx: RuleContext) -> Placement | None:
    p = ctx.p(ctx.tensor_arg())
    if isinstance(p, Replicated):
        return expand_to_batch(ctx)
    sizes = _sizes(ctx)
    if isinstance(p, Split) and len(sizes) == 1 and isinstance(sizes[0], fx.Node):
        return _expand_to_shape(ctx, p, sizes[0])
    if not isinstance(p, Split) or p.dim >= len(sizes):
        return None
    nd = ctx.ndim(ctx.tensor_arg())
    offset = len(sizes) - (nd if nd is not None else len(sizes))
    at = p.dim + offset
    if not 0 <= at < len(sizes):
        return None
    entry = sizes[at]
    if entry == -1 or (isinstance(entry, fx.Node) and ctx.p(entry) == BatchSize()):
        others_ok = all(not isinstance(s, fx.Node) or isinstance(ctx.p(s), Replicated) for i, s in enumerate(sizes) if i != at)
        return Split(at) if others_ok else None
    return None


def _expand_to_shape(ctx: RuleContext, p: Split, shape: fx.Node) -> Placement | None:
    """``k.expand(q.shape)`` / ``torch.broadcast_to(k, q.shape)`` of a split ``k``: split where
    ``q.shape`` holds the batch size and ``k``'s split dim lands (ranks known)."""
    q = ctx.p(shape)
    nd, out_nd = ctx.ndim(ctx.tensor_arg()), ctx.out_ndim()
    if not isinstance(q, BatchSize) or q.shape_of_dim is None or nd is None or out_nd is None:
        return None
    return Split(q.shape_of_dim) if p.dim + out_nd - nd == q.shape_of_dim else None


def chunk_like(ctx: RuleContext) -> Placement | None:
    """chunk / split / split_with_sizes / unbind along a non-batch dim: a tuple of equally split pieces."""
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split):
        return None
    name = target_name(ctx.node)
    if name == "unbind":
        dim = ctx.arg(1, "dim", 0)
    else:
        dim = ctx.arg(2, "dim", 0)
    nd = ctx.ndim(ctx.tensor_arg())
    dim = normalize_dim(dim, nd, p.dim, ctx.min_ndim(ctx.tensor_arg()))
    if dim is None or dim == p.dim:
        return None
    piece = Split(p.dim - 1 if name == "unbind" and dim < p.dim else p.dim)
    val = ctx.node.meta.get("val")
    count = len(val) if isinstance(val, (list, tuple)) else 64  # pieces; 64 where no example says
    return Tuple(tuple([piece] * count))


def size(ctx: RuleContext) -> Placement | None:
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split):
        return None
    dim = ctx.arg(1, "dim")
    if dim is None:
        return BatchSize(shape_of_dim=p.dim)
    if isinstance(dim, int):
        if dim < 0:
            dim = ctx.resolve(dim, ctx.tensor_arg(), p.dim)
            if dim is None:
                return None  # x.size(-2) of a tensor of unknown rank may be its batch size
        if dim == p.dim:
            return BatchSize()
        return REPLICATED
    return None


def _factory_sizes(ctx: RuleContext) -> tuple[list | fx.Node | None, list]:
    """The sizes of a factory and its other arguments, for each spelling: ``torch.zeros(b, h)``,
    ``torch.zeros((b, h))``, ``torch.full((b, h), v)``, ``x.new_zeros(b, h)``, ``aten.full([b, h], v)``."""
    args = list(ctx.node.args)
    if ctx.node.op == "call_method" or target_name(ctx.node).startswith("new_"):
        args = args[1:]  # the tensor a new_* factory takes its dtype and device from
    if not args:
        size = ctx.node.kwargs.get("size")
        return (list(size) if isinstance(size, (list, tuple)) else size), []
    if isinstance(args[0], (list, tuple)):
        return list(args[0]), args[1:]
    if isinstance(args[0], fx.Node) and isinstance(ctx.p(args[0]), BatchSize) and ctx.p(args[0]).shape_of_dim is not None:
        return args[0], args[1:]
    if target_name(ctx.node) in ("full", "new_full"):
        return None, []  # full(size, value) takes its size as one sequence
    return args, []


def factory(ctx: RuleContext) -> Placement | None:
    """torch.zeros(n, b, h) / full((b, h), v) / x.new_ones(b, h): a batch size among the sizes
    makes a tensor split there (each device makes its chunk's rows)."""
    sizes, rest = _factory_sizes(ctx)
    others = list(rest) + list(ctx.node.kwargs.values())
    if any(isinstance(v, fx.Node) and not isinstance(ctx.p(v), Replicated) for v in others):
        return None
    if isinstance(sizes, fx.Node):  # torch.ones(x.shape[:2]): a shape holding the batch size
        return Split(ctx.p(sizes).shape_of_dim)
    if sizes is None:
        return None
    return made_to_sizes(ctx, sizes)


def made_to_sizes(ctx: RuleContext, sizes: list) -> Placement | None:
    """A tensor made to ``sizes``: split where one of them is the batch size, replicated where none
    carries the batch (``x.new_ones([])`` / ``x.new_zeros(h, w)`` of a split ``x``)."""
    at = _batch_entry(ctx, sizes)
    if at is None and all(not isinstance(s, fx.Node) or isinstance(ctx.p(s), Replicated) for s in sizes):
        return REPLICATED
    return Split(at) if at is not None else None


BATCH_RULES.register_family(ops.FLATTEN, flatten)
BATCH_RULES.register_family(ops.VIEW, reshape)
BATCH_RULES.register_family(ops.PERMUTE, permute)
BATCH_RULES.register_family(ops.TRANSPOSE, transpose)
BATCH_RULES.register_family(ops.MATRIX_TRANSPOSE, matrix_transpose)
BATCH_RULES.register_family(ops.UNSQUEEZE, unsqueeze)
BATCH_RULES.register_family(ops.SQUEEZE, squeeze)
BATCH_RULES.register_family(ops.CONCAT, cat)
BATCH_RULES.register_family(ops.EXPAND, expand)
BATCH_RULES.register("repeat", repeat)
BATCH_RULES.register(operator.add, shape_concat, replace=True)
BATCH_RULES.register(torch.Tensor.unfold, along_dims_unfold)
BATCH_RULES.register("unfold", along_dims_unfold)
for _target in (torch.flip, torch.roll, "flip", "roll"):
    BATCH_RULES.register(_target, along_dims)
BATCH_RULES.register_family(ops.CHUNK, chunk_like)
BATCH_RULES.register(torch.diagonal, diagonal)
BATCH_RULES.register("diagonal", diagonal)
BATCH_RULES.register_family(ops.FACTORIES, factory)
BATCH_RULES.register("size", size)
