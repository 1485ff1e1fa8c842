"""What one more micro-batch costs a stage of ``bench_planner_rank.py``'s MLP pipeline (``pp2``, cut at
``layers.4``) over ``torch.distributed.pipelining`` on 2 gloo processes, decomposed into its parts (issue 34:
measured ~7 ms a micro-batch more a step, predicted ~1.3 ms).

Each rank (one thread, as torchrun gives it) times, interleaved over ``--rounds`` rounds (the minimum kept:
the machine is shared), its wall seconds, its main thread's CPU seconds (``time.thread_time``: what it
computes and dispatches, the schedule's Python included; not the waits, nor the time it was runnable but
not running) and its process's (the gloo threads' too):

- ``step``: a dpcompile training step, ``pipeline=2``, 1F1B at M = 2, 4, 8 and GPipe at M = 1, 2, 4, 8;
- ``calls``: the rank's own stage program called forward and backward on each of M micro-batches (its
  gradients accumulating), no schedule, no message: the stage's computing and dispatch, and autograd's
  per-micro-batch graph and gradient accumulation; ``alone`` (the other rank waiting in a barrier) and
  ``together`` (both ranks at once: two ranks contending for the cores and the memory bus);
- ``pingpong``: a blocking send/recv round trip of one micro-batch's boundary value between the ranks
  (half of it: one transfer's latency, the wake-up of the waiting process included), back to back, and
  ``after_work``: the same after 2 ms of computing on each side (a transfer reached after computing);
- ``torch one stage``: torch's GPipe over a one-stage pipeline on each rank's own group (4 blocks 8 wide, no
  message), against the same calls without it: the schedule's own work per micro-batch;
- ``blocked receive``: rank 0's receive of one float while rank 1 computes 5 ms first: its CPU seconds (the
  wake-up's, main thread and gloo's);
- ``rendezvous``: rank 0's ``isend(...).wait()`` while rank 1 posts its recv 20 ms later (torch's 1F1B waits
  each send together with the next receive: a gloo send completes only once the peer posts its receive);
- in the main process, one thread, eager (CPU seconds, the least of ``--rounds``): the MLP's stage (4 blocks
  of 256, 512 rows) forward and backward in M = 1, 2, 4, 8 micro-batches with its gradients accumulating; the
  same with ``.grad`` reset after each micro-batch (no accumulation); the same stage 8 wide (its ops' dispatch
  and autograd's per-micro-batch graph, almost no weights); the accumulation alone (``add_`` of 8.4 MB); and
  the calibration's figures measured now (``op_seconds``, ``microbatch_weight_s_per_byte``).

Per micro-batch (the least-squares slope over M of the 1F1B runs, and of the calls) it prints the measured
step's wall, the main thread's CPU, the calls' wall alone and together; the schedule's own work per
micro-batch (the step's main-thread CPU less the calls' CPU, both slopes); the waits (the step's wall less
its main-thread CPU); and what the cost model charges per micro-batch. Run it under ``nice -n -10`` with
many rounds on a quiet machine:

    PYTHONPATH=. nice -n -10 python benchmarks/probe_microbatch_cost.py [--rounds 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ResidualStack, spawn_ranks, uptime  # noqa: E402

ONE_F_ONE_B_M = (2, 4, 8)
GPIPE_M = (1, 2, 4, 8)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)  # bench_planner_rank.py's MLP batch: 8 x 64 tokens
    return torch.randn(8, 64, 16, generator=g), torch.randn(8, 64, 8, generator=g)


def _pipeline(world: int, m: int, schedule: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    x, y = _batch()
    return dpcompile.transform(ResidualStack(8, 256), mesh, pipeline=world, micro_batches=m, schedule=schedule,
                               example_inputs=(x, y))  # fmt: skip


def _step(pm: Any) -> Any:
    x, y = _batch()

    def step() -> None:
        pm(x, y)
        for p in pm.parameters():
            p.grad = None

    return step


def _stage_calls(pm: Any, m: int) -> Any:
    """The rank's stage program on each of ``m`` micro-batches, forward then backward, its gradients
    accumulating: no schedule, no message."""
    from dpcompile.modules.mesh_pipeline import _first_micro_batch, _stage_examples

    ins, _ = _stage_examples(pm, _first_micro_batch(pm, _batch(), m), True)
    g = torch.Generator().manual_seed(2)
    ins = tuple(torch.randn(t.shape, generator=g).requires_grad_(t.requires_grad)
                if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in ins)  # fmt: skip

    def calls() -> None:
        for _ in range(m):
            outs = pm.program(*ins)
            tensors = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,))
                       if isinstance(o, torch.Tensor) and o.requires_grad]  # fmt: skip
            torch.autograd.backward([o.sum() for o in tensors])
        for p in pm.program.parameters():
            p.grad = None

    return calls


def _ping_pong(rank: int, m: int, work_s: float) -> Any:
    """Round trips of one micro-batch's boundary value (8 x 64 x 256 floats over ``m``); ``work_s`` of
    matmuls on each side before each transfer."""
    import torch.distributed as dist

    t = torch.zeros(8 * 64 * 256 // m)
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    start = time.perf_counter()
    for _ in range(20):
        a @ b  # noqa: B018
    products = max(1, round(work_s / ((time.perf_counter() - start) / 20))) if work_s else 0

    def step() -> None:
        for sender in (0, 1):
            for _ in range(products):
                a @ b  # noqa: B018 - the computing before the transfer
            (dist.send if rank == sender else dist.recv)(t, 1 - rank)

    return step, products


def _one_stage(m: int, group: Any, scheduled: bool) -> Any:
    """torch's GPipe over a pipeline of one stage on this rank's own ``group`` (no message), 4 blocks 8 wide
    (almost no compute) on 512 rows in ``m`` micro-batches; ``scheduled`` False: the same calls without it."""
    from common import ResidualBlock
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(0)
    module = torch.nn.Sequential(*[ResidualBlock(8) for _ in range(4)])
    x, y = torch.randn(512, 8), torch.randn(512, 8)
    stage = PipelineStage(module, 0, 1, torch.device("cpu"), input_args=(torch.empty(512 // m, 8),),
                          output_args=(torch.empty(512 // m, 8, requires_grad=True),), group=group)  # fmt: skip
    schedule = ScheduleGPipe(stage, m, loss_fn=lambda out, target: ((out - target) ** 2).sum(), scale_grads=False)

    def step() -> None:
        if scheduled:
            schedule.step(x, target=y)
        else:
            for xm, ym in zip(x.chunk(m), y.chunk(m)):
                ((module(xm) - ym) ** 2).sum().backward()
        for p in module.parameters():
            p.grad = None

    return step


def _blocked_receive(rank: int, work_s: float = 5e-3) -> Any:
    """Rank 1 computes ``work_s`` then sends one float; rank 0 waits in its receive (its CPU: the wake-up's)."""
    import torch.distributed as dist

    t = torch.zeros(1)
    a, b = torch.randn(128, 128), torch.randn(128, 128)

    def step() -> None:
        if rank == 0:
            dist.recv(t, 1)
            return
        stop = time.perf_counter() + work_s
        while time.perf_counter() < stop:
            a @ b  # noqa: B018 - the sender's computing
        dist.send(t, 0)

    return step


def rank_main(rank: int, world: int, port: int, rounds: int, results: Any) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))  # fmt: skip
        cases: dict[str, tuple[Any, str]] = {}  # name -> (thunk, who runs it: "both" or "rank0")
        for m in ONE_F_ONE_B_M:
            pm = _pipeline(world, m, "1f1b")
            cases[f"step 1f1b M={m}"] = (_step(pm), "both")
            cases[f"calls alone rank0 M={m}"] = (_stage_calls(pm, m), "rank0")
            cases[f"calls alone rank1 M={m}"] = (_stage_calls(pm, m), "rank1")
            cases[f"calls together M={m}"] = (_stage_calls(pm, m), "both")
        for m in GPIPE_M:
            cases[f"step gpipe M={m}"] = (_step(_pipeline(world, m, "gpipe")), "both")
        products = {}
        for m in ONE_F_ONE_B_M:
            cases[f"pingpong M={m}"] = (_ping_pong(rank, m, 0.0)[0], "both")
            step, products[m] = _ping_pong(rank, m, 2e-3)
            cases[f"after_work M={m}"] = (step, "both")
        report["after_work_products"] = products
        own = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group
        for m in GPIPE_M:
            cases[f"torch one stage M={m}"] = (_one_stage(m, own, True), "both")
            cases[f"torch one stage calls M={m}"] = (_one_stage(m, own, False), "both")
        cases["blocked receive"] = (_blocked_receive(rank), "both")
        t = torch.zeros(8 * 64 * 256 // 8)
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            dist.isend(t, 1).wait()
            report["rendezvous_s"] = time.perf_counter() - start
        else:
            time.sleep(0.02)
            dist.recv(t, 0)
        wall: dict[str, list[float]] = {k: [] for k in cases}
        cpu: dict[str, list[float]] = {k: [] for k in cases}
        proc: dict[str, list[float]] = {k: [] for k in cases}
        for thunk, who in cases.values():
            if who == "both" or who == f"rank{rank}":
                thunk()  # warm up
        for r in range(rounds):
            names = list(cases)
            names = names[r % len(names):] + names[:r % len(names)]  # each case in turn first
            for name in names:
                thunk, who = cases[name]
                dist.barrier()
                if who == "both" or who == f"rank{rank}":
                    w, c, p = time.perf_counter(), time.thread_time(), time.process_time()
                    thunk()
                    wall[name].append(time.perf_counter() - w)
                    cpu[name].append(time.thread_time() - c)
                    proc[name].append(time.process_time() - p)
                dist.barrier()
        report.update(wall=wall, cpu=cpu, proc=proc)
    except Exception:  # noqa: BLE001
        report["fatal"] = traceback.format_exc()[-3000:]
    results.put((rank, report))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def eager_stage(rounds: int) -> dict[str, Any]:
    """One thread, eager: the MLP's stage per micro-batch more, in parts (CPU seconds, least of ``rounds``)."""
    from common import ResidualBlock

    from dpcompile.analysis import calibration

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        wide = torch.nn.Sequential(*[ResidualBlock(256) for _ in range(4)])
        narrow = torch.nn.Sequential(*[ResidualBlock(8) for _ in range(4)])
        inputs = {wide: torch.randn(512, 256), narrow: torch.randn(512, 8)}
        grads = [torch.randn_like(p) for p in wide.parameters()]
        held = [torch.zeros_like(p) for p in wide.parameters()]

        def stage(module: Any, m: int, accumulate: bool = True) -> None:
            for piece in inputs[module].chunk(m):
                module(piece).sum().backward()
                if not accumulate:
                    for p in module.parameters():
                        p.grad = None
            for p in module.parameters():
                p.grad = None

        def accumulation(m: int) -> None:
            for _ in range(m - 1):  # the first micro-batch's gradient is assigned, the others added
                for h, g in zip(held, grads):
                    h.add_(g)

        cases = {}
        for m in GPIPE_M:
            cases[("stage", m)] = lambda m=m: stage(wide, m)
            cases[("stage without accumulation", m)] = lambda m=m: stage(wide, m, False)
            cases[("stage 8 wide", m)] = lambda m=m: stage(narrow, m)
            cases[("accumulation alone", m)] = lambda m=m: accumulation(m)
        best = dict.fromkeys(cases, float("inf"))
        for r in range(rounds + 1):
            for key, thunk in cases.items():
                start = time.thread_time()
                thunk()
                best[key] = min(best[key], time.thread_time() - start) if r else best[key]
        names = dict.fromkeys(name for name, _ in cases)
        out = {f"{name} per micro-batch ms": slope([(m, best[(name, m)]) for m in GPIPE_M]) * 1e3 for name in names}
        out["weight bytes"] = sum(p.numel() * 4 for p in wide.parameters())
        out["op_seconds"] = calibration._op_seconds()
        out["microbatch_weight_s_per_byte"] = calibration._microbatch_weight_seconds_per_byte()
        out["calibrated weights per micro-batch ms"] = out["microbatch_weight_s_per_byte"] * out["weight bytes"] * 1e3
        return out
    finally:
        torch.set_num_threads(before)


def slope(points: list[tuple[int, float]]) -> float:
    """Least squares: seconds per micro-batch."""
    mx = statistics.mean(m for m, _ in points)
    my = statistics.mean(s for _, s in points)
    return sum((m - mx) * (s - my) for m, s in points) / sum((m - mx) ** 2 for m, _ in points)


def predicted(world: int) -> dict[str, Any]:
    """The cost model's step times of the probed layouts and its per-micro-batch terms, with the
    calibration cached here (``calibrate_mesh``: measured now where there is none)."""
    from dpcompile.analysis import layout_costs, step_time
    from dpcompile.analysis.calibration import calibrate_mesh
    from dpcompile.planner import plan_mesh_layouts

    c = calibrate_mesh(world)
    x, y = _batch()
    labels = [f"rank{r}" for r in range(world)]
    stages_of: dict[int, Any] = {}
    spy_target = layout_costs.step_seconds

    def spy(profile: Any, layout: dict, stages: Any, m: int, *rest: Any) -> float:
        stages_of[len(stages)] = (profile, stages)
        return spy_target(profile, layout, stages, m, *rest)

    layout_costs.step_seconds = spy
    try:
        planned = plan_mesh_layouts(ResidualStack(8, 256), labels, dict.fromkeys(labels, 1 << 40), optimizer="sgd",
                                    training=True, example_inputs=(x, y), example_kwargs=None)  # fmt: skip
    finally:
        layout_costs.step_seconds = spy_target
    times = {f"{c_.spec.schedule} M={c_.spec.micro_batches}": c_.step_time for c_ in planned.candidates
             if c_.spec.size("pp") == world and not c_.spec.checkpointing and len(c_.spec.layout) == 1}  # fmt: skip
    _, stages = stages_of[world]
    per_mb = []
    for units in stages:
        per_mb.append({
            "dispatch_s": sum(u.ops for u in units) * c.op_seconds,
            "weights_s": step_time.weight_seconds(c, sum(u.grad_bytes for u in units)),
            "weights_before_s": step_time.PARAM_PASSES * sum(u.grad_bytes for u in units) / c.copy_bytes_per_s,
            "schedule_s": step_time.schedule_seconds(c, True),
            "transfers_s": 2 * step_time.MESSAGES_ON_PATH * step_time.message_seconds(c),
        })  # fmt: skip
    return {"calibration": c.__dict__, "step_s": times, "per_micro_batch_by_stage": per_mb}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--json", default="")
    ns = parser.parse_args()
    world = 2
    before = uptime()
    eager = eager_stage(ns.rounds)
    print("one thread, eager, the MLP's stage (4 blocks of 256, 512 rows): " + "; ".join(
        f"{k} {v:.4g}" for k, v in eager.items()))  # fmt: skip
    reports = spawn_ranks(rank_main, world, ns.rounds, timeout=900)
    after = uptime()
    for rank, report in sorted(reports.items()):
        if report.get("fatal"):
            print(f"rank {rank}:", report["fatal"])
    if any("wall" not in r for r in reports.values()) or len(reports) < world:
        return
    best = {r: {kind: {k: min(v) for k, v in rep[kind].items() if v} for kind in ("wall", "cpu", "proc")}
            for r, rep in reports.items()}  # fmt: skip
    print(f"load before: {before}\nload after:  {after}")
    for name in best[0]["wall"] | best[1]["wall"]:
        line = [f"  {name:24s}"]
        for r in (0, 1):
            if name in best[r]["wall"]:
                line.append(f"rank{r} wall {best[r]['wall'][name] * 1e3:8.2f} cpu {best[r]['cpu'][name] * 1e3:8.2f} "
                            f"proc {best[r]['proc'][name] * 1e3:8.2f} ms")  # fmt: skip
        print("  ".join(line))
    out: dict[str, Any] = {"uptime_before": before, "uptime_after": after, "rounds": ns.rounds, "best": best,
                           "after_work_products": reports[0]["after_work_products"], "eager": eager,
                           "rendezvous_s": reports[0].get("rendezvous_s"), "per_micro_batch_ms": {}}  # fmt: skip

    def per_mb(r: int, kind: str, prefix: str, ms: tuple[int, ...] = ONE_F_ONE_B_M) -> float:
        return slope([(m, best[r][kind][f"{prefix} M={m}"]) for m in ms]) * 1e3

    for r in (0, 1):
        row = {
            "step 1f1b wall": per_mb(r, "wall", "step 1f1b"),
            "step 1f1b main-thread cpu": per_mb(r, "cpu", "step 1f1b"),
            "step gpipe wall": per_mb(r, "wall", "step gpipe", GPIPE_M),
            "calls alone wall": per_mb(r, "wall", f"calls alone rank{r}"),
            "calls alone cpu": per_mb(r, "cpu", f"calls alone rank{r}"),
            "calls together wall": per_mb(r, "wall", "calls together"),
            "calls together cpu": per_mb(r, "cpu", "calls together"),
        }
        row["schedule (step cpu - calls together cpu)"] = row["step 1f1b main-thread cpu"] - row["calls together cpu"]
        row["waits (step wall - step cpu)"] = row["step 1f1b wall"] - row["step 1f1b main-thread cpu"]
        out["per_micro_batch_ms"][f"rank{r}"] = row
        print(f"rank {r}, per micro-batch (slope over M): " + "; ".join(f"{k} {v:.2f} ms" for k, v in row.items()))
    for r in (0, 1):
        own = {kind: per_mb(r, "cpu", f"torch one stage{kind}", GPIPE_M) for kind in ("", " calls")}
        out["per_micro_batch_ms"][f"rank{r}"]["torch one stage's own (cpu)"] = own[""] - own[" calls"]
        print(f"rank {r}: torch's GPipe over one stage (8 wide, no message) per micro-batch {own[''] :.3f} ms CPU, "
              f"its calls alone {own[' calls']:.3f} ms: the schedule's own {own[''] - own[' calls']:.3f} ms")  # fmt: skip
    print(f"  rank 0's receive waiting for rank 1's 5 ms of work: main-thread CPU {best[0]['cpu']['blocked receive'] * 1e3:.3f} ms, "
          f"process CPU {best[0]['proc']['blocked receive'] * 1e3:.3f} ms")  # fmt: skip
    for m in ONE_F_ONE_B_M:
        print(f"  one transfer of M={m}'s boundary: back to back {best[0]['wall'][f'pingpong M={m}'] / 2 * 1e3:.3f} ms; "
              f"after 2 ms of work {(best[0]['wall'][f'after_work M={m}'] - 2 * 2e-3) / 2 * 1e3:.3f} ms (less the work)")  # fmt: skip
    print(f"  rank 0's isend waited {reports[0].get('rendezvous_s', float('nan')) * 1e3:.1f} ms for rank 1's recv posted 20 ms later")
    model = predicted(world)
    out["model"] = model
    print("model: step " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in model["step_s"].items()) + " ms")
    for s, terms in enumerate(model["per_micro_batch_by_stage"]):
        print(f"model: stage {s} per micro-batch " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in terms.items()))
    if ns.json:
        Path(ns.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
