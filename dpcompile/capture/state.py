"""Tracing runs forward on stand-in values (fx proxies, export's fake tensors): what forward
stores in its modules' plain Python state while traced is no state of the model.

timm's attention-bias caches (LeViT, EfficientFormer: ``self.attention_bias_cache[device] =
...`` in eval) keep a traced value, which the next capture of the same model then reads as a
value of another graph (``Argument ... does not belong to this Graph``) and eager calls read as
a fake tensor. :func:`python_state_kept` gives every module back its attributes, the contents of
its dicts and lists, and its hooks (of every kind, and ``nn.Module``'s global ones) as they were
before tracing, and says what forward wrote:

    with python_state_kept(model) as effects:
        graph = tracer.trace(model)
    effects.attributes     # [(path, name, value)]: plain values forward set (``self.rescaled = True``)
    effects.hooks_added    # hooks forward registered (transformers 5 installs its output recorders
                           # on the first call): removed again, and known to the guards as forward's own

A hook forward installs itself is not a change of the model: the guards (``ModelGuard``) skip
hooks whose code forward installed (:func:`installed_by_forward`), and attributes forward writes
that change nothing it computes (:func:`mark_not_a_change`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.nn.modules import module as nn_module

# nn.Module's own dicts (parameters, buffers, submodules, hooks): restored apart, or by the tracers
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
_HOOK_DICTS = tuple(name for name, value in nn.Module().__dict__.items() if "hook" in name and isinstance(value, dict))
_GLOBAL_HOOK_DICTS = tuple(
    name for name in dir(nn_module) if name.startswith("_global_") and isinstance(getattr(nn_module, name), dict)
)
# torch.fx.Tracer.create_arg holds a constant met while tracing on the root (a tensor, a torch.Generator...)
_FX_CONSTANTS = ("_tensor_constant", "_opaque_obj", "_torchbind_obj", "_tree_spec_constant")
_PLAIN = (bool, int, float, str, type(None), enum.Enum, torch.dtype, torch.device)

# the code of hooks a model's forward registered on itself while captured (their closures differ
# at each call, their code does not), and {module: attribute names} forward writes that change
# nothing the program computes: what the guards do not count as a change of the model
_FORWARD_HOOK_CODES: set[types.CodeType] = set()
_NOT_A_CHANGE: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class SideEffects:
    """What forward wrote to the model's Python state while captured (all of it undone)."""

    attributes: list[tuple[str, str, Any]] = dataclasses.field(default_factory=list)
    before: dict[tuple[str, str], Any] = dataclasses.field(default_factory=dict)
    hooks_added: list[tuple[str, str, Any]] = dataclasses.field(default_factory=list)
    tensors: list[tuple[str, str, Any]] = dataclasses.field(default_factory=list)  # set to a tensor
    lists_changed: list[str] = dataclasses.field(default_factory=list)  # a list attribute forward appended to
    dicts_filled: list[str] = dataclasses.field(default_factory=list)  # a dict given values computed from inputs


_MISSING = object()


@contextlib.contextmanager
def python_state_kept(model: nn.Module) -> Iterator[SideEffects]:
    effects = SideEffects()
    saved = []
    modules = list(model.named_modules()) if isinstance(model, nn.Module) else []
    for path, module in modules:
        attributes = {k: v for k, v in module.__dict__.items() if k not in _MODULE_INTERNALS}
        contents = {k: (dict(v) if type(v) is dict else list(v)) for k, v in attributes.items() if type(v) in (dict, list)}
        hooks = {name: dict(module.__dict__[name]) for name in _HOOK_DICTS if name in module.__dict__}
        saved.append((path, module, attributes, contents, hooks, module.__dict__.get("_is_full_backward_hook")))
    global_hooks = {name: dict(getattr(nn_module, name)) for name in _GLOBAL_HOOK_DICTS}
    # writes as forward makes them (torch.export may undo a plain attribute's before it returns)
    paths = {id(m): p for p, m in modules}
    written: dict[tuple[str, str], Any] = {}
    setattr_ = nn.Module.__setattr__

    def recording(module: nn.Module, name: str, value: Any) -> None:
        setattr_(module, name, value)
        path = paths.get(id(module))
        if path is not None and name not in module._buffers and name not in module._parameters and name not in module._modules:
            written[(path, name)] = value

    nn.Module.__setattr__ = recording
    try:
        yield effects
    finally:
        nn.Module.__setattr__ = setattr_
        for path, module, attributes, contents, hooks, full_backward in saved:
            state = module.__dict__
            for name in [k for k in state if k not in _MODULE_INTERNALS and k not in attributes]:
                if not name.startswith(_FX_CONSTANTS):  # fx's own: the graph reads them
                    written.setdefault((path, name), state[name])
                    del state[name]  # set while traced
            for name, value in attributes.items():
                if state.get(name, _MISSING) is not value:
                    written.setdefault((path, name), state.get(name, _MISSING))
                    state[name] = value
                if name in contents and _changed(value, contents[name]):
                    if type(value) is list:
                        effects.lists_changed.append(f"{path}.{name}".lstrip("."))
                    if type(value) is dict and any(_reads_an_input(v) for v in _new_values(value, contents[name])):
                        effects.dicts_filled.append(f"{path}.{name}".lstrip("."))
                    if type(value) is dict:
                        value.clear()
                        value.update(contents[name])
                    else:
                        value[:] = contents[name]
            for name, before in hooks.items():
                _restore_hooks(state[name], before, effects, path, name)
            if "_is_full_backward_hook" in state:
                state["_is_full_backward_hook"] = full_backward
            for (where, name), value in written.items():
                if where == path and name not in _MODULE_INTERNALS and not name.startswith(_FX_CONSTANTS):
                    _record(effects, path, name, attributes.get(name, _MISSING), value)
        for name, before in global_hooks.items():
            _restore_hooks(getattr(nn_module, name), before, effects, "<global>", name)


def _record(effects: SideEffects, path: str, name: str, before: Any, after: Any) -> None:
    if after is _MISSING:
        return
    if isinstance(after, (torch.SymInt, torch.SymFloat, torch.SymBool)):  # export: the example's value
        after = after.node.hint
        if after is None:
            return
    if isinstance(after, (torch.Tensor, fx.Proxy)):
        effects.tensors.append((path, name, after))
    elif (type(after) in _PLAIN or isinstance(after, enum.Enum)) and (type(before) is not type(after) or before != after):
        effects.attributes.append((path, name, after))
        effects.before[(path, name)] = before


def _restore_hooks(hooks: dict, before: dict, effects: SideEffects, path: str, name: str) -> None:
    if list(hooks.items()) == list(before.items()):
        return
    for hook_id, hook in hooks.items():
        if hook_id not in before:
            effects.hooks_added.append((path, name, hook))
            code = getattr(getattr(hook, "__func__", hook), "__code__", None)
            if isinstance(code, types.CodeType):
                _FORWARD_HOOK_CODES.add(code)
    hooks.clear()
    hooks.update(before)


def installed_by_forward(hook: Any) -> bool:
    """Whether ``hook``'s code is that of a hook some model's forward registered while captured
    (it registers it again when missing, so its presence changes nothing the program computes)."""
    if not _FORWARD_HOOK_CODES:
        return False
    return getattr(getattr(hook, "__func__", hook), "__code__", None) in _FORWARD_HOOK_CODES


def mark_not_a_change(module: nn.Module, name: str) -> None:
    """``module.<name>`` is written by forward before it matters: the guards do not watch it."""
    _NOT_A_CHANGE.setdefault(module, set()).add(name)


def not_a_change(module: nn.Module) -> set[str] | None:
    return _NOT_A_CHANGE.get(module)


def _changed(value: dict | list, before: dict | list) -> bool:
    if len(value) != len(before):
        return True
    pairs = zip(value.values(), before.values()) if type(value) is dict else zip(value, before)
    return any(a is not b for a, b in pairs) or (type(value) is dict and list(value) != list(before))


def _new_values(value: dict, before: dict) -> list[Any]:
    return [v for k, v in value.items() if k not in before or before[k] is not v]


def _reads_an_input(value: Any) -> bool:
    """Whether a value forward stored was computed from its inputs: an fx proxy reached from a placeholder, or
    an exported tensor sized by the batch (a symbolic size). A value of the weights alone (timm's attention
    biases, kept per device) is a cache."""
    if isinstance(value, fx.Proxy):
        seen, todo = set(), [value.node]
        while todo:
            node = todo.pop()
            if node.op == "placeholder":
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(node.all_input_nodes)
        return False
    return isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in value.shape)


def warn_lists_changed(model: nn.Module, effects: SideEffects) -> None:
    """Forward appended to a list attribute (``self.features.append(h)``) or stored a value computed from its
    inputs in a dict (``self.cache[k] = h``): the program computes what forward returns and does not fill
    them at each call (a dict given values of the weights alone is taken for a cache, as timm's attention biases)."""
    import warnings

    for kind, names in (("list", effects.lists_changed), ("dict", effects.dicts_filled)):
        if names:
            warnings.warn(
                f"{type(model).__name__}.forward changes the {kind} {', '.join(repr(n) for n in names[:3])}: the "
                f"program does not repeat that at each call, so the {kind} stays as it was; return the values "
                "instead, or collect them with a forward hook (frontend='fx' calls it at each call)",
                stacklevel=4,
            )
