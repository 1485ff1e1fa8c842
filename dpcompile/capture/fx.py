"""Capture a model as a ``torch.fx`` graph.

The :class:`DpTracer` differs from ``torch.fx.Tracer`` in three ways:

* RNN modules (``nn.RNNBase``) and the user's ``leaf_modules`` are never entered;
* ``rnn.flatten_parameters()`` called inside forward is *recorded* as a graph node
  (``dpcompile.runtime.flatten_parameters(self.rnn)``) instead of running at trace time
  and vanishing;
* any failure becomes a :class:`~dpcompile.TraceError` naming the user's file and line.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx._symbolic_trace import _assert_is_none
from torch.nn.utils import parametrize
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from dpcompile.capture.errors import ShapeBranch, trace_error, user_source_line
from dpcompile.capture.fx_checkpoint import record_checkpoints
from dpcompile.capture.fx_effects import record_calls, untracked_in_place, write_back
from dpcompile.capture.fx_signature import VARARGS_COUNT, keyword_only_last, remember_varargs_count
from dpcompile.capture.grad_blocks import (
    check_grad_mode,
    check_gradients_taken_with_grad_on,
    grad_mode_reads,
    inference_mode_as_no_grad,
    stowed_attributes_undone,
    traced_alike,
)
from dpcompile.capture.leaf_modes import called_mode_reads, remember_called_modes
from dpcompile.capture.norms import parametrize_cache_off, refuse_spectral_norm_hooks, writes_parametrization_state
from dpcompile.capture.state import python_state_kept, warn_lists_changed
from dpcompile.errors import ArgumentError, TraceError
from dpcompile.fx_utils import graph_module
from dpcompile.progress import step_bar
from dpcompile.runtime import flatten_parameters as runtime_flatten_parameters
from dpcompile.runtime import run_forward_hook as runtime_run_forward_hook
from dpcompile.runtime import without_grad as runtime_without_grad


def _reads_as_parameter(plist: nn.Module) -> bool:
    """A parametrization list whose every parametrization is read as the parameter it makes (data_parallel="fsdp"
    in one process: the gather of its pieces, ``GatherShards.reads_as_the_parameter``)."""
    return len(plist) > 0 and all(getattr(p, "reads_as_the_parameter", False) for p in plist)


class WritableProxy(fx.Proxy):
    """A traced tensor that records ``x[i] = v`` as an ``operator.setitem`` node (fx's own
    proxies refuse it); :mod:`passes.functionalize` later makes the write functional."""

    def __setitem__(self, key: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


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
        self.pretend_grad: bool | None = None  # what the user's torch.is_grad_enabled() reads return, where set
        # fx wraps them where forward names them as globals; spelled nn.utils.rnn.pack_padded_sequence,
        # the lookup goes through these modules (traced into, it failed on a proxy's __cuda_array_interface__)
        self._autowrap_search.extend((torch.nn.utils.rnn, torch.nn.utils))

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind not in ("placeholder", "output"):
            where = user_source_line()
            if where:
                node.meta["stack_trace"] = where
        return node

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return WritableProxy(node, self)

    def to_bool(self, obj: fx.Proxy) -> bool:
        kind = branch_kind(obj.node)
        if kind is not None:
            raise ShapeBranch(kind)
        return super().to_bool(obj)

    def create_arg(self, a: Any) -> Any:
        """An ``OrderedDict`` (torchvision's segmentation outputs) stays one: fx would write a dict literal."""
        if type(a) is collections.OrderedDict:
            return self.create_node("call_function", collections.OrderedDict, (super().create_arg(dict(a)),), {})
        return super().create_arg(a)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        """``forward(self, *inputs)`` traced as the examples call it: one placeholder per value
        (``inputs_0``, ``inputs_1``), each split like any argument, and ``inputs`` a tuple
        forward can iterate; a call with another count is refused by Python's own binding."""
        root_fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)
        count = getattr(self, "varargs_count", None)
        for i, arg in enumerate(args):
            target = str(arg.node.target) if isinstance(arg, fx.Proxy) and arg.node.op == "placeholder" else ""
            if count is not None and target.startswith("*") and not target.startswith("**"):
                with self.graph.inserting_before(arg.node):
                    values = tuple(self.create_proxy("placeholder", f"{target[1:]}_{j}", (), {}) for j in range(count))
                self.graph.erase_node(arg.node)
                args[i] = values
        return root_fn, args

    def call_module(self, m, forward, args, kwargs):
        """A module forward is traced through, with its forward hooks: one that computes the output
        is traced in; one that only records (returns None, computes nothing) runs at call time."""
        if isinstance(m, parametrize.ParametrizationList) and not args and not kwargs and _reads_as_parameter(m):
            owner, _, leaf = self.path_of_module(m).rpartition("parametrizations.")
            return self.create_proxy("get_attr", f"{owner}{leaf}", (), {})  # ``emb.weight``, not its gather's call
        hooks = m._forward_hooks
        if not hooks or self.is_leaf_module(m, self.path_of_module(m)):
            return super().call_module(m, forward, args, kwargs)
        saved = dict(hooks)
        hooks.clear()
        try:
            output = super().call_module(m, forward, args, kwargs)
        finally:
            hooks.clear()
            hooks.update(saved)
        for hook_id, hook in saved.items():
            with_kwargs = hook_id in m._forward_hooks_with_kwargs
            last = next(iter(reversed(self.graph.nodes)))
            result = hook(m, args, kwargs, output) if with_kwargs else hook(m, args, output)
            if result is not None:
                output = result
            elif next(iter(reversed(self.graph.nodes))) is last:  # it recorded: run it at each call
                module = self.create_proxy("get_attr", self.path_of_module(m), (), {})
                call_kwargs = kwargs if with_kwargs else None
                self.create_proxy("call_function", runtime_run_forward_hook, (module, hook_id, args, call_kwargs, output), {})
        return output

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, nn.RNNBase) or (self.leaf_module_types and isinstance(m, self.leaf_module_types)):
            return True
        if writes_parametrization_state(m):
            return False  # entered: its weight is one ``parametrizations.weight()`` call, run once per call as in eager
        if parametrize.is_parametrized(m):  # as its own class is (a ``Parametrized*`` class lives in torch.nn)
            original = type(m).__bases__[0]
            return original.__module__.startswith(("torch.nn", "torch.ao.nn")) and not isinstance(m, nn.Sequential)
        return super().is_leaf_module(m, module_qualified_name)

    def trace(self, root, concrete_args=None):
        if isinstance(root, nn.Module):
            refuse_spectral_norm_hooks(root)
        tracer = self

        def recorded_flatten_parameters(rnn: nn.RNNBase) -> None:
            path = tracer.path_of_module(rnn)
            module_ref = tracer.create_proxy("get_attr", path, (), {})
            tracer.create_proxy("call_function", runtime_flatten_parameters, (module_ref,), {})

        original = nn.RNNBase.flatten_parameters
        nn.RNNBase.flatten_parameters = recorded_flatten_parameters
        unpatch_calls = record_calls(tracer)
        unpatch_checkpoint = record_checkpoints(tracer, root)
        grad_switches, unpatch_grad_mode = _record_grad_mode(tracer)
        factories = {name: getattr(torch, name) for name in _SIZE_FACTORIES}
        for name, factory in factories.items():
            setattr(torch, name, _sizes_as_tuple(factory))
        modules = list(root.named_modules()) if isinstance(root, nn.Module) else []
        before = [(dict(m._buffers), dict(m._parameters), dict(m.__dict__)) for _, m in modules]
        try:  # switches relative to a call with gradients; no parametrization caches a proxy
            with torch.enable_grad(), python_state_kept(root) as effects, parametrize_cache_off(), inference_mode_as_no_grad(), \
                    grad_mode_reads(self.pretend_grad) as grad_reads, called_mode_reads(root, self) as called_modes:  # fmt: skip
                graph = super().trace(root, concrete_args)
        finally:
            nn.RNNBase.flatten_parameters = original
            unpatch_calls()
            unpatch_checkpoint()
            unpatch_grad_mode()
            for name, factory in factories.items():
                setattr(torch, name, factory)
            rebound = _restore_state(modules, before)
        write_back(graph, rebound, effects, root, self)
        if self.pretend_grad is None:
            warn_lists_changed(root, effects)
        _keep_no_grad_blocks(graph, grad_switches)
        check_gradients_taken_with_grad_on(graph)
        remember_called_modes(root, called_modes)
        if grad_reads and self.pretend_grad is None and self._decides_on_grad_mode(graph, root, concrete_args):
            check_grad_mode(graph, grad_reads[0])
        _read_opaque_attributes_by_name(graph, root)
        return graph

    def _decides_on_grad_mode(self, graph: fx.Graph, root: Any, concrete_args: Any) -> bool:
        """Whether forward's reads of ``torch.is_grad_enabled()`` change the program: traced again with
        them returning False, a read that is only logged or stored traces the same code."""
        again = DpTracer(self.leaf_module_types)
        again.pretend_grad, again.varargs_count = False, getattr(self, "varargs_count", None)
        with stowed_attributes_undone(root):  # its tensor constants: compared, then taken off the model
            try:
                other = again.trace(root, concrete_args)
            except Exception:  # noqa: BLE001 - it takes another path that does not trace: it decides something
                return True
            return not traced_alike(graph, other, root)


def _read_opaque_attributes_by_name(graph: fx.Graph, root: Any) -> None:
    """Read an object fx stowed on the root (``self._opaque_obj0``: a ``torch.Generator``) from
    the module attribute that holds it, so the program shares it with the model by its name::

        _opaque_obj0 = self._opaque_obj0  ->  sampler_g = self.sampler.g
    """
    stowed = [n for n in graph.nodes if n.op == "get_attr" and n.target.startswith("_opaque_obj")]
    if not stowed or not isinstance(root, nn.Module):
        return
    owners = {id(v): f"{path}.{name}" if path else name
              for path, m in root.named_modules() for name, v in vars(m).items() if not name.startswith("_")}
    for node in stowed:
        owner = owners.get(id(getattr(root, node.target, None)))
        if owner is not None:
            delattr(root, node.target)
            node.target = owner
            node._rename(owner.replace(".", "_"))


def _record_grad_mode(tracer: fx.Tracer) -> tuple[list[tuple[fx.Node | None, bool]], Any]:
    """Record where forward switches grad mode (``with torch.no_grad():``, ``set_grad_enabled``):
    the last node traced before each switch, and the mode. Tracing runs the switch itself and
    records no node, so without this a no_grad block's values would carry gradients in the
    program (its parameters trained, where eager leaves them alone). Entering ``torch.autocast``
    is refused the same way (a TraceError with the way out), not silently run in float32."""
    switches: list[tuple[fx.Node | None, bool]] = []
    original = torch._C._set_grad_enabled
    autocast_enter = torch.amp.autocast_mode.autocast.__enter__

    def recorded(mode: bool) -> None:
        graph = getattr(tracer, "graph", None)
        if graph is not None:
            switches.append((next(iter(reversed(graph.nodes)), None), bool(mode)))
        original(mode)

    def refused_autocast(context: torch.amp.autocast_mode.autocast) -> Any:
        if context._enabled:  # autocast(enabled=False) in forward changes nothing for a call without autocast
            raise ShapeBranch(
                "enters torch.autocast, which tracing does not record (the program would run in full "
                "precision); call the program under autocast instead (`with torch.autocast(...): pm(x)`)"
            )
        return autocast_enter(context)

    torch._C._set_grad_enabled = recorded
    torch.amp.autocast_mode.autocast.__enter__ = refused_autocast

    def undo() -> None:
        torch._C._set_grad_enabled = original
        torch.amp.autocast_mode.autocast.__enter__ = autocast_enter

    return switches, undo


def _keep_no_grad_blocks(graph: fx.Graph, switches: list[tuple[fx.Node | None, bool]]) -> None:
    """Where a value computed inside a ``torch.no_grad()`` block is used after it, use it
    through :func:`~dpcompile.runtime.without_grad` (detached), so gradients stop there as in eager.

    Before (eager)::                          After (the captured program)::

        with torch.no_grad():                     teacher = self.teacher(x)
            t = self.teacher(x)                   teacher_no_grad = without_grad(teacher)
        return self.student(x) * t                return student * teacher_no_grad
    """
    if all(enabled for _, enabled in switches):
        return
    after: dict[fx.Node | None, list[bool]] = {}
    for last, enabled in switches:
        after.setdefault(last, []).append(enabled)
    enabled = after[None][-1] if None in after else True  # relative to the call's own grad mode
    in_block: set[fx.Node] = set()
    for node in graph.nodes:
        if not enabled and node.op in ("call_function", "call_method", "call_module"):
            in_block.add(node)
        if node in after:
            enabled = after[node][-1]
    for node in [n for n in graph.nodes if n in in_block]:
        untracked_in_place(node)  # ``w.div_(2)`` on a parameter: as eager, untracked
        outside = [user for user in node.users if user not in in_block]
        if not outside:
            continue
        with graph.inserting_after(node):
            detached = graph.call_function(runtime_without_grad, (node,))
        detached.name = graph._graph_namespace.create_name(f"{node.name}_no_grad", None)
        detached.meta["stack_trace"] = node.meta.get("stack_trace", "")
        for user in outside:
            user.replace_input_with(node, detached)


_SHAPE_METHODS = ("size", "dim", "numel", "nelement")
_SHAPE_ATTRIBUTES = ("shape", "ndim")
_DTYPE_ATTRIBUTES = ("dtype", "device", "is_cuda", "is_floating_point", "layout")
_PYTHON_OPERATORS = {getattr(operator, name) for name in dir(operator) if not name.startswith("_")} | {len, getattr}


def branch_kind(node: fx.Node) -> str | None:
    """What a Python ``if`` on ``node`` branches on, where fx could have been given it or
    export can capture it: a shape, a dtype, or an argument's value. None for tensor data.

    Walks back through Python operators only (``x.size(0) != y.shape[0]``); a tensor op on the
    way (``x.sum() > 0``) makes it a branch on data.
    """
    seen: set[fx.Node] = set()
    todo = [node]
    argument = None
    while todo:
        current = todo.pop()
        if current in seen or len(seen) > 64:
            continue
        seen.add(current)
        if current.op == "call_method" and current.target in _SHAPE_METHODS:
            return "branches on a shape (Python control flow on tensor sizes, which torch.fx cannot trace)"
        if current.op == "call_function" and current.target is getattr and len(current.args) > 1:
            if current.args[1] in _SHAPE_ATTRIBUTES:
                return "branches on a shape (Python control flow on tensor sizes, which torch.fx cannot trace)"
            if current.args[1] in _DTYPE_ATTRIBUTES:
                return "branches on a dtype (Python control flow on a tensor's dtype or device, which torch.fx cannot trace)"
        if current.op == "placeholder":
            argument = argument or str(current.target)
            continue
        if current.op == "call_function" and current.target in _PYTHON_OPERATORS:
            todo.extend(current.all_input_nodes)
    if argument is not None and (node.op == "placeholder" or node.target in _PYTHON_OPERATORS):
        return (
            f"branches on the argument '{argument}' (a Python flag or optional argument: give its value "
            "in example_inputs= / example_kwargs=, or leave it to its default)"
        )
    return None


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


def capture(
    model: nn.Module,
    *,
    leaf_modules: Iterable[type[nn.Module]] = (),
    none_args: Iterable[str] = (),
    flags: Mapping[str, Any] | None = None,
    check_nones: bool = False,
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
            raise ArgumentError(f"leaf_modules must hold nn.Module subclasses, got {leaf!r}")
    tracer = DpTracer(leaf_modules)
    tracer.varargs_count = model.__dict__.get(VARARGS_COUNT)
    if tracer.is_leaf_module(model, "") and not _traces_cleanly(model):
        return _call_leaf_root(model)
    concrete = {**dict.fromkeys(none_args), **(flags or {})}
    bar = step_bar("Capturing the model", 1)  # transform(progress=): one step a trace
    try:
        graph = tracer.trace(model, concrete_args=concrete or None)
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - every tracing failure becomes a TraceError
        raise trace_error(exc, model).with_traceback(None) from exc
    bar.update()
    for node in graph.nodes:
        # fx would emit `wrap("torch.nn.utils.rnn.pack_padded_sequence")` into generated code,
        # which breaks every later trace in the process (a dotted name is not a global)
        node.meta.pop("is_wrapped", None)
    if concrete:
        _keep_argument_names(graph, frozenset(concrete), check_nones)
    keyword_only_last(graph, {p.name for p in forward_parameters(model) if p.kind is p.KEYWORD_ONLY})
    return graph_module(tracer.root, graph, class_name=type(model).__name__)


def _keep_argument_names(graph: fx.Graph, concrete: frozenset[str], check_nones: bool = False) -> None:
    """fx names an argument traced as a given value ``mask_1`` and asserts that value; give it
    back its name (callers pass it by keyword) and drop the assert (the caller chose this
    program for that value), unless ``check_nones`` keeps those of arguments traced as None."""
    for node in reversed(list(graph.nodes)):
        if check_nones and node.target is _assert_is_none:
            node.args = (node.args[0], f"this program was traced with '{node.args[0]}' None; transform the model "
                         "with an example that passes it (example_kwargs=) for calls that do")
            continue
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


def forward_parameters(model: nn.Module) -> list[inspect.Parameter]:
    """The parameters of ``model.forward``, behind any decorator (``inspect.signature`` follows
    ``__wrapped__``: transformers wraps every forward as ``wrapper(self, *args, **kwargs)``)."""
    try:
        return list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return []


def bind_examples(
    model: nn.Module, example_inputs: Sequence[Any] | None, example_kwargs: Mapping[str, Any] | None
) -> dict[str, Any]:
    """``{argument name: example value}`` for what the examples give, positional or by keyword."""
    given: dict[str, Any] = {}
    positional = [p for p in forward_parameters(model) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for param, value in zip(positional, example_inputs or ()):
        given[param.name] = value
    given.update(example_kwargs or {})
    return given


def flag_arguments(
    model: nn.Module, example_inputs: Sequence[Any] | None = None, example_kwargs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Arguments of ``model.forward`` that hold a Python flag (``return_hidden: bool = False``,
    ``mode="sum"``), with the values to trace them as: the example's, else the default."""
    given = bind_examples(model, example_inputs, example_kwargs)
    flags: dict[str, Any] = {}
    for param in forward_parameters(model):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        value = given.get(param.name, param.default)
        if type(value) in FLAG_TYPES:
            flags[param.name] = value
    return flags


def optional_arguments(
    model: nn.Module, example_inputs: Sequence[Any] | None = None, example_kwargs: Mapping[str, Any] | None = None
) -> frozenset[str]:
    """Arguments that default to None and that the examples leave None (``attn_mask=None``)."""
    given = bind_examples(model, example_inputs, example_kwargs)
    return frozenset(
        p.name
        for p in forward_parameters(model)
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.default is None and given.get(p.name) is None
    )


def capture_fx(
    model: nn.Module,
    *,
    leaf_modules: Iterable[type[nn.Module]] = (),
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    optional_as_none: bool = False,
) -> tuple[fx.GraphModule, dict[str, Any]]:
    """Capture ``model`` with fx; where forward branches on a Python flag (``if is_causal:``) or
    on an optional argument (``if attn_mask is not None``), which fx traces as values it cannot
    branch on, trace them as the example (else the default) gives them: the program serves
    calls with those values, and ``ParallelModule`` traces again for others.

    ``optional_as_none``: trace every optional argument the examples leave None as None, also
    where forward does not branch on it (``sdpa(q, k, v, attn_mask=attn_mask)``): a placeholder
    no example gives has no shape, so the ops it reaches could not be split. A call that passes a
    tensor there is traced again.

    Returns the graph and the flags it was specialised on.
    """
    leaf_modules = tuple(leaf_modules)
    if isinstance(model, fx.GraphModule):
        return capture(model, leaf_modules=leaf_modules), {}
    remember_varargs_count(model, example_inputs, forward_parameters(model))
    nones = optional_arguments(model, example_inputs, example_kwargs)
    flags = flag_arguments(model, example_inputs, example_kwargs)
    if optional_as_none and nones:
        for fixed in ({}, flags) if flags else ({},):
            with contextlib.suppress(TraceError):  # else as below: traced as they come
                return capture(model, leaf_modules=leaf_modules, none_args=nones, flags=fixed, check_nones=True), fixed
    try:
        gm = capture(model, leaf_modules=leaf_modules)
    except TraceError as error:
        if not flags and not nones:
            raise
        # trace the optional arguments as None and the flags as their values; the program
        # checks at run time that a call leaves those arguments None
        try:
            return capture(model, leaf_modules=leaf_modules, none_args=nones, flags=flags, check_nones=True), flags
        except TraceError as again:
            raise (again if str(again) != str(error) else error) from None
    if nones and flags and not _traces_with(model, leaf_modules, nones, {}):
        # the first call (its optional arguments None) needs its flags fixed to take a path fx
        # can trace (``if attn_mask is not None or is_causal``): ParallelModule then checks the
        # flags at every call and traces the variant for them
        if _traces_with(model, leaf_modules, nones, flags):
            return gm, flags
    return gm, {}


def _traces_with(model: nn.Module, leaf_modules: tuple, nones: frozenset[str], flags: dict[str, Any]) -> bool:
    try:
        capture(model, leaf_modules=leaf_modules, none_args=nones, flags=flags)
        return True
    except TraceError:
        return False


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

