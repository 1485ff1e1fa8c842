"""``insert_scatter_gather``: rewrite a single-device graph into explicit per-device code.

Before (the captured model)::

    def forward(self, x):
        fc1 = self.fc1(x)
        relu = torch.relu(fc1)
        loss = relu.mean()
        return self.fc2(relu), loss

After, on ``["cpu", "cpu"]``::

    def forward(self, x):
        fc1_src = self.fc1
        fc2_src = self.fc2
        replicas = dpcompile_runtime_replicate({'fc1': fc1_src, 'fc2': fc2_src}, ['cpu', 'cpu'], include_source=True)
        replica_dev0 = replicas[0]
        replica_dev1 = replicas[1]
        x_scatter = dpcompile_runtime_scatter(x, ['cpu', 'cpu'], 0)
        x_dev0 = x_scatter[0]
        x_dev1 = x_scatter[1]
        fc1_dev0 = replica_dev0.fc1(x_dev0)
        fc1_dev1 = replica_dev1.fc1(x_dev1)
        relu_dev0 = torch.relu(fc1_dev0)
        relu_dev1 = torch.relu(fc1_dev1)
        fc2_dev0 = replica_dev0.fc2(relu_dev0)
        fc2_dev1 = replica_dev1.fc2(relu_dev1)
        mean_sum_dev0 = relu_dev0.sum()                    # partial sums ...
        mean_count_dev0 = dpcompile_runtime_numel(relu_dev0)
        ...
        fc2 = dpcompile_runtime_gather([fc2_dev0, fc2_dev1], 0, 'cpu')
        mean = dpcompile_runtime_mean_of_partials([mean_sum_dev0, mean_sum_dev1], [mean_count_dev0, mean_count_dev1], 'cpu')
        return (fc2, mean)

Device 0 runs the user's own modules, read through ``replica_dev0``; device ``k`` runs
``replica_devk``, made once at the head of forward: an alias of the originals on a virtual
device (nothing copied), a copy on a distinct GPU (one coalesced, differentiable broadcast).
Every device looks its modules up in its root, in plain attribute reads. Where a value must be whole (an op
with no batch rule, an output) the split ends with a gather; per-device partial sums end
with a reduction.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from dpcompile import runtime
from dpcompile.analysis.batch_dims import propagate
from dpcompile.analysis.batch_positions import batch_arange_size, index_positions, running_sum_dim, table_rows
from dpcompile.analysis.batch_rules.reductions import bind_loss, loss_kwargs_of_module
from dpcompile.analysis.batch_rules.shape import squeeze_keeps
from dpcompile.analysis.batch_rules.structures import builds_returned_structure
from dpcompile.analysis.ops import BATCH_NORMS, LOSS_FUNCTIONS, LOSS_MODULES
from dpcompile.analysis.placement import (
    Partial,
    Placement,
    Replicated,
    Split,
    Tuple,
    Whole,
)
from dpcompile.analysis.sequence_exchange import is_sequence_marker
from dpcompile.devices import Devices
from dpcompile.infra import PassResult, replace_graph, stamp, stamp_comm
from dpcompile.runtime import tensor_parallel as tp_runtime
from passes.data_parallel_grad import emit_grad_over_devices, is_autograd_grad
from passes.data_parallel_nodes import (
    gather_dims,
    has_side_effect,
    is_pad_packed,
    is_pure_read,
    is_training_batch_norm_function,
    is_view,
    names_read_from,
    packed_lengths,
    stamp_rows,
)
from passes.functionalize import refuse_lost_writes

PASS = "insert_scatter_gather"


def insert_scatter_gather(
    gm: fx.GraphModule,
    *,
    devices: Devices,
    input_dims: Mapping[str, int | None],
    output_device: torch.device | None = None,
    copy_replicas: bool = False,
) -> PassResult:
    """Make every cross-device step of data parallelism an explicit node.

    ``input_dims`` says how each placeholder is split (``None``: replicated). With
    ``copy_replicas`` every device gets its own replica even where it shares memory with
    ``devices[0]`` (virtual devices), which exercises the multi-GPU code path on a CPU.
    """
    placements = propagate(gm, input_dims)
    if len(devices) > 1:  # one device splits nothing: every write lands where eager's does
        refuse_lost_writes(gm, placements)
    builder = _Builder(gm, devices, placements, output_device or devices.primary, copy_replicas)
    replace_graph(gm, builder.build())
    return PassResult(gm, True, {"placements": {n.name: p for n, p in placements.items()}, "input_dims": dict(input_dims)})


class _Builder:
    def __init__(
        self,
        gm: fx.GraphModule,
        devices: Devices,
        placements: Mapping[fx.Node, Placement],
        output_device: torch.device,
        copy_replicas: bool,
    ):
        self.gm = gm
        self.devices = devices
        self.n = len(devices)
        self.placements = placements
        self.output_device = output_device
        self.modules = dict(gm.named_modules())
        self.graph = fx.Graph()
        # device 0 runs the user's modules; every other device runs its replica (an alias of
        # the original on a virtual device, a copy on a distinct GPU)
        self.uses_replica = [k > 0 for k in range(self.n)]
        self.copy_replicas = copy_replicas
        self.per_device: dict[fx.Node, list[Any]] = {}
        self.whole: dict[fx.Node, Any] = {}
        self.moved: dict[tuple[fx.Node, int], Any] = {}  # a whole value's copy on device k
        self.inputs_on_primary: dict[fx.Node, fx.Node] = {}
        self.max_lengths: dict[fx.Node, fx.Node] = {}
        self.partials: dict[fx.Node, tuple[str, list[Any], list[Any]]] = {}
        self.replica_roots: dict[int, fx.Node] = {}
        self.primary = str(devices.primary)

    # ------------------------------------------------------------------ helpers
    def node(self, op: str, target: Any, args=(), kwargs=None, *, name: str, source: fx.Node | None = None) -> fx.Node:
        new = self.graph.create_node(op, target, tuple(args), dict(kwargs or {}), name=name)
        return stamp(new, PASS, source)

    def call(self, fn, args=(), kwargs=None, *, name: str, source: fx.Node | None = None) -> fx.Node:
        return self.node("call_function", fn, args, kwargs, name=name, source=source)

    def device_str(self, k: int) -> str:
        return str(self.devices[k])

    # ------------------------------------------------------------------ build
    def build(self) -> fx.Graph:
        nodes = list(self.gm.graph.nodes)
        for node in nodes:
            if node.op == "placeholder":
                copy = self.graph.node_copy(node)
                self.whole[node] = copy
        self._emit_replicas(nodes)
        for node in nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                self._emit_output(node)
                continue
            placement = self.placements[node]
            if is_sequence_marker(node) and len(self.devices) > 1:
                self._emit_exchange(node, placement)
            elif isinstance(placement, Whole):
                if not (is_autograd_grad(node) and emit_grad_over_devices(self, node) is not None):
                    self._emit_whole(node)
            elif isinstance(placement, Partial):
                self._emit_partial(node, placement)
            elif node.op == "call_module" and isinstance(self.modules.get(node.target), BATCH_NORMS):
                self._emit_batch_norm(node)
            elif is_training_batch_norm_function(node):
                self._emit_functional_batch_norm(node)
            else:
                self._emit_per_device(node, placement)
        self._drop_unused()
        return self.graph

    def _drop_unused(self) -> None:
        """Remove what the program computes but never reads: shape reads made per device for an
        op that then ran whole, and replicas (or parts of them) no device runs, which on
        distinct GPUs would cost a broadcast of their weights every step."""
        for node in reversed(list(self.graph.nodes)):
            if not node.users and is_pure_read(node):
                self.graph.erase_node(node)
        replicas = next((n for n in self.graph.nodes if n.target is runtime.replicate), None)
        if replicas is None:
            return
        used = {name for root in self.replica_roots.values() for name in names_read_from(root)}
        roots: dict[str, fx.Node] = replicas.args[0]
        if not used:
            for user in list(replicas.users):
                self.graph.erase_node(user)
            self.graph.erase_node(replicas)
        elif "*" not in used:
            replicas.args = ({name: src for name, src in roots.items() if name in used}, *replicas.args[1:])
        for src in roots.values():
            if not src.users:
                self.graph.erase_node(src)

    def _emit_replicas(self, nodes: list[fx.Node]) -> None:
        if self.n < 2:
            return
        roots: dict[str, fx.Node] = {}
        for node in nodes:
            if node.op in ("call_module", "get_attr"):
                top = node.target.split(".")[0]
                if top not in roots:
                    roots[top] = self.node("get_attr", top, name=f"{top}_src")
        options = {"copy": True} if self.copy_replicas else {}
        replicas = self.call(
            runtime.replicate, (roots, self.devices.strings()), {**options, "include_source": True}, name="replicas"
        )
        stamp_comm(replicas, "broadcast", backward="reduce")
        for k in range(self.n):
            self.replica_roots[k] = self.call(operator.getitem, (replicas, k), name=f"replica_dev{k}")

    # ------------------------------------------------------------------ values
    def on_device(self, value: Any, k: int) -> Any:
        """The per-device version of an argument for device ``k``."""
        return fx.node.map_arg(value, lambda n: self._node_on_device(n, k))

    def _node_on_device(self, node: fx.Node, k: int) -> Any:
        placement = self.placements.get(node)
        if node.op == "placeholder":
            return self._placeholder_on_device(node, k)
        if node in self.per_device and not isinstance(placement, Partial):
            return self.per_device[node][k]
        if isinstance(placement, Whole) and placement.batch and self.n > 1:  # on one device the whole is its part
            raise AssertionError(f"{node.name} is whole along the batch and cannot feed device {k}")
        key = (node, k)
        if key not in self.moved:
            whole = self.whole_value(node)
            if self._same_place(k):
                self.moved[key] = whole
            else:
                self.moved[key] = stamp_comm(
                    self.call(runtime.to_device, (whole, self.device_str(k)), name=f"{node.name}_dev{k}", source=node),
                    "broadcast",
                    backward="reduce",
                )
        return self.moved[key]

    def _same_place(self, k: int) -> bool:
        """Whether device ``k`` holds the primary's tensors as they are (a virtual device)."""
        return k == 0 or (not self.copy_replicas and self.devices.shares_memory_with_primary(k))

    def _placeholder_on_device(self, node: fx.Node, k: int) -> Any:
        if node not in self.per_device:
            placement = self.placements[node]
            source = self.whole[node]
            if isinstance(placement, Split):
                scattered = self.call(
                    runtime.scatter, (source, self.devices.strings(), placement.dim), name=f"{node.name}_scatter", source=node
                )
                stamp_comm(scattered, "scatter", io=True, backward="gather")
                self.per_device[node] = [
                    self.call(operator.getitem, (scattered, i), name=f"{node.name}_dev{i}", source=node)
                    for i in range(self.n)
                ]
            else:
                copies: dict[str, fx.Node] = {}
                values = []
                for i in range(self.n):
                    where = self.device_str(i)
                    if where not in copies or not self._same_place(i):
                        copies[where] = stamp_comm(
                            self.call(runtime.to_device, (source, where), name=f"{node.name}_dev{i}", source=node),
                            "broadcast",
                            io=True,
                            backward="reduce",
                        )
                    values.append(copies[where])
                self.per_device[node] = values
        return self.per_device[node][k]

    def whole_value(self, node: fx.Node) -> Any:
        """The value of ``node`` for the whole batch, on the primary device."""
        if node in self.whole and node.op != "placeholder":
            return self.whole[node]
        placement = self.placements[node]
        if node.op == "placeholder":
            if node not in self.inputs_on_primary:
                self.inputs_on_primary[node] = self.call(
                    runtime.to_device, (self.whole[node], self.primary), name=f"{node.name}_whole", source=node
                )
            return self.inputs_on_primary[node]
        if isinstance(placement, Partial):
            value = self._combine(node, self.primary)
        elif isinstance(placement, Replicated):
            value = self.per_device[node][0]
        elif (dims := gather_dims(placement)) is not None:
            value = self._gather_or_recompute(node, dims)
        else:  # batch sizes and packed sequences: recompute from whole inputs
            value = self._emit_whole(node, record=False)
        self.whole[node] = value
        return value

    def _gather_or_recompute(self, node: fx.Node, dims: Any) -> fx.Node:
        """Views of a split value are recomputed from its gathered source, not gathered again."""
        sources = [n for n in node.all_input_nodes if not isinstance(self.placements.get(n), Replicated)]
        if is_view(node) and len(sources) == 1 and sources[0] in self.per_device:
            return self._emit_whole(node, record=False)
        gathered = self.call(
            runtime.gather, (list(self.per_device[node]), dims, self.primary), name=node.name, source=node
        )
        return stamp_comm(gathered, "gather", backward="scatter")

    # ------------------------------------------------------------------ emitters
    def _emit_whole(self, node: fx.Node, record: bool = True) -> fx.Node:
        read = node.args[1:] if node.target is runtime.write_back else node.args
        args = fx.node.map_arg(read, self.whole_value)
        if node.target is runtime.write_back:  # into the caller's own tensor, wherever it lies
            args = (self.whole[node.args[0]], *args)
        kwargs = fx.node.map_arg(node.kwargs, self.whole_value)
        new = self.node(node.op, node.target, args, kwargs, name=node.name if record else f"{node.name}_whole", source=node)
        placement = self.placements.get(node)
        if isinstance(placement, Whole) and placement.batch and not builds_returned_structure(node):
            new.meta["dpcompile_whole"] = placement.reason or "runs on the gathered batch"
        elif not record:
            new.meta["dpcompile_whole"] = "recomputed on the gathered batch"
        if record:
            self.whole[node] = new
        return new

    def _emit_exchange(self, node: fx.Node, placement: Placement) -> None:
        """Context parallelism's markers: keys and values all-gathered along the sequence
        (``gather_sequence``), a mask's query rows scattered (nothing where already split)."""
        value, dim = node.args[0], node.args[1]
        split = self.placements.get(value)
        if isinstance(placement, Whole) and placement.batch:
            self._emit_whole(node)
        elif node.target is runtime.sequence_split:
            if isinstance(split, Split) and split.dim == dim:
                self.per_device[node] = list(self.per_device[value])
                return
            scattered = self.call(
                runtime.scatter, (self.whole_value(value), self.devices.strings(), dim), name=f"{node.name}_scatter", source=node
            )
            stamp_comm(scattered, "scatter", backward="gather")
            self.per_device[node] = [
                self.call(operator.getitem, (scattered, k), name=f"{node.name}_dev{k}", source=node) for k in range(self.n)
            ]
        elif isinstance(split, Split) and value in self.per_device:
            gathered = self.call(runtime.gather_sequence, (list(self.per_device[value]), dim, self.primary), name=node.name, source=node)
            self.whole[node] = stamp_comm(gathered, "all_gather", backward="reduce_scatter")
        elif isinstance(placement, Replicated):
            self.per_device[node] = [self.on_device(value, k) for k in range(self.n)]
        else:
            self.whole[node] = self.whole_value(value)

    def _emit_per_device(self, node: fx.Node, placement: Placement) -> None:
        values: list[Any] = []
        split = isinstance(placement, Split)
        arange_size = batch_arange_size(node, self.placements) if split else None
        rows = table_rows(node, self.placements) if split else None
        positions = index_positions(node, self.placements) if split and node.op == "call_function" else None
        keep = squeeze_keeps(node, self.placements) if split else None
        running = running_sum_dim(node, self.placements) if split else None
        for k in range(self.n):
            # a value the same on every device is computed once per physical device; module
            # state is still read from each device's replica, as on distinct GPUs
            if (
                isinstance(placement, Replicated)
                and k > 0
                and self._same_place(k)
                and node.op != "get_attr"
                and not has_side_effect(node)
            ):
                values.append(values[0])
                continue
            args = self.on_device(node.args, k)
            kwargs = self.on_device(node.kwargs, k)
            name = f"{node.name}_dev{k}"
            if node.op == "get_attr":
                values.append(self._attr_on_device(node, k))
                continue
            if node.op == "call_module" and k in self.replica_roots:
                values.append(self.node("call_method", node.target, (self.replica_roots[k], *args), kwargs, name=name, source=node))
                stamp_rows(values[-1], placement, k)
                continue
            if is_pad_packed(node):
                kwargs = self._with_total_length(node, kwargs)
            if arange_size is not None:  # device k's slice of arange(B): its rows' positions in the batch
                sizes = [self.on_device(arange_size, j) for j in range(self.n)]
                values.append(self.call(runtime.batch_arange, (sizes, k), kwargs, name=name, source=node))
                continue
            if rows is not None:  # table[:size] of a split size: device k's own rows of the table
                sizes = [self.on_device(rows[1], j) for j in range(self.n)]
                values.append(self.call(runtime.rows_of_shard, (args[0], rows[0], sizes, k), name=name, source=node))
                continue
            if running is not None:  # cumsum along the split dim: the earlier devices' totals added
                dtype = {"dtype": args[2] if len(args) > 2 else kwargs.get("dtype")} if len(args) > 2 or "dtype" in kwargs else {}
                earlier = [self.on_device(node.args[0], j) for j in range(k)]
                values.append(self.call(runtime.running_sum, (args[0], earlier, running), dtype, name=name, source=node))
                continue
            if positions is not None:
                args = self._rows_of_device(node, args, positions, k)
            if keep is not None:  # squeeze() would drop the batch dim of a chunk of one sample
                values.append(self.call(runtime.squeeze_except, (args[0], keep), name=name, source=node))
                continue
            values.append(stamp_rows(self.node(node.op, node.target, args, kwargs, name=name, source=node), placement, k))
        self.per_device[node] = values

    def _rows_of_device(self, node: fx.Node, args: tuple, positions: tuple[int, fx.Node], k: int) -> tuple:
        """``h[positions, i]`` on device ``k``: positions in the batch made rows of its own chunk."""
        slot, arange = positions
        size = batch_arange_size(arange, self.placements)
        sizes = [self.on_device(size, j) for j in range(self.n)]
        indices = list(args[1])
        indices[slot] = self.call(runtime.local_positions, (indices[slot], sizes, k), name=f"{node.name}_rows_dev{k}", source=node)
        return (args[0], type(args[1])(indices), *args[2:])

    def _attr_on_device(self, node: fx.Node, k: int) -> fx.Node:
        if self.uses_replica[k]:
            value: fx.Node = self.replica_roots[k]
            for atom in node.target.split("."):
                value = self.call(getattr, (value, atom), name=f"{atom}_dev{k}", source=node)
            module = self.modules.get(node.target)
            if module is not None and module._modules:  # handed on whole: the module, not its view
                value = self.call(runtime.module_of, (value,), name=f"{value.name}_module", source=node)
            return value
        if node not in self.whole:
            self.whole[node] = self.node("get_attr", node.target, name=node.name, source=node)
        return self.whole[node]

    def _emit_batch_norm(self, node: fx.Node) -> None:
        module_ref = self.node("get_attr", node.target, name=f"{node.name}_module", source=node)
        chunks = [self.on_device(node.args[0], k) for k in range(self.n)]
        normed = self.call(runtime.batch_norm, (module_ref, chunks), name=f"{node.name}_sync", source=node)
        stamp_comm(normed, "all_reduce", backward="all_reduce")
        self.per_device[node] = [
            self.call(operator.getitem, (normed, k), name=f"{node.name}_dev{k}", source=node) for k in range(self.n)
        ]

    def _emit_functional_batch_norm(self, node: fx.Node) -> None:
        """``F.batch_norm(x, ..., training=True, ...)`` (timm's BatchNormAct2d) with the whole
        batch's statistics, as a BatchNorm module gets them."""
        if node.target is F.batch_norm:
            bound = inspect.signature(F.batch_norm).bind(*node.args, **node.kwargs)
            bound.apply_defaults()
            a = bound.arguments
        else:  # aten.batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, ...)
            a = dict(zip(("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps"), node.args))
        chunks = [self.on_device(a["input"], k) for k in range(self.n)]
        names = ("running_mean", "running_var", "weight", "bias")
        state = [self.whole_value(a[v]) if isinstance(a[v], fx.Node) else a[v] for v in names]
        mode = () if a["training"] is True else (self.whole_value(a["training"]),)  # the module's, read at run time
        normed = self.call(
            runtime.functional_batch_norm, (chunks, *state, a["momentum"], a["eps"], *mode), name=f"{node.name}_sync", source=node
        )
        stamp_comm(normed, "all_reduce", backward="all_reduce")
        self.per_device[node] = [
            self.call(operator.getitem, (normed, k), name=f"{node.name}_dev{k}", source=node) for k in range(self.n)
        ]

    def _emit_partial(self, node: fx.Node, placement: Partial) -> None:
        sums, counts = [], []
        for k in range(self.n):
            args = self.on_device(node.args, k)
            kwargs = self.on_device(node.kwargs, k)
            name = f"{node.name}_dev{k}"
            if placement.kind == "sum":
                sums.append(self.node(node.op, node.target, args, kwargs, name=name, source=node))
            elif placement.kind == "mean":
                target = "sum" if node.op == "call_method" else torch.sum
                sums.append(self.node(node.op, target, args, kwargs, name=f"{node.name}_sum_dev{k}", source=node))
                counts.append(self._mean_count(node, args, kwargs, k))
            else:  # a loss with reduction="mean"
                total, count = self._loss_partial(node, args, kwargs, k)
                sums.append(total)
                counts.append(count)
        self.partials[node] = (placement.kind, sums, counts)
        self.per_device[node] = sums

    def _mean_count(self, node: fx.Node, args: tuple, kwargs: dict, k: int) -> fx.Node:
        x = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if dim is None:
            return self.call(runtime.numel, (x,), name=f"{node.name}_count_dev{k}", source=node)
        return self.call(runtime.numel_over, (x, dim), name=f"{node.name}_count_dev{k}", source=node)

    def _loss_partial(self, node: fx.Node, args: tuple, kwargs: dict, k: int) -> tuple[fx.Node, fx.Node]:
        if node.op == "call_function" and node.target is tp_runtime.cross_entropy_from_parts:
            return self._vocab_loss_partial(node, args, kwargs, k)
        if node.op == "call_module":
            module = self.modules[node.target]
            fn = LOSS_MODULES[type(module)]
            settings = loss_kwargs_of_module(module)
            for tensor_name in ("weight", "pos_weight"):
                if getattr(module, tensor_name, None) is not None:
                    settings[tensor_name] = self._module_tensor_on_device(node, tensor_name, k)
            bound = bind_loss(fn, args, {**kwargs, **settings})
        else:
            fn = node.target
            bound = bind_loss(fn, args, kwargs)
        assert bound is not None
        inputs = list(bound.arguments.values())
        defaults = {p.name: p.default for p in inspect.signature(fn).parameters.values()}
        options = {
            name: value
            for name, value in list(bound.arguments.items())[2:]
            if name not in ("reduction", "size_average", "reduce") and value is not defaults.get(name) and value != defaults.get(name)
        }
        total = self.call(fn, tuple(inputs[:2]), {**options, "reduction": "sum"}, name=f"{node.name}_sum_dev{k}", source=node)
        if LOSS_FUNCTIONS.get(fn) == "class":  # the others (batch_rules.losses) average every element
            count = self.call(
                runtime.target_weight,
                (inputs[1], bound.arguments.get("weight"), bound.arguments.get("ignore_index", -100)),
                name=f"{node.name}_count_dev{k}",
                source=node,
            )
        else:
            count = self.call(runtime.numel, (inputs[0],), name=f"{node.name}_count_dev{k}", source=node)
        return total, count

    def _vocab_loss_partial(self, node: fx.Node, args: tuple, kwargs: dict, k: int) -> tuple[fx.Node, fx.Node]:
        """A vocab-parallel mean cross-entropy: this device's sum over its rows, and its count of valid targets."""
        a = bind_loss(tp_runtime.cross_entropy_from_parts, args, kwargs).arguments  # type: ignore[union-attr]
        parts, ignore_index = (a["lse_parts"], a["target_logit"], a["target"]), a["ignore_index"]
        total = self.call(tp_runtime.cross_entropy_from_parts, parts, {"reduction": "sum", "ignore_index": ignore_index},
                          name=f"{node.name}_sum_dev{k}", source=node)  # fmt: skip
        count = self.call(runtime.target_weight, (a["target"], None, ignore_index), name=f"{node.name}_count_dev{k}", source=node)
        return total, count

    def _module_tensor_on_device(self, node: fx.Node, attr: str, k: int) -> fx.Node:
        if self.uses_replica[k]:
            value: fx.Node = self.replica_roots[k]
            for atom in [*node.target.split("."), attr]:
                value = self.call(getattr, (value, atom), name=f"{atom}_dev{k}", source=node)
            return value
        return self.node("get_attr", f"{node.target}.{attr}", name=f"{node.name}_{attr}", source=node)

    def _combine(self, node: fx.Node, device: str) -> fx.Node:
        kind, sums, counts = self.partials[node]
        if kind == "sum":
            combined = self.call(runtime.reduce_add, (sums, device), name=node.name, source=node)
        else:
            combined = self.call(runtime.mean_of_partials, (sums, counts, device), name=node.name, source=node)
        return stamp_comm(combined, "reduce", backward="broadcast")

    def _with_total_length(self, node: fx.Node, kwargs: dict) -> dict:
        """Pad every chunk to the whole batch's longest sequence, as the single-device run does."""
        given = node.args[3] if len(node.args) > 3 else node.kwargs.get("total_length")
        if given is not None:
            return kwargs
        lengths = packed_lengths(node)
        if lengths is None:
            return kwargs
        if lengths not in self.max_lengths:
            self.max_lengths[lengths] = self.call(
                runtime.max_length, (self.whole_value(lengths),), name="max_length", source=node
            )
        return {**kwargs, "total_length": self.max_lengths[lengths]}

    def _emit_output(self, node: fx.Node) -> None:
        def finish(n: fx.Node) -> Any:
            placement = self.placements[n]
            target = str(self.output_device)
            if isinstance(placement, Partial):
                return self._combine(n, target)
            if isinstance(placement, (Split, Tuple)) and (dims := gather_dims(placement)) is not None and n.op != "placeholder":
                gathered = self.call(runtime.gather, (list(self.per_device[n]), dims, target), name=n.name, source=n)
                return stamp_comm(gathered, "gather", io=True, backward="scatter")
            value = self.whole_value(n)
            if target != self.primary or n.op == "placeholder":
                moved = self.call(runtime.to_device, (value, target), name=f"{n.name}_out", source=n)
                return stamp_comm(moved, "gather", io=True)
            return value

        self.graph.output(fx.node.map_arg(node.args[0], finish), type_expr=node.type)
