"""What forward writes besides its output, recorded by the fx tracer so the program replays it.

Tracing runs forward once on proxies: Python writes and global calls happen then, and only then.
The tracer records them instead (the program calls :mod:`dpcompile.runtime.side_effects`)::

    torch.manual_seed(3)                     ->  manual_seed(3)
    Fn.apply(x, w)   (a torch.autograd.Function)  ->  Fn_apply(x, w)    (its own backward stands)
    with torch.no_grad(): w.div_(2)          ->  in_place_without_grad(w, 'div_', 2)
    self.cache = x.mean(0)   (any shape)     ->  assign_buffer(None, 'cache', mean)
    self.rescaled = True                     ->  attributes_written({'': {'rescaled': True}})
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.capture.state import SideEffects
from dpcompile.runtime.side_effects import (
    apply_function,
    assign_buffer,
    attributes_written,
    in_place_without_grad,
    manual_seed,
)


def record_calls(tracer: fx.Tracer) -> Callable[[], None]:
    """While tracing: ``torch.manual_seed`` and ``autograd.Function.apply`` on traced values become
    nodes. Returns the function that undoes it (and gives the global generator back its state)."""
    seed_original = torch.manual_seed
    apply_original = torch.autograd.Function.__dict__["apply"]  # a classmethod
    rng = torch.random.get_rng_state()

    def recorded_manual_seed(seed: int) -> Any:
        tracer.create_proxy("call_function", manual_seed, (int(seed),), {})
        return seed_original(seed)

    def recorded_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        traced = any(isinstance(a, fx.Proxy) for a in torch.utils._pytree.tree_leaves((args, kwargs)))
        if traced and not cls.__module__.startswith("torch."):  # torch's own (checkpointing): traced through
            return tracer.create_proxy("call_function", apply_function(cls), args, kwargs)
        return apply_original.__get__(None, cls)(*args, **kwargs)

    torch.manual_seed = recorded_manual_seed
    torch.autograd.Function.apply = classmethod(recorded_apply)

    def undo() -> None:
        torch.manual_seed = seed_original
        torch.autograd.Function.apply = apply_original
        torch.random.set_rng_state(rng)  # a seed forward set is the program's, not transform's

    return undo


def untracked_in_place(node: fx.Node) -> None:
    """An in-place method inside a ``torch.no_grad()`` block runs untracked, as in eager."""
    if node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_"):
        node.args = (node.args[0], node.target, *node.args[1:])
        node.op, node.target = "call_function", in_place_without_grad


def write_back(graph: fx.Graph, rebound: list[tuple[str, fx.Node]], effects: SideEffects, root: Any, tracer: fx.Tracer) -> None:
    """End forward by writing what it wrote, as eager leaves it: each buffer it rebound and each
    tensor it kept as an attribute (``rebound``, ``effects.tensors``), then the plain attributes."""
    seen = {path for path, _ in rebound}
    for path, name, value in effects.tensors:  # ``self.inner.last = y``: a tensor kept as an attribute
        full = f"{path}.{name}" if path else name
        if isinstance(value, fx.Proxy) and value.tracer is tracer and full not in seen:
            rebound.append((full, value.node))
    _write_back_buffers(graph, rebound)
    _write_back_attributes(graph, effects, root)


def _write_back_buffers(graph: fx.Graph, rebound: list[tuple[str, fx.Node]]) -> None:
    """Each buffer (or tensor attribute) forward rebound: in place where the new value has the
    buffer's shape (``self.count += 1``), else rebound (``self.cache = x.mean(0)``, another shape)."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    with graph.inserting_before(output):
        for path, value in rebound:
            owner, _, name = path.rpartition(".")
            graph.call_function(assign_buffer, (graph.get_attr(owner) if owner else None, name, value))


def _write_back_attributes(graph: fx.Graph, effects: SideEffects, root: Any) -> None:
    """The plain attributes forward set (``if not self.rescaled: ...; self.rescaled = True``): the
    guard then sees the new value and the next call runs the program traced for it. Attributes no
    code of the model reads (a marker transformers sets beside the hooks it installs, which capture
    removed) are left as found."""
    from dpcompile.program_cache import code_names  # it imports capture.state: not at import time

    if not effects.attributes or not isinstance(root, nn.Module):
        return
    modules = dict(root.named_modules())
    read = frozenset().union(*(code_names(type(m)) for m in modules.values()))
    writes: dict[str, dict[str, Any]] = {}
    for path, name, value in effects.attributes:
        before = effects.before[(path, name)]
        if name in read and path in modules and (type(before) is not type(value) or before != value):
            writes.setdefault(path, {})[name] = value
    if writes:
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        with graph.inserting_before(output):
            graph.call_function(attributes_written, (writes,))
