"""Ops along, or over, the dims their arguments name: cumulative ops (``cumprod``, ``cummax``,
``logcumsumexp``, ``cumulative_trapezoid``), order statistics (``quantile``, ``median``,
``mode``, ``kthvalue``), moments (``var_mean``, ``aminmax``), ``take_along_dim``, the FFT
shifts, and the lookups ``searchsorted`` / ``bucketize``. Each is per sample wherever the batch
dim is not a named dim; over the batch dim (or every dim, their default) it mixes rows and runs
whole. Their Tensor methods and ATen packets share the rule."""

from __future__ import annotations

import torch
import torch.fx as fx

from dpcompile.analysis.batch_rules.context import RuleContext, node_shape
from dpcompile.analysis.batch_rules.over_dims import along_dim, reduce_dims, register_unclaimed, split_on
from dpcompile.analysis.placement import Placement, Replicated, Split

_KEEP = ("input", "dim", "keepdim")

# name: the rule, for torch.<name>, x.<name>() and aten.<name>
RULES = {
    "cumprod": along_dim(("input", "dim")),
    "logcumsumexp": along_dim(("input", "dim")),
    "cummax": along_dim(("input", "dim"), outputs=2),
    "cummin": along_dim(("input", "dim"), outputs=2),
    "cumulative_trapezoid": along_dim(("y", "x"), default=-1),
    "take_along_dim": along_dim(("input", "indices", "dim")),
    "trapezoid": reduce_dims(("y", "x"), default=-1),
    "trapz": reduce_dims(("y", "x"), default=-1),
    "quantile": reduce_dims(("input", "q", "dim", "keepdim"), leading_from="q"),
    "nanquantile": reduce_dims(("input", "q", "dim", "keepdim"), leading_from="q"),
    "median": reduce_dims(_KEEP, outputs=2),
    "nanmedian": reduce_dims(_KEEP, outputs=2),
    "mode": reduce_dims(_KEEP, default=-1, outputs=2),
    "kthvalue": reduce_dims(("input", "k", "dim", "keepdim"), default=-1, outputs=2),
    "aminmax": reduce_dims(("input",), outputs=2),
    "var_mean": reduce_dims(("input", "dim", "unbiased", "keepdim"), outputs=2),
    "std_mean": reduce_dims(("input", "dim", "unbiased", "keepdim"), outputs=2),
    "count_nonzero": reduce_dims(("input", "dim")),
    "all": reduce_dims(_KEEP),
    "nanmean": reduce_dims(_KEEP),
}
FFT_SHIFTS = along_dim(("input", "dim"))


def searchsorted(ctx: RuleContext) -> Placement | None:
    """``searchsorted(sorted_rows, values)``: one search per row, where both are split on the
    same leading dim (a 1-D sequence is one sequence: searching its chunks would not be)."""
    seq, values = ctx.node.args[:2] if len(ctx.node.args) >= 2 else (ctx.tensor_arg(), ctx.node.kwargs.get("values"))
    if not isinstance(seq, fx.Node) or not isinstance(values, fx.Node):
        return None  # one value searched in every row
    p, q = ctx.p(seq), ctx.p(values)
    shape, other = node_shape(seq), node_shape(values)
    if not isinstance(p, Split) or not split_on(q, p.dim) or shape is None or other is None or len(shape) != len(other):
        return None
    if p.dim >= len(shape) - 1 or any(not isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes[2:]):
        return None
    return p


def bucketize(ctx: RuleContext) -> Placement | None:
    """``bucketize(x, boundaries)``: element-wise in ``x``, the boundaries carry no batch."""
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split) or any(not isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes[1:]):
        return None
    return p


def register() -> None:
    for name, rule in RULES.items():
        spellings = [getattr(torch, name, None), name if hasattr(torch.Tensor, name) else None, f"aten.{name}"]
        register_unclaimed(rule, [s for s in spellings if s is not None])
    register_unclaimed(FFT_SHIFTS, [torch.fft.fftshift, torch.fft.ifftshift, "aten.fft_fftshift", "aten.fft_ifftshift"])
    register_unclaimed(searchsorted, [torch.searchsorted, "aten.searchsorted"])
    register_unclaimed(bucketize, [torch.bucketize, "aten.bucketize"])


register()
