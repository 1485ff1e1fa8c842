"""What GPipe's order costs a pipeline stage beyond 1F1B's, and why: memory new to the process.

One eager stage of 4 ``ResidualBlock``s of width 256 on 512 rows (``bench_microbatch_weights.py``'s),
one thread, a training step cut into M = 2, 4, 8 micro-batches in GPipe's order (every forward, then
every backward) and in 1F1B's (each forward followed by its backward), rounds interleaved: per step the
wall and the thread's CPU seconds and the process's minor page faults (medians). Then the calibration's
``page_in_bytes_per_s`` (``calibrate_mesh``'s measure: a 40 MiB tensor filled less a touched one) on one
thread and on two at once, and what the cost model charges GPipe's order for this stage
(``step_time.gpipe_held_bytes`` of a one-stage pipeline at the one-thread rate) beside the measured
difference (in wall seconds, as the rate is: load included; the CPU seconds leave out the waits for a core).

    PYTHONPATH=. nice -n 10 python benchmarks/bench_gpipe_page_in.py [--rounds 10]

Prints its table (nothing written).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_microbatch_weights import ROWS, _stage_step, stage_profile  # noqa: E402
from common import ResidualBlock, uptime  # noqa: E402


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _held_bytes(stage: torch.nn.Module, x: torch.Tensor, m: int) -> float:
    """The cost model's bytes GPipe's order holds beyond 1F1B's for this stage (a one-stage pipeline)."""
    from dpcompile.analysis.step_time import gpipe_held_bytes

    return gpipe_held_bytes(stage_profile(stage, x).units, m, 1, False)


def main() -> None:
    from dpcompile.analysis.calibration import _page_in_bytes_per_s

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    ns = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    stage, x = torch.nn.Sequential(*[ResidualBlock(256) for _ in range(4)]), torch.randn(ROWS, 256)
    cases = [(m, g) for m in (2, 4, 8) for g in (False, True)]
    cpu: dict[tuple[int, bool], list[float]] = {c: [] for c in cases}
    wall: dict[tuple[int, bool], list[float]] = {c: [] for c in cases}
    faults: dict[tuple[int, bool], list[int]] = {c: [] for c in cases}
    for m, g in cases:
        _stage_step(stage, x, m, g)  # warm up
    for _ in range(ns.rounds):
        for m, g in cases:
            before, start, wall_start = _faults(), time.thread_time(), time.perf_counter()
            _stage_step(stage, x, m, g)
            cpu[(m, g)].append(time.thread_time() - start)
            wall[(m, g)].append(time.perf_counter() - wall_start)
            faults[(m, g)].append(_faults() - before)
    alone, together = _page_in_bytes_per_s(1), _page_in_bytes_per_s(2)
    print(f"{uptime()}\npage_in_bytes_per_s: {alone / 1e9:.2f} GB/s alone, {together / 1e9:.2f} GB/s each with two at once")
    for m in (2, 4, 8):
        ms = {g: statistics.median(cpu[(m, g)]) * 1e3 for g in (False, True)}
        ws = {g: statistics.median(wall[(m, g)]) * 1e3 for g in (False, True)}
        pages = {g: statistics.median(faults[(m, g)]) for g in (False, True)}
        predicted = _held_bytes(stage, x, m) / alone * 1e3
        print(f"M={m}: 1F1B {ws[False]:6.1f} ms ({ms[False]:5.1f} CPU) {pages[False]:5.0f} faults  GPipe {ws[True]:6.1f} ms "
              f"({ms[True]:5.1f} CPU) {pages[True]:5.0f} faults  GPipe - 1F1B {ws[True] - ws[False]:+5.1f} ms "
              f"({ms[True] - ms[False]:+5.1f} CPU), predicted {predicted:4.1f} ms (the extra faults at the rate: "
              f"{4096 * (pages[True] - pages[False]) / alone * 1e3:+5.1f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
