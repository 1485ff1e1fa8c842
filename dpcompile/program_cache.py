"""One cache of programs per ``ParallelModule``, keyed by everything a call can depart on.

A program is specialised on what forward read as Python while it was traced: the modules'
modes (``self.training``), optional arguments left None (``if mask is not None``), flag
arguments (``if return_hidden:``), hooks on the modules forward entered, the model's
submodules and parameters, and the plain attributes forward reads (``self.use_residual``).
A call computes its :class:`CallKey`; the cache answers with the program traced for it
(built on first use, as ``torch.compile`` recompiles on a failed guard), never the old one.

    key = cache.key_for(args, kwargs, devices=n)     # cheap: dict versions, no walk
    program = cache.program(key, args, kwargs)       # None: the main program serves it

The expensive part of a key, the :class:`ModelGuard` fingerprint, is recomputed only when
the version of one of the watched dicts (a module's ``__dict__``, ``_modules``,
``_parameters``, hook dicts) has changed since the last call.
"""

from __future__ import annotations

import enum
import functools
import inspect
import logging
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch import nn
from torch.nn.modules import module as nn_module

from dpcompile.capture.leaf_modes import called_modes_read
from dpcompile.capture.state import installed_by_forward, not_a_change

try:  # CPython's dict version tag, as torch.compile's guards read it
    from torch._C._dynamo.guards import dict_version
except ImportError:  # pragma: no cover - a torch without dynamo's C guards
    dict_version = None

log = logging.getLogger("dpcompile")

PLAIN_TYPES = (bool, int, float, str, type(None), enum.Enum, torch.dtype, torch.device)
# values forward may call or pass along whose identity tracing baked in (``self.act = F.gelu``)
_CALLABLE_TYPES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial, type)
_UNWATCHED = object()
_MAX_ITEMS = 64  # a longer list or dict is data, not configuration: not watched

# hooks of every module, registered with torch.nn.modules.module.register_module_*_hook
_GLOBAL_HOOK_DICTS = tuple(
    getattr(nn_module, name)
    for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_with_kwargs",
        "_global_backward_hooks", "_global_backward_pre_hooks",
    )
    if isinstance(getattr(nn_module, name, None), dict)
)  # fmt: skip
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_BACKWARD_HOOK_DICTS = ("_backward_hooks", "_backward_pre_hooks")
# containers forward indexes but never calls (``for layer in self.layers``): their modules are
# entered at every depth (``encoder.layer.3.attention``), though tracing takes the list for a leaf
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def frozen(value: Any, depth: int = 0) -> Any:
    """``value`` as a hashable description of what tracing read of it: plain values and small
    tuples, lists and dicts of them by value, functions by identity; :data:`_UNWATCHED` otherwise."""
    if isinstance(value, PLAIN_TYPES):
        return value
    if isinstance(value, _CALLABLE_TYPES):
        return ("callable", id(value))
    if depth > 3:
        return _UNWATCHED
    if isinstance(value, (tuple, list)) and len(value) <= _MAX_ITEMS:
        items: tuple = tuple(frozen(v, depth + 1) for v in value)
        parts = items
    elif isinstance(value, dict) and len(value) <= _MAX_ITEMS:
        items = tuple((frozen(k, depth + 1), frozen(v, depth + 1)) for k, v in value.items())
        parts = tuple(x for pair in items for x in pair)
    else:
        return _UNWATCHED
    return _UNWATCHED if any(x is _UNWATCHED for x in parts) else (type(value).__name__, items)


class Modes(tuple):
    """``((path, training), ...)``: a tuple that hashes once (a call in eval mode looks its
    program up by it every time)."""

    def __hash__(self) -> int:
        cached = self.__dict__.get("hash")
        if cached is None:
            cached = self.__dict__["hash"] = tuple.__hash__(self)
        return cached

    def __reduce__(self):
        return (Modes, (tuple(self),))


class CallKey(NamedTuple):
    """Everything a call's program depends on beyond the tensors' values.

    ``devices``: how many devices it runs on (a batch smaller than the device count uses
    fewer); ``modes``: the training flag of each module forward enters, by path;
    ``none_args``/``flags``: optional arguments left None and flag values; ``guard``: the
    hooks, structure and attributes fingerprint (not portable across processes); ``batched``:
    inputs replicated in the examples (a mask without a batch dim) that this call gives the batch;
    ``unbatched``: inputs split by default that this call gives without the batch dim (a 0-dim
    temperature beside a batch), replicated.
    """

    devices: int
    modes: tuple[tuple[str, bool], ...]
    none_args: frozenset[str] = frozenset()
    flags: tuple[tuple[str, Any], ...] = ()
    guard: int | None = None
    batched: frozenset[str] = frozenset()
    unbatched: frozenset[str] = frozenset()

    def portable(self) -> CallKey:
        """The key without object identities: what a pickled program can be looked up by."""
        return CallKey(self.devices, Modes(self.modes), self.none_args, self.flags, None, self.batched, self.unbatched)

    def traced(self) -> CallKey:
        """The key of the trace this call's program is lowered from (any device count, any inputs batched)."""
        return CallKey(0, self.modes, self.none_args, self.flags, self.guard)

    def describe(self) -> str:
        training = {mode for _, mode in self.modes}
        mode = "training" if training == {True} else "eval" if training == {False} else "mixed-mode" if training else "any"
        parts = [f"{mode} mode", f"{self.devices} device(s)"]
        if self.none_args:
            parts.append(f"{', '.join(sorted(self.none_args))} left None")
        if self.flags:
            parts.append(", ".join(f"{name}={value!r}" for name, value in self.flags))
        if self.batched:
            parts.append(f"{', '.join(sorted(self.batched))} with the batch")
        if self.unbatched:
            parts.append(f"{', '.join(sorted(self.unbatched))} without the batch")
        return "; ".join(parts)


@dataclass(frozen=True)
class CallSignature:
    """Where a program's optional arguments (default None) and flag arguments sit.

    >>> sig = CallSignature(optional=((1, "mask"),), flags=((2, "return_hidden", False),))
    >>> sig.departures((x, None), {"return_hidden": True})  # doctest: +SKIP
    (frozenset({'mask'}), (('return_hidden', True),))
    """

    optional: tuple[tuple[int, str], ...] = ()
    flags: tuple[tuple[int, str, Any], ...] = ()
    # data parallel: inputs replicated in the examples, ``(position, name, dim, size, rank)``: a call whose
    # tensor there has another size on ``dim`` (the batch dim it would split on), or more dims, departs
    replicated: tuple[tuple[int, str, int, int, int], ...] = ()

    @classmethod
    def of(cls, graph: fx.Graph, flag_names: Sequence[str] = ()) -> CallSignature:
        inputs = [n for n in graph.nodes if n.op == "placeholder"]
        optional = tuple((i, str(n.target)) for i, n in enumerate(inputs) if n.args and n.args[0] is None)
        flags = tuple(
            (i, str(n.target), n.args[0] if n.args else None) for i, n in enumerate(inputs) if n.target in flag_names
        )
        return cls(optional, flags)

    def departures(self, args: tuple, kwargs: dict) -> tuple[frozenset[str], tuple[tuple[str, Any], ...]]:
        nones = frozenset(
            name for position, name in self.optional
            if (args[position] if position < len(args) else kwargs.get(name)) is None
        )  # fmt: skip
        flags = tuple(
            (name, args[position] if position < len(args) else kwargs.get(name, default))
            for position, name, default in self.flags
        )
        return nones, flags

    def batched(self, args: tuple, kwargs: dict, batch_size: Callable[[tuple, dict], int | None]) -> frozenset[str]:
        """The replicated inputs this call gives the batch (their size on ``dim`` is the call's
        batch size); :class:`~dpcompile.errors.DpCompileError` for one of another size."""
        out = []
        for position, name, dim, size, rank in self.replicated:
            value = args[position] if position < len(args) else kwargs.get(name)
            if not isinstance(value, torch.Tensor) or value.dim() < rank or (value.dim() == rank and value.shape[dim] == size):
                continue  # as in the example, or fewer dims (it broadcasts, as eager's does)
            batch = batch_size(args, kwargs)
            if value.shape[dim] != batch:
                from dpcompile.errors import DpCompileError

                raise DpCompileError(
                    f"argument '{name}' has shape {tuple(value.shape)}, but the example gave it {rank} dims and size "
                    f"{size} on dim {dim}, so the program replicates it (every device reads all of it); this call's batch is "
                    f"{batch}, so dim {dim} of '{name}' is neither the example's size nor the batch. Pass "
                    f"'{name}' as in the example, or with the batch on dim {dim}; or call dpcompile.transform with "
                    f"example_inputs= that give '{name}' the batch dim"
                )
            out.append(name)
        return frozenset(out)


def _code_names(cls: type, _cache: dict[type, frozenset[str]] = {}) -> frozenset[str]:  # noqa: B006 - a memo
    """Attribute names the methods of ``cls`` (and its bases below nn.Module) read, but ``__init__``:
    behind decorators (``functools.wraps``), and in the functions of their own module they call
    (transformers' ``eager_attention_forward(self, ...)`` reads ``module.scaling``)."""
    if cls not in _cache:
        names: set[str] = set()
        seen: set[types.CodeType] = set()

        def visit(code: types.CodeType, namespace: dict, depth: int) -> None:
            if code in seen:
                return
            seen.add(code)
            names.update(code.co_names)
            for const in code.co_consts:
                if isinstance(const, types.CodeType):
                    visit(const, namespace, depth)
            if depth < 2:
                for name in code.co_names:
                    called = namespace.get(name)
                    if isinstance(called, types.FunctionType) and called.__module__ == namespace.get("__name__"):
                        visit(called.__code__, namespace, depth + 1)

        for klass in cls.__mro__:
            if klass in (nn.Module, object) or klass.__module__.startswith("torch.nn"):
                continue
            for name, value in vars(klass).items():
                if name == "__init__":  # sets attributes; only what the other methods read matters
                    continue
                func = getattr(value, "__func__", value)
                if callable(func) and hasattr(func, "__wrapped__"):
                    try:
                        func = inspect.unwrap(func)
                    except ValueError:
                        pass
                code = getattr(func, "__code__", None)
                if isinstance(code, types.CodeType):
                    visit(code, getattr(func, "__globals__", {}), 0)
        _cache[cls] = frozenset(names)
    return _cache[cls]


def _hook_ids(dicts: Iterable[dict]) -> tuple[int, ...]:
    """The hooks of ``dicts`` by identity, but those forward registers itself (transformers 5's
    output recorders, installed at the first call): their presence changes nothing traced."""
    return tuple(id(h) for d in dicts for h in d.values() if not installed_by_forward(h))


code_names = _code_names  # the attribute names a class's code reads (capture keeps writes of those)


class ModelGuard:
    """Watches the modules a model's forward was traced through.

    ``fingerprint()`` describes what tracing baked into the program: each entered module's
    hooks, its children and parameters (by identity) and the attributes its code mentions
    (``self.use_residual``, ``self.scales = [1.0, 2.0]``, ``self.act = F.gelu``, a ``forward``
    set on the instance), and those attributes of its leaf children (``self.norm.eps``);
    ``modes()`` their training flags. Leaf modules (RNNs, ``leaf_modules=``, torch.nn layers) run
    as calls, so their hooks and modes apply at run time and are not watched; swapping one is
    (it is a child of an entered module). A list or dict attribute is compared by value at
    every call, as changing it in place leaves every dict version as it was.
    """

    def __init__(
        self,
        model: nn.Module,
        is_leaf: Callable[[nn.Module, str], bool],
        *,
        paths: Sequence[str] | None = None,
        root_class: type | None = None,
    ):
        """``paths``: watch these modules of ``model`` (a restored program's, whose modules are
        plain stand-ins) instead of the ones tracing would enter; ``root_class``: the class whose
        code forward ran at the root, where ``model`` is a program standing in for the model."""
        self.model = model
        self.root_class = root_class
        self.is_leaf = is_leaf
        self._paths = None if paths is None else tuple(paths)
        self._tokens: dict[tuple, int] = {}
        self._refresh()

    def _entered(self) -> Iterator[tuple[str, nn.Module]]:
        if self._paths is not None:
            modules = dict(self.model.named_modules())
            yield from ((path, modules[path]) for path in self._paths if path in modules)
            return
        stack = [("", self.model)]
        while stack:
            path, module = stack.pop()
            yield path, module
            for name, child in reversed(module._modules.items()):
                child_path = f"{path}.{name}" if path else name
                if child is not None and (type(child) in _CONTAINERS or not self.is_leaf(child, child_path)):
                    stack.append((child_path, child))

    def _refresh(self) -> None:
        self.entered = list(self._entered())
        entered_ids = {id(m) for _, m in self.entered}
        self._leaf_children = [
            (f"{path}.{name}" if path else name, c)
            for path, m in self.entered for name, c in m._modules.items() if c is not None and id(c) not in entered_ids
        ]  # fmt: skip
        self._dicts = [*_GLOBAL_HOOK_DICTS, *(c.__dict__ for _, c in self._leaf_children)]
        for _, m in self.entered:
            self._dicts += [m.__dict__, m._modules, m._parameters, m._buffers, *(getattr(m, h) for h in _HOOK_DICTS)]
        self._mutables: list[tuple[Any, Any]] = []
        self._versions = self._read_versions()
        # modules forward enters (not the model itself) with backward hooks, or all of them under a
        # global backward hook: tracing cannot record those, so a call refuses to run without them
        everywhere = any(getattr(nn_module, h, None) for h in ("_global_backward_hooks", "_global_backward_pre_hooks"))
        self.hooks = tuple((path, _hook_ids(getattr(m, d) for d in _HOOK_DICTS)) for path, m in self.entered if path)
        self.backward_hooked = [
            path for path, m in self.entered if path and (everywhere or any(getattr(m, h) for h in _BACKWARD_HOOK_DICTS))
        ]
        # and the called modules whose mode forward read (``self.emb.training``): tracing kept the value read
        called = [(p, m) for p, m in ((p, _module_at(self.model, p)) for p in called_modes_read(self.model)) if m is not None]
        self._modes = Modes([*((path, m.training) for path, m in self.entered), *((p, m.training) for p, m in called)])
        # what the program is specialised on, as a small token: equal fingerprints, equal tokens
        self.description = self._compute_fingerprint()
        self._fingerprint = self._tokens.setdefault(self.description, len(self._tokens))

    def read_afresh(self) -> None:
        """Describe the model as it is now, whatever the watched dicts' versions say."""
        self._refresh()

    def watched_modules(self) -> list[tuple[str, nn.Module]]:
        """The modules entered, then their leaf children, by path."""
        self._current()
        return [*self.entered, *self._leaf_children]

    def _read_versions(self) -> tuple[int, ...] | None:
        return None if dict_version is None else tuple(map(dict_version, self._dicts))

    def _attributes(self, module: nn.Module, names: frozenset[str]) -> tuple:
        out = []
        written = not_a_change(module)  # forward writes them before they matter
        for name, value in module.__dict__.items():
            if (written and name in written) or name in _MODULE_STATE:
                continue
            if name in names and not (type(value) is dict and not value):  # an empty dict: a cache (timm's attention biases)
                description = frozen(value)
                if description is not _UNWATCHED:
                    out.append((name, description))
                    if isinstance(value, (list, dict)):
                        self._mutables.append((value, description))
        return tuple(out)

    def _compute_fingerprint(self) -> tuple:
        out: list[Any] = [_hook_ids(_GLOBAL_HOOK_DICTS)]
        # a module's attribute may be read by its own code or by a parent's (``self.block.enabled``)
        classes = {type(m) for _, m in self.entered if not isinstance(m, fx.GraphModule)}
        readers = classes | ({self.root_class} if self.root_class not in (None, type(None)) else set())
        read_anywhere = frozenset().union(*map(_code_names, readers)) - {"training"} | {"forward"}  # modes: keyed apart
        read_of_leaves = read_anywhere - {"forward"}
        attributes = [(path, self._attributes(m, read_anywhere)) for path, m in self.entered if type(m) in classes]
        attributes += [(path, self._attributes(c, read_of_leaves)) for path, c in self._leaf_children]
        self.attributes = tuple(attributes)
        for path, m in self.entered:
            if isinstance(m, fx.GraphModule):  # a program (tensor parallel): its code is its graph
                continue
            hooks = _hook_ids(getattr(m, name) for name in _HOOK_DICTS if path)
            children = tuple((name, id(c)) for name, c in m._modules.items())
            tensors = tuple((name, id(t)) for d in (m._parameters, m._buffers) for name, t in d.items())
            out.append((path, type(m), hooks, children, tensors))
        out.append(self.attributes)
        return tuple(out)

    def _current(self) -> None:
        versions = self._read_versions()
        if versions is None or versions != self._versions:
            self._refresh()
        elif self._mutables and any(frozen(value) != seen for value, seen in self._mutables):
            self._refresh()  # a list or dict attribute changed in place

    def versions_read(self) -> tuple[int, ...] | None:
        """The versions of the watched dicts as last read (None without CPython's version tags)."""
        return self._versions

    def unchanged_since(self, versions: tuple[int, ...] | None) -> bool:
        """Whether nothing watched changed since ``versions`` were read: this guard has not been
        refreshed since, every watched dict is at its version and watched lists and dicts are equal
        (the same answer :meth:`state` would give, without refreshing)."""
        if versions is None or versions is not self._versions or self._read_versions() != versions:
            return False
        return not self._mutables or all(frozen(value) == seen for value, seen in self._mutables)

    def modes(self) -> tuple[tuple[str, bool], ...]:
        self._current()
        return self._modes

    def state(self) -> tuple[Modes, int]:
        """``(modes(), fingerprint())`` in one check of the watched dicts."""
        self._current()
        return self._modes, self._fingerprint

    def fingerprint(self) -> int:
        """A token of the hooks, structure and attributes: the same token, the same program."""
        self._current()
        return self._fingerprint

    def root_hooks(self) -> bool:
        """Whether the model itself has forward or backward hooks (tracing forward never runs them)."""
        m = self.model
        return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def describe_changes(before: tuple, now: tuple) -> list[str]:
    """What departs between two :attr:`ModelGuard.description` s, in words, one change per path."""
    changes: dict[str, str] = {}
    if before[0] != now[0]:
        changes[""] = "a global module hook (torch.nn.modules.module.register_module_*_hook)"
    old = {entry[0]: entry for entry in before[1:-1]}
    new = {entry[0]: entry for entry in now[1:-1]}
    for path in sorted(old.keys() | new.keys()):
        where = repr(path) if path else "the model"
        if path not in new or path not in old:
            changes.setdefault(path, f"submodule {where} {'removed' if path not in new else 'added'}")
        elif old[path][1] is not new[path][1]:
            changes.setdefault(path, f"submodule {where} replaced ({old[path][1].__name__} -> {new[path][1].__name__})")
        else:
            _, _, hooks, children, tensors = old[path]
            if hooks != new[path][2]:
                changes.setdefault(path, f"a forward or backward hook added to or removed from {where}")
            for label, seen, now_seen in (("submodule", children, new[path][3]), ("parameter or buffer", tensors, new[path][4])):
                for name in sorted({n for n, _ in set(seen) ^ set(now_seen)}):
                    full = f"{path}.{name}" if path else name
                    changes.setdefault(full, f"{label} {full!r} replaced, added or removed")
    attrs_before = {(p, n): v for p, pairs in before[-1] for n, v in pairs}
    attrs_now = {(p, n): v for p, pairs in now[-1] for n, v in pairs}
    for p, n in sorted(attrs_before.keys() | attrs_now.keys()):
        if attrs_before.get((p, n)) != attrs_now.get((p, n)):
            full = f"{p}.{n}" if p else n
            changes.setdefault(full, f"attribute {full!r} (forward reads it) changed")
    return list(changes.values())


def _module_at(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


#: nn.Module's own dicts: watched as the parameters, buffers and submodules they hold, not as attributes
#: (FSDP's parametrization moves a weight out of ``_parameters``; code that reads the dict is no reader)
_MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules"})


class ProgramCache:
    """Programs by :class:`CallKey`; ``build(key, args, kwargs)`` makes a missing one.

    ``build`` returns a program, or None where the main program serves the key (forward
    took the same path). More than ``limit`` programs warn once, as ``torch.compile``'s
    recompile limit does; the least recently used are dropped beyond it.
    """

    def __init__(self, main_key: CallKey, build: Callable[[CallKey, tuple, dict], fx.GraphModule | None], limit: int = 16):
        self.main_key = main_key
        self.build = build
        self.limit = limit
        self._programs: OrderedDict[CallKey, fx.GraphModule | None] = OrderedDict()
        self.traces: dict[Any, Any] = {}  # the builder's memo of traces (a key without its device count)
        self.last: Any = None  # the module's shortcut for a call like the last (modules/last_call.py)
        self._warned = False

    def program(self, key: CallKey, args: tuple, kwargs: dict) -> fx.GraphModule | None:
        if key == self.main_key:
            return None
        try:
            self._programs.move_to_end(key)
            return self._programs[key]
        except KeyError:
            pass
        program = self.build(key, args, kwargs)
        self._programs[key] = program
        if len(self._programs) > self.limit:
            evicted, _ = self._programs.popitem(last=False)
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"dpcompile: more than {self.limit} programs were traced for calls that depart from the "
                    f"first one (e.g. {key.describe()}); the oldest are dropped and traced again when needed. "
                    "A flag argument with many values (an int step, a string) is better passed as a tensor.",
                    stacklevel=3,
                )
            log.debug("program cache full: dropped the program for %s", evicted.describe())
        return program

    def reset(self, main_key: CallKey, build: Callable[[CallKey, tuple, dict], fx.GraphModule | None]) -> None:
        """Start over with another main key and build function (a restored program)."""
        self.main_key = main_key
        self.build = build
        self.clear()

    def items(self) -> list[tuple[CallKey, fx.GraphModule | None]]:
        return list(self._programs.items())

    def clear(self) -> None:
        self.last = None
        self._programs.clear()
        self.traces.clear()

    def __len__(self) -> int:
        return len(self._programs)
