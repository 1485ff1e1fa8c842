"""Attention over split queries: each device attends its own queries to every key.

``scaled_dot_product_attention(q, k, v, mask)`` is exact row by row of the queries: a device
holding some query rows, all the keys and values, and the mask's rows of its queries computes
its rows of the output (``runtime.causal_attention``: causal, at the queries' positions in the
whole sequence). Context parallelism makes the keys and values whole on every device
(``runtime.sequence_whole``, an all-gather) and the mask's rows split
(``runtime.sequence_split``), see ``passes/context_parallel.py``.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from dpcompile import runtime
from dpcompile.analysis.batch_rules.context import RuleContext, node_shape
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.placement import Placement, Replicated, Split

SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def sdpa_arguments(node: fx.Node) -> dict[str, Any]:
    """The arguments of an SDPA call by name (positional or keyword, both spellings)."""
    bound = dict(zip(SDPA_ARGUMENTS, node.args))
    bound.update(node.kwargs)
    return bound


def sdpa_query_rows(ctx: RuleContext) -> Placement | None:
    """``q`` split on its query dim (-2), ``k``/``v`` the same on every device, the mask split on
    its query rows or of one row (broadcast), not causal, no dropout: split like ``q``."""
    bound = sdpa_arguments(ctx.node)
    q, mask = bound.get("query"), bound.get("attn_mask")
    p, nd = ctx.p(q), ctx.ndim(q)
    if not isinstance(p, Split) or nd is None or p.dim != nd - 2:
        return None
    if not all(isinstance(ctx.p(bound.get(name)), Replicated) for name in ("key", "value")):
        return None
    if bound.get("is_causal") not in (None, False) or bound.get("dropout_p") not in (None, 0, 0.0):
        return None  # a causal flag is read against local rows; dropout draws per element
    if isinstance(mask, fx.Node):
        shape, pm = node_shape(mask), ctx.p(mask)
        if shape is None or len(shape) < 2:
            return None
        rows_split = isinstance(pm, Split) and pm.dim == len(shape) - 2
        if not rows_split and not (isinstance(pm, Replicated) and shape[-2] == 1):
            return None
    for name, value in ctx.node.kwargs.items():
        if name not in SDPA_ARGUMENTS and isinstance(value, fx.Node) and not isinstance(ctx.p(value), Replicated):
            return None
    return Split(p.dim)


def causal_query_rows(ctx: RuleContext) -> Placement | None:
    """``runtime.causal_attention(q, k, v, positions)``: ``q`` split on its query dim with its
    positions (dim 0), keys and values the same on every device, no dropout: split like ``q``."""
    q, k, v, positions = ctx.node.args[:4]
    p, nd, pp = ctx.p(q), ctx.ndim(q), ctx.p(positions)
    if not isinstance(p, Split) or nd is None or p.dim != nd - 2 or not (isinstance(pp, Split) and pp.dim == 0):
        return None
    if not all(isinstance(ctx.p(t), Replicated) for t in (k, v)) or ctx.node.kwargs.get("dropout_p") not in (None, 0, 0.0):
        return None
    if any(isinstance(value, fx.Node) and not isinstance(ctx.p(value), Replicated) for value in ctx.node.kwargs.values()):
        return None
    return Split(p.dim)


BATCH_RULES.register(runtime.causal_attention, causal_query_rows)

__all__ = ["SDPA_ARGUMENTS", "causal_query_rows", "sdpa_arguments", "sdpa_query_rows"]
