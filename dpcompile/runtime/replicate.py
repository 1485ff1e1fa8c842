"""Replicate modules onto other devices for one forward, as data parallelism needs.

A replica shares nothing mutable with its original: its parameters are the outputs of one
differentiable :class:`~dpcompile.runtime.comm.Broadcast` (so gradients flow back and are
summed on the source device), its buffers are copies. Each RNN's weights are copied into one
contiguous buffer per replica, laid out as cuDNN expects, so that the replica's
``flatten_parameters`` finds them flat and copies nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from dpcompile.runtime.comm import Broadcast, DeviceLike, as_devices


class ReplicaRoot(nn.Module):
    """The per-device stand-in for ``self`` in generated code: ``replica_dev1.fc1(x_dev1)``.

    Dotted names resolve as paths (``getattr(root, "enc.fc1")``), as fx's ``Interpreter`` asks
    for them when it runs a ``call_method`` node such as ``replica_dev1.enc.fc1(x)``.
    """

    def __getattr__(self, name: str):
        if "." in name:
            value = self
            for atom in name.split("."):
                value = getattr(value, atom)
            return value
        return super().__getattr__(name)


def _collect(values: Mapping[str, nn.Module | torch.Tensor]) -> tuple[list[nn.Module], list[torch.Tensor]]:
    modules: dict[int, nn.Module] = {}
    tensors: dict[int, torch.Tensor] = {}
    for value in values.values():
        if isinstance(value, nn.Module):
            for m in value.modules():
                modules.setdefault(id(m), m)
                for t in list(m._parameters.values()) + list(m._buffers.values()):
                    if t is not None:
                        tensors.setdefault(id(t), t)
        elif isinstance(value, torch.Tensor):
            tensors.setdefault(id(value), value)
    return list(modules.values()), list(tensors.values())


def replicate(
    modules: Mapping[str, nn.Module | torch.Tensor], devices: Sequence[DeviceLike], *, copy: bool = False
) -> tuple[ReplicaRoot, ...]:
    """One :class:`ReplicaRoot` per device holding replicas of ``modules`` (names kept).

    On a device that already holds the tensors (a virtual device) the replica *is* the
    original: nothing is copied and autograd sums the gradients of the shared tensors.
    ``copy=True`` copies there too, as a distinct GPU needs, to exercise that path.

    >>> lin = nn.Linear(2, 2)
    >>> (r,) = replicate({"fc": lin}, ["cpu"], copy=True)
    >>> torch.equal(r.fc.weight, lin.weight), r.fc.weight is lin.weight
    (True, False)
    """
    devices = as_devices(devices)
    roots: list[ReplicaRoot] = [_aliasing_root(modules) for _ in devices]
    source = _first_tensor_device(modules)
    if source is None or (not copy and all(d == source for d in devices)):
        return tuple(roots)  # virtual devices: every replica is the original, nothing to walk
    all_modules, tensors = _collect(modules)
    to_copy = [k for k, d in enumerate(devices) if copy or d != source]
    index = {id(t): i for i, t in enumerate(tensors)}
    packed_groups = [
        [index[id(w)] for w in m._flat_weights]
        for m in all_modules
        if isinstance(m, nn.RNNBase) and all(isinstance(w, torch.Tensor) for w in m._flat_weights)
    ]
    packed_groups = _disjoint(packed_groups)
    flat = Broadcast.apply([devices[k] for k in to_copy], packed_groups, *tensors)
    for slot, k in enumerate(to_copy):
        copies = {id(t): flat[slot * len(tensors) + i] for i, t in enumerate(tensors)}
        memo: dict[int, nn.Module] = {}
        root = ReplicaRoot()
        for name, value in modules.items():
            if isinstance(value, nn.Module):
                root._modules[name] = _replicate_module(value, copies, memo)
            else:
                root._buffers[name] = copies[id(value)]
        roots[k] = root
    return tuple(roots)


def _first_tensor_device(modules: Mapping[str, nn.Module | torch.Tensor]) -> torch.device | None:
    for value in modules.values():
        if isinstance(value, torch.Tensor):
            return value.device
        for tensor in itertools.chain(value.parameters(), value.buffers()):
            return tensor.device
    return None


def _aliasing_root(modules: Mapping[str, nn.Module | torch.Tensor]) -> ReplicaRoot:
    root = ReplicaRoot()
    for name, value in modules.items():
        if isinstance(value, nn.Module):
            root._modules[name] = value
        elif isinstance(value, nn.Parameter):
            root._parameters[name] = value
        else:
            root._buffers[name] = value
    return root


def _disjoint(groups: list[list[int]]) -> list[list[int]]:
    """Drop groups that overlap an earlier one (weights shared between two RNNs)."""
    seen: set[int] = set()
    out = []
    for group in groups:
        if seen.isdisjoint(group) and len(set(group)) == len(group):
            out.append(group)
            seen.update(group)
    return out


def _replicate_module(module: nn.Module, copies: dict[int, torch.Tensor], memo: dict[int, nn.Module]) -> nn.Module:
    if id(module) in memo:
        return memo[id(module)]
    replica = module._replicate_for_data_parallel()
    memo[id(module)] = replica
    for name, p in module._parameters.items():
        replica._parameters[name] = None if p is None else copies[id(p)]
    for name, b in module._buffers.items():
        replica._buffers[name] = None if b is None else copies[id(b)]
    for name, child in module._modules.items():
        replica._modules[name] = None if child is None else _replicate_module(child, copies, memo)
    if isinstance(replica, nn.RNNBase):
        # not _init_flat_weights(): it ends in flatten_parameters(), a copy on CUDA
        replica._flat_weights = [replica._parameters.get(name) for name in replica._flat_weights_names]
    return replica
