"""Products of vectors and per-sample bilinear forms: ``dot``/``vdot`` of two split vectors (and
``v @ x`` of two, ``x.__rmatmul__(v)``) are partial sums over the batch; ``inner``, ``outer``,
``mv`` of a split operand and an unbatched one, ``F.bilinear`` of two split inputs, ``cross`` and
``linalg.vecdot`` along a non-batch dim are per sample (``vecdot`` along the batch dim: a partial sum)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dpcompile.analysis.batch_rules.context import RuleContext
from dpcompile.analysis.batch_rules.over_dims import along_dim, reduce_dims, register_unclaimed, split_on
from dpcompile.analysis.placement import Partial, Placement, Replicated, Split


def _two(ctx: RuleContext) -> tuple[object, object, int | None, int | None] | None:
    if len(ctx.node.args) < 2 or ctx.node.kwargs:
        return None
    a, b = ctx.node.args[:2]
    return ctx.p(a), ctx.p(b), ctx.ndim(a), ctx.ndim(b)


def vector_dot(ctx: RuleContext) -> Placement | None:
    """``dot(x, y)`` / ``vdot`` / ``inner`` of two 1-D tensors split alike: each device's dot, summed."""
    found = _two(ctx)
    if found is None:
        return None
    p, q, na, nb = found
    if na == nb == 1 and split_on(p, 0) and split_on(q, 0):
        return Partial("sum")
    return None


def inner(ctx: RuleContext) -> Placement | None:
    """``inner(x, y)`` contracts the last dims: per sample on a leading dim of ``x`` with ``y``
    unbatched (its leading dims come after ``x``'s); two split vectors: a partial sum."""
    found = _two(ctx)
    if found is None:
        return None
    p, q, na, nb = found
    if isinstance(p, Split) and isinstance(q, Replicated) and na is not None and p.dim < na - 1:
        return p
    return vector_dot(ctx)


def outer(ctx: RuleContext) -> Placement | None:
    """``outer(x, y)`` of a split ``x`` and an unbatched ``y``: row ``i`` is ``x[i] * y``."""
    found = _two(ctx)
    return Split(0) if found and split_on(found[0], 0) and isinstance(found[1], Replicated) else None


def mv(ctx: RuleContext) -> Placement | None:
    """``mv(M, v)`` with ``M`` split on its rows and ``v`` unbatched: one dot per row."""
    found = _two(ctx)
    return Split(0) if found and split_on(found[0], 0) and found[2] == 2 and isinstance(found[1], Replicated) else None


def bilinear(ctx: RuleContext) -> Placement | None:
    """``F.bilinear(x1, x2, weight, bias)``: per sample where ``x1`` and ``x2`` are split on the same
    leading dim and the weight and bias carry no batch."""
    args = ctx.node.args
    if len(args) < 3:
        return None
    p, q, na = ctx.p(args[0]), ctx.p(args[1]), ctx.ndim(args[0])
    if not isinstance(p, Split) or not split_on(q, p.dim) or na is None or p.dim >= na - 1:
        return None
    if any(not isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes[2:]):
        return None
    return p


def register() -> None:
    register_unclaimed(vector_dot, [torch.dot, "dot", torch.vdot, "vdot", torch.Tensor.__rmatmul__, "__rmatmul__",
                                    "aten.dot", "aten.vdot"])  # fmt: skip
    register_unclaimed(inner, [torch.inner, "inner", "aten.inner"])
    register_unclaimed(outer, [torch.outer, "outer", torch.ger, "ger", "aten.outer"])
    register_unclaimed(mv, [torch.mv, "mv", "aten.mv"])
    register_unclaimed(bilinear, [F.bilinear, "aten.bilinear"])
    register_unclaimed(along_dim(("input", "other", "dim")), [torch.cross, "cross"])  # dim=None: the first of size 3
    register_unclaimed(along_dim(("input", "other", "dim"), default=-1), [torch.linalg.cross, "aten.linalg_cross"])
    register_unclaimed(reduce_dims(("x", "y"), default=-1, partial="sum"), [torch.linalg.vecdot, "aten.linalg_vecdot"])


register()
