"""Batch rules only ATen ops need (the export frontend's graphs): ``slice``/``select``/``index``
(fx records ``x[...]``), attention, batch norm's ATen forms, losses with an integer ``reduction``.

Every ATen op's rule is in the one table of :mod:`~dpcompile.analysis.batch_rules.table`, keyed by
op packet (``aten.view`` covers ``aten.view.default``); most are the fx-level rules, whose argument
positions are those of the ATen schemas. Ops without a rule run whole after a gather (correct,
not parallel).

``aten.arange(b)`` of a batch size and ``aten.index`` by such positions are rules of
:mod:`~dpcompile.analysis.batch_rules.batch_values` (each device holds its rows' global positions).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dpcompile.analysis.batch_positions import table_rows
from dpcompile.analysis.batch_rules.attention import sdpa_query_rows
from dpcompile.analysis.batch_rules.context import Rule, RuleContext, normalize_dim
from dpcompile.analysis.batch_rules.modules import per_sample_dim0
from dpcompile.analysis.batch_rules.sizes import is_whole_split_size
from dpcompile.analysis.placement import REPLICATED, Partial, Placement, Replicated, Split, Tuple
from dpcompile.runtime import exported as frontend

aten = torch.ops.aten
INT64_MAX = 9223372036854775807


def _split(ctx: RuleContext, value: Any) -> Split | None:
    p = ctx.p(value)
    return p if isinstance(p, Split) else None


def _others_replicated(ctx: RuleContext, *skip: Any) -> bool:
    return all(isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes if n not in skip)


def batch_norm(ctx: RuleContext) -> Placement | None:
    """Batch norm with running statistics (eval) is per sample; with batch statistics it needs
    the whole batch (a module call, which the export frontend restores where it can, keeps
    whole-batch statistics across devices instead)."""
    target = ctx.node.target
    if target.overloadpacket is aten._native_batch_norm_legit_no_training:
        training = False
    else:  # batch_norm(..., training, ...) / _native_batch_norm_legit(..., training, ...) and .no_stats
        training = _bound(ctx).get("training", True)
    if training is not False:
        return per_sample_dim0(ctx) if trains_with_whole_batch_statistics(ctx.node) else None
    p = per_sample_dim0(ctx)
    if p is None:
        return None
    if target.overloadpacket is aten.batch_norm:
        return p
    return Tuple((p, REPLICATED, REPLICATED))  # the saved statistics of training: empty here


def trains_with_whole_batch_statistics(node: fx.Node) -> bool:
    """``aten.batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps, ...)``
    in training, or in its module's mode read at run time (the export frontend's timm
    ``BatchNormAct2d``: ``getattr(bn, "training")``), with constant ``momentum`` and ``eps``: split,
    the data-parallel pass computing the whole batch's statistics (``runtime.functional_batch_norm``)."""
    if node.op != "call_function" or node.target is not aten.batch_norm.default or len(node.args) < 8:
        return False
    training, momentum, eps = node.args[5:8]
    reads_mode = (
        isinstance(training, fx.Node) and training.op == "call_function" and training.target is getattr
        and training.args[1:] == ("training",)
    )  # fmt: skip
    return (training is True or reads_mode) and all(isinstance(v, (int, float)) for v in (momentum, eps))


def instance_norm(ctx: RuleContext) -> Placement | None:
    """Per sample, unless it updates running statistics (given, and ``use_input_stats`` not False:
    training, or a mode read at run time): those average over the whole batch, updated once, so it
    runs whole (as the module's rule has it)."""
    bound = _bound(ctx)
    if bound.get("running_mean") is not None and bound.get("use_input_stats", True) is not False:
        return None
    return per_sample_dim0(ctx)


def _bound(ctx: RuleContext) -> dict[str, Any]:
    """The arguments of an ATen call by their schema names."""
    names = [a.name for a in ctx.node.target._schema.arguments]
    bound = dict(zip(names, ctx.node.args))
    bound.update(ctx.node.kwargs)
    return bound


def last_two_dims(ctx: RuleContext) -> Placement | None:
    """``tril``/``triu`` (a mask by row and column index of the last two dims): per sample where
    the batch dim is before them (a row index of a chunk is not the whole's)."""
    p = _split(ctx, ctx.tensor_arg())
    nd = ctx.ndim(ctx.tensor_arg())
    if p is None or nd is None or p.dim >= nd - 2 or not _others_replicated(ctx, ctx.tensor_arg()):
        return None
    return p


def glu(ctx: RuleContext) -> Placement | None:
    """``glu(x, dim=-1)`` halves ``dim``: per sample unless that is the batch dim."""
    p = _split(ctx, ctx.tensor_arg())
    if p is None or not _others_replicated(ctx, ctx.tensor_arg()):
        return None
    dim = ctx.module.dim if ctx.module is not None else ctx.arg(1, "dim", -1)
    dim = normalize_dim(dim, ctx.ndim(ctx.tensor_arg()), p.dim, ctx.min_ndim(ctx.tensor_arg()))
    return p if dim is not None and dim != p.dim else None


def col2im(ctx: RuleContext) -> Placement | None:
    """``col2im`` / ``F.fold`` of a batched ``(N, C*k, L)`` input (a 2-D one is one sample)."""
    p = _split(ctx, ctx.tensor_arg())
    if p is None or p.dim != 0 or ctx.ndim(ctx.tensor_arg()) != 3 or not _others_replicated(ctx, ctx.tensor_arg()):
        return None
    return p


def sdpa(ctx: RuleContext) -> Placement | None:
    """``scaled_dot_product_attention(q, k, v, mask)``: the same batch dim (before the last two)
    split in q, k, v; the mask split there too or replicated. Or the queries split on their own
    dim, keys and values whole (:func:`~dpcompile.analysis.batch_rules.attention.sdpa_query_rows`)."""
    return _sdpa_batch(ctx) or sdpa_query_rows(ctx)


def _sdpa_batch(ctx: RuleContext) -> Placement | None:
    args = list(ctx.node.args) + [None] * 4
    q, k, v, mask = args[:4]
    mask = ctx.node.kwargs.get("attn_mask", mask)
    ps = [_split(ctx, t) for t in (q, k, v)]
    if any(p is None for p in ps) or len({p.dim for p in ps}) != 1:
        return None
    dim = ps[0].dim
    nd = ctx.ndim(q)
    if nd is not None and dim >= nd - 2:
        return None
    low = ctx.min_ndim(q)
    if nd is None and (low is None or low < dim + 3):
        return None  # a 2-D query is one unbatched sequence: its dim 0 is the sequence
    if isinstance(mask, fx.Node):
        pm = ctx.p(mask)
        if isinstance(pm, Split):
            if ctx.ndim(mask) != nd or pm.dim != dim:
                return None
        elif not isinstance(pm, Replicated):
            return None
    for key, value in ctx.node.kwargs.items():
        if key != "attn_mask" and isinstance(value, fx.Node) and not isinstance(ctx.p(value), Replicated):
            return None
    return Split(dim)


def slice_(ctx: RuleContext) -> Placement | None:
    """``slice(x, dim, start, end, step)``: any slice of another dim; all of the batch dim; a
    table the same on every device sliced to a split size, each device its own rows."""
    rows = table_rows(ctx.node, ctx.placements)
    if rows is not None:
        return Split(rows[0])
    x = ctx.node.args[0]
    p = _split(ctx, x)
    bound = _bound(ctx)  # dim, start, end and step may come by keyword
    dim, start, end, step = bound.get("dim", 0), bound.get("start"), bound.get("end"), bound.get("step", 1)
    dim = 0 if dim is None else dim
    nd = ctx.ndim(x)
    if isinstance(dim, int) and dim < 0 and nd is not None:
        dim += nd
    if p is None or not isinstance(dim, int):
        return None
    batch_end = dim == p.dim and is_whole_split_size(ctx, x, p, end)
    if not _others_replicated(ctx, x, end if batch_end else x):
        return None
    if batch_end:
        end = None  # x[:batch_size]: the whole batch, each device's chunk whole
    if dim != p.dim:
        return p
    whole = start in (None, 0) and (end is None or (isinstance(end, int) and end >= INT64_MAX)) and step in (None, 1)
    return p if whole else None


def select(ctx: RuleContext) -> Placement | None:
    """``select(x, dim, i)`` of a non-batch dim."""
    x, dim = ctx.node.args[0], ctx.arg(1, "dim")
    p = _split(ctx, x)
    if p is None or not isinstance(dim, int) or not _others_replicated(ctx, x):
        return None
    nd = ctx.ndim(x)
    if dim < 0:
        if nd is None:
            return None
        dim += nd
    if dim == p.dim:
        return None
    return Split(p.dim - 1 if dim < p.dim else p.dim)


def summed_loss(ctx: RuleContext) -> Placement | None:
    """A loss with ``reduction=sum`` (the export frontend writes ``mean`` as ``sum / count``) over
    inputs split on dim 0: partial sums; ``reduction=none`` stays split."""
    target = ctx.node.target
    names = [a.name for a in target._schema.arguments]
    bound = dict(zip(names, ctx.node.args))
    bound.update(ctx.node.kwargs)
    reduction = bound.get("reduction", 1)
    first, second = ctx.node.args[0], ctx.node.args[1]
    p1, p2 = _split(ctx, first), _split(ctx, second)
    if p1 is None or p2 is None or p1.dim != 0 or p2.dim != 0 or not _others_replicated(ctx, first, second):
        return None
    if reduction == 0:
        return Split(0)
    if reduction == 2:
        return Partial("sum")
    return None


def count(ctx: RuleContext) -> Placement | None:
    """The count of a mean loss (``cross_entropy_count``, ``element_count``): summed over chunks."""
    p = _split(ctx, ctx.node.args[0])
    if p is not None and p.dim == 0 and _others_replicated(ctx, ctx.node.args[0]):
        return Partial("sum")
    return None


def diff(ctx: RuleContext) -> Placement | None:
    """``diff(x, n, dim, prepend, append)`` along a non-batch dim."""
    x = ctx.node.args[0]
    p = _split(ctx, x)
    dim = ctx.arg(2, "dim", -1)
    if p is None:
        return None
    dim = normalize_dim(dim, ctx.ndim(x), p.dim)
    if dim is None or dim == p.dim:
        return None
    for extra in ctx.node.all_input_nodes[1:]:
        q = ctx.p(extra)
        if not (isinstance(q, Replicated) or (isinstance(q, Split) and q.dim == p.dim)):
            return None
    return p


def mode_check(ctx: RuleContext) -> Placement | None:
    return REPLICATED


def register_aten_rule(name: str, rule: Rule) -> None:
    """Teach data parallelism an ATen op (by packet name, ``"addmm"``), replacing the table's rule."""
    from dpcompile.analysis.batch_rules.registry import BATCH_RULES

    packet = getattr(aten, name, None)
    if packet is not None:
        BATCH_RULES.register(packet, rule, replace=True)


def _function_rules() -> dict[Any, Rule]:
    return {
        frontend.cross_entropy_count: count,
        frontend.element_count: count,
        frontend.expect_value: mode_check,
        frontend.expect_mode: mode_check,
        frontend.expect_grad_mode: mode_check,
    }


_FUNCTIONS: dict[Any, Rule] | None = None


def aten_rule(node: fx.Node) -> Rule | None:
    """The rule for a helper the export frontend writes into its graphs (ATen ops are in the table)."""
    global _FUNCTIONS
    if _FUNCTIONS is None:
        _FUNCTIONS = _function_rules()
    try:
        return _FUNCTIONS.get(node.target)
    except TypeError:
        return None


__all__ = ["aten_rule", "register_aten_rule"]
