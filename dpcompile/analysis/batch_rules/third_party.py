"""Functions of other libraries that fx keeps as calls (``torch.fx.wrap``), and per-sample random
ops: stochastic depth, drop block, Swin's window attention (2-D and video), MViT's helpers. Registered by qualified name, so
nothing here imports torchvision or timm.

Random ops run per device on their chunk: each sample still gets its own draw (the same
distribution as on one device, not the same numbers, as with dropout).
"""

from __future__ import annotations

from torch.fx._symbolic_trace import _assert_is_none

from dpcompile.analysis.batch_rules.context import RuleContext
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.placement import REPLICATED, Placement, Replicated, Split, Tuple, Whole
from dpcompile.runtime.random_more import stochastic_depth as runtime_stochastic_depth


def per_sample(ctx: RuleContext) -> Placement | None:
    """Per sample: the output is split as the first tensor argument; every other input carries
    no batch or is split on the same dim."""
    first = next((n for n in ctx.node.all_input_nodes if not isinstance(ctx.p(n), Replicated)), None)
    p = ctx.p(first) if first is not None else None
    if not isinstance(p, Split):
        return None
    for n in ctx.node.all_input_nodes:
        q = ctx.p(n)
        if not (isinstance(q, Replicated) or (isinstance(q, Split) and q.dim == p.dim)):
            return None
    return Split(p.dim)


def per_sample_dim0(ctx: RuleContext) -> Placement | None:
    """As :func:`per_sample`, the batch on dim 0 (the function treats dim 0 as its batch)."""
    out = per_sample(ctx)
    return out if isinstance(out, Split) and out.dim == 0 else None


def _expand_dim_after_batch(ctx: RuleContext) -> Split | None:
    """The split of ``fn(x, target_dim, expand_dim, ...)``'s ``x`` where ``expand_dim`` (the dim
    it may add or drop) lies after the batch dim, so the batch dim stays where it is."""
    p, expand = ctx.p(ctx.tensor_arg()), ctx.arg(2, "expand_dim")
    if isinstance(p, Split) and isinstance(expand, int) and expand > p.dim >= 0:
        return p
    return None


def mvit_unsqueeze(ctx: RuleContext) -> Placement | None:
    """torchvision MViT's ``_unsqueeze(x, target_dim, expand_dim) -> (x, x's rank)``."""
    p = _expand_dim_after_batch(ctx)
    return Tuple((p, REPLICATED)) if p is not None else None


def mvit_squeeze(ctx: RuleContext) -> Placement | None:
    """torchvision MViT's ``_squeeze(x, target_dim, expand_dim, tensor_dim)``."""
    return _expand_dim_after_batch(ctx)


def stochastic_depth(ctx: RuleContext) -> Placement | None:
    """``stochastic_depth(x, p, mode, training)``: identity in eval; per sample in ``"row"`` mode
    (one draw per row of dim 0). ``"batch"`` mode draws once for the whole batch: it runs whole."""
    p = ctx.p(ctx.tensor_arg())
    rate, mode, training = ctx.arg(1, "p"), ctx.arg(2, "mode"), ctx.arg(3, "training", True)
    if not isinstance(p, Split):
        return None
    if training is False or rate == 0.0:
        return Split(p.dim)
    if mode == "row" and p.dim == 0:
        return Split(0)
    return Whole(reason=f"stochastic_depth(mode={mode!r}) in training draws once for the whole batch")


def drop_block(ctx: RuleContext) -> Placement | None:
    """``drop_block2d/3d(x, p, block_size, inplace, eps, training)``: identity in eval; in training
    it rescales by the kept share of the whole batch, so it runs whole."""
    p = ctx.p(ctx.tensor_arg())
    rate, training = ctx.arg(1, "p"), ctx.arg(5, "training", True)
    if isinstance(p, Split) and (training is False or rate == 0.0):
        return Split(p.dim)
    return None


BATCH_RULES.register_by_name("torchvision.ops.stochastic_depth.stochastic_depth", stochastic_depth)
BATCH_RULES.register(runtime_stochastic_depth, stochastic_depth)  # its stand-in in an exported program
BATCH_RULES.register_by_name("torchvision.ops.drop_block.drop_block2d", drop_block)
BATCH_RULES.register_by_name("torchvision.ops.drop_block.drop_block3d", drop_block)
# Swin: attention within windows of one sample (its shift mask is built from the sample's shape)
BATCH_RULES.register_by_name("torchvision.models.swin_transformer.shifted_window_attention", per_sample_dim0)
BATCH_RULES.register_by_name("torchvision.models.swin_transformer._patch_merging_pad", per_sample_dim0)
BATCH_RULES.register_by_name("torchvision.models.video.swin_transformer.shifted_window_attention_3d", per_sample_dim0)
# MViT (video): the pooled attention's helpers; the two adds write into their first argument, per sample
BATCH_RULES.register_by_name("torchvision.models.video.mvit._unsqueeze", mvit_unsqueeze)
BATCH_RULES.register_by_name("torchvision.models.video.mvit._squeeze", mvit_squeeze)
BATCH_RULES.register_by_name("torchvision.models.video.mvit._add_rel_pos", per_sample_dim0)
BATCH_RULES.register_by_name("torchvision.models.video.mvit._add_shortcut", per_sample_dim0)
# fx's check that an optional argument traced as None is None: checked on each device's chunk
# (None scatters as None), so nothing is gathered for it
BATCH_RULES.register(_assert_is_none, per_sample)
