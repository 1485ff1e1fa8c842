"""Random factories sized by the batch: ``torch.normal(0.0, 1.0, (x.size(0), h))`` splits with the
batch as ``torch.zeros`` of that size does (each device draws its chunk's rows; exact random
gives them the single-device values)."""

from __future__ import annotations

import torch
import torch.fx as fx

from dpcompile.analysis.batch_rules.context import RuleContext
from dpcompile.analysis.batch_rules.pointwise import pointwise
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.batch_rules.shape import made_to_sizes
from dpcompile.analysis.placement import BatchSize, Placement, Replicated, Split


def normal(ctx: RuleContext) -> Placement | None:
    """``torch.normal(0.0, 1.0, (b, h))``: numbers for mean and std and a size holding a batch
    size draw each device's rows, as a factory makes them; tensor mean and std draw per element."""
    bound = {**dict(zip(("mean", "std", "size"), ctx.node.args)), **ctx.node.kwargs}
    if not all(isinstance(bound.get(n), (int, float)) for n in ("mean", "std")) or "size" not in bound:
        return pointwise(ctx)
    others = [v for k, v in bound.items() if k != "size"]
    if any(isinstance(v, fx.Node) and not isinstance(ctx.p(v), Replicated) for v in others):
        return None
    size = bound["size"]
    if isinstance(size, fx.Node) and isinstance(ctx.p(size), BatchSize) and ctx.p(size).shape_of_dim is not None:
        return Split(ctx.p(size).shape_of_dim)  # torch.normal(0.0, 1.0, x.shape)
    if not isinstance(size, (list, tuple)):
        return None
    return made_to_sizes(ctx, list(size))


BATCH_RULES.register(torch.normal, normal, replace=True)
