"""Reductions (``sum``/``mean`` become partial results over the batch), ops along one dim
(softmax, cumsum, normalize) and losses."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch.fx as fx
from torch import nn

from dpcompile.analysis import ops
from dpcompile.analysis.batch_rules.context import Rule, RuleContext, normalize_dim
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.placement import (
    Partial,
    Placement,
    Replicated,
    Split,
)


def softmax_like(ctx: RuleContext) -> Placement | None:
    """softmax / log_softmax / cumsum: fine unless the dim is the batch dim."""
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split):
        return None
    if ctx.module is not None:
        dim = getattr(ctx.module, "dim", None)
    else:
        dim = ctx.arg(1, "dim")
    dim = normalize_dim(dim, ctx.ndim(ctx.tensor_arg()), p.dim, ctx.min_ndim(ctx.tensor_arg()))
    if dim is None or dim == p.dim:
        return None
    return p


def _reduction_dims(ctx: RuleContext) -> tuple[Any, bool]:
    dim = ctx.arg(1, "dim")
    keepdim = ctx.arg(2, "keepdim", False)
    return dim, bool(keepdim)


def reduction(kind: str | None) -> Rule:
    """sum/mean (kind) become partial results over the batch; other reductions must avoid it."""

    def rule(ctx: RuleContext) -> Placement | None:
        p = ctx.p(ctx.tensor_arg())
        if not isinstance(p, Split) or any(
            not isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes[1:]
        ):
            return None
        dim, keepdim = _reduction_dims(ctx)
        if isinstance(dim, fx.Node):
            return None
        nd = ctx.ndim(ctx.tensor_arg())
        if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
            return Partial(kind) if kind else None
        dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
        if not all(isinstance(d, int) for d in dims):
            return None
        if any(d < 0 for d in dims):
            if nd is None:
                dims = [ctx.resolve(d, ctx.tensor_arg(), p.dim) for d in dims]
                if any(d is None for d in dims):
                    return None  # a negative dim that may name the batch dim of a tensor of unknown rank
            else:
                dims = [d % nd for d in dims]
        if p.dim in dims:
            if kind and not keepdim and len(dims) == 1:
                return Partial(kind)
            return None
        if keepdim:
            return p
        shift = sum(1 for d in dims if 0 <= d < p.dim)
        return Split(p.dim - shift)

    return rule


def loss_kwargs_of_module(module: nn.Module) -> dict[str, Any]:
    """The functional keyword arguments equivalent to a loss module's attributes."""
    out: dict[str, Any] = {"reduction": module.reduction}
    for name in ("ignore_index", "label_smoothing", "beta", "delta"):
        if hasattr(module, name):
            out[name] = getattr(module, name)
    return out


def bind_loss(fn: Callable, args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound


def loss(ctx: RuleContext) -> Placement | None:
    """Losses: ``reduction='none'`` stays split; ``'mean'``/``'sum'`` become partial sums."""
    if ctx.module is not None:
        fn = ops.LOSS_MODULES[type(ctx.module)]
        settings = loss_kwargs_of_module(ctx.module)
        has_weight = getattr(ctx.module, "weight", None) is not None or getattr(ctx.module, "pos_weight", None) is not None
        bound = bind_loss(fn, tuple(ctx.node.args), dict(ctx.node.kwargs))
        if bound is None:
            return None
        reduction_ = settings["reduction"]
        smoothing = settings.get("label_smoothing", 0.0)
    else:
        fn = ctx.node.target
        bound = bind_loss(fn, tuple(ctx.node.args), dict(ctx.node.kwargs))
        if bound is None:
            return None
        if bound.arguments.get("size_average") is not None or bound.arguments.get("reduce") is not None:
            return None
        reduction_ = bound.arguments.get("reduction", "mean")
        smoothing = bound.arguments.get("label_smoothing", 0.0)
        has_weight = bound.arguments.get("weight") is not None
    first, second = list(bound.arguments.values())[:2]
    p_in, p_target = ctx.p(first), ctx.p(second)
    extra = [
        ctx.p(v) for k, v in bound.arguments.items() if k not in list(bound.arguments)[:2] and isinstance(v, fx.Node)
    ]
    if not (isinstance(p_in, Split) and p_in.dim == 0 and isinstance(p_target, Split) and p_target.dim == 0):
        return None
    if ops.LOSS_FUNCTIONS[fn] == "elementwise" and any(not isinstance(e, Replicated) for e in extra):
        if not all(isinstance(e, (Replicated, Split)) and getattr(e, "dim", 0) == 0 for e in extra):
            return None
    elif any(not isinstance(e, Replicated) for e in extra):
        return None
    if not isinstance(reduction_, str):
        return None
    if reduction_ == "none":
        return Split(0)
    if reduction_ == "sum":
        return Partial("sum")
    if reduction_ == "mean":
        if ops.LOSS_FUNCTIONS[fn] == "class" and has_weight and smoothing:
            return None  # PyTorch's weighted, smoothed mean has no simple partial form
        return Partial("loss_mean")
    return None


BATCH_RULES.register_family(ops.ALONG_DIM, softmax_like)
for _target in ops.REDUCTIONS:
    _name = _target if isinstance(_target, str) else _target.__name__
    BATCH_RULES.register(_target, reduction(ops.PARTIAL_REDUCTIONS.get(_name)))
for _target in ops.LOSS_FUNCTIONS:
    BATCH_RULES.register(_target, loss)
for _target in ops.LOSS_MODULES:
    BATCH_RULES.register(_target, loss, subclasses=False)  # a subclass may compute another loss
