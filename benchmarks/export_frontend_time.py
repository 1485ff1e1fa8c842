"""How long does ``transform`` take on the export frontend, against ``torch.export.export`` alone?

GPT-2 from a tiny config (random weights, dropout on), data parallel on 4 virtual CPU devices.
Each is timed after one warm-up run (torch.export's first call in a process pays for imports and
caches); runs alternate, the median of ``--repeat`` each. GPT-2's attention reads
``self.training`` (its dropout), so transform exports twice, once per mode. Writes ``benchmarks/results/export_frontend_time.json``.

    python benchmarks/export_frontend_time.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    options = parser.parse_args()
    for name in ("nms", "qnms"):  # torchvision (imported by transformers) on a CPU-only torch
        try:
            torch.library.define(f"torchvision::{name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass
    import transformers
    from torch.export import Dim, export

    import dpcompile

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).eval()
    kwargs = {"input_ids": torch.randint(0, 128, (4, 16)), "labels": torch.randint(0, 128, (4, 16))}
    spec = {"input_ids": {0: Dim.AUTO}, "labels": {0: Dim.AUTO}}

    def run_export() -> None:
        export(model, (), kwargs, dynamic_shapes=spec, strict=False)

    def run_transform() -> None:
        dpcompile.transform(model, ["cpu"] * 4, frontend="export", example_kwargs=kwargs)

    samples: dict[str, list[float]] = {"torch_export": [], "transform": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_export()
        run_transform()
        for _ in range(options.repeat):  # interleaved, so a busy machine slows both alike
            for label, fn in (("torch_export", run_export), ("transform", run_transform)):
                start = time.perf_counter()
                fn()
                samples[label].append(time.perf_counter() - start)
    times = {label: statistics.median(values) for label, values in samples.items()}
    result = {**{f"{k}_seconds": round(v, 3) for k, v in times.items()}, "ratio": round(times["transform"] / times["torch_export"], 2)}
    out = Path(__file__).parent / "results" / "export_frontend_time.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
