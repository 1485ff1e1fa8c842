"""The random plan of a pipeline stage over a mesh (``StageRandomPlan``) is recorded on a fake copy of
the whole program: FSDP, applied to the stage after the plan is made, swaps the shared modules'
parameters for DTensor shards (a ``("pp", "dp")`` mesh with ``data_parallel="fsdp"`` failed in the
recording run with "mixed torch.Tensor and DTensor"); which sites draw still follows the shared
modules' train/eval modes. Over gloo: ``test_exact_random_mesh.py``, the ``pp_fsdp`` cells."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

import passes
from dpcompile.modules.mesh_random import StageRandomPlan


class NoisyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        h = self.fc(x)
        return self.out(self.drop(h) + 0.1 * torch.randn_like(h))


def _plan() -> tuple[fx.GraphModule, StageRandomPlan]:
    gm = passes.draw_random_whole(fx.symbolic_trace(NoisyNet().train()), planned=True).graph_module
    return gm, StageRandomPlan(gm, frozenset(), torch.device("cpu"))


def _recorded(plan: StageRandomPlan, rows: int) -> list[tuple[str, tuple[int, ...]]]:
    record = plan.record((torch.randn(rows, 4),), rows, [(1, rows)], None)
    return [(site, shape) for site, shape, _ in record.plan]


def test_stage_random_plan_reads_no_real_parameter():
    """The shared modules' parameters replaced after the plan is made (as FSDP shards them): each
    input shape is still recorded, every site at its whole shape, in program order."""
    gm, plan = _plan()
    assert _recorded(plan, 3) == [("drop", (3, 8)), ("randn_like", (3, 8))]
    gm.fc.weight = nn.Parameter(torch.empty(8, 4, device="meta"))  # any real use of it would fail
    assert _recorded(plan, 5) == [("drop", (5, 8)), ("randn_like", (5, 8))]


def test_stage_random_plan_follows_the_shared_modules_modes():
    """A dropout module put in eval mode alone draws nothing: the plan records only the noise."""
    gm, plan = _plan()
    assert _recorded(plan, 3) == [("drop", (3, 8)), ("randn_like", (3, 8))]
    gm.drop.eval()
    assert _recorded(plan, 3) == [("randn_like", (3, 8))]
    plan.train(True)
    assert _recorded(plan, 3) == [("drop", (3, 8)), ("randn_like", (3, 8))]
