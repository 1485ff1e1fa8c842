"""``insert_stage_transfers``: lower a staged graph to one program over the stages' devices.

It runs after :func:`~passes.split_stages.split_stages` and, for ``micro_batches > 1``, after
``insert_scatter_gather`` over ``micro_batches`` virtual devices: the micro-batches are data
parallelism's per-device values, so a mean loss is combined from partial sums and counts, a
BatchNorm in training normalises with the whole batch's statistics (the micro-batches meet at
that op), and everything data parallelism splits exactly is split exactly here. This pass

* runs every micro-batch on the model's own modules (no replicas: ``self.fc1(x_mb1)``);
* puts each node on its stage's device (the data-parallel calls' device arguments included);
* makes every value that crosses a stage boundary an explicit ``send`` node
  (``relu_mb0_to_stage1 = dpcompile_runtime_send(relu_mb0, 'cuda:1')``), and the outputs'
  way back to ``output_device`` too;
* orders the program as the GPipe schedule issues it: stage ``s`` runs micro-batch ``m`` at
  clock ``s + m``, so on distinct GPUs (asynchronous kernels, a default stream per device)
  stage 1 works on micro-batch 0 while stage 0 works on micro-batch 1.

Before (``pipeline=2, micro_batches=2``, after ``insert_scatter_gather``)::

    replicas = dpcompile_runtime_replicate({'fc1': fc1_src, 'fc2': fc2_src}, ['cpu', 'cpu'], ...)
    x_scatter = dpcompile_runtime_scatter(x, ['cpu', 'cpu'], 0)
    fc1_dev0 = replica_dev0.fc1(x_dev0)
    fc1_dev1 = replica_dev1.fc1(x_dev1)
    fc2_dev0 = replica_dev0.fc2(fc1_dev0)
    ...

After, on ``["cuda:0", "cuda:1"]``::

    x_scatter = dpcompile_runtime_scatter(x, ['cuda:0', 'cuda:0'], 0)
    fc1_mb0 = self.fc1(x_mb0)
    fc1_mb0_to_stage1 = dpcompile_runtime_send(fc1_mb0, 'cuda:1')
    fc1_mb1 = self.fc1(x_mb1)
    fc2_mb0 = self.fc2(fc1_mb0_to_stage1)
    fc1_mb1_to_stage1 = dpcompile_runtime_send(fc1_mb1, 'cuda:1')
    fc2_mb1 = self.fc2(fc1_mb1_to_stage1)
    fc2 = dpcompile_runtime_gather([fc2_mb0, fc2_mb1], 0, 'cuda:1')
    fc2_out = dpcompile_runtime_send(fc2, 'cuda:0')
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from dpcompile import runtime
from dpcompile.devices import Devices
from dpcompile.errors import PassError
from dpcompile.fx_utils import state_access_order
from dpcompile.infra import PassResult, replace_graph, stamp, stamp_comm
from passes.split_stages import STAGE, StagePlan

PASS = "insert_stage_transfers"
_PER_MICRO_BATCH = re.compile(r"_dev(\d+)(?=_|$)")


def insert_stage_transfers(
    gm: fx.GraphModule,
    *,
    plan: StagePlan,
    devices: Devices,
    micro_batches: int = 1,
    output_device: torch.device | None = None,
) -> PassResult:
    """Place every node on its stage's device, send what crosses a boundary, order as GPipe."""
    if len(devices) != plan.stages:
        raise PassError(f"{plan.stages} stages need {plan.stages} devices, got {len(devices)}")
    run_on_own_modules(gm)
    stage = node_stages(gm, plan)
    builder = _Builder(gm, stage, devices, micro_batches, str(output_device or devices.primary))
    replace_graph(gm, builder.build())
    return PassResult(gm, True, {"plan": plan, "micro_batches": micro_batches, "sends": builder.sends})


# ------------------------------------------------------------------ no replicas
def run_on_own_modules(gm: fx.GraphModule) -> None:
    """Every micro-batch reads the model's own modules: ``replica_dev1.fc1(x)`` becomes
    ``self.fc1(x)`` (micro-batches share their stage's device, nothing is replicated)."""
    graph = gm.graph
    replicas = next((n for n in graph.nodes if n.op == "call_function" and n.target is runtime.replicate), None)
    if replicas is None:
        return
    paths: dict[fx.Node, str] = {root: "" for root in replicas.users}
    for node in list(graph.nodes):
        if node.op == "call_method" and node.args and node.args[0] in paths and _is_module(gm, paths[node.args[0]]):
            with graph.inserting_before(node):
                call = graph.call_module(_join(paths[node.args[0]], str(node.target)), node.args[1:], node.kwargs)
            _take_place(node, call)
        elif node.op == "call_function" and node.target is getattr and node.args[0] in paths:
            path = _join(paths[node.args[0]], node.args[1])
            paths[node] = path
            with graph.inserting_before(node):
                attr = graph.get_attr(path)
            _take_place(node, attr, keep=True)
            paths[attr] = path
        elif node.op == "call_function" and node.target is runtime.module_of and node.args[0] in paths:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    for node in reversed(list(graph.nodes)):
        if node in paths and not node.users and node.op != "get_attr":
            graph.erase_node(node)
    for node in list(paths):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    if replicas.users:
        raise PassError(f"a replica root is used as a value by {[u.name for u in replicas.users]}")
    sources = [a for a in replicas.args[0].values() if isinstance(a, fx.Node)]
    graph.erase_node(replicas)
    for src in sources:
        if not src.users:
            graph.erase_node(src)


def _is_module(gm: fx.GraphModule, path: str) -> bool:
    """Whether ``path`` names a module of ``gm``: ``replica.fc1(x)`` calls one, while
    ``replica.cls_token.expand(...)`` (a parameter the root holds) is a tensor method."""
    parent, _, name = path.rpartition(".")
    try:
        return isinstance(getattr(gm.get_submodule(parent), name) if name else gm, torch.nn.Module)
    except AttributeError:
        return False


def _join(prefix: str, atom: str) -> str:
    return f"{prefix}.{atom}" if prefix else atom


def _take_place(old: fx.Node, new: fx.Node, keep: bool = False) -> None:
    new.meta.update({k: v for k, v in old.meta.items() if k != "val"})
    new.meta["dpcompile_name"] = old.name
    old.replace_all_uses_with(new)
    if not keep:
        old.graph.erase_node(old)


# ------------------------------------------------------------------ stages
def node_stages(gm: fx.GraphModule, plan: StagePlan) -> dict[fx.Node, int]:
    """Each node's stage: its source node's (data parallelism stamps the node it came from), else
    the earliest stage that reads it (inputs scattered straight to the stage that needs them)."""
    stage: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        source = node.meta.get("dpcompile_source", node.meta.get("dpcompile_name", node.name))
        if STAGE in node.meta and "dpcompile_source" not in node.meta:
            stage[node] = node.meta[STAGE]
        elif source in plan.stage_of:
            stage[node] = plan.stage_of[source]
    for node in reversed(list(gm.graph.nodes)):
        if node.op in ("placeholder", "output") or node in stage:
            continue
        readers = [stage[u] for u in node.users if u in stage]
        if readers:
            stage[node] = min(readers)
        else:
            stage[node] = max((stage[a] for a in node.all_input_nodes if a in stage), default=0)
    return stage


def _micro_batch(node: fx.Node) -> int | None:
    if node.meta.get("dpcompile_pass") != "insert_scatter_gather":
        return None
    found = _PER_MICRO_BATCH.search(node.meta.get("dpcompile_name", node.name))
    return int(found.group(1)) if found else None


# ------------------------------------------------------------------ the program
class _Builder:
    def __init__(
        self, gm: fx.GraphModule, stage: Mapping[fx.Node, int], devices: Devices, micro_batches: int, output: str
    ):
        self.gm = gm
        self.stage = stage
        self.devices = devices.strings()
        self.micro_batches = micro_batches
        self.output = output
        self.primary = str(devices.primary)
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.sent: dict[tuple[fx.Node, str], fx.Node] = {}
        self.sends: list[str] = []

    def build(self) -> fx.Graph:
        for node in self._schedule():
            if node.op == "placeholder":
                self.env[node] = self.graph.node_copy(node)
            elif node.op == "output":
                self.graph.output(fx.node.map_arg(node.args[0], self._to_output), type_expr=node.type)
            else:
                self.env[node] = self._emit(node)
        return self.graph

    def _schedule(self) -> list[fx.Node]:
        """The nodes in the order GPipe issues them (a topological order: ready nodes by clock)."""
        nodes = list(self.gm.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        priority: dict[fx.Node, tuple[int, int, int]] = {}
        for node in reversed(nodes):
            m = _micro_batch(node)
            s = self.stage.get(node, 0)
            if node.op == "output":
                priority[node] = (1 << 30, 0, index[node])
            elif node.op == "placeholder":  # first, in order: forward's signature (a flag read by none too)
                priority[node] = (-1, 0, index[node])
            elif m is not None:
                priority[node] = (s + m, s, index[node])
            elif node.users:  # just in time for its first reader
                first = min(priority[u] for u in node.users)
                priority[node] = (first[0], first[1], index[node])
            else:
                priority[node] = (s + self.micro_batches - 1, s, index[node])
        after = state_access_order(nodes)
        waiting = {n: len(set(n.all_input_nodes)) + len(after.get(n, ())) for n in nodes}
        followers: dict[fx.Node, list[fx.Node]] = {}
        for node, earlier in after.items():
            for e in earlier:
                followers.setdefault(e, []).append(node)
        ready = [(priority[n], n.name, n) for n in nodes if waiting[n] == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            _, _, node = heapq.heappop(ready)
            order.append(node)
            for user in [*node.users, *followers.get(node, ())]:
                waiting[user] -= 1
                if waiting[user] == 0:
                    heapq.heappush(ready, (priority[user], user.name, user))
        if len(order) != len(nodes):
            raise PassError("the staged graph has a cycle")
        return order

    def _emit(self, node: fx.Node) -> fx.Node:
        s = self.stage[node]
        device = self.devices[s]

        def arg(a: fx.Node) -> fx.Node:
            return self._value_for(a, s, consumer=node)

        args = fx.node.map_arg(node.args, arg)
        kwargs = fx.node.map_arg(node.kwargs, arg)
        if _is_runtime_call(node):
            args, kwargs = _on_device((args, kwargs), self.primary, device)
        name = _PER_MICRO_BATCH.sub(lambda m: f"_mb{m.group(1)}", node.meta.get("dpcompile_name", node.name))
        if node.meta.get("dpcompile_pass") != "insert_scatter_gather" or node.op == "get_attr":
            name = node.meta.get("dpcompile_name", node.name)
        new = self.graph.create_node(node.op, node.target, args, kwargs, name=name, type_expr=node.type)
        new.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta", "dpcompile_name")})
        new.meta[STAGE] = s
        new.meta["dpcompile_slot"] = s  # explain: the node's device is its stage's
        return new

    def _value_for(self, value: fx.Node, s: int, consumer: fx.Node) -> fx.Node:
        """``value`` where stage ``s`` reads it: sent there when it lives elsewhere."""
        new = self.env[value]
        if value.op == "placeholder":
            if _is_runtime_call(consumer) and consumer.target in (runtime.scatter, runtime.to_device, runtime.write_back):
                return new  # these move the user's input themselves, or write into it
            return self._send(value, new, self.devices[s], f"{new.name}_to_stage{s}", s)
        if self.stage[value] == s:
            return new
        return self._send(value, new, self.devices[s], f"{new.name}_to_stage{s}", s)

    def _send(self, value: fx.Node, new: fx.Node, device: str, name: str, s: int | None) -> fx.Node:
        key = (value, name)
        if key not in self.sent:
            sent = self.graph.create_node("call_function", runtime.send, (new, device), name=name)
            stamp(sent, PASS, value)
            stamp_comm(sent, "send", io=value.op == "placeholder" or s is None, backward="send")
            if s is not None:
                sent.meta[STAGE] = s
            self.sent[key] = sent
            self.sends.append(sent.name)
        return self.sent[key]

    def _to_output(self, value: fx.Node) -> fx.Node:
        new = self.env[value]
        if value.op != "placeholder" and self.devices[self.stage[value]] == self.output:
            return new
        return self._send(value, new, self.output, f"{new.name}_out", None)


def _is_runtime_call(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__module__", "") == runtime.__name__


def _on_device(value: Any, primary: str, device: str) -> Any:
    """Data parallelism's device arguments (the micro-batches' virtual device) made the stage's."""
    if isinstance(value, str) and value == primary:
        return device
    if isinstance(value, (list, tuple)) and not isinstance(value, fx.Node):
        mapped = [_on_device(v, primary, device) for v in value]
        return tuple(mapped) if isinstance(value, tuple) else mapped
    if isinstance(value, dict):
        return {k: _on_device(v, primary, device) for k, v in value.items()}
    return value


__all__ = ["insert_stage_transfers", "node_stages", "run_on_own_modules"]
