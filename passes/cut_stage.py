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
from dataclasses import dataclass

import torch.fx as fx

from dpcompile import runtime
from dpcompile.errors import DpCompileError
from dpcompile.infra import PassResult, replace_graph, stamp
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


def cut_stage(gm: fx.GraphModule, *, plan: StagePlan, stage: int) -> PassResult:
    """Rewrite ``gm`` (lowered for one device) into the program of pipeline stage ``stage``."""
    _drop_one_device_scatter(gm)
    stages = node_stages(gm, plan)
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    last = plan.stages - 1

    def where(node: fx.Node) -> int:
        return -1 if node.op == "placeholder" else stages[node]

    def readers(node: fx.Node) -> set[int]:
        return {last if u.op == "output" else stages[u] for u in node.users}

    def live_after(b: int) -> list[fx.Node]:
        return [n for n in nodes if n.op != "output" and where(n) <= b and any(s > b for s in readers(n))]

    leaves = [n for n in output.all_input_nodes]
    has_loss = any(n.op == "call_function" and n.target is runtime.mean_of_partials for n in leaves)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = [n for n in nodes if n.op == "placeholder"] if stage == 0 else live_after(stage - 1)
    for value in inputs:
        env[value] = graph.placeholder(value.name if value.op == "placeholder" else value.name.replace("_dev0", ""))
    for node in nodes:
        if node.op in ("placeholder", "output") or stages[node] != stage:
            continue
        env[node] = graph.node_copy(node, lambda v: env[v])
    info: dict = {"has_loss": has_loss}
    if stage < last:
        graph.output(tuple(env[v] for v in live_after(stage)))
    else:
        flat, layout = _last_stage_outputs(graph, output, env)
        graph.output(tuple(flat))
        info["outputs"] = layout
    for node in reversed(list(graph.nodes)):  # the one-device gather and mean the outputs replaced
        if not node.users and node.op == "call_function" and node.target in (runtime.gather, runtime.mean_of_partials):
            graph.erase_node(node)
    for node in graph.nodes:
        if node.op not in ("placeholder", "output") and "dpcompile_pass" not in node.meta:
            stamp(node, PASS)
    replace_graph(gm, graph)
    _tidy_names(gm.graph)
    return PassResult(gm, True, {"stage": stage, "inputs": [v.name for v in inputs], **info})


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
        elif node.op == "call_function" and node.target is runtime.mean_of_partials:
            pair = graph.call_function(runtime.partial_pair, (env[node.args[0][0]], env[node.args[1][0]]))
            flat.extend(
                [graph.call_function(operator.getitem, (pair, 0)), graph.call_function(operator.getitem, (pair, 1))]
            )
            leaves.append(("mean", len(flat) - 2, len(flat) - 1))
        else:
            raise DpCompileError(
                f"over a mesh, a pipeline's outputs must be split along the batch or be a mean loss; output "
                f"'{node.name}' is neither ({node.op} {getattr(node.target, '__name__', node.target)}): return the "
                "per-sample values and the loss, or run the pipeline in one process (devices=[...])"
            )
        return len(leaves) - 1

    structure = fx.node.map_aggregate(output.args[0], lambda v: leaf(v) if isinstance(v, fx.Node) else v)
    return flat, StageOutputs(tuple(leaves), structure)


def _tidy_names(graph: fx.Graph) -> None:
    """``fc1_dev0`` reads ``fc1``: one device's program has no other."""
    taken = {n.name for n in graph.nodes}
    for node in graph.nodes:
        wanted = _DEV0.sub("", node.name)
        if wanted != node.name and wanted not in taken:
            taken.discard(node.name)
            taken.add(node._rename(wanted) or wanted)
