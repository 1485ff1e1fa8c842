"""One shard's tensor-parallel program (``shard_linear``'s SPMD form) split into micro-batches: the
collectives of :mod:`dpcompile.runtime.collectives` and the shard helpers of
:mod:`dpcompile.runtime.tensor_parallel` act on each sample alone, along the feature dims, so a
pipeline stage that is tensor parallel runs them per micro-batch
(``transform(..., pipeline=2, tensor_parallel=True)``, :mod:`dpcompile.recipes.pipeline_tensor_parallel`).

``gather_from_shards(x, dim, sizes)`` and ``split_to_shards`` are per sample where ``dim`` is not the
batch dim; a vocab-parallel ``cross_entropy_from_parts`` with ``reduction="sum"`` is a partial sum
per micro-batch and with ``"mean"`` a partial mean (each micro-batch's sum and count of valid rows,
as ``F.cross_entropy``'s), so each micro-batch reaches its loss on its own (1F1B)::

    before: loss = cross_entropy_from_parts(lse_all, target_logit, labels)          # on the gathered batch
    after:  loss_sum_mb0 = cross_entropy_from_parts(lse_all_mb0, .., reduction="sum")
            loss_count_mb0 = target_weight(labels_mb0, None, -100)
            loss = mean_of_partials([loss_sum_mb0, ..], [loss_count_mb0, ..])
"""

from __future__ import annotations

from dpcompile.analysis.batch_rules.context import RuleContext
from dpcompile.analysis.batch_rules.over_dims import split_on
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.batch_rules.third_party import per_sample
from dpcompile.analysis.placement import Partial, Placement, Split, Whole
from dpcompile.runtime import collectives
from dpcompile.runtime import tensor_parallel as tp_runtime


def along_feature_dim(ctx: RuleContext) -> Placement | None:
    """``gather_from_shards(x, dim, ...)`` / ``split_to_shards(x, dim, ...)``: per sample when
    ``dim`` surely is not the batch dim."""
    p = per_sample(ctx)
    if not isinstance(p, Split):
        return None
    dim = ctx.resolve(ctx.arg(1, "dim"), ctx.tensor_arg(), p.dim)
    return p if dim is not None and dim != p.dim else None


def last_dim(ctx: RuleContext) -> Placement | None:
    """``shard_logsumexp(logits)`` / ``shard_target_logit(logits, target, offset)``: over the last
    dim, per row, where the batch is not the last dim."""
    p = per_sample(ctx)
    if not isinstance(p, Split):
        return None
    last = ctx.resolve(-1, ctx.tensor_arg(), p.dim)
    return p if last is not None and last != p.dim else None


def cross_entropy_from_parts(ctx: RuleContext) -> Placement | None:
    """Per row with ``reduction="none"``; over rows split on dim 0 (the parts and the target alike) a
    sum is a partial sum and a mean a partial mean (the data-parallel pass counts the valid rows)."""
    reduction = ctx.arg(3, "reduction", "mean")
    p = per_sample(ctx)
    if reduction == "none" or p is None:
        return p
    rows_split = isinstance(p, Split) and p.dim == 0 and all(split_on(ctx.p(n), 0) for n in ctx.node.all_input_nodes)
    if rows_split and reduction in ("sum", "mean"):
        return Partial("sum" if reduction == "sum" else "loss_mean")
    return Whole(reason=f"vocab-parallel cross_entropy(reduction={reduction!r}) reduces over the batch")


for _function in (collectives.copy_to_shards, collectives.reduce_from_shards, tp_runtime.add_bias,
                  tp_runtime.linear_in_out, tp_runtime.masked_embedding):  # fmt: skip
    BATCH_RULES.register(_function, per_sample)
for _function in (collectives.gather_from_shards, collectives.split_to_shards):
    BATCH_RULES.register(_function, along_feature_dim)
for _function in (tp_runtime.shard_logsumexp, tp_runtime.shard_target_logit):
    BATCH_RULES.register(_function, last_dim)
BATCH_RULES.register(tp_runtime.cross_entropy_from_parts, cross_entropy_from_parts)

__all__ = ["along_feature_dim", "cross_entropy_from_parts", "last_dim"]
