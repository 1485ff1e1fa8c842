"""What a GPipe step costs a rank beyond a 1F1B step, in what a loaded machine cannot blur: page faults and CPU.

Over 2 gloo processes, ``bench_planner_rank.py``'s model (default its MLP stack) as ``pp2`` with GPipe and
1F1B at 4 and 8 micro-batches (each built and warmed up first, then ``--rounds`` rounds over them): per rank
and step, the medians of the minor page faults (memory new to the process), the process's CPU seconds (gloo's
threads included), the main thread's CPU seconds (its page faults included) and the wall seconds.

    PYTHONPATH=. nice -n 10 python benchmarks/probe_gpipe_faults.py [--model mlp_stack] [--rounds 12]

Prints its table (nothing written). Issue 34: the step-time model charges GPipe's order the saved values a
stage holds beyond 1F1B's first stage, paged in (``step_time.gpipe_held_bytes``); the faults say how many bytes
are new, the main thread's CPU what computing and faulting cost, the wall the rest (load and waits).
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_planner_rank import _program, _step, build  # noqa: E402
from common import uptime  # noqa: E402

CANDIDATES = [{"pipeline": ["layers.4"], "micro_batches": m, "schedule": s} for m in (4, 8) for s in ("gpipe", "1f1b")]


def _rank(rank: int, world: int, port: int, name: str, rounds: int, results: Any) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))  # fmt: skip
    model, args, kwargs = build(name)
    if kwargs:
        from dpcompile.capture import capture_model

        model, _ = capture_model(model, frontend="export", example_kwargs=kwargs)
    programs = []
    for keywords in CANDIDATES:
        pm, mesh = _program(copy.deepcopy(model), args, kwargs, dict(keywords), world)
        for _ in range(2):  # warm up
            _step(pm, mesh, args, kwargs, True)
        programs.append((pm, mesh))
    samples: list[list[tuple[float, ...]]] = [[] for _ in programs]
    for _ in range(rounds):
        for i, (pm, mesh) in enumerate(programs):
            dist.barrier()
            before, thread, wall = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
            _step(pm, mesh, args, kwargs, True)
            after = resource.getrusage(resource.RUSAGE_SELF)
            process = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
            samples[i].append((after.ru_minflt - before.ru_minflt, process, time.thread_time() - thread,
                               time.perf_counter() - wall))  # fmt: skip
    results.put((rank, [tuple(statistics.median(s[k] for s in rows) for k in range(4)) for rows in samples]))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mlp_stack")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--port", type=int, default=29611)
    ns = parser.parse_args()
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_rank, args=(r, 2, ns.port, ns.model, ns.rounds, results)) for r in range(2)]
    for p in ranks:
        p.start()
    got = dict(results.get(timeout=900) for _ in ranks)
    for p in ranks:
        p.join()
    print(f"{uptime()}\n{ns.model}: per rank, medians of a step: faults (MiB), process CPU, main thread CPU, wall (ms)")
    for i, keywords in enumerate(CANDIDATES):
        cells = [f"{got[r][i][0] * 4096 / 2**20:5.1f} MiB {got[r][i][1] * 1e3:6.1f} {got[r][i][2] * 1e3:6.1f} "
                 f"{got[r][i][3] * 1e3:6.1f}" for r in (0, 1)]  # fmt: skip
        print(f"  {keywords['schedule']:5} mb{keywords['micro_batches']}  rank 0: {cells[0]}   rank 1: {cells[1]}")


if __name__ == "__main__":
    main()
