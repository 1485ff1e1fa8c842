"""Reductions (``sum``/``mean`` become partial results over the batch), ops along one dim
(softmax, cumsum, normalize) and losses."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.analysis import ops
from dpcompile.analysis.batch_rules.context import Rule, RuleContext, is_aten, normalize_dim, target_name
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.placement import (
    Partial,
    Placement,
    Replicated,
    Split,
    Tuple,
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


def cumsum(ctx: RuleContext) -> Placement | None:
    """``cumsum`` along another dim than the batch: as softmax. Along the split dim itself, of
    integers (a padding mask's positions, RoBERTa's): split, each device's running sum plus the
    totals of the devices before it, exact (``insert_scatter_gather`` emits ``runtime.running_sum``,
    see :func:`~dpcompile.analysis.batch_positions.running_sum_dim`); of floats it runs whole, where
    the sums keep eager's order."""
    p = ctx.p(ctx.tensor_arg())
    along_other = softmax_like(ctx)
    if along_other is not None or type(p) is not Split or not _holds_integers(ctx.tensor_arg()):
        return along_other
    dim = normalize_dim(ctx.arg(1, "dim"), ctx.ndim(ctx.tensor_arg()), p.dim, ctx.min_ndim(ctx.tensor_arg()))
    return Split(p.dim) if dim == p.dim else None


def _holds_integers(value: Any) -> bool:
    meta = value.meta.get("val", value.meta.get("tensor_meta")) if isinstance(value, fx.Node) else None
    dtype = getattr(meta, "dtype", None)
    return isinstance(dtype, torch.dtype) and not dtype.is_floating_point and not dtype.is_complex


def _reduction_dims(ctx: RuleContext) -> tuple[Any, bool]:
    """``(dim, keepdim)`` of a reduction in any spelling: ``x.sum(1, True)``, ``torch.var(x, 1,
    True, True)`` (``unbiased`` comes before ``keepdim``), ``aten.var.correction(x, [1], keepdim=True)``."""
    node = ctx.node
    if is_aten(node) and hasattr(node.target, "_schema"):
        names = [a.name for a in node.target._schema.arguments]
        bound = dict(zip(names, node.args))
        bound.update(node.kwargs)
        return bound.get("dim"), bool(bound.get("keepdim", False))
    keep_at = 3 if target_name(node) in ("var", "std") else 2
    dim = ctx.arg(1, "dim")
    keepdim = ctx.arg(keep_at, "keepdim", False)
    return dim, bool(keepdim) if isinstance(keepdim, bool) else keepdim


@functools.cache
def reduction(kind: str | None) -> Rule:
    """sum/mean (kind) become partial results over the batch; other reductions must avoid it.
    One rule per kind, whatever the spelling (``torch.sum``, ``x.sum()``, ``aten.sum.dim_IntList``)."""

    def rule(ctx: RuleContext) -> Placement | None:
        p = ctx.p(ctx.tensor_arg())
        if not isinstance(p, Split) or any(
            not isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes[1:]
        ):
            return None
        dim, keepdim = _reduction_dims(ctx)
        if isinstance(dim, fx.Node) or not isinstance(keepdim, bool):
            return None
        nd = ctx.ndim(ctx.tensor_arg())
        if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
            return Partial(kind) if kind else None
        dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            return None  # torch.var(x, True): the flag is unbiased, not a dim
        if any(d < 0 for d in dims):
            if nd is None:
                dims = [ctx.resolve(d, ctx.tensor_arg(), p.dim) for d in dims]
                if any(d is None for d in dims):
                    return None  # a negative dim that may name the batch dim of a tensor of unknown rank
            else:
                dims = [d % nd if nd else d for d in dims]
        if p.dim in dims:
            if kind:  # any dims with the batch dim among them, kept or not: each device sums (counts) its rows
                return Partial(kind)
            return None
        if keepdim:
            return p
        shift = sum(1 for d in set(dims) if 0 <= d < p.dim)
        return Split(p.dim - shift)

    rule.__name__ = f"reduction_{kind or 'along_other_dims'}"
    rule.__qualname__ = rule.__name__
    return rule


def values_and_indices(ctx: RuleContext) -> Placement | None:
    """``max(x, dim)`` / ``min(x, dim)`` (values and indices of a reduction), ``sort(x, dim)`` and
    ``topk(x, k, dim)`` along a non-batch dim: two tensors split alike. ``max(x, y)`` is element-wise;
    ``max(x)`` reduces the whole batch and runs whole."""
    from dpcompile.analysis.batch_rules.pointwise import pointwise

    name = target_name(ctx.node)
    second = ctx.arg(1, "dim" if name in ("max", "min") else "other")
    if name in ("max", "min"):
        if isinstance(second, fx.Node) or "other" in ctx.node.kwargs:
            return pointwise(ctx)
        if not isinstance(second, int):
            return None
        out = reduction(None)(ctx)
        return Tuple((out, out)) if isinstance(out, Split) else None
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split) or any(not isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes[1:]):
        return None
    dim = ctx.arg(2, "dim", -1) if name == "topk" else ctx.arg(1, "dim", -1)
    if name == "sort" and isinstance(ctx.arg(1, "dim", -1), bool):
        dim = -1  # sort(x, stable=...) spelled positionally
    dim = normalize_dim(dim, ctx.ndim(ctx.tensor_arg()), p.dim, ctx.min_ndim(ctx.tensor_arg()))
    if dim is None or dim == p.dim:
        return None
    return Tuple((p, p))


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
for _target in (torch.cumsum, "cumsum"):
    BATCH_RULES.register(_target, cumsum, replace=True)  # along the split dim too: a running sum over the devices
for _target in ops.REDUCTIONS:
    _name = _target if isinstance(_target, str) else _target.__name__
    BATCH_RULES.register(_target, reduction(ops.PARTIAL_REDUCTIONS.get(_name)))
for _target in ops.LOSS_FUNCTIONS:
    BATCH_RULES.register(_target, loss)
for _target in ops.LOSS_MODULES:
    BATCH_RULES.register(_target, loss, subclasses=False)  # a subclass may compute another loss
