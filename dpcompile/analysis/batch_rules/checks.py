"""Rules checked where examples exist: a placement the node's example value cannot have (a split
dim past its rank, a tuple for one tensor, a split for an ATen op's tuple of tensors) is a
:class:`BatchRuleError` naming the rule and the op when the program is built, not an
``IndexError`` inside ``gather`` at call time."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dpcompile.analysis.placement import Placement, Split, Tuple
from dpcompile.errors import DpCompileError


class BatchRuleError(DpCompileError):
    """A batch rule claimed a placement the op's example output cannot have."""


def _example(node: fx.Node) -> Any:
    val = node.meta.get("val")
    if val is not None:
        return val
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return torch.empty(0).new_empty(tuple(tm.shape), device="meta")
    return None


def check_placement(node: fx.Node, placement: Placement, rule: Any, what: str) -> None:
    """Raise :class:`BatchRuleError` where ``placement`` does not fit ``node``'s example value."""
    value = _example(node)
    if value is None or node.op == "call_function" and node.target in (getattr, __import__("operator").getitem):
        return
    name = getattr(rule, "__qualname__", None) or repr(rule)
    problem = None
    if isinstance(value, torch.Tensor):
        if isinstance(placement, Split) and placement.dim >= value.dim():
            problem = f"claims its output is split on dim {placement.dim}, but the output has {value.dim()} dims {list(value.shape)}"
        elif isinstance(placement, Tuple):
            problem = f"returns a tuple of {len(placement.items)} placements for one tensor {list(value.shape)}"
    elif isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        if isinstance(placement, Tuple) and len(placement.items) < len(value):
            problem = f"returns {len(placement.items)} placements for a tuple of {len(value)} tensors"
        elif isinstance(placement, Split) and isinstance(node.target, torch._ops.OpOverload):
            problem = f"returns one split for a tuple of {len(value)} tensors"
        elif isinstance(placement, Tuple):
            for i, (p, v) in enumerate(zip(placement.items, value)):
                if isinstance(p, Split) and p.dim >= v.dim():
                    problem = f"claims item {i} is split on dim {p.dim}, but it has {v.dim()} dims {list(v.shape)}"
                    break
    if problem is not None:
        raise BatchRuleError(
            f"the batch rule {name} for {what} (node '{node.name}') {problem}. Fix the rule (or register it "
            "again with replace=True: dpcompile.register_batch_rule(target, rule, replace=True)); "
            "'whole' runs the op once on the gathered batch."
        )


__all__ = ["BatchRuleError", "check_placement"]
