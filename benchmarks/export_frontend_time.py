"""How long does ``transform`` take on the export frontend, against ``torch.export.export`` alone?

GPT-2 from a tiny config (random weights, dropout on) of 8, 16 and 32 layers, data parallel on 4
virtual CPU devices. Each is timed after one warm-up run (torch.export's first call in a process
pays for imports and caches); runs alternate, the median of ``--repeat`` each, in process CPU
seconds (on a shared machine wall time mostly measures the neighbours) and wall seconds. GPT-2's
attention reads ``self.training`` (its dropout); transform exports only the mode the model is in
(eval here), the other at the first call in it, so the ratio is one export plus the passes
(it was about 2.65 when transform exported both modes). Writes
``benchmarks/results/export_frontend_time.json``.

    python benchmarks/export_frontend_time.py [--repeat 3] [--layers 8 16 32]
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
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    options = parser.parse_args()
    torch.set_num_threads(1)  # fake tensors compute nothing; one thread keeps CPU seconds comparable
    for name in ("nms", "qnms"):  # torchvision (imported by transformers) on a CPU-only torch
        try:
            torch.library.define(f"torchvision::{name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass
    import transformers

    transformers.logging.set_verbosity_error()
    result = {str(layers): _time_layers(transformers, layers, options.repeat) for layers in options.layers}
    out = Path(__file__).parent / "results" / "export_frontend_time.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


def _time_layers(transformers, layers: int, repeat: int) -> dict:
    from torch.export import Dim, export

    import dpcompile

    config = transformers.GPT2Config(
        n_layer=layers, n_embd=64, n_head=4, vocab_size=128, n_positions=64, use_cache=False
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    kwargs = {"input_ids": torch.randint(0, 128, (4, 16)), "labels": torch.randint(0, 128, (4, 16))}
    spec = {"input_ids": {0: Dim.AUTO}, "labels": {0: Dim.AUTO}}

    def run_export() -> None:
        export(model, (), kwargs, dynamic_shapes=spec, strict=False)

    def run_transform() -> None:
        dpcompile.transform(model, ["cpu"] * 4, frontend="export", example_kwargs=kwargs)

    cpu: dict[str, list[float]] = {"torch_export": [], "transform": []}
    wall: dict[str, list[float]] = {"torch_export": [], "transform": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_export()
        run_transform()
        for _ in range(repeat):  # interleaved, so a busy machine slows both alike
            for label, fn in (("torch_export", run_export), ("transform", run_transform)):
                start, start_cpu = time.perf_counter(), time.process_time()
                fn()
                cpu[label].append(time.process_time() - start_cpu)
                wall[label].append(time.perf_counter() - start)
    out = {}
    for kind, samples in (("cpu", cpu), ("wall", wall)):
        times = {label: statistics.median(values) for label, values in samples.items()}
        out.update({f"{k}_{kind}_seconds": round(v, 3) for k, v in times.items()})
        out[f"ratio_{kind}"] = round(times["transform"] / times["torch_export"], 2)
    print(f"{layers:3d} layers: {out}", flush=True)
    return out


if __name__ == "__main__":
    main()
