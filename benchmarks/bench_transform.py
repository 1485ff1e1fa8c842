"""How fast is transform, and what does data parallelism on virtual devices cost at run time?

    python benchmarks/bench_transform.py

1. transform(model, ["cpu"] * 2) against bare torch.fx.symbolic_trace on MLPs of 50, 200 and
   800 layers (targets: <= 4x symbolic_trace; time(800) / time(200) <= 4.5, linear growth).
2. forward + backward of the transformed MLP on ["cpu"] * 2 against the eager model,
   batch 64, d = 1024 (target: <= 1.15x eager), and against the same eager model run on two
   half batches by hand: on one physical device the split itself costs (each weight matrix
   is streamed twice), and that ratio isolates what dpcompile adds.

Ratios come from the same process, measured in alternation. Results: results/transform.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.fx as fx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DeepMLP, interleaved, write_result  # noqa: E402

import dpcompile  # noqa: E402


def transform_times() -> dict:
    out = {}
    for layers in (50, 200, 800):
        model = DeepMLP(layers, 8)
        times = interleaved(
            {
                "symbolic_trace": lambda m=model: fx.symbolic_trace(m),
                "transform": lambda m=model: dpcompile.transform(m, ["cpu"] * 2),
            },
            rounds=5 if layers < 800 else 3,
            warmup=1,
        )
        out[layers] = {**times, "ratio": times["transform"] / times["symbolic_trace"]}
        print(f"{layers:4d} layers: symbolic_trace {times['symbolic_trace'] * 1e3:8.1f} ms   "
              f"transform {times['transform'] * 1e3:8.1f} ms   ratio {out[layers]['ratio']:.2f}x")
    growth = out[800]["transform"] / out[200]["transform"]
    print(f"growth time(800)/time(200) = {growth:.2f} (linear: 4.0)")
    return {"by_layers": out, "growth_800_over_200": growth}


def runtime_overhead(batch: int = 64, d: int = 1024, layers: int = 4) -> dict:
    model = DeepMLP(layers, d)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    x = torch.randn(batch, d)

    def step(module):
        def run():
            model.zero_grad(set_to_none=True)
            module(x).sum().backward()

        return run

    def hand_split():
        # what any data parallelism on one device must do: two half batches, one concatenation
        model.zero_grad(set_to_none=True)
        torch.cat([model(half) for half in x.tensor_split(2)]).sum().backward()

    times = interleaved({"eager": step(model), "dpcompile": step(pm), "hand_split": hand_split}, rounds=21, warmup=3)
    ratio = times["dpcompile"] / times["eager"]
    own = times["dpcompile"] / times["hand_split"]
    print(f"forward+backward, batch {batch}, d {d}: eager {times['eager'] * 1e3:.2f} ms, "
          f"dpcompile on 2 virtual devices {times['dpcompile'] * 1e3:.2f} ms ({ratio:.3f}x eager), "
          f"hand-split eager {times['hand_split'] * 1e3:.2f} ms (dpcompile / hand-split {own:.3f}x)")
    return {**times, "ratio": ratio, "ratio_vs_hand_split": own, "batch": batch, "d": d, "layers": layers}


def main() -> None:
    result = {"transform": transform_times(), "forward_backward": runtime_overhead()}
    path = write_result("transform", result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
