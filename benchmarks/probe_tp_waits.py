"""Where a tensor-parallel step's time goes over 2 gloo processes, against data parallel's.

For each model, ``dp2`` and ``tp2`` (as ``bench_planner_rank.py`` builds them) are timed in the same
2 spawned processes, interleaved: per step each rank's wall and CPU seconds (its main thread's, and
the whole process's: gloo's threads too), every collective the program calls from Python (its kind,
bytes, when each rank entered and left it: ``time.perf_counter`` is one clock for both processes),
and, in the same run, gloo's all-reduce latency alone at the sizes the step uses.

    PYTHONPATH=. nice -n -19 python benchmarks/probe_tp_waits.py [--only bert,gpt2] [--steps 6]

Prints a summary per model; writes ``benchmarks/results/tp_waits.json``.

``--concurrency 6``: instead, 6 times in a row, the calibration's concurrency measured on threads of
this process (the older ``_thread_concurrency``) and on processes (``_concurrency``), beside what 2
spawned processes' matmuls (one thread each, as the ranks) run over one's: how far each reads from it.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_planner_rank as bench  # noqa: E402
from common import uptime  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "tp_waits.json"
COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier")


class _Recorder:
    """Wraps ``torch.distributed``'s collectives: each call's kind, bytes, and entry/exit times."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.on, self.calls = False, []
        for name in COLLECTIVES:
            original = getattr(dist, name)

            def wrapped(*args: Any, __original=original, __name=name, **kwargs: Any) -> Any:
                if not self.on:
                    return __original(*args, **kwargs)
                t = args[0] if args and isinstance(args[0], torch.Tensor) else (args[1] if len(args) > 1 else None)
                size = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
                enter, cpu = time.perf_counter(), time.thread_time()
                out = __original(*args, **kwargs)
                self.calls.append((__name, size, enter, time.perf_counter(), time.thread_time() - cpu))
                return out

            setattr(dist, name, wrapped)


def _gloo_latency(sizes: list[int], repeats: int = 50) -> dict[int, float]:
    """Median seconds of an all-reduce of ``n`` floats among the group, for each ``n`` (after a barrier)."""
    import torch.distributed as dist

    out = {}
    for n in sizes:
        x = torch.ones(n)
        dist.all_reduce(x)
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            seconds.append(time.perf_counter() - start)
        out[n] = statistics.median(seconds)
    return out


def _synced_in_ranks(work_s: float = 1e-3, calls: int = 24) -> float:
    """The calibration's ``_gloo_synced_seconds`` pattern run by the rank processes themselves: the mean
    seconds a rank spends in an all-reduce of 16 floats after ``work_s`` of matmuls."""
    import torch.distributed as dist

    from dpcompile.analysis.timing import best_seconds

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    products = max(1, round(work_s / best_seconds(lambda: a @ b)))
    x, waited = torch.ones(16), 0.0
    dist.barrier()
    for _ in range(calls):
        for _ in range(products):
            a @ b  # noqa: B018
        start = time.perf_counter()
        dist.all_reduce(x)
        waited += time.perf_counter() - start
    return waited / calls


def rank_main(rank: int, world: int, port: int, name: str, layouts: dict[str, dict], steps: int, results: Any) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))  # fmt: skip
        recorder = _Recorder()
        model, args, kwargs = bench.build(name)
        if kwargs:
            from dpcompile.capture import capture_model

            model, _ = capture_model(model, frontend="export", example_kwargs=kwargs)
        import copy

        programs = {}
        for label, kw in layouts.items():
            pm, mesh = bench._program(copy.deepcopy(model), args, kwargs, kw, world)
            bench._step(pm, mesh, args, kwargs, bool(kw.get("pipeline")))
            programs[label] = (pm, mesh, bool(kw.get("pipeline")))
        latency_sizes = [1, 8 * 64 * 128 // 2, 8 * 64 * 128, 1 << 20]
        report["gloo_before"] = _gloo_latency(latency_sizes)
        steps_of: dict[str, list] = {label: [] for label in programs}
        for s in range(steps):
            for label in (list(programs) if s % 2 == 0 else list(programs)[::-1]):
                pm, mesh, pipelined = programs[label]
                dist.barrier()
                recorder.calls = []
                recorder.on = True
                start, cpu, proc = time.perf_counter(), time.thread_time(), time.process_time()
                bench._step(pm, mesh, args, kwargs, pipelined)
                wall, cpu, proc = time.perf_counter() - start, time.thread_time() - cpu, time.process_time() - proc
                recorder.on = False
                end = time.perf_counter()
                dist.barrier()
                steps_of[label].append({"start": start, "end": end, "wall": wall, "thread_cpu": cpu, "process_cpu": proc,
                                        "calls": recorder.calls})  # fmt: skip
        report["steps"] = steps_of
        report["gloo_after"] = _gloo_latency(latency_sizes)
        report["synced_in_ranks"] = _synced_in_ranks()
    except Exception:  # noqa: BLE001
        report["fatal"] = traceback.format_exc()[-3000:]
    results.put((rank, report))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def measure(name: str, layouts: dict[str, dict], steps: int, world: int = 2) -> dict[int, dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, name, layouts, steps, results), daemon=True)
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    reports = dict(results.get(timeout=600) for _ in range(world))
    for p in procs:
        p.join(timeout=10)
    return reports


def summarize(name: str, reports: dict[int, dict]) -> dict[str, Any]:
    out: dict[str, Any] = {"gloo_before_ms": {k: v * 1e3 for k, v in reports[0]["gloo_before"].items()},
                           "gloo_after_ms": {k: v * 1e3 for k, v in reports[0]["gloo_after"].items()}}  # fmt: skip
    for label in reports[0]["steps"]:
        rows = []
        for s0, s1 in zip(reports[0]["steps"][label], reports[1]["steps"][label]):
            c0, c1 = s0["calls"], s1["calls"]
            skews, late_waits, early_waits, total_wait = [], [], [], [0.0, 0.0]
            for a, b in zip(c0, c1):
                skews.append(abs(a[2] - b[2]))
                late, early = (a, b) if a[2] > b[2] else (b, a)
                late_waits.append(late[3] - late[2])
                early_waits.append(early[3] - early[2])
            for r, calls in enumerate((c0, c1)):
                total_wait[r] = sum(c[3] - c[2] for c in calls)
            sizes: dict[str, int] = {}
            for c in c0:
                sizes[f"{c[0]}:{c[1]}"] = sizes.get(f"{c[0]}:{c[1]}", 0) + 1
            rows.append({
                "wall_ms": [s0["wall"] * 1e3, s1["wall"] * 1e3], "thread_cpu_ms": [s0["thread_cpu"] * 1e3, s1["thread_cpu"] * 1e3],
                "process_cpu_ms": [s0["process_cpu"] * 1e3, s1["process_cpu"] * 1e3],
                "start_skew_ms": (s1["start"] - s0["start"]) * 1e3, "calls": len(c0), "calls_by_size": sizes,
                "in_collectives_ms": [w * 1e3 for w in total_wait],
                "per_call_ms": sum(total_wait) / 2 / max(1, len(c0)) * 1e3, "skew_sum_ms": sum(skews) * 1e3,
                "late_wait_sum_ms": sum(late_waits) * 1e3, "late_wait_median_us": statistics.median(late_waits) * 1e6 if late_waits else 0,
                "early_wait_sum_ms": sum(early_waits) * 1e3,
                "cpu_in_collectives_ms": [sum(c[4] for c in calls) * 1e3 for calls in (c0, c1)],
                "each_call": [(a[0], a[1], round((a[2] - s0["start"]) * 1e3, 3), round((a[3] - a[2]) * 1e3, 3),
                               round((b[2] - s0["start"]) * 1e3, 3), round((b[3] - b[2]) * 1e3, 3)) for a, b in zip(c0, c1)],
            })  # fmt: skip
        med = {k: statistics.median(r[k] if not isinstance(r[k], list) else max(r[k]) for r in rows)
               for k in rows[0] if k not in ("calls_by_size", "each_call")}  # fmt: skip
        out[label] = {"median": med, "calls_by_size": rows[0]["calls_by_size"], "rows": rows}
    return out


def _matmuls(commands: Any, counts: Any) -> None:
    """A worker of :func:`concurrency`: per command (seconds) the 384 x 384 matmuls it ran in them."""
    torch.set_num_threads(1)
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    a @ b
    counts.put(0)
    while (seconds := commands.get()) is not None:
        done, stop = 0, time.perf_counter() + seconds
        while time.perf_counter() < stop:
            a @ b  # noqa: B018
            done += 1
        counts.put(done)


def concurrency(times: int, seconds: float = 0.3) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from dpcompile.analysis import calibration

    ctx = mp.get_context("spawn")
    commands, counts = [ctx.Queue() for _ in range(2)], [ctx.Queue() for _ in range(2)]
    procs = [ctx.Process(target=_matmuls, args=(c, n), daemon=True) for c, n in zip(commands, counts)]
    for p in procs:
        p.start()
    for n in counts:
        n.get()
    out: dict[str, list] = {"threads": [], "processes": [], "spawned_matmuls": [], "load": []}
    for _ in range(times):
        out["threads"].append(calibration._thread_concurrency(2))
        out["processes"].append(calibration._concurrency(2))
        commands[0].put(seconds)
        alone = counts[0].get()
        for c in commands:
            c.put(seconds)
        out["spawned_matmuls"].append(sum(n.get() for n in counts) / alone)
        out["load"].append(Path("/proc/loadavg").read_text().split()[0])
    for c in commands:
        c.put(None)
    for p in procs:
        p.join()
    for k, v in out.items():
        print(f"{k:16s}", " ".join(f"{x:.2f}" if isinstance(x, float) else x for x in v))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="bert,gpt2")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=0)
    ns = parser.parse_args()
    if ns.concurrency:
        out = {"command": f"PYTHONPATH=. nice -n {os.nice(0)} python benchmarks/probe_tp_waits.py {' '.join(sys.argv[1:])}",
               "uptime_before": uptime(), **concurrency(ns.concurrency), "uptime_after": uptime()}  # fmt: skip
        RESULTS.with_name("concurrency_probe.json").write_text(json.dumps(out, indent=1))
        return
    data: dict[str, Any] = {"command": f"PYTHONPATH=. nice -n {os.nice(0)} python benchmarks/probe_tp_waits.py {' '.join(sys.argv[1:])}",
                            "uptime_before": uptime(), "models": {}}  # fmt: skip
    for name in ns.only.split(","):
        fitting, _, _ = bench.plan(name, 2)
        layouts = {c.spec.name: c.keywords() for c in fitting if c.spec.name in ("dp2", "tp2")}
        predicted = {c.spec.name: c.step_time * 1e3 for c in fitting if c.spec.name in layouts}
        from dpcompile.analysis import calibration, timing

        with timing.threads(1):
            synced_before = calibration._gloo_synced_seconds(2)
        reports = measure(name, layouts, ns.steps)
        with timing.threads(1):
            synced_after = calibration._gloo_synced_seconds(2)
        if any("fatal" in r for r in reports.values()):
            print(name, [r.get("fatal") for r in reports.values()])
            continue
        summary = summarize(name, reports)
        summary["predicted_ms"] = predicted
        summary["synced_ms"] = [synced_before * 1e3, synced_after * 1e3]
        summary["synced_in_ranks_ms"] = (reports[0]["synced_in_ranks"] + reports[1]["synced_in_ranks"]) / 2 * 1e3
        data["models"][name] = summary
        print(f"{name}  gloo all-reduce ms (floats: before / after) "
              + "  ".join(f"{k}: {summary['gloo_before_ms'][k]:.3f}/{summary['gloo_after_ms'][k]:.3f}" for k in summary["gloo_before_ms"])
              + f"  synced (threads, before/after) {synced_before * 1e3:.3f}/{synced_after * 1e3:.3f} ms,"
              f" in the rank processes {summary['synced_in_ranks_ms']:.3f} ms")
        for label in layouts:
            m = summary[label]["median"]
            print(f"  {label}: predicted {predicted[label]:.1f} ms; median wall {m['wall_ms']:.1f}, thread cpu {m['thread_cpu_ms']:.1f}, "
                  f"process cpu {m['process_cpu_ms']:.1f}, {m['calls']:.0f} calls, in collectives {m['in_collectives_ms']:.1f} "
                  f"(late side {m['late_wait_sum_ms']:.1f}, median {m['late_wait_median_us']:.0f} us; early side {m['early_wait_sum_ms']:.1f}; "
                  f"cpu in them {m['cpu_in_collectives_ms']:.1f}; per call {m['per_call_ms']:.2f}), arrival skew sum {m['skew_sum_ms']:.1f}, start skew {m['start_skew_ms']:.2f}")
            print(f"    calls: {summary[label]['calls_by_size']}")
    data["uptime_after"] = uptime()
    print(data["uptime_after"])
    RESULTS.write_text(json.dumps(data, indent=1, default=str))


if __name__ == "__main__":
    main()
