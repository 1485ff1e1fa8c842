"""Ops that move, flip, tile or lift dims without mixing samples (``fliplr``, ``rot90``, ``tile``,
``movedim``, ``atleast_2d``, ``diag_embed``) and the ``*_copy`` forms of views (``expand_copy``,
``unbind_copy``): per sample wherever the batch dim is not one they flip, rotate or tile, the
output split on wherever the batch dim lands."""

from __future__ import annotations

import torch

from dpcompile.analysis.batch_rules import shape
from dpcompile.analysis.batch_rules.context import RuleContext
from dpcompile.analysis.batch_rules.over_dims import leading_dims, register_unclaimed
from dpcompile.analysis.placement import Placement, Replicated, Split, Tuple


def _alone(ctx: RuleContext) -> tuple[Split, int] | None:
    """The input's split and rank, where it is the only tensor carrying the batch."""
    p, nd = ctx.p(ctx.tensor_arg()), ctx.ndim(ctx.tensor_arg())
    if not isinstance(p, Split) or nd is None:
        return None
    if any(not isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes[1:]):
        return None
    return p, nd


def fliplr(ctx: RuleContext) -> Placement | None:
    """``fliplr(x)`` flips dim 1 (``flipud``, dim 0, has no rule: it reverses the rows)."""
    found = _alone(ctx)
    return found[0] if found and found[0].dim != 1 and found[1] >= 2 else None


def rot90(ctx: RuleContext) -> Placement | None:
    """``rot90(x, k, dims)`` turns the plane of ``dims``; the batch dim must be neither."""
    found = _alone(ctx)
    dims = ctx.arg(2, "dims", (0, 1))
    if not found or not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
        return None
    p, nd = found
    return None if p.dim in {d % nd for d in dims} else p


def tile(ctx: RuleContext) -> Placement | None:
    """``tile(x, reps)``: ``reps`` aligned to the last dims; the batch dim's must be 1, and leading
    reps beyond the rank add dims in front."""
    found = _alone(ctx)
    reps = ctx.arg(1, "dims")
    if not found or not isinstance(reps, (list, tuple)) or not all(isinstance(r, int) for r in reps):
        return None
    p, nd = found
    at = p.dim - (nd - len(reps))
    if at >= 0 and reps[at] != 1:
        return None
    return Split(p.dim + max(0, len(reps) - nd))


def movedim(ctx: RuleContext) -> Placement | None:
    """``movedim(x, source, destination)``: where the batch dim lands."""
    found = _alone(ctx)
    source, destination = ctx.arg(1, "source"), ctx.arg(2, "destination")
    if not found:
        return None
    p, nd = found
    source = [source] if isinstance(source, int) else source
    destination = [destination] if isinstance(destination, int) else destination
    if not isinstance(source, (list, tuple)) or not isinstance(destination, (list, tuple)):
        return None
    if not all(isinstance(d, int) for d in (*source, *destination)) or len(source) != len(destination):
        return None
    order: list[int | None] = [None] * nd
    for s, d in zip(source, destination):
        order[d % nd] = s % nd
    rest = iter(i for i in range(nd) if i not in {s % nd for s in source})
    order = [o if o is not None else next(rest) for o in order]
    return Split(order.index(p.dim))


def atleast(rank: int):  # noqa: ANN201 - a rule
    """``atleast_{rank}d(x)``: a tensor of that rank already is left alone; a lower one gains
    dims (``atleast_2d`` of ``(n,)`` is ``(1, n)``, ``atleast_3d`` of ``(b, n)`` is ``(b, n, 1)``)."""

    def rule(ctx: RuleContext) -> Placement | None:
        if not isinstance(ctx.tensor_arg(), torch.fx.Node):
            return None  # atleast_2d(x, y): a tuple of tensors
        found = _alone(ctx)
        if not found:
            return None
        p, nd = found
        if nd >= rank:
            return p
        lifted = {(1, 2): 1, (1, 3): 1, (2, 3): 0}  # (rank of x, rank wanted): where dim 0 lands
        return Split(p.dim + lifted[(nd, rank)]) if (nd, rank) in lifted else None

    rule.__name__ = rule.__qualname__ = f"atleast_{rank}d"
    return rule


def unbind_copy(ctx: RuleContext) -> Placement | None:
    """``unbind_copy(x, dim)`` along a non-batch dim: pieces split on the batch dim (shifted past ``dim``)."""
    found = _alone(ctx)
    dim = ctx.arg(1, "dim", 0)
    if not found or not isinstance(dim, int):
        return None
    p, dim = found[0], dim % found[1]
    if dim == p.dim:
        return None
    value = ctx.node.meta.get("val")
    if not isinstance(value, (list, tuple)):
        return None
    return Tuple((Split(p.dim - 1 if dim < p.dim else p.dim),) * len(value))


# diag_embed(x, offset, dim1=-2, dim2=-1): the last dim becomes a diagonal of two new last dims
diag_embed = leading_dims(1, fixed=("dim1", "dim2"), params=("input", "offset", "dim1", "dim2"))


def register() -> None:
    register_unclaimed(fliplr, [torch.fliplr, "fliplr"])
    register_unclaimed(rot90, [torch.rot90, "rot90", "aten.rot90"])
    register_unclaimed(tile, [torch.tile, "tile"])
    register_unclaimed(movedim, [torch.movedim, "movedim", torch.moveaxis, "moveaxis"])
    for rank, fn in ((1, torch.atleast_1d), (2, torch.atleast_2d), (3, torch.atleast_3d)):
        register_unclaimed(atleast(rank), [fn])
    register_unclaimed(diag_embed, [torch.diag_embed, "diag_embed", "aten.diag_embed"])
    register_unclaimed(unbind_copy, [torch.unbind_copy, "aten.unbind_copy"])
    copies = {"expand_copy": shape.expand, "diagonal_copy": shape.diagonal,  # the views' rules, for their copies
              "split_with_sizes_copy": shape.chunk_like, "unfold_copy": shape.along_dims_unfold}  # fmt: skip
    for copy, rule in copies.items():
        register_unclaimed(rule, [getattr(torch, copy), f"aten.{copy}"])


register()


def unflatten(ctx: RuleContext) -> Placement | None:
    """``unflatten(x, dim, sizes)`` of a non-batch dim: ``len(sizes)`` dims where ``dim`` was."""
    found = _alone(ctx)
    dim, sizes = ctx.arg(1, "dim"), ctx.arg(2, "sizes")
    if not found or not isinstance(dim, int) or not isinstance(sizes, (list, tuple)):
        return None
    p, nd = found
    dim %= nd
    if dim == p.dim:
        return None
    return Split(p.dim + len(sizes) - 1 if dim < p.dim else p.dim)


register_unclaimed(unflatten, [torch.unflatten, "unflatten", "aten.unflatten"])  # aten: the export frontend (SigLIP's pooling head)
