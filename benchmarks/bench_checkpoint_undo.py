"""What putting back a recompute's outside writes costs a checkpointed training step, on one device.

For each model of ``bench_planner_rank.py`` (tiny random-weight configurations), three programs over one
CPU device: plain, every repeated block checkpointed with the runtime's undo of outside writes on every
region (as before ``passes.checkpoint_writes``), and checkpointed as ``transform`` builds it now (regions
known to write nothing outside run their recompute without the undo: ``undo_writes = False``). The median
of 8 training steps' CPU seconds (this thread's), interleaved over 6 rounds, the median of those; each
checkpointed program's step over the plain one's.

    PYTHONPATH=. python benchmarks/bench_checkpoint_undo.py [--only gpt2,llama]

Writes ``benchmarks/results/checkpoint_undo.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_planner_rank as bench  # noqa: E402
from common import uptime  # noqa: E402

import dpcompile  # noqa: E402
from dpcompile.capture import capture_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint_undo.json"


def _loss(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out["loss"] if isinstance(out, dict) else out.loss


def _step_seconds(pm: Any, args: tuple, kwargs: dict, steps: int = 8) -> float:
    def step() -> None:
        _loss(pm(*args, **kwargs)).backward()
        for p in pm.parameters():
            p.grad = None

    step()
    seconds = []
    for _ in range(steps):
        start = time.thread_time()
        step()
        seconds.append(time.thread_time() - start)
    return statistics.median(seconds)


def measure(name: str, rounds: int = 6) -> dict[str, Any]:
    model, args, kwargs = bench.build(name)
    if kwargs:
        model, _ = capture_model(model, frontend="export", example_kwargs=kwargs)

    def build(**keywords: Any) -> Any:
        return dpcompile.transform(copy.deepcopy(model), ["cpu"], example_inputs=args or None,
                                   example_kwargs=kwargs or None, **keywords)  # fmt: skip

    activations = sys.modules["passes.checkpoint_activations"]
    programs = {"plain": build(), "checkpointed": build(activation_checkpointing=True)}
    finder = activations.may_write_outside
    activations.may_write_outside = lambda nodes: True  # every region keeps the undo, as before
    try:
        programs["checkpointed, undo everywhere"] = build(activation_checkpointing=True)
    finally:
        activations.may_write_outside = finder
    runs: dict[str, list[float]] = {k: [] for k in programs}
    for _ in range(rounds):
        for label, pm in programs.items():
            runs[label].append(_step_seconds(pm, args, kwargs))
    median = {k: statistics.median(v) for k, v in runs.items()}
    regions = programs["checkpointed"].code.count("dpcompile_runtime_checkpoint(")
    without = programs["checkpointed"].code.count("undo_writes = False")
    return {"step_s": median, "over_plain": {k: v / median["plain"] for k, v in median.items()},
            "regions": regions, "regions_without_undo": without}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="gpt2,llama,bert,vit,mlp_stack")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    out: dict[str, Any] = {"command": "PYTHONPATH=. python benchmarks/bench_checkpoint_undo.py " + " ".join(sys.argv[1:]),
                           "models": {}}  # fmt: skip
    for name in ns.only.split(","):
        out["models"][name] = found = measure(name)
        ratios = ", ".join(f"{k} {v:.3f}" for k, v in found["over_plain"].items() if k != "plain")
        print(f"{name}: {found['regions_without_undo']}/{found['regions']} regions without the undo; x plain: {ratios}",
              flush=True)  # fmt: skip
    out["uptime"] = uptime()
    RESULTS.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
