"""Layers: convolutions and pooling, norms, embeddings, RNNs and packed sequences, attention and
transformer layers (as modules, and their functional forms)."""

from __future__ import annotations

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from dpcompile.analysis import ops
from dpcompile.analysis.batch_rules.context import RuleContext, target_name
from dpcompile.analysis.batch_rules.matrix import assume_batched
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.placement import (
    REPLICATED,
    BatchSize,
    Packed,
    Placement,
    Replicated,
    Split,
    Tuple,
)


def per_sample_dim0(ctx: RuleContext) -> Placement | None:
    """Modules that treat dim 0 as the batch and every sample alike (conv, pooling, ...)."""
    x = ctx.tensor_arg()
    p = ctx.p(x)
    others = [ctx.p(n) for n in ctx.node.all_input_nodes[1:]]
    if isinstance(p, Split) and p.dim == 0 and all(isinstance(o, Replicated) for o in others):
        rank = batched_rank(ctx)
        if rank is not None:  # Conv2d takes (N, C, H, W) or one unbatched (C, H, W)
            nd = ctx.ndim(x)
            if nd is not None and nd < rank:
                return None  # one unbatched sample: dim 0 is its channels
            assume_batched(ctx, x, p, rank)
        return p
    return None


def per_sample_all_dim0(ctx: RuleContext) -> Placement | None:
    """Ops of several batched tensors (``grid_sample(x, grid)``, a pooling's backward of its
    gradient and input): every tensor input split on dim 0."""
    ps = [ctx.p(n) for n in ctx.node.all_input_nodes]
    if ps and all(isinstance(q, Split) and q.dim == 0 for q in ps):
        return Split(0)
    return None


def pad(ctx: RuleContext) -> Placement | None:
    """``F.pad(x, pad)`` and the padding layers pad the last ``len(pad) // 2`` dims: per sample
    where those surely lie after the batch dim. ``F.pad(h, (0, 0, 1, 1))`` of a 2-D batch pads the
    batch itself (two more rows), so where the rank is unknown and could be that low it runs whole."""
    p = ctx.p(ctx.tensor_arg())
    others = [ctx.p(n) for n in ctx.node.all_input_nodes[1:]]
    if not (isinstance(p, Split) and all(isinstance(o, Replicated) for o in others)):
        return None
    padding = getattr(ctx.module, "padding", None) if ctx.module is not None else ctx.arg(1, "pad")
    if not isinstance(padding, (list, tuple)) or not padding:
        return None
    first_padded = ctx.resolve(-(len(padding) // 2), ctx.tensor_arg(), p.dim)
    if first_padded is not None and first_padded > p.dim:
        return p
    nd = ctx.ndim(ctx.tensor_arg())
    if nd is not None and len(padding) >= 2 * (nd - p.dim):  # the pad names the batch dim: by (0, 0) only
        at = 2 * (nd - 1 - p.dim)
        return p if padding[at] == 0 and padding[at + 1] == 0 else None
    return None


_SPATIAL_MODULES = (nn.modules.conv._ConvNd, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
                    nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd)  # fmt: skip
_SPATIAL_FUNCTIONS = ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                      "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d",
                      "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_max_pool2d")  # fmt: skip


def batched_rank(ctx: RuleContext) -> int | None:
    """The rank of a batched input of a convolution or pooling (``Conv2d``: 4), which also takes
    one sample without the batch dim; None for other layers."""
    if isinstance(ctx.module, _SPATIAL_MODULES):
        suffix = type(ctx.module).__name__[-2:]
    elif isinstance(ctx.module, (nn.PixelShuffle, nn.PixelUnshuffle, nn.ChannelShuffle)):
        return 4  # (N, C, H, W), as their functions are read: a 3-D input may be one sample
    elif ctx.node.op == "call_function":
        name = target_name(ctx.node).removesuffix("_with_indices").removesuffix(".vec").lstrip("_")
        if name == "convolution":
            weight = ctx.ndim(ctx.node.args[1]) if len(ctx.node.args) > 1 else None
            return weight
        if name not in _SPATIAL_FUNCTIONS and not name.startswith("upsample_"):
            return None
        suffix = name[-2:] if name[-2:] in ("1d", "2d", "3d") else "2d"  # pixel_shuffle: (N, C, H, W)
    else:
        return None
    return int(suffix[0]) + 2 if suffix in ("1d", "2d", "3d") else None


def embedding(ctx: RuleContext) -> Placement | None:
    """A lookup per index: split as the indices, the table carries no batch. ``F.embedding(input,
    weight)`` and ``nn.Embedding`` take the indices first, ``torch.embedding`` and
    ``aten.embedding(weight, indices)`` second."""
    indices_first = ctx.module is not None or ctx.node.target is F.embedding
    if _scales_grad_by_freq(ctx, indices_first):  # its gradient divides by counts over the whole batch: run whole
        return None
    indices = ctx.tensor_arg() if indices_first else (ctx.node.args[1] if len(ctx.node.args) > 1 else None)
    p = ctx.p(indices)
    if isinstance(p, Split) and all(isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes if n is not indices):
        return p
    return None


def _scales_grad_by_freq(ctx: RuleContext, indices_first: bool) -> bool:
    """``scale_grad_by_freq=True``: each row's gradient is divided by how often its index occurs in the
    batch, which a shard of the batch counts differently. ``F.embedding``'s is its 6th argument, ATen's its 4th."""
    if ctx.module is not None:
        return bool(getattr(ctx.module, "scale_grad_by_freq", False))
    position = 5 if indices_first else 3
    args = ctx.node.args
    return bool(ctx.node.kwargs.get("scale_grad_by_freq", args[position] if len(args) > position else False))


def layer_norm(ctx: RuleContext) -> Placement | None:
    """``F.layer_norm(x, normalized_shape, w, b)``, ``nn.LayerNorm``/``nn.RMSNorm`` and their ATen
    ops normalise the last ``len(normalized_shape)`` dims: any dim before those may be split."""
    x = ctx.tensor_arg()
    p = ctx.p(x)
    if not isinstance(p, Split) or any(not isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes if n is not x):
        return None
    shape = getattr(ctx.module, "normalized_shape", None) if ctx.module is not None else ctx.arg(1, "normalized_shape")
    if isinstance(shape, int):
        shape = (shape,)
    if not isinstance(shape, (list, tuple)):
        return None
    nd = ctx.ndim(x)
    if nd is not None and p.dim >= nd - len(shape):
        return None
    if nd is None:
        assume_batched(ctx, x, p, p.dim + 1 + len(shape))
    return p


def group_norm(ctx: RuleContext) -> Placement | None:
    """Per sample (statistics over groups of one sample's channels). ``aten.native_group_norm``
    spells out the batch size ``N``: it must be the chunk's (a number would be the whole batch's)."""
    if target_name(ctx.node) == "native_group_norm":
        x, n = ctx.node.args[0], ctx.arg(3, "N")
        p = ctx.p(x)
        if not (isinstance(n, fx.Node) and ctx.p(n) == BatchSize() and isinstance(p, Split) and p.dim == 0):
            return None
        if any(not isinstance(ctx.p(v), Replicated) for v in ctx.node.all_input_nodes if v not in (x, n)):
            return None
        return Tuple((Split(0), Split(0), Split(0)))
    return per_sample_dim0(ctx)


def instance_norm(ctx: RuleContext) -> Placement | None:
    """Per sample, unless it tracks running statistics: those average over the whole batch,
    updated once, so it runs whole."""
    if ctx.module is not None and ctx.module.track_running_stats:
        return None
    return per_sample_dim0(ctx)


def batch_first(module: nn.Module) -> bool:
    """``batch_first`` of an RNN, attention or transformer layer (which keep it in ``self_attn``)."""
    if isinstance(module, nn.TransformerEncoder):
        module = module.layers[0]
    if hasattr(module, "batch_first"):
        return bool(module.batch_first)
    attention = getattr(module, "self_attn", None)
    return bool(getattr(attention, "batch_first", False))


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
        assume_batched(ctx, x, p, rank=3)  # a call with a 2-D (unbatched) sequence runs as one sample
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
    assume_batched(ctx, x, p)  # and a call with one runs on one device
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
        if ctx.ndim(t) == 2:
            return None  # an unbatched (length, embedding) sequence
    for t in (q, k, v):  # a call with a 2-D (unbatched) sequence runs as one sample
        assume_batched(ctx, t, ctx.p(t), rank=3)
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
    batch_dim = 0 if batch_first(ctx.module) else 1
    x = ctx.tensor_arg()
    p = ctx.p(x)
    if not (isinstance(p, Split) and p.dim == batch_dim) or ctx.ndim(x) == 2:
        return None  # a 2-D input is one unbatched sequence
    assume_batched(ctx, x, p, rank=3)
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


BATCH_RULES.register_family(ops.PER_SAMPLE, per_sample_dim0)
BATCH_RULES.register_family(ops.PAD, pad)
for _norm in ops.BATCH_NORMS:
    BATCH_RULES.register(_norm, per_sample_dim0)  # per sample here; the data-parallel pass syncs statistics
for _norm in ops.INSTANCE_NORMS:
    BATCH_RULES.register(_norm, instance_norm)
BATCH_RULES.register_family(ops.LAST_DIMS, layer_norm)
def embedding_bag_rows(ctx: RuleContext) -> Placement | None:
    """``nn.EmbeddingBag`` given a 2-D ``input`` and no ``offsets``: one bag per row, so split as the rows
    (``per_sample_weights`` split alike). With ``offsets`` the bags are ranges of the whole batch's
    indices: whole (as ``F.embedding_bag``)."""
    ids, offsets, weights = ctx.tensor_arg(), ctx.arg(1, "offsets"), ctx.arg(2, "per_sample_weights")
    p = ctx.p(ids)
    if not isinstance(p, Split) or p.dim != 0 or ctx.ndim(ids) != 2 or offsets is not None:
        return None
    if getattr(ctx.module, "scale_grad_by_freq", False):  # counts over the whole batch, as nn.Embedding's
        return None
    w = ctx.p(weights) if weights is not None else None
    if weights is not None and not (isinstance(w, Split) and w.dim == 0):
        return None
    return p


BATCH_RULES.register(nn.EmbeddingBag, embedding_bag_rows)
BATCH_RULES.register(nn.GroupNorm, group_norm, replace=True)
BATCH_RULES.register(F.group_norm, group_norm)
BATCH_RULES.register_family(ops.EMBEDDING, embedding)
for _rnn in ops.RNNS:
    BATCH_RULES.register(_rnn, rnn)
for _cell in ops.RNN_CELLS:
    BATCH_RULES.register(_cell, rnn_cell)
BATCH_RULES.register(nn.MultiheadAttention, multihead_attention)
for _layer in ops.TRANSFORMER_LAYERS:
    BATCH_RULES.register(_layer, transformer_layer)
BATCH_RULES.register_family(ops.PACK_PADDED, pack_padded)
BATCH_RULES.register_family(ops.PAD_PACKED, pad_packed)


def functional_batch_norm(ctx: RuleContext) -> Placement | None:
    """``F.batch_norm(x, running_mean, running_var, weight, bias, training, ...)`` (timm's
    ``BatchNormAct2d`` calls it directly): with running statistics (``training=False``) it is per
    sample; in training it normalises with statistics of the whole batch, so it runs whole."""
    from dpcompile.analysis.placement import Whole

    p = ctx.p(ctx.tensor_arg())
    training = ctx.arg(5, "training", False)
    others = [ctx.p(n) for n in ctx.node.all_input_nodes[1:]]
    if not (isinstance(p, Split) and p.dim == 0 and all(isinstance(o, Replicated) for o in others)):
        return None
    if training is False:
        return p
    if training is True and isinstance(ctx.arg(6, "momentum", 0.1), (float, int)) and isinstance(ctx.arg(7, "eps", 1e-5), (float, int)):
        return p  # the data-parallel pass computes the whole batch's statistics (runtime.functional_batch_norm)
    return Whole(reason="F.batch_norm in training mode with a traced training flag or momentum")


BATCH_RULES.register(nn.functional.batch_norm, functional_batch_norm)
