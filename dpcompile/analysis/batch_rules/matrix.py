"""Matrix ops: matmul/bmm, ``F.linear`` and ``nn.Linear`` (and layers on the last dims only)."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from dpcompile.analysis import ops
from dpcompile.analysis.batch_rules.context import RuleContext, node_shape, target_name
from dpcompile.analysis.batch_rules.pointwise import pointwise
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.placement import (
    Placement,
    Replicated,
    Split,
)


def assume_batched(ctx: RuleContext, x: object, p: Split, rank: int | None = None) -> None:
    """A rule that takes dim ``p.dim`` of ``x`` (rank unknown) for the batch assumes ``x`` has a
    feature dim after it (or ``rank`` dims, a convolution's batched input): recorded on an input,
    so a call with fewer dims (one unbatched sample, ``nn.Linear`` on a 1-D tensor, ``nn.Conv2d``
    on a 3-D one) runs on one device instead of splitting the features or channels."""
    if isinstance(x, fx.Node) and x.op == "placeholder" and ctx.ndim(x) is None:
        x.meta["dpcompile_min_rank"] = max(x.meta.get("dpcompile_min_rank", 0), rank or p.dim + 2)


def matmul(ctx: RuleContext) -> Placement | None:
    a, b = ctx.node.args[0], ctx.node.args[1]
    pa, pb = ctx.p(a), ctx.p(b)
    na, nb = ctx.ndim(a), ctx.ndim(b)
    if isinstance(pa, Split) and isinstance(pb, Replicated):
        if na is None:
            if pa.dim == 0:
                assume_batched(ctx, a, pa)
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
        assume_batched(ctx, x, p)
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
    assume_batched(ctx, ctx.tensor_arg(), p)
    return p


BATCH_RULES.register_family(ops.MATMUL, matmul)
BATCH_RULES.register(F.linear, linear_function)
BATCH_RULES.register(nn.Linear, last_dim_op)
BATCH_RULES.register(nn.Bilinear, pointwise)


def _rows_broadcast(ctx: RuleContext, bias: object, batch_dims: int) -> bool:
    """Whether an added term carries no batch and broadcasts over the leading (batch) dims."""
    if not isinstance(bias, fx.Node):
        return True
    if not isinstance(ctx.p(bias), Replicated):
        return False
    shape = node_shape(bias)
    if shape is None:
        return False
    leading = len(shape) - (batch_dims + 1)  # a bias of the result's rank has a leading batch-sized dim
    return leading < 0 or all(s == 1 for s in shape[: leading + 1])


def addmm(ctx: RuleContext) -> Placement | None:
    """``torch.addmm(bias, x, w)`` (GPT-2's Conv1D): rows of ``x`` split, ``w`` and a bias that
    broadcasts over rows carry no batch."""
    bias, a, b = (list(ctx.node.args) + [None, None, None])[:3]
    pa, pb = ctx.p(a), ctx.p(b)
    if isinstance(pa, Split) and pa.dim == 0 and isinstance(pb, Replicated) and _rows_broadcast(ctx, bias, 1):
        return Split(0)
    return None


def bmm(ctx: RuleContext) -> Placement | None:
    """``torch.bmm(a, b)`` / ``baddbmm(c, a, b)``: batches of matrices, both split on dim 0 (the
    added term split on dim 0 too, or broadcasting over it)."""
    added = None
    if target_name(ctx.node) == "baddbmm":  # baddbmm(input, batch1, batch2), any of them by keyword
        added, args = ctx.arg(0, "input"), [ctx.arg(1, "batch1"), ctx.arg(2, "batch2")]
    else:
        args = [ctx.arg(0, "input"), ctx.arg(1, "mat2")]
    pa, pb = ctx.p(args[0]), ctx.p(args[1])
    if not (isinstance(pa, Split) and pa.dim == 0 and isinstance(pb, Split) and pb.dim == 0):
        return None
    if added is not None:
        pc = ctx.p(added) if isinstance(added, fx.Node) else Replicated()
        if not ((isinstance(pc, Split) and pc.dim == 0) or _rows_broadcast(ctx, added, 2)):
            return None
    return Split(0)


def einsum(ctx: RuleContext) -> Placement | None:
    """``torch.einsum(eq, *operands)``: every split operand carries one letter on its split dim,
    no unsplit operand has it, and the output keeps it (else the batch would be summed away)."""
    args = list(ctx.node.args)
    if not args or not isinstance(args[0], str):
        return None
    equation, operands = args[0].replace(" ", ""), args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if "..." in equation or "->" not in equation:
        return None
    inputs, output = equation.split("->")
    terms = inputs.split(",")
    if len(terms) != len(operands):
        return None
    letter = None
    for term, operand in zip(terms, operands):
        p = ctx.p(operand)
        if isinstance(p, Split):
            if p.dim >= len(term) or (letter is not None and term[p.dim] != letter) or term.count(term[p.dim]) != 1:
                return None
            letter = term[p.dim]
        elif not isinstance(p, Replicated):
            return None
    if letter is None or output.count(letter) != 1:
        return None
    for term, operand in zip(terms, operands):
        if isinstance(ctx.p(operand), Replicated) and letter in term:
            return None
    return Split(output.index(letter))


def _per_sample_dim0(ctx: RuleContext) -> Placement | None:
    p = ctx.p(ctx.tensor_arg())
    others = [ctx.p(n) for n in ctx.node.all_input_nodes[1:]]
    if isinstance(p, Split) and p.dim == 0 and all(isinstance(o, Replicated) for o in others):
        return p
    return None


BATCH_RULES.register(torch.addmm, addmm)
BATCH_RULES.register("addmm", addmm)
BATCH_RULES.register(torch.baddbmm, bmm)
BATCH_RULES.register("baddbmm", bmm)
BATCH_RULES.register(torch.einsum, einsum)
BATCH_RULES.register(torch.bmm, bmm, replace=True)  # bmm never broadcasts: its own rule, not matmul's
BATCH_RULES.register("bmm", bmm, replace=True)
BATCH_RULES.register(F.unfold, _per_sample_dim0)
BATCH_RULES.register(nn.Unfold, _per_sample_dim0)
