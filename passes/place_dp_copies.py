"""``place_dp_copies``: run each dp copy of a program on its own devices.

A ``dp`` dimension over a pipeline or a tensor-parallel program in one process is ``D`` copies of
that program, built on copy 0's devices (``dpcompile.target.replicate_over_dp``) and named by
``name_dp_copies``. This pass, after it, moves copy ``r`` (``r >= 1``) onto its own devices
(``copies[r]``, in the order of ``copies[0]``):

* every device a copy-``r`` node names (a send, a tensor-parallel copy or gather) becomes copy
  ``r``'s device of the same place, and the batch's scatter sends each piece to its copy;
* every parameter, buffer or shared value a copy-``r`` node reads (a batch-independent value
  another copy made: ``rotary_dp0_to_dp1``) is sent to that node's device once per call (``fc1_weight_shard0_dp1 = dpcompile_runtime_send(fc1_weight_shard0, 'cuda:1')``):
  a differentiable copy, so its gradient is summed back into the one parameter by autograd;
* every module a copy calls is replicated once per call, one replicate per stage onto every other
  copy's device there (``replicas_stage0 = dpcompile_runtime_replicate({'fc1': fc1_src}, ['cuda:1'])``,
  ``replica_dp1_stage0 = replicas_stage0[0]``, ``fc1_dp1 = replica_dp1_stage0.fc1(x_dp1)``), as
  one-process data parallelism replicates (one differentiable broadcast).

Where copy ``r``'s device of a place is copy 0's (repeated, virtual devices, as ``["cpu"] * 8``)
nothing is sent or replicated: the program is the one built, each copy still named and stamped
with its copy (``explain`` places it on its own devices).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile import runtime
from dpcompile.errors import PassError
from dpcompile.infra import PassResult, stamp, stamp_comm
from passes.name_dp_copies import COPY
from passes.split_stages import STAGE

PASS = "place_dp_copies"
SLOT = "dpcompile_slot"  # node.meta: the node's place in its copy's devices


def copy_device_maps(copies: Sequence[Sequence[str]]) -> list[dict[str, str]]:
    """For each copy ``r``, copy 0's device names to copy ``r``'s (the same place in each)."""
    maps = []
    for r, copy in enumerate(copies):
        mapping: dict[str, str] = {}
        for own, other in zip(copies[0], copy):
            if mapping.setdefault(own, other) != other:
                raise PassError(f"dp copy 0 names {own!r} where copy {r} has {mapping[own]!r} and {other!r}")
        maps.append(mapping)
    return maps


def find_copy_nodes(gm: fx.GraphModule, copies: Sequence[Sequence[str]]) -> dict[fx.Node, tuple[int, str]]:
    """``{node: (copy, device)}`` for every node of a copy other than copy 0."""
    found = {}
    for node in gm.graph.nodes:
        r = node.meta.get(COPY)
        if isinstance(r, int) and r > 0:
            found[node] = (r, copies[r][_slot_index(node, len(copies[r]))])
    return found


def _slot_index(node: fx.Node, places: int) -> int:
    slot = node.meta.get(SLOT, 0)
    return slot if isinstance(slot, int) and slot < places else 0


def place_dp_copies(gm: fx.GraphModule, *, copies: Sequence[Sequence[str]], micro_batches: int) -> PassResult:
    """Move every copy ``r >= 1`` onto ``copies[r]``: devices renamed, parameters sent, modules replicated."""
    maps = copy_device_maps(copies)
    found = find_copy_nodes(gm, copies)
    _place_scatters(gm, maps, micro_batches)
    placer = _Placer(gm, maps)
    for node, (r, device) in found.items():
        home = copies[0][_slot_index(node, len(copies[0]))]
        placer.place(node, r, device, moves=device != home)
    gm.graph.lint()
    return PassResult(gm, bool(found), {"placed": len(found), "sends": placer.sends, "replicas": len(placer.replicas)})


def _place_scatters(gm: fx.GraphModule, maps: Sequence[Mapping[str, str]], micro_batches: int) -> None:
    """The batch's scatter: piece ``j`` goes to copy ``j // micro_batches``'s device."""
    pieces = len(maps) * micro_batches
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is runtime.scatter and len(node.args) > 1:
            targets = node.args[1]
            if isinstance(targets, (list, tuple)) and len(targets) <= pieces:  # fewer: a batch of fewer pieces
                moved = [_renamed(d, maps[j // micro_batches]) for j, d in enumerate(targets)]
                node.args = (node.args[0], type(targets)(moved), *node.args[2:])


class _Placer:
    def __init__(self, gm: fx.GraphModule, maps: Sequence[Mapping[str, str]]):
        self.gm, self.maps = gm, maps
        self.sent: dict[tuple[fx.Node, str], fx.Node] = {}
        self.replicas: dict[int, fx.Node] = {}  # by copy 0's slot: one replicate onto every other copy
        self.roots: dict[tuple[int, int], fx.Node] = {}  # by (copy, slot): that copy's replica root
        self.sends: list[str] = []

    def place(self, node: fx.Node, r: int, device: str, *, moves: bool) -> None:
        """``node`` of copy ``r`` onto ``device``: its device names renamed and, where ``moves``
        (copy 0's device of its place is another), what it reads sent or replicated there."""
        node.args = _renamed(node.args, self.maps[r])
        node.kwargs = _renamed(node.kwargs, self.maps[r])
        if not moves:  # a virtual device: copy 0's values are already where copy r reads them
            return
        container = node.args[0] if node.op == "call_function" and node.target is operator.getitem else None
        for value in node.all_input_nodes:
            if value is container or value.meta.get(COPY) == r or self._is_module(value):
                continue  # a value of another copy (one batch-independent value, made once) is sent too
            made = self._replica_root(value, node, r, device) if _replicated_root(value) else self._send(value, node, r, device)
            node.replace_input_with(value, made)
        if node.op == "call_module":
            self._call_replica(node, r, device)

    def _is_module(self, value: fx.Node) -> bool:
        if value.op != "get_attr":
            return False
        try:
            return isinstance(self.gm.get_submodule(str(value.target)), nn.Module)
        except AttributeError:
            return False

    def _send(self, value: fx.Node, consumer: fx.Node, r: int, device: str) -> fx.Node:
        key = (value, device)
        if key not in self.sent:
            with self.gm.graph.inserting_before(consumer):
                sent = self.gm.graph.call_function(runtime.send, (value, device))
            sent._rename(f"{value.name}_to_dp{r}" if COPY in value.meta else f"{value.name}_dp{r}")
            self._stamp(sent, consumer, r)
            stamp_comm(sent, "send", io=value.op == "placeholder", backward="send")
            self.sent[key] = sent
            self.sends.append(sent.name)
        return self.sent[key]

    def _replica_root(self, value: fx.Node, consumer: fx.Node, r: int, device: str) -> fx.Node:
        """Copy ``r``'s root of a replicate made before this pass (a module tied across pipeline stages,
        ``replicate_borrowed_modules``): ``device`` added to that replicate, as for a copy's own modules.
        A module cannot be sent (``send`` moves tensors only): copy ``r`` would call copy 0's replica."""
        key = (value, device)
        if key not in self.sent:
            replicas = value.args[0]
            replicas.args = (replicas.args[0], [*replicas.args[1], device], *replicas.args[2:])
            with self.gm.graph.inserting_before(consumer):
                root = self.gm.graph.call_function(operator.getitem, (replicas, len(replicas.args[1]) - 1))
            root._rename(f"{value.name}_dp{r}")
            self._stamp(root, consumer, r)
            self.sent[key] = root
        return self.sent[key]

    def _call_replica(self, node: fx.Node, r: int, device: str) -> None:
        """``self.fc1(x_dp1)`` becomes ``replica_dp1_stage0.fc1(x_dp1)``, the replica made on ``device``."""
        slot = node.meta.get(SLOT, 0)
        replicas = self._replicas(node, slot)
        path = str(node.target)
        key = path.replace(".", "_")
        if key not in replicas.args[0]:  # one replicate a stage lists every module its copies call there
            with self.gm.graph.inserting_before(replicas):
                source = self.gm.graph.get_attr(path)
            source._rename(f"{key}_src")
            self._stamp(source, node, None)
            replicas.args = ({**replicas.args[0], key: source}, *replicas.args[1:])
        node.op, node.target, node.args = "call_method", key, (self._root(node, replicas, r, device, slot), *node.args)

    def _replicas(self, node: fx.Node, slot: int) -> fx.Node:
        """The one replicate of the modules on copy 0's ``slot``-th device onto every other copy's."""
        if slot not in self.replicas:
            with self.gm.graph.inserting_before(node):
                replicas = self.gm.graph.call_function(runtime.replicate, ({}, []))
            replicas._rename(f"replicas{self._suffix(node, slot)}")
            self._stamp(replicas, node, None)
            stamp_comm(replicas, "broadcast", io=False, backward="reduce")
            self.replicas[slot] = replicas
        return self.replicas[slot]

    def _root(self, node: fx.Node, replicas: fx.Node, r: int, device: str, slot: int) -> fx.Node:
        """Copy ``r``'s replica root on its ``slot``-th device: its device added to the replicate."""
        if (r, slot) not in self.roots:
            replicas.args = (replicas.args[0], [*replicas.args[1], device], *replicas.args[2:])
            with self.gm.graph.inserting_before(node):
                root = self.gm.graph.call_function(operator.getitem, (replicas, len(replicas.args[1]) - 1))
            root._rename(f"replica_dp{r}{self._suffix(node, slot)}")
            self._stamp(root, node, r)
            self.roots[(r, slot)] = root
        return self.roots[(r, slot)]

    @staticmethod
    def _suffix(node: fx.Node, slot: int) -> str:
        return f"_stage{node.meta[STAGE]}" if STAGE in node.meta else f"_slot{slot}"

    @staticmethod
    def _stamp(made: fx.Node, consumer: fx.Node, r: int | None) -> None:
        """Made by this pass for ``consumer``, in its stage and slot; of copy ``r`` (None: shared)."""
        stamp(made, PASS, consumer)
        if r is not None:
            made.meta[COPY] = r
        for key in (STAGE, SLOT):
            if key in consumer.meta:
                made.meta[key] = consumer.meta[key]


def _replicated_root(value: fx.Node) -> bool:
    """``value`` is a root of ``runtime.replicate`` (``replicas[k]``): modules, not tensors."""
    made = value.args[0] if value.op == "call_function" and value.target is operator.getitem and value.args else None
    return isinstance(made, fx.Node) and made.op == "call_function" and made.target is runtime.replicate


def _renamed(value: Any, mapping: Mapping[str, str]) -> Any:
    """Device names (strings and ``torch.device``) in ``value`` renamed by ``mapping``."""
    if isinstance(value, str):
        return mapping.get(value, value)
    if isinstance(value, torch.device):
        return torch.device(mapping[str(value)]) if str(value) in mapping else value
    if isinstance(value, (list, tuple)) and not isinstance(value, fx.Node):
        renamed = [_renamed(v, mapping) for v in value]
        return type(value)(renamed) if not hasattr(value, "_fields") else type(value)(*renamed)
    if isinstance(value, dict):
        return {k: _renamed(v, mapping) for k, v in value.items()}
    return value


__all__ = ["copy_device_maps", "find_copy_nodes", "place_dp_copies"]
