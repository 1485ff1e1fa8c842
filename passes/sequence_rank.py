"""``lower_sequence_to_rank``: one ``cp`` rank's program, cut from context parallel's program over virtual devices.

Context parallel over a ``DeviceMesh`` lowers the same marked program as in one process
(``insert_sequence_exchange`` → ``insert_scatter_gather`` over ``N`` virtual devices →
``regather_keys_values``), then keeps device ``r``'s nodes and every node all devices share, and
turns each cross-device step into a collective over the mesh's ``cp`` group:

=================================================  ==================================================
one process (device ``r`` of ``N``)                 rank ``r`` of the ``cp`` group
=================================================  ==================================================
``scatter(input, devices, 1)[r]``                   the input itself (each rank passes its own shard)
``scatter(whole, devices, dim)[r]``                 ``shard_of_whole(whole, cp_group, dim)``
``to_device(input, device)`` (a split input whole)  ``gather_over_group(input, cp_group, dim)``
``gather([x_0, ...], dim, device)``                 ``gather_over_group(x_r, cp_group, dim)``; an output: ``x_r``
``gather_sequence([x_0, ...], dim, device)``        ``gather_onto_owners(x_r, cp_group, dim)``
``attention_regathered(q, [k_0, ...], [v_0, ...])``  ``attention_over_group(q, k_r, v_r, cp_group, dim, sizes)``
``ring_attention(q, [k_0, ...], [v_0, ...], ...)``    ``ring_attention_over_group(q, k_r, v_r, cp_group, dim, sizes)``
``balanced_attention([q_0, ...], ...)``, rows back   ``balanced_attention_over_group(q_r, k_r, v_r, ...)``
``batch_arange([s_0, ...], r)`` (and its kin)       ``batch_arange(sequence_sizes(s_r, cp_group), r)``
``mean_of_partials`` / ``reduce_add``                ``mean_over_group`` / ``all_reduce``
``mean_of_partials`` to a scalar, ``("dp", "cp")``   ``mean_over_batch`` over every ``dp x cp`` rank
``running_sum(x_r, [x_0, ..., x_r-1], dim)``         ``running_sum_over_group(x_r, cp_group, dim)``
=================================================  ==================================================

What every device computes alike (the whole values: a mask from gathered positions, the loss on
the gathered logits) runs on every rank, the same values; backward through a gather keeps the
rank's own slice, so the ranks' parameter gradients summed over ``cp`` are the single-device ones.
DDP averages them: the returned values' gradients are scaled by ``N`` (the inputs' back by
``1/N``, ``scale_gradient``), so the average is that sum, with gradients accumulated too.
Over a ``("dp", "cp")`` mesh (``batch_mesh``: its flattened ``dp_cp`` mesh) a mean over every token
(a scalar: the loss) is reduced over all the ranks (``runtime.context_parallel_mesh.mean_over_batch``),
the whole batch's sum over its count, its gradient scaled by the dp size (DDP averages over dp too).
The program's head checks, with one all-gather of the first split input's length, that the ranks'
shards are the balanced ``tensor_split`` parts one process makes.

Before (device 1 of 2, excerpt)::

    input_ids_scatter = dpcompile_runtime_scatter(input_ids, ['cpu', 'cpu'], 1)
    input_ids_dev1 = input_ids_scatter[1]
    arange_dev1 = dpcompile_runtime_batch_arange([sym_size_dev0, sym_size_dev1], 1, device=...)
    sdpa_dev1 = dpcompile_runtime_attention_regathered(q_dev1, [k_dev0, k_dev1], [v_dev0, v_dev1], 2, 'cpu', None)
    lm_head = dpcompile_runtime_gather([lm_head_dev0, lm_head_dev1], 1, 'cpu')

After (rank 1)::

    sequence_sizes = dpcompile_runtime_distributed_sequence_sizes(sym_size_dev1, cp_group)
    arange_dev1 = dpcompile_runtime_batch_arange(sequence_sizes, 1, device=...)
    size = k_dev1.size(2)
    sdpa_sizes = dpcompile_runtime_distributed_sequence_sizes(size, cp_group)
    sdpa_dev1 = dpcompile_runtime_distributed_attention_over_group(q_dev1, k_dev1, v_dev1, cp_group, 2, sdpa_sizes, None)
    lm_head_dev1_out = dpcompile_runtime_distributed_scale_gradient(lm_head_dev1, 2.0)
    return lm_head_dev1_out                            # the rank's own shard of the output

A module every rank runs alike on the whole sequence (BERT's pooler on the gathered first token,
T5's relative position bias) gets on every rank the whole gradient of its parameters (the ranks'
gradients into a whole value are the same: backward through ``shard_of_whole`` all-gathers them,
and a whole output is backwarded alike), so its parameters' gradients from that call are scaled by
``1/N`` (``scaling_parameter_gradients``; a parameter read directly: ``scale_gradient``)::

    classifier = dpcompile_runtime_distributed_scaling_parameter_gradients(self.classifier, 0.5, tanh)

So is a value device 0 computes whole and then scatters (a ViT's embedding: patches, CLS token,
position embeddings, before its sequence is split): every rank computes it, then takes its part.

A cross-device step with no rank lowering (BatchNorm's statistics over the sequence, a packed
sequence's longest length, a gather of a tuple) is a ``DpCompileError`` naming it; so is a
parameter read on the whole sequence whose gradient would not be the same on every rank (a whole
value a device's own computation reads as it is: each rank's gradient is its tokens' part).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from dpcompile import runtime
from dpcompile.analysis.context_exchange import CHOICE_META
from dpcompile.errors import DpCompileError
from dpcompile.infra import PassResult, stamp, stamp_comm
from dpcompile.runtime import distributed as dist_rt
from dpcompile.runtime import exported
from dpcompile.runtime.context_parallel_mesh import mean_over_batch
from dpcompile.runtime.distributed import MeshGroup
from dpcompile.runtime.sequence_all_to_all import heads_over_group, sequence_over_group
from dpcompile.runtime.sequence_balance import balanced_attention_over_group
from dpcompile.runtime.sequence_ring_group import ring_attention_over_group
from passes.collectives import group_size
from passes.cut_stage import builds_output

PASS = "lower_sequence_to_rank"
_PER_DEVICE = re.compile(r"^(.*)_dev(\d+)(?:_\d+)?$")  # fx's suffix where two nodes asked for one name
_LOWERED_PASSES = ("insert_scatter_gather", "regather_keys_values", "ring_exchange", "all_to_all_exchange",
                   "balance_causal_attention")
#: cross-device steps of the one-process program that have no lowering to one rank yet
REFUSED = {
    runtime.batch_norm: "BatchNorm's statistics over the sequence",
    runtime.functional_batch_norm: "BatchNorm's statistics over the sequence",
    runtime.max_length: "a packed sequence's longest length",
    runtime.broadcast: "a broadcast between devices",
}
_LOSS_COUNTS = (exported.cross_entropy_count, exported.element_count)
#: runtime calls whose argument ``sizes`` lists every device's length, and ``k`` names the device
_SIZES_AT = {runtime.batch_arange: 0, runtime.rows_of_shard: 2, runtime.local_positions: 1}


def device_of(node: fx.Node) -> int | None:
    """The virtual device a node of the lowered program runs for (its ``_dev<k>`` name), or None."""
    if node.meta.get("dpcompile_pass") not in _LOWERED_PASSES:
        return None
    match = _PER_DEVICE.match(node.name)
    return int(match.group(2)) if match else None


@dataclass
class RankSites:
    """What :func:`lower_sequence_to_rank` rewrites: every device's nodes, and what it refuses."""

    devices: dict[fx.Node, int] = field(default_factory=dict)
    counterparts: dict[tuple[str, int, Any], fx.Node] = field(default_factory=dict)  # (base name, device, op) -> node
    refused: list[fx.Node] = field(default_factory=list)
    whole_parameters: list[tuple[fx.Node, fx.Node, str]] = field(default_factory=list)  # (whole node, reader, parameter)
    scaled_readers: set[fx.Node] = field(default_factory=set)  # their parameters' gradients scaled by 1/N


#: cross-device steps: a walk back from a whole value stops there (past them, values are each rank's own)
_CROSS = (runtime.gather, runtime.gather_sequence, runtime.scatter, runtime.attention_regathered,
          runtime.ring_attention, runtime.mean_of_partials, runtime.reduce_add, runtime.to_device,
          runtime.heads_of_sequence, runtime.sequence_of_heads, runtime.balanced_attention,
          runtime.balanced_rows_back)  # fmt: skip


def _parameters_read(gm: fx.GraphModule, node: fx.Node) -> list[str]:
    """The trainable parameters ``node`` reads itself (a module call, a parameter's ``get_attr``)."""
    if node.op == "get_attr":
        try:
            value = gm.get_parameter(str(node.target))
        except AttributeError:
            return []
        return [str(node.target)] if value.requires_grad else []
    if node.op == "call_module" or _calls_a_replica(node):
        module = gm.get_submodule(str(node.target))
        return [f"{node.target}.{name}" for name, p in module.named_parameters() if p.requires_grad]
    return []


def _calls_a_replica(node: fx.Node) -> bool:
    """``replica_dev0.path.to.module(x)``: a module of a device's replica called (the rank's is the model's)."""
    held = node.args[0] if node.op == "call_method" and node.args else None
    return (
        isinstance(held, fx.Node)
        and held.target is operator.getitem
        and isinstance(held.args[0], fx.Node)
        and held.args[0].target is runtime.replicate
    )


def _whole_region(node: fx.Node) -> set[fx.Node]:
    """``node`` and what it is computed from, up to the cross-device steps."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in seen or (current.op == "call_function" and current.target in _CROSS):
            continue
        seen.add(current)
        stack.extend(current.all_input_nodes)
    return seen


def _whole_parameters(gm: fx.GraphModule, node: fx.Node) -> list[tuple[fx.Node, str]]:
    """``(reader, parameter)`` for each trainable parameter a value every rank computes whole reads,
    up to the cross-device steps."""
    return [(current, name) for current in _whole_region(node) for name in _parameters_read(gm, current)]


def _carries_gradient(node: fx.Node) -> bool:
    """Whether ``node``'s value can carry a gradient (a floating tensor; unknown counts as yes)."""
    val = node.meta.get("val")
    if val is None:
        return True
    values = val if isinstance(val, (tuple, list)) else (val,)
    return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in values)


def _gradient_same_on_every_rank(reader: fx.Node, devices: Mapping[fx.Node, int]) -> bool:
    """Whether the gradient reaching ``reader``'s output is the same whole one on every rank: every
    use, through values every rank computes alike, ends in a scatter of its rows (backward all-gathers
    the ranks' parts) or in the returned values (backwarded alike), never in a device's own node."""
    seen, stack = set(), [reader]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for user in current.users:
            if user.op == "output" or _is_output_structure(user) or not _carries_gradient(user):
                continue
            if user.op == "call_function" and user.target is runtime.scatter:
                continue
            if user in devices or (user.op == "call_function" and user.target in _CROSS + (runtime.replicate,)):
                return False
            stack.append(user)
    return True


def _op_of(node: fx.Node) -> tuple[str, Any]:
    """What a node runs: two devices' nodes of one name and source are counterparts only if alike (a
    replica's module read, ``qkv_dev1``, is not the linear ``qkv_dev0`` that device 0 runs on the model's)."""
    return node.op, node.target if isinstance(node.target, str) or node.op != "call_function" else id(node.target)


def find_rank_sites(gm: fx.GraphModule) -> RankSites:
    sites = RankSites()
    for node in gm.graph.nodes:
        k = device_of(node)
        if k is not None:
            sites.devices[node] = k
            sites.counterparts.setdefault((_PER_DEVICE.match(node.name).group(1), k, _op_of(node)), node)  # type: ignore[union-attr]
        if node.op == "call_function" and node.target in REFUSED:
            sites.refused.append(node)
        elif node.op == "call_function" and node.target is runtime.gather and not isinstance(node.args[1], int):
            sites.refused.append(node)
    # a value device 0 computes whole and scatters (a ViT's embedding, before its sequence is split)
    # runs on every rank alike, as a whole value does
    alone: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if "dpcompile_whole" in node.meta:
            sites.whole_parameters += [(node, reader, name) for reader, name in _whole_parameters(gm, node)]
        source = node.args[0] if node.op == "call_function" and node.target is runtime.scatter else None
        if isinstance(source, fx.Node) and source in sites.devices:
            alone |= _whole_region(source)
            sites.whole_parameters += [(source, reader, name) for reader, name in _whole_parameters(gm, source)]
    own = {n: k for n, k in sites.devices.items() if n not in alone}
    sites.scaled_readers = {
        reader
        for _, reader, _ in sites.whole_parameters
        if (reader.op in ("call_module", "get_attr") or _calls_a_replica(reader)) and _gradient_same_on_every_rank(reader, own)
    }
    return sites


def lower_sequence_to_rank(
    gm: fx.GraphModule, *, mesh: Any, cp_dim: str, rank: int, input_dims: Mapping[str, int | None],
    batch_mesh: Any = None, dp_dim: str | None = None,
) -> PassResult:  # fmt: skip
    """Rank ``rank``'s program over the ``cp_dim`` group of ``mesh`` (see the module's docstring);
    over a ``(dp_dim, cp_dim)`` mesh, ``batch_mesh`` is it flattened: a mean over every token is
    reduced over all its ranks."""
    sites = find_rank_sites(gm)
    if sites.refused:
        node = sites.refused[0]
        what = REFUSED.get(node.target, "a gather of several values at once")  # type: ignore[call-overload]
        raise DpCompileError(
            f"context parallel over a DeviceMesh: '{node.name}' is {what}, which is built in one process only "
            "(mesh={'cp': N} over a device list); use that, or leave 'cp' out of the mesh"
        )
    unscaled = [(node, name) for node, reader, name in sites.whole_parameters if reader not in sites.scaled_readers]
    if unscaled:
        node, name = unscaled[0]
        raise DpCompileError(
            f"context parallel over a DeviceMesh: '{node.name}' runs on the whole gathered sequence on every rank and "
            f"reads the parameter '{name}', and a device's own computation reads that whole value as it is, so the "
            "ranks' gradients of the parameter are neither the same whole one nor parts of it (not built over a mesh "
            "yet); it is built in one process only (mesh={'cp': N} over a device list). Teach its op a sequence rule "
            "(dpcompile.register_batch_rule) or leave 'cp' out of the mesh"
        )
    if not isinstance(getattr(gm, "cp_group", None), MeshGroup):
        gm.add_submodule("cp_group", MeshGroup(mesh, cp_dim))
    world = group_size(mesh, cp_dim) or _world_of(sites)
    replicas = None
    if batch_mesh is not None and dp_dim is not None:
        replicas = batch_mesh.size() // world
        for name, group in (("dp_group", MeshGroup(mesh, dp_dim)), ("dp_cp_group", MeshGroup(batch_mesh, batch_mesh.mesh_dim_names[0]))):
            if not isinstance(getattr(gm, name, None), MeshGroup):
                gm.add_submodule(name, group)
    rewriter = _RankRewriter(gm, sites, rank, dict(input_dims), world, replicas)
    gm.graph = rewriter.build()
    gm.graph.eliminate_dead_code(is_impure_node=_keeps)
    return PassResult(gm, True, {"rank": rank, "collectives": rewriter.lowered})


def _world_of(sites: RankSites) -> int:
    """How many virtual devices the program runs on: one more than the highest device index."""
    return max(sites.devices.values(), default=0) + 1


def _only_returned(node: fx.Node) -> bool:
    """Whether ``node`` is only returned: read by the output, or by an output structure built of it
    (transformers' ``CausalLMOutput(loss=..., logits=...)``, or its record) that is only returned."""
    return bool(node.users) and all(
        user.op == "output" or (builds_output(user) and _only_returned(user))
        for user in node.users
    )


def _is_output_structure(node: fx.Node) -> bool:
    """An output structure built of returned values (transformers' ``CausalLMOutput(...)``, or its record in a
    program loaded from a folder)."""
    return builds_output(node) and _only_returned(node)


def _is_scalar(node: fx.Node) -> bool:
    """Whether a ``mean_of_partials`` is a mean over every element (a 0-dim value, or counts of
    every element: ``numel``, a loss's ``target_weight``), not over some dims (``numel_over``)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dim() == 0
    counts = node.args[1]
    first = counts[0] if isinstance(counts, (list, tuple)) and counts else None
    return isinstance(first, fx.Node) and first.target in (runtime.numel, runtime.target_weight)


def _is_mean_loss(node: fx.Node) -> bool:
    """``loss_sum / count``: a loss with ``reduction="mean"`` as the export frontend writes it
    (``capture.rewrite``), its count ``cross_entropy_count`` (tokens not ignored) or ``element_count``."""
    count = node.args[1] if node.op == "call_function" and node.target is operator.truediv else None
    return isinstance(count, fx.Node) and count.op == "call_function" and count.target in _LOSS_COUNTS


def _keeps(node: fx.Node) -> bool:
    """What dead-code elimination keeps: the head's check of the shards, and what fx keeps anyway."""
    return node.target is dist_rt.sequence_sizes or node.is_impure()


class _RankRewriter:
    def __init__(self, gm: fx.GraphModule, sites: RankSites, rank: int, input_dims: dict[str, int | None], world: int,
                 replicas: int | None = None):  # fmt: skip
        self.gm, self.sites, self.rank, self.input_dims, self.world = gm, sites, rank, input_dims, world
        self.replicas = replicas  # the dp size over a ("dp", "cp") mesh, else None
        self.graph = fx.Graph()
        self.env: dict[fx.Node, Any] = {}
        self.group: fx.Node | None = None
        self.sizes: dict[tuple[fx.Node, ...], fx.Node] = {}
        self.lowered: list[str] = []

    # ------------------------------------------------------------------ helpers
    def call(self, fn: Any, args: tuple, kwargs: dict | None = None, *, name: str, source: fx.Node) -> fx.Node:
        new = self.graph.create_node("call_function", fn, args, dict(kwargs or {}), name=name)
        for key in ("val", "tensor_meta", "stack_trace"):
            if key in source.meta:
                new.meta[key] = source.meta[key]
        return stamp(new, PASS, source)

    def value(self, node: fx.Node) -> Any:
        """``node`` on this rank: its own value, or this rank's counterpart of another device's."""
        if node in self.env:
            return self.env[node]
        k = self.sites.devices.get(node)
        other = self._counterpart(node) if k is not None and k != self.rank else None
        if other is None:
            raise AssertionError(f"{node.name} is read before it is computed on rank {self.rank}")
        return self.value(other)

    def _counterpart(self, node: fx.Node) -> fx.Node | None:
        base = _PER_DEVICE.match(node.name).group(1)  # type: ignore[union-attr]
        other = self.sites.counterparts.get((base, self.rank, _op_of(node)))
        if other is None or other.meta.get("dpcompile_source") != node.meta.get("dpcompile_source"):
            return None
        return other

    def mapped(self, value: Any) -> Any:
        return fx.node.map_arg(value, self.value)

    def mine(self, values: list[Any]) -> Any:
        return self.mapped(values[self.rank])

    def sizes_of(self, lengths: list[fx.Node], source: fx.Node) -> fx.Node:
        """Every rank's length, exchanged once per list of lengths."""
        key = tuple(lengths)
        if key not in self.sizes:
            exchanged = self.call(dist_rt.sequence_sizes, (self.mine(lengths), self.group), name="sequence_sizes", source=source)
            self.sizes[key] = stamp_comm(exchanged, "all_gather")
        return self.sizes[key]

    # ------------------------------------------------------------------ build
    def build(self) -> fx.Graph:
        for node in self.gm.graph.nodes:
            k = self.sites.devices.get(node)
            if k is not None and k != self.rank and self._counterpart(node) is not None:
                continue  # another device's: this rank computes its own counterpart
            if node.op != "placeholder" and self.group is None:
                self._head()
            if node.op == "placeholder":
                self.env[node] = self.graph.node_copy(node)
            elif node.op == "output":
                self.graph.output(self._returned(node.args[0]), type_expr=node.type)
            elif _is_output_structure(node):
                self.env[node] = self.graph.create_node(
                    node.op, node.target, self._returned(node.args), self._returned(node.kwargs), name=node.name
                )
            else:
                self.env[node] = self._lower(node)
        return self.graph

    def _returned(self, value: Any) -> Any:
        """What the program returns, each value's gradient scaled by the group's size: DDP averages
        the ranks' gradients, and each holds its share of the one single-device gradient, so the
        average of ``N`` times each share is their sum (also when gradients accumulate)."""

        def scaled(node: fx.Node) -> Any:
            if _is_output_structure(node):
                return self.env[node]
            return self.call(dist_rt.scale_gradient, (self.value(node), float(self.world)), name=f"{node.name}_out",
                             source=node)  # fmt: skip

        return fx.node.map_arg(value, scaled)

    def _head(self) -> None:
        """The group, the inputs' gradients scaled back (see :meth:`_returned`), and the check that
        the ranks' shards are the balanced parts of the sequence."""
        self.group = stamp(self.graph.get_attr("cp_group"), PASS)
        for node in [n for n in self.env if n.op == "placeholder"]:
            self.env[node] = self.call(dist_rt.scale_gradient, (self.env[node], 1.0 / self.world),
                                       name=f"{node.name}_in", source=node)  # fmt: skip
        split = [n for n in self.env if n.op == "placeholder" and self.input_dims.get(str(n.target)) is not None]
        if split:
            first = split[0]
            length = self.graph.call_method("size", (self.env[first], self.input_dims[str(first.target)]))
            check = self.graph.call_function(dist_rt.sequence_sizes, (length, self.group), {"balanced": True})
            stamp_comm(stamp(check, PASS, first), "all_gather")

    def _lower(self, node: fx.Node) -> Any:
        target = node.target
        if node.op == "call_function" and target is operator.getitem and isinstance(node.args[0], fx.Node):
            held = node.args[0]
            if held.op == "call_function" and held.target in (runtime.replicate, runtime.scatter):
                return self.env[held] if held.target is runtime.scatter else self._getitem(self.env[held], 0, node)
        if node in self.sites.scaled_readers:
            return self._scaled_reader(node)
        if node.op != "call_function":
            return self.graph.node_copy(node, self.value)
        if target is runtime.replicate:
            roots, devices = node.args[0], node.args[1]
            return self.call(runtime.replicate, (self.mapped(roots), [devices[self.rank]]), {"include_source": True},
                             name=node.name, source=node)  # fmt: skip
        if target is runtime.scatter:
            return self._scatter(node)
        if target is runtime.to_device:
            return self._to_device(node)
        if target is runtime.gather:
            return self._gather(node)
        if target is runtime.gather_sequence:
            return self._collective(dist_rt.gather_onto_owners, (self.mine(node.args[0]), self.group, node.args[1]), node)
        if target is runtime.attention_regathered:
            return self._attention(node)
        if target is runtime.ring_attention:
            return self._ring(node)
        if target in (runtime.heads_of_sequence, runtime.sequence_of_heads):  # the all-to-all: one over the group
            fn = heads_over_group if target is runtime.heads_of_sequence else sequence_over_group
            shards, _index, dim, lengths, _device = node.args
            args = (self.mine(shards), self.group, dim, self.sizes_of(list(lengths), node))
            return stamp_comm(self._collective(fn, args, node), "all_to_all", backward="all_to_all")
        if target is runtime.balanced_attention:
            return self._attention(node, balanced_attention_over_group)
        if target is runtime.balanced_rows_back:  # the rank's balanced call returned its own rows already
            return self.mine(node.args[0])
        if target in _SIZES_AT:
            at = _SIZES_AT[target]
            args = list(self.mapped(node.args))
            args[at] = self.sizes_of(list(node.args[at]), node)  # type: ignore[arg-type]
            return self.call(target, tuple(args), self.mapped(node.kwargs), name=node.name, source=node)
        if target is runtime.mean_of_partials:
            sums, counts = node.args[0], node.args[1]
            if self.replicas is not None and _is_scalar(node):  # over every token: every dp x cp rank's
                group = stamp(self.graph.get_attr("dp_cp_group"), PASS, node)
                args = (self.mine(sums), self.mine(counts), group, self.replicas)
                return self._collective(mean_over_batch, args, node)
            return self._collective(dist_rt.mean_over_group, (self.mine(sums), self.mine(counts), self.group), node)
        if self.replicas is not None and node not in self.sites.devices and _is_mean_loss(node):
            group = stamp(self.graph.get_attr("dp_group"), PASS, node)  # whole over cp: the same on its ranks
            args = (self.value(node.args[0]), self.value(node.args[1]), group, self.replicas)
            return self._collective(mean_over_batch, args, node)
        if target is runtime.reduce_add:
            return self._collective(dist_rt.all_reduce, (self.mine(node.args[0]), self.group), node)
        if target is runtime.running_sum:
            own, _earlier, dim = node.args
            return self._collective(dist_rt.running_sum_over_group, (self.value(own), self.group, dim), node,
                                    self.mapped(node.kwargs))  # fmt: skip
        return self.graph.node_copy(node, self.value)

    def _scaled_reader(self, node: fx.Node) -> fx.Node:
        """A parameter read alike on every rank: its gradients from here scaled by ``1/N`` (each
        rank gets the whole one, and DDP's average of ``N`` times a share is that share's sum)."""
        factor = 1.0 / self.world
        if node.op == "get_attr":
            return self.call(dist_rt.scale_gradient, (self.graph.node_copy(node), factor), name=f"{node.name}_scaled",
                             source=node)  # fmt: skip
        module = stamp(self.graph.get_attr(str(node.target)), PASS, node)
        args = node.args[1:] if node.op == "call_method" else node.args  # a replica's module: the model's own here
        return self.call(dist_rt.scaling_parameter_gradients, (module, factor, *self.mapped(args)),
                         self.mapped(node.kwargs), name=node.name, source=node)  # fmt: skip

    def _getitem(self, held: fx.Node, index: int, node: fx.Node) -> fx.Node:
        return self.call(operator.getitem, (held, index), name=node.name, source=node)

    def _collective(self, fn: Any, args: tuple, node: fx.Node, kwargs: dict | None = None) -> fx.Node:
        self.lowered.append(f"{getattr(node.target, '__name__', node.target)} -> {fn.__name__}")
        new = self.call(fn, args, kwargs, name=node.name, source=node)
        comm = node.meta.get("dpcompile_comm")
        return stamp_comm(new, comm.kind if comm else "all_gather", backward=comm.backward if comm else None)

    def _scatter(self, node: fx.Node) -> Any:
        """An input: this rank's shard is what it was given; a whole value: this rank's part of it."""
        source, dim = node.args[0], node.args[2]
        if isinstance(source, fx.Node) and source.op == "placeholder":
            return self.env[source]
        return self._collective(dist_rt.shard_of_whole, (self.value(source), self.group, dim), node)

    def _to_device(self, node: fx.Node) -> Any:
        """A split input needed whole is gathered from every rank; anything else is here already."""
        source = node.args[0]
        dim = self.input_dims.get(str(source.target)) if isinstance(source, fx.Node) and source.op == "placeholder" else None
        if dim is None or node in self.sites.devices:
            return self.value(source)
        return self._collective(dist_rt.gather_over_group, (self.value(source), self.group, dim), node)

    def _gather(self, node: fx.Node) -> Any:
        """An output: this rank's own shard (as data parallel over a mesh returns each rank's own);
        a value every rank uses whole: all-gathered (backward keeps this rank's slice)."""
        parts, dim = node.args[0], node.args[1]
        comm = node.meta.get("dpcompile_comm")
        if (comm is not None and comm.io) or _only_returned(node):
            return self.mine(parts)
        return self._collective(dist_rt.gather_over_group, (self.mine(parts), self.group, dim), node)

    def _attention(self, node: fx.Node, balanced: Any = None) -> fx.Node:
        """``attention_regathered`` (or, ``balanced``, ``balanced_attention``: the query rows of the
        rank's zig-zag chunks exchanged by all-to-all) over the group."""
        query, keys, values, dim = node.args[:4]
        key = self.mine(keys)
        length = self.graph.call_method("size", (key, dim))
        sizes = self.call(dist_rt.sequence_sizes, (length, self.group), name=f"{node.name}_sizes", source=node)
        stamp_comm(sizes, "all_gather")
        fn, kwargs = balanced or dist_rt.attention_over_group, dict(node.kwargs)
        if balanced:
            args = (self.mine(query), key, self.mine(values), self.group, dim, sizes)
            if "masks" in kwargs:  # this rank's mask rows
                kwargs["mask"] = kwargs.pop("masks")[self.rank]
        else:
            args = (self.value(query), key, self.mine(values), self.group, dim, sizes, self.mapped(node.args[5]))
        self.lowered.append(f"{node.target.__name__} -> {fn.__name__}")  # type: ignore[union-attr]
        new = self.call(fn, args, self.mapped(kwargs), name=node.name, source=node)
        _carry_choice(node, new)
        return stamp_comm(new, "all_gather", backward="reduce_scatter")

    def _ring(self, node: fx.Node) -> fx.Node:
        """A ring call: this rank's key and value blocks go round the ``cp`` group (``sequence_ring_group``)."""
        query, keys, values, dim, _device, _own, positions = node.args
        key = self.mine(keys)
        length = self.graph.call_method("size", (key, dim))
        sizes = self.call(dist_rt.sequence_sizes, (length, self.group), name=f"{node.name}_sizes", source=node)
        stamp_comm(sizes, "all_gather")
        args = (self.value(query), key, self.mine(values), self.group, dim, sizes, self.mapped(positions))
        self.lowered.append(f"ring_attention -> {ring_attention_over_group.__name__}")
        new = self.call(ring_attention_over_group, args, self.mapped(node.kwargs), name=node.name, source=node)
        _carry_choice(node, new)
        return stamp_comm(new, "send", backward="send")


def _carry_choice(node: fx.Node, new: fx.Node) -> None:
    """The attention call's exchange choice, for ``explain`` and ``pm.strategies`` (``passes/ring_exchange.py``)."""
    if CHOICE_META in node.meta:
        new.meta[CHOICE_META] = node.meta[CHOICE_META]


__all__ = ["REFUSED", "RankSites", "device_of", "find_rank_sites", "lower_sequence_to_rank"]
