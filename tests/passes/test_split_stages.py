"""``find_stage_boundaries`` / ``split_stages`` / ``follow_plan``: where stages start, on captured graphs."""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from passes.split_stages import STAGE, find_stage_boundaries, follow_plan, split_stages


class Residual(nn.Module):
    """Four equal layers; the input skips over layers 1 and 2 (a cut inside sends two values)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        a = self.layers[0](x)
        b = self.layers[2](self.layers[1](a)) + a
        return self.layers[3](b)


def test_find_stage_boundaries_named_paths_start_stages():
    """pipeline=["layers.2"]: stage 1 starts at the first op of layers.2."""
    gm = fx.symbolic_trace(Residual())
    plan = find_stage_boundaries(gm, stages=["layers.2"])
    assert plan.stages == 2
    assert plan.module_paths == (("layers.0", "layers.1"), ("layers.2", "layers.3"))
    assert plan.sent == (("layers_0", "layers_1"),)  # the skip connection crosses too


def test_find_stage_boundaries_balanced_by_weight():
    """pipeline=N: stages of equal weight (2 stages of two layers, 4 of one)."""
    gm = fx.symbolic_trace(Residual())
    weights = {n.name: (64 if n.op == "call_module" else 0) for n in gm.graph.nodes}
    plan = find_stage_boundaries(gm, stages=2, weights=weights)
    assert plan.weights == (128, 128)
    assert plan.imbalance == 1.0
    plan3 = find_stage_boundaries(gm, stages=4, weights=weights)
    assert [len(p) for p in plan3.module_paths] == [1, 1, 1, 1]


def test_split_stages_stamps_without_changing_code():
    """split_stages stamps each node's stage and leaves the code as it was."""
    gm = fx.symbolic_trace(Residual())
    code = gm.code
    result = split_stages(gm, plan=find_stage_boundaries(gm, stages=["layers.2"]))
    assert not result.modified and gm.code == code
    assert {n.name: n.meta.get(STAGE) for n in gm.graph.nodes if n.op == "call_module"} == {
        "layers_0": 0, "layers_1": 0, "layers_2": 1, "layers_3": 1,
    }  # fmt: skip


def test_follow_plan_keeps_modules_in_their_stages():
    """Another trace of the same model keeps each module in the stage the plan gave it."""
    gm = fx.symbolic_trace(Residual())
    plan = find_stage_boundaries(gm, stages=["layers.3"])
    again = follow_plan(fx.symbolic_trace(Residual()), plan)
    assert again.module_paths == plan.module_paths
