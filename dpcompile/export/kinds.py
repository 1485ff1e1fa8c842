"""What each value of a loaded program is, known before anything runs, and what may be done with it.

A value is a module of the tree (``self.encoder``), the replicas ``replicate`` makes, one
replica, or a plain value (a tensor, a number, a tuple of them). Calls that name an
attribute are checked against the kind of the value they name it on:

* ``call_method``: on a plain value, a Tensor method of the vocabulary
  (:data:`~dpcompile.export.vocabulary.TENSOR_METHODS`); on a replica or a module, a module of
  the tree below it whose class can run (``replica_dev0.encoder.fc(x)``); nothing else. A
  method name is never looked up in the module tree for a value, so a tree holding empty
  modules named ``numpy`` and ``tofile`` makes ``x.numpy().tofile(path)`` no more callable.
* ``getattr``: of a module or replica, a child module, a parameter or buffer, or ``training``;
  of a plain value, a data attribute of
  :data:`~dpcompile.export.vocabulary.GETATTR_NAMES` or a registered output type's field,
  never a method (a bound method in hand is a call the vocabulary does not list).
* a module is handed only to the runtime functions made for one (``replicate``,
  ``batch_norm``, ``expect_mode``, ...), as their first argument; a replica to none; never to
  torch or Python functions; and no program returns one. ``builtins`` take no keywords
  (``max(xs, key=f)`` calls ``f``).
* an op passed as a value (``{"op": "aten::slice.Tensor"}``, resolved in the vocabulary) goes only
  to ``written``, which applies it: its view steps ``[(op, args), ...]`` and its write op are
  vocabulary ATen ops or Tensor methods by name (``"copy_"``, ``"__setitem__"``); no other
  function is handed an op.

>>> tree = TreeIndex([{"path": "", "class": None, "parameters": {}, "buffers": {}, "children": ["fc"]},
...                   {"path": "fc", "class": "torch.nn.modules.linear.Linear", "parameters": {"weight": "fc.weight"},
...                    "buffers": {}, "children": []}])
>>> tree.is_module("fc"), tree.is_tensor("fc.weight"), tree.runnable("")
(True, True, False)
"""

from __future__ import annotations

import builtins
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from dpcompile.export.allowlist import allowed_method, output_fields
from dpcompile.export.common import ExportError
from dpcompile.export.vocabulary import GETATTR_NAMES, TENSOR_METHODS
from dpcompile.fx_utils import unalias

__all__ = ["Kind", "TreeIndex", "check_graph"]

_RUNTIME = "dpcompile.runtime"


class TreeIndex:
    """The module tree of ``program.json`` as paths: which are modules, which are tensors, which
    modules can run (a class, not a plain container). Read from the JSON, before anything is built."""

    def __init__(self, entries: Any) -> None:
        self.classes: dict[str, Any] = {}
        self.tensors: set[str] = set()
        entries = entries if isinstance(entries, list) else []
        by_path = {e["path"]: e for e in entries if isinstance(e, dict) and isinstance(e.get("path"), str)}
        for path, entry in by_path.items():
            seen = set()
            while "alias" in entry and entry["alias"] in by_path and entry["alias"] not in seen:
                seen.add(entry["alias"])
                entry = by_path[entry["alias"]]
            self.classes[path] = entry.get("class", "plain")
            for table in ("parameters", "buffers"):
                names = entry.get(table)
                if isinstance(names, list):  # [[name, tensor key], ...]; a dict in older folders
                    names = [pair[0] for pair in names if isinstance(pair, list) and pair]
                if isinstance(names, (dict, list)):
                    self.tensors.update(f"{path}.{n}" if path else str(n) for n in names)

    def is_module(self, path: str) -> bool:
        return path in self.classes

    def is_tensor(self, path: str) -> bool:
        return path in self.tensors

    def runnable(self, path: str) -> bool:
        """A module a program may call: it has a class (not the root, not a plain container)."""
        return self.classes.get(path) not in (None, "plain")


@dataclass(frozen=True)
class Kind:
    """``what``: "value" (``path``: a tensor of the tree, or none), "module" (``path``), "replicas" or
    "replica" (``members``: name -> path)."""

    what: str
    path: str = ""
    members: Mapping[str, str] = field(default_factory=dict)


VALUE = Kind("value")


# the runtime functions that take a module (first) or, ``replicate``, a table of them
_TAKE_A_MODULE = frozenset(
    {"replicate", "batch_norm", "flatten_parameters", "weights_in_one_buffer", "module_of", "expect_mode", "mode_value",
     "exact_dropout_module", "exact_special_dropout_module"}
)


# the runtime functions handed an op to apply: ``written(base, [(op, args), ...], op, *args)``
_APPLY_AN_OP = frozenset({"written"})
# the Tensor methods ``written`` applies by name beyond TENSOR_METHODS: indexing a view, writing into it
_INDEXING = frozenset({"__getitem__", "__setitem__"})


def _ops_in(value: Any) -> list[Any]:
    """The op objects (not nodes, not strings) among ``value``'s nested tuples, lists and dicts."""
    if isinstance(value, torch._ops.OpOverload):
        return [value]
    if isinstance(value, (tuple, list)):
        return [op for v in value for op in _ops_in(v)]
    if isinstance(value, dict):
        return [op for v in value.values() for op in _ops_in(v)]
    return []


def _fields(node: fx.Node) -> tuple[str, ...]:
    """The fields of the output record ``node`` makes (``model_output(name, fields, ...)``), if it makes one."""
    made = node.op == "call_function" and getattr(node.target, "__name__", "") == "model_output"
    fields = node.args[1] if made and len(node.args) > 1 else ()
    return fields if isinstance(fields, tuple) and all(isinstance(f, str) for f in fields) else ()


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _nodes_in(value: Any) -> Iterable[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(value, out.append)
    return out


class _Checker:
    def __init__(self, tree: TreeIndex) -> None:
        self.tree = tree
        self.kinds: dict[fx.Node, Kind] = {}

    def refuse(self, node: fx.Node, what: str) -> ExportError:
        return ExportError(f"program.json: node {node.name!r} {what}")

    def kind(self, node: fx.Node) -> Kind:
        if node.op == "placeholder" or node.op == "output":
            return VALUE
        if node.op == "get_attr":
            return self.attribute(node, unalias(node.target))
        if node.op == "call_module":
            path = unalias(node.target)
            if not self.tree.runnable(path):
                raise self.refuse(node, f"calls module {path!r:.60}, which the tree does not hold as a class that runs")
            self.only_values(node)
            return VALUE
        if node.op == "call_method":
            return self.method(node)
        self.ops_only_where_applied(node)
        return self.function(node)

    def ops_only_where_applied(self, node: fx.Node) -> None:
        """An op among the arguments only of ``written``, in its places; a method named there a Tensor method."""
        applies = getattr(node.target, "__name__", "") in _APPLY_AN_OP and (
            getattr(node.target, "__module__", "") or ""
        ).startswith(_RUNTIME)
        if not applies:
            if _ops_in((node.args, node.kwargs)):
                raise self.refuse(node, f"hands an op to {node.target!r:.60}, which does not apply one")
            return
        steps = node.args[1] if len(node.args) > 2 else None
        if not isinstance(steps, (list, tuple)) or not all(isinstance(s, tuple) and len(s) == 2 for s in steps):
            raise self.refuse(node, "calls written without a list of (op, arguments) steps")
        for op in [*(s[0] for s in steps), node.args[2]]:
            if not (isinstance(op, torch._ops.OpOverload) or isinstance(op, str) and op in TENSOR_METHODS | _INDEXING):
                raise self.refuse(node, f"has written apply {op!r:.60}, which is neither an ATen op nor a Tensor method")
        if _ops_in((node.args[0], [s[1] for s in steps], node.args[3:], node.kwargs)):
            raise self.refuse(node, "hands written an op outside its steps and write op")

    def attribute(self, node: fx.Node, path: str) -> Kind:
        if self.tree.is_module(path):
            return Kind("module", path)
        if self.tree.is_tensor(path):
            return Kind("value", path)  # the path: a tensor replicate hands to each replica by name
        raise self.refuse(node, f"reads {path!r:.60}, which is neither a module nor a tensor of the tree")

    def receiver(self, node: fx.Node) -> Kind:
        if not node.args or not isinstance(node.args[0], fx.Node):
            raise self.refuse(node, "names an attribute of something that is not a value of the program")
        return self.kinds[node.args[0]]

    def member_path(self, node: fx.Node, kind: Kind, name: str) -> str | None:
        """The tree path ``name`` names below a module or replica (None: not one)."""
        if kind.what == "module":
            return _join(kind.path, name)
        if kind.what == "replica":
            first, _, rest = name.partition(".")
            base = kind.members.get(first)
            return None if base is None else _join(base, rest) if rest else base
        return None

    def method(self, node: fx.Node) -> Kind:
        receiver, name = self.receiver(node), node.target
        if receiver.what in ("module", "replica"):
            path = self.member_path(node, receiver, unalias(name)) if isinstance(name, str) else None
            if path is None or not self.tree.runnable(path):
                raise self.refuse(
                    node, f"calls {name!r:.60} on a {receiver.what}, which is not a module of the tree that runs"
                )
            self.only_values(node, skip_first=True)
            return VALUE
        if receiver.what != "value" or not allowed_method(name):
            raise self.refuse(node, f"calls method {name!r:.60} on a {receiver.what}, which is not a Tensor method")
        self.only_values(node, skip_first=True)
        return VALUE

    def function(self, node: fx.Node) -> Kind:
        target = node.target
        if target is builtins.getattr:
            if len(node.args) != 2 or node.kwargs or not isinstance(node.args[1], str):
                raise self.refuse(node, "calls getattr with other than a value and a name")
            receiver, name = self.receiver(node), unalias(node.args[1])
            if receiver.what in ("module", "replica"):
                path = self.member_path(node, receiver, name) if "." not in name else None
                if name == "training":
                    return VALUE
                if path is not None and (self.tree.is_module(path) or self.tree.is_tensor(path)):
                    return Kind("module", path) if self.tree.is_module(path) else VALUE
            elif receiver.what == "value" and (
                name in GETATTR_NAMES or name in output_fields() or name in _fields(node.args[0])
            ):
                return VALUE
            raise self.refuse(node, f"reads attribute {name!r:.40} of a {receiver.what}")
        if target is operator.getitem and node.args and isinstance(node.args[0], fx.Node):
            receiver = self.kinds[node.args[0]]
            if receiver.what == "replicas" and type(node.args[1]) is int and not node.kwargs:
                return Kind("replica", members=receiver.members)
            if receiver.what != "value":
                raise self.refuse(node, f"indexes a {receiver.what}")
            self.only_values(node)
            return VALUE
        module_name = getattr(target, "__module__", "") or ""
        if module_name.startswith(_RUNTIME):
            return self.runtime(node)
        if module_name == "builtins" and node.kwargs:
            raise self.refuse(node, f"passes keywords {sorted(node.kwargs)} to a builtin (max(xs, key=f) calls f)")
        self.only_values(node)
        return VALUE

    def runtime(self, node: fx.Node) -> Kind:
        name = getattr(node.target, "__name__", "")
        args = [self.kinds[n] for n in _nodes_in((node.args, node.kwargs))]
        if any(k.what in ("replicas", "replica") for k in args):
            raise self.refuse(node, "hands replicas to a function")
        if name not in _TAKE_A_MODULE:
            self.only_values(node)
        elif name != "replicate":  # the module comes first, values after it
            self.only_values(node, skip_first=True)
            if not node.args or not isinstance(node.args[0], fx.Node) or self.kinds[node.args[0]].what != "module":
                raise self.refuse(node, f"hands {name} something that is not a module of the tree")
        if name == "replicate":
            modules = node.args[0] if node.args else None
            if not isinstance(modules, dict) or not all(
                isinstance(k, str) and isinstance(v, fx.Node) for k, v in modules.items()
            ):
                raise self.refuse(node, "replicates something that is not a table of modules")
            members = {}
            for key, value in modules.items():
                kind = self.kinds[value]
                if kind.what in ("module", "value") and kind.path:
                    members[key] = members[unalias(key)] = kind.path  # generated code names `devices` `user:devices`
            return Kind("replicas", members=members)
        if name == "module_of":
            return self.kinds[node.args[0]]
        return VALUE

    def only_values(self, node: fx.Node, skip_first: bool = False) -> None:
        args = node.args[1:] if skip_first else node.args
        for n in _nodes_in((args, node.kwargs)):
            if self.kinds[n].what != "value":
                raise self.refuse(
                    node, f"hands the {self.kinds[n].what} {n.name!r} to {node.target!r:.60}, which only takes values"
                )


def check_graph(graph: fx.Graph, tree: TreeIndex) -> Mapping[fx.Node, Kind]:
    """Raise :class:`ExportError` where ``graph`` calls a method, reads an attribute or hands a
    module to a function other than its kind allows (see the module docstring); return each
    node's kind."""
    checker = _Checker(tree)
    for node in graph.nodes:
        checker.kinds[node] = checker.kind(node)
    output = next((n for n in graph.nodes if n.op == "output"), None)
    if output is not None:
        for n in _nodes_in(output.args):
            if checker.kinds[n].what != "value":
                raise ExportError(f"program.json: the program returns the {checker.kinds[n].what} {n.name!r}")
    return checker.kinds
