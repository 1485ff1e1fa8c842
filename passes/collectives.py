"""``lower_to_collectives``: make one process's program talk to the others through ``torch.distributed``.

The input is the program of *one* rank: the captured model (data parallel) or one shard's
program from ``shard_linear`` (tensor parallel), whose cross-shard steps are call nodes of
``dpcompile.runtime.collectives``. This pass

* swaps each such collective for its ``torch.distributed`` counterpart in
  :mod:`dpcompile.runtime.distributed` (all-reduce, all-gather, Megatron's f), over the
  mesh dimension ``tp_dim``;
* with ``dp_dim``, turns every training-mode ``BatchNorm`` into
  :func:`~dpcompile.runtime.distributed.sync_batch_norm` over that dimension, so batch
  statistics are those of the whole, cross-process batch.

The process groups are state-less :class:`~dpcompile.runtime.distributed.MeshGroup`
submodules (``dp_group``, ``tp_group``) that the generated code names. Each lowered node
keeps its ``Comm`` stamp and records the size of its group in
``node.meta["dpcompile_comm_world"]`` (for ring-algorithm cost figures); a ``sync_batch_norm``
also records what it all-reduces, ``2 * num_features + 1`` elements, in
``node.meta["dpcompile_comm_numel"]``.

Before (data parallel, the captured model)::

    def forward(self, x):
        fc1 = self.fc1(x)
        bn = self.bn(fc1)
        relu = torch.relu(bn)
        return self.fc2(relu)

After ``lower_to_collectives(gm, mesh=mesh, dp_dim="dp")``::

    def forward(self, x):
        dp_group = self.dp_group
        fc1 = self.fc1(x)
        bn = self.bn
        bn_sync = dpcompile_runtime_distributed_sync_batch_norm(bn, fc1, dp_group)
        relu = torch.relu(bn_sync)
        fc2 = self.fc2(relu)
        return fc2

Before (tensor parallel: one shard of ``fc2(relu(fc1(x)))`` from ``shard_linear``, fc1
column, fc2 row)::

    def forward(self, x):
        x_copy = dpcompile_runtime_collectives_copy_to_shards(x)                     # f
        fc1_weight = self.fc1.weight
        fc1_bias = self.fc1.bias
        fc1 = torch._C._nn.linear(x_copy, fc1_weight, fc1_bias)
        relu = torch.relu(fc1)
        fc2_weight = self.fc2.weight
        fc2_partial = torch._C._nn.linear(relu, fc2_weight)
        fc2_all_reduce = dpcompile_runtime_collectives_reduce_from_shards(fc2_partial)   # g
        fc2_bias = self.fc2.bias
        fc2 = add_bias(fc2_all_reduce, fc2_bias)
        return fc2

After ``lower_to_collectives(gm, mesh=mesh, tp_dim="tp")``::

    def forward(self, x):
        tp_group = self.tp_group
        x_copy = dpcompile_runtime_distributed_all_reduce_grad(x, tp_group)
        fc1_weight = self.fc1.weight
        fc1_bias = self.fc1.bias
        fc1 = torch._C._nn.linear(x_copy, fc1_weight, fc1_bias)
        relu = torch.relu(fc1)
        fc2_weight = self.fc2.weight
        fc2_partial = torch._C._nn.linear(relu, fc2_weight)
        fc2_all_reduce = dpcompile_runtime_distributed_all_reduce(fc2_partial, tp_group)
        fc2_bias = self.fc2.bias
        fc2 = add_bias(fc2_all_reduce, fc2_bias)
        return fc2

``gather_from_shards(x, dim, sizes)`` becomes ``all_gather(x, tp_group, dim=, sizes=)``,
``split_to_shards`` becomes ``local_slice`` and ``local_size(sizes)`` becomes
``local_size(sizes, tp_group)``. ``shard_sequence``'s calls (sequence parallel) become
:mod:`dpcompile.runtime.sequence_mesh`'s, sized by the call's own sequence length, read once where
the first value enters the region (``sequence_length = fc2_partial.size(1)``); on gloo the
reduce-scatter is ``reduce_scatter_by_all_reduce`` (faster there than gloo's own); a module run on the rank's
slice (a norm) is called through ``call_summing_grads`` (its parameters' gradients summed over tp). A pass that finds nothing to lower returns
``modified=False``; lowered calls are not found again, so a second run changes nothing.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.fx as fx
from torch import nn

from dpcompile.infra import PassResult, stamp, stamp_comm
from dpcompile.runtime import distributed as dist_rt
from dpcompile.runtime import sequence_mesh as seq_rt
from dpcompile.runtime.distributed import MeshGroup
from passes.sequence_parallel import SEQUENCE_MARK

PASS = "lower_to_collectives"
log = logging.getLogger("dpcompile")

BATCH_NORMS: tuple[type[nn.Module], ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


@dataclass(frozen=True)
class Lowering:
    """How one collective of :mod:`dpcompile.runtime.collectives` becomes a process-group call.

    ``fn`` is called as ``fn(<tensor>, <group>, **{name: argument for name in keep})``
    (``local_size`` as ``fn(sizes, group)``); ``kind`` / ``backward`` are its ``Comm`` stamp.
    """

    fn: Callable[..., Any]
    kind: str
    backward: str | None = None
    keep: tuple[str, ...] = ()


LOWERING: dict[str, Lowering] = {
    "copy_to_shards": Lowering(dist_rt.all_reduce_grad, "identity", "all_reduce"),
    "reduce_from_shards": Lowering(dist_rt.all_reduce, "all_reduce"),
    "gather_from_shards": Lowering(dist_rt.all_gather, "all_gather", None, ("dim", "sizes")),
    "split_to_shards": Lowering(dist_rt.local_slice, "split", "all_gather", ("dim", "sizes")),
    "local_size": Lowering(dist_rt.local_size, "shape", None, ()),
    "local_offset": Lowering(dist_rt.local_offset, "shape", None, ()),
}
"""Keyed by the name of the function in ``dpcompile.runtime.collectives``."""

SEQUENCE_COLLECTIVES = ("reduce_scatter_to_shards", "all_gather_to_shards", "linear_of_gathered", "whole_size")
"""``shard_sequence``'s calls, lowered to :mod:`dpcompile.runtime.sequence_mesh` by the call's own sequence
length (with the splits and gathers ``shard_sequence`` made, see :func:`_is_sequence_node`)."""


@dataclass
class CollectiveSites:
    """What :func:`lower_to_collectives` would rewrite: batch norms and one-shard collectives."""

    batch_norms: list[fx.Node] = field(default_factory=list)
    collectives: list[fx.Node] = field(default_factory=list)
    unknown: list[fx.Node] = field(default_factory=list)


def _is_shard_collective(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    module = getattr(node.target, "__module__", "") or ""
    home = getattr(node.target, "_dpcompile_home", "")
    return module.endswith("runtime.collectives") or str(home).endswith("runtime.collectives")


def _collective_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def find_collective_sites(gm: fx.GraphModule, *, batch_norm: bool = True) -> CollectiveSites:
    """The nodes :func:`lower_to_collectives` rewrites, in graph order."""
    modules = dict(gm.named_modules())
    sites = CollectiveSites()
    for node in gm.graph.nodes:
        if batch_norm and node.op == "call_module" and isinstance(modules.get(node.target), BATCH_NORMS):
            sites.batch_norms.append(node)
        elif _is_shard_collective(node):
            if _collective_name(node) in LOWERING or _collective_name(node) in SEQUENCE_COLLECTIVES:
                sites.collectives.append(node)
            else:
                sites.unknown.append(node)
    return sites


def group_size(mesh: object, dim: str | int | None) -> int | None:
    """How many ranks the mesh dimension ``dim`` (a name or an index) holds; None if unknown."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    index = names.index(dim) if isinstance(dim, str) and dim in names else dim if isinstance(dim, int) else 0
    try:
        return int(mesh.size(index))  # type: ignore[attr-defined]
    except (AttributeError, TypeError, IndexError):
        return None


def _bound_arguments(node: fx.Node) -> dict[str, Any]:
    """The collective call's arguments by name (positional ones bound to the signature)."""
    try:
        signature = inspect.signature(node.target)  # type: ignore[arg-type]
        bound = signature.bind_partial(*node.args, **node.kwargs)
        return dict(bound.arguments)
    except (TypeError, ValueError):
        return {"x": node.args[0] if node.args else None, **node.kwargs}


def _first_tensor_arg(node: fx.Node, arguments: dict[str, Any]) -> Any:
    for value in arguments.values():
        if isinstance(value, fx.Node):
            return value
    return node.args[0]


def _as_literal(value: Any) -> Any:
    """Tuples of sizes print as lists in generated code; everything else as it is."""
    return list(value) if isinstance(value, tuple) else value


def lower_to_collectives(
    gm: fx.GraphModule,
    *,
    mesh: object,
    dp_dim: str | int | None = None,
    tp_dim: str | int | None = None,
    batch_norm: bool = True,
) -> PassResult:
    """Lower one rank's program to ``torch.distributed`` collectives over ``mesh``.

    ``dp_dim`` names the mesh dimension across which the batch is split (BatchNorm gets
    cross-process statistics over it); ``tp_dim`` the one across which ``shard_linear``'s
    shards live (its collectives become process-group collectives over it). Either may be
    None: a 1-D mesh passes one of them (its name, or ``0`` when it is unnamed).

    >>> from torch.distributed.device_mesh import init_device_mesh  # doctest: +SKIP
    >>> mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))  # doctest: +SKIP
    >>> lower_to_collectives(gm, mesh=mesh, dp_dim="dp").modified  # doctest: +SKIP
    True
    """
    sites = find_collective_sites(gm, batch_norm=batch_norm and dp_dim is not None)
    if sites.unknown:
        names = sorted({_collective_name(n) for n in sites.unknown})
        raise NotImplementedError(
            f"lower_to_collectives has no torch.distributed lowering for {names}; "
            f"known collectives: {sorted([*LOWERING, *SEQUENCE_COLLECTIVES])} (add one to passes.collectives.LOWERING)"
        )
    if sites.collectives and tp_dim is None:
        raise ValueError(
            "the program has tensor-parallel collectives but no tp_dim= was given; pass the mesh "
            "dimension the shards live on (its name, or 0 for a 1-D mesh)"
        )
    if not sites.batch_norms and not sites.collectives:
        return PassResult(gm, False, {"batch_norms": [], "collectives": []})
    rewriter = _Rewriter(gm, sites, mesh=mesh, dp_dim=dp_dim, tp_dim=tp_dim)
    gm.graph = rewriter.build()
    lowered_bn, lowered = rewriter.lowered_bn, rewriter.lowered
    return PassResult(gm, True, {"batch_norms": lowered_bn, "collectives": lowered})


class _Rewriter:
    """Copy the graph into a fresh one (so the lowered nodes keep the names they replace)."""

    def __init__(
        self, gm: fx.GraphModule, sites: CollectiveSites, *, mesh: object, dp_dim: str | int | None, tp_dim: str | int | None
    ):
        self.gm = gm
        self.batch_norms = set(sites.batch_norms)
        self.collectives = set(sites.collectives)
        self.groups_needed = [("dp_group", dp_dim)] * bool(sites.batch_norms) + [("tp_group", tp_dim)] * bool(sites.collectives)
        self.mesh = mesh
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.groups: dict[str, fx.Node] = {}
        self.sizes: dict[str, int | None] = {}
        self.lowered_bn: list[str] = []
        self.lowered: list[str] = []
        self.length: fx.Node | None = None  # the call's sequence length, where shard_sequence ran
        self.by_all_reduce: bool | None = None
        self.sizes_node: fx.Node | None = None  # every rank's slice of the call's sequence (random draws)

    def build(self) -> fx.Graph:
        for node in self.gm.graph.nodes:
            if node.op != "placeholder" and len(self.groups) < len(self.groups_needed):
                self._add_groups()
            if node in self.batch_norms:
                self.env[node] = self._batch_norm(node)
            elif node in self.collectives:
                self.env[node] = self._collective(node)
            elif self._module_on_slice(node):
                self.env[node] = self._summing_grads(node)
            else:
                self.env[node] = self.graph.node_copy(node, lambda n: self.env[n])
                self._size_random_piece(self.env[node], node)
        return self.graph

    def _module_on_slice(self, node: fx.Node) -> bool:
        return node.op == "call_module" and bool(node.meta.get(SEQUENCE_MARK)) and any(
            p.requires_grad for p in self.gm.get_submodule(str(node.target)).parameters())  # fmt: skip

    def _summing_grads(self, node: fx.Node) -> fx.Node:
        """A module run on this rank's sequence slice (a norm) sees its tokens' part of its parameters'
        gradient: called with them through ``all_reduce_grad``, so each rank gets the whole sum."""
        module = stamp(self.graph.create_node("get_attr", str(node.target), name=f"{node.name}_module"), PASS, node)
        args = tuple(self.env[a] if isinstance(a, fx.Node) else a for a in node.args)
        kwargs = {k: self.env[v] if isinstance(v, fx.Node) else v for k, v in node.kwargs.items()}
        call = self.graph.create_node("call_function", seq_rt.call_summing_grads, (module, self.groups["tp_group"], *args),
                                      kwargs, name=node.name)  # fmt: skip
        call.meta.update(node.meta)
        self.lowered.append(f"{node.target} -> call_summing_grads")
        return stamp_comm(stamp(call, PASS, node), "identity", backward="all_reduce")

    def _size_random_piece(self, new: fx.Node, node: fx.Node) -> None:
        """A random draw on this rank's sequence slice (``exact_random``): its ``cols`` name the call's
        slices (``sequence_sizes``), not the example's."""
        cols = new.kwargs.get("cols")
        if self.length is None or not node.meta.get(SEQUENCE_MARK) or not (isinstance(cols, tuple) and cols[1] is not None):
            return
        if self.sizes_node is None:
            with self.graph.inserting_after(self.length):
                self.sizes_node = self.graph.call_function(seq_rt.sequence_sizes, (self.length, self.groups["tp_group"]))
            self.sizes_node.name = "sequence_sizes"
            stamp(self.sizes_node, PASS, node)
        new.kwargs = {**new.kwargs, "cols": (cols[0], cols[1], self.sizes_node)}

    def _add_groups(self) -> None:
        for name, dim in self.groups_needed:
            if not isinstance(getattr(self.gm, name, None), MeshGroup):
                self.gm.add_submodule(name, MeshGroup(self.mesh, dim))
            self.groups[name] = stamp(self.graph.get_attr(name), PASS)
            self.sizes[name] = group_size(self.mesh, dim)

    def _stamp_size(self, call: fx.Node, group: str) -> None:
        if self.sizes.get(group) is not None:
            call.meta["dpcompile_comm_world"] = self.sizes[group]

    def _batch_norm(self, node: fx.Node) -> fx.Node:
        module_ref = stamp(self.graph.create_node("get_attr", node.target, name=node.name), PASS, node)
        x = self.env[node.args[0]]  # type: ignore[index]
        call = self.graph.create_node(
            "call_function", dist_rt.sync_batch_norm, (module_ref, x, self.groups["dp_group"]), name=f"{node.name}_sync"
        )
        call.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", "stack_trace")})
        # What it all-reduces: per-channel sums and the count, then per-channel squared deviations
        call.meta["dpcompile_comm_numel"] = 2 * int(self.gm.get_submodule(node.target).num_features) + 1
        self.lowered_bn.append(str(node.target))
        self._stamp_size(call, "dp_group")
        return stamp_comm(stamp(call, PASS, node), "all_reduce", backward="all_reduce")

    def _collective(self, node: fx.Node) -> fx.Node:
        if _is_sequence_node(node):
            return self._sequence_collective(node)
        name = _collective_name(node)
        rule = LOWERING[name]
        group = self.groups["tp_group"]
        arguments = _bound_arguments(node)
        if rule.kind == "shape":  # local_size / local_offset: (sizes, group), an int
            sizes = arguments.get("sizes", node.args[0] if node.args else None)
            args: tuple[Any, ...] = (_as_literal(sizes), group)
            kwargs: dict[str, Any] = {}
        else:
            args = (self.env[_first_tensor_arg(node, arguments)], group)
            kwargs = {k: _as_literal(arguments[k]) for k in rule.keep if k in arguments}
        call = self.graph.create_node("call_function", rule.fn, args, kwargs, name=node.name)
        call.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", "dpcompile_source", "stack_trace")})
        self.lowered.append(f"{name} -> {rule.fn.__name__}")
        self._stamp_size(call, "tp_group")
        return stamp_comm(stamp(call, PASS, node), rule.kind, backward=rule.backward)

    def _sequence_collective(self, node: fx.Node) -> fx.Node:
        """``shard_sequence``'s calls, sized by the call's own sequence length: the first value that
        enters the region (a row layer's partial sum, a sliced input) gives ``sequence_length``."""
        name, args, group = _collective_name(node), node.args, self.groups["tp_group"]
        if name in ("reduce_scatter_to_shards", "split_to_shards") and self.length is None:
            self.length = self.graph.call_method("size", (self.env[args[0]], args[1]))
            self.length.name = "sequence_length"
            stamp(self.length, PASS, node)
        if self.length is None:
            raise NotImplementedError(f"{node.name}: a sequence-parallel gather before any value entered the region")
        env = lambda a: self.env[a] if isinstance(a, fx.Node) else a  # noqa: E731
        kind, backward = "all_gather", "reduce_scatter"
        by_all_reduce = self.reduce_scatter_by_all_reduce()
        if name == "reduce_scatter_to_shards":
            fn = seq_rt.reduce_scatter_by_all_reduce if by_all_reduce else seq_rt.reduce_scatter
            new_args, kwargs = (env(args[0]), group, args[1]), {}
            kind, backward = ("all_reduce" if by_all_reduce else "reduce_scatter"), "all_gather"
        elif name == "all_gather_to_shards":
            fn, new_args = seq_rt.all_gather_sequence, (env(args[0]), group, args[1], self.length)
            kwargs = {"by_all_reduce": True} if by_all_reduce else {}
            backward = "all_reduce" if by_all_reduce else "reduce_scatter"
        elif name == "gather_from_shards":
            fn, new_args, kwargs, backward = seq_rt.gather_sequence, (env(args[0]), group, args[1], self.length), {}, None
        elif name == "split_to_shards":
            fn, new_args, kwargs, kind = seq_rt.sequence_slice, (env(args[0]), group, args[1]), {}, "split"
            backward = "all_gather"
        elif name == "linear_of_gathered":  # (gathered, x, weight, bias, dim, sizes, transposed)
            gathered, x, weight, bias, dim, _, transposed = args
            fn = seq_rt.linear_of_gathered
            new_args, kwargs = (env(gathered), env(x), env(weight), env(bias), group, dim, self.length, transposed), {}
            kind, backward = "identity", "all_gather"
        else:  # whole_size: (x, dim, sizes, index), no communication
            fn, new_args, kwargs = seq_rt.whole_size, (env(args[0]), args[1], self.length, args[3]), {}
        call = self.graph.create_node("call_function", fn, new_args, kwargs, name=node.name)
        call.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", "dpcompile_source", "stack_trace")})
        self.lowered.append(f"{name} -> {fn.__name__}")
        if name == "whole_size":
            return stamp(call, PASS, node)
        self._stamp_size(call, "tp_group")
        return stamp_comm(stamp(call, PASS, node), kind, backward=backward)

    def reduce_scatter_by_all_reduce(self) -> bool:
        """Anything but nccl: an all-reduce of which each rank keeps its slice, not the backend's own
        reduce-scatter (gloo's measured slower, ``benchmarks/bench_sequence_parallel_mesh.py``)."""
        if self.by_all_reduce is None:
            try:
                backend = dist.get_backend(self.gm.get_submodule("tp_group").group)
            except (AttributeError, RuntimeError, ValueError):
                backend = "gloo"
            self.by_all_reduce = str(backend) != "nccl"
        return self.by_all_reduce


def _is_sequence_node(node: fx.Node) -> bool:
    """A call ``shard_sequence`` made: its own collectives, and the sequence splits and gathers."""
    name = _collective_name(node)
    if name in SEQUENCE_COLLECTIVES:
        return True
    return name in ("split_to_shards", "gather_from_shards") and node.meta.get("dpcompile_pass") == "shard_sequence"
