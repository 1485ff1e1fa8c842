"""What does ``transform(progress=)`` cost? Quiet it must cost ~nothing; drawn, little.

    PYTHONPATH=. python benchmarks/bench_transform_progress.py [--json]

For a small model (an MLP of 4 layers, d = 32) and a deeper one (50 layers), each under tensor
parallelism on ``["cpu"] * 2`` and pipeline x tensor parallelism on ``["cpu"] * 4``:

1. quiet overhead: the calls a transform makes to the bar sites (``step_bar`` and each ``update``,
   counted) times the cost of one quiet call (``timeit``), as a fraction of the quiet transform's
   time; what a quiet transform pays beyond the code without the sites;
2. drawn against quiet: ``progress=True`` (bars written to an in-memory stream) against
   ``progress=False``, medians of runs in alternation, as a ratio.

Results: results/transform_progress.json (with --json).
"""

from __future__ import annotations

import argparse
import io
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DeepMLP, interleaved, write_result  # noqa: E402

import dpcompile  # noqa: E402
import dpcompile.progress as progress_module  # noqa: E402

LAYOUTS = {"tp": {"tensor_parallel": True}, "pp_x_tp": {"mesh": {"pp": 2, "tp": 2}}}


def _transform(model, layout, progress):
    options = LAYOUTS[layout]
    devices = ["cpu"] * (4 if "mesh" in options else 2)
    return dpcompile.transform(model, devices, example_inputs=(torch.randn(4, 32),), progress=progress, **options)


def _site_calls(model, layout) -> int:
    """How many step_bar and update calls one transform makes (counted with the bars shown)."""
    calls = 0
    bar_for, advance = progress_module.StepBars.bar_for, progress_module.StepBars.advance

    def counted_bar_for(self, *a):
        nonlocal calls
        calls += 1
        return bar_for(self, *a)

    def counted_advance(self, *a):
        nonlocal calls
        calls += 1
        return advance(self, *a)

    progress_module.StepBars.bar_for, progress_module.StepBars.advance = counted_bar_for, counted_advance
    old, sys.stderr = sys.stderr, io.StringIO()
    try:
        _transform(model, layout, True)
    finally:
        sys.stderr = old
        progress_module.StepBars.bar_for, progress_module.StepBars.advance = bar_for, advance
    return calls


def _drawn(model, layout):
    old, sys.stderr = sys.stderr, io.StringIO()
    try:
        return _transform(model, layout, True)
    finally:
        sys.stderr = old


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    quiet_call = min(timeit.repeat(lambda: progress_module.step_bar("Running passes", 1).update(), number=10000, repeat=5)) / 10000
    results = {"quiet_call_ns": quiet_call * 1e9, "models": {}}
    print(f"one quiet step_bar(...).update(): {quiet_call * 1e9:.0f} ns")
    for layers in (4, 50):
        model = DeepMLP(layers, 32)
        for layout in LAYOUTS:
            calls = _site_calls(model, layout)
            times = interleaved({"quiet": lambda m=model, lay=layout: _transform(m, lay, False),
                                 "drawn": lambda m=model, lay=layout: _drawn(m, lay)}, rounds=9, warmup=1)  # fmt: skip
            quiet_share = calls * quiet_call / times["quiet"]
            drawn_ratio = times["drawn"] / times["quiet"]
            results["models"][f"mlp{layers}_{layout}"] = {
                "site_calls": calls, "quiet_s": times["quiet"], "drawn_s": times["drawn"],
                "quiet_overhead_share": quiet_share, "drawn_over_quiet": drawn_ratio,
            }  # fmt: skip
            print(f"MLP {layers} layers, {layout}: {calls} site calls, quiet transform {times['quiet'] * 1e3:.0f} ms, "
                  f"quiet overhead {quiet_share:.2e} of it, drawn / quiet {drawn_ratio:.3f}")  # fmt: skip
    if args.json:
        print(write_result("transform_progress", results))


if __name__ == "__main__":
    main()
