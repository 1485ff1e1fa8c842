"""What does a dpcompile pipeline cost against the same pipeline written by hand, and how well
does the planner balance the stages?

    python benchmarks/bench_pipeline.py

A deep MLP (16 x Linear(512, 512) + ReLU, a mean loss) on ``["cpu"] * 4``
virtual devices, 4 stages, 4 micro-batches, batch 64, forward + backward:

- ``dpcompile_s``: ``dpcompile.transform(model, devices, pipeline=4, micro_batches=4)``;
- ``by_hand_s``: the PyTorch model-parallel tutorial's loop over the same stages (the planner's
  cut, the same modules): ``x.chunk(4)``, each chunk through stage 0, moved, stage 1, ...,
  the per-chunk loss sums added and divided by the element count;
- ``ratio`` = dpcompile / by hand (goal: at most 1.05);
- ``stage_flops_max_over_mean``: the planner's balance on this uniform stack (goal: at most 1.1),
  from ``dpcompile.explain``, and the bubble fraction ``(S-1)/(M+S-1)``.

The baseline is a one-process loop, not ``torch.distributed.pipelining`` (which needs one
process per stage; the mesh mode is not built yet). Ratios come from one process, measured
in alternation. Results: results/pipeline.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
from common import interleaved, write_result  # noqa: E402

import dpcompile  # noqa: E402

STAGES, MICRO, BATCH, LAYERS, WIDTH = 4, 4, 64, 16, 512


class LossMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])

    def forward(self, x):
        return self.layers(x).pow(2).mean()


def by_hand(model: LossMLP, stage_paths: list[tuple[str, ...]], devices: list[str]):
    """The tutorial's pipeline over the planner's stages: a loop over micro-batches and stages."""
    stages = [nn.Sequential(*[model.get_submodule(p) for p in paths]) for paths in stage_paths]

    def step(x: torch.Tensor) -> torch.Tensor:
        total = None
        for chunk in x.chunk(MICRO):
            h = chunk
            for stage, device in zip(stages, devices):
                h = stage(h.to(device))
            part = h.pow(2).sum().to(devices[0])
            total = part if total is None else total + part
        return total / (x.size(0) * WIDTH)

    return step


def main() -> None:
    torch.manual_seed(0)
    devices = ["cpu"] * STAGES
    model = LossMLP()
    x = torch.randn(BATCH, WIDTH)
    pm = dpcompile.transform(model, devices, pipeline=STAGES, micro_batches=MICRO, example_inputs=(x,))
    report = dpcompile.explain(pm, x).pipeline
    hand = by_hand(model, [s.module_paths for s in pm.stages], devices)
    torch.testing.assert_close(pm(x), hand(x))

    def run(fn):
        def step():
            model.zero_grad(set_to_none=True)
            fn(x).backward()

        return step

    times = interleaved({"dpcompile": run(pm), "by_hand": run(hand)}, rounds=15, warmup=3)
    payload = {
        "model": f"{LAYERS} x Linear({WIDTH}, {WIDTH}) + ReLU, mean loss",
        "devices": devices,
        "stages": STAGES,
        "micro_batches": MICRO,
        "batch": BATCH,
        "dpcompile_s": times["dpcompile"],
        "by_hand_s": times["by_hand"],
        "ratio": times["dpcompile"] / times["by_hand"],
        "stage_flops_max_over_mean": report["imbalance"],
        "bubble_fraction": report["bubble_fraction"],
        "stage_module_paths": [s["module_paths"] for s in report["stages"]],
    }
    path = write_result("pipeline", payload)
    print(f"ratio {payload['ratio']:.3f} (dpcompile {times['dpcompile'] * 1e3:.2f} ms, by hand {times['by_hand'] * 1e3:.2f} ms); "
          f"stage FLOPs max/mean {report['imbalance']:.3f}; bubble {report['bubble_fraction']:.3f} -> {path}")  # fmt: skip


if __name__ == "__main__":
    main()
