"""How much of real models runs split, and what does dpcompile cost against splitting by hand?

    python benchmarks/bench_models.py [name ...]

Per model of ``tests/thirdparty.py`` (torchvision and timm, tiny configurations, an LSTM
seq2seq), in eval mode, on ``["cpu"] * 2`` virtual devices, batch 8:

- ``split_flop_fraction``: the share of forward FLOPs that runs per device
  (``dpcompile.explain``), and the ops that run whole with their reasons;
- ``transform_s``: ``dpcompile.transform(model, devices, example_inputs=...)``;
- ``dpcompile_s`` / ``by_hand_s``: forward + backward of the transformed model, and of the
  same per-device work split by hand (each chunk of the batch run through the model, one
  chunk per virtual device, the losses summed); ``ratio`` = dpcompile / by hand (1.0: dpcompile
  adds nothing; an op running whole shows here as more than 1).

Ratios come from one process, measured in alternation. Results: results/models.json.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
from common import interleaved, write_result  # noqa: E402

import dpcompile  # noqa: E402
from tests.thirdparty import models  # noqa: E402

DEVICES = ["cpu", "cpu"]
BATCH = 8


def _batch(inputs: tuple[Any, ...], name: str) -> tuple[Any, ...]:
    """The example inputs grown to a batch of BATCH (time-major inputs of the seq2seq on dim 1)."""
    dim = 1 if name == "lstm_seq2seq" else 0
    return tuple(torch.cat([x] * (BATCH // x.size(dim)), dim) for x in inputs)


def _loss(out: Any) -> torch.Tensor:
    return out.float().pow(2).mean()


def bench(name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model, inputs = models()[name]()
    model.eval()
    inputs = _batch(inputs, name)
    dim = 1 if name == "lstm_seq2seq" else 0
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = dpcompile.transform(model, DEVICES, example_inputs=inputs)
    transform_s = time.perf_counter() - start
    report = dpcompile.explain(pm, *inputs)
    chunks = list(zip(*(x.tensor_split(len(DEVICES), dim) for x in inputs)))

    def ours() -> None:
        _loss(pm(*inputs)).backward()

    def by_hand() -> None:
        total = sum(_loss(model(*chunk)) * (chunk[0].size(dim) / BATCH) for chunk in chunks)
        total.backward()

    times = interleaved({"dpcompile": ours, "by_hand": by_hand}, rounds=5, warmup=1)
    return {
        "split_flop_fraction": report.split_flop_fraction,
        "whole": [{k: w[k] for k in ("node", "reason", "flops")} for w in report.whole[:5]],
        "warned": [str(w.message)[:200] for w in caught if "run whole" in str(w.message)],
        "transform_s": round(transform_s, 3),
        "dpcompile_s": round(times["dpcompile"], 4),
        "by_hand_s": round(times["by_hand"], 4),
        "ratio": round(times["dpcompile"] / times["by_hand"], 3),
    }


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name in names or list(models()):
        try:
            results[name] = bench(name)
        except Exception as e:  # noqa: BLE001 - one model's failure is a result too
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        r = results[name]
        fraction = r.get("split_flop_fraction")
        print(
            f"{name:22s} " + (f"error: {r['error'][:90]}" if "error" in r else
            f"split {fraction:.3f}  transform {r['transform_s']:.2f}s  fwd+bwd {r['dpcompile_s'] * 1e3:.1f} ms "
            f"vs by hand {r['by_hand_s'] * 1e3:.1f} ms  ratio {r['ratio']:.2f}"),
            flush=True,
        )  # fmt: skip
    path = write_result("models", {"devices": DEVICES, "batch": BATCH, "models": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
