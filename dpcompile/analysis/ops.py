"""The op catalogue: which functions, Tensor methods and modules behave alike.

One table of op families, read by both analyses: the batch rules of data parallelism
(:mod:`dpcompile.analysis.batch_rules`) and the sharding rules of tensor parallelism
(:mod:`dpcompile.analysis.sharding_rules`). A family lists an op in each form fx records
it: ``torch.relu`` / ``F.relu`` (``call_function``), ``x.relu()`` (``call_method``) and
``nn.ReLU`` (``call_module``).

Tensor parallelism carries a sharded value through fewer ops than data parallelism carries a
batch: its families are declared here too, as checked subsets (:meth:`OpFamily.only`) of the
families above, so an op is never listed twice and never in a family it does not belong to.

>>> import torch
>>> torch.relu in UNARY.functions and "relu" in UNARY.methods
True
>>> torch.log in UNARY.functions and torch.log not in SHARD_UNARY.functions
True
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from dpcompile import runtime


@dataclass(frozen=True)
class OpFamily:
    """Ops that one rule treats alike, as functions, Tensor method names and module types."""

    name: str
    functions: frozenset[Callable[..., Any]] = frozenset()
    methods: frozenset[str] = frozenset()
    modules: tuple[type[nn.Module], ...] = ()

    @classmethod
    def of(
        cls,
        name: str,
        *,
        functions: Collection[Callable[..., Any]] = (),
        methods: Collection[str] = (),
        modules: Collection[type[nn.Module]] = (),
    ) -> OpFamily:
        """Build a family from plain collections: ``OpFamily.of("matmul", functions={torch.matmul})``."""
        return cls(name, frozenset(functions), frozenset(methods), tuple(modules))

    def only(
        self,
        name: str,
        *,
        functions: Collection[Callable[..., Any]] = (),
        methods: Collection[str] = (),
        modules: Collection[type[nn.Module]] = (),
    ) -> OpFamily:
        """The sub-family of the named members; naming an op outside this family is an error."""
        outside = [f for f in functions if f not in self.functions] + [m for m in methods if m not in self.methods]
        outside += [m for m in modules if m not in self.modules]
        if outside:
            raise ValueError(f"{name}: {outside} are not in the op family {self.name!r}")
        return OpFamily.of(name, functions=functions, methods=methods, modules=modules)

    def __or__(self, other: OpFamily) -> OpFamily:
        return OpFamily(
            f"{self.name} | {other.name}",
            self.functions | other.functions,
            self.methods | other.methods,
            self.modules + tuple(m for m in other.modules if m not in self.modules),
        )

    def __iter__(self) -> Iterator[Any]:
        """Every member: functions, then method names, then module types."""
        yield from self.functions
        yield from self.methods
        yield from self.modules

    def matches(self, node: fx.Node, modules: Mapping[str, nn.Module] | None = None) -> bool:
        """Whether ``node`` calls a member (``modules``: ``dict(gm.named_modules())``, for ``call_module``)."""
        if node.op == "call_function":
            try:
                return node.target in self.functions
            except TypeError:  # an unhashable target
                return False
        if node.op == "call_method":
            return node.target in self.methods
        if node.op == "call_module" and modules is not None:
            return isinstance(modules.get(node.target), self.modules)
        return False


# ---------------------------------------------------------------------- element-wise
UNARY = OpFamily.of(
    "unary element-wise",
    functions={
        operator.neg, operator.pos, operator.abs, operator.invert,
        torch.neg, torch.abs, torch.exp, torch.log, torch.log1p, torch.expm1, torch.sqrt, torch.rsqrt,
        torch.sin, torch.cos, torch.tanh, torch.sigmoid, torch.relu, torch.clamp, torch.clip, torch.erf,
        torch.sign, torch.square, torch.reciprocal, torch.floor, torch.ceil, torch.round,
        torch.nan_to_num, torch.isnan, torch.isfinite, torch.logical_not,
        torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like, torch.rand_like, torch.randn_like,
        F.relu, F.relu6, F.gelu, F.silu, F.elu, F.selu, F.celu, F.leaky_relu, F.softplus, F.softsign,
        F.hardtanh, F.hardswish, F.hardsigmoid, F.mish, F.tanhshrink, F.logsigmoid, F.sigmoid, F.tanh,
        F.dropout, F.alpha_dropout, F.threshold,
        runtime.without_grad,  # where a torch.no_grad() block's value leaves it
    },
    methods={
        "neg", "abs", "exp", "log", "log1p", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu",
        "clamp", "clip", "square", "reciprocal", "sign", "floor", "ceil", "round", "logical_not", "isnan",
        "nan_to_num", "softplus", "erf",
        "float", "double", "half", "bfloat16", "int", "long", "bool", "contiguous", "clone", "detach",
        "relu_", "sigmoid_", "tanh_", "clamp_", "zero_", "fill_", "exp_", "neg_", "sqrt_",
        "requires_grad_", "detach_", "new_zeros_like",
    },
    modules=(
        nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.ELU, nn.SELU, nn.CELU, nn.LeakyReLU, nn.Tanh,
        nn.Sigmoid, nn.Softplus, nn.Softsign, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Mish,
        nn.Identity, nn.Dropout, nn.AlphaDropout, nn.Tanhshrink, nn.LogSigmoid, nn.Threshold,
    ),
)  # fmt: skip

BINARY = OpFamily.of(
    "binary element-wise (with broadcasting)",
    functions={
        operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.pow,
        operator.mod, operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
        operator.and_, operator.or_, operator.xor,
        torch.normal,  # normal(mean, std): a draw per element of the broadcast shape
        torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.pow, torch.where,
        torch.maximum, torch.minimum, torch.masked_fill, torch.lerp, torch.addcmul, torch.addcdiv,
        torch.logical_and, torch.logical_or, torch.eq, torch.ne, torch.gt, torch.lt, torch.ge, torch.le,
    },
    methods={
        "add", "sub", "mul", "div", "pow", "type_as", "masked_fill", "expand_as",
        "eq", "ne", "gt", "lt", "ge", "le", "maximum", "minimum", "where", "lerp",
        "add_", "sub_", "mul_", "div_", "pow_", "masked_fill_",
    },
)  # fmt: skip

POINTWISE = UNARY | BINARY

# Python arithmetic on sizes (``b * t``, ``c // heads``): a Python value when every operand is one
PYTHON_ARITHMETIC = OpFamily.of(
    "Python arithmetic",
    functions={
        operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.pow, operator.mod,
        operator.neg,
    },
)  # fmt: skip

# ---------------------------------------------------------------------- along one dim
ALONG_DIM = OpFamily.of(
    "along one dim (softmax, cumsum, normalize)",
    functions={torch.softmax, torch.log_softmax, F.softmax, F.log_softmax, torch.cumsum, F.normalize},
    methods={"softmax", "log_softmax", "cumsum"},
    modules=(nn.Softmax, nn.LogSoftmax, nn.Softmin),
)

REDUCTIONS = OpFamily.of(
    "reductions",
    functions={torch.sum, torch.mean, torch.amax, torch.amin, torch.logsumexp},
    methods={"sum", "mean", "amax", "amin", "logsumexp"},
)
# reductions whose per-chunk results combine into the whole's (the rest must avoid the batch dim)
PARTIAL_REDUCTIONS: dict[str, str] = {"sum": "sum", "mean": "mean"}

# ---------------------------------------------------------------------- matrix ops
MATMUL = OpFamily.of("matmul", functions={operator.matmul, torch.matmul, torch.bmm}, methods={"matmul", "bmm"})
LINEAR = OpFamily.of("linear", functions={F.linear}, modules=(nn.Linear,))
ATTENTION = OpFamily.of("attention", functions={F.scaled_dot_product_attention}, modules=(nn.MultiheadAttention,))

# ---------------------------------------------------------------------- views and shape ops
VIEW = OpFamily.of("view", functions={torch.reshape}, methods={"view", "reshape"})
TRANSPOSE = OpFamily.of("transpose", functions={torch.transpose, torch.swapaxes}, methods={"transpose", "swapaxes"})
MATRIX_TRANSPOSE = OpFamily.of("matrix transpose", functions={torch.t}, methods={"t"})
PERMUTE = OpFamily.of("permute", functions={torch.permute}, methods={"permute"})
FLATTEN = OpFamily.of("flatten", functions={torch.flatten}, methods={"flatten"}, modules=(nn.Flatten,))
UNSQUEEZE = OpFamily.of("unsqueeze", functions={torch.unsqueeze}, methods={"unsqueeze"})
SQUEEZE = OpFamily.of("squeeze", functions={torch.squeeze}, methods={"squeeze"})
EXPAND = OpFamily.of("expand", methods={"expand"})
CONCAT = OpFamily.of("concatenate", functions={torch.cat, torch.concat, torch.stack})
CHUNK = OpFamily.of(
    "chunk", functions={torch.chunk, torch.split, torch.unbind}, methods={"chunk", "split", "unbind"}
)
FACTORIES = OpFamily.of(
    "factories",
    functions={torch.zeros, torch.ones, torch.empty, torch.full, torch.randn, torch.rand},
    methods={"new_zeros", "new_ones", "new_empty", "new_full"},
)

# the attributes of a tensor, as ``getattr`` nodes read them
TENSOR_ATTRIBUTES = frozenset(
    {"dtype", "device", "ndim", "is_cuda", "requires_grad", "layout", "shape", "T", "mT", "data", "grad"}
)
# those whose value is a Python value the same for every chunk of a batch
METADATA_ATTRIBUTES = frozenset({"dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"})

# ---------------------------------------------------------------------- layers
PER_SAMPLE = OpFamily.of(
    "per sample, batch on dim 0 (convolutions, pooling, per-sample norms)",
    functions={
        F.conv1d, F.conv2d, F.conv3d, F.max_pool1d, F.max_pool2d, F.avg_pool1d, F.avg_pool2d,
        F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d, F.interpolate,
        F.dropout1d, F.dropout2d, F.dropout3d, F.feature_alpha_dropout, torch.multinomial,
    },
    modules=(
        nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
        nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
        nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
        nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.GroupNorm, nn.Upsample, nn.PixelShuffle,
        nn.PixelUnshuffle, nn.LocalResponseNorm, nn.Dropout2d, nn.Dropout3d, nn.Dropout1d, nn.PReLU,
        nn.FeatureAlphaDropout,
    ),
)  # fmt: skip
# pads the last len(pad) // 2 dims: per sample only where those lie after the batch dim
PAD = OpFamily.of(
    "padding (the last dims)",
    functions={F.pad},
    modules=(
        nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d,
        nn.ReflectionPad1d, nn.ReflectionPad2d, nn.ReflectionPad3d, nn.ReplicationPad1d, nn.ReplicationPad2d,
        nn.ReplicationPad3d, nn.CircularPad1d, nn.CircularPad2d, nn.CircularPad3d,
    ),
)  # fmt: skip
INSTANCE_NORMS: tuple[type[nn.Module], ...] = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
BATCH_NORMS: tuple[type[nn.Module], ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
LAST_DIMS = OpFamily.of(
    "on the last dims only (norms over features)",
    functions={F.layer_norm},
    modules=(nn.LayerNorm, nn.RMSNorm),
)
EMBEDDING = OpFamily.of("embedding", functions={F.embedding}, modules=(nn.Embedding,))
RNNS: tuple[type[nn.Module], ...] = (nn.RNNBase,)
RNN_CELLS: tuple[type[nn.Module], ...] = (nn.RNNCellBase,)
TRANSFORMER_LAYERS: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer, nn.TransformerEncoder)
PACK_PADDED = OpFamily.of("pack padded", functions={torch.nn.utils.rnn.pack_padded_sequence})
PAD_PACKED = OpFamily.of("pad packed", functions={torch.nn.utils.rnn.pad_packed_sequence})

# ---------------------------------------------------------------------- losses
# "elementwise": a loss per element, the target shaped like the input; "class": a loss per
# sample over class scores, the target a class index per sample
LOSS_FUNCTIONS: dict[Callable[..., Any], str] = {
    F.mse_loss: "elementwise",
    F.l1_loss: "elementwise",
    F.smooth_l1_loss: "elementwise",
    F.huber_loss: "elementwise",
    F.binary_cross_entropy: "elementwise",
    F.binary_cross_entropy_with_logits: "elementwise",
    F.cross_entropy: "class",
    F.nll_loss: "class",
}
# each loss module and the function it calls
LOSS_MODULES: dict[type[nn.Module], Callable[..., Any]] = {
    nn.MSELoss: F.mse_loss,
    nn.L1Loss: F.l1_loss,
    nn.SmoothL1Loss: F.smooth_l1_loss,
    nn.HuberLoss: F.huber_loss,
    nn.BCELoss: F.binary_cross_entropy,
    nn.BCEWithLogitsLoss: F.binary_cross_entropy_with_logits,
    nn.CrossEntropyLoss: F.cross_entropy,
    nn.NLLLoss: F.nll_loss,
}

# ---------------------------------------------------------------------- what tensor parallelism carries
# A sharded value passes through these (given matching shapes); anything else gathers it first.
SHARD_UNARY = UNARY.only(
    "sharded unary",
    functions={
        torch.relu, F.relu, F.relu6, F.gelu, F.silu, F.mish, F.hardswish, F.elu, F.leaky_relu, F.softplus,
        torch.tanh, torch.sigmoid, F.dropout, torch.exp, torch.neg, operator.neg, torch.erf, torch.abs,
        torch.square, torch.sqrt, torch.rsqrt,
    },
    methods={
        "relu", "sigmoid", "tanh", "exp", "neg", "abs", "sqrt", "rsqrt", "square", "erf",
        "float", "half", "bfloat16", "double", "contiguous", "clone",
    },
    modules=(
        nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Hardswish, nn.ELU, nn.LeakyReLU, nn.Softplus,
        nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity,
    ),
)  # fmt: skip
SHARD_BINARY = BINARY.only(
    "sharded binary",
    functions={
        operator.add, operator.sub, operator.mul, operator.truediv, operator.pow, torch.add, torch.sub,
        torch.mul, torch.div, torch.where, torch.maximum, torch.minimum,
    },
    methods={"add", "sub", "mul", "div", "pow", "masked_fill", "maximum", "minimum"},
)  # fmt: skip
SHARD_SOFTMAX = ALONG_DIM.only(
    "sharded softmax",
    functions={F.softmax, torch.softmax, F.log_softmax, torch.log_softmax},
    methods={"softmax", "log_softmax"},
    modules=(nn.Softmax,),
)
SHARD_ATTENTION = ATTENTION.only("sharded attention", functions={F.scaled_dot_product_attention})
SHARD_TRANSPOSE = TRANSPOSE.only("sharded transpose", functions={torch.transpose}, methods={"transpose"})
# the same ops as the export frontend's ATen overloads (same argument positions as the torch functions)
_aten = torch.ops.aten
SHARD_ATEN_UNARY = OpFamily.of(
    "sharded ATen unary",
    functions={
        _aten.relu.default, _aten.gelu.default, _aten.silu.default, _aten.tanh.default, _aten.sigmoid.default,
        _aten.exp.default, _aten.neg.default, _aten.erf.default, _aten.abs.default, _aten.sqrt.default,
        _aten.rsqrt.default, _aten.square.default, _aten.clone.default,
    },
)  # fmt: skip
SHARD_ATEN_BINARY = OpFamily.of(
    "sharded ATen binary",
    functions={
        _aten.add.Tensor, _aten.sub.Tensor, _aten.mul.Tensor, _aten.div.Tensor, _aten.pow.Tensor_Scalar,
        _aten.where.self, _aten.maximum.default, _aten.minimum.default,
    },
)  # fmt: skip
SHARD_ATEN_SOFTMAX = OpFamily.of("sharded ATen softmax", functions={_aten.softmax.int, _aten.log_softmax.int})
SHARD_ATEN_ATTENTION = OpFamily.of("sharded ATen attention", functions={_aten.scaled_dot_product_attention.default})
SHARD_ATEN_VIEW = OpFamily.of("sharded ATen view", functions={_aten.reshape.default, _aten.view.default})
SHARD_ATEN_TRANSPOSE = OpFamily.of("sharded ATen transpose", functions={_aten.transpose.int})
SHARD_ATEN_MATMUL = OpFamily.of("sharded ATen matmul", functions={_aten.matmul.default})
# the attributes of a sharded tensor that are Python values (``shape`` is the local shape)
SHARD_METADATA_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "is_cuda"})


__all__ = [
    "OpFamily",
    "UNARY",
    "BINARY",
    "POINTWISE",
    "PYTHON_ARITHMETIC",
    "ALONG_DIM",
    "REDUCTIONS",
    "PARTIAL_REDUCTIONS",
    "MATMUL",
    "LINEAR",
    "ATTENTION",
    "VIEW",
    "TRANSPOSE",
    "MATRIX_TRANSPOSE",
    "PERMUTE",
    "FLATTEN",
    "UNSQUEEZE",
    "SQUEEZE",
    "EXPAND",
    "CONCAT",
    "CHUNK",
    "FACTORIES",
    "TENSOR_ATTRIBUTES",
    "METADATA_ATTRIBUTES",
    "PER_SAMPLE",
    "PAD",
    "INSTANCE_NORMS",
    "BATCH_NORMS",
    "LAST_DIMS",
    "EMBEDDING",
    "RNNS",
    "RNN_CELLS",
    "TRANSFORMER_LAYERS",
    "PACK_PADDED",
    "PAD_PACKED",
    "LOSS_FUNCTIONS",
    "LOSS_MODULES",
    "SHARD_UNARY",
    "SHARD_RANDOM",
    "SHARD_BINARY",
    "SHARD_SOFTMAX",
    "SHARD_ATTENTION",
    "SHARD_TRANSPOSE",
    "SHARD_METADATA_ATTRIBUTES",
]


# ---------------------------------------------------------------------- tensor parallel: fused projections
# (kept apart from the data-parallel families above) a fused qkv output split into q, k, v
SHARD_SPLIT = CHUNK.only("sharded split", functions={torch.split, torch.chunk, torch.unbind}, methods={"split", "chunk", "unbind"})
SHARD_ATEN_SPLIT = OpFamily.of("sharded ATen split", functions={_aten.split.Tensor, _aten.chunk.default, _aten.unbind.int})
__all__ += ["SHARD_SPLIT"]
__all__ += [
    "SHARD_ATEN_UNARY", "SHARD_ATEN_BINARY", "SHARD_ATEN_SOFTMAX", "SHARD_ATEN_ATTENTION", "SHARD_ATEN_VIEW",
    "SHARD_ATEN_TRANSPOSE", "SHARD_ATEN_MATMUL", "SHARD_ATEN_SPLIT",
]  # fmt: skip

# ---------------------------------------------------------------------- tensor parallel: shapes and casts
# rotary embeddings (slice / getitem, cat, unsqueeze), grouped-query attention (expand + reshape,
# repeat_interleave of kv heads) and ops that leave values as they are (casts, copies, dropout)
SHARD_CAST = OpFamily.of(
    "sharded cast",
    functions={
        torch.clone, torch.detach, _aten.to.dtype, _aten.to.dtype_layout, _aten._to_copy.default, _aten.alias.default,
        _aten.detach.default, _aten.contiguous.default, _aten.lift_fresh_copy.default, _aten.dropout.default,
        _aten.feature_dropout.default,
    },
    methods={"to", "detach", "float", "half", "bfloat16", "double", "contiguous", "clone"},
)  # fmt: skip
SHARD_TUPLE_DROPOUT = OpFamily.of("sharded dropout with its mask", functions={_aten.native_dropout.default,
                                                                              torch.native_dropout})
# draws of a tensor's shape (the values ignore the input's, or compare with it per element): each shard
# its own columns, exact_random draws each shard's slice of the whole tensor
SHARD_RANDOM = OpFamily.of(
    "sharded random draws", functions={torch.rand_like, torch.randn_like, torch.randint_like, torch.bernoulli}
)
SHARD_TYPE_AS = OpFamily.of("sharded type_as", functions={_aten.type_as.default}, methods={"type_as"})
SHARD_SLICE = OpFamily.of("sharded slice", functions={_aten.slice.Tensor})
SHARD_CAT = OpFamily.of("sharded concatenate", functions={torch.cat, torch.concat, _aten.cat.default})
SHARD_UNSQUEEZE = OpFamily.of("sharded unsqueeze", functions={torch.unsqueeze, _aten.unsqueeze.default}, methods={"unsqueeze"})
SHARD_EXPAND = OpFamily.of("sharded expand", functions={_aten.expand.default}, methods={"expand"})
SHARD_REPEAT_INTERLEAVE = OpFamily.of(
    "sharded repeat_interleave",
    functions={torch.repeat_interleave, _aten.repeat_interleave.self_int},
    methods={"repeat_interleave"},
)
SHARD_ATEN_PERMUTE = OpFamily.of("sharded ATen permute", functions={_aten.permute.default})
SHARD_ATEN_CROSS_ENTROPY = OpFamily.of("sharded ATen cross-entropy", functions={_aten.cross_entropy_loss.default})
__all__ += [
    "SHARD_CAST", "SHARD_TUPLE_DROPOUT", "SHARD_TYPE_AS", "SHARD_SLICE", "SHARD_CAT", "SHARD_UNSQUEEZE", "SHARD_EXPAND",
    "SHARD_REPEAT_INTERLEAVE", "SHARD_ATEN_PERMUTE", "SHARD_ATEN_CROSS_ENTROPY",
]  # fmt: skip
