"""Matrix ops: matmul/bmm, ``F.linear`` and ``nn.Linear`` (and layers on the last dims only)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from dpcompile.analysis import ops
from dpcompile.analysis.batch_rules.context import RuleContext
from dpcompile.analysis.batch_rules.pointwise import pointwise
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.placement import (
    Placement,
    Replicated,
    Split,
)


def matmul(ctx: RuleContext) -> Placement | None:
    a, b = ctx.node.args[0], ctx.node.args[1]
    pa, pb = ctx.p(a), ctx.p(b)
    na, nb = ctx.ndim(a), ctx.ndim(b)
    if isinstance(pa, Split) and isinstance(pb, Replicated):
        if na is None:
            return pa if pa.dim == 0 else None
        if na >= 2 and pa.dim <= na - 2 and (nb is None or nb <= 2 or pa.dim < na - nb):
            return Split(pa.dim)
        return None
    if isinstance(pa, Split) and isinstance(pb, Split) and pa.dim == pb.dim:
        if na is not None and nb is not None and na == nb and na >= 3 and pa.dim < na - 2:
            return Split(pa.dim)
        if na is None and nb is None and pa.dim == 0:
            return None
    return None


def linear_function(ctx: RuleContext) -> Placement | None:
    x = ctx.node.args[0]
    p = ctx.p(x)
    if isinstance(p, Split) and all(isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes if n is not x):
        nd = ctx.ndim(x)
        if nd is not None and p.dim >= nd - 1:
            return None
        return p
    return None


def last_dim_op(ctx: RuleContext) -> Placement | None:
    """Ops on the last dims only (Linear, LayerNorm, Embedding lookups): any other dim may be split."""
    p = ctx.p(ctx.tensor_arg())
    others = [ctx.p(n) for n in ctx.node.all_input_nodes[1:]]
    if not isinstance(p, Split) or not all(isinstance(o, Replicated) for o in others):
        return None
    nd = ctx.ndim(ctx.tensor_arg())
    if nd is not None and p.dim >= nd - 1:
        return None
    return p


BATCH_RULES.register_family(ops.MATMUL, matmul)
BATCH_RULES.register(F.linear, linear_function)
BATCH_RULES.register(nn.Linear, last_dim_op)
BATCH_RULES.register(nn.Bilinear, pointwise)
