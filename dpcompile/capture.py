"""Capture a model as a ``torch.fx`` graph.

The :class:`DpTracer` differs from ``torch.fx.Tracer`` in three ways:

* RNN modules (``nn.RNNBase``) and the user's ``leaf_modules`` are never entered;
* ``rnn.flatten_parameters()`` called inside forward is *recorded* as a graph node
  (``dpcompile.runtime.flatten_parameters(self.rnn)``) instead of running at trace time
  and vanishing;
* any failure becomes a :class:`~dpcompile.TraceError` naming the user's file and line.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import os
import sys
import traceback
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx._symbolic_trace import _assert_is_none
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from dpcompile.errors import TraceError
from dpcompile.fx_utils import graph_module
from dpcompile.runtime import flatten_parameters as runtime_flatten_parameters

_TORCH_DIRS = (os.path.dirname(torch.__file__),)
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class DpTracer(fx.Tracer):
    """An fx tracer that keeps RNNs whole and records their ``flatten_parameters`` calls.

    Buffers are traced like parameters (``get_attr`` nodes), so what forward computes from
    them (``self.mask[:T, :T]``, ``self.log_scale.exp()``) runs each call on the buffer's
    current value instead of being frozen into a constant at trace time.
    """

    proxy_buffer_attributes = True

    def __init__(self, leaf_modules: Iterable[type[nn.Module]] = ()):
        super().__init__(
            autowrap_functions=(pack_padded_sequence, pad_packed_sequence),
            param_shapes_constant=False,
        )
        self.leaf_module_types = tuple(leaf_modules)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind not in ("placeholder", "output"):
            where = _user_source_line()
            if where:
                node.meta["stack_trace"] = where
        return node

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, nn.RNNBase) or (self.leaf_module_types and isinstance(m, self.leaf_module_types)):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def trace(self, root, concrete_args=None):
        tracer = self

        def recorded_flatten_parameters(rnn: nn.RNNBase) -> None:
            path = tracer.path_of_module(rnn)
            module_ref = tracer.create_proxy("get_attr", path, (), {})
            tracer.create_proxy("call_function", runtime_flatten_parameters, (module_ref,), {})

        original = nn.RNNBase.flatten_parameters
        nn.RNNBase.flatten_parameters = recorded_flatten_parameters
        unpatch_checkpoint = _record_checkpoints(tracer, root)
        factories = {name: getattr(torch, name) for name in _SIZE_FACTORIES}
        for name, factory in factories.items():
            setattr(torch, name, _sizes_as_tuple(factory))
        modules = list(root.named_modules()) if isinstance(root, nn.Module) else []
        before = [(dict(m._buffers), dict(m._parameters), dict(m.__dict__)) for _, m in modules]
        try:
            graph = super().trace(root, concrete_args)
        finally:
            nn.RNNBase.flatten_parameters = original
            unpatch_checkpoint()
            for name, factory in factories.items():
                setattr(torch, name, factory)
            rebound = _restore_state(modules, before)
        _write_back_buffers(graph, rebound)
        return graph


def _record_checkpoints(tracer: fx.Tracer, root: Any):
    """Keep activation checkpointing: ``checkpoint(self.block, x, ...)`` inside forward becomes a
    ``torch.utils.checkpoint.checkpoint`` node calling the submodule (run per device by data
    parallelism) instead of being traced through and lost. Other callables are traced through,
    as before. Returns the function that undoes the patch."""
    import torch.utils.checkpoint as checkpointing

    original = checkpointing.checkpoint

    def recorded_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
        module = function if isinstance(function, nn.Module) else None
        if module is None and getattr(function, "__name__", None) == "forward" and isinstance(getattr(function, "__self__", None), nn.Module):
            module = function.__self__
        if module is None or not any(isinstance(a, fx.Proxy) for a in args):
            return original(function, *args, **kwargs)
        try:
            path = tracer.path_of_module(module)
        except NameError:  # not a submodule of the traced model
            return original(function, *args, **kwargs)
        ref = tracer.create_proxy("get_attr", path, (), {})
        return tracer.create_proxy("call_function", original, (ref, *args), kwargs)

    patched: list[tuple[dict, str]] = []
    namespaces = [checkpointing.__dict__]
    if isinstance(root, nn.Module):
        for _, m in root.named_modules():
            namespace = getattr(sys.modules.get(type(m).__module__), "__dict__", None)
            if namespace is not None and namespace not in namespaces:
                namespaces.append(namespace)
    for namespace in namespaces:
        for name, value in list(namespace.items()):
            if value is original:
                namespace[name] = recorded_checkpoint
                patched.append((namespace, name))

    def undo() -> None:
        for namespace, name in patched:
            namespace[name] = original

    return undo


def _restore_state(
    modules: list[tuple[str, nn.Module]], before: list[tuple[dict, dict, dict]]
) -> list[tuple[str, fx.Node]]:
    """Give every module back the tensors and attributes it had before tracing (forward may
    have stored traced values in them); return the buffers forward rebound to traced values
    (``self.count += 1``), as ``(path, value)``."""
    rebound = []
    for (path, module), (buffers, parameters, attributes) in zip(modules, before):
        for name, value in list(module._buffers.items()):
            if isinstance(value, fx.Proxy) and name in buffers:
                rebound.append((f"{path}.{name}" if path else name, value.node))
        module._buffers.clear()
        module._buffers.update(buffers)
        module._parameters.clear()
        module._parameters.update(parameters)
        for name, value in list(module.__dict__.items()):
            if isinstance(value, fx.Proxy):
                if name in attributes:
                    module.__dict__[name] = attributes[name]
                else:
                    del module.__dict__[name]
    return rebound


def _write_back_buffers(graph: fx.Graph, rebound: list[tuple[str, fx.Node]]) -> None:
    """End forward by copying each rebound buffer's new value into it, as eager leaves it."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    with graph.inserting_before(output):
        for path, value in rebound:
            graph.call_method("copy_", (graph.get_attr(path), value))


# factories taking sizes as ``*size``: given a traced size first (``torch.zeros(x.size(0), 4)``)
# torch's argument parser reads it as the whole size and refuses the rest
_SIZE_FACTORIES = ("zeros", "ones", "empty", "rand", "randn")


def _sizes_as_tuple(factory):
    """``factory(*size)`` called as ``factory(size)`` when a traced value comes first."""

    @functools.wraps(factory)
    def call(*size, **kwargs):
        if len(size) > 1 and isinstance(size[0], fx.Proxy):
            return factory(tuple(size), **kwargs)
        return factory(*size, **kwargs)

    return call


def _is_library_file(filename: str) -> bool:
    if filename.startswith(_OWN_DIR) and filename.endswith(os.sep + "demo.py"):
        return False  # the built-in demo model is user code
    return filename.startswith(_TORCH_DIRS) or filename.startswith(_OWN_DIR) or filename.startswith("<")


def _user_source_line() -> str | None:
    """The innermost user frame, formatted as a one-frame traceback (cheaper than fx's
    ``record_stack_traces``, which formats the whole stack for every node)."""
    frame = sys._getframe(2)
    while frame is not None and _is_library_file(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    code = frame.f_code
    line = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}\n    {line}\n'


def _user_frame(tb: TracebackType | None) -> traceback.FrameSummary | None:
    """The innermost frame of the traceback that is the user's code, not torch's or ours."""
    frames = traceback.extract_tb(tb)
    for frame in reversed(frames):
        filename = frame.filename
        if _is_library_file(filename):
            continue
        if "/site-packages/" in filename and "/torch/" in filename:
            continue
        return frame
    return None


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "symbolically traced variables cannot be used as inputs to control flow" in text:
        return "branches on a tensor value (control flow that depends on data)"
    if "iterate" in text and "Proxy" in text:
        return "iterates over a traced value"
    return f"{type(exc).__name__}: {text}"


def _offending_module(tb: TracebackType | None, frame: traceback.FrameSummary | None) -> type | None:
    """The class of the module whose code ``frame`` is (its ``self``), if it is a module."""
    if frame is None:
        return None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename == frame.filename and tb.tb_lineno == frame.lineno and code.co_name == frame.name:
            owner = tb.tb_frame.f_locals.get("self")
            return type(owner) if isinstance(owner, nn.Module) else None
        tb = tb.tb_next
    return None


def trace_error(exc: BaseException, model: nn.Module) -> TraceError:
    """Build the :class:`TraceError` for an exception raised while tracing ``model``.

    ``model.py:42 in Encoder.forward: 'if y.sum() > 0' branches on a tensor value; ...``
    """
    frame = _user_frame(exc.__traceback__)
    owner = _offending_module(exc.__traceback__, frame)
    leaf = owner.__name__ if owner is not None else "..."
    way_out = (
        f"mark the module as a leaf (leaf_modules=[{leaf}]) so the tracer does not enter it (it then "
        "runs whole, after a gather), or make the code traceable: torch.where for a branch on data, "
        "a Python flag argument with its value in example_inputs="
    )
    if frame is None:
        return TraceError(f"cannot trace {type(model).__name__}: {_describe(exc)}; {way_out}")
    source = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
    short = frame.filename.rsplit("/", 1)[-1]
    where = f"{owner.__name__}.{frame.name}" if owner is not None else frame.name
    return TraceError(
        f"{short}:{frame.lineno} in {where}: {source!r} {_describe(exc)}; {way_out}\n"
        f"  file: {frame.filename}"
    )


def capture(
    model: nn.Module,
    *,
    leaf_modules: Iterable[type[nn.Module]] = (),
    none_args: Iterable[str] = (),
    flags: Mapping[str, Any] | None = None,
) -> fx.GraphModule:
    """Trace ``model`` into a fresh ``GraphModule`` that shares its submodules and tensors.

    An already traced ``GraphModule`` is copied (same submodules, fresh graph), so passes
    never touch the user's graph. ``none_args`` names optional arguments to trace as None,
    so that forward's ``if mask is not None:`` takes the branch a call without them takes;
    ``flags`` gives Python values (``return_hidden=False``) to trace arguments as.
    """
    if isinstance(model, fx.GraphModule):
        graph = fx.Graph()
        remap: dict[fx.Node, fx.Node] = {}
        for node in model.graph.nodes:
            remap[node] = graph.node_copy(node, lambda n: remap[n])
        return graph_module(model, graph, class_name=type(model).__name__)
    leaf_modules = tuple(leaf_modules)
    for leaf in leaf_modules:
        if not (isinstance(leaf, type) and issubclass(leaf, nn.Module)):
            raise ValueError(f"leaf_modules must hold nn.Module subclasses, got {leaf!r}")
    tracer = DpTracer(leaf_modules)
    if tracer.is_leaf_module(model, "") and not _traces_cleanly(model):
        return _call_leaf_root(model)
    concrete = {**dict.fromkeys(none_args), **(flags or {})}
    try:
        graph = tracer.trace(model, concrete_args=concrete or None)
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - every tracing failure becomes a TraceError
        raise trace_error(exc, model).with_traceback(None) from exc
    for node in graph.nodes:
        # fx would emit `wrap("torch.nn.utils.rnn.pack_padded_sequence")` into generated code,
        # which breaks every later trace in the process (a dotted name is not a global)
        node.meta.pop("is_wrapped", None)
    if concrete:
        _keep_argument_names(graph, frozenset(concrete))
    return graph_module(tracer.root, graph, class_name=type(model).__name__)


def _keep_argument_names(graph: fx.Graph, concrete: frozenset[str]) -> None:
    """fx names an argument traced as a given value ``mask_1`` and asserts that value; give it
    back its name (callers pass it by keyword) and drop the assert (the caller chose this
    program for that value)."""
    for node in reversed(list(graph.nodes)):
        asserting = node.target is _assert_is_none or (
            node.target is torch._assert and "has been specialized" in str(node.args[1:])
        )
        if node.op == "call_function" and asserting:
            checked = node.args[0]
            graph.erase_node(node)
            if isinstance(checked, fx.Node) and checked.op != "placeholder" and not checked.users:
                graph.erase_node(checked)  # the `arg == value` the assert checked
    for node in graph.nodes:
        if node.op == "placeholder" and isinstance(node.target, str) and node.target.endswith("_1"):
            name = node.target[: -len("_1")]
            if name in concrete:
                node.target = name
                node._rename(name)


FLAG_TYPES = (bool, int, str)


def flag_arguments(model: nn.Module, example_inputs: Sequence[Any] | None = None) -> dict[str, Any]:
    """Arguments of ``model.forward`` that hold a Python flag (``return_hidden: bool = False``,
    ``mode="sum"``), with the values to trace them as: the example's, else the default."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    flags: dict[str, Any] = {}
    for position, param in enumerate(parameters):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            break
        value = param.default
        if example_inputs is not None and position < len(example_inputs):
            value = example_inputs[position]
        if type(value) in FLAG_TYPES:
            flags[param.name] = value
    return flags


ROOT_LEAF = "root"


def _traces_cleanly(model: nn.Module) -> bool:
    """Leaf modules fx can still enter when they are the root (Linear, Conv, activations)."""
    return not isinstance(model, (nn.RNNBase, nn.modules.batchnorm._BatchNorm, nn.MultiheadAttention)) and type(
        model
    ).__module__.startswith("torch.nn")


def _call_leaf_root(model: nn.Module) -> fx.GraphModule:
    """A one-call graph for a root that is itself a leaf (``transform(nn.LSTM(...), ...)``).

    The module is held as ``root`` so the program can call it; ``ParallelModule`` keeps it
    out of ``state_dict`` (whose keys stay the model's own).
    """
    graph = fx.Graph()
    args = []
    for name, param in inspect.signature(model.forward).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TraceError(f"cannot capture {type(model).__name__}.forward(*{name}): name its arguments")
        default = param.default if param.default is not param.empty else inspect.Signature.empty
        args.append(graph.placeholder(name, default_value=default))
    graph.output(graph.call_module(ROOT_LEAF, tuple(args)))
    return fx.GraphModule({ROOT_LEAF: model}, graph, class_name=type(model).__name__)

