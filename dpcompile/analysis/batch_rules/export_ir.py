"""The ATen ops of ``torch.export``'s default (training) IR, and how the batch-rule table resolves each.

``torch.export.export`` does not decompose to the core opset: its graphs keep ``aten.linear``,
``aten.layer_norm``, ``aten.dropout``, ``aten.tensor_split.indices``, ``aten.pad``, in-place ops
(``aten.add_``) and the conversions (``aten.to.dtype``). :data:`EXPORT_IR_OPS` lists those it
emitted for the models of ``benchmarks/dp_models_sweep.py`` and the constructs of
``tests/analysis/test_split_by_construction.py`` (torch 2.13); :func:`resolve` says what the
data-parallel pass does with each, which ``tests/analysis/test_batch_rule_table.py`` checks for
every one of them and for whatever export emits for a few small models.
"""

from __future__ import annotations

import torch

from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.batch_rules.table import TABLE

aten = torch.ops.aten

EXPORT_IR_OPS: tuple[str, ...] = tuple(
    """
    __and__.Tensor _assert_tensor_metadata.default abs.default adaptive_avg_pool2d.default add.Tensor add_.Tensor
    addmm.default alias.default arange.default arange.start argmax.default argsort.default avg_pool2d.default
    baddbmm.default batch_norm.default bmm.default cat.default chunk.default clone.default contiguous.default
    conv2d.default copy_.default cos.default cross_entropy_loss.default cumsum.default detach_.default
    diff.default div.Tensor div_.Tensor dropout.default dropout_.default einsum.default embedding.default
    empty_like.default eq.Scalar eq.Tensor expand.default fill_.Tensor flatten.using_ints floor_divide.default
    full.default full_like.default gather.default ge.Scalar gelu.default gt.Scalar gt.Tensor hardsigmoid.default
    hardswish_.default hardtanh_.default histc.default im2col.default index.Tensor index_put_.default
    layer_norm.default le.Tensor lift_fresh_copy.default linalg_vector_norm.default linear.default log.default
    lt.Scalar masked_fill_.Scalar matmul.default max_pool2d.default mean.dim min.other mul.Tensor ne.Scalar
    neg.default new_ones.default new_zeros.default numpy_T.default ones.default pad.default permute.default
    pow.Tensor_Scalar pow.Tensor_Tensor relu.default relu_.default repeat.default reshape.default
    reshape_as.default rsqrt.default scaled_dot_product_attention.default select.int sigmoid.default silu.default
    sin.default slice.Tensor softmax.int sort.default split.Tensor split_with_sizes.default squeeze.default
    sub.Tensor sum.dim_IntList tanh.default tensor_split.indices tensor_split.sections to.device to.dtype
    to.dtype_layout topk.default transpose.int type_as.default unbind.int unfold.default unsqueeze.default
    view.default view_as.default where.ScalarOther where.self zeros.default zeros_like.default
    group_norm.default conv1d.default conv3d.default max_pool3d.default adaptive_avg_pool3d.default
    instance_norm.default upsample_nearest2d.vec upsample_bilinear2d.vec pixel_shuffle.default roll.default
    flip.default log_softmax.int rms_norm.default var.correction std.correction logsumexp.default max.dim
    amax.default index_select.default embedding_bag.padding_idx glu.default softplus.default mish.default
    expand_as.default masked_fill.Scalar native_dropout.default scaled_dot_product_attention.default
""".split()
)

# what the export frontend drops (checks of the capture, not ops on values)
DROPPED = frozenset({"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range", "sym_constrain_range_for_size"})


def resolve(op: str) -> tuple[str, str]:
    """``(how, what)`` for ``"aten.<op>.<overload>"`` (or ``"<op>.<overload>"``): ``("rule", name)``,
    ``("whole", reason)``, ``("in place", the functional op's rule)`` (``passes.functionalize``
    makes ``x.add_(y)`` a value first: ``written``), ``("dropped", why)`` or ``("none", "")``."""
    name = op.removeprefix("aten.").split(".")[0]
    entry = TABLE.get(name)
    if entry is not None:
        return ("whole", entry.whole) if entry.whole else ("rule", entry.rule.__name__)
    if name in DROPPED:
        return "dropped", "a check of the capture, which the export frontend drops"
    if name.endswith("_") and not name.endswith("__") and name[:-1] in TABLE:
        functional = TABLE[name[:-1]]
        return "in place", f"functionalised into written(...) (rule written_rule); then {functional.rule.__name__}"
    packet = getattr(aten, name, None)
    rule = BATCH_RULES.function_rule(packet) if packet is not None else None
    if rule is not None:
        return "rule", rule.__name__
    if name == "histc":  # local_order's rule, for keys in a device's own order only
        return "whole", "a histogram of the whole tensor, its range read from the data (split only over a device's own order)"
    return "none", ""


__all__ = ["EXPORT_IR_OPS", "resolve"]
