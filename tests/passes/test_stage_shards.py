"""``passes/stage_shards.py``: stages over ``shard_linear``'s one-shard program, and the shard
helpers' batch rules the micro-batches need."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpcompile.analysis.batch_dims import propagate
from dpcompile.analysis.placement import Split, Whole
from dpcompile.analysis.sharding import Sharded, resolve_plan
from dpcompile.devices import parse_devices
from dpcompile.errors import DpCompileError
from dpcompile.runtime import collectives
from passes.shard_linear import shard_linear
from passes.split_stages import find_stage_boundaries
from passes.stage_shards import inside_sharded_regions, stages_of_shards
from tests.helpers import captured

PLAN = {"fc1": "column", "fc2": "row", "fc3": "column", "fc4": "row"}


class Blocks(nn.Module):
    """Two column → row pairs reading the same input (copied to the shards once, read in both)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.fc3, self.fc4 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc2(F.gelu(self.fc1(x)))
        return self.fc4(F.gelu(self.fc3(x))) + h


def _inputs():
    return (torch.randn(4, 8),)


def test_inside_sharded_regions_lists_the_ops_between_a_column_layer_and_its_row_layer():
    """A cut must not fall after fc1 (column) up to fc2 (row) that reads its sharded output."""
    gm = captured(Blocks(), *_inputs())
    inside = inside_sharded_regions(gm, resolve_plan(gm, plan=PLAN, n=2).analysis.layouts)
    assert {"gelu", "fc2"} <= inside and {"fc1", "fc3"}.isdisjoint(inside)
    plan = find_stage_boundaries(gm, stages=2, no_cut_before=inside)
    assert plan.starts[1] == "fc3"


def test_stages_of_shards_copies_a_replicated_input_again_in_each_stage():
    """``x`` copied to the shards for fc1 is copied again in stage 1 for fc3, not sent per shard."""
    gm = captured(Blocks(), *_inputs())
    plan = find_stage_boundaries(gm, stages=["fc3"])
    shard_linear(gm, plan=PLAN, devices=parse_devices(["cpu"] * 2))
    staged = stages_of_shards(gm, plan)
    copies = {n.name: staged.stage_of[n.name] for n in gm.graph.nodes if n.target is collectives.copy_to_shards}
    assert copies == {"x_copy": 0, "x_copy_stage1": 1}
    for node in gm.graph.nodes:  # no sharded value is read in another stage
        if isinstance(node.meta.get("dpcompile_layout"), Sharded) and node.op != "get_attr":
            assert {staged.stage_of[u.name] for u in node.users if u.op != "output"} <= {staged.stage_of[node.name]}


def test_stages_of_shards_refuses_a_cut_through_a_column_row_pair():
    """A boundary before fc2 would send fc1's sharded output: refused, naming the way out."""
    gm = captured(Blocks(), *_inputs())
    plan = find_stage_boundaries(gm, stages=["fc2"])
    shard_linear(gm, plan=PLAN, devices=parse_devices(["cpu"] * 2))
    with pytest.raises(DpCompileError, match="keep a column layer and the row layer it feeds in one stage"):
        stages_of_shards(gm, plan)


def test_shard_helpers_split_into_micro_batches():
    """The one-shard program's collectives are per sample: its values stay split on the batch dim."""
    gm = captured(Blocks(), *_inputs())
    shapes = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    shard_linear(gm, plan=PLAN, devices=parse_devices(["cpu"] * 2))
    for node in gm.graph.nodes:  # shard_linear's new nodes: the shapes of the nodes they come from
        if "val" not in node.meta and shapes.get(node.meta.get("dpcompile_source")) is not None:
            node.meta["val"] = shapes[node.meta["dpcompile_source"]]
    placements = propagate(gm, {"x": 0})
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in collectives.COLLECTIVES:
            assert isinstance(placements[node], Split) and placements[node].dim == 0, node.name
    assert not any(isinstance(p, Whole) and p.batch for p in placements.values())
