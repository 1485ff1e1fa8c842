"""The examples as ``torch.export`` takes them: bound to forward's argument names, transformers'
cache left out, and the dims that vary between calls (the batch dim, and those ``dynamic_dims=``
names) marked dynamic.

    names = bind_names(model, (ids,), {"labels": labels})   # {"input_ids": ids, "labels": labels}
    spec = {n: dynamic_spec(v, 0, varying_dims({"input_ids": [1]}, n)) for n, v in names.items()}
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dpcompile.capture.errors import check_forward_names
from dpcompile.capture.fx import forward_parameters
from dpcompile.errors import ArgumentError, TraceError


def batch_dim_of(model: nn.Module) -> int:
    """1 where the model's sequence modules are all sequence-first (``batch_first=False``)."""
    firsts = [
        m.batch_first for m in model.modules() if isinstance(m, (nn.MultiheadAttention, nn.RNNBase)) and hasattr(m, "batch_first")
    ]
    return 1 if firsts and not any(firsts) else 0


def dynamic_spec(value: Any, batch_dim: int, varying: Sequence[int] = ()) -> Any:
    """The batch dim and the ``varying`` dims (those ``dynamic_dims=`` names) of ``value`` dynamic."""
    from torch.export import Dim

    if isinstance(value, torch.Tensor):
        dim = batch_dim if value.dim() > batch_dim else 0
        dims = {dim, *(d for d in varying if d < value.dim())}
        return {d: Dim.AUTO for d in sorted(dims)} if value.dim() > 0 else None
    if isinstance(value, (list, tuple)):
        return type(value)(dynamic_spec(v, batch_dim, varying) for v in value)
    if isinstance(value, dict):
        return {k: dynamic_spec(v, batch_dim, varying) for k, v in value.items()}
    return None


def varying_dims(dynamic_dims: Any, name: str) -> tuple[int, ...]:
    """The dims of argument ``name`` that ``dynamic_dims=`` says vary between calls: a mapping
    ``{argument: dims}``, or dims for every tensor argument that has them."""
    if dynamic_dims is None:
        return ()
    if isinstance(dynamic_dims, Mapping):
        dims = dynamic_dims.get(name, ())
    else:
        dims = dynamic_dims
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ArgumentError(f"dynamic_dims= takes non-negative dims (ints), got {dynamic_dims!r}")
    return dims


def check_dynamic_dims(model: nn.Module, dynamic_dims: Any, example_inputs: Sequence[Any] | None, example_kwargs: Mapping[str, Any] | None) -> None:
    """``ValueError`` where ``dynamic_dims={argument: dims}`` names an argument the examples do not
    give, or a dim that argument's example does not have (``[1]`` for every tensor applies where it
    can, and must apply somewhere); dims that are not non-negative ints are refused even without examples."""
    if not isinstance(dynamic_dims, Mapping):
        if isinstance(dynamic_dims, (str, bytes)) or not isinstance(dynamic_dims, (int, Sequence)):
            raise ArgumentError(
                f"dynamic_dims={dynamic_dims!r}: expected {{argument name: [dims]}} or [dims] for every tensor argument"
            )
        dims = varying_dims(dynamic_dims, "")
        if example_inputs is None and not example_kwargs:
            return
        names = bind_names(model, tuple(example_inputs or ()), dict(example_kwargs or {}))
        ranks = [v.dim() for v in names.values() if isinstance(v, torch.Tensor)]
        if unplaced := [d for d in dims if not any(d < r for r in ranks)]:
            raise ArgumentError(
                f"dynamic_dims={dynamic_dims!r} names dim(s) {unplaced}, which no tensor argument of the examples has "
                f"(their dims: {ranks}); name dims below {max(ranks, default=0)}"
            )
        return
    if example_inputs is None and not example_kwargs:
        for name in dynamic_dims:
            varying_dims(dynamic_dims, name)
        check_forward_names(model, dynamic_dims)
        return
    names = bind_names(model, tuple(example_inputs or ()), dict(example_kwargs or {}))
    if unknown := set(dynamic_dims) - set(names):
        raise ArgumentError(f"dynamic_dims= names {sorted(unknown)}, which the examples do not give (they give {list(names)})")
    for name in dynamic_dims:
        value = names[name]
        rank = value.dim() if isinstance(value, torch.Tensor) else None
        for dim in varying_dims(dynamic_dims, name):
            if rank is None or dim >= rank:
                has = f"{rank} dims (shape {tuple(value.shape)})" if rank is not None else f"no dims (a {type(value).__name__})"
                raise ArgumentError(
                    f"dynamic_dims= names dim {dim} of '{name}', but the example of '{name}' has {has}: name a "
                    f"dim below {rank or 0}, or drop '{name}' from dynamic_dims="
                )


def bind_names(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The examples by argument name, in forward's order (export then takes them as kwargs)."""
    params = [p for p in forward_parameters(model) if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(positional):
        var_positional = next((p.name for p in forward_parameters(model) if p.kind is p.VAR_POSITIONAL), None)
        if var_positional is not None:  # a decorator without functools.wraps hides forward's own names
            raise TraceError(
                f"{type(model).__name__}.forward takes {len(args) - len(positional)} of the example's arguments as "
                f"*{var_positional}, and the export frontend passes each argument by its name: name them in forward "
                "(where a decorator wraps forward, give its wrapper @functools.wraps(forward))"
            )
        raise TraceError(f"{type(model).__name__}.forward takes {len(positional)} positional arguments, the example gives {len(args)}")
    given = {p.name: a for p, a in zip(positional, args)}
    for key in kwargs:
        if key in given:
            raise TraceError(f"example argument '{key}' given both in example_inputs= and example_kwargs=")
    given.update(kwargs)
    var_keyword = next((p.name for p in forward_parameters(model) if p.kind is p.VAR_KEYWORD), None)
    collected = [k for k in kwargs if k not in {p.name for p in params}]
    python_values = [k for k in collected if not isinstance(kwargs[k], torch.Tensor)]
    if var_keyword is not None and python_values:  # transformers 5's return_dict=, output_hidden_states=
        raise TraceError(
            f"the export frontend cannot pass {python_values} through {type(model).__name__}.forward's "
            f"**{var_keyword} (torch.export refuses dynamic shapes for a **{var_keyword} dict): leave "
            f"{'it' if len(python_values) == 1 else 'them'} out of example_kwargs= and the calls, or set "
            f"{'it' if len(python_values) == 1 else 'them'} on the model before transform where forward reads a default "
            f"there (transformers: model.config.{python_values[0]} = {kwargs[python_values[0]]!r})"
        )
    if var_keyword is not None and collected:
        raise TraceError(
            f"the export frontend cannot pass {collected} through {type(model).__name__}.forward's **{var_keyword} "
            f"(torch.export takes no dynamic shapes there); name it in forward, e.g. "
            f"`def forward(self, ..., {collected[0]}=None, **{var_keyword})`"
        )
    order = [p.name for p in params if p.name in given] + [k for k in given if k not in {p.name for p in params}]
    return {name: given[name] for name in order}


def without_cache(model: nn.Module, names: dict[str, Any]) -> frozenset[str]:
    """transformers models return a key/value cache (not a tensor) unless ``use_cache=False``;
    a parallel program has no use for it: export with ``use_cache=False`` where the examples do
    not say (the program then has no ``use_cache`` argument)."""
    config = getattr(model, "config", None)
    params = {p.name for p in forward_parameters(model)}
    if "use_cache" in params and names.get("use_cache") is True:
        raise TraceError(
            f"use_cache=True makes {type(model).__name__}.forward return a key/value cache (a transformers Cache, "
            "not tensors), which a parallel program does not return: leave use_cache out of the examples (the "
            "program is exported with use_cache=False) or pass use_cache=False"
        )
    if "use_cache" in params and "use_cache" not in names and getattr(config, "use_cache", False):
        names["use_cache"] = False
        ordered = [p.name for p in forward_parameters(model) if p.name in names]
        items = {k: names[k] for k in ordered + [k for k in names if k not in ordered]}
        names.clear()
        names.update(items)
        return frozenset({"use_cache"})
    return frozenset()


__all__ = [
    "batch_dim_of", "bind_names", "check_dynamic_dims", "dynamic_spec", "root_pre_hooks_given_positions", "varying_dims", "without_cache",
]


@contextlib.contextmanager
def root_pre_hooks_given_positions(model: nn.Module, positional: Sequence[str]) -> Iterator[None]:
    """While exporting, hand the model's own forward pre-hooks the examples given positionally
    (``positional``, the names of ``example_inputs=``) as ``args``, as eager's call ``model(x)`` does:
    export passes every argument by name, so a hook that checks or casts ``args[0]`` saw ``()`` and
    failed (IndexError). What the hook returns is passed on by name again::

        hook(model, args)  # before: args == ()        after: args == (x,)"""
    hooks = dict(model._forward_pre_hooks)
    if not hooks:
        yield
        return
    with_kwargs = dict(model._forward_pre_hooks_with_kwargs)
    for key, hook in hooks.items():
        model._forward_pre_hooks[key] = _given_positions(model, hook, key in with_kwargs, positional)
        model._forward_pre_hooks_with_kwargs[key] = True
    try:
        yield
    finally:
        model._forward_pre_hooks.update(hooks)
        model._forward_pre_hooks_with_kwargs.clear()
        model._forward_pre_hooks_with_kwargs.update(with_kwargs)


def _given_positions(model: nn.Module, hook: Any, takes_kwargs: bool, positional: Sequence[str]) -> Any:
    signature = inspect.signature(model.forward)

    def called(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        args = (*args, *(kwargs[n] for n in positional if n in kwargs))
        kwargs = {k: v for k, v in kwargs.items() if k not in positional}
        if takes_kwargs:
            result = hook(module, args, kwargs)
            if result is None:
                return None
            args, kwargs = result
        else:
            result = hook(module, args)
            if result is None:
                return None
            args = result if isinstance(result, tuple) else (result,)
        by_name: dict[str, Any] = {}
        for name, value in signature.bind(*args, **kwargs).arguments.items():
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                by_name.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                if value:
                    raise TraceError(f"a forward pre-hook of {type(model).__name__} returns arguments for *{name}, which the export frontend cannot pass by name")
            else:
                by_name[name] = value
        return (), by_name

    return called
