"""``cut_stage``: one stage's program, for ``torch.distributed.pipelining`` over a ``"pp"`` mesh dim.

It runs after :func:`~passes.split_stages.split_stages` and ``insert_scatter_gather`` over one
device (which writes every mean loss as a partial sum and a count: ``cross_entropy_sum_dev0``,
``cross_entropy_count_dev0``). It keeps the nodes of stage ``stage`` and makes the program a
``PipelineStage`` can run on one micro-batch: its inputs are the values live across the
boundary before it (for stage 0: the model's inputs), in graph order; its outputs are the values
live across the boundary after it, in the same order, so the next stage's inputs line up. A value
that a later stage reads passes through the stages between (the labels reach the last stage
this way). The last stage returns each output leaf: a batch-split value as it is, a mean loss
as its partial sum and count, each of shape ``(1,)``, which the module adds up over micro-batches
(and over ``dp``) into the whole batch's mean.

Stage 1 of 2 of ``tanh(head(tanh(layer(x))))`` with ``cross_entropy(logits, labels)``::

    def forward(self, tanh, labels):
        head = self.head(tanh)
        cross_entropy_sum = torch.nn.functional.cross_entropy(head, labels, reduction = 'sum')
        cross_entropy_count = dpcompile_runtime_target_weight(labels, None, -100)
        partial = dpcompile_runtime_partial_pair(cross_entropy_sum, cross_entropy_count)
        return (head, partial[0], partial[1])
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from dpcompile import runtime
from dpcompile.errors import DpCompileError
from dpcompile.infra import PassResult, replace_graph, stamp
from dpcompile.runtime import exported
from passes.split_stages import StagePlan
from passes.stage_transfers import node_stages

PASS = "cut_stage"
_DEV0 = re.compile(r"_dev0(?=_|$)")


@dataclass(frozen=True)
class StageOutputs:
    """How the last stage's flat outputs make the model's output: ``leaves`` per output leaf,
    ``("split", i, dim)`` (output ``i``, concatenated over micro-batches on ``dim``) or
    ``("mean", i_sum, i_count)``; ``structure``: the output with each leaf's index in ``leaves``."""

    leaves: tuple[tuple, ...]
    structure: object

    def assemble(self, values: list) -> object:
        """The model's output from each leaf's value (``values[i]`` for ``leaves[i]``)."""
        return _assemble(self.structure, values)


@dataclass(frozen=True)
class Built:
    """An output the program builds by a call (the export frontend rebuilds transformers'
    ``ModelOutput`` and named tuples that way; a program loaded from a folder, the output's record,
    ``exported.model_output``): ``kind(*args, **kwargs)`` of leaf indices."""

    kind: Callable[..., object]
    args: tuple
    kwargs: dict


def _assemble(structure: object, values: list) -> object:
    if isinstance(structure, Built):
        args = tuple(_assemble(a, values) for a in structure.args)
        return structure.kind(*args, **{k: _assemble(v, values) for k, v in structure.kwargs.items()})
    if isinstance(structure, int) and not isinstance(structure, bool):
        return values[structure]
    if isinstance(structure, (tuple, list)):
        return type(structure)(_assemble(v, values) for v in structure)
    if isinstance(structure, dict):
        return {k: _assemble(v, values) for k, v in structure.items()}
    return structure


def cut_stage(gm: fx.GraphModule, *, plan: StagePlan, stage: int) -> PassResult:
    """Rewrite ``gm`` (lowered for one device) into the program of pipeline stage ``stage``."""
    _drop_one_device_scatter(gm)
    stages = node_stages(gm, plan)
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    last = plan.stages - 1
    for node in _assembling(output):  # a value an earlier stage returns passes through, as the labels do
        stages[node] = last

    def where(node: fx.Node) -> int:
        return -1 if node.op == "placeholder" else stages[node]

    def readers(node: fx.Node) -> set[int]:
        return {last if u.op == "output" else stages[u] for u in node.users}

    def live_after(b: int) -> list[fx.Node]:
        return [n for n in nodes if n.op != "output" and where(n) <= b and any(s > b for s in readers(n))]

    means = [parts for parts in map(mean_parts, _output_leaves(output)) if parts is not None]
    if len(means) > 1:  # on every rank, before any stage is built
        second = next(n for n in _output_leaves(output) if mean_parts(n) is not None and mean_parts(n) != means[0])
        raise DpCompileError(
            f"over a mesh, a pipeline returns one mean loss (the one the schedule runs backward from); output "
            f"'{second.name}' is a second mean. Add it into the loss inside forward, or return its per-sample values "
            "(reduction='none', or a mean over dims after the batch's) and average them after, or run the pipeline "
            "in one process (devices=[...])"
        )
    has_loss = bool(means)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = [n for n in nodes if n.op == "placeholder"] if stage == 0 else live_after(stage - 1)
    for value in inputs:
        env[value] = graph.placeholder(value.name if value.op == "placeholder" else value.name.replace("_dev0", ""))
    for node in nodes:
        if node.op in ("placeholder", "output") or stages[node] != stage:
            continue
        env[node] = graph.node_copy(node, lambda v: env[v])
    info: dict = {"has_loss": has_loss, "count": means[0][1].name if means else None}
    if stage < last:
        graph.output(tuple(env[v] for v in live_after(stage)))
    else:
        flat, layout = _last_stage_outputs(graph, output, env)
        graph.output(tuple(flat))
        info["outputs"] = layout
    for node in reversed(list(graph.nodes)):  # the one-device gather and mean (and the output's class) replaced
        if (
            not node.users
            and node.op == "call_function"
            and (node.target in _REPLACED or builds_output(node))
        ):
            graph.erase_node(node)
    for node in graph.nodes:
        if node.op not in ("placeholder", "output") and "dpcompile_pass" not in node.meta:
            stamp(node, PASS)
    replace_graph(gm, graph)
    _tidy_names(gm.graph)
    return PassResult(gm, True, {"stage": stage, "inputs": [v.name for v in inputs], **info})


def find_shared_parameters(gm: fx.GraphModule, plan: StagePlan) -> list[tuple[str, tuple[int, ...]]]:
    """Trainable parameters that two stages read (tied weights: GPT-2's ``lm_head`` and ``wte``),
    each named where the graph first reads it, with the stages that read it. Over a mesh each of
    those stages' ranks holds its own copy, so their gradients are summed over those ranks.
    The order is the graph's: the same on every rank."""
    stages = node_stages(gm, plan)
    names: dict[int, str] = {}
    readers: dict[int, set[int]] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "get_attr") or node not in stages:
            continue
        value = gm.get_submodule(str(node.target)) if node.op == "call_module" else _attribute(gm, str(node.target))
        if isinstance(value, nn.Module):
            found = [(f"{node.target}.{n}", p) for n, p in value.named_parameters()]
        else:
            found = [(str(node.target), value)] if isinstance(value, nn.Parameter) else []
        for name, param in found:
            if param.requires_grad:
                names.setdefault(id(param), name)
                readers.setdefault(id(param), set()).add(stages[node])
    return [(names[k], tuple(sorted(s))) for k, s in readers.items() if len(s) > 1]


def _attribute(gm: fx.GraphModule, target: str) -> object:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name, None)


def mean_parts(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """A mean loss's partial sum and count, as ``insert_scatter_gather`` over one device writes it:
    ``mean_of_partials([sum], [count])``, or (``aten.cross_entropy_loss`` from the export frontend)
    ``reduce_add([sum]) / reduce_add([count])``."""
    if node.op != "call_function":
        return None
    if node.target is runtime.mean_of_partials and isinstance(node.args[1][0], fx.Node):
        return node.args[0][0], node.args[1][0]
    if node.target is operator.truediv and all(
        isinstance(a, fx.Node) and a.op == "call_function" and a.target is runtime.reduce_add and len(a.args[0]) == 1
        for a in node.args[:2]
    ):
        return node.args[0].args[0][0], node.args[1].args[0][0]
    return None


def _output_leaves(output: fx.Node) -> list[fx.Node]:
    """The output's values, inside the classes it builds (``ModelOutput(loss=..., logits=...)``)."""
    found: list[fx.Node] = []

    def visit(v: object) -> None:
        if isinstance(v, fx.Node) and builds_output(v):
            fx.node.map_aggregate((v.args, v.kwargs), visit)
        elif isinstance(v, fx.Node):
            found.append(v)

    fx.node.map_aggregate(output.args[0], visit)
    return found


def _assembling(output: fx.Node) -> list[fx.Node]:
    """The nodes that make the model's output from the stages' values (the one-device gathers, the
    mean losses' sums and divisions, the output's classes): the last stage assembles the output, so
    they are its, and a value made on an earlier stage (``return loss, hidden_of_stage0``) crosses
    the later stages to it."""
    found: list[fx.Node] = []

    def visit(v: object) -> None:
        if not isinstance(v, fx.Node) or v.op != "call_function":
            return
        if builds_output(v):
            found.append(v)
            fx.node.map_aggregate((v.args, v.kwargs), visit)
        elif v.target is runtime.gather and isinstance(v.args[1], int):
            found.append(v)
        elif mean_parts(v) is not None:
            found.append(v)
            found.extend(a for a in v.args[:2] if isinstance(a, fx.Node) and a.target is runtime.reduce_add)

    fx.node.map_aggregate(output.args[0], visit)
    return found


def builds_output(node: fx.Node) -> bool:
    """``node`` builds the model's output from values: a class it calls (``ModelOutput(loss=..., logits=...)``),
    or that class's record in a program loaded from a folder (``exported.model_output(name, fields, ...)``)."""
    return node.op == "call_function" and (isinstance(node.target, type) or node.target is exported.model_output)


_REPLACED = (runtime.gather, runtime.mean_of_partials, runtime.reduce_add, operator.truediv)
_COMBINERS = (runtime.gather, runtime.mean_of_partials, runtime.reduce_add)


def find_row_meetings(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """Where the program lowered over one device combines the batch's rows and computes on
    with the result (``h - h.mean(0, keepdim=True)``: a partial mean read by a subtraction), as
    ``(combiner, first reader)``. Over a mesh ``torch.distributed.pipelining`` runs each
    micro-batch apart, so there the combination would be each micro-batch's, not the batch's;
    combining only to make an output (the mean loss, the gathered logits) is what the stages
    assemble over micro-batches."""
    meetings = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _COMBINERS:
            reader = _first_computing_reader(node)
            if reader is not None:
                meetings.append((node, reader))
    return meetings


def _first_computing_reader(node: fx.Node) -> fx.Node | None:
    for user in node.users:
        assembles = user.op == "output" or (
            user.op == "call_function" and (builds_output(user) or user.target in _REPLACED)
        )
        if not assembles:
            return user
        if user.op != "output" and (reader := _first_computing_reader(user)) is not None:
            return reader
    return None


def _drop_one_device_scatter(gm: fx.GraphModule) -> None:
    """``scatter(x, [dev], 0)[0]`` is ``x``: the schedule has split the batch already."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is runtime.scatter:
            for user in list(node.users):
                if user.target is operator.getitem and user.args[1] == 0:
                    user.replace_all_uses_with(node.args[0])
                    gm.graph.erase_node(user)
            if not node.users:
                gm.graph.erase_node(node)


def _last_stage_outputs(
    graph: fx.Graph, output: fx.Node, env: dict[fx.Node, fx.Node]
) -> tuple[list[fx.Node], StageOutputs]:
    flat: list[fx.Node] = []
    leaves: list[tuple] = []

    def leaf(node: fx.Node) -> int:
        if node.op == "call_function" and node.target is runtime.gather and isinstance(node.args[1], int):
            flat.append(env[node.args[0][0]])
            leaves.append(("split", len(flat) - 1, node.args[1]))
        elif mean_parts(node) is not None:
            partial_sum, count = mean_parts(node)
            pair = graph.call_function(runtime.partial_pair, (env[partial_sum], env[count]))
            flat.extend(
                [graph.call_function(operator.getitem, (pair, 0)), graph.call_function(operator.getitem, (pair, 1))]
            )
            leaves.append(("mean", len(flat) - 2, len(flat) - 1))
        else:
            why = _mixing_message(node)
            raise DpCompileError(
                f"over a mesh, a pipeline's outputs must be split along the batch or be a mean loss; output "
                f"'{node.name}' is neither ({node.op} {getattr(node.target, '__name__', node.target)})"
                + (f": {why}. Keep the rows apart, or" if why else ": return the per-sample values and the loss, or")
                + " run the pipeline in one process (devices=[...])"
            )
        return len(leaves) - 1

    def value(v: object) -> object:
        if not isinstance(v, fx.Node):
            return fx.node.map_aggregate(v, lambda u: value(u) if isinstance(u, fx.Node) else u)
        if builds_output(v):  # ModelOutput(loss=..., logits=...)
            return Built(v.target, tuple(value(a) for a in v.args), {k: value(a) for k, a in v.kwargs.items()})
        return leaf(v)

    structure = fx.node.map_aggregate(output.args[0], value)
    return flat, StageOutputs(tuple(leaves), structure)


def _mixing_message(node: fx.Node) -> str | None:
    """Where ``node`` (an output the whole batch computes) met the other rows: the first op that
    reads a value gathered from the micro-batches (an op that mixes rows, or has no batch rule)."""
    seen: set[fx.Node] = set()
    stack = [node]
    readers: set[fx.Node] = set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target is runtime.gather:
            readers.update(u for u in n.users if u.op != "output")
            continue
        stack.extend(n.all_input_nodes)
    found = next((n for n in node.graph.nodes if n in readers), None)
    if found is None:
        return None
    return (
        f"'{found.name}' ({getattr(found.target, '__name__', found.target)}) mixes the rows of the batch (or has no "
        "batch rule), so it runs once on the gathered batch; over a mesh a stage runs one micro-batch at a time, and "
        "the outputs after it are the whole batch's"
    )


def _tidy_names(graph: fx.Graph) -> None:
    """``fc1_dev0`` reads ``fc1``: one device's program has no other."""
    taken = {n.name for n in graph.nodes}
    for node in graph.nodes:
        wanted = _DEV0.sub("", node.name)
        if wanted != node.name and wanted not in taken:
            taken.discard(node.name)
            taken.add(node._rename(wanted) or wanted)
