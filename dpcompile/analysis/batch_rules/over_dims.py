"""Rule factories for ops that name the dims they work along: the op is per sample wherever the
batch dim is none of them. One factory per shape of op, each given the op's parameter names:

- :func:`along_dim`: the output has the input's shape (``cumprod(x, dim)``, ``masked.softmax``);
- :func:`reduce_dims`: the named dims are reduced, or kept as size 1 (``quantile(x, q, dim)``,
  ``masked.sum(x, dim, mask=m)``, ``var_mean``);
- :func:`leading_dims`: the op works on the last ``core`` dims and is batched over the ones
  before them (``linalg.det`` on a stack of matrices, ``linalg.vander``).

Other tensor arguments (a mask, the right-hand side of a solve) must be split on the same dim with
the same rank, or carry no batch and not reach the batch dim when broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from dpcompile.analysis.batch_rules.context import Rule, RuleContext, is_aten, node_shape, normalize_dim
from dpcompile.analysis.placement import Partial, Placement, Replicated, Split, Tuple

ALL = object()  # a default dim meaning "every dim" (the batch dim among them)


def split_on(p: Placement, dim: int) -> bool:
    """Whether ``p`` is a split on ``dim`` (whichever input it came from)."""
    return isinstance(p, Split) and p.dim == dim


def bind(ctx: RuleContext, params: Sequence[str]) -> dict[str, Any] | None:
    """The call's arguments by name: an ATen op's by its schema, others by ``params`` (the fx
    spelling's positional names, the tensor first); None where more are given than named."""
    node = ctx.node
    names = [a.name for a in node.target._schema.arguments] if is_aten(node) and hasattr(node.target, "_schema") else params
    if len(node.args) > len(names):
        return None
    bound = dict(zip(names, node.args))
    for key, value in node.kwargs.items():
        if key in bound:
            return None
        bound[key] = value
    return bound


def _others_fit(ctx: RuleContext, p: Split, nd: int | None) -> bool:
    """Every tensor input but the first is split like it (same dim, same rank) or carries no batch
    and, broadcast from the right, does not reach the batch dim (or has size 1 there)."""
    for node in ctx.node.all_input_nodes[1:]:
        q = ctx.p(node)
        shape = node_shape(node)
        if isinstance(q, Split):
            if q.dim != p.dim or nd is None or shape is None or len(shape) != nd:
                return False
        elif isinstance(q, Replicated):
            if shape is None:
                if isinstance(node.meta.get("val"), torch.Tensor) or "val" not in node.meta:
                    return False  # a tensor of unknown shape may broadcast along the batch dim
                continue  # a number (a size, a scalar)
            if nd is None:
                return False
            at = p.dim - (nd - len(shape))
            if at >= 0 and shape[at] != 1:
                return False
        else:
            return False
    return True


def _dims(value: Any, default: Any) -> list[Any] | None:
    if value is None:
        value = default
    if value is ALL or value is None:
        return None
    return list(value) if isinstance(value, (list, tuple)) else [value]


def along_dim(params: Sequence[str], *, dim: str = "dim", default: Any = ALL, outputs: int = 1) -> Rule:
    """An op along the dims named by argument ``dim`` (``default`` where it is not given) whose
    output(s) keep the input's shape: per sample unless a named dim is the batch dim."""

    def rule(ctx: RuleContext) -> Placement | None:
        p = ctx.p(ctx.tensor_arg())
        bound = bind(ctx, params)
        if not isinstance(p, Split) or bound is None:
            return None
        nd = ctx.ndim(ctx.tensor_arg())
        dims = _dims(bound.get(dim), default)
        if dims is None or not _others_fit(ctx, p, nd):
            return None
        normal = [normalize_dim(d, nd, p.dim, ctx.min_ndim(ctx.tensor_arg())) for d in dims]
        if any(d is None or d == p.dim for d in normal):
            return None
        return Tuple((p,) * outputs) if outputs > 1 else p

    rule.__name__ = rule.__qualname__ = "along_dim"
    return rule


def reduce_dims(
    params: Sequence[str],
    *,
    dim: str = "dim",
    default: Any = ALL,
    keepdim: str = "keepdim",
    outputs: int = 1,
    leading_from: str | None = None,
    partial: str | None = None,
) -> Rule:
    """A reduction over the dims named by argument ``dim`` (``default`` where not given; ``ALL``:
    every dim, which runs whole), ``keepdim`` keeping them as size 1. ``leading_from``: an argument
    that, given as a 1-D tensor, puts a new dim in front of the output (``quantile``'s ``q``).
    ``partial="sum"``: a reduction the batch dim among its dims makes a partial sum (``masked.sum``)."""

    def rule(ctx: RuleContext) -> Placement | None:
        p = ctx.p(ctx.tensor_arg())
        bound = bind(ctx, params)
        if not isinstance(p, Split) or bound is None:
            return None
        nd = ctx.ndim(ctx.tensor_arg())
        dims = _dims(bound.get(dim), default)
        keep = bound.get(keepdim, False)
        if not isinstance(keep, bool) or not _others_fit(ctx, p, nd):
            return None
        if not dims:
            return Partial(partial) if partial and outputs == 1 else None
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            return None
        normal = [normalize_dim(d, nd, p.dim, ctx.min_ndim(ctx.tensor_arg())) for d in dims]
        if partial and outputs == 1 and nd is not None and p.dim in normal:
            return Partial(partial)
        if any(d is None or d == p.dim for d in normal):
            return None
        out = p.dim if keep else p.dim - sum(1 for d in set(normal) if d < p.dim)
        extra = bound.get(leading_from) if leading_from else None
        if isinstance(extra, fx.Node):
            shape = node_shape(extra)
            if shape is None or len(shape) > 1:
                return None
            out += len(shape)
        split = Split(out)
        return Tuple((split,) * outputs) if outputs > 1 else split

    rule.__name__ = rule.__qualname__ = "reduce_dims"
    return rule


def leading_dims(core: int, *, fixed: Sequence[str] = (), params: Sequence[str] = ()) -> Rule:
    """An op on the last ``core`` dims of its tensors (a matrix: 2), batched over the dims before:
    per sample where the batch dim is one of those. Other tensors must be split alike. Each output is split on the same dim, where its example has
    that dim with the batch's size. ``fixed``: arguments (of ``params``) that must be left at
    their default (``dim1``/``dim2`` of ``linalg.diagonal``)."""

    def rule(ctx: RuleContext) -> Placement | None:
        x = ctx.tensor_arg()
        p = ctx.p(x)
        if not isinstance(p, Split):
            return None
        if fixed and (bound := bind(ctx, params)) is not None and any(bound.get(n) is not None for n in fixed):
            return None
        nd = ctx.ndim(x)
        if nd is None or p.dim >= nd - core:
            return None
        if any(not split_on(ctx.p(node), p.dim) for node in ctx.node.all_input_nodes[1:]):
            return None  # an unbatched B could be a batch of vectors, pivots a batch of rows: kernels do not check
        return _outputs_split(ctx.node, p, node_shape(x)[p.dim])

    rule.__name__ = rule.__qualname__ = f"leading_dims_{core}"
    return rule


def _outputs_split(node: fx.Node, p: Split, size: Any) -> Placement | None:
    """``p`` for the output, or a tuple of it for each output; None where an example output lacks
    the batch dim (an empty placeholder tensor, a count)."""
    value = node.meta.get("val")
    if value is None:
        return p
    if isinstance(value, torch.Tensor):
        return p if value.dim() > p.dim and _same(value.shape[p.dim], size) else None
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        if all(v.dim() > p.dim and _same(v.shape[p.dim], size) for v in value):
            return Tuple((p,) * len(value))
    return None


def register_unclaimed(rule: Rule, targets: Sequence[Any]) -> None:
    """Register ``rule`` for each target (a function, a method name, an ATen packet's name as
    ``"aten.<name>"``) that no family has a rule for; targets this PyTorch lacks are left out."""
    from dpcompile.analysis.batch_rules.registry import BATCH_RULES

    for target in targets:
        if isinstance(target, str) and target.startswith("aten."):
            target = getattr(torch.ops.aten, target[5:], None)
            if target is None:
                continue
        known = BATCH_RULES.methods.get(target) if isinstance(target, str) else BATCH_RULES.function_rule(target)
        if known is None:
            BATCH_RULES.register(target, rule)


def _same(a: Any, b: Any) -> bool:
    """Equal sizes, ints or symbols (comparing symbols by expression adds no guard)."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return str(a.node.expr if isinstance(a, torch.SymInt) else a) == str(b.node.expr if isinstance(b, torch.SymInt) else b)
    return a == b


__all__ = ["ALL", "along_dim", "bind", "leading_dims", "reduce_dims", "register_unclaimed", "split_on"]
