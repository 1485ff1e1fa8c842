"""What the ``torch.export`` frontend cannot replay of what forward writes, refused at transform by
name; and the attribute writes that are no change of the model.

Export runs forward once on fake tensors and keeps its tensor ops: a ``torch.manual_seed(k)`` in
forward, a buffer rebound to a value of another shape, a tensor stored as a plain attribute
(``self.cache = x.mean(0)``) or a Python flag forward flips (``if not self.rescaled: w.div_(2);
self.rescaled = True``) would be lost or frozen, so the program would drift from eager at the next
call. Each is a ``DpCompileError`` naming it; the fx frontend replays them all
(:mod:`dpcompile.runtime.side_effects`).

An attribute forward writes before it reads (``self.scale = 2.0`` then ``x * self.scale``) is no
change: exported again with the value forward leaves, the program is the same, so the guard does
not watch it (:func:`~dpcompile.capture.state.mark_not_a_change`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.capture.errors import is_library_file, trace_source, user_source_line
from dpcompile.capture.function_backward import ArgumentSpec, backward_departs
from dpcompile.capture.state import SideEffects, mark_not_a_change, python_state_kept
from dpcompile.errors import DpCompileError

_WAY_OUT = "frontend='fx' replays it at each call where the model traces"


class SideEffectRefused(DpCompileError):
    """Forward writes state the export frontend cannot replay at each call."""


@contextlib.contextmanager
def hooks_that_return_nothing(model: nn.Module) -> Iterator[list[str]]:
    """Within: every forward hook of a submodule of ``model`` noted (``"encoder.fc"``) when it returns
    None. torch.export traces a hook's tensor ops into the program, not what it does in Python (a
    feature dict it fills, a check it makes): such a hook is not called by the exported program."""
    noted: list[str] = []
    wrapped: list[tuple[dict, int, Callable]] = []

    def noting(path: str, hook: Callable) -> Callable:
        def call(*args: Any) -> Any:
            result = hook(*args)
            if result is None and path not in noted:
                noted.append(path)
            return result

        return call

    for path, module in model.named_modules():
        if not path:
            continue  # the model's own hooks run around the whole program (modules.hooks)
        for hook_id, hook in list(module._forward_hooks.items()):
            wrapped.append((module._forward_hooks, hook_id, hook))
            module._forward_hooks[hook_id] = noting(path, hook)
    try:
        yield noted
    finally:
        for hooks, hook_id, hook in wrapped:
            hooks[hook_id] = hook


@contextlib.contextmanager
def seeds_recorded() -> Iterator[list[str]]:
    """While export runs: each ``torch.manual_seed`` forward calls and each ``torch.autograd.Function``
    it applies (export traces through its forward and drops its backward), by where it is called."""
    calls: list[str] = []
    original = torch.manual_seed
    apply = torch.autograd.Function.__dict__["apply"]

    def recorded(seed: int) -> Any:
        calls.append(f"calls torch.manual_seed({seed})" + _where())
        return original(seed)

    applied: dict[type, tuple[list[ArgumentSpec | None], str]] = {}  # user Functions that keep the grad mode

    def recorded_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        # torch's own (checkpointing) export handles; a forward that keeps the grad mode differentiates as
        # its backward does where that is its derivative (BLOOM's GeLUFunction): checked after export
        if not cls.__module__.startswith("torch."):
            if _sets_grad_mode(cls):
                calls.append(f"applies the autograd.Function {cls.__qualname__}" + _where())
            elif cls not in applied and not kwargs:
                applied[cls] = ([ArgumentSpec.of(a) for a in args], _where())
        return apply.__get__(None, cls)(*args, **kwargs)

    register_hook = torch.Tensor.register_hook

    def recorded_register_hook(tensor: torch.Tensor, hook: Any) -> Any:
        if not is_library_file(sys._getframe(1).f_code.co_filename):  # the user's own, not a module hook's
            calls.append("registers a gradient hook on a tensor (Tensor.register_hook)" + _where())
        return register_hook(tensor, hook)

    torch.manual_seed = recorded
    torch.autograd.Function.apply = classmethod(recorded_apply)
    torch.Tensor.register_hook = recorded_register_hook  # type: ignore[method-assign]
    rng = torch.random.get_rng_state()
    try:
        with numpy_draws_recorded(calls):
            yield calls
    finally:
        torch.manual_seed = original
        torch.autograd.Function.apply = apply
        torch.Tensor.register_hook = register_hook  # type: ignore[method-assign]
        torch.random.set_rng_state(rng)  # the seed forward set is no effect of transform
    for cls, (specs, where) in applied.items():  # export done: no fake mode now
        if None not in specs and backward_departs(cls, specs):  # type: ignore[arg-type]
            calls.append(f"applies the autograd.Function {cls.__qualname__}, whose backward is not its forward's derivative "
                          f"(a straight-through estimator, a gradient reversal){where}")
        torch.random.set_rng_state(rng)


@contextlib.contextmanager
def numpy_draws_recorded(calls: list[str]) -> Iterator[None]:
    """While export runs: each draw from numpy's global generator (``np.random.rand``, ``choice``:
    wav2vec2's SpecAugment mask), which export runs once and keeps as a constant; numpy's state
    is left as found."""
    try:
        import numpy.random as npr
    except ImportError:  # no numpy: nothing draws from it
        yield
        return
    drawing = {
        name: fn for name in dir(npr) if not name.startswith("_") and name not in ("seed", "get_state", "set_state")
        and getattr(fn := getattr(npr, name), "__self__", None) is npr.mtrand._rand
    }  # fmt: skip

    def recorder(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            calls.append(f"draws numpy.random.{name}(...)" + _where())
            return fn(*args, **kwargs)

        return recorded

    state = npr.get_state()
    for name, fn in drawing.items():
        setattr(npr, name, recorder(name, fn))
    try:
        yield
    finally:
        for name, fn in drawing.items():
            setattr(npr, name, fn)
        npr.set_state(state)


_GRAD_MODE = ("no_grad", "enable_grad", "set_grad_enabled", "inference_mode", "detach")


def _sets_grad_mode(cls: type) -> bool:
    """Whether the Function's forward leaves autograd (a ``no_grad`` block, a ``detach``): then its
    values differentiate only through its own backward, which export drops."""
    import inspect

    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True  # unknown: refused, as before
    return any(word in source for word in _GRAD_MODE)


def _where() -> str:
    where = trace_source(user_source_line())
    return f" ({where})" if where else ""


def check_export_effects(
    model: nn.Module, effects: SideEffects, seeds: list[str], unlifted: fx.GraphModule, exported_code: str,
    export_again: Callable[[], Any], code_names: Callable[[type], frozenset[str]],
) -> None:
    """``exported_code``: the exported graph's code; ``export_again()``: export with the model as it is."""
    """Refuse what the exported program would not replay; mark attribute writes that are no change."""
    name = type(model).__name__
    for call in seeds:
        if call.startswith("draws numpy.random"):
            raise SideEffectRefused(
                f"{name}.forward {call}: torch.export runs numpy once, at capture, and keeps what it drew as a constant, "
                "so every call would reuse that draw instead of drawing anew; turn the draw off (wav2vec2, HuBERT: "
                "config.mask_time_prob = config.mask_feature_prob = 0, their SpecAugment mask), transform in eval mode, "
                f"or {_WAY_OUT}"
            )
        if "manual_seed" in call:
            raise SideEffectRefused(
                f"{name}.forward {call}: the program exported with torch.export keeps the draws but not the "
                f"seed, so it would draw other values than eager; seed before calling the program, or {_WAY_OUT}"
            )
        if "register_hook" in call:
            raise SideEffectRefused(
                f"{name}.forward {call}: torch.export drops the hook, so gradients would not be eager's; register "
                "it on the module instead (register_full_backward_hook), or apply it to the gradients after backward"
            )
        raise SideEffectRefused(
            f"{name}.forward {call}: torch.export traces through its forward and drops its backward (and the "
            f"grad mode its forward sets), so gradients would not be eager's; use frontend='fx', which calls it whole"
        )
    if effects.tensors:
        paths = [f"{p}.{n}".lstrip(".") for p, n, _ in effects.tensors]
        raise SideEffectRefused(
            f"{name}.forward stores a new tensor in {', '.join(repr(p) for p in paths[:3])} (a cache kept on the "
            f"module): the program exported with torch.export does not store it; return it instead, or {_WAY_OUT}"
        )
    for node in unlifted.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default):
        target, value = node.args[0], node.args[1]
        old, new = (getattr(a, "meta", {}).get("val") for a in (target, value))
        if target.op == "get_attr" and isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.shape != new.shape:
            raise SideEffectRefused(
                f"{name}.forward rebinds the buffer '{target.target}' of shape {tuple(old.shape)} to a value of shape "
                f"{tuple(new.shape)}: torch.export writes it in place, which fails at every call; keep its shape, "
                f"or {_WAY_OUT}"
            )
    modules = dict(model.named_modules())
    read = frozenset().union(*(code_names(type(m)) for m in modules.values()))
    writes = [(p, n, v) for p, n, v in effects.attributes if n in read and p in modules]
    if not writes:
        return
    with python_state_kept(model):
        for path, attr, value in writes:
            setattr(modules[path], attr, value)
        again = export_again()
    if again.graph_module.code != exported_code:
        path, attr, value = writes[0]
        full = f"{path}.{attr}".lstrip(".")
        raise SideEffectRefused(
            f"{name}.forward sets {full!r} to {value!r} and what it computes depends on it (a flag read before it is "
            f"written, e.g. a one-time rescale): the program exported with torch.export would repeat the first call's "
            f"path at every call; do the one-time work before transform, or {_WAY_OUT}"
        )
    for path, attr, _ in writes:
        mark_not_a_change(modules[path], attr)


def check_writes_without_grad(model: nn.Module, unlifted: fx.GraphModule) -> None:
    """Refuse a ``torch.no_grad()`` block that writes a buffer or parameter in place (after
    :func:`check_export_effects`, whose refusals say more about a model that also sets a flag)."""
    if (written := _written_without_grad(unlifted)) is not None:
        raise SideEffectRefused(
            f"{type(model).__name__}.forward writes {written!r} in place inside torch.no_grad() (an EMA, a counter): "
            f"the program exported with torch.export would drop the write; make it outside the no_grad block (on a "
            f"detached value), or {_WAY_OUT}"
        )

def _written_without_grad(unlifted: fx.GraphModule) -> str | None:
    """The model tensor (a buffer, a parameter) a ``torch.no_grad()`` block writes in place, if any:
    export keeps the block as ``wrap_with_set_grad_enabled(False, submod, ema, h)``, whose unused
    output the program would drop, and the write with it."""
    from dpcompile.fx_utils import writes

    hop = torch.ops.higher_order.wrap_with_set_grad_enabled
    for node in unlifted.graph.find_nodes(op="call_function", target=hop):
        body = unlifted.get_submodule(str(node.args[1].target))
        outer = dict(zip(body.graph.find_nodes(op="placeholder"), node.args[2:]))
        for inner in body.graph.nodes:
            written = outer.get(inner.args[0]) if writes(inner) and inner.args else None
            if isinstance(written, fx.Node) and written.op == "get_attr":
                return str(written.target)
    return None
