"""dp copies of a context-parallel program (``mesh={"dp": D, "cp": C}`` in one process): the
batch's split into copies, ``runtime.scatter(x, devices, 0)``, and the copies' outputs joined
again, ``runtime.gather(pieces, 0, device)``, act on every position alone, so the sequence split
that lowers each copy over its ``cp`` devices runs through them
(:meth:`dpcompile.recipes.data_parallel.DataParallelRecipe.lower`).

Each ``cp`` device scatters its own tokens of every row over the copies, and joins its tokens of
the copies' rows again; a value split on the dim the scatter or gather acts on has no rule (it
runs whole).
"""

from __future__ import annotations

from dpcompile.analysis.batch_rules.context import RuleContext
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.placement import Placement, Split, Tuple
from dpcompile.runtime import comm


def scatter_across(ctx: RuleContext) -> Placement | None:
    """``scatter(x, devices, dim)`` of ``x`` split on another dim: every piece split as ``x`` is."""
    p, devices, dim = ctx.p(ctx.tensor_arg()), ctx.arg(1, "devices"), ctx.arg(2, "dim", 0)
    if not isinstance(p, Split) or type(p) is not Split or not isinstance(devices, (list, tuple)):
        return None
    if ctx.resolve(dim, ctx.tensor_arg(), p.dim) in (None, p.dim) or (ctx.ndim(ctx.tensor_arg()) or 0) <= dim:
        return None
    return Tuple((Split(p.dim),) * len(devices))


def gather_across(ctx: RuleContext) -> Placement | None:
    """``gather(pieces, dim, device)`` of pieces all split on another dim: split as they are."""
    pieces, dim = ctx.tensor_arg(), ctx.arg(1, "dim")
    if not isinstance(pieces, (list, tuple)) or not pieces or not isinstance(dim, int):
        return None
    found = [ctx.p(piece) for piece in pieces]
    if not all(isinstance(p, Split) and type(p) is Split for p in found) or len({p.dim for p in found}) != 1:
        return None
    split = found[0].dim
    return None if ctx.resolve(dim, pieces[0], split) in (None, split) else Split(split)


BATCH_RULES.register(comm.scatter, scatter_across)
BATCH_RULES.register(comm.gather, gather_across)

__all__ = ["gather_across", "scatter_across"]
