"""One rule table on each dim: an op no sharding rule names, asked of its batch rule.

A batch rule (:mod:`dpcompile.analysis.batch_rules`) answers "the input split on dim b: where is
the result split?", and a sharded value is a split too, along a feature dim instead of the batch.
So an op the sharding rules do not know asks the batch-rule table with each sharded input as
``Split(its dim, counted from the front)``; a ``Split(d)`` result is ``Sharded(d - ndim)``,
anything else (a partial sum, a whole op, a size read) needs the whole tensor::

    before: torch.log(column_out)       -> NeedsWhole("needs the whole tensor"): gathered first
    after:  torch.log(column_out)       -> the pointwise batch rule: Split(2) -> Sharded(-1), no gather

Random draws stay whole here (each shard would draw its own numbers; the sharding rules carry
the draws ``exact_random`` can slice), as do writes and fused-projection (sectioned) values.
``apply_rule`` asks :func:`from_batch_rule` for every op no sharding rule names, and the planner's
``is_shard_transparent`` asks :func:`keeps_last_dim_sharded`; ``tests/analysis/opinfo_shard.py``
proves the delegated ops against OpInfo samples, and ``benchmarks/sharding_delegation_plans.py``
shows the plans that changed (a tied LM's ``cross_entropy(head(x).flatten(0, 1), ..)`` stays
vocab-parallel through the ``flatten``: under a pipeline each micro-batch's sum and count, as the
batch rule of ``cross_entropy_from_parts`` says, so 1F1B runs it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from dpcompile import runtime
from dpcompile.analysis.batch_positions import index_positions, running_sum_dim, table_rows
from dpcompile.analysis.batch_rules import RuleContext, rule_for
from dpcompile.analysis.batch_rules.aten import trains_with_whole_batch_statistics
from dpcompile.analysis.batch_rules.shape import squeeze_keeps
from dpcompile.analysis.ops import BATCH_NORMS
from dpcompile.analysis.placement import (
    REPLICATED,
    BatchSize,
    LocalOrder,
    Partial,
    Placement,
    Replicated,
    Split,
    Tuple,
    Whole,
)
from dpcompile.analysis.random_ops import random_kind
from dpcompile.analysis.sequence_exchange import is_sequence_marker
from dpcompile.analysis.sharding_layout import (
    Copied,
    Layout,
    LayoutContext,
    NeedsWhole,
    Sharded,
    flat_nodes,
    node_val,
    refuse_tuple_read_whole,
    tensor_ndim,
)

# splits the data-parallel pass makes exact by rewriting each device's call: not a plain op per shard
_PER_DEVICE_REWRITES = (squeeze_keeps, running_sum_dim, table_rows, index_positions)
_BATCH_NORM_FUNCTIONS = (F.batch_norm, torch.batch_norm, torch.ops.aten.native_batch_norm.default,
                         torch.ops.aten._native_batch_norm_legit_functional.default,
                         torch.ops.aten._native_batch_norm_legit.default)  # fmt: skip


def _normalises_with_batch_statistics(node: fx.Node) -> bool:
    return node.target in _BATCH_NORM_FUNCTIONS or trains_with_whole_batch_statistics(node)


def from_batch_rule(
    ctx: LayoutContext, node: fx.Node, modules: Mapping[str, nn.Module]
) -> tuple[Layout, list[fx.Node]]:
    """The layout of ``node``'s result by its batch rule, and the replicated tensor args that need *f*."""
    if node.op not in ("call_function", "call_method", "call_module") or node.target is runtime.written:
        raise NeedsWhole("needs the whole tensor")
    module = modules.get(node.target) if node.op == "call_module" else None
    gm = node.graph.owning_module
    if gm is not None and random_kind(gm, node) is not None:
        raise NeedsWhole("a random draw: each shard would draw its own numbers")
    if isinstance(module, BATCH_NORMS) or _normalises_with_batch_statistics(node) or is_sequence_marker(node):
        raise NeedsWhole("needs the whole tensor")  # their split is the data-parallel pass' own (synced statistics)
    rule = rule_for(node, module)
    if rule is None:
        raise NeedsWhole("needs the whole tensor")
    placements, ref = _as_splits(ctx, node)
    _refuse_spanning_operands(ctx, node, ref)
    try:
        out = rule(RuleContext(node, placements, module))
    except Exception as e:  # noqa: BLE001 - a rule that cannot read this call: the op runs whole, as before
        raise NeedsWhole(f"its batch rule {getattr(rule, '__name__', rule)} cannot read it ({type(e).__name__})") from e
    if out is not None:
        placements[node] = out
        if any(helper(node, placements) is not None for helper in _PER_DEVICE_REWRITES):
            raise NeedsWhole("its split needs the data-parallel pass' per-device rewrite (a running sum, squeeze())")
    layout = _as_layout(node, out, ref, getattr(rule, "__name__", "its batch rule"))
    if isinstance(out, Tuple):
        ctx.mark_tuple(node)
    operands = flat_nodes((node.args, node.kwargs))
    copies = [
        a for a in operands if isinstance(ctx.layout(a), (Replicated, Copied)) and isinstance(node_val(a), torch.Tensor)
    ]
    origins = frozenset().union(*(la.origins for a in operands if isinstance(la := ctx.layout(a), Sharded)))
    return dataclasses.replace(layout, origins=origins), copies


def keeps_last_dim_sharded(node: fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    """Whether ``node``'s batch rule carries its first tensor input, sharded on the last dim (a column
    layer's output), to a sharded result: the planner's "transparent" op (``torch.log`` between two layers)."""
    x = next((a for a in node.all_input_nodes if isinstance(node_val(a), torch.Tensor) and node_val(a).dim() > 0), None)
    if x is None:
        return False
    try:
        from_batch_rule(_LastDimSharded(x), node, modules)
    except NeedsWhole:
        return False
    return True


class _LastDimSharded:
    """``x`` sharded on its last dim (in one piece: the extent is what the rules check), all else replicated."""

    def __init__(self, x: fx.Node):
        self.x, self.sharded = x, Sharded(-1, (node_val(x).shape[-1],))  # type: ignore[union-attr]

    def layout(self, node: object) -> Layout:
        return self.sharded if node is self.x else REPLICATED

    def mark_tuple(self, node: fx.Node) -> None:
        refuse_tuple_read_whole(node)


def _refuse_spanning_operands(ctx: LayoutContext, node: fx.Node, ref: Sharded) -> None:
    """A batch rule takes a replicated operand for one without the batch dim (a parameter); along a
    feature dim it may well span the sharded extent (``prelu``'s weight, ``diff``'s ``prepend``),
    which each shard would read whole: refused, as the every-sample sweep found. A size known only
    at run time (the count of a ``nonzero``, as DeBERTa-v2's) may be the extent: refused too."""
    extent = sum(ref.sizes)
    for a in flat_nodes((node.args, node.kwargs)):
        value = node_val(a)
        if not isinstance(ctx.layout(a), Sharded) and isinstance(value, torch.Tensor) and _true_unless_known(value.numel() > 1):
            if any(_true_unless_known(d == extent) for d in value.shape):
                raise NeedsWhole("a replicated operand has a dim of the sharded extent")


def _as_splits(ctx: LayoutContext, node: fx.Node) -> tuple[dict[fx.Node, Placement], Sharded]:
    """Each input as the batch rules see it: a sharded one ``Split`` on its dim from the front, the others replicated."""
    placements: dict[fx.Node, Placement] = {}
    ref: Sharded | None = None
    for a in node.all_input_nodes:
        la = ctx.layout(a)
        if not isinstance(la, Sharded):
            placements[a] = REPLICATED
            continue
        nd = tensor_ndim(a)
        if nd is None or la.sections != 1:
            raise NeedsWhole("a sharded value of unknown rank, or a fused projection's sections")
        if ref is not None and la.sizes != ref.sizes:
            raise NeedsWhole("operands sharded differently")
        ref = ref or la
        placements[a] = Split(la.dim + nd)
    assert ref is not None  # the analysis asks only for ops with a sharded input
    return placements, ref


def _as_layout(node: fx.Node, out: Placement | None, ref: Sharded, rule: str) -> Sharded:
    """``Split(d)`` of a result of rank ``ndim`` (each part of a tuple alike): ``Sharded(d - ndim)``, the
    shards' sizes unchanged; anything else needs the whole tensor, with what the batch rule said."""
    if isinstance(out, Tuple):
        values = node_val(node)
        if not isinstance(values, (list, tuple)) or len(values) != len(out.items):
            raise NeedsWhole("a tuple of unknown values")
        parts = {_as_layout_of(v, p, ref, rule) for v, p in zip(values, out.items)}
        if len(parts) != 1:
            raise NeedsWhole("the parts of its result are sharded differently")
        return parts.pop()
    return _as_layout_of(node_val(node), out, ref, rule)


def _as_layout_of(value: object, out: Placement | None, ref: Sharded, rule: str) -> Sharded:
    if type(out) is Split and not isinstance(out, LocalOrder) and isinstance(value, torch.Tensor):
        if out.dim >= value.dim() or value.shape[out.dim] != sum(ref.sizes):
            raise NeedsWhole("its result's sharded dim has another extent than the input's")
        return Sharded(out.dim - value.dim(), ref.sizes, unit=ref.unit)
    if isinstance(out, Whole):
        raise NeedsWhole(out.reason or "its batch rule runs it whole")
    if isinstance(out, Partial):
        raise NeedsWhole(f"reduces over the sharded dim (a partial {out.kind} per shard)")
    if isinstance(out, BatchSize):
        raise NeedsWhole("reads the size of the sharded dim")
    raise NeedsWhole(f"its batch rule ({rule}) does not split it along the sharded dim")


__all__ = ["from_batch_rule", "keeps_last_dim_sharded"]


def _true_unless_known(condition: object) -> bool:
    """``condition`` where it is known (a bool), else true (``guard_or_true`` of a symbolic size's)."""
    if isinstance(condition, bool):
        return condition
    from torch.fx.experimental.symbolic_shapes import guard_or_true  # lazy: it imports sympy

    return guard_or_true(condition)
