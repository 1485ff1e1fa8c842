"""Small torch.fx utilities every layer above the runtime shares.

* :func:`copy_graph`: a graph's copy that belongs to no module (linear time);
* :func:`adopt_state`: make a GraphModule hold *all* of a model's state, not only what its
  graph reads, so state dict keys stay the model's;
* :func:`propagate_shapes`: record each node's fake value (``node.meta["val"]``);
* :func:`example_shapes` / :func:`propagate_example_shapes` / :class:`PicklableGraph`: a graph
  whose fake values cannot be pickled or written, and the example shapes to propagate them again;
* :func:`placeholders`: a graph's inputs in order;
* :func:`graph_module`: ``fx.GraphModule(root, graph)`` where the model's names never collide
  with the module's own (:data:`RESERVED_NAMES`, read through :func:`alias_of`).
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dpcompile.errors import ExampleError, first_line
from dpcompile.runtime.side_effects import in_place_without_grad

log = logging.getLogger("dpcompile")


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` that belongs to no module (linear time, unlike ``copy.deepcopy``)."""
    clone = fx.Graph()
    clone._codegen = graph._codegen
    remap: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        remap[node] = clone.node_copy(node, lambda n: remap[n])
    return clone


def ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node its value is computed from."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def placeholders(graph: fx.Graph) -> list[fx.Node]:
    """The inputs of ``graph``, in order."""
    return [n for n in graph.nodes if n.op == "placeholder"]


#: set on a submodule a pass adds to the program (it holds no state of the model's): kept by adopt_state
PROGRAM_OWNED = "dpcompile_program_owned"
#: node.meta key: the pipeline stage a node runs in (``passes/split_stages.py`` stamps it; a 1F1B step groups by it)
STAGE = "dpcompile_stage"


def adopt_state(holder: nn.Module, model: nn.Module, *, aliased: bool = False, follow_removals: bool = False) -> None:
    """Make ``holder`` hold ``model``'s own submodules, parameters and buffers (the same
    objects) and training mode, so their state dicts have the same keys.

    ``fx.GraphModule`` keeps only what its graph reads, with empty stand-ins for the modules
    on the way; this restores the rest. Buffers the program holds beyond the model's (the
    tracer's ``_tensor_constant0`` for a tensor made in forward) stay out of ``state_dict``.
    ``aliased``: hold reserved names under their alias (:func:`alias_of`), as a plain
    ``GraphModule`` must (its own ``graph`` and ``meta`` are not the model's).
    ``follow_removals``: drop the submodules and parameters the model no longer has (``del
    model.head`` after transform), where ``holder`` holds nothing of its own but the model's.
    """
    rename = alias_of if aliased else (lambda key: key)
    program_only = {key for key in holder._buffers if key not in {rename(k) for k in model._buffers}}
    for name in ("_modules", "_parameters", "_buffers"):
        ours, theirs = getattr(holder, name), {rename(k): v for k, v in getattr(model, name).items()}
        merged = dict(theirs)  # the model's order, so state_dict keys come in the same order
        if not (follow_removals and name in ("_modules", "_parameters")):
            merged.update((key, value) for key, value in ours.items() if key not in theirs)
        elif name == "_modules":  # the program's own (a region recomputed in backward) stay
            merged.update((k, v) for k, v in ours.items() if k not in theirs and getattr(v, PROGRAM_OWNED, False))
        ours.clear()
        ours.update(merged)
    holder._non_persistent_buffers_set = {rename(k) for k in model._non_persistent_buffers_set} | program_only
    holder.training = model.training


# what torch's shape checks say when a tensor does not fit an op (not: an op fake tensors cannot run)
_SHAPE_ERRORS = ("must have same", "size mismatch", "shapes cannot be multiplied", "expected input", "sizes of tensors",
                 "must match the size", "mat1 and mat2", "is invalid for input of size", "dimension out of range",
                 "must be Tensor, not", "invalid combination of arguments", "the dtype of its weight")  # fmt: skip
#: modules and functions whose input must have the dtype of their weight (fake tensors do not check it)
_SAME_DTYPE_MODULES = (nn.Linear, nn.modules.conv._ConvNd)
_SAME_DTYPE_FUNCTIONS = {torch.nn.functional.linear, torch._C._nn.linear, torch.conv1d, torch.conv2d, torch.conv3d,
                         torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d}  # fmt: skip


def _fresh(value: Any) -> Any:
    """``value`` with fx's immutable lists and dicts made plain, as the generated code builds them."""
    if isinstance(value, (list, fx.immutable_collections.immutable_list)):
        return [_fresh(v) for v in value]
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    if type(value) is tuple:
        return tuple(_fresh(v) for v in value)
    return value


class FreshArguments(fx.Interpreter):
    """An interpreter that passes each call plain lists and dicts, as the generated code does (a
    list literal there is a new list each call): a function that writes into its list argument
    (torchvision's Swin3D ``shifted_window_attention_3d``: ``shift_size[i] = 0``) runs as in eager,
    where fx's own ``Interpreter`` would pass the node's ``immutable_list`` and fail."""

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return tuple(_fresh(a) for a in args), {k: _fresh(v) for k, v in kwargs.items()}


class _ShapeProp(FreshArguments, FakeTensorProp):
    """FakeTensorProp that remembers the node it is running (to name it when an example does not fit)
    and checks what fake kernels leave out: a Linear's or convolution's input has its weight's dtype."""

    current: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        value, weight = self._input_and_weight(n)
        if (isinstance(value, torch.Tensor) and isinstance(weight, torch.Tensor) and value.dtype != weight.dtype
                and not torch.is_autocast_enabled(value.device.type)):  # fmt: skip
            raise RuntimeError(f"expected {weight.dtype} input, the dtype of its weight, got {value.dtype}")
        return super().run_node(n)

    def _input_and_weight(self, n: fx.Node) -> tuple[Any, Any]:
        if len(n.args) < 1 + (n.op == "call_function") or not isinstance(n.args[0], fx.Node):
            return None, None
        value = n.args[0].meta.get("val")
        if n.op == "call_module":
            module = self.fetch_attr(str(n.target))
            # a pre-hook may compute the weight at the call (the older weight_norm's, whose weight is left
            # in its first dtype by model.double() until then)
            plain = isinstance(module, _SAME_DTYPE_MODULES) and not module._forward_pre_hooks
            return (value, getattr(module, "weight", None)) if plain else (None, None)
        if n.op == "call_function" and n.target in _SAME_DTYPE_FUNCTIONS and isinstance(n.args[1], fx.Node):
            return value, n.args[1].meta.get("val")
        return None, None


def propagate_shapes(gm: fx.GraphModule, example_inputs: Sequence[Any], *, check: bool = False) -> bool:
    """Record each node's shape (``node.meta['val']``) from fake copies of the example inputs.

    Costs no real compute; returns False (and records nothing) where fake tensors cannot run
    the model. Inputs that are fake already (``verify(..., fake_devices=)``) run in their own mode.
    ``check=True`` (the user's ``example_inputs=``): an example that does not fit the model (a
    shape, dtype or type an op refuses) raises :class:`~dpcompile.errors.ExampleError` (a ``ValueError``) naming the op and the user's line.
    """
    given = detect_fake_mode(example_inputs)
    mode = given or FakeTensorMode(allow_non_fake_inputs=True)
    prop = _ShapeProp(gm, mode)
    try:
        with quiet_fake_tensor_log():
            try:
                return _propagate(gm, prop, mode, example_inputs)
            except DynamicOutputShapeException:
                if given is not None:
                    raise
                # an op whose output size depends on values (nonzero): again with a shape
                # environment, where that size is a symbol (u0) rather than an error
                from torch.fx.experimental.symbolic_shapes import ShapeEnv  # lazy: it imports sympy

                mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
                prop = _ShapeProp(gm, mode)
                return _propagate(gm, prop, mode, example_inputs)
    except Exception as e:  # noqa: BLE001 - shapes are a refinement, not a requirement
        for node in gm.graph.nodes:
            node.meta.pop("val", None)
        message = first_line(e)
        if check and is_example_misfit(e):
            node = prop.current
            lines = node.meta.get("stack_trace", "").strip().splitlines() if node is not None else []
            where = lines[0].strip() if lines else ""  # a node traced from no user line (a Sequential's) has none
            raise ExampleError(
                f"example_inputs= do not fit the model: {_op_name(gm, node)} refuses them "
                f"({message}){' at ' + where if where else ''}; pass examples shaped as forward expects them, "
                "or leave example_inputs= out"
            ) from None
        log.debug("shape propagation on fake tensors failed (%s); continuing without shapes", message)
        return False


def _propagate(gm: fx.GraphModule, prop: _ShapeProp, mode: FakeTensorMode, example_inputs: Sequence[Any]) -> bool:
    """Run ``prop`` on fake copies of the examples, giving back the counters fake mode bumps."""
    fake_inputs = [
        mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
        for x in example_inputs
    ]
    with state_writes_undone(gm):
        prop.propagate(*fake_inputs)
    return True


@contextlib.contextmanager
def state_writes_undone(gm: fx.GraphModule) -> Iterator[None]:
    """Run a fake run of ``gm``, then give the real state it wrote its values back: fake mode still
    runs an op whose tensors are all real, on real 0-dim buffers (batch norm's ``num_batches_tracked
    += 1``) and in a write into a parameter by a Python number (``with torch.no_grad(): w.mul_(0.9)``)."""
    written = {id(t): t for t in (*(b for b in gm.buffers() if b.dim() == 0), *_state_written(gm))}
    kept = [(t, t.clone()) for t in written.values() if not isinstance(t, FakeTensor) and t.device.type != "meta"]
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in kept:
                tensor.copy_(value)


_CALLS = ("call_function", "call_method")  # fx's ``buf.mul_(1.5)`` is a method call, export's an op


def _state_written(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The parameters and buffers ``gm`` writes in place: the first argument of an in-place op (or a
    chain of them) on a ``get_attr``, an op's ``out=`` (export's spelling of spectral_norm's power
    iteration, ``div.out(mv, norm, out=_u)``), and the weight of an embedding with ``max_norm`` it calls."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
                out.append(module.weight)
        elif node.op in _CALLS and _writes_into_first(node) or isinstance(node.kwargs.get("out"), fx.Node):
            root = node.kwargs["out"] if isinstance(node.kwargs.get("out"), fx.Node) else node.args[0]
            while isinstance(root, fx.Node) and root.op in _CALLS and _writes_into_first(root):
                root = root.args[0]
            if isinstance(root, fx.Node) and root.op == "get_attr":
                value = attribute_at(gm, str(root.target))
                if isinstance(value, torch.Tensor):
                    out.append(value)
    return out


def attribute_at(gm: nn.Module, target: str) -> Any:
    """What a ``get_attr`` of ``target`` (``"layers.0.weight"``) reads from ``gm``; None where a name is missing."""
    value: Any = gm
    for name in target.split("."):
        value = getattr(value, name, None)
    return value


def example_shapes(graph: fx.Graph) -> list[list[Any]] | None:
    """The example inputs' shapes and dtypes (``[[sizes], "float32"]`` per placeholder) a graph's
    shapes were propagated from (symbolic sizes at their hints), so a copy that drops its fake
    values (pickling, ``export``) can propagate them again; None where a placeholder was not a
    tensor of known shape."""
    out = []
    for node in placeholders(graph):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        sizes = [s if isinstance(s, int) else getattr(getattr(s, "node", None), "hint", None) for s in val.shape]
        if not all(isinstance(s, int) for s in sizes):
            return None
        out.append([sizes, str(val.dtype).removeprefix("torch.")])
    return out


def propagate_example_shapes(holder: nn.Module, graph: fx.Graph, inputs: Any, device: Any) -> None:
    """Each node's shape (``meta['val']``) propagated again on fake tensors (nothing allocated)
    from :func:`example_shapes`' record, on ``device``: lowering a captured program for other
    devices reads them (a mask built from the batch's shape). Nothing where none were recorded,
    the record is malformed (it may come from a file) or the shapes do not fit."""
    if not isinstance(inputs, list) or not all(
        isinstance(i, list)
        and len(i) == 2
        and isinstance(i[0], list)
        and all(type(s) is int and 0 <= s < 2**31 for s in i[0])
        and isinstance(getattr(torch, str(i[1]), None), torch.dtype)
        for i in inputs
    ):
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        examples = [torch.empty(sizes, dtype=getattr(torch, dtype), device=device) for sizes, dtype in inputs]
    shaped_graph = copy_graph(graph)
    try:
        shaped = propagate_shapes(fx.GraphModule(holder, shaped_graph, "Shapes"), examples)
    except Exception:  # noqa: BLE001 - shapes refine the lowering; without them it is the lowering of old
        return
    if shaped:
        for node, shaped_node in zip(graph.nodes, shaped_graph.nodes):
            if "val" in shaped_node.meta:
                node.meta["val"] = shaped_node.meta["val"]


class PicklableGraph:
    """A graph as pickle can write it: its nodes as a flat list (pickle follows fx's linked nodes
    one level per node and overflows the stack on a graph of a few hundred), without the fake
    tensors and symbolic sizes shape propagation left in their meta (those hold their fake mode
    and shape environment). :meth:`graph` rebuilds it."""

    def __init__(self, graph: fx.Graph) -> None:
        self.codegen = graph._codegen
        self.nodes = [
            (n.op, n.name, n.target, fx.node.map_arg(n.args, _name_of), fx.node.map_arg(n.kwargs, _name_of), n.type,
             {k: v for k, v in n.meta.items() if not _holds_fake_values(v)})
            for n in graph.nodes
        ]  # fmt: skip

    def graph(self) -> fx.Graph:
        graph = fx.Graph()
        graph._codegen = self.codegen
        made: dict[str, fx.Node] = {}
        for op, name, target, args, kwargs, type_expr, meta in self.nodes:
            args, kwargs = _named_nodes(args, made), _named_nodes(kwargs, made)
            node = graph.create_node(op, target, args, kwargs, name=name, type_expr=type_expr)
            node.meta.update(meta)
            made[name] = node
        return graph


class _NodeName(str):
    """An argument that names a node of the graph (:class:`PicklableGraph`)."""


def _name_of(node: fx.Node) -> _NodeName:
    return _NodeName(node.name)


def _named_nodes(value: Any, made: dict[str, fx.Node]) -> Any:
    if type(value) is _NodeName:
        return made[str(value)]
    if isinstance(value, (tuple, list)):
        return type(value)(_named_nodes(v, made) for v in value)
    if isinstance(value, dict):
        return {k: _named_nodes(v, made) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(*(_named_nodes(v, made) for v in (value.start, value.stop, value.step)))
    return value


def _holds_fake_values(value: Any) -> bool:
    symbolic = (FakeTensor, torch.SymInt, torch.SymFloat, torch.SymBool)
    for leaf in torch.utils._pytree.tree_leaves(value):
        if isinstance(leaf, symbolic) or (isinstance(leaf, torch.Size) and any(isinstance(s, symbolic) for s in leaf)):
            return True
    return False


_NOT_WRITES = frozenset({"requires_grad_", "retain_grad_", "share_memory_", "record_stream_"})


def writes(n: fx.Node) -> bool:
    """Whether ``n`` writes into a tensor: ``self.calls.add_(1)``, ``buf.copy_(v)``, ``t[i] = v``,
    ``F.relu(x, inplace=True)``, an ATen op whose schema writes."""
    if n.op == "call_method":
        name = str(n.target)
        return name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES and hasattr(torch.Tensor, name)
    if n.op != "call_function":
        return False
    target = n.target
    if target is operator.setitem or n.kwargs.get("inplace") is True:
        return True
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    name = getattr(target, "__name__", "")
    return name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES


def state_access_order(nodes: list[fx.Node]) -> dict[fx.Node, set[fx.Node]]:
    """For each node that reads or writes the model's state around an in-place write into it, the
    accesses it must follow, as in ``nodes``' order: data edges alone would let micro-batch 0 read
    ``self.avg`` before the write the whole batch's mean makes (``avg.mul_(0.9).add_(mean)``, then
    ``h - self.avg``), or a write run before an earlier read."""
    root: dict[fx.Node, str] = {}  # a get_attr, or a write into one, -> the attribute it is
    # a detached alias of one (export's ``embedding_renorm_(detach(weight), ids)``: nn.Embedding's max_norm)
    alias: dict[fx.Node, str] = {}
    for node in nodes:
        first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if node.op == "get_attr":
            root[node] = str(node.target)
        elif first is not None and (first in root or first in alias) and _writes_into_first(node):
            root[node] = root.get(first) or alias[first]
        elif first is not None and (first in root or first in alias) and node.target in _ALIASES:
            alias[node] = root.get(first) or alias[first]
    accesses: dict[str, list[fx.Node]] = {}
    written: set[str] = set()
    for node in nodes:
        touched = {root.get(a) or alias[a] for a in node.all_input_nodes if a in root or a in alias}
        if node in root and node.op != "get_attr":
            written.add(root[node])
        for target in touched:
            accesses.setdefault(target, []).append(node)
    after: dict[fx.Node, set[fx.Node]] = {}
    for target in written:
        last_write, since = None, []  # since the last write: reads a next write must follow
        for node in accesses[target]:
            if root.get(node) == target and node.op != "get_attr":
                after.setdefault(node, set()).update(since)
                last_write, since = node, []
            else:
                since.append(node)
                if last_write is not None:
                    after.setdefault(node, set()).add(last_write)
    return after


_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.Tensor.detach, "detach")


def _writes_into_first(node: fx.Node) -> bool:
    """``buf.mul_(0.9)``, ``torch.add_(buf, x)``, or one replayed under ``torch.no_grad()``."""
    return bool(node.args) and (writes(node) or node.target is in_place_without_grad)


def is_example_misfit(error: BaseException) -> bool:
    """Whether ``error`` is torch saying an input does not fit an op (a shape, dtype or type it
    refuses), not that fake tensors cannot run the op."""
    return any(words in str(error) for words in _SHAPE_ERRORS)


@contextlib.contextmanager
def quiet_fake_tensor_log() -> Iterator[None]:
    """Silence fake tensors' logged traceback of an op that refused its inputs: the error that
    follows is ours to report, once."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        fake_log.setLevel(level)


def _op_name(gm: fx.GraphModule, node: fx.Node | None) -> str:
    """``fc1 (Linear)`` for a module call, else the node's name."""
    if node is None:
        return "an op"
    if node.op == "call_module":
        try:
            return f"{node.target} ({type(gm.get_submodule(str(node.target))).__name__})"
        except AttributeError:
            pass
    return node.name


def bind_inputs(gm: fx.GraphModule, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    """The value of each placeholder of ``gm`` for a call ``gm(*args, **kwargs)``, in order
    (defaults where the call leaves one out)."""
    values = []
    inputs = placeholders(gm.graph)
    for i, node in enumerate(inputs):
        name = str(node.target).lstrip("*")
        if i < len(args):
            values.append(args[i])
        elif name in kwargs:
            values.append(kwargs[name])
        elif node.args:
            values.append(node.args[0])
        else:
            raise TypeError(f"missing argument '{name}' (the program takes {[str(p.target) for p in inputs]})")
    return values


# ------------------------------------------------------------------ names that never collide
#: Attribute names of the modules dpcompile builds (``GraphModule``'s ``graph``, ``code``,
#: ``meta``; ``ParallelModule``'s ``devices``, ``mode``, ``plan``, ...). A model's top-level
#: submodule, parameter or buffer of such a name is read by generated code under its alias
#: (``getattr(self, "user:devices")``), never as ``self.devices``, which is the module's own.
RESERVED_NAMES: set[str] = set(dir(fx.GraphModule)) | set(vars(fx.GraphModule(nn.Module(), fx.Graph())))

ALIAS_PREFIX = "user:"  # not an identifier: no model attribute is ever named so


def reserve_names(names: Iterable[str]) -> None:
    """Add attribute names of a module class built on ``fx.GraphModule`` to :data:`RESERVED_NAMES`."""
    RESERVED_NAMES.update(names)


def alias_of(path: str) -> str:
    """``path`` as generated code reads it: its first name aliased where it is reserved.

    >>> alias_of("devices.weight"), alias_of("fc1.weight")
    ('user:devices.weight', 'fc1.weight')
    """
    first, dot, rest = path.partition(".")
    return f"{ALIAS_PREFIX}{first}{dot}{rest}" if first in RESERVED_NAMES else path


def unalias(path: str) -> str:
    """The model's own name for ``path`` (the inverse of :func:`alias_of`)."""
    return path[len(ALIAS_PREFIX):] if path.startswith(ALIAS_PREFIX) else path


def alias_targets(graph: fx.Graph) -> bool:
    """Rename every ``get_attr``/``call_module`` target of ``graph`` whose first name is
    reserved to its alias; return whether any target is an alias."""
    aliased = False
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module") and isinstance(node.target, str):
            node.target = alias_of(node.target)
            aliased = aliased or node.target.startswith(ALIAS_PREFIX)
    return aliased


def own_attribute(module: nn.Module, name: str) -> Any:
    """``module``'s submodule, parameter or buffer ``name`` (an alias read as the model's name),
    found in its state before its attributes (``pm.devices`` is the module's own)."""
    for candidate in dict.fromkeys((name, unalias(name))):  # held under the alias, else the name
        for store in ("_parameters", "_buffers", "_modules"):
            values = module.__dict__.get(store)
            if values is not None and candidate in values:
                return values[candidate]
    if name.startswith(ALIAS_PREFIX):  # never the module's own attribute of that name
        plain = module.__dict__.get(unalias(name))
        if isinstance(plain, torch.Tensor):  # a tensor the model holds as a plain attribute (self.mode = torch.ones(4))
            return plain
        raise AttributeError(f"{type(module).__name__} holds no submodule, parameter or buffer {unalias(name)!r}")
    return getattr(module, name)


class _AliasedRoot(nn.Module):
    """``root`` seen by ``fx.GraphModule``'s copy of targets: names looked up in its state first."""

    def __init__(self, root: nn.Module):
        super().__init__()
        self.__dict__["_root"] = root
        self.training = root.training

    def __getattr__(self, name: str) -> Any:
        return own_attribute(self.__dict__["_root"], name)


def aliased_root(root: nn.Module) -> nn.Module:
    """``root`` as the source of :func:`graph_module`'s copies (reads aliases as the model's names)."""
    return _AliasedRoot(root)


class _RootWithConstants(nn.Module):
    """``root`` seen by ``fx.GraphModule``'s copy of targets, with tensors it does not hold."""

    def __init__(self, root: nn.Module, constants: Mapping[str, torch.Tensor]):
        super().__init__()
        self.__dict__["_root"], self.__dict__["_constants"] = root, dict(constants)
        self.training = root.training

    def __getattr__(self, name: str) -> Any:
        constants = self.__dict__["_constants"]
        return constants[name] if name in constants else getattr(self.__dict__["_root"], name)


def graph_module(
    root: nn.Module, graph: fx.Graph, class_name: str = "GraphModule", constants: Mapping[str, torch.Tensor] | None = None
) -> fx.GraphModule:
    """``fx.GraphModule(root, graph, class_name)`` with reserved names aliased in ``graph``
    (in place), so a model's submodule named ``graph``, ``meta`` or ``devices`` is held and
    called as the model's, not confused with the module's own attribute.

    The module holds an aliased submodule under its alias (``gm.get_submodule("user:meta")``);
    ``ParallelModule`` holds it under the model's name and resolves the alias on access.
    ``constants``: tensors the graph reads (``get_attr``) that ``root`` does not hold, such as the
    tracer's ``_tensor_constant1`` of a program traced for another call.
    """
    if alias_targets(graph) and isinstance(root, nn.Module):
        root = aliased_root(root)
    if constants:
        root = _RootWithConstants(root, constants)
    return fx.GraphModule(root, graph, class_name)
