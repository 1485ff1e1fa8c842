"""``stage_shards``: the pipeline passes over ``shard_linear``'s program, and back to shards per stage.

A pipeline whose stages are tensor parallel (``transform(..., pipeline=2, tensor_parallel=True)``,
:mod:`dpcompile.recipes.pipeline_tensor_parallel`) cuts the graph into stages before the layers are
sharded (:func:`inside_sharded_regions` tells ``find_stage_boundaries`` where not to cut), stamps
``shard_linear``'s one-shard program with those stages (:func:`stages_of_shards`), splits it into
micro-batches and places the stages (``insert_scatter_gather``, ``insert_stage_transfers``, reading
the shard helpers' batch rules), and lets ``expand_shards`` write one node per shard
(:func:`restore_shard_layouts` hands it the layouts). :func:`place_shard_values` then puts stage
``s``'s shard ``k`` on ``devices[s*T + k]``. Stage 1 of a 2-stage MLP, one micro-batch, 2 shards::

    tanh_1_to_stage1 = dpcompile_runtime_send(tanh_1, 'cuda:2')
    tanh_1_copy = dpcompile_runtime_tensor_parallel_copy_to_devices(tanh_1_to_stage1, ['cuda:2', 'cuda:3'])
    tanh_1_copy_dev0 = tanh_1_copy[0]
    tanh_1_copy_dev1 = tanh_1_copy[1]
    layers_2_dev0 = torch._C._nn.linear(tanh_1_copy_dev0, layers_2_weight_shard0, layers_2_bias_shard0)
    layers_2_dev1 = torch._C._nn.linear(tanh_1_copy_dev1, layers_2_weight_shard1, layers_2_bias_shard1)
    ...
    layers_3_all_reduce = dpcompile_runtime_tensor_parallel_reduce_to_device([layers_3_partial_dev0, layers_3_partial_dev1], 'cuda:2')
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch.fx as fx

from dpcompile import runtime
from dpcompile.analysis.sharding import Copied, Sharded
from dpcompile.devices import Devices
from dpcompile.errors import DpCompileError
from passes.split_stages import STAGE, StagePlan

LAYOUT = "dpcompile_layout"  # shard_linear's layout of a node (expand_shards reads it)
SHARD = "dpcompile_shard"  # shard_linear's ShardSpec of a sharded parameter read


def inside_sharded_regions(gm: fx.GraphModule, layouts: Mapping[fx.Node, Any]) -> set[str]:
    """Names of the nodes a stage must not start before: between a sharded value (a column layer's
    output, as the sharding analysis lays it out) and each of its readers."""
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    index = {n: i for i, n in enumerate(body)}
    inside: set[str] = set()
    for node in body:
        if isinstance(layouts.get(node), Sharded):
            last = max((index[u] for u in node.users if u in index), default=index[node])
            inside.update(n.name for n in body[index[node] + 1 : last + 1])
    return inside


def stages_of_shards(gm: fx.GraphModule, plan: StagePlan) -> StagePlan:
    """``plan`` (made on the unsharded graph) for ``shard_linear``'s program: every node goes with
    the node it was made from; a copy to the shards (Megatron's *f*), a shard's size constant and a
    parameter read with their first reader. A copy read in a later stage too (an attention mask
    every block reads) is made again there, from the whole value sent on; a sharded value read in a
    later stage (a cut between a column layer and the row layer it feeds) is refused: stages
    exchange whole values."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    stage: dict[fx.Node, int] = {}
    for node in nodes:
        source = node.meta.get("dpcompile_source", node.name)
        if not _follows_reader(node) and source in plan.stage_of:
            stage[node] = plan.stage_of[source]
    for node in reversed(nodes):
        if node not in stage:
            readers = [stage[u] for u in node.users if u in stage]
            stage[node] = min(readers) if readers else max((stage.get(a, 0) for a in node.all_input_nodes), default=0)
    copies: dict[tuple[fx.Node, int], fx.Node] = {}

    def copy_in(node: fx.Node, s: int, before: fx.Node) -> fx.Node:
        """``node`` (a copy to the shards, or made only of such copies) computed again in stage ``s``."""
        if not _per_shard(node) or stage[node] == s:
            return node
        if not _clonable(node):
            later = s
            raise DpCompileError(
                f"the boundary before stage {later} cuts through a tensor-parallel region: '{node.name}' (stage "
                f"{stage[node]}) is sharded over the stage's devices and read in stage {later}. Stages exchange "
                "whole values; name stage boundaries (pipeline=[...module paths...]) that keep a column layer and "
                "the row layer it feeds in one stage, or plan one of them 'replicate'"
            )
        if (node, s) not in copies:
            args = fx.node.map_arg((node.args, node.kwargs), lambda a: copy_in(a, s, before))
            with gm.graph.inserting_before(before):
                again = gm.graph.create_node(node.op, node.target, *args, name=f"{node.name}_stage{s}")
            again.meta.update(node.meta)
            stage[again] = s
            copies[(node, s)] = again
        return copies[(node, s)]

    for node in list(nodes):
        if node.op == "get_attr":
            continue
        for user in list(node.users):
            if user in stage and stage[user] != stage[node] and _per_shard(node):
                user.replace_input_with(node, copy_in(node, stage[user], user))
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    stage_of = {n.name: stage[n] for n in nodes}
    sent = tuple(
        tuple(n.name for n in nodes if stage[n] <= b and any(stage.get(u, plan.stages) > b for u in n.users))
        for b in range(plan.stages - 1)
    )
    return dataclasses.replace(plan, stage_of=stage_of, sent=sent)


_SIZE_HELPERS = (runtime.collectives.local_size, runtime.collectives.local_offset)


def _follows_reader(node: fx.Node) -> bool:
    """A parameter read, a copy to the shards, a split of a whole value (a row layer's input) and a
    size constant go with their first reader: the stage before a cut sends the whole value."""
    return (
        node.op == "get_attr" or node.target in _SIZE_HELPERS
        or node.target in (runtime.collectives.copy_to_shards, runtime.collectives.split_to_shards)
    )  # fmt: skip


def _per_shard(node: fx.Node) -> bool:
    return isinstance(node.meta.get(LAYOUT), (Sharded, Copied)) or node.target in _SIZE_HELPERS


def _clonable(node: fx.Node) -> bool:
    """Whether a stage can compute ``node`` again from whole values: a copy to the shards, or a
    size constant, or an op of such values alone."""
    if node.target in _SIZE_HELPERS or node.target is runtime.collectives.copy_to_shards:
        return True
    if node.target is runtime.collectives.split_to_shards:  # each stage cuts its shard of the whole value
        return not any(_per_shard(a) for a in node.all_input_nodes)
    return isinstance(node.meta.get(LAYOUT), Copied) and all(
        _clonable(a) or not _per_shard(a) for a in node.all_input_nodes
    )


def name_own_sources(gm: fx.GraphModule) -> None:
    """Make every node of ``shard_linear``'s program the source of what later passes make of it
    (``node.meta["dpcompile_source"]``): a micro-batch's copy of ``x_copy`` is then known as one of
    ``x_copy``, not of ``x``, for its stage and its layout."""
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "output"):
            node.meta["dpcompile_source"] = node.name


def borrow_shapes(gm: fx.GraphModule, shapes: Mapping[str, Mapping[str, Any]]) -> None:
    """Give a node ``shard_linear`` wrote (``fc2_all_reduce``, ``fc2 = add_bias(...)``) the shape
    record (``shapes``: by node name, before it ran) of the node it was made from: its rank, which
    the batch rules read to split it into micro-batches."""
    for node in gm.graph.nodes:
        if "val" not in node.meta and "tensor_meta" not in node.meta:
            borrowed = shapes.get(node.meta.get("dpcompile_source", node.name), {})
            if (
                getattr(borrowed.get("val"), "ndim", None) != 0
            ):  # not a loss: the parts of a vocab-parallel one are rows
                node.meta.update(borrowed)


def shard_findings(gm: fx.GraphModule) -> tuple[dict[str, tuple[Any, dict[str, Any]]], dict[str, Any]]:
    """What ``shard_linear`` stamped on its program, to hand on past the pipeline passes: per node
    name its target and its layout and communication records; per sharded parameter its spec."""
    nodes = {
        n.name: (n.target, {k: n.meta[k] for k in _CARRIED if k in n.meta})
        for n in gm.graph.nodes
        if n.op not in ("placeholder", "output")
    }
    specs = {str(n.target): n.meta[SHARD] for n in gm.graph.nodes if n.op == "get_attr" and SHARD in n.meta}
    return nodes, specs


_CARRIED = (LAYOUT, "dpcompile_comm")  # not the element count: a micro-batch moves its own share


def restore_shard_layouts(
    gm: fx.GraphModule, found: Mapping[str, tuple[Any, Mapping[str, Any]]], specs: Mapping[str, Any]
) -> None:
    """Give the lowered pipeline's nodes what ``shard_linear`` found (:func:`shard_findings`;
    ``expand_shards`` reads it): a micro-batch's node (``fc1_mb0``) takes its source node's layout,
    a micro-batch's collective its communication record, a parameter read its shard spec."""
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in specs:
            node.meta[SHARD] = specs[str(node.target)]
        source = node.meta.get("dpcompile_source", node.name)
        if source in found:
            target, meta = found[source]
            node.meta.update(meta if target == node.target else {k: v for k, v in meta.items() if k == LAYOUT})


def tidy_micro_batch_names(gm: fx.GraphModule) -> None:
    """``fc1_mb1_2_dev0`` (a name made unique along the way) back to ``fc1_mb1_dev0`` where it is free."""
    taken = {n.name for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        found = _DEDUPLICATED.fullmatch(node.name)
        if found and found.group(1) + (found.group(2) or "") not in taken:
            taken.discard(node.name)
            node._rename(found.group(1) + (found.group(2) or ""))
            taken.add(node.name)


_DEDUPLICATED = re.compile(r"(.+_mb\d+)_\d+(_dev\d+)?")


def read_each_parameter_once(gm: fx.GraphModule) -> None:
    """One ``get_attr`` per parameter: every micro-batch reads the first one (the earliest in the
    graph, so before all their readers)."""
    first: dict[str, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        kept = first.setdefault(str(node.target), node)
        if kept is not node:
            node.replace_all_uses_with(kept)
            gm.graph.erase_node(node)


_TO_GROUP = (runtime.tensor_parallel.copy_to_devices, runtime.tensor_parallel.split_to_devices,
             # sequence parallel's slices, gathers and reduce-scatters: one value per device of the stage
             runtime.tensor_parallel.split_sequence_to_devices, runtime.tensor_parallel.all_gather_to_devices,
             runtime.tensor_parallel.reduce_scatter_to_devices)
_TO_ONE = (runtime.tensor_parallel.reduce_to_device, runtime.tensor_parallel.gather_to_device)


def place_shard_values(gm: fx.GraphModule, groups: Sequence[Devices]) -> dict[fx.Node, tuple[int, int]]:
    """Put stage ``s``'s shard ``k`` on ``groups[s][k]``: the device arguments of the calls that
    make its values, and what is sent to it; whole values of a stage on ``groups[s][0]``. Every node
    is stamped with its stage and its device slot ``s * T + k`` (``explain``). Returns each read of
    a shard parameter with its ``(stage, shard)``, to put the parameter there."""
    t = len(groups[0])
    stage: dict[fx.Node, int] = {}
    slot: dict[fx.Node, int | None] = {}
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    for node in nodes:
        if STAGE in node.meta:
            stage[node] = node.meta[STAGE]
    staged = set(stage)  # a send without a stage goes to the output device
    for node in reversed(nodes):
        if node not in stage:
            readers = [stage[u] for u in node.users if u in stage]
            if readers:
                stage[node] = min(readers)
    for node in nodes:
        if node not in stage:
            stage[node] = max((stage.get(a, 0) for a in node.all_input_nodes), default=0)
        slot[node] = _slot_of(node, slot)
    for node in nodes:
        s, k = stage[node], slot[node]
        node.meta[STAGE] = s
        node.meta["dpcompile_slot"] = s * t + (k or 0)
        if node.op != "call_function" or getattr(node.target, "__module__", "").split(".")[0] != "dpcompile":
            continue
        group = groups[s].strings()
        args = list(node.args)
        if node.target in _TO_GROUP or node.target in _TO_ONE:
            node.meta["dpcompile_comm_world"] = t  # a collective among the stage's devices
        if node.target in _TO_GROUP:
            args[-1] = group
        elif node.target in _TO_ONE:
            args[-1] = group[0]
        elif node.target is runtime.tensor_parallel.call_module_on_device:  # a norm on shard k's sequence slice
            args[1] = group[k or 0]
        elif node.target is runtime.send:
            source = node.args[0]
            if node in staged and isinstance(source, fx.Node):
                args[1] = group[slot.get(source) or 0]
        else:
            args = [group[k or 0] if isinstance(a, str) and a == group[0] else a for a in args]
        node.args = tuple(args)
    return {n: (stage[n], k) for n, k in slot.items() if n.op == "get_attr" and k is not None}


def _slot_of(node: fx.Node, slot: Mapping[fx.Node, int | None]) -> int | None:
    """Which shard a node's value belongs to (None: whole)."""
    if node.op == "get_attr":
        found = _SHARD_SUFFIX.search(str(node.target))
        return int(found.group(1)) if found else None
    if node.target in _TO_ONE:
        return None
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        if isinstance(source, fx.Node) and source.target in _TO_GROUP:
            return int(node.args[1])
    return next((slot[a] for a in node.all_input_nodes if slot.get(a) is not None), None)


_SHARD_SUFFIX = re.compile(r"_shard(\d+)$")


__all__ = [
    "LAYOUT",
    "SHARD",
    "borrow_shapes",
    "inside_sharded_regions",
    "name_own_sources",
    "place_shard_values",
    "read_each_parameter_once",
    "restore_shard_layouts",
    "shard_findings",
    "stages_of_shards",
    "tidy_micro_batch_names",
]
