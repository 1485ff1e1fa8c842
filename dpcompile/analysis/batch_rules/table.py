"""The one table of batch rules by ATen op: every op of PyTorch's core ATen opset (the ops tagged
``torch.Tag.core``, what ``torch.export`` decomposes to) has a rule or an explicit ``whole`` with
the reason, and so do the other ATen ops the export frontend's graphs hold (``aten.linear``,
``aten.scaled_dot_product_attention``, ...).

One table, several spellings: registering an entry registers its rule for the ATen op packet
and for the fx spellings of the same op that share its arguments (``torch.acos``, ``x.acos()``,
``F.gelu``), so both frontends ask the same rule. The other fx spellings (``nn.GELU``,
``F.layer_norm`` of ``native_layer_norm``, ``nn.Conv2d`` of ``convolution``) are registered by
their family in the rule files with the same rule, which :func:`spellings` finds and
``tests/analysis/test_batch_rule_table.py`` checks. ``docs/batch_rules_coverage.md`` is written
from here (``python -m dpcompile.analysis.batch_rules.coverage``).

>>> from dpcompile.analysis.batch_rules.table import TABLE
>>> TABLE["gather"].family, TABLE["gather"].rule.__name__
('indexing', 'gather')
>>> TABLE["nonzero"].whole
'the indices of the whole tensor, a data-dependent count'
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpcompile.analysis.batch_rules import aten as aten_rules
from dpcompile.analysis.batch_rules import (
    batch_values,
    local_order,
    matrix,
    model_constructs,
    modules,
    pointwise,
    reductions,
    selection,
    shape,
    sizes,
    training_ir,
)
from dpcompile.analysis.batch_rules.context import Rule, RuleContext, tuple_of
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.placement import Placement, Whole

aten = torch.ops.aten


@dataclass(frozen=True)
class Entry:
    """One ATen op (by packet name): its family and rule, or why it runs whole."""

    op: str
    family: str
    rule: Rule
    whole: str | None = None  # the reason, for an op that always runs whole
    same_name: bool = True  # torch.<op> / F.<op> / x.<op>() are this op with its arguments

    @property
    def core(self) -> bool:
        return any(torch.Tag.core in getattr(self.packet, o).tags for o in self.packet.overloads())

    @property
    def packet(self) -> torch._ops.OpOverloadPacket:
        return getattr(aten, self.op)


def _whole_rule(reason: str) -> Rule:
    def whole(ctx: RuleContext) -> Placement | None:
        return Whole(reason=f"{ctx.node.target}: {reason}")

    whole.__name__ = whole.__qualname__ = "whole"
    return whole


TABLE: dict[str, Entry] = {}


def _add(family: str, rule: Rule, names: str, *, same_name: bool = True) -> None:
    for name in names.split():
        TABLE[name] = Entry(name, family, rule, same_name=same_name)


def _whole(reason: str, names: str, *, same_name: bool = True) -> None:
    for name in names.split():
        TABLE[name] = Entry(name, "whole", _whole_rule(reason), reason, same_name)


# ---------------------------------------------------------------------- element-wise (broadcasting)
_add(
    "pointwise",
    pointwise.pointwise,
    """
    abs acos acosh add alias asin asinh atan atan2 atanh bitwise_and bitwise_not bitwise_or bitwise_xor
    ceil clamp clone copy cos cosh div elu eq erf exp expm1 fill floor fmod full_like ge gelu gt hardtanh
    isinf isnan le leaky_relu log log10 log1p log2 logical_and logical_not logical_or logical_xor lt
    maximum minimum mul ne neg pow reciprocal relu remainder round rsqrt sigmoid sign sin sinh sqrt sub
    tan tanh trunc where _to_copy
    rsub silu hardswish hardsigmoid mish softplus clamp_min clamp_max __and__ __or__ __xor__ __invert__
    square isfinite nan_to_num lerp addcmul addcdiv contiguous detach lift_fresh_copy zeros_like
    ones_like empty_like floor_divide bitwise_left_shift bitwise_right_shift relu6 prelu logsigmoid
    masked_fill
""",
)
_add(
    "pointwise",
    pointwise.pointwise,
    """
    angle copysign deg2rad rad2deg digamma erfc erfinv exp2 float_power fmax fmin frac heaviside hypot i0 igamma
    igammac isneginf isposinf isreal ldexp lgamma logaddexp logaddexp2 logit mvlgamma nextafter polar positive
    real imag sgn signbit sinc xlogy conj conj_physical resolve_conj resolve_neg complex hardshrink softshrink
    alias_copy true_divide clip fix negative absolute arccos arcsin arctan arctan2 arccosh arcsinh arctanh
    multiply subtract divide greater greater_equal less less_equal not_equal isclose
""",
)
_add("pointwise", pointwise.pointwise, " ".join(n for n in dir(aten) if n.startswith("special_")), same_name=False)
_add("pointwise", pointwise.pointwise, "to", same_name=False)  # x.to(device) is not: its rule is to_method
_add("pointwise", pointwise.type_as, "type_as")  # only y's type is read: x keeps its split whatever y's rank
_add("pointwise", pointwise.pointwise, "rand_like randn_like randint_like bernoulli dropout poisson")  # random: a draw per element
_add("pointwise", tuple_of(pointwise.pointwise, 2), "native_dropout")
_add("along one dim", aten_rules.glu, "glu")
_add("along the last two dims", aten_rules.last_two_dims, "tril triu")

# ---------------------------------------------------------------------- reductions and ops along dims
_add("reduction (partial sum over the batch)", reductions.reduction("sum"), "sum nansum")
_add("reduction (partial mean over the batch)", reductions.reduction("mean"), "mean")
_add("reduction (along other dims)", reductions.reduction(None), "amax amin argmax argmin any prod var std logsumexp")
_add("values and indices along other dims", reductions.values_and_indices, "max min topk")
_add("values and indices along other dims; along the batch, each device's own order", local_order.sort, "sort")
_add("along one dim", reductions.softmax_like, "_softmax _log_softmax softmax log_softmax")
_add("along one dim; along the batch, of integers, a running sum over the devices", reductions.cumsum, "cumsum")
_add("along named dims", shape.along_dims, "flip roll")
_add("along named dims", selection.along_named_dims, "_fft_r2c _fft_c2r")
_add("along named dims", training_ir.fft, " ".join(f"fft_{n}" for n in training_ir.FFTS.split()), same_name=False)
_add("along one dim", aten_rules.diff, "diff")
_add("reduction (along other dims)", training_ir.norm, "norm linalg_vector_norm linalg_norm")
_add("values and indices along other dims", training_ir.argsort, "argsort")
_add("recurrent: each sample's sequence, the states on dim 1", training_ir.recurrent, "lstm gru rnn_tanh rnn_relu")

# ---------------------------------------------------------------------- views and shapes
_add("view", shape.reshape, "view reshape _unsafe_view")
_add("view", shape.expand, "expand broadcast_to")
_add("view", shape.permute, "permute")
_add("view", shape.transpose, "transpose transpose_copy swapaxes swapdims")
_add("view", shape.matrix_transpose, "t")
_add("view", shape.unsqueeze, "unsqueeze unsqueeze_copy")
_add("view", shape.squeeze, "squeeze")  # not squeeze_copy: squeeze() keeps a 1-row chunk's dim only for squeeze
_add("view", shape.flatten, "flatten ravel")
_add("view", shape.diagonal, "diagonal")
_add("view", shape.narrow, "narrow narrow_copy")
_add("view", aten_rules.slice_, "slice", same_name=False)
_add("view", aten_rules.select, "select")
_add("view", shape.chunk_like, "split_with_sizes split chunk unbind tensor_split unsafe_split unsafe_chunk")
_add("concatenate", shape.cat, "cat stack concatenate concat")  # concatenate, concat: aliases export keeps
_add("view", shape.repeat, "repeat")
_add("view", training_ir.shaped_as, "reshape_as view_as")
_add("pointwise", pointwise.pointwise, "expand_as")  # broadcasting y's shape, as y + 0 * x would
_add("along named dims", shape.along_dims_unfold, "unfold", same_name=False)  # F.unfold is im2col
_add("view", model_constructs.repeat_interleave, "repeat_interleave")
_add("size", shape.size, "sym_size", same_name=False)
_add("size", selection.stride, "sym_stride", same_name=False)
_whole("the element count of a chunk is not a size along one dim", "sym_numel", same_name=False)
_whole("where a chunk starts in memory differs by device", "sym_storage_offset", same_name=False)
_whole("strides address the whole tensor's memory", "as_strided")
_whole("a layout flag of the chunk, asked of the whole tensor", "sym_is_contiguous", same_name=False)
# named here also so that its packet exists from import on: torch.ops.aten loads packets when first read
_whole("resizes a tensor in place to sizes it names (the whole batch's, not a chunk's)", "resize_", same_name=False)

# ---------------------------------------------------------------------- factories (sizes that hold a batch size)
_add("factory", shape.factory, "empty full rand randn empty_strided new_ones new_zeros new_full new_empty ones zeros")
_add("factory", batch_values.arange, "arange")
_whole("a tensor holding a batch size (each device's chunk size) is not a slice of the whole's", "scalar_tensor")
_whole("a permutation of the whole batch's indices", "randperm")

# ---------------------------------------------------------------------- indexing
_add("indexing", batch_values.aten_index, "index", same_name=False)
_add("indexing", selection.gather, "gather")
_add("indexing", selection.scatter, "scatter scatter_add scatter_reduce")
_add("indexing", selection.index_select, "index_select")
_add("indexing", selection.index_put, "index_put")
_add("indexing", selection.slice_scatter, "slice_scatter select_scatter")
_whole("takes the source's elements in order over the whole tensor", "masked_scatter")
_whole("the indices of the whole tensor, a data-dependent count", "nonzero")
_whole("reads one number of the tensor (one sample's, per device)", "_local_scalar_dense")

# ---------------------------------------------------------------------- matrix ops
_add("matmul", model_constructs.matmul_weight_left, "mm matmul")
_add("matmul", matrix.bmm, "bmm baddbmm")
_add("matmul", matrix.addmm, "addmm")
_add("matmul", matrix.linear_function, "linear")
_add("matmul", selection.cdist, "_cdist_forward")
_add("matmul", selection.cdist, "cdist", same_name=False)  # the export frontend keeps aten.cdist undecomposed
_whole("distances between every pair of rows: the rows are the samples", "_pdist_forward")
_add("matmul", matrix.einsum, "einsum")
_add("attention", aten_rules.sdpa, "scaled_dot_product_attention")

# ---------------------------------------------------------------------- layers: convolution, pooling, padding
_add(
    "per sample (batch on dim 0)",
    modules.per_sample_dim0,
    """
    convolution avg_pool2d avg_pool3d _adaptive_avg_pool2d _adaptive_avg_pool3d upsample_bilinear2d
    upsample_nearest2d
    conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d max_pool1d max_pool2d max_pool3d
    avg_pool1d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d
    upsample_nearest1d pixel_shuffle pixel_unshuffle channel_shuffle im2col
    upsample_bicubic2d upsample_trilinear3d upsample_linear1d upsample_nearest3d
""",
)
_add(
    "per sample (batch on dim 0)",
    tuple_of(modules.per_sample_dim0, 2),
    """
    max_pool2d_with_indices max_pool3d_with_indices adaptive_max_pool2d
""",
)
_add("per sample (batch on dim 0)", aten_rules.col2im, "col2im")
_add(
    "per sample (batch on dim 0)",
    modules.per_sample_all_dim0,
    """
    grid_sampler_2d avg_pool2d_backward max_pool2d_with_indices_backward _adaptive_avg_pool2d_backward
""",
)
_add(
    "padding (the last dims)",
    modules.pad,
    """
    constant_pad_nd reflection_pad1d reflection_pad2d reflection_pad3d replication_pad1d replication_pad2d
    replication_pad3d pad
""",
)
_add("embedding", modules.embedding, "embedding")
_whole("bags are ranges of the whole batch's indices (offsets)", "_embedding_bag")
_whole("bags are ranges of the whole batch's indices (offsets)", "embedding_bag", same_name=False)  # export's spelling

# ---------------------------------------------------------------------- norms
_add("norm over the last dims", tuple_of(modules.layer_norm, 3), "native_layer_norm")
_add("norm over the last dims", modules.layer_norm, "layer_norm rms_norm")
_add("per sample (batch on dim 0)", modules.group_norm, "native_group_norm group_norm")
_add("per sample, whole where it updates running statistics", aten_rules.instance_norm, "instance_norm", same_name=False)
_add(
    "batch norm (whole in training)",
    aten_rules.batch_norm,
    """
    _native_batch_norm_legit _native_batch_norm_legit_no_training batch_norm
""",
    same_name=False,
)

# ---------------------------------------------------------------------- losses (the export frontend)
_add(
    "loss",
    aten_rules.summed_loss,
    """
    cross_entropy_loss nll_loss nll_loss_nd mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy
    binary_cross_entropy_with_logits
""",
    same_name=False,
)

# ---------------------------------------------------------------------- backward ops
_whole(
    "a backward op summing over the batch into weight gradients; dpcompile differentiates the forward "
    "program instead of capturing backward graphs",
    "convolution_backward native_layer_norm_backward native_group_norm_backward embedding_dense_backward",
)

for _name in [n for n in TABLE if not isinstance(getattr(aten, n, None), torch._ops.OpOverloadPacket)]:
    del TABLE[_name]  # an op this PyTorch lacks


# ---------------------------------------------------------------------- the fx spellings
def _candidates(entry: Entry) -> Iterator[Any]:
    """``torch.<op>``, ``F.<op>`` and ``x.<op>()`` where they exist (``_softmax``: ``torch.softmax``;
    ``native_layer_norm``: ``torch.native_layer_norm`` and ``torch.layer_norm`` is another entry)."""
    if not entry.same_name:
        return
    name = entry.op.lstrip("_")
    for namespace in (torch, F):
        fn = getattr(namespace, name, None)
        if callable(fn) and not isinstance(fn, type):
            yield fn
    if callable(getattr(torch.Tensor, name, None)):
        yield name


# spellings by another name: the fx forms whose rule is this op's (modules by their classes)
OTHER_SPELLINGS: dict[str, tuple[Any, ...]] = {
    "convolution": (F.conv1d, F.conv2d, F.conv3d, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d,
                    nn.ConvTranspose2d, nn.ConvTranspose3d),
    "max_pool2d_with_indices": (F.max_pool2d, nn.MaxPool2d),
    "max_pool3d_with_indices": (nn.MaxPool3d,),
    "avg_pool2d": (nn.AvgPool2d,),
    "avg_pool3d": (nn.AvgPool3d,),
    "_adaptive_avg_pool2d": (nn.AdaptiveAvgPool2d,),
    "_adaptive_avg_pool3d": (nn.AdaptiveAvgPool3d,),
    "upsample_bilinear2d": (F.interpolate, nn.Upsample),
    "upsample_nearest2d": (F.interpolate, nn.Upsample),
    "constant_pad_nd": (F.pad, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d, nn.ZeroPad2d),
    "reflection_pad1d": (nn.ReflectionPad1d,),
    "reflection_pad2d": (nn.ReflectionPad2d,),
    "reflection_pad3d": (nn.ReflectionPad3d,),
    "replication_pad2d": (nn.ReplicationPad2d,),
    "replication_pad3d": (nn.ReplicationPad3d,),
    "native_layer_norm": (F.layer_norm, nn.LayerNorm),
    "native_group_norm": (F.group_norm, nn.GroupNorm),
    "native_dropout": (F.dropout, nn.Dropout, "dropout"),
    "_softmax": (nn.Softmax,),
    "_log_softmax": (nn.LogSoftmax,),
    "embedding": (nn.Embedding,),
    "col2im": (F.fold, nn.Fold),
    "pixel_shuffle": (nn.PixelShuffle,),
    "pixel_unshuffle": (nn.PixelUnshuffle,),
    "channel_shuffle": (nn.ChannelShuffle,),
    "grid_sampler_2d": (F.grid_sample,),
    "_cdist_forward": (torch.cdist,),
    "_pdist_forward": (F.pdist,),
    "_embedding_bag": (F.embedding_bag,),
    "mm": (torch.matmul, "matmul"),
    "view": ("reshape", torch.reshape),
    "sym_size": ("size",),
    "_local_scalar_dense": ("item",),
    "linalg_vector_norm": (torch.linalg.vector_norm,),
    "linalg_norm": (torch.linalg.norm,),
    "unfold": ("unfold", torch.Tensor.unfold),
    **{f"fft_{n}": (getattr(torch.fft, n),) for n in training_ir.FFTS.split()},
    **{n: (getattr(torch.special, n.removeprefix("special_")),) for n in dir(aten)
       if n.startswith("special_") and callable(getattr(torch.special, n.removeprefix("special_"), None))},
    "glu": (nn.GLU,),
    "relu": (nn.ReLU,), "gelu": (nn.GELU,), "elu": (nn.ELU,), "hardtanh": (nn.Hardtanh,),
    "leaky_relu": (nn.LeakyReLU,), "sigmoid": (nn.Sigmoid,), "tanh": (nn.Tanh,),
}  # fmt: skip
# spellings with a rule of their own, and why (``spellings`` reports them apart)
OWN_RULES: dict[Any, str] = {
    F.batch_norm: "whole-batch statistics in training are computed across devices by the data-parallel pass",
    nn.BatchNorm1d: "the data-parallel pass syncs the statistics of a module batch norm in training",
    nn.BatchNorm2d: "the data-parallel pass syncs the statistics of a module batch norm in training",
    nn.BatchNorm3d: "the data-parallel pass syncs the statistics of a module batch norm in training",
}


def _registered(target: Any) -> Rule | None:
    if isinstance(target, type):
        entry = BATCH_RULES.modules.get(target)
        return entry[0] if entry else None
    if isinstance(target, str):
        return BATCH_RULES.methods.get(target)
    return BATCH_RULES.function_rule(target)


def _same(a: Rule | None, b: Rule | None) -> bool:
    return (
        a is not None
        and b is not None
        and (a is b or getattr(b, "__wrapped__", None) is a or getattr(a, "__wrapped__", None) is b)
    )


def spellings(entry: Entry) -> tuple[list[Any], list[tuple[Any, Rule | None]]]:
    """The fx spellings of ``entry``'s op that resolve to its rule, and those that resolve to
    another rule (or to none): ``(same, [(spelling, its rule)])``."""
    same: list[Any] = []
    other: list[tuple[Any, Rule | None]] = []
    for target in list(_candidates(entry)) + list(OTHER_SPELLINGS.get(entry.op, ())):
        rule = _registered(target)
        if _same(rule, entry.rule):
            same.append(target)
        else:
            other.append((target, rule))
    return same, other


def _register() -> None:
    for entry in TABLE.values():
        BATCH_RULES.register(entry.packet, entry.rule)
        for target in list(_candidates(entry)) + list(OTHER_SPELLINGS.get(entry.op, ())):
            if _registered(target) is None:  # a spelling no family has claimed: it shares the op's rule
                BATCH_RULES.register(
                    target, getattr(entry.rule, "__wrapped__", entry.rule) if isinstance(target, type) else entry.rule
                )


_register()
sizes.register()  # arithmetic on batch sizes, around whatever rule ``*``, ``//``, ``+``, ``-`` have


@functools.cache
def core_ops() -> tuple[str, ...]:
    """Every overload of PyTorch's core ATen opset, ``"aten.add.Tensor"``, sorted."""
    found = []
    for name in dir(aten):
        packet = getattr(aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            if torch.Tag.core in getattr(packet, overload).tags:
                found.append(f"aten.{name}.{overload}")
    return tuple(sorted(found))


__all__ = ["TABLE", "Entry", "OTHER_SPELLINGS", "OWN_RULES", "core_ops", "spellings"]
