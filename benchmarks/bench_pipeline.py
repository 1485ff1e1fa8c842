"""What does a dpcompile pipeline cost against the same pipeline written by hand, and how well
does the planner balance the stages?

    python benchmarks/bench_pipeline.py [--mesh]

A deep MLP (16 x Linear(512, 512) + ReLU, a cross-entropy loss in forward) on ``["cpu"] * 4``
virtual devices, 4 stages, 4 micro-batches, batch 64, forward + backward:

- ``dpcompile_s``: ``dpcompile.transform(model, devices, pipeline=4, micro_batches=4)``;
- ``by_hand_s``: the PyTorch model-parallel tutorial's loop over the same stages (the planner's
  cut, the same modules): ``x.chunk(4)``, each chunk through stage 0, moved, stage 1, ...,
  the per-chunk loss sums added and divided by the batch;
- ``ratio`` = dpcompile / by hand (goal: at most 1.05);
- ``stage_flops_max_over_mean``: the planner's balance on this uniform stack (goal: at most 1.1),
  from ``dpcompile.explain``, and the bubble fraction ``(S-1)/(M+S-1)``.

Over a mesh (``--mesh``, 2 gloo processes on CPU, a ``("pp",)`` mesh, GPipe, 4 micro-batches):

- ``mesh_dpcompile_s``: ``dpcompile.transform(model, mesh, pipeline=2, micro_batches=4)``, one
  training step (forward and backward run by the schedule);
- ``mesh_by_hand_s``: the same two stages written by hand with ``torch.distributed.pipelining``
  (``PipelineStage`` over ``nn.Sequential`` of the planner's modules, ``ScheduleGPipe`` with a
  ``loss_fn``): what a user of the engine writes;
- ``mesh_ratio`` = dpcompile / by hand (goal: at most 1.05).

Ratios come from one process (each rank of the mesh), measured in alternation. Results:
results/pipeline.json.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
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

    def forward(self, x, labels):
        return F.cross_entropy(self.layers(x), labels)


def by_hand(model: LossMLP, stage_paths: list[tuple[str, ...]], devices: list[str]):
    """The tutorial's pipeline over the planner's stages: a loop over micro-batches and stages."""
    stages = [nn.Sequential(*[model.get_submodule(p) for p in paths]) for paths in stage_paths]

    def step(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = None
        for chunk, chunk_labels in zip(x.chunk(MICRO), labels.chunk(MICRO)):
            h = chunk
            for stage, device in zip(stages, devices):
                h = stage(h.to(device))
            part = F.cross_entropy(h, chunk_labels.to(h.device), reduction="sum").to(devices[0])
            total = part if total is None else total + part
        return total / x.size(0)

    return step


def _mesh_rank(rank: int, port: int, out: dict) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # fmt: skip
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model = LossMLP()
    x, labels = torch.randn(BATCH, WIDTH), torch.randint(0, WIDTH, (BATCH,))
    pm = dpcompile.transform(model, mesh, pipeline=2, micro_batches=MICRO, example_inputs=(x, labels))
    hand_model = LossMLP()
    hand_model.load_state_dict(model.state_dict())
    mine = nn.Sequential(*[hand_model.get_submodule(p) for p in pm.module_paths])
    stage = PipelineStage(mine, rank, 2, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, MICRO, loss_fn=lambda out, target: F.cross_entropy(out, target) / MICRO)

    def ours():
        model.zero_grad(set_to_none=True)
        pm(x, labels)

    def by_hand():
        hand_model.zero_grad(set_to_none=True)
        schedule.step(*((x,) if rank == 0 else ()), target=labels)

    times = interleaved({"dpcompile": ours, "by_hand": by_hand}, rounds=15, warmup=3)
    if rank == 0:
        out.update(times)
    dist.destroy_process_group()


def _mesh_entry(rank: int, port: int, queue) -> None:
    out: dict = {}
    _mesh_rank(rank, port, out)
    if rank == 0:
        queue.put(out)


def mesh_times() -> dict:
    """Step times over a 2-process ("pp",) gloo mesh: dpcompile's pipeline and the same stages by hand."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_mesh_entry, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return result


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    devices = ["cpu"] * STAGES
    model = LossMLP()
    x, labels = torch.randn(BATCH, WIDTH), torch.randint(0, WIDTH, (BATCH,))
    pm = dpcompile.transform(model, devices, pipeline=STAGES, micro_batches=MICRO, example_inputs=(x, labels))
    report = dpcompile.explain(pm, x, labels).pipeline
    hand = by_hand(model, [s.module_paths for s in pm.stages], devices)
    torch.testing.assert_close(pm(x, labels), hand(x, labels))

    def run(fn):
        def step():
            model.zero_grad(set_to_none=True)
            fn(x, labels).backward()

        return step

    times = interleaved({"dpcompile": run(pm), "by_hand": run(hand)}, rounds=15, warmup=3)
    payload = {
        "model": f"{LAYERS} x Linear({WIDTH}, {WIDTH}) + ReLU, cross-entropy in forward",
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
    if "--mesh" in sys.argv:
        mesh = mesh_times()
        payload.update(mesh_dpcompile_s=mesh["dpcompile"], mesh_by_hand_s=mesh["by_hand"],
                       mesh_ratio=mesh["dpcompile"] / mesh["by_hand"])  # fmt: skip
        print(f"mesh ratio {payload['mesh_ratio']:.3f} (dpcompile {mesh['dpcompile'] * 1e3:.2f} ms, "
              f"by hand {mesh['by_hand'] * 1e3:.2f} ms)")  # fmt: skip
    path = write_result("pipeline", payload)
    print(f"ratio {payload['ratio']:.3f} (dpcompile {times['dpcompile'] * 1e3:.2f} ms, by hand {times['by_hand'] * 1e3:.2f} ms); "
          f"stage FLOPs max/mean {report['imbalance']:.3f}; bubble {report['bubble_fraction']:.3f} -> {path}")  # fmt: skip


if __name__ == "__main__":
    main()
