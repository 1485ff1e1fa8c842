"""Rules for constructs real models use that would otherwise run whole.

=====================================  =========================================================
``F.scaled_dot_product_attention``     the fx spelling of ``aten.scaled_dot_product_attention``
``topk`` / ``sort`` / ``argsort``      along a dim that is not the batch (a mixture-of-experts router)
``aten.gather`` / ``torch.gather``     along another dim, index split as the input
``w @ x`` (weight on the left)         a replicated matrix times a batch of matrices
``a.T @ b`` / ``a @ b.T``              a partial sum over the batch / a B x B pairing (whole)
``x[..., 1::2]``                       slices (any step) of the last dims (rotary embeddings)
``b * t``                              a batch size times a per-sample size: the rows of ``(b, t)``
``x[:, :, idx]`` / ``aten.index``      integer index tensors that carry no batch, on other dims
transformers' ``Conv1D``               ``x @ W + b`` on the last dim (GPT-2), by qualified name
``x.repeat_interleave(k, dim)``        each sample's rows (or features) repeated: split as ``x``
``W[ids]`` (``aten.index``)            rows of a replicated table by split indices (an expert's
                                       weights per token): split as ``ids``
=====================================  =========================================================
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from dpcompile.analysis.batch_rules.aten import sdpa
from dpcompile.analysis.batch_rules.context import RuleContext, node_shape
from dpcompile.analysis.batch_rules.matrix import last_dim_op, matmul
from dpcompile.analysis.batch_rules.pointwise import pointwise
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.placement import BatchSize, Partial, Placement, Replicated, Split, Whole
from dpcompile.runtime.exported import TransposedLinear

aten = torch.ops.aten


def matmul_weight_left(ctx: RuleContext) -> Placement | None:
    """``w @ x`` with ``w`` a replicated matrix and ``x`` a batch of matrices (``(B, n, m)``):
    split as ``x`` wherever its split dim is a batch dim of the product; else matmul's rule."""
    a, b = ctx.node.args[0], ctx.node.args[1]
    pa, pb = ctx.p(a), ctx.p(b)
    if isinstance(pa, Replicated) and isinstance(pb, Split):
        na, nb = ctx.ndim(a), ctx.ndim(b)
        nb = nb if nb is not None else ctx.min_ndim(b)
        if na is not None and na <= 2 and nb is not None and nb >= 3 and pb.dim < nb - 2:
            return Split(pb.dim)
        return _weights_broadcast_over_batch(a, nb, pb)
    if isinstance(pa, Split) and isinstance(pb, Split):
        return samples_product(ctx, pa, pb) or matmul(ctx)
    return matmul(ctx) or rows_times_replicated(ctx, pa, pb)


def _weights_broadcast_over_batch(a: fx.Node, nb: int | None, pb: Split) -> Placement | None:
    """``w @ x`` with ``w`` replicated, of rank 3 or more, of size 1 on the dim that meets ``x``'s batch dim
    (a batch dim of the product): Zamba's per-head weights ``x_proj_weight[:, None] @ h``, ``(H, 1, r, d) @
    (H, B, d, L)``. Each device's product is its samples' rows of the whole's."""
    shape = node_shape(a) if isinstance(a, fx.Node) else None
    if shape is None or nb is None or len(shape) < 3 or not 0 <= pb.dim < nb - 2:
        return None
    out = max(len(shape), nb)
    at = pb.dim + out - nb  # the split dim in the product's (and a's, right-aligned) coordinates
    aligned = at - (out - len(shape))
    if aligned >= 0 and shape[aligned] != 1:
        return None
    return Split(at)


def rows_times_replicated(ctx: RuleContext, pa: object, pb: object) -> Placement | None:
    """``x @ w`` with ``x`` split on its rows (dim -2) and ``w`` replicated: each output row is its row of
    ``x`` times ``w``, split on the output's rows. SpeechT5's relative position bias,
    ``(T, B*H, D) @ (T, D, T)``, holds the batch in the rows of a batch of matrices."""
    a, b = ctx.node.args[0], ctx.node.args[1]
    na, nb = ctx.ndim(a), ctx.ndim(b)
    if not (isinstance(pa, Split) and isinstance(pb, Replicated)) or na is None or nb is None or na < 2 or nb < 1:
        return None
    if pa.dim != na - 2:
        return None
    return Split(na - 2) if nb == 1 else Split(max(na, nb) - 2)


def samples_product(ctx: RuleContext, pa: Split, pb: Split) -> Placement | None:
    """``a @ b`` of two split tensors whose matrix dims hold the samples (rank 2 or less each):

    * ``a.T @ b`` contracts over the batch (a Gram or cross-covariance matrix): each device's
      product is a partial sum of the whole's, ``Partial("sum")``;
    * ``a @ b.T`` pairs every sample with every sample (a ``(B, B)`` matrix, CLIP's contrastive
      logits ``text @ image.T``): a row needs every device's samples, so it runs whole, by nature."""
    a, b = ctx.node.args[0], ctx.node.args[1]
    na, nb = ctx.ndim(a), ctx.ndim(b)
    if na is None or nb is None or not (1 <= na <= 2 and 1 <= nb <= 2):
        return None
    if pa.dim == na - 1 and pb.dim == (0 if nb == 1 else nb - 2):
        return Partial("sum")
    if na == 2 and nb == 2 and pa.dim == 0 and pb.dim == 1:
        return Whole(reason="a @ b.T of two batches pairs every sample with every sample (a B x B matrix): "
                     "each row needs every device's samples")  # fmt: skip
    return None


def last_dims_slice(ctx: RuleContext) -> Placement | None:
    """``x[..., a:b:c]`` and ``x[..., None]`` (slices of the last dims, any step): the leading dims,
    the batch among them, stay where they are when the rank is surely above the sliced dims."""
    base, index = ctx.node.args
    p = ctx.p(base)
    if not isinstance(p, Split) or not isinstance(index, tuple) or not index or index[0] is not Ellipsis:
        return None
    after = index[1:]
    if Ellipsis in after or not all(i is None or isinstance(i, slice) for i in after):
        return None
    if any(isinstance(v, fx.Node) for i in after if isinstance(i, slice) for v in (i.start, i.stop, i.step)):
        return None
    sliced = sum(1 for i in after if isinstance(i, slice))
    rank = ctx.min_ndim(base)
    return p if rank is not None and rank - sliced > p.dim else None


def batch_size_product(ctx: RuleContext) -> Placement | None:
    """``b * t`` of a batch size and a size that carries no batch: the row count of a chunk's
    ``(b, t, ...)`` flattened, which ``view``/``reshape`` take as the first size."""
    left, right = (list(ctx.node.args) + [None, None])[:2]
    sides = [ctx.p(v) if isinstance(v, fx.Node) else None for v in (left, right)]
    if BatchSize() in sides:
        other = right if sides[0] == BatchSize() else left
        if (
            isinstance(other, int)
            and not isinstance(other, bool)
            and other > 0
            or (isinstance(other, fx.Node) and isinstance(ctx.p(other), Replicated))
        ):
            return BatchSize(rows=True)
        return None
    return pointwise(ctx)


def index_other_dims(ctx: RuleContext, base: fx.Node, indices: list) -> Placement | None:
    """``aten.index(x, [None, None, idx])`` (``x[:, :, [-2]]``, Falcon's fused heads): integer
    index tensors that carry no batch on dims other than the batch dim of ``x`` (``None``: a dim
    kept whole). The batch dim moves as advanced indexing moves dims: where the indexed dims are
    adjacent, their broadcast result takes their place; else it goes first."""
    p = ctx.p(base)
    if not isinstance(p, Split) or (p.dim < len(indices) and indices[p.dim] is not None):
        return None
    at = [i for i, index in enumerate(indices) if index is not None]
    ranks = []
    for i in at:
        index = indices[i]
        if isinstance(index, (list, tuple)):  # x[:, [0, 2]] in an fx graph: a 1-D index of ints
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in index):
                return None
            ranks.append(1)
            continue
        value = index.meta.get("val") if isinstance(index, fx.Node) else None
        if not isinstance(ctx.p(index), Replicated) or not isinstance(value, torch.Tensor):
            return None
        if value.dtype in (torch.bool, torch.uint8) or value.is_floating_point():
            return None  # a mask indexes as many dims as it has: not one dim per index
        ranks.append(len(node_shape(index) or value.shape))
    if not at:
        return None
    rank = max(ranks)
    if at == list(range(at[0], at[-1] + 1)):
        return Split(p.dim if p.dim < at[0] else p.dim - len(at) + rank)
    return Split(rank + sum(1 for i in range(p.dim) if i not in at))


def aten_index_other_dims(ctx: RuleContext) -> Placement | None:
    """``aten.index(x, indices)`` by :func:`index_other_dims`."""
    base, indices = ctx.node.args[0], ctx.node.args[1]
    if not isinstance(base, fx.Node) or not isinstance(indices, (list, tuple)):
        return None
    return index_other_dims(ctx, base, list(indices))


def getitem_other_dims(ctx: RuleContext) -> Placement | None:
    """``x[:, :, idx]`` / ``x[..., [0, 2]]`` (full slices, index tensors and lists of ints) by
    :func:`index_other_dims`."""
    base, index = ctx.node.args[0], ctx.node.args[1]
    items = list(index) if isinstance(index, tuple) else [index]
    if not isinstance(base, fx.Node) or not any(isinstance(i, (fx.Node, list)) for i in items):
        return None
    if Ellipsis in items:
        rank = ctx.ndim(base)
        if rank is None or items.count(Ellipsis) > 1:
            return None
        at = items.index(Ellipsis)
        items[at : at + 1] = [slice(None)] * (rank - (len(items) - 1))
    if not all(isinstance(i, (fx.Node, list)) or i == slice(None) for i in items):
        return None  # ints, None and partial slices beside index tensors
    return index_other_dims(ctx, base, [None if isinstance(i, slice) else i for i in items])


def conv1d_transformers(ctx: RuleContext) -> Placement | None:
    """transformers' ``Conv1D`` (``x @ W + b`` on the last dim, GPT-2): like ``nn.Linear``."""
    return last_dim_op(ctx)


def repeat_interleave(ctx: RuleContext) -> Placement | None:
    """``x.repeat_interleave(k, dim)`` with a whole number ``k`` (a literal, or a size that carries
    no batch: GCViT's ``B // q.shape[0]``): every row of each sample repeated in place, along the
    batch dim or another, so each device repeats its own rows. ``output_size`` (Mamba2's) is
    the whole batch's along the batch dim, a per-sample size along another."""
    x, repeats, dim = ctx.tensor_arg(), ctx.arg(1, "repeats"), ctx.arg(2, "dim")
    p = ctx.p(x)
    if not isinstance(p, Split) or not _whole_repeats(ctx, repeats):
        return None
    if not isinstance(dim, int) or isinstance(dim, bool):
        return None  # no dim flattens x first
    if ctx.arg(3, "output_size") is not None and ctx.resolve(dim, x, p.dim) in (None, p.dim):
        return None  # an output size of the whole batch's rows
    return p


def _whole_repeats(ctx: RuleContext, repeats: object) -> bool:
    """A positive whole number of repeats, the same on every device."""
    if isinstance(repeats, fx.Node) and isinstance(ctx.p(repeats), Replicated):
        repeats = repeats.meta.get("val")
        if isinstance(repeats, torch.SymInt):
            return True  # a size symbol of the export frontend, replicated: the same count everywhere
    return isinstance(repeats, int) and not isinstance(repeats, bool) and repeats >= 1


def index_replicated_by_split(ctx: RuleContext) -> Placement | None:
    """``aten.index(W, [ids])`` of a replicated ``W`` by one integer index tensor split on ``d``:
    ``W[ids[j]]`` for every element alone, split on ``d`` like ``ids`` (an embedding lookup)."""
    x, indices = ctx.node.args[0], ctx.node.args[1]
    if not isinstance(ctx.p(x), Replicated) or not isinstance(indices, (list, tuple)) or len(indices) != 1:
        return None
    index = indices[0]
    p = ctx.p(index)
    value = index.meta.get("val") if isinstance(index, fx.Node) else None
    if not isinstance(p, Split) or not isinstance(value, torch.Tensor) or value.dtype in (torch.bool, torch.uint8):
        return None
    return Split(p.dim)


BATCH_RULES.register(F.scaled_dot_product_attention, sdpa)
for _target in (operator.matmul, torch.matmul, "matmul"):
    BATCH_RULES.register(_target, matmul_weight_left, replace=True)
BATCH_RULES.register(operator.mul, batch_size_product, replace=True)
BATCH_RULES.register_by_name("transformers.pytorch_utils.Conv1D", conv1d_transformers)
BATCH_RULES.register(TransposedLinear, conv1d_transformers)  # its stand-in in a program loaded from a folder
