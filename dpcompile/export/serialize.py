"""The program as JSON: graphs (nodes with allowlisted targets) and the module tree.

Values in node arguments and module attributes are JSON with tags for what JSON lacks::

    {"node": "x_dev0"}            a reference to an earlier node (graphs only)
    {"tuple": [...]}              a tuple (a plain JSON list is a list)
    {"dict": [[key, value], ...]} a dict (keys: str, int, bool or None)
    {"slice": [start, stop, step]}, {"float": "inf" | "-inf" | "nan"}, {"ellipsis": null}
    {"dtype": "float32"}, {"device": "cuda:0"}, {"memory_format": "..."}, {"layout": "strided"}
    {"size": [...]}               a torch.Size
    {"fn": "torch.nn.functional.relu"}   an allowlisted function
    {"op": "aten::slice.Tensor"}  an ATen op of the vocabulary handed to a runtime function that
                                  applies one (``written``'s view steps; :mod:`~dpcompile.export.kinds`
                                  says where a graph may hold one)
    {"tensor": "fc.weight"}       a tensor of weights.safetensors (module attributes only)
    {"const": "TAKE_FIRST"}       dpcompile.runtime.TAKE_FIRST

Anything else cannot be data: :class:`NotData` says what, and export keeps a pickle that
only ``load(..., trust_code=True)`` reads.
"""

from __future__ import annotations

import builtins
import keyword
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.immutable_collections import immutable_dict, immutable_list

from dpcompile.errors import DpCompileError
from dpcompile.export.allowlist import (
    NotAllowed,
    allowed_method,
    class_name,
    op_name,
    qualified_name,
    resolve_class,
    resolve_op,
    resolve_target,
    safe_attribute,
    safe_name_part,
    stand_in_name,
)
from dpcompile.export.kinds import TreeIndex, check_graph
from dpcompile.export.strided import bound
from passes.name_dp_copies import COPY
from passes.place_dp_copies import SLOT

__all__ = ["NotData", "decode_graph", "decode_value", "encode_graph", "encode_tree", "encode_value", "model_output_fields"]

_MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"}
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# attributes a class rebuilds itself after its parameters are in place
_REBUILT: dict[type, tuple[frozenset[str], Callable[[nn.Module], None]]] = {
    nn.RNNBase: (frozenset({"_flat_weights", "_flat_weight_refs"}), lambda m: m._init_flat_weights()),
}
_RESERVED = frozenset({"self", "torch", *dir(builtins)})
_OPS = ("placeholder", "get_attr", "call_function", "call_method", "call_module", "output")


class NotData(DpCompileError):
    """Part of a program that JSON cannot hold (a user class, a closure, an odd constant)."""


# ------------------------------------------------------------------------------ values
def encode_value(value: Any, tensors: Mapping[int, str] | None = None, functions: bool = True) -> Any:
    """``value`` as tagged JSON (see the module docstring); raises :class:`NotData`. A graph's
    arguments hold no functions (``functions=False``): a program calls functions, never passes them."""
    from dpcompile.runtime import TAKE_FIRST

    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int) and type(value) is int:
        return value
    if isinstance(value, float) and type(value) is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if isinstance(value, torch.Size):
        return {"size": [int(v) for v in value]}
    if type(value) in (list, immutable_list):
        return [encode_value(v, tensors, functions) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return {"tuple": [encode_value(v, tensors, functions) for v in value]}
    if type(value) in (dict, immutable_dict):
        if not all(k is None or type(k) in (str, int, bool) for k in value):
            raise NotData(f"a dict with keys {list(value)[:4]!r}")
        return {"dict": [[k, encode_value(v, tensors, functions)] for k, v in value.items()]}
    if isinstance(value, slice):
        return {"slice": [encode_value(v, tensors, functions) for v in (value.start, value.stop, value.step)]}
    if value is Ellipsis:
        return {"ellipsis": None}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if value is TAKE_FIRST:
        return {"const": "TAKE_FIRST"}
    if isinstance(value, torch.Tensor):
        if tensors is not None and id(value) in tensors:
            return {"tensor": tensors[id(value)]}
        raise NotData(f"a tensor constant of shape {tuple(value.shape)} outside the module's state")
    if isinstance(value, torch._ops.OpOverload):
        name = qualified_name(value)
        if name is not None and name.startswith("torch.ops.aten."):
            return {"op": op_name(value)}
        raise NotData(f"the op {value!r:.60}, which is no ATen op of the vocabulary")
    if callable(value) and functions:
        name = qualified_name(value)
        if name is not None:
            return {"fn": name}
    raise NotData(f"a value of type {type(value).__module__}.{type(value).__qualname__} ({value!r:.60})")


def decode_value(
    data: Any, nodes: Mapping[str, fx.Node] | None = None, tensors: Mapping[str, Any] | None = None, functions: bool = True
) -> Any:
    """The counterpart of :func:`encode_value`; raises ``ExportError`` for anything unknown
    (with ``functions=False``, a function among a graph's arguments)."""
    from dpcompile.export.common import ExportError
    from dpcompile.runtime import TAKE_FIRST

    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode_value(v, nodes, tensors, functions) for v in data]
    if not isinstance(data, dict) or len(data) != 1:
        raise ExportError(f"program.json holds a value it cannot read: {data!r:.80}")
    (tag, body), = data.items()
    try:
        if tag == "node" and nodes is not None:
            return nodes[body]
        if tag == "tuple":
            return tuple(decode_value(v, nodes, tensors, functions) for v in body)
        if tag == "dict":
            out = {}
            for key, value in body:
                if not (key is None or type(key) in (str, int, bool)):
                    raise ExportError(f"program.json: a dict key {key!r:.40}")
                out[key] = decode_value(value, nodes, tensors, functions)
            return out
        if tag == "size":
            return torch.Size([int(v) for v in body])
        if tag == "slice":
            return slice(*(decode_value(v, nodes, tensors, functions) for v in body))  # x[:n], n a node
        if tag == "float" and body in ("inf", "-inf", "nan"):
            return float(body)
        if tag == "ellipsis":
            return Ellipsis
        if tag in ("dtype", "memory_format", "layout"):
            kind = {"dtype": torch.dtype, "memory_format": torch.memory_format, "layout": torch.layout}[tag]
            value = getattr(torch, body, None) if isinstance(body, str) and body.isidentifier() else None
            if isinstance(value, kind):
                return value
        if tag == "device" and isinstance(body, str):
            return torch.device(body)
        if tag == "fn" and functions:
            return resolve_target(body)
        if tag == "op":
            return resolve_op(body)
        if tag == "const" and body == "TAKE_FIRST":
            return TAKE_FIRST
        if tag == "tensor" and tensors is not None:
            return tensors[body]
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ExportError(f"program.json holds a value it cannot read: {data!r:.80} ({e!s:.80})") from None
    except NotAllowed as e:
        raise ExportError(f"program.json: {e}") from None
    raise ExportError(f"program.json holds a value it cannot read: {data!r:.80}")


# ------------------------------------------------------------------------------ graphs
def encode_graph(graph: fx.Graph) -> dict[str, Any]:
    """The nodes of ``graph`` as JSON, call targets by allowlisted name."""
    if type(graph._codegen) is not fx.graph.CodeGen:
        raise NotData(f"a graph with {type(graph._codegen).__name__} (pytree calling convention)")
    nodes = []
    for node in graph.nodes:
        args = node.args
        if node.op == "call_function":
            target = qualified_name(node.target)
            fields = model_output_fields(node.target) if target is None else None
            if fields is not None:  # transformers' output class: a record of its fields (data, no class)
                target, args = _MODEL_OUTPUT, (class_name(node.target), fields, *node.args)
            if target is None:
                what = f"{getattr(node.target, '__module__', '?')}.{getattr(node.target, '__qualname__', node.target)!s}"
                hint = " (a type the model returns: register_output_type)" if isinstance(node.target, type) else ""
                raise NotData(f"a call of {what}, which is not an allowlisted op{hint}")
        elif node.op == "call_method" and not allowed_method(node.target) and not safe_attribute(node.target):
            raise NotData(f"a call of method {node.target!r}")
        else:
            target = node.target
        item = {
            "op": node.op,
            "name": node.name,
            "target": target,
            "args": encode_value(args, functions=False),
            "kwargs": encode_value(node.kwargs, functions=False),
        }  # fmt: skip
        labels = _labels(node)
        if labels:
            item["meta"] = labels
        nodes.append(item)
    return {"nodes": nodes}


#: the device-slot labels a node keeps, by their key in JSON: its slot (``passes/stage_transfers.py``,
#: ``stage_shards.py``, ``place_dp_copies.py``) and its dp copy (``passes/name_dp_copies.py``)
_PLACES = {"slot": SLOT, "copy": COPY}
_MAX_PLACE = 1 << 16


def _labels(node: fx.Node) -> dict[str, Any]:
    """What explain and measure read of a node beside the program (labels: nothing runs them): the
    data it moves (``Comm``: ``[kind, io, backward]``), the pass that made it, and the device slot
    and dp copy it runs on (a pipeline's stages and dp copies on virtual devices are told apart by them)."""
    labels: dict[str, Any] = {}
    comm = node.meta.get("dpcompile_comm")
    if comm is not None:
        labels["comm"] = [comm.kind, comm.io, comm.backward]
    if isinstance(node.meta.get("dpcompile_pass"), str):
        labels["pass"] = node.meta["dpcompile_pass"]
    for key, meta_key in _PLACES.items():
        place = node.meta.get(meta_key)
        if type(place) is int and 0 <= place < _MAX_PLACE:
            labels[key] = place
    return labels


def _label(x: Any) -> bool:
    return isinstance(x, str) and 0 < len(x) <= 64 and x.isascii() and x.isidentifier()


def _decoded_labels(value: Any, node: fx.Node) -> None:
    """:func:`_labels`' ``meta`` field, checked, back on ``node.meta``."""
    from dpcompile.export.common import ExportError
    from dpcompile.infra import Comm

    comm, made_by = (value.get("comm"), value.get("pass")) if isinstance(value, dict) else (None, None)
    places = {k: value[k] for k in _PLACES if k in value} if isinstance(value, dict) else {}
    if (not isinstance(value, dict) or not set(value) <= {"comm", "pass", *_PLACES}
            or not all(type(v) is int and 0 <= v < _MAX_PLACE for v in places.values())
            or (made_by is not None and not _label(made_by))
            or (comm is not None and not (isinstance(comm, list) and len(comm) == 3 and _label(comm[0])
                                          and type(comm[1]) is bool and (comm[2] is None or _label(comm[2]))))):  # fmt: skip
        raise ExportError(f"program.json: node {node.name!r} has malformed labels {value!r:.80}")
    if comm is not None:
        node.meta["dpcompile_comm"] = Comm(comm[0], comm[1], comm[2])
    if made_by is not None:
        node.meta["dpcompile_pass"] = made_by
    for key, place in places.items():
        node.meta[_PLACES[key]] = place


_MODEL_OUTPUT = "dpcompile.runtime.exported.model_output"


def model_output_fields(cls: Any) -> tuple[str, ...] | None:
    """The fields of a transformers ``ModelOutput`` dataclass (by the name of its base: nothing
    imports transformers here), or None for anything else."""
    import dataclasses

    bases = {f"{c.__module__}.{c.__qualname__}" for c in getattr(cls, "__mro__", ())}
    if isinstance(cls, type) and "transformers.utils.generic.ModelOutput" in bases and dataclasses.is_dataclass(cls):
        return tuple(f.name for f in dataclasses.fields(cls))
    return None


def decode_graph(data: Any, tree: TreeIndex | None = None) -> fx.Graph:
    """Rebuild a graph from :func:`encode_graph`'s JSON, checking every target.

    ``call_function`` targets come from the vocabulary (an op taking explicit strides becomes
    its bounded counterpart of :mod:`dpcompile.export.strided`); ``get_attr``, ``call_module`` and
    ``call_method`` targets must be attribute paths without dunders, and, given the module
    ``tree``, each is checked against the kind of value it names (:mod:`dpcompile.export.kinds`):
    a Tensor method on a value, a module call on a replica, a module or tensor of the tree.
    """
    from dpcompile.export.common import ExportError

    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise ExportError("program.json: a graph without a node list")
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    for item in data["nodes"]:
        if not isinstance(item, dict) or set(item) - {"meta"} != {"op", "name", "target", "args", "kwargs"}:
            raise ExportError(f"program.json: a node it cannot read: {item!r:.80}")
        op, name, target = item["op"], item["name"], item["target"]
        if op not in _OPS or not isinstance(name, str) or not name.isidentifier() or name in nodes:
            raise ExportError(f"program.json: a node with op {op!r:.20} and name {name!r:.40}")
        if op == "call_function":
            try:
                target = resolve_target(target)
            except NotAllowed as e:
                raise ExportError(f"program.json: node {name!r} calls {e}") from None
        elif op == "placeholder":
            if not isinstance(target, str) or not target.lstrip("*").isidentifier():
                raise ExportError(f"program.json: placeholder {target!r:.40}")
        elif op in ("get_attr", "call_module", "call_method"):
            if not safe_attribute(target):
                verb = "reads" if op == "get_attr" else "calls"
                raise ExportError(f"program.json: node {name!r} {verb} {target!r:.60}, not an attribute path")
        elif target != "output":
            raise ExportError(f"program.json: output node with target {target!r:.40}")
        args = decode_value(item["args"], nodes, functions=False)
        kwargs = decode_value(item["kwargs"], nodes, functions=False)
        if not isinstance(args, tuple) or not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ExportError(f"program.json: node {name!r} has malformed arguments")
        node = graph.create_node(op, target, args, kwargs, name=name)
        if node.name != name:
            raise ExportError(f"program.json: node name {name!r} is taken")
        if "meta" in item:
            _decoded_labels(item["meta"], node)
        nodes[name] = node
    kinds = check_graph(graph, tree) if tree is not None else None
    bound(graph, kinds)  # as_strided and its kin: within their input's own elements (dpcompile.export.strided)
    graph.lint()
    # a node named like a global of the generated code (``self``, ``torch``, ``getattr``,
    # ``dpcompile_runtime_scatter``) would make a later call resolve to that node's value
    code = graph.python_code(root_module="self")
    clashes = sorted(n for n in nodes if n in code.globals or n in _RESERVED or keyword.iskeyword(n))
    if clashes:
        raise ExportError(f"program.json: nodes named {clashes[:3]} would shadow names the generated code uses")
    return graph


# ------------------------------------------------------------------------ module tree
def _rebuilt_attrs(cls: type) -> tuple[frozenset[str], Callable[[nn.Module], None] | None]:
    for base, (skip, after) in _REBUILT.items():
        if issubclass(cls, base):
            return skip, after
    return frozenset(), None


def encode_tree(
    pm: nn.Module,
    used: set[str],
    tensor_keys: Mapping[int, str],
    outside: Mapping[str, nn.Module] = {},
    constants: Mapping[str, torch.Tensor] = {},
) -> list[dict[str, Any]]:
    """Every module of ``pm`` (and ``outside`` ones held beside the tree) as JSON entries.

    A module in ``used`` (called by the program, or inside one that is) keeps its class,
    which must be a ``torch.nn`` or registered class; any other module is stored as a plain
    container (its parameters, buffers and children, not its Python class).
    """
    seen: dict[int, str] = {}
    entries: list[dict[str, Any]] = []

    def walk(module: nn.Module, path: str, parent_used: bool, is_outside: bool = False) -> None:
        if id(module) in seen:
            entries.append({"path": path, "alias": seen[id(module)]})
            return
        seen[id(module)] = path
        is_used = parent_used or path in used
        cls = type(module)
        entry: dict[str, Any] = {"path": path, "training": bool(module.training)}
        if is_outside:
            entry["outside"] = True
        if path == "" and not is_outside:
            entry["class"] = None  # the ParallelModule itself
        elif stand_in_name(module) is not None:
            entry["class"] = stand_in_name(module)
        elif is_used:
            raise NotData(
                f"module '{path}' is a {cls.__module__}.{cls.__qualname__}, which the program calls (a leaf module); "
                "its forward is Python code"
            )
        else:
            entry["class"] = "plain"
        if entry["class"] not in (None, "plain"):
            hooks = [h for h in _HOOKS if getattr(module, h, None)]
            if hooks:
                raise NotData(f"module '{path}' has {', '.join(hooks)} (Python code)")
            skip, _ = _rebuilt_attrs(cls)
            attrs = {}
            for key, value in module.__dict__.items():
                if key in _MODULE_INTERNALS or key == "training" or key in skip:
                    continue
                try:
                    attrs[key] = encode_value(value, tensor_keys)
                except NotData as e:
                    raise NotData(f"attribute '{key}' of module '{path}' ({entry['class']}): {e}") from None
            entry["attrs"] = attrs
        buffers = dict(module._buffers)
        entry["non_persistent"] = sorted(module._non_persistent_buffers_set)
        if module is pm and not is_outside and constants:  # a variant program's own tensors
            buffers.update(constants)
            entry["non_persistent"] = sorted({*entry["non_persistent"], *constants})
        # [name, tensor key] pairs, not a dict: program.json sorts a dict's keys, and the order of
        # named_parameters() is what an optimizer's state saved by position lines up with
        entry["parameters"] = [[k, None if v is None else tensor_keys[id(v)]] for k, v in module._parameters.items()]
        entry["buffers"] = [[k, None if v is None else tensor_keys[id(v)]] for k, v in buffers.items()]
        entry["children"] = list(module._modules)
        entries.append(entry)
        for name, child in module._modules.items():
            if child is None:
                continue
            walk(child, f"{path}.{name}" if path else name, is_used)

    walk(pm, "", False)
    for path, module in outside.items():
        walk(module, path, True, is_outside=True)
    return entries


def _named_tensor_keys(table: Any, where: str) -> list[tuple[Any, Any]]:
    """A module entry's ``parameters`` / ``buffers``: ``[[name, tensor key], ...]`` in the module's
    order (a dict, from folders exported before the order was kept, in its sorted order)."""
    from dpcompile.export.common import ExportError

    if isinstance(table, dict):
        return list(table.items())
    if not isinstance(table, list) or not all(isinstance(pair, list) and len(pair) == 2 for pair in table):
        raise ExportError(where)
    names = [pair[0] for pair in table]
    if len(set(map(str, names))) != len(names):
        raise ExportError(f"{where}: a name listed twice")
    return [tuple(pair) for pair in table]


def decode_tree(
    entries: Any, tensors: Mapping[str, torch.Tensor]
) -> tuple[nn.Module, dict[str, nn.Module], dict[str, nn.Module]]:
    """``(root, {path: module}, {outside path: module})`` rebuilt from :func:`encode_tree`'s JSON,
    without running any constructor: ``cls.__new__`` + ``nn.Module.__init__`` + attributes."""
    from dpcompile.export.common import ExportError

    if not isinstance(entries, list) or not entries:
        raise ExportError("program.json: no module tree")
    modules: dict[str, nn.Module] = {}
    outside: dict[str, nn.Module] = {}
    pending_children: list[tuple[nn.Module, str, list]] = []
    after: list[tuple[nn.Module, Callable[[nn.Module], None]]] = []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise ExportError(f"program.json: a module entry it cannot read: {entry!r:.80}")
        path = entry["path"]
        if path in modules or (path and not safe_attribute(path)):
            raise ExportError(f"program.json: module path {path!r:.60}")
        if "alias" in entry:
            if set(entry) != {"path", "alias"} or entry["alias"] not in modules:
                raise ExportError(f"program.json: module {path!r} aliases an unknown module")
            modules[path] = modules[entry["alias"]]
            continue
        known = {"path", "training", "class", "attrs", "parameters", "buffers", "non_persistent", "children", "outside"}
        if not set(entry) <= known or not {"class", "parameters", "buffers", "children"} <= set(entry):
            raise ExportError(f"program.json: module {path!r} has fields {sorted(entry)}")
        name = entry["class"]
        if name is None or name == "plain":
            module = nn.Module()
        else:
            try:
                cls = resolve_class(name)
            except NotAllowed as e:
                raise ExportError(f"program.json: module {path!r}: {e}") from None
            module = cls.__new__(cls)
            nn.Module.__init__(module)
            skip, post = _rebuilt_attrs(cls)
            attrs = entry.get("attrs", {})
            if not isinstance(attrs, dict):
                raise ExportError(f"program.json: module {path!r} attributes")
            for key, value in attrs.items():
                if not safe_attribute(key) or "." in key or key in _MODULE_INTERNALS or key in skip or key == "training":
                    raise ExportError(f"program.json: module {path!r} attribute {key!r:.40}")
                held = getattr(cls, key, None)
                if callable(held) or isinstance(held, property):
                    raise ExportError(f"program.json: module {path!r} would shadow {cls.__name__}.{key}")
                module.__dict__[key] = decode_value(value, None, tensors)
            if post is not None:
                after.append((module, post))
        module.training = bool(entry.get("training", True))
        for field, store in (("parameters", module._parameters), ("buffers", module._buffers)):
            for key, tensor_key in _named_tensor_keys(entry[field], f"program.json: module {path!r} {field}"):
                if not isinstance(key, str) or not key.isidentifier():
                    raise ExportError(f"program.json: module {path!r} {field[:-1]} {key!r:.40}")
                if tensor_key is None:
                    store[key] = None
                    continue
                if tensor_key not in tensors:
                    raise ExportError(f"program.json: module {path!r} refers to tensor {tensor_key!r:.60}, which weights lack")
                value = tensors[tensor_key]
                if (field == "parameters") != isinstance(value, nn.Parameter):
                    raise ExportError(f"program.json: tensor {tensor_key!r} is not a {field[:-1]}")
                store[key] = value
        module._non_persistent_buffers_set = set(entry.get("non_persistent", []))
        children = entry["children"]
        if not isinstance(children, list):
            raise ExportError(f"program.json: module {path!r} children")
        pending_children.append((module, path, children))
        if entry.get("outside"):
            if path == "" or "." in path:
                raise ExportError(f"program.json: outside module {path!r}")
            outside[path] = module
        modules[path] = module
    for module, path, children in pending_children:
        for child in children:
            if not safe_name_part(child):
                raise ExportError(f"program.json: module {path!r} child {child!r:.40}")
            full = f"{path}.{child}" if path else child
            if full not in modules:
                raise ExportError(f"program.json: module {full!r} is listed but not described")
            module._modules[child] = modules[full]
    for module, post in after:
        post(module)
    if "" not in modules:
        raise ExportError("program.json: the module tree has no root")
    return modules[""], modules, outside
