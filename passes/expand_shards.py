"""``expand_shards``: lower ``shard_linear``'s one-shard program to one process driving several devices.

Sharded values become one node per device (``fc1_dev1``), the collectives of
:mod:`dpcompile.runtime.collectives` become calls of :mod:`dpcompile.runtime.tensor_parallel`,
replicated values are computed once, on ``devices[0]``. Before, the program of one shard of an
MLP planned ``{"fc1": "column", "fc2": "row"}`` (see :mod:`passes.shard_linear`)::

    def forward(self, x):
        x_copy = dpcompile_runtime_collectives_copy_to_shards(x)
        fc1_weight = self.fc1.weight
        fc1_bias = self.fc1.bias
        fc1 = torch._C._nn.linear(x_copy, fc1_weight, fc1_bias)
        relu = torch.relu(fc1)
        fc2_weight = self.fc2.weight
        fc2_partial = torch._C._nn.linear(relu, fc2_weight)
        fc2_all_reduce = dpcompile_runtime_collectives_reduce_from_shards(fc2_partial)
        fc2_bias = self.fc2.bias
        fc2 = add_bias(fc2_all_reduce, fc2_bias)
        return fc2

After ``expand_shards`` on ``["cpu", "cpu"]``::

    def forward(self, x):
        x_on_device = dpcompile_runtime_to_device(x, 'cpu')
        x_copy = dpcompile_runtime_tensor_parallel_copy_to_devices(x_on_device, ['cpu', 'cpu'])
        x_copy_dev0 = x_copy[0]
        x_copy_dev1 = x_copy[1]
        fc1_weight_shard0 = self.fc1.weight_shard0
        ...
        fc1_dev0 = torch._C._nn.linear(x_copy_dev0, fc1_weight_shard0, fc1_bias_shard0)
        fc1_dev1 = torch._C._nn.linear(x_copy_dev1, fc1_weight_shard1, fc1_bias_shard1)
        relu_dev0 = torch.relu(fc1_dev0)
        relu_dev1 = torch.relu(fc1_dev1)
        ...
        fc2_all_reduce = dpcompile_runtime_tensor_parallel_reduce_to_device([fc2_partial_dev0, fc2_partial_dev1], 'cpu')
        fc2 = add_bias(fc2_all_reduce, fc2_bias)
        return fc2
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.analysis.sharding import REPLICATED, Copied, Sharded
from dpcompile.analysis.sharding_rules import flat_nodes
from dpcompile.devices import Devices
from dpcompile.infra import PassResult, stamp, stamp_comm
from dpcompile.progress import step_bar
from dpcompile.runtime import collectives, to_device
from dpcompile.runtime import tensor_parallel as tp_runtime
from dpcompile.runtime.tensor_parallel import ShardSpec
from passes.split_stages import STAGE

PASS = "expand_shards"


class LinearShards(nn.Module):
    """What replaces a sharded ``nn.Linear`` (or Conv1D, or vocab-parallel ``nn.Embedding``): its
    shards (``weight_shard0``, ...) and any whole rest. Tied weights share one set of shards.

    ``specs`` maps each sharded parameter name (``"weight"``) to its :class:`ShardSpec`.
    """

    def __init__(self, linear: nn.Module, specs: Mapping[str, ShardSpec], devices: Devices, make: Any = None):
        super().__init__()
        make = make or (lambda full, spec: _make_shards(full, spec, devices))
        w = getattr(linear, "weight", None)
        if w is None:  # an nn.MultiheadAttention: its fused in-projection is sharded, out_proj is a child
            w = linear.in_proj_weight
            self.in_features, self.out_features = int(w.shape[1]), int(w.shape[0])
        elif isinstance(linear, nn.Embedding):  # vocab-parallel: rows of the table
            self.in_features, self.out_features = linear.num_embeddings, linear.embedding_dim
        else:  # nn.Linear, or Conv1D (weight (in, out))
            self.in_features = getattr(linear, "in_features", int(w.shape[0]))
            self.out_features = getattr(linear, "out_features", int(w.shape[1] if not hasattr(linear, "in_features") else w.shape[0]))
        self.specs = dict(specs)
        for name, p in linear.named_parameters(recurse=False):
            if name in self.specs:
                for k, shard in enumerate(make(p, self.specs[name])):
                    self.register_parameter(f"{name}_shard{k}", shard)
            else:
                self.register_parameter(name, p)
        for name, child in linear.named_children():  # out_proj of an nn.MultiheadAttention
            self.add_module(name, child)
        for name, b in linear.named_buffers(recurse=False):  # one the user registered on the layer (a scale)
            self.register_buffer(name, b, persistent=name not in linear._non_persistent_buffers_set)

    def extra_repr(self) -> str:
        specs = ", ".join(f"{name}: dim {s.dim} sizes {list(s.sizes)}" for name, s in self.specs.items())
        return f"in_features={self.in_features}, out_features={self.out_features}, {specs}"


def _make_shards(full: torch.Tensor, spec: ShardSpec, devices: Devices) -> list[nn.Parameter]:
    with torch.no_grad():
        return [
            nn.Parameter(tp_runtime.shard_of(full.detach(), spec, k).to(devices[k], copy=True), requires_grad=full.requires_grad)
            for k in range(len(devices))
        ]


def expand_shards(gm: fx.GraphModule, *, devices: Devices, output_device: torch.device | None = None) -> PassResult:
    """Lower a ``shard_linear`` program to one process driving ``devices`` (one shard each).

    Sharded values become one node per device (``fc1_dev1``), collectives become calls of
    :mod:`dpcompile.runtime.tensor_parallel`, replicated values are computed once on
    ``devices[0]``. The sharded parameters are cut from the full ones, put on their devices
    and each sharded ``nn.Linear`` of ``gm`` is replaced by a :class:`LinearShards`.
    ``info["param_shards"]`` maps each original parameter name to ``(spec, shard names)``.
    """
    specs = {n.target: n.meta["dpcompile_shard"] for n in gm.graph.nodes if n.op == "get_attr" and "dpcompile_shard" in n.meta}
    if not specs and not any(is_shard_collective(n) for n in gm.graph.nodes):
        return PassResult(gm, False, {"param_shards": {}})
    primary = devices.primary
    _move_whole_state(gm, primary, skip=set(specs))
    _materialize_shards(gm, specs, devices)
    builder = _Expander(gm, devices, output_device or primary)
    gm.graph = builder.build()
    param_shards = {t: (s, [f"{t}_shard{k}" for k in range(len(devices))]) for t, s in specs.items()}
    return PassResult(gm, True, {"param_shards": param_shards})


def _move_whole_state(gm: fx.GraphModule, device: torch.device, *, skip: set[str]) -> None:
    """Put every parameter and buffer not in ``skip`` on ``device`` (new tensors, not in place; one
    per tensor, so modules that share one, tied weights, still share it)."""
    moved: dict[int, torch.Tensor] = {}
    modules = list(gm.named_modules())
    bar = step_bar("Placing weights", sum(len(m._parameters) + len(m._buffers) for _, m in modules))
    for path, module in modules:
        prefix = f"{path}." if path else ""
        for name, p in list(module._parameters.items()):
            if p is not None and p.device != device and prefix + name not in skip:
                if id(p) not in moved:
                    with torch.no_grad():
                        moved[id(p)] = nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
                module._parameters[name] = moved[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and b.device != device:
                module._buffers[name] = moved.setdefault(id(b), b.to(device))
        bar.update(len(module._parameters) + len(module._buffers))


def is_shard_collective(node: fx.Node) -> bool:
    """A call of ``shard_linear``'s one-shard collectives, or of the sizes and offsets they read."""
    return node.op == "call_function" and (
        node.target in collectives.COLLECTIVES or node.target in (collectives.local_size, collectives.local_offset, collectives.whole_size)
    )


def _materialize_shards(gm: fx.GraphModule, specs: Mapping[str, ShardSpec], devices: Devices) -> None:
    made: dict[int, list[nn.Parameter]] = {}  # tied weights (an embedding and its LM head): one set of shards

    def shards_of(full: torch.Tensor, spec: ShardSpec) -> list[nn.Parameter]:
        if id(full) not in made:
            made[id(full)] = _make_shards(full, spec, devices)
        return made[id(full)]

    by_module: dict[str, dict[str, ShardSpec]] = {}
    for target, spec in specs.items():
        path, _, name = target.rpartition(".")
        by_module.setdefault(path, {})[name] = spec
    bar = step_bar("Placing weights", len(specs))  # transform(progress=): one step a sharded parameter
    for path, module_specs in by_module.items():
        bar.update(len(module_specs))
        linear = gm.get_submodule(path)
        if path == "":  # the root is the Linear: shard its own parameters
            for name, spec in module_specs.items():
                full = gm._parameters.pop(name)
                for k, shard in enumerate(shards_of(full, spec)):
                    gm.register_parameter(f"{name}_shard{k}", shard)
            continue
        parent_path, _, child = path.rpartition(".")
        parent = gm.get_submodule(parent_path)
        setattr(parent, child, LinearShards(linear, module_specs, devices, shards_of))


class _Expander:
    """Builds the per-device graph: one node per device for sharded values, one for the rest."""

    def __init__(self, gm: fx.GraphModule, devices: Devices, output_device: torch.device):
        self.gm = gm
        self.devices = devices
        self.n = len(devices)
        self.primary = str(devices.primary)
        self.output_device = str(output_device)
        self.graph = fx.Graph()
        self.whole: dict[fx.Node, Any] = {}
        self.per_device: dict[fx.Node, list[fx.Node]] = {}
        self.local_sizes: dict[fx.Node, list[int]] = {}
        self.module_reads: dict[fx.Node, fx.Node] = {}

    def make(self, op: str, target: Any, args: tuple = (), kwargs: dict | None = None, *, name: str, source: fx.Node) -> fx.Node:
        new = self.graph.create_node(op, target, args, kwargs or {}, name=name)
        stamp(new, PASS, source)
        if STAGE in source.meta:  # a pipeline stage's node: its shards run in that stage (sequence parallel's too)
            new.meta[STAGE] = source.meta[STAGE]
        if "dpcompile_whole" in source.meta:  # dp copies' split: its shards run on the gathered batch too
            new.meta["dpcompile_whole"] = source.meta["dpcompile_whole"]
        return new

    def comm(self, new: fx.Node, source: fx.Node) -> fx.Node:
        for key in ("dpcompile_comm", "dpcompile_comm_numel"):
            if key in source.meta:
                new.meta[key] = source.meta[key]
        return new

    def on_device(self, value: Any, k: int) -> Any:
        def pick(a: fx.Node) -> Any:
            if a in self.local_sizes:
                return self.local_sizes[a][k]
            if a in self.per_device:
                return self.per_device[a][k]
            return self.whole[a]

        return fx.node.map_arg(value, pick)

    def whole_of(self, value: Any) -> Any:
        def pick(a: fx.Node) -> Any:
            if a not in self.whole:
                raise AssertionError(f"'{a.name}' is per-shard where a whole value is needed")
            return self.whole[a]

        return fx.node.map_arg(value, pick)

    def split(self, new: fx.Node, source: fx.Node) -> list[fx.Node]:
        pieces = [self.make("call_function", operator.getitem, (new, k), name=f"{source.name}_dev{k}", source=source) for k in range(self.n)]
        if source.meta.get("dpcompile_sequence") or source.meta.get("dpcompile_sequence_split"):
            for piece in pieces:  # a reduce-scatter's or a split's: sized by the call (not counted by explain)
                piece.meta["dpcompile_sequence_piece"] = True
        return pieces

    def per_device_call(self, node: fx.Node, k: int) -> fx.Node:
        """Device ``k``'s call of ``node``. A module with state called on device ``k``'s values (a norm
        on its sequence slice) whose state lives on another device reads copies of it on device ``k``
        (``call_module_on_device``; its gradients summed back), as a replicated weight's ``copy_to_devices``."""
        args, kwargs, name = self.on_device(node.args, k), self.on_device(node.kwargs, k), f"{node.name}_dev{k}"
        device = str(self.devices[k])
        if node.op != "call_module" or device == self.primary or not _parameters_only(self.gm.get_submodule(str(node.target))):
            return self.make(node.op, node.target, args, kwargs, name=name, source=node)
        if node not in self.module_reads:
            self.module_reads[node] = self.make("get_attr", node.target, name=f"{node.name}_module", source=node)
        return self.make("call_function", tp_runtime.call_module_on_device, (self.module_reads[node], device, *args), kwargs,
                         name=name, source=node)  # fmt: skip

    def build(self) -> fx.Graph:
        for node in self.gm_nodes():
            layout = node.meta.get("dpcompile_layout", REPLICATED)
            target = node.target
            if node.op == "placeholder":
                placeholder = self.graph.node_copy(node)
                if node.users:
                    moved = self.make("call_function", to_device, (placeholder, self.primary), name=f"{node.name}_on_device", source=node)
                    stamp_comm(moved, "broadcast", io=True)
                    self.whole[node] = moved
                else:
                    self.whole[node] = placeholder
            elif node.op == "output":
                out = self.whole_of(node.args[0])
                if self.output_device != self.primary:
                    out = stamp_comm(self.make("call_function", to_device, (out, self.output_device), name="output_moved", source=node), "gather", io=True)
                self.graph.output(out, type_expr=node.type)
            elif node.op == "get_attr" and "dpcompile_shard" in node.meta:
                self.per_device[node] = [
                    self.make("get_attr", f"{target}_shard{k}", name=f"{node.name}_shard{k}", source=node) for k in range(self.n)
                ]
            elif target is collectives.local_size:
                self.local_sizes[node] = list(node.args[0])
            elif target is collectives.local_offset:
                self.local_sizes[node] = ShardSpec(0, tuple(node.args[0])).offsets()
            elif target is collectives.copy_to_shards:
                new = self.make("call_function", tp_runtime.copy_to_devices, (self.whole_of(node.args[0]), self.devices.strings()), name=node.name, source=node)
                self.per_device[node] = self.split(self.comm(new, node), node)
            elif target is collectives.split_to_shards:
                x, dim, sizes = node.args[:3]
                split = tp_runtime.split_sequence_to_devices if node.meta.get("dpcompile_sequence_split") else tp_runtime.split_to_devices
                new = self.make("call_function", split, (self.whole_of(x), dim, list(sizes), self.devices.strings()), name=node.name, source=node)
                self.per_device[node] = self.split(self.comm(new, node), node)
            elif target is collectives.reduce_from_shards:
                new = self.make("call_function", tp_runtime.reduce_to_device, (list(self.per_device[node.args[0]]), self.primary), name=node.name, source=node)
                self.whole[node] = self.comm(new, node)
            elif target is collectives.reduce_scatter_to_shards:
                x, dim, sizes = node.args[:3]
                new = self.make("call_function", tp_runtime.reduce_scatter_to_devices, (list(self.per_device[x]), dim, list(sizes), self.devices.strings()), name=node.name, source=node)
                self.per_device[node] = self.split(self.comm(new, node), node)
            elif target is collectives.all_gather_to_shards:
                x, dim = node.args[:2]
                new = self.make("call_function", tp_runtime.all_gather_to_devices, (list(self.per_device[x]), dim, self.devices.strings()), name=node.name, source=node)
                self.per_device[node] = self.split(self.comm(new, node), node)
            elif target is collectives.linear_of_gathered:
                gathered, x, weight, bias, dim, _sizes, transposed = node.args[:7]
                self.per_device[node] = [
                    _stamp_cols(self.make("call_function", tp_runtime.linear_of_gathered, (
                        self.on_device(gathered, k), list(self.per_device[x]), self.on_device(weight, k),
                        self.on_device(bias, k), dim, transposed), name=f"{node.name}_dev{k}", source=node), node, layout, k)
                    for k in range(self.n)
                ]  # fmt: skip
            elif target is collectives.whole_size:
                x, dim, _sizes, index = node.args[:4]
                self.whole[node] = self.make("call_function", tp_runtime.whole_size, (list(self.per_device[x]), dim, index), name=node.name, source=node)
            elif target is collectives.gather_from_shards:
                x, dim = node.args[:2]
                new = self.make("call_function", tp_runtime.gather_to_device, (list(self.per_device[x]), dim, self.primary), name=node.name, source=node)
                self.whole[node] = self.comm(new, node)
            elif isinstance(layout, (Sharded, Copied)):
                self.per_device[node] = [_stamp_cols(self.per_device_call(node, k), node, layout, k) for k in range(self.n)]
            elif any(a in self.per_device for a in flat_nodes((node.args, node.kwargs))):
                self.whole[node] = self.make(node.op, target, self.on_device(node.args, 0), self.on_device(node.kwargs, 0), name=node.name, source=node)
            else:
                new = self.graph.create_node(node.op, target, self.whole_of(node.args), self.whole_of(node.kwargs), name=node.name, type_expr=node.type)
                new.meta = dict(node.meta)
                self.whole[node] = new
        for new in self.graph.nodes:  # fake tensors of the captured shapes: stale here, and unpicklable
            new.meta.pop("val", None)
            new.meta.pop("tensor_meta", None)
        return self.graph

    def gm_nodes(self) -> Iterable[fx.Node]:
        return list(self.gm.graph.nodes)


def _parameters_only(module: nn.Module) -> bool:
    """Parameters only: a module with buffers (running statistics written in forward) is called as it
    is, its buffers' updates would land in a copy."""
    return any(True for _ in module.parameters()) and not any(True for _ in module.buffers())


def _stamp_cols(new: fx.Node, source: fx.Node, layout: Any, k: int) -> fx.Node:
    """Where shard ``k``'s piece lies (``draw_random_whole`` slices random draws by it), and its rows
    where the value is a micro-batch's."""
    if isinstance(layout, Sharded):  # blocks of a fused projection are no one slice: "sections"
        new.meta["dpcompile_cols"] = (k, layout.dim, tuple(layout.sizes)) if layout.sections == 1 else "sections"
    else:
        new.meta["dpcompile_cols"] = (k, None, None)
    for key in ("dpcompile_rows", "dpcompile_sequence"):  # the sequence: shard_sequence's values
        if key in source.meta:
            new.meta[key] = source.meta[key]
    return new


__all__ = ["PASS", "LinearShards", "expand_shards", "is_shard_collective"]
