"""Training checkpoints: what each load reads, and what the optimizer's state costs, as ratios.

    python benchmarks/bench_training_checkpoint.py [--width 96] [--vocab 512]

The small LM of ``tests/integration/test_training_checkpoint.py`` (fused qkv, tied embedding),
wider, trained one AdamW step under tensor parallelism on 2 virtual devices and saved twice in
the same run: weights only (the baseline) and with the optimizer and scheduler. Then loaded into
other layouts. Reported per destination layout: the bytes all of its devices read from the
files, over the bytes of tensor data the files hold (1.0: each byte read once, by the device that
holds it; a load reading every tensor whole on each device would be the device count or more), and
the seconds of the training load over the weights-only load; for the save, the training save
over the weights-only save (the optimizer's AdamW state is twice the weights' bytes).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

import dpcompile
import tests.integration.test_training_checkpoint as lm
from dpcompile.checkpoint import slices

DESTINATIONS = [{"pp": 2, "tp": 2}, {"tp": 3}, {"dp": 2}]


def _counted_reads(counts: list[int]):
    """``pread_runs`` of the loads that adds up the bytes each read takes from the files."""
    real = slices.pread_runs

    def counted(fd, data, at, runs):
        counts.append(sum(n for _, n in runs))
        return real(fd, data, at, runs)

    return counted


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=96, help="model width (a multiple of 3 heads)")
    parser.add_argument("--vocab", type=int, default=512)
    args = parser.parse_args()
    lm.V, lm.D = args.vocab, args.width
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, lm.V, (4, 6), generator=g), torch.randint(0, lm.V, (4, 6), generator=g))
    lm.batches = lambda: [batch] * 3
    pm, opt, sched = lm.build({"tp": 2})
    lm.train_step(pm, opt, sched, batch)
    folder = Path(tempfile.mkdtemp(prefix="dpcompile_training_ckpt_"))
    weights, training = folder / "weights", folder / "training"
    save_weights = _timed(lambda: dpcompile.save_checkpoint(pm, weights))
    save_training = _timed(lambda: dpcompile.save_checkpoint(pm, training, optimizer=opt, lr_scheduler=sched))
    held = sum(t.numel() * t.element_size() for t in load_file(training / "model.safetensors").values())
    held += sum(t.numel() * t.element_size() for t in load_file(training / "optimizer.safetensors").values())
    result = {"save_training_over_weights": save_training / save_weights, "bytes_in_files": held, "loads": {}}
    for layout in DESTINATIONS:
        dest, dest_opt, dest_sched = lm.build(layout)
        counts: list[int] = []
        real = slices.pread_runs
        slices.pread_runs = _counted_reads(counts)
        try:
            load_training = _timed(
                lambda d=dest, o=dest_opt, s=dest_sched: dpcompile.load_checkpoint(
                    d, training, optimizer=o, lr_scheduler=s
                )
            )
        finally:
            slices.pread_runs = real
        load_weights = _timed(lambda d=dest: dpcompile.load_checkpoint(d, weights))
        name = "x".join(f"{k}{v}" for k, v in layout.items())
        result["loads"][name] = {
            "read_over_held": sum(counts) / held,
            "load_training_over_weights": load_training / load_weights,
        }
        print(f"tp2 -> {name}: read/held {sum(counts) / held:.3f}; training load / weights-only load "
              f"{load_training / load_weights:.2f}x")  # fmt: skip
    print(f"save: training / weights-only {save_training / save_weights:.2f}x")
    out = Path(__file__).parent / "results" / "training_checkpoint.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
