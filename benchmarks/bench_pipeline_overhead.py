"""What a micro-batch costs a pipeline step over a mesh, beyond its computing: 2 gloo processes, stages
too small to compute anything, 1-8 micro-batches, against figures measured in the same run.

Each rank (one thread, as torchrun gives it) times, interleaved over ``--rounds`` rounds of
``--steps`` steps each (the median round kept):

- ``dpcompile``: ``transform(ResidualStack(2, 8), mesh, pipeline=2, micro_batches=M, schedule=...)``
  training steps on a batch of 8 x 4 tokens (GPipe: M = 1, 2, 4, 8; 1F1B: M = 2, 4, 8), and data
  parallel (``dp2``); ``--model mlp``: ``bench_planner_rank.py``'s MLP (8 blocks of 256, 8 x 64 tokens);
- ``torch``: ``torch.distributed.pipelining`` alone, an ``nn.Linear(16, 16)`` per stage, GPipe, the
  same M: what the schedule itself costs per micro-batch; ``torch alone``: the same over a pipeline
  of one stage on each rank's own group (no message): the schedule's actions alone;
- ``message``: a blocking send/recv ping-pong of one float between the two processes (half a round
  trip: one message's latency, the wake-up of the process waiting for it included); ``p2p_batch``:
  the same through ``dist.batch_isend_irecv``, as the schedules send;
- ``stage_call``: one rank's stage program (dpcompile's, for one micro-batch of 1 row: M = 8) called
  forward and its autograd backward, alone (no schedule, no message); ``linear_call``: the torch
  stages' Linear so; ``op_seconds`` between the rounds;
- and in the main process, before and after the ranks run (one thread, as ``calibrate_mesh``
  measures them): the calibration's ``op_seconds``, a gloo all-reduce's latency and a message's
  (:func:`_gloo_message_seconds`, here: a ping-pong, which the calibration measured then) between gloo groups on threads.

Per schedule the least-squares slope of step time over M is the cost of one more micro-batch, in ms
and as multiples of the message latency and of ``op_seconds``; a schedule action is ``torch alone``'s
slope less the Linear's call, over 2 (what ``step_time.SCHEDULE_ACTION_OPS`` counts in the
calibration's ``op_seconds``), the transfers' waits ``torch`` less ``torch alone`` (per transfer, over
the calibration's message latency: ``step_time.MESSAGES_ON_PATH``).

    PYTHONPATH=. nice -n 5 python benchmarks/bench_pipeline_overhead.py [--rounds 8] [--steps 10] [--model mlp]
    PYTHONPATH=. python benchmarks/bench_pipeline_overhead.py --predict   # the model's slopes for the stored runs

Adds a run to ``benchmarks/results/pipeline_overhead.json`` (with ``uptime``: the load; every run is
kept, since one run under load says little).
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
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import ResidualStack, spawn_ranks, uptime  # noqa: E402

RESULTS = Path(os.environ.get("PIPELINE_OVERHEAD_RESULTS", Path(__file__).resolve().parent / "results" / "pipeline_overhead.json"))
GPIPE_M = (1, 2, 4, 8)
ONE_F_ONE_B_M = (2, 4, 8)


#: ``--model``: (layers, width, tokens) of the ResidualStack timed (``mlp``: bench_planner_rank.py's MLP)
MODELS = {"tiny": (2, 8, 4), "mlp": (8, 256, 64)}
MODEL = os.environ.get("PIPELINE_OVERHEAD_MODEL", "tiny")  # the ranks read it: set by main before they start


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = MODELS[MODEL][2]
    return torch.randn(8, tokens, 16, generator=g), torch.randn(8, tokens, 8, generator=g)


def _dp_step(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.mesh import local_batch

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    x, y = _batch()
    pm = dpcompile.transform(ResidualStack(*MODELS[MODEL][:2]), mesh, example_inputs=(x, y))
    mine = local_batch((x, y), mesh)

    def step() -> None:
        pm(*mine).backward()
        for p in pm.parameters():
            p.grad = None

    return step


def _dpcompile_step(world: int, m: int, schedule: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    x, y = _batch()
    pm = dpcompile.transform(ResidualStack(*MODELS[MODEL][:2]), mesh, pipeline=world, micro_batches=m, schedule=schedule,
                             example_inputs=(x, y))  # fmt: skip

    def step() -> None:
        pm(x, y)
        for p in pm.parameters():
            p.grad = None

    return step, pm


def _torch_step(rank: int, world: int, m: int, alone: Any = None) -> Any:
    """torch's GPipe over ``world`` stages, an ``nn.Linear(16, 16)`` each; ``alone``: a group of this
    rank only, where it runs a pipeline of one stage (no message: the schedule's own work)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(0)
    layer = nn.Linear(16, 16)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    index, stages = (0, 1) if alone is not None else (rank, world)
    example = torch.empty(8 // m, 16).requires_grad_(index > 0)  # a later stage returns its input's gradient
    stage = PipelineStage(layer, index, stages, torch.device("cpu"), input_args=(example,),
                          output_args=(torch.empty(8 // m, 16, requires_grad=True),), group=alone)  # fmt: skip
    schedule = ScheduleGPipe(stage, m, loss_fn=lambda out, target: ((out - target) ** 2).sum(), scale_grads=False)

    def step() -> None:
        if stages == 1:
            schedule.step(x, target=y)
        elif rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        layer.weight.grad = layer.bias.grad = None

    return step


def _linear_call() -> Any:
    """The torch stages' ``nn.Linear(16, 16)`` on one row, forward then backward, alone."""
    layer, x = nn.Linear(16, 16), torch.randn(1, 16, requires_grad=True)

    def step() -> None:
        ((layer(x) - 1.0) ** 2).sum().backward()
        layer.weight.grad = layer.bias.grad = x.grad = None

    return step


def _message_step(rank: int, batched: bool, count: int = 20) -> Any:
    import torch.distributed as dist

    t = torch.zeros(1)
    peer = 1 - rank

    def one(send: bool) -> None:
        if batched:
            op = dist.P2POp(dist.isend if send else dist.irecv, t, peer)
            for w in dist.batch_isend_irecv([op]):
                w.wait()
        elif send:
            dist.send(t, peer)
        else:
            dist.recv(t, peer)

    def step() -> None:  # ``count`` round trips
        for _ in range(count):
            one(rank == 0)
            one(rank == 1)

    return step, 2 * count  # messages a step


def _stage_call(pm: Any) -> Any:
    """The rank's stage program on one micro-batch of 1 row, forward then backward, alone."""
    from dpcompile.modules.mesh_pipeline import example_stage_inputs

    ins = example_stage_inputs(pm, _batch())
    ins = tuple(torch.randn(1, *t.shape[1:]).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
                and t.is_floating_point() else t for t in ins)  # fmt: skip

    def step() -> None:
        outs = pm.program(*ins)
        tensors = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,))
                   if isinstance(o, torch.Tensor) and o.requires_grad]  # fmt: skip
        torch.autograd.backward([o.sum() for o in tensors])
        for p in pm.program.parameters():
            p.grad = None

    return step


def rank_main(rank: int, world: int, port: int, rounds: int, steps: int, results: Any) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from dpcompile.analysis import calibration

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))  # fmt: skip
        cases: dict[str, tuple[Any, int]] = {}  # name -> (step, units a step: messages, or 1)
        pm_one = None
        for m in GPIPE_M:
            step, pm = _dpcompile_step(world, m, "gpipe")
            cases[f"dpcompile gpipe M={m}"] = (step, 1)
            pm_one = pm_one or pm
        for m in ONE_F_ONE_B_M:
            cases[f"dpcompile 1f1b M={m}"] = (_dpcompile_step(world, m, "1f1b")[0], 1)
        cases["dpcompile dp2"] = (_dp_step(world), 1)
        for m in GPIPE_M:
            cases[f"torch gpipe M={m}"] = (_torch_step(rank, world, m), 1)
        alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group
        for m in GPIPE_M:
            cases[f"torch alone M={m}"] = (_torch_step(rank, world, m, alone=alone), 1)
        cases["message"] = _message_step(rank, batched=False)
        cases["p2p_batch"] = _message_step(rank, batched=True)
        local_calls = {"stage_call": _stage_call(pm_one), "linear_call": _linear_call()}
        seconds: dict[str, list[float]] = {name: [] for name in cases}
        local: dict[str, list[float]] = {name: [] for name in (*local_calls, "op_seconds")}
        for step, _ in cases.values():
            step()  # warm up
        for r in range(rounds):
            names = list(cases)
            names = names[r % len(names):] + names[:r % len(names)]
            for name in names:
                step, units = cases[name]
                dist.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                dist.barrier()
                seconds[name].append((time.perf_counter() - start) / steps / units)
            for name, call in local_calls.items():
                call()
                start = time.perf_counter()
                for _ in range(4 * steps):
                    call()
                local[name].append((time.perf_counter() - start) / (4 * steps))
            local["op_seconds"].append(calibration._op_seconds())  # the calibration's dispatch figure, here and now
        report["seconds"] = seconds
        report.update(local)
    except Exception:  # noqa: BLE001
        report["fatal"] = traceback.format_exc()[-3000:]
    results.put((rank, report))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def slope(points: list[tuple[int, float]]) -> float:
    """Least squares: seconds per micro-batch."""
    mx = statistics.mean(m for m, _ in points)
    my = statistics.mean(s for _, s in points)
    return sum((m - mx) * (s - my) for m, s in points) / sum((m - mx) ** 2 for m, _ in points)


def _gloo_message_seconds(ranks: int = 2, window: float = 0.1) -> float:
    """Seconds of one point-to-point message of one float between two gloo groups on threads of this
    process, each waiting for the other's (half a ping-pong's round trip, its mean: every wake-up of
    the waiting side counts, as a pipeline's sends and receives pay it)."""
    from datetime import timedelta

    from torch.distributed import HashStore, ProcessGroupGloo

    from dpcompile.analysis.calibration import _on_threads

    if ranks < 2:
        return 0.0
    store = HashStore()
    groups: list = [None, None]
    seconds = [0.0, 0.0]

    def join(rank: int) -> None:
        groups[rank] = ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))

    def ping_pong(rank: int) -> None:
        t, peer, group = torch.zeros(1), 1 - rank, groups[rank]

        def round_trip() -> None:
            for sender in (0, 1):
                (group.send if rank == sender else group.recv)([t], peer, 0).wait()

        for _ in range(3):  # warm up
            round_trip()
        count, start = 0, time.perf_counter()
        while count < 2000:
            round_trip()
            count += 1
            if count % 16 == 0:  # both sides stop after the same count: the peer decides with rank 0
                done = torch.tensor([float(time.perf_counter() - start >= window)])
                (group.send if rank == 0 else group.recv)([done], peer, 1).wait()
                if done.item():
                    break
        seconds[rank] = (time.perf_counter() - start) / (2 * count)

    _on_threads(join, 2)
    _on_threads(ping_pong, 2)
    return max(max(seconds), 1e-9)


def _calibration_figures(world: int) -> dict[str, float]:
    """The calibration's own figures, measured here (one thread, as ``calibrate_mesh`` measures them)."""
    from dpcompile.analysis import calibration

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {"op_seconds": calibration._op_seconds(), "all_reduce_latency_s": calibration._gloo_all_reduce(world)[0]}
        out["thread_message_s"] = _gloo_message_seconds(world)
        return out
    finally:
        torch.set_num_threads(before)


def predicted_slopes(run: dict[str, Any]) -> dict[str, float]:
    """The cost model's seconds per micro-batch of the run's GPipe (least squares over M), with the
    run's calibration figures (their mean before and after; reference FLOP/s and bytes/s: its stages
    compute almost nothing), with its pipeline terms ("now") and without them ("before")."""
    import tempfile

    from dpcompile.analysis import calibration, step_time
    from dpcompile.planner import plan_mesh_layouts

    cal = {k: statistics.mean(v) for k, v in run["calibration_before_after"].items()}
    figures = calibration.Calibration(5e10, 5e9, "cpu", "run", 2, calibration.available_cores(), cal["op_seconds"],
                                      cal["all_reduce_latency_s"], 1e9, 2.0,
                                      synced_collective_s=cal["thread_message_s"])  # a transfer's latency  # fmt: skip
    layers, width, tokens = MODELS[run.get("model", "tiny")]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, tokens, 16, generator=g), torch.randn(8, tokens, 8, generator=g)
    labels = ["rank0", "rank1"]
    now = (step_time.SCHEDULE_ACTION_OPS, step_time.MESSAGES_ON_PATH, step_time.message_seconds)
    before = (0, 1.0, lambda c: c.collective_latency_s)
    out = {}
    saved = os.environ.get("DPCOMPILE_CACHE_DIR"), os.environ.pop("DPCOMPILE_CALIBRATION", None)
    with tempfile.TemporaryDirectory() as d:
        os.environ["DPCOMPILE_CACHE_DIR"] = d
        calibration._write_cache(calibration.cache_path("gloo2"), figures)
        try:
            for label, terms in (("before", before), ("now", now)):
                step_time.SCHEDULE_ACTION_OPS, step_time.MESSAGES_ON_PATH, step_time.message_seconds = terms
                planned = plan_mesh_layouts(ResidualStack(layers, width), labels, dict.fromkeys(labels, 1 << 40),
                                            optimizer="sgd", training=True, example_inputs=(x, y),
                                            example_kwargs=None)  # fmt: skip
                times = {c.spec.micro_batches: c.step_time for c in planned.candidates
                         if c.spec.size("pp") > 1 and c.spec.schedule == "gpipe" and not c.spec.checkpointing}  # fmt: skip
                out[label] = slope([(m, times[m]) for m in GPIPE_M])
        finally:
            step_time.SCHEDULE_ACTION_OPS, step_time.MESSAGES_ON_PATH, step_time.message_seconds = now
            for key, value in zip(("DPCOMPILE_CACHE_DIR", "DPCOMPILE_CALIBRATION"), saved):
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--predict", action="store_true", help="only the model's slopes for the stored runs")
    ns = parser.parse_args()
    if ns.predict:
        for run in json.loads(RESULTS.read_text())["runs"]:
            if run.get("model", "tiny") != "tiny":  # its compute counts, and the run recorded no FLOP/s
                continue
            measured = slope([(m, run["median_s"][f"dpcompile gpipe M={m}"]) for m in GPIPE_M])
            got = predicted_slopes(run)
            print(f"{run.get('model', 'tiny'):5s} load {run['uptime_before'].split('average:')[-1].strip():18s} GPipe "
                  f"per micro-batch: measured {measured * 1e3:.2f} ms, predicted {got['now'] * 1e3:.2f} ms "
                  f"(without the pipeline terms {got['before'] * 1e3:.2f} ms)")  # fmt: skip
        return
    os.environ["PIPELINE_OVERHEAD_MODEL"] = ns.model  # the spawned ranks read it at import
    world = 2
    before = uptime()
    figures = [_calibration_figures(world)]
    reports = spawn_ranks(rank_main, world, ns.rounds, ns.steps, timeout=900)
    figures.append(_calibration_figures(world))
    for rank, report in sorted(reports.items()):
        if report.get("fatal"):
            print(f"rank {rank}:", report["fatal"])
    if "seconds" not in reports.get(0, {}):
        return
    medians = {name: statistics.median(v) for name, v in reports[0]["seconds"].items()}
    stage_calls = {r: statistics.median(reports[r]["stage_call"]) for r in reports}
    linear_calls = {r: statistics.median(reports[r]["linear_call"]) for r in reports}
    cal = {k: [f[k] for f in figures] for k in figures[0]}
    op_s = statistics.median(reports[0]["op_seconds"])  # rank 0's, between its rounds
    message = medians["message"]
    out: dict[str, Any] = {"model": ns.model, "uptime_before": before, "uptime_after": uptime(), "rounds": ns.rounds, "steps": ns.steps,
                           "median_s": medians, "stage_call_s": stage_calls, "linear_call_s": linear_calls,
                           "calibration_before_after": cal, "slopes": {}}  # fmt: skip
    for label, prefix, ms in (("dpcompile gpipe", "dpcompile gpipe", GPIPE_M),
                              ("dpcompile 1f1b", "dpcompile 1f1b", ONE_F_ONE_B_M),
                              ("torch gpipe", "torch gpipe", GPIPE_M), ("torch alone", "torch alone", GPIPE_M)):  # fmt: skip
        b = slope([(m, medians[f"{prefix} M={m}"]) for m in ms])
        out["slopes"][label] = {"s_per_micro_batch": b, "messages": b / message, "op_seconds": b / op_s}
    action = (out["slopes"]["torch alone"]["s_per_micro_batch"] - linear_calls[0]) / 2  # forward and backward
    calibrated_op = statistics.mean(cal["op_seconds"])  # what calibrate_mesh measures: the planning process's
    out["schedule_action"] = {"s": action, "op_seconds_of_ranks": action / op_s,
                              "op_seconds_of_calibration": action / calibrated_op}  # step_time.SCHEDULE_ACTION_OPS
    path = out["slopes"]["torch gpipe"]["s_per_micro_batch"] - out["slopes"]["torch alone"]["s_per_micro_batch"]
    out["messages_on_path_per_micro_batch"] = path / message
    calibrated = statistics.mean(cal.get("thread_message_s", [float("nan")]))
    out["path_per_transfer_over_calibrated_message"] = path / 2 / calibrated  # step_time.MESSAGES_ON_PATH
    print(f"load before: {before}\nload after:  {out['uptime_after']}")
    for name, v in medians.items():
        print(f"  {name:22s} {v * 1e3:8.3f} ms")
    print(f"  stage call (fwd+bwd, 1 row) per rank: {', '.join(f'{v * 1e3:.3f} ms' for v in stage_calls.values())}; "
          f"the Linear's: {', '.join(f'{v * 1e3:.3f} ms' for v in linear_calls.values())}")
    print(f"  op_seconds between the rounds (rank 0, median): {op_s * 1e6:.1f} us")
    print("  calibration before / after: " + "; ".join(f"{k} {', '.join(f'{x * 1e6:.1f}' for x in v)} us"
                                                       for k, v in cal.items()))  # fmt: skip
    for label, s in out["slopes"].items():
        print(f"  {label:16s} per micro-batch {s['s_per_micro_batch'] * 1e3:.3f} ms = {s['messages']:.2f} messages "
              f"= {s['op_seconds']:.1f} op_seconds")  # fmt: skip
    print(f"  a schedule action (torch alone's slope less the Linear's call, over 2): {action * 1e3:.3f} ms = "
          f"{action / op_s:.1f} op_seconds of the ranks, {action / calibrated_op:.1f} of the calibration; the messages on the path per micro-batch (torch's 2 stages less 1): "
          f"{path * 1e3:.3f} ms = {path / message:.2f} messages; per transfer, over the calibration's message: "
          f"{path / 2 / calibrated:.2f}")  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    runs = json.loads(RESULTS.read_text()).get("runs", []) if RESULTS.exists() else []
    RESULTS.write_text(json.dumps({"runs": [*runs, out]}, indent=1, default=str))  # every run kept: they are noisy


if __name__ == "__main__":
    main()
