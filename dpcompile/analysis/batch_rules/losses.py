"""Losses beyond :data:`~dpcompile.analysis.ops.LOSS_FUNCTIONS` (Gaussian and Poisson NLL,
margin and hinge losses, ``F.cosine_similarity``): one value per element or sample, then reduced.
``reduction="none"`` stays split on dim 0, ``"sum"`` becomes a partial sum over the batch and
``"mean"`` of a loss per element a partial mean (each device's sum and element count, as
``mse_loss``'s). A mean over samples of a loss per sample (triplet, multilabel soft margin) runs
whole: its count is rows, not elements, which the partial mean does not count."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from dpcompile.analysis.batch_rules.context import Rule, RuleContext, node_shape
from dpcompile.analysis.batch_rules.over_dims import bind, split_on
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.placement import Partial, Placement, Replicated, Split, Whole


def per_sample_loss(params: tuple[str, ...], min_rank: int = 1, per_element: bool = True) -> Rule:
    """A loss whose first argument (``params[0]``) is split on dim 0, with rank ``min_rank`` or more
    (a loss that reduces a sample's last dim needs 2: a 1-D input is one sample). Every other
    tensor is split alike with the same rank, or carries no batch and broadcasts without reaching
    dim 0 (a target of shape ``(1,)``, a class weight). ``per_element``: ``"mean"`` averages every
    element of the input (a partial mean), else one loss per sample (it runs whole)."""

    def rule(ctx: RuleContext) -> Placement | None:
        bound = bind(ctx, params)
        if bound is None or bound.get("size_average") is not None or bound.get("reduce") is not None:
            return None
        first = bound.get(params[0])
        shape = node_shape(first) if isinstance(first, fx.Node) else None
        if shape is None or len(shape) < min_rank or not split_on(ctx.p(first), 0):
            return None
        for node in ctx.node.all_input_nodes:
            other = node_shape(node)
            if node is first:
                continue
            if other is None:
                return None
            if split_on(ctx.p(node), 0):
                if len(other) != len(shape) or tuple(other[1:]) != tuple(shape[1:]):
                    return None  # the loss would broadcast past the input's shape (its mean's count)
            elif not isinstance(ctx.p(node), Replicated):
                return None
            elif node is bound.get("var") and len(other) == len(shape) - 1 > 0:
                return None  # gaussian_nll_loss reads a var of shape input.shape[:-1] as one per sample
            elif not _broadcasts_into(tuple(other), tuple(shape)):
                return None  # an unbatched tensor reaching dim 0 (as long as the batch) or past the input's shape
        reduction = bound.get("reduction", "mean")
        if reduction == "none":
            return Split(0)
        if reduction == "sum":
            return Partial("sum")
        if reduction == "mean" and per_element:
            return Partial("loss_mean")
        if reduction == "mean":
            return Whole(reason=f"{ctx.node.target.__name__}(reduction='mean') averages one loss per sample: the "
                                "partial mean counts elements, not rows")  # fmt: skip
        return None

    rule.__name__ = rule.__qualname__ = "per_sample_loss"
    return rule


def _broadcasts_into(small: tuple, big: tuple) -> bool:
    """``small`` broadcasts to ``big`` without a size of its own on ``big``'s dim 0."""
    at = len(big) - len(small)
    if at < 0 or (at == 0 and small and small[0] != 1):
        return False
    return all(s in (1, b) for s, b in zip(small, big[at:]))


def cosine_similarity(ctx: RuleContext) -> Placement | None:
    """``F.cosine_similarity(x1, x2, dim=1)``: per sample along a dim after the batch dim."""
    bound = bind(ctx, ("x1", "x2", "dim", "eps"))
    if bound is None:
        return None
    p, q = ctx.p(bound.get("x1")), ctx.p(bound.get("x2"))
    shape, other = node_shape(bound.get("x1")), node_shape(bound.get("x2"))
    dim = bound.get("dim", 1)
    if not split_on(p, 0) or not split_on(q, 0) or shape is None or shape != other or not isinstance(dim, int):
        return None
    return Split(0) if dim % len(shape) != 0 else None


_LOSSES: dict[object, tuple[Any, ...]] = {
    F.gaussian_nll_loss: (("input", "target", "var", "full", "eps", "reduction"),),
    F.poisson_nll_loss: (("input", "target", "log_input", "full", "size_average", "eps", "reduce", "reduction"),),
    F.margin_ranking_loss: (("input1", "input2", "target", "margin", "size_average", "reduce", "reduction"),),
    F.hinge_embedding_loss: (("input", "target", "margin", "size_average", "reduce", "reduction"),),
    F.soft_margin_loss: (("input", "target", "size_average", "reduce", "reduction"),),
    F.multilabel_soft_margin_loss: (("input", "target", "weight", "size_average", "reduce", "reduction"), 2, False),
    F.triplet_margin_loss: (("anchor", "positive", "negative", "margin", "p", "eps", "swap", "size_average",
                             "reduce", "reduction"), 2, False),
    F.multilabel_margin_loss: (("input", "target", "size_average", "reduce", "reduction"), 2, False),
}  # fmt: skip


def register() -> None:
    for fn, spec in _LOSSES.items():
        BATCH_RULES.register(fn, per_sample_loss(*spec))
    for target in (torch.cosine_similarity, F.cosine_similarity):
        if BATCH_RULES.function_rule(target) is None:
            BATCH_RULES.register(target, cosine_similarity)


register()
