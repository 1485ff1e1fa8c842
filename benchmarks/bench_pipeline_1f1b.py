"""What does ``schedule="1f1b"`` cost in one process against GPipe, and what does it save?

    python benchmarks/bench_pipeline_1f1b.py

The deep MLP of ``bench_pipeline.py`` (16 x Linear(512, 512) + ReLU, a cross-entropy loss in
forward) on ``["cpu"] * 4`` virtual devices, 4 stages, 8 micro-batches, batch 128, one training
step (forward and backward):

- ``gpipe_s``: ``pm = transform(..., schedule="gpipe")``; ``pm(x, labels).backward()``;
- ``one_f_one_b_s``: ``pm = transform(..., schedule="1f1b")``; ``pm(x, labels)`` (the call runs
  the backward);
- ``ratio`` = 1F1B / GPipe (the price of running the program as stage x micro-batch units);
- ``peak_saved_bytes_*``: the most bytes of activations autograd holds for backward at once
  during a step (tensors saved for backward, parameters left out; counted with
  ``torch.autograd.graph.saved_tensors_hooks``): GPipe holds every micro-batch's, 1F1B at most
  ``S - s`` per stage — the point of 1F1B.

Both on one process, measured in alternation. Results: results/pipeline_1f1b.json.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
from bench_pipeline import LossMLP  # noqa: E402
from common import interleaved, write_result  # noqa: E402

import dpcompile  # noqa: E402

STAGES, MICRO, BATCH, WIDTH = 4, 8, 128, 512


class _Held:
    """A saved activation as autograd holds it: gone when autograd lets it go."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class SavedBytes:
    """The bytes of activations saved for backward that are alive, and the most seen at once."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor) -> object:
        if t.is_leaf and t.requires_grad:  # a parameter: not an activation
            return t
        size = t.numel() * t.element_size()
        self.live += size
        self.peak = max(self.peak, self.live)
        held = _Held(t)
        weakref.finalize(held, self._release, size)
        return held

    def _release(self, size: int) -> None:
        self.live -= size

    @staticmethod
    def unpack(packed: object) -> torch.Tensor:
        return packed.t if isinstance(packed, _Held) else packed


def peak_saved_bytes(step) -> int:
    counter = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        step()
    return counter.peak


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, labels = torch.randn(BATCH, WIDTH), torch.randint(0, WIDTH, (BATCH,))
    steps, models = {}, {}
    for schedule in ("gpipe", "1f1b"):
        torch.manual_seed(0)
        model = models[schedule] = LossMLP()
        pm = dpcompile.transform(model, ["cpu"] * STAGES, pipeline=STAGES, micro_batches=MICRO,
                                 schedule=schedule, example_inputs=(x, labels))  # fmt: skip

        def step(pm=pm, model=model, schedule=schedule):
            model.zero_grad(set_to_none=True)
            loss = pm(x, labels)
            if schedule == "gpipe":
                loss.backward()

        steps[schedule] = step
    steps["gpipe"]()
    steps["1f1b"]()
    for p, q in zip(models["gpipe"].parameters(), models["1f1b"].parameters()):
        torch.testing.assert_close(p.grad, q.grad)  # the same step
    peaks = {name: peak_saved_bytes(step) for name, step in steps.items()}
    times = interleaved(steps, rounds=15, warmup=3)
    payload = {
        "model": f"16 x Linear({WIDTH}, {WIDTH}) + ReLU, cross-entropy in forward",
        "stages": STAGES,
        "micro_batches": MICRO,
        "batch": BATCH,
        "gpipe_s": times["gpipe"],
        "one_f_one_b_s": times["1f1b"],
        "ratio": times["1f1b"] / times["gpipe"],
        "peak_saved_bytes_gpipe": peaks["gpipe"],
        "peak_saved_bytes_1f1b": peaks["1f1b"],
        "peak_saved_ratio": peaks["1f1b"] / peaks["gpipe"],
    }
    path = write_result("pipeline_1f1b", payload)
    print(f"1f1b / gpipe step time {payload['ratio']:.3f} (1f1b {times['1f1b'] * 1e3:.2f} ms, gpipe "
          f"{times['gpipe'] * 1e3:.2f} ms); peak saved activations 1f1b / gpipe {payload['peak_saved_ratio']:.3f} "
          f"({peaks['1f1b'] / 2**20:.1f} MiB vs {peaks['gpipe'] / 2**20:.1f} MiB) -> {path}")  # fmt: skip


if __name__ == "__main__":
    main()
