"""``checkpoint_activations``: regions of the program recomputed in backward instead of saved.

Before (data parallel over two virtual devices, one block ``layers.0``)::

    def forward(self, x):
        ...
        layers_0_fc1_dev0 = getattr(replica_dev0.layers, "0").fc1(x_dev0)
        relu_dev0 = torch.relu(layers_0_fc1_dev0)
        layers_0_fc2_dev0 = getattr(replica_dev0.layers, "0").fc2(relu_dev0)
        add_dev0 = x_dev0 + layers_0_fc2_dev0
        ...

After (``paths=["layers.0"]``)::

    def forward(self, x):
        ...
        layers_0_dev0_region = self.layers_0_dev0_region
        layers_0_dev0 = dpcompile_runtime_checkpoint(layers_0_dev0_region, replica_dev0, x_dev0, undo_writes = False)
        ...

The region (a submodule holding the extracted nodes, with no parameters of its own: modules and
weights come in as arguments) runs under ``torch.utils.checkpoint`` (non-reentrant, RNG state
kept), so backward keeps only its inputs and runs it again; ``undo_writes = False`` where the region is
known to write nothing outside itself (``passes.checkpoint_writes``: the runtime then does not watch the
recompute's writes). A region is every node whose user
node ran inside the module (``node.meta["dpcompile_module"]``), closed over the nodes between
them (a send, a collective), and split into its independent parts: one region per replica or
micro-batch, one across the shards of a tensor-parallel block. It runs last, on the lowered
program, so it composes with data, tensor and pipeline parallelism alike.
"""

from __future__ import annotations

import heapq
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn
from torch.nn.utils.parametrize import ParametrizationList

from dpcompile.analysis.checkpoint_regions import byte_budget, parse_save_rule
from dpcompile.errors import DpCompileError
from dpcompile.fx_utils import PROGRAM_OWNED, STAGE, PicklableGraph, copy_graph, graph_module, writes
from dpcompile.infra import PassResult, module_path_of, stamp
from dpcompile.runtime import (
    checkpoint,
    current_random_draws,
    join_tiles,
    keep_outputs,
    random_draws,
    random_draws_over_ranks,
    send,
    token_tiles,
)
from passes.checkpoint_budget import kept_for_rule, kept_over_regions, kept_within_bytes
from passes.checkpoint_tiles import tiled_input, why_not_per_token
from passes.checkpoint_writes import may_write_outside

PASS = "checkpoint_activations"
_COMPUTE = ("call_function", "call_method", "call_module")
_PLACEMENT = (STAGE, "dpcompile_slot")  # where a pipeline runs a node: its new nodes run there too
_PLACE_SUFFIX = re.compile(r"_(dev\d+|mb\d+)$")
_DRAW_RECORDS = (random_draws, random_draws_over_ranks, current_random_draws)  # a call's record of draws


@dataclass
class CheckpointRegion:
    """One region to recompute: the module ``path`` it comes from, its ``name`` in the code, its
    nodes in graph order, the values it reads (``inputs``), the ones read after it (``outputs``) and
    the nodes whose outputs backward keeps instead of recomputing (``kept``, the save rule's)."""

    path: str
    name: str
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    kept: list[fx.Node] = field(default_factory=list)


def _in_path(node: fx.Node, path: str) -> bool:
    module = module_path_of(node)
    return module is not None and (module == path or module.startswith(path + "."))


def _recomputable(node: fx.Node) -> bool:
    # random_draws (and a rank's or a stage's record of them): one call's record of whole draws, shared by
    # every replica and micro-batch (a region reads it; recomputing reads the same draws, and the parts stay apart)
    return (node.op in _COMPUTE and node.target not in (checkpoint, *_DRAW_RECORDS)
            and node.meta.get("dpcompile_pass") != PASS and not _stateful_weight(node))  # fmt: skip


def _stateful_weight(node: fx.Node) -> bool:
    """A weight computed by a parametrization holding state (``parametrizations.spectral_norm``'s power
    iteration writes ``_u``/``_v``): computed once a call, outside every region, which reads it. Inside, a
    pipeline's region per micro-batch ran the iteration once per micro-batch (gradients off), and each
    recompute computed the weight from the vectors the forward had iterated."""
    if node.op != "call_module":
        return False
    try:
        module = node.graph.owning_module.get_submodule(str(node.target))
    except AttributeError:
        return False
    return isinstance(module, ParametrizationList) and any(True for _ in module.buffers())


def _stages(gm: fx.GraphModule) -> dict[fx.Node, object]:
    """Each node's pipeline stage: its stamp, or (a node ``expand_shards`` wrote per shard, stamped
    only later by ``place_shard_values``) the same rule as there: its first reader's, else its
    inputs' last. Without it a block's shard nodes and its stamped nodes (the micro-batches' residual
    adds) would make regions apart that read each other's outputs."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    stage = {n: n.meta[STAGE] for n in nodes if STAGE in n.meta}
    if not stage:
        return {}
    for node in reversed(nodes):
        if node not in stage and (readers := [stage[u] for u in node.users if u in stage]):
            stage[node] = min(readers)
    for node in nodes:
        if node not in stage:
            stage[node] = max((stage.get(a, 0) for a in node.all_input_nodes), default=0)
    return stage


def _closed(
    members: set[fx.Node], order: dict[fx.Node, int], stage: dict[fx.Node, object], *, staged: bool = False
) -> set[fx.Node]:
    """``members`` with every node on a path between two of them (a send, a collective)."""
    low, high = min(order[n] for n in members), max(order[n] for n in members)
    after: set[fx.Node] = set()
    stack = list(members)
    while stack:
        for user in stack.pop().users:
            if user not in after and order[user] <= high:
                after.add(user)
                stack.append(user)
    before: set[fx.Node] = set()
    stack = list(members)
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg not in before and order[arg] >= low:
                before.add(arg)
                stack.append(arg)
    stages = {stage.get(n) for n in members}
    return members | {n for n in after & before if _recomputable(n) and (not staged or stage.get(n) in stages)}


def _calls(
    members: set[fx.Node], path: str, order: dict[fx.Node, int], stage: dict[fx.Node, object], staged: bool
) -> list[set[fx.Node]]:
    """``members`` cut where another module's code runs between them (a module called twice,
    ``shared(b(a(shared(x))))``): each call is a region, as eager checkpoints each call, and no
    region takes in another module's nodes (which may be a region of their own)."""
    closed = _closed(members, order, stage, staged=staged)
    foreign = sorted(order[n] for n in closed - members if module_path_of(n) is not None and not _in_path(n, path))
    if not foreign:
        return [members]
    calls: list[set[fx.Node]] = [set()]
    at = 0
    for node in sorted(members, key=order.__getitem__):
        if at < len(foreign) and foreign[at] < order[node]:
            while at < len(foreign) and foreign[at] < order[node]:
                at += 1
            calls.append(set())
        calls[-1].add(node)
    return [c for c in calls if c]


_ROWS = "dpcompile_rows"  # passes.data_parallel: the replica or micro-batch whose rows a value holds


def _stateless(node: fx.Node) -> bool:
    """A ``call_module`` of a torch.nn module that neither keeps buffers nor draws (T5's
    ``relative_attention_bias`` Embedding of the bucketed positions): a function of its input."""
    try:
        module = node.graph.owning_module.get_submodule(str(node.target))
    except AttributeError:  # no owner or no such module: not known to be a function
        return False
    return (type(module).__module__.startswith("torch.nn.") and not any(True for _ in module.buffers())
            and not isinstance(module, (nn.modules.dropout._DropoutNd, nn.RReLU)))  # fmt: skip


def _without_shared_values(nodes: set[fx.Node], order: dict[fx.Node, int]) -> set[fx.Node]:
    """``nodes`` less the values every replica or micro-batch shares, made from values outside them
    (Llama's ``cos.unsqueeze(1)`` of the rotary positions inside each layer, T5's position bias):
    computed once before the regions and read by each, they no longer join the micro-batches into
    one region (which 1F1B refuses, and which recomputes every micro-batch at once)."""
    if not any(_ROWS in n.meta for n in nodes):
        return nodes
    shared: set[fx.Node] = set()
    for node in sorted(nodes, key=order.__getitem__):
        pure = (node.op in ("call_function", "call_method") and not node.is_impure() and not writes(node)
                or node.op == "call_module" and _stateless(node))  # fmt: skip
        drawn = any(w in getattr(node.target, "__name__", str(node.target)) for w in ("rand", "dropout", "bernoulli"))
        if (_ROWS not in node.meta and pure and not drawn
                and all(a not in nodes or a in shared for a in node.all_input_nodes)):  # fmt: skip
            shared.add(node)
    return nodes - shared


def _without_joins(nodes: set[fx.Node], order: dict[fx.Node, int]) -> set[fx.Node]:
    """``nodes`` less a join of the micro-batches or replicas (the ``gather`` of a block's outputs
    that the next block's ``input.dim()`` check reads, torchvision's ViT) and what only reads it,
    where nothing else of ``nodes`` reads them: left after the regions, they read each one's output
    and no longer join every micro-batch into one region."""
    joined: set[fx.Node] = set()
    for node in sorted(nodes, key=order.__getitem__):
        if _ROWS in node.meta or writes(node):
            continue
        rows = {a.meta[_ROWS] for a in node.all_input_nodes if a in nodes and _ROWS in a.meta}
        if len(rows) > 1 or any(a in joined for a in node.all_input_nodes):
            joined.add(node)
    after: set[fx.Node] = set()
    for node in sorted(joined, key=order.__getitem__, reverse=True):
        if all(u not in nodes or u in after for u in node.users):
            after.add(node)
    return nodes - after


def _per_micro_batch(nodes: set[fx.Node], order: dict[fx.Node, int]) -> set[fx.Node]:
    """``nodes`` less what no micro-batch or replica owns, which would join their parts."""
    return _without_joins(_without_shared_values(nodes, order), order)


def _components(nodes: set[fx.Node]) -> list[set[fx.Node]]:
    """The parts of ``nodes`` that share no value (replicas, micro-batches)."""
    parent = {n: n for n in nodes}

    def root(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for node in nodes:
        for arg in node.all_input_nodes:
            if arg in nodes:
                parent[root(arg)] = root(node)
    parts: dict[fx.Node, set[fx.Node]] = {}
    for node in nodes:
        parts.setdefault(root(node), set()).add(node)
    return list(parts.values())


def _identifier(path: str) -> str:
    """A module path as a Python name: ``layers.0`` -> ``layers_0``; a top-level ``Sequential``'s
    ``0`` -> ``module_0`` (generated code cannot name a variable ``0_module``); any other character a
    name cannot hold (torchvision RegNet's ``block1-0``) -> ``_``."""
    name = re.sub(r"\W", "_", path)
    return f"module_{name}" if name[:1].isdigit() else name


def _region_name(path: str, nodes: list[fx.Node], taken: set[str]) -> str:
    suffixes = {m.group(0) for n in nodes if (m := _PLACE_SUFFIX.search(n.name))}
    base = _identifier(path) + (suffixes.pop() if len(suffixes) == 1 else "")
    name, k = base, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def paths_run_in(gm: fx.GraphModule, paths: Sequence[str]) -> tuple[str, ...]:
    """Those of ``paths`` some operation of ``gm`` runs in (a pipeline stage's, over a mesh, of the
    model's), in their order."""
    return tuple(p for p in paths if any(_recomputable(n) and _in_path(n, p) for n in gm.graph.nodes))


def find_checkpoint_regions(gm: fx.GraphModule, paths: Sequence[str]) -> list[CheckpointRegion]:
    """The regions of ``paths`` (module paths; a path inside another given one is part of it).

    Raises ``DpCompileError`` for a path no node of the program ran in.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    stage = _stages(gm)
    outer = [p for p in dict.fromkeys(paths) if not any(p.startswith(q + ".") for q in paths if q != p)]
    regions: list[CheckpointRegion] = []
    taken: set[str] = set()  # names among regions; a region takes its nodes' names once they are gone
    done = {n.meta.get("dpcompile_region") for n in gm.graph.nodes}
    for path in outer:
        members = {n for n in gm.graph.nodes if _recomputable(n) and _in_path(n, path)}
        if not members and path in done:  # checkpointed already: running the pass again changes nothing
            continue
        if not members:
            raise DpCompileError(
                f"activation_checkpointing names {path!r}, but no operation of the program runs in it (a module "
                "forward does not call); leave it out of the list"
            )
        by_stage: dict[object, set[fx.Node]] = {}  # a pipeline stage's part of a module runs on its device
        for node in members:
            by_stage.setdefault(stage.get(node), set()).add(node)
        staged = len(by_stage) > 1
        parts = [p for group in by_stage.values() for call in _calls(group, path, order, stage, staged)
                 for p in _components(_per_micro_batch(_closed(call, order, stage, staged=staged), order))]  # fmt: skip
        for part in sorted(parts, key=lambda p: min(order[n] for n in p)):
            nodes = sorted(part, key=order.__getitem__)
            inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in part))
            outputs = [n for n in nodes if any(u not in part for u in n.users)]
            if outputs and not all(n.target is send for n in nodes):  # a stage's send alone keeps nothing
                _refuse_writes_into_inputs(path, nodes, part)
                regions.append(CheckpointRegion(path, _region_name(path, nodes, taken), nodes, inputs, outputs))
    return regions


def _refuse_writes_into_inputs(path: str, nodes: list[fx.Node], part: set[fx.Node]) -> None:
    """A region that writes in place into a tensor it reads from outside (``self.seen.add_(h)``)
    cannot be recomputed: checkpoint saves that tensor as it was before the write (backward then
    finds it modified), and the recompute would read it after. Module-internal writes (batch norm's
    running statistics) are not nodes here, and the runtime undoes them after the recompute."""
    for node in nodes:
        written = node.kwargs.get("out", node.args[0] if node.args else None)  # export's div.out(..., out=_u)
        if writes(node) and isinstance(written, fx.Node) and written not in part:
            line = node.meta.get("stack_trace", "").strip().splitlines()
            where = f" ({line[-1].strip()})" if line else ""
            raise DpCompileError(
                f"activation_checkpointing: {path!r} writes in place into {written.name!r}, which it reads from "
                f"outside, at {node.name!r}{where}; a recompute in backward would read it after the write. Leave "
                f"{path!r} out of activation_checkpointing=, or name its submodules that do not write"
            )


def _owner_and_method(target: str, path: str, staged: bool) -> tuple[str, str]:
    """The module a region gets as an argument for ``call_module`` ``target``, and the method path on
    it; in a pipeline the module itself (a stage moves the modules it is given onto its device)."""
    if staged:
        return target, "__call__"
    if target.startswith(path + "."):
        return path, target[len(path) + 1 :]
    if "." in target:
        owner, _, last = target.rpartition(".")
        return owner, last
    return target, "__call__"


def _region_module(region: CheckpointRegion) -> tuple[fx.GraphModule, list[fx.Node | str]]:
    """The region's nodes as a parameter-free GraphModule, and what the call passes it: its input
    nodes, and the module paths it calls (as strings, for the caller to fetch)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    arguments: list[fx.Node | str] = []
    for value in region.inputs:
        env[value] = graph.placeholder(value.name)
        arguments.append(value)
    owners: dict[str, fx.Node] = {}
    kept = set(region.kept)
    for node in region.nodes:
        if node in kept:
            graph.call_function(keep_outputs, (True,))
        _copy_into(graph, node, region, env, owners, arguments)
        if node in kept:
            graph.call_function(keep_outputs, (False,))
    outs = [env[n] for n in region.outputs]
    graph.output(outs[0] if len(outs) == 1 else tuple(outs))
    return _region_from_graph(graph, f"Region_{region.name}"), arguments


class RegionModule(fx.GraphModule):
    """A region's GraphModule, pickled as its graph: fx's own pickling traces the generated code
    again, which would enter the runtime functions it calls (BatchNorm's ``batch_norm`` branches on
    the module's mode) instead of keeping them as calls."""

    def __reduce__(self):  # type: ignore[override]
        return _region_from_graph, (PicklableGraph(self.graph), self._get_name())


def _region_from_graph(graph: fx.Graph | PicklableGraph, class_name: str) -> fx.GraphModule:
    if isinstance(graph, PicklableGraph):
        graph = graph.graph()
    module = RegionModule(nn.Module(), graph, class_name=class_name)
    setattr(module, PROGRAM_OWNED, True)
    return module


def _copy_into(graph: fx.Graph, node: fx.Node, region: CheckpointRegion, env: dict[fx.Node, fx.Node],
               owners: dict[str, fx.Node], arguments: list[fx.Node | str]) -> None:  # fmt: skip
    """Copy ``node`` into the region's ``graph``; a module it calls comes in as an argument."""
    if node.op != "call_module":
        env[node] = graph.node_copy(node, env.__getitem__)
    else:
        owner, method = _owner_and_method(str(node.target), region.path, STAGE in node.meta)
        if owner not in owners:
            owners[owner] = graph.placeholder(_identifier(owner) + "_module")
            arguments.append(owner)
        args = tuple(fx.map_arg(node.args, env.__getitem__))
        kwargs = fx.map_arg(node.kwargs, env.__getitem__)
        env[node] = graph.create_node("call_method", method, (owners[owner], *args), kwargs, name=node.name)
        env[node].meta = dict(node.meta)


def _stable_topological_order(graph: fx.Graph) -> None:
    """Reorder ``graph`` so every node follows its inputs, keeping the old order where it can."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(index[n], n) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    ordered: list[fx.Node] = []
    while ready:
        _, node = heapq.heappop(ready)
        ordered.append(node)
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (index[user], user))
    cursor = graph._root  # type: ignore[attr-defined]
    for node in ordered:
        cursor.append(node)
        cursor = node


def _placed(node: fx.Node, like: fx.Node) -> fx.Node:
    node.meta.update({k: like.meta[k] for k in _PLACEMENT if k in like.meta})
    return node


def _take_name(graph: fx.Graph, node: fx.Node, name: str) -> None:
    """Give ``node`` the name of a node erased from ``graph``."""
    namespace = graph._graph_namespace  # type: ignore[attr-defined]
    namespace._used_names.discard(name)
    node._rename(name)


def _device_of(region: CheckpointRegion) -> tuple[object, object]:
    """Where a region runs: its replica or micro-batch suffix and its pipeline stage."""
    suffix = _PLACE_SUFFIX.search(region.name)
    return (suffix.group(0) if suffix else None), region.nodes[-1].meta.get(STAGE)


def _kept_by_region(gm: fx.GraphModule, regions: list[CheckpointRegion], rule: str, over_device: bool) -> None:
    """Set each region's ``kept``: per region, or (``over_device``, an ``"auto"`` rule) by one
    knapsack over the regions of each device."""
    if not (over_device and rule.startswith("auto:")):
        for region in regions:
            region.kept = kept_for_rule(gm, region.nodes, rule)
        return
    by_device: dict[tuple[object, object], list[CheckpointRegion]] = {}
    for region in regions:
        by_device.setdefault(_device_of(region), []).append(region)
    for group in by_device.values():
        nodes = [r.nodes for r in group]
        chosen = (kept_within_bytes(gm, nodes, rule) if byte_budget(rule)
                  else kept_over_regions(gm, nodes, float(rule.removeprefix("auto:"))))  # fmt: skip
        for region, kept in zip(group, chosen, strict=True):
            region.kept = kept


def _tiled_calls(gm: fx.GraphModule, region: CheckpointRegion, holder: fx.Node, values: list[fx.Node],
                 tiles: int, saving: dict[str, bool], last: fx.Node) -> fx.Node:  # fmt: skip
    """``token_tiles`` of each value the region reads, one checkpoint call per tile, and the
    ``join_tiles`` of their outputs (returned); inserted after ``values[-1]``."""
    graph = gm.graph
    cursor = values[-1]
    inputs = set(tiled_input(gm, region.inputs, region.nodes))

    def add(target, args, kwargs=None, name=None):
        nonlocal cursor
        with graph.inserting_after(cursor):
            cursor = _placed(stamp(graph.create_node("call_function", target, args, kwargs or {}, name=name), PASS, last), last)
        return cursor

    cut = {v: add(token_tiles, (v, tiles), name=f"{region.name}_tiles") for v in values if v in inputs}
    parts = []
    for i in range(tiles):
        args = [add(operator.getitem, (cut[v], i), name=f"{region.name}_tile{i}_in") if v in cut else v for v in values]
        parts.append(add(checkpoint, (holder, *args), saving, name=f"{region.name}_tile{i}"))
    return add(join_tiles, (parts, next(iter(cut))), name=f"{region.name}_checkpoint")


def checkpoint_activations(gm: fx.GraphModule, *, paths: Sequence[str], save: str = "nothing") -> PassResult:
    """Rewrite each region of ``paths`` into ``dpcompile_runtime_checkpoint(self.<name>_region, ...)``;
    the nodes ``save`` names (``passes.checkpoint_saves``, ``passes.checkpoint_budget``) keep their outputs, between
    ``dpcompile_runtime_keep_outputs(True)`` and ``(False)`` in the region's code. ``save`` may end in
    ``@device`` (one knapsack over a device's regions) and ``;tiles=k``: a region acting on each token
    alone runs as ``k`` checkpoint calls on token slices (``passes.checkpoint_tiles``).

    ``info["regions"]`` is ``{region name: module path}``, ``info["tiled"]`` the regions run in tiles,
    ``info["untiled"]`` ``{region name: why not}``; no paths: a no-op.
    """
    if not paths:
        return PassResult(gm, False, {"regions": {}})
    rule, over_device, tiles = parse_save_rule(save)
    regions = find_checkpoint_regions(gm, paths)
    _kept_by_region(gm, regions, rule, over_device)
    untiled = {r.name: why_not_per_token(gm, r.nodes, r.inputs) for r in regions} if tiles > 1 else {}
    graph = gm.graph
    replaced: dict[fx.Node, fx.Node] = {}  # an earlier region's outputs, read by a later one
    for region in regions:
        region.inputs = [replaced.get(n, n) for n in region.inputs]
        module, arguments = _region_module(region)
        attribute, k = f"{region.name}_region", 1
        while hasattr(gm, attribute):
            attribute, k = f"{region.name}_{k}_region", k + 1
        if tiles > 1:  # pm.strategies reads why a region runs whole
            module.untiled_reason = untiled[region.name]
        gm.add_submodule(attribute, module)
        last = region.nodes[-1]
        with graph.inserting_after(last):
            holder = _placed(stamp(graph.create_node("get_attr", attribute, name=attribute), PASS, last), last)
        values: list[fx.Node] = []
        cursor = holder
        for argument in arguments:
            if isinstance(argument, str):
                with graph.inserting_after(cursor):
                    name = _identifier(argument) + "_module"
                    cursor = _placed(stamp(graph.create_node("get_attr", argument, name=name), PASS, last), last)
                values.append(cursor)
            else:
                values.append(argument)
        saving = ({"saving": True} if region.kept else {}) | (
            {} if may_write_outside(region.nodes) else {"undo_writes": False})  # fmt: skip
        if tiles > 1 and untiled[region.name] is None:
            call = _tiled_calls(gm, region, holder, values, tiles, saving, last)
        else:
            with graph.inserting_after(cursor):
                call = graph.create_node("call_function", checkpoint, (holder, *values), saving, name=f"{region.name}_checkpoint")
            _placed(stamp(call, PASS, last), last)
        call.meta["dpcompile_region"] = region.path
        results = [call]
        if len(region.outputs) > 1:
            results = []
            for i, out in enumerate(region.outputs):
                with graph.inserting_after(results[-1] if results else call):
                    results.append(_placed(stamp(graph.call_function(operator.getitem, (call, i)), PASS, out), out))
        inside = set(region.nodes)
        for out, result in zip(region.outputs, results, strict=True):
            out.replace_all_uses_with(result, delete_user_cb=lambda user, inside=inside: user not in inside)
            replaced[out] = result
            if "val" in out.meta:
                result.meta["val"] = out.meta["val"]
        names = [out.name for out in region.outputs]
        for node in reversed(region.nodes):
            graph.erase_node(node)
        if len(results) > 1:  # the values keep their names: the code after the region reads as before
            for result, name in zip(results, names, strict=True):
                _take_name(graph, result, name)
        if region.name not in {n.name for n in graph.nodes}:  # one of the values may hold it now
            _take_name(graph, call, region.name)
    _stable_topological_order(graph)
    info = {"regions": {r.name: r.path for r in regions}}
    if tiles > 1:
        info |= {"tiled": [n for n, why in untiled.items() if why is None],
                 "untiled": {n: why for n, why in untiled.items() if why is not None}}  # fmt: skip
    return PassResult(gm, bool(regions), info)


def with_regions_recomputed(gm: fx.GraphModule, paths: Sequence[str], save: str = "nothing") -> fx.GraphModule:
    """A copy of the single-device program ``gm`` with ``paths`` checkpointed (for counting what a
    step saves for backward: ``explain``'s memory estimate); ``gm`` is left as it is."""
    copy = graph_module(gm, copy_graph(gm.graph), type(gm).__name__)
    checkpoint_activations(copy, paths=paths, save=save)
    copy.recompile()
    return copy


__all__ = ["CheckpointRegion", "checkpoint_activations", "find_checkpoint_regions", "paths_run_in", "with_regions_recomputed"]
