"""What one more micro-batch costs a pipeline stage in its weights (``step_time.PARAM_PASSES``).

One stage of 4 ``ResidualBlock``s of width ``d`` (64-320: 0.5-12.5 MiB of weights), one thread, eager,
a training step on 512 rows cut into 1 or 8 micro-batches (each forward then its backward, the
gradients accumulated in ``.grad`` as a pipeline's stage does), timed in the thread's CPU seconds
(what other processes take of the cores is not counted: the machine is shared), rounds interleaved,
the median kept. Per extra micro-batch: ``(t8 - t1) / 7``; the width-64 stage's (the same ops, almost
no weights) is its dispatch; what the wider stages cost beyond it, over their extra weight bytes at
the rate of a 4 MiB clone (as ``calibrate_mesh`` measures the copy bytes/s, here in CPU seconds), is
the passes over the weights each micro-batch makes (``step_time.PARAM_PASSES``).

The same stage of width 256 at M = 4 and 8 in GPipe's order (every forward, then every backward)
against 1F1B's (each forward followed by its backward: one micro-batch held): the difference, over
(M - 1) / M of the bytes the stage's ops write in a training step (3x forward's, from
``profile_model``) at the clone's rate, was ``step_time.GPIPE_WRITTEN_PASSES`` (0.9-1.3 passes); the cost
model now pages in the saved values held beyond 1F1B's first stage at the calibrated
``page_in_bytes_per_s`` instead (``step_time.gpipe_held_bytes``: of its 12 MB saved, 3/4 and 7/8 at 2.4 GB/s, one
thread paging in alone, is 3.7 and 4.3 ms against the 3.3 and 5.4 ms measured at M = 4 and 8).

    PYTHONPATH=. nice -n -19 python benchmarks/bench_microbatch_weights.py [--rounds 30] [--runs 3]

Writes ``benchmarks/results/microbatch_weights.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ResidualBlock, uptime, write_result  # noqa: E402

WIDTHS = (64, 128, 192, 256, 320)
ROWS = 512


def _stage_step(stage: torch.nn.Module, x: torch.Tensor, micro_batches: int, gpipe: bool = False) -> None:
    if gpipe:
        outs = [stage(part).sum() for part in x.chunk(micro_batches)]
        for out in outs:
            out.backward()
    else:
        for part in x.chunk(micro_batches):
            stage(part).sum().backward()
    for p in stage.parameters():
        p.grad = None


def stage_profile(stage: torch.nn.Module, x: torch.Tensor):
    """The cost model's profile of a training step of ``stage`` on ``x`` (its output summed: the loss)."""
    from dpcompile.analysis.model_profile import profile_model

    class Summed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stage = stage

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.stage(x).sum()

    return profile_model(Summed(), (x,), None, optimizer=None, training=True)


def _written_bytes(stage: torch.nn.Module, x: torch.Tensor) -> int:
    """The bytes a training step's ops write, as the cost model counts them (3x forward's)."""
    return 3 * sum(u.op_bytes for u in stage_profile(stage, x).units)


def gpipe_order(rounds: int, copy_bytes_per_s: float, d: int = 256) -> list[dict]:
    torch.manual_seed(0)
    stage, x = torch.nn.Sequential(*[ResidualBlock(d) for _ in range(4)]), torch.randn(ROWS, d)
    cases = [(m, g) for m in (4, 8) for g in (False, True)]
    seconds: dict[tuple[int, bool], list[float]] = {c: [] for c in cases}
    for m, g in cases:
        _stage_step(stage, x, m, g)
    for _ in range(rounds):
        for m, g in cases:
            seconds[(m, g)] += _cpu_seconds(lambda m=m, g=g: _stage_step(stage, x, m, g), 1)
    written = _written_bytes(stage, x)
    rows = []
    for m in (4, 8):
        extra = statistics.median(seconds[(m, True)]) - statistics.median(seconds[(m, False)])
        passes = extra * copy_bytes_per_s / (written * (m - 1) / m)
        rows.append({"width": d, "micro_batches": m, "written_bytes": written, "gpipe_minus_1f1b_s": extra,
                     "passes": passes})  # fmt: skip
        print(f"  d={d} M={m}: GPipe's order {extra * 1e3:+.2f} ms over 1F1B's = {passes:.2f} passes over "
              f"(M - 1) / M of {written / 2**20:.0f} MiB written", flush=True)  # fmt: skip
    return rows


def _cpu_seconds(run, repeats: int) -> list[float]:  # noqa: ANN001 - a thunk
    out = []
    for _ in range(repeats):
        start = time.thread_time()
        run()
        out.append(time.thread_time() - start)
    return out


def one_run(rounds: int) -> dict:
    torch.manual_seed(0)
    stages = {d: torch.nn.Sequential(*[ResidualBlock(d) for _ in range(4)]) for d in WIDTHS}
    inputs = {d: torch.randn(ROWS, d) for d in WIDTHS}
    cases = [(d, m) for d in WIDTHS for m in (1, 8)]
    seconds: dict[tuple[int, int], list[float]] = {c: [] for c in cases}
    for d, m in cases:
        _stage_step(stages[d], inputs[d], m)  # warm up
    for _ in range(rounds):
        for d, m in cases:
            seconds[(d, m)] += _cpu_seconds(lambda d=d, m=m: _stage_step(stages[d], inputs[d], m), 1)
    x = torch.randn(2**20)
    copy_bytes_per_s = x.numel() * 4 / statistics.median(_cpu_seconds(x.clone, 50))
    per_extra = {d: (statistics.median(seconds[(d, 8)]) - statistics.median(seconds[(d, 1)])) / 7 for d in WIDTHS}
    weights = {d: sum(p.numel() * p.element_size() for p in stages[d].parameters()) for d in WIDTHS}
    rows = []
    for d in WIDTHS:
        beyond = weights[d] - weights[WIDTHS[0]]
        passes = (per_extra[d] - per_extra[WIDTHS[0]]) * copy_bytes_per_s / beyond if beyond else None
        rows.append({"width": d, "weight_bytes": weights[d], "step_1_s": statistics.median(seconds[(d, 1)]),
                     "step_8_s": statistics.median(seconds[(d, 8)]), "per_extra_micro_batch_s": per_extra[d],
                     "passes": passes})  # fmt: skip
        print(f"  d={d:4d} weights {weights[d] / 2**20:5.2f} MiB  M=1 {rows[-1]['step_1_s'] * 1e3:6.2f} ms  "
              f"M=8 {rows[-1]['step_8_s'] * 1e3:6.2f} ms  per extra micro-batch {per_extra[d] * 1e3:5.2f} ms"
              + (f"  passes {passes:.2f}" if passes is not None else "  (dispatch)"), flush=True)  # fmt: skip
    return {"copy_bytes_per_s": copy_bytes_per_s, "rows": rows, "gpipe_order": gpipe_order(rounds, copy_bytes_per_s),
            "uptime": uptime()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--runs", type=int, default=3)
    ns = parser.parse_args()
    torch.set_num_threads(1)
    runs = []
    for r in range(ns.runs):
        print(f"run {r + 1} ({uptime()})", flush=True)
        runs.append(one_run(ns.rounds))
    write_result("microbatch_weights", {
        "command": "PYTHONPATH=. nice -n -19 python benchmarks/bench_microbatch_weights.py " + " ".join(sys.argv[1:]),
        "rows": ROWS, "runs": runs})  # fmt: skip


if __name__ == "__main__":
    main()
