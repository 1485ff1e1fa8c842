"""Placements of context parallelism's markers (``runtime.sequence_whole`` / ``sequence_split``).

A marker is decided before the usual rules, since its input may run whole (a mask built on the
gathered sequence): ``sequence_whole`` of a value split along its dim is whole on every device
(an all-gather); ``sequence_split`` of any value is split along its dim (a scatter, or nothing
where it is split there already).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.fx as fx

from dpcompile import runtime
from dpcompile.analysis.placement import REPLICATED, Partial, Placement, Replicated, Split, Tuple, Whole

SEQUENCE_MARKERS = (runtime.sequence_whole, runtime.sequence_split)


def is_sequence_marker(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in SEQUENCE_MARKERS


def marker_placement(node: fx.Node, placements: Mapping[fx.Node, Placement]) -> Placement:
    """Where ``node`` (a marker) puts its input: see the module's docstring."""
    value, dim = node.args[0], node.args[1]
    p = placements[value] if isinstance(value, fx.Node) else REPLICATED
    if isinstance(p, (Partial, Tuple)) or (isinstance(p, Split) and type(p) is not Split):
        return Whole(batch=True, reason=f"'{value}' cannot be exchanged along the sequence ({type(p).__name__})")
    if node.target is runtime.sequence_split:
        return Split(dim)
    if isinstance(p, Replicated):
        return REPLICATED
    if isinstance(p, Split) and p.dim != dim:
        return Whole(batch=True, reason=f"'{value}' is split on dim {p.dim}, not on its sequence dim {dim}")
    if isinstance(p, (Split, Whole)):
        return Whole(batch=False, reason="all-gathered along the sequence, for attention")
    return Whole(batch=True, reason=f"'{value}' cannot be gathered along the sequence ({type(p).__name__})")


__all__ = ["SEQUENCE_MARKERS", "is_sequence_marker", "marker_placement"]
