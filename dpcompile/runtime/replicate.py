"""Replicate modules onto other devices, as data parallelism needs.

A replica shares nothing mutable with its original: its parameters are the outputs of one
differentiable broadcast (so gradients flow back and are summed on the source device), its
buffers are copies. The copies persist between forwards (a :class:`ReplicaSet` per program
and set of devices) and are refreshed only where a source tensor changed, as an optimizer
step changes them; the module objects around them are made per forward, so mode flags and
attributes are always the original's. Each RNN's weights are copied into one contiguous
buffer per replica, laid out as cuDNN expects (matrices, then biases), so that the replica's ``flatten_parameters``
finds them flat and copies nothing.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.autograd import Function
from torch.nn.utils import parametrize

from dpcompile.runtime.comm import (
    Broadcast,
    DeviceLike,
    as_devices,
    copy_tensors_to_devices,
    sum_to_source,
    uniform_device,
)
from dpcompile.runtime.rnn import cudnn_order
from dpcompile.runtime.structures import is_fake

try:  # CPython's dict version tag, as torch.compile's guards read it
    from torch._C._dynamo.guards import dict_version
except ImportError:  # pragma: no cover - an older torch: views are made per forward
    dict_version = None


class ReplicaRoot(nn.Module):
    """The per-device stand-in for ``self`` in generated code: ``replica_dev1.fc1(x_dev1)``.

    Each of its modules is an attribute in its ``__dict__``, a module with children as a
    :class:`ModuleView`, so ``getattr(replica_dev1.layers, "0")`` is two dictionary lookups
    where ``getattr(self.layers, "0")`` calls ``nn.Module.__getattr__`` twice. Dotted names
    resolve as paths through the modules themselves (``getattr(root, "enc.fc1")``), as fx's
    ``Interpreter`` asks for them when it runs a ``call_method`` node such as
    ``replica_dev1.enc.fc1(x)``.
    """

    def __getattr__(self, name: str):
        if "." in name:
            first, *rest = name.split(".")
            value = getattr(self, first)  # a kept root holds its modules' views alone
            for atom in rest:
                value = getattr(value, atom)
            return value
        return super().__getattr__(name)


class ModuleView:
    """A module's children as plain attributes, for generated code to look up cheaply.

    ``view.fc1`` is the child itself (or, if the child has children of its own, its view);
    anything else (parameters, buffers, attributes, a call, indexing) is the module's own,
    so a view reads and calls exactly as the module does. Made per forward (a copy's children
    are the copies) or kept while the module's children stay the same (virtual devices).
    """

    __slots__ = ("__dict__", "_dpcompile_module")

    def __init__(self, module: nn.Module | weakref.ReferenceType, children: dict[str, object]):
        object.__setattr__(self, "_dpcompile_module", module)
        self.__dict__.update(children)

    def __getattr__(self, name: str):
        return getattr(module_of(self), name)

    def __call__(self, *args, **kwargs):
        return module_of(self)(*args, **kwargs)

    def __getitem__(self, index):
        return module_of(self)[index]

    def __iter__(self):
        return iter(module_of(self))

    def __len__(self) -> int:
        return len(module_of(self))

    def __repr__(self) -> str:
        return f"ModuleView({type(module_of(self)).__name__})"


def module_of(value):
    """The module a :class:`ModuleView` stands for; anything else as it is."""
    if type(value) is not ModuleView:
        return value
    module = value._dpcompile_module
    return module() if type(module) is weakref.ReferenceType else module  # a kept view holds it weakly


def _viewable(module: nn.Module) -> bool:
    """Whether ``module``'s children can be plain attributes of a view: none is missing or
    named like an attribute of the view itself."""
    return bool(module._modules) and all(
        child is not None and not hasattr(ModuleView, name) for name, child in module._modules.items()
    )


def view_of(module: nn.Module) -> nn.Module | ModuleView:
    """``module`` itself if it has no children, else a :class:`ModuleView` of it (and of
    each of its children that has children)."""
    if not _viewable(module):
        return module
    return ModuleView(module, {name: view_of(child) for name, child in module._modules.items()})


def holds_pieces_gathered_per_replica(module: nn.Module) -> bool:
    """Whether ``module`` holds the pieces of a parameter stored sharded (FSDP in one process:
    ``fc1.parametrizations.weight``, its ``original0..`` on each copy's device, read through a gather
    flagged ``gathers_on_each_replica``). Replicas broadcast none of them: each reads the pieces
    themselves, gathered onto its own device (FSDP's all-gather on every copy), and autograd of the
    gathers sums every copy's gradient into each piece (the reduce-scatter)."""
    return isinstance(module, parametrize.ParametrizationList) and all(
        getattr(p, "gathers_on_each_replica", False) for p in module
    )


def _collect(values: Mapping[str, nn.Module | torch.Tensor]) -> tuple[list[nn.Module], list[torch.Tensor]]:
    modules: dict[int, nn.Module] = {}
    tensors: dict[int, torch.Tensor] = {}
    for value in values.values():
        if isinstance(value, nn.Module):
            for m in value.modules():
                modules.setdefault(id(m), m)
                if holds_pieces_gathered_per_replica(m):
                    continue  # read in place by every replica (gathered onto its device), never copied
                for t in list(m._parameters.values()) + list(m._buffers.values()):
                    if t is not None:
                        tensors.setdefault(id(t), t)
        elif isinstance(value, torch.Tensor):
            tensors.setdefault(id(value), value)
    return list(modules.values()), list(tensors.values())


def replicate(
    modules: Mapping[str, nn.Module | torch.Tensor],
    devices: Sequence[DeviceLike],
    *,
    copy: bool = False,
    include_source: bool = False,
) -> tuple[ReplicaRoot, ...]:
    """One :class:`ReplicaRoot` per device holding replicas of ``modules`` (names kept).

    On a device that already holds the tensors (a virtual device) the replica *is* the
    original: nothing is copied and autograd sums the gradients of the shared tensors.
    ``copy=True`` copies there too, as a distinct GPU needs, to exercise that path.
    ``include_source=True``: ``devices[0]`` is where the modules are, and its root holds
    them (never copies), so generated code reads every device's modules alike.

    >>> lin = nn.Linear(2, 2)
    >>> (r,) = replicate({"fc": lin}, ["cpu"], copy=True)
    >>> torch.equal(r.fc.weight, lin.weight), r.fc.weight is lin.weight
    (True, False)
    """
    devices = as_devices(devices)
    if include_source and not copy and uniform_device(devices) is not None:
        return (_aliasing_root(modules),) * len(devices)  # virtual devices of the modules' own
    source = _first_tensor_device(modules)
    if source is None or (not copy and uniform_device(devices) == source):
        # virtual devices: every replica is the original, nothing to walk or copy
        return (_aliasing_root(modules),) * len(devices)
    if include_source:
        return (_aliasing_root(modules), *_replicas(modules, devices[1:], copy, source))
    return _replicas(modules, devices, copy, source)


def _replicas(
    modules: Mapping[str, nn.Module | torch.Tensor], devices: tuple[torch.device, ...], copy: bool, source: torch.device
) -> tuple[ReplicaRoot, ...]:
    if not devices:
        return ()
    roots: list[ReplicaRoot] = [_aliasing_root(modules) for _ in devices]
    all_modules, tensors = _collect(modules)
    to_copy = [k for k, d in enumerate(devices) if copy or d != source]
    index = {id(t): i for i, t in enumerate(tensors)}
    packed_groups = [  # each RNN's weights, packed as cuDNN lays them out
        [index[id(m._flat_weights[k])] for k in cudnn_order(list(m._flat_weights_names))]
        for m in all_modules
        if isinstance(m, nn.RNNBase) and all(isinstance(w, torch.Tensor) for w in m._flat_weights)
    ]
    packed_groups = _disjoint(packed_groups)
    targets = tuple(devices[k] for k in to_copy)
    replica_set = _persistent_set(modules, tensors, targets, packed_groups)
    if not tensors:  # every parameter stored as pieces (FSDP), no buffer: nothing to copy
        flat: tuple[torch.Tensor, ...] = ()
    elif replica_set is None:
        flat = Broadcast.apply(list(targets), packed_groups, *tensors)
    else:
        flat = _Refreshed.apply(replica_set, *tensors)
    compiling = torch.compiler.is_compiling()
    for slot, k in enumerate(to_copy):
        copies = {id(t): flat[slot * len(tensors) + i] for i, t in enumerate(tensors)}
        memo: dict[int, nn.Module] = {}
        root = _fresh_root()
        for name, value in modules.items():
            if isinstance(value, nn.Module):
                replica = _replicate_module(value, copies, memo, devices[k])
                root._modules[name] = replica
                root.__dict__[name] = replica if compiling else view_of(replica)
            else:
                root._buffers[name] = copies[id(value)]
        roots[k] = root
    return tuple(roots)


class ReplicaSet:
    """Persistent copies of a list of source tensors on a list of devices.

    Made once (RNN weights laid into one buffer per device, as :class:`Broadcast` lays them)
    and refreshed in place, tensor by tensor, only where a source changed since the last
    copy: its version counter moved (an optimizer step, ``load_state_dict``, any in-place
    op) or its data was swapped (``p.data = ...``). A copy whose own version moved (a
    replica's forward wrote into it) is refreshed as well. Writes through ``p.data`` bypass
    version counters: call :func:`refresh_replicas` after them.
    """

    def __init__(self, sources: Sequence[torch.Tensor], devices: Sequence[torch.device], packed_groups):
        self.sources = list(sources)
        self.devices = list(devices)
        self.copies = copy_tensors_to_devices(self.sources, self.devices, packed_groups)
        self.stale = False
        self._record()

    def _record(self) -> None:
        self.seen = [(t._version, t.data_ptr()) for t in self.sources]
        self.seen_copies = [[c._version for c in per_device] for per_device in self.copies]

    def matches(self, sources: Sequence[torch.Tensor]) -> bool:
        """Whether these are the same source tensors, with the same shapes and dtypes."""
        return len(sources) == len(self.sources) and all(
            a is b and a.shape == c.shape and a.dtype == c.dtype
            for a, b, c in zip(sources, self.sources, self.copies[0])
        )

    def refresh(self) -> int:
        """Copy the sources that changed into their copies; return how many were copied."""
        copied = 0
        with torch.no_grad():
            for i, t in enumerate(self.sources):
                changed = self.stale or self.seen[i] != (t._version, t.data_ptr())
                for k, per_device in enumerate(self.copies):
                    if changed or per_device[i]._version != self.seen_copies[k][i]:
                        per_device[i].copy_(t.detach(), non_blocking=True)
                        copied += 1
        if copied or self.stale:
            self.stale = False
            self._record()
        return copied


class _Refreshed(Function):
    """:class:`Broadcast` onto a :class:`ReplicaSet`'s persistent copies: forward refreshes
    what changed and hands out the copies; backward reduce-adds the gradients as Broadcast's."""

    @staticmethod
    def forward(ctx, replica_set: ReplicaSet, *tensors):
        replica_set.refresh()
        ctx.source = tensors[0].device
        ctx.count = len(tensors)
        outputs = [c.detach() for per_device in replica_set.copies for c in per_device]
        nondiff = [o for j, o in enumerate(outputs) if not tensors[j % len(tensors)].requires_grad]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *sum_to_source(ctx, grads))


# anchor module -> {(names, ids of the values, devices, packed groups): ReplicaSet}
_SETS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, ReplicaSet]] = weakref.WeakKeyDictionary()


def _persistent_set(
    modules: Mapping[str, nn.Module | torch.Tensor],
    tensors: Sequence[torch.Tensor],
    devices: tuple[torch.device, ...],
    packed_groups: list[list[int]],
) -> ReplicaSet | None:
    """The persistent copies of ``tensors`` on ``devices`` (made on first use); None where
    they cannot persist: no tensors or module to anchor them, fake or meta tensors, tracing."""
    anchor = next((v for v in modules.values() if isinstance(v, nn.Module)), None)
    if anchor is None or not tensors or any(is_fake(t) for t in tensors) or torch.compiler.is_compiling():
        return None
    key = (
        tuple(modules),
        tuple(id(v) for v in modules.values()),
        devices,
        tuple(tuple(g) for g in packed_groups),
    )
    sets = _SETS.setdefault(anchor, {})
    replica_set = sets.get(key)
    if replica_set is None or not replica_set.matches(tensors):
        if len(sets) >= 8:  # programs for fewer devices, variants: a few; never an unbounded pile
            sets.clear()
        replica_set = sets[key] = ReplicaSet(tensors, devices, packed_groups)
    return replica_set


def refresh_replicas(model: nn.Module | None = None) -> None:
    """Copy every source into the persistent replicas of ``model`` (all models: None) on
    their next use, whether or not its version counter moved (after writes via ``p.data``)."""
    anchors = list(_SETS.keys()) if model is None else [m for m in model.modules() if m in _SETS]
    for anchor in anchors:
        for replica_set in _SETS.get(anchor, {}).values():
            replica_set.stale = True


def _first_tensor_device(modules: Mapping[str, nn.Module | torch.Tensor]) -> torch.device | None:
    for value in modules.values():
        if isinstance(value, torch.Tensor):
            return value.device
        tensor = _first_tensor(value)
        if tensor is not None:
            return tensor.device
    return None


# module -> one of its tensors: where a module lives, without walking it on every forward. A
# module moved with ``.to()`` keeps its tensor objects (their data moves), so the entry stays
# right; one whose tensors are replaced is looked up again.
_FIRST_TENSOR: weakref.WeakKeyDictionary[nn.Module, tuple[torch.Tensor, nn.Module, str, str]] = (
    weakref.WeakKeyDictionary()
)


def _first_tensor(module: nn.Module) -> torch.Tensor | None:
    if torch.compiler.is_compiling():  # no guards on the cache's weak entries, which come and go
        return next((t for m in module.modules() for t in [*m._parameters.values(), *m._buffers.values()] if t is not None), None)
    entry = _FIRST_TENSOR.get(module)
    if entry is not None:
        tensor, owner, kind, name = entry
        if getattr(owner, kind).get(name) is tensor:
            return tensor
    for owner in module.modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(owner, kind).items():
                if tensor is not None:
                    _FIRST_TENSOR[module] = (tensor, owner, kind, name)
                    return tensor
    return None


_BLANK = ReplicaRoot()


# what a root needs of nn.Module's state: its own dict of modules; the rest is the blank one's
# (read-only empties where tensors go, given their own dicts only where a root holds tensors),
# as nothing registers hooks on a root, calls it or adds to it
_BLANK_STATE = {
    **_BLANK.__dict__,
    "_parameters": types.MappingProxyType({}),
    "_buffers": types.MappingProxyType({}),
    "_non_persistent_buffers_set": frozenset(),
}


def _fresh_root(tensors: bool = True) -> ReplicaRoot:
    """``ReplicaRoot()`` at a fraction of the cost of ``nn.Module.__init__`` (made per forward)."""
    root = ReplicaRoot.__new__(ReplicaRoot)
    state = root.__dict__
    state.update(_BLANK_STATE)
    state["_modules"] = {}
    if tensors:
        state["_parameters"], state["_buffers"], state["_non_persistent_buffers_set"] = {}, {}, set()
    return root


def _aliasing_root(modules: Mapping[str, nn.Module | torch.Tensor]) -> ReplicaRoot:
    compiling = torch.compiler.is_compiling()  # torch.compile reads the modules themselves
    if not compiling:
        kept = _kept_root(modules)
        if kept is not None:
            return kept
    root = _fresh_root(tensors=compiling or not all(isinstance(v, nn.Module) for v in modules.values()))
    for name, value in modules.items():
        if isinstance(value, nn.Module):
            root._modules[name] = value
            # generated code reads it on every call: plain lookups, down to the module it calls
            root.__dict__[name] = value if compiling else _cached_view(value)
        elif isinstance(value, nn.Parameter):
            root._parameters[name] = value
        else:
            root._buffers[name] = value
    return root


# (names, ids of the modules) -> (weak references to them, the dicts and versions their views were
# made from, the root): the root of virtual devices whose modules all have children, made again only
# where a module was replaced, added or removed under one. It holds its modules only through their
# views, weakly, so the entry keeps no module alive (and goes when one of them goes).
_KEPT_ROOTS: dict[tuple, tuple[tuple[weakref.ReferenceType, ...], tuple[tuple[dict, int], ...], ReplicaRoot]] = {}


def _kept_root(modules: Mapping[str, nn.Module | torch.Tensor]) -> ReplicaRoot | None:
    """The kept root of ``modules`` on virtual devices: views of them as plain attributes, and
    nothing else (no ``_modules``: it would hold them); None where one is no module with children."""
    values = modules.values()
    key = (*modules, *map(id, values))
    entry = _KEPT_ROOTS.get(key)
    if entry is not None:
        refs, versions, root = entry
        if all(ref() is value for ref, value in zip(refs, values)) and _unchanged(versions):
            return root
    if dict_version is None or not all(isinstance(v, nn.Module) and _viewable(v) for v in values):
        return None
    root = _fresh_root(tensors=False)
    for name, value in modules.items():
        root.__dict__[name] = _cached_view(value)
    refs = tuple(weakref.ref(v, lambda _, key=key: _KEPT_ROOTS.pop(key, None)) for v in values)
    versions = tuple((m._modules, dict_version(m._modules)) for v in values for m in v.modules() if m._modules)
    _KEPT_ROOTS[key] = (refs, versions, root)
    return root


# id(module) -> (a weak reference to it, the dicts its view was made from, their versions, the
# view): a view of an original is made again only where a module was added, removed or
# replaced under it. The view holds the module weakly, so the entry keeps no module alive.
_VIEWS: dict[int, tuple[weakref.ReferenceType, tuple[tuple[dict, int], ...], ModuleView]] = {}


def _cached_view(module: nn.Module) -> nn.Module | ModuleView:
    entry = _VIEWS.get(id(module))
    if entry is None or entry[0]() is not module or not _unchanged(entry[1]):
        if not _viewable(module) or dict_version is None:
            return view_of(module)
        key = id(module)
        ref = weakref.ref(module, lambda _: _VIEWS.pop(key, None))
        versions = tuple((m._modules, dict_version(m._modules)) for m in module.modules() if m._modules)
        entry = _VIEWS[key] = (ref, versions, ModuleView(ref, view_of(module).__dict__))
    return entry[2]


def _unchanged(versions: tuple[tuple[dict, int], ...]) -> bool:
    for d, version in versions:
        if dict_version(d) != version:
            return False
    return True


def _disjoint(groups: list[list[int]]) -> list[list[int]]:
    """Drop groups that overlap an earlier one (weights shared between two RNNs)."""
    seen: set[int] = set()
    out = []
    for group in groups:
        if seen.isdisjoint(group) and len(set(group)) == len(group):
            out.append(group)
            seen.update(group)
    return out


def _replicate_module(
    module: nn.Module, copies: dict[int, torch.Tensor], memo: dict[int, nn.Module], device: torch.device
) -> nn.Module:
    """``module``'s replica on ``device``: its tensors the ``copies``, a sharded parameter's pieces
    themselves with its gather onto ``device`` (:func:`holds_pieces_gathered_per_replica`)."""
    if id(module) in memo:
        return memo[id(module)]
    replica = module._replicate_for_data_parallel()
    memo[id(module)] = replica
    if getattr(module, "gathers_on_each_replica", False):
        replica.device = str(device)
    in_place = holds_pieces_gathered_per_replica(module)
    for name, p in module._parameters.items():
        replica._parameters[name] = None if p is None else p if in_place else copies[id(p)]
    for name, b in module._buffers.items():
        replica._buffers[name] = None if b is None else copies[id(b)]
    for name, child in module._modules.items():
        replica._modules[name] = None if child is None else _replicate_module(child, copies, memo, device)
    if isinstance(replica, nn.RNNBase):
        # not _init_flat_weights(): it ends in flatten_parameters(), a copy on CUDA
        replica._flat_weights = [replica._parameters.get(name) for name in replica._flat_weights_names]
        # and the references RNN.forward compares them with: the original's would make every
        # forward of the replica re-run _init_flat_weights(), a flatten (a copy) on CUDA
        replica._flat_weight_refs = [None if w is None else weakref.ref(w) for w in replica._flat_weights]
    return replica
