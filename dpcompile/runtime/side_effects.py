"""What forward writes besides its output, replayed by the program at each call as eager writes it.

Tracing runs forward once: a Python write (``self.rescaled = True``), a buffer rebound to a new
value of another shape (``self.cache = x.mean(0)``), ``torch.manual_seed(k)`` or an in-place
update inside ``torch.no_grad()`` would happen at capture only, or not as eager does it. The
captured program calls these instead, where forward made them::

    attributes_written({'block': {'rescaled': True}})   # set after the call; the guard follows
    assign_buffer(self, 'cache', mean)                    # copy_ where the shape allows, else rebind
    manual_seed(3)                                        # the global generator, as eager seeds it
    div_ = in_place_without_grad(weight, 'div_', 2)       # ``with torch.no_grad(): w.div_(2)``
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
import torch.fx as fx
from torch import nn


@fx.node.has_side_effect
def attributes_written(values: dict[str, dict[str, Any]]) -> None:
    """Where forward set plain attributes (``{module path: {name: value}}``, ``self.rescaled =
    True``): the program that runs this graph sets them on the model after the call
    (:func:`set_attributes`), since the graph has no name for the model itself."""


def attributes_written_by(graph: fx.Graph) -> dict[str, dict[str, Any]]:
    """The attributes a graph's :func:`attributes_written` nodes say forward sets."""
    writes: dict[str, dict[str, Any]] = {}
    for node in graph.find_nodes(op="call_function", target=attributes_written):
        for path, values in node.args[0].items():
            writes.setdefault(path, {}).update(values)
    return writes


def set_attributes(model: nn.Module, writes: dict[str, dict[str, Any]]) -> None:
    """Set the plain attributes forward set, by module path (``""``: the model itself)."""
    for path, values in writes.items():
        module = model.get_submodule(path)
        state = module.__dict__
        for name, value in values.items():
            if name not in state or type(state[name]) is not type(value) or state[name] != value:
                setattr(module, name, value)  # an equal value is left alone: the guard's dict version stands


_root_writes = threading.local()


@fx.node.has_side_effect
def assign_buffer(module: nn.Module | None, name: str, value: Any) -> None:
    """``module.<name> = value`` for a buffer (or a tensor attribute) forward rebinds: written in
    place where the shape, dtype and device allow (the buffer keeps its identity), else rebound.
    ``module`` None: the model itself, which the graph has no name for: the program running the
    graph writes it after the call (:func:`take_root_writes`)."""
    if module is None:
        _root_writes.__dict__.setdefault("pending", []).append((name, value))
        return
    old = module._buffers.get(name) if name in module._buffers else module.__dict__.get(name)
    if (
        isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) and old.shape == value.shape
        and old.dtype == value.dtype and old.device == value.device and name in module._buffers
    ):  # fmt: skip
        old.copy_(value)
    else:
        setattr(module, name, value)


def take_root_writes() -> list[tuple[str, Any]]:
    """The model's own buffers the last graph run rebound (``[(name, value)]``), now forgotten."""
    pending = _root_writes.__dict__.pop("pending", None)
    return pending or []


@fx.node.has_side_effect
def manual_seed(seed: int) -> None:
    """``torch.manual_seed(seed)`` where forward called it."""
    torch.manual_seed(seed)


@fx.node.has_side_effect
def in_place_without_grad(tensor: torch.Tensor, method: str, *args: Any, **kwargs: Any) -> Any:
    """``tensor.<method>(*args)``, an in-place update forward made inside ``torch.no_grad()``."""
    with torch.no_grad():
        return getattr(tensor, method)(*args, **kwargs)


_APPLIES: dict[type, Any] = {}


def _apply(function: type, *args: Any, **kwargs: Any) -> Any:
    return function.apply(*args, **kwargs)


class AppliedFunction(functools.partial):
    """``function.apply`` under a name of its own (``ReversibleFn_apply``); pickled as the Function it applies
    (by its importable name), where a function made here at trace time had no name pickle could find."""


def apply_function(function: type) -> Any:
    """``function.apply`` as a plain function named after it (``ReversibleFn_apply(x, w)``): a
    ``torch.autograd.Function`` forward calls is kept whole in the program, so its own backward (and
    any ``torch.no_grad()`` block in its forward, as reversible layers hold) stand as in eager."""
    if function not in _APPLIES:
        apply = AppliedFunction(_apply, function)
        apply.__name__ = apply.__qualname__ = f"{function.__name__}_apply"  # type: ignore[attr-defined]
        apply.__module__ = __name__
        _APPLIES[function] = apply
    return _APPLIES[function]
