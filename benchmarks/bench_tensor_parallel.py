"""How fast is dpcompile's tensor-parallel MLP, and how much does its plan communicate?

An MLP (d=1024, h=4096, batch 64) over ``["cpu"] * 2``: the forward time of the dpcompile
module (automatic plan: column then row) against the eager model and against the
``tensor-parallel`` package (``tp.tensor_parallel(model, ["cpu", "cpu"])``), measured in
one run, interleaved so that machine noise hits every contender alike. Also the plan's
communication from the cost model against a plan that gathers after every Linear.

    python benchmarks/bench_tensor_parallel.py [--repeats 30]

Writes ``benchmarks/results/tensor_parallel.json``. The peer is optional
(``pip install --no-deps tensor-parallel==2.0.0 "setuptools<81"`` plus its ``transformers``
import); without it its figures are null.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dpcompile
from dpcompile.analysis.cost import linear_comms, plan_cost

D, H, BATCH, DEVICES = 1024, 4096, 64, ["cpu", "cpu"]
RESULTS = Path(__file__).parent / "results" / "tensor_parallel.json"


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D))


def load_peer(model: nn.Module) -> tuple[nn.Module | None, str | None]:
    """The tensor-parallel package's model, or None and why not."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import tensor_parallel as tp
    except Exception as e:  # noqa: BLE001 - optional peer: any import failure means skip
        return None, f"tensor_parallel not importable: {type(e).__name__}: {e}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tp.tensor_parallel(model, DEVICES), None
    except Exception as e:  # noqa: BLE001
        return None, f"tp.tensor_parallel failed: {type(e).__name__}: {e}"


def time_forward(fn, x: torch.Tensor) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        fn(x)
    return time.perf_counter() - start


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    model = make_mlp().eval()
    x = torch.randn(BATCH, D)
    pm = dpcompile.transform(model, DEVICES, tensor_parallel=True, example_inputs=(x,)).eval()
    peer, peer_skipped = load_peer(make_mlp().eval())

    with torch.no_grad():
        reference = model(x)
        torch.testing.assert_close(pm(x), reference, rtol=1e-4, atol=1e-4)
        if peer is not None:
            torch.testing.assert_close(peer(x), reference, rtol=1e-4, atol=1e-4)

    contenders = {"eager": model, "dpcompile": pm}
    if peer is not None:
        contenders["tensor_parallel"] = peer
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for i in range(args.warmup + args.repeats):
        for name, fn in contenders.items():  # interleaved: noise hits everyone alike
            t = time_forward(fn, x)
            if i >= args.warmup:
                times[name].append(t)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    best = {name: min(ts) for name, ts in times.items()}

    n = len(DEVICES)
    planned = pm.comm_cost
    gather_every = plan_cost(linear_comms("column", BATCH * D, BATCH * H) + linear_comms("column", BATCH * H, BATCH * D), n)
    result = {
        "question": "forward time of a tensor-parallel MLP (d=1024, h=4096, batch 64) on ['cpu']*2, and its communication",
        "model": {"d": D, "h": H, "batch": BATCH, "devices": DEVICES},
        "plan": pm.plan,
        "forward_ms_median": {k: round(v * 1e3, 3) for k, v in median.items()},
        "forward_ms_min": {k: round(v * 1e3, 3) for k, v in best.items()},
        "ratios": {
            "dpcompile_over_eager": round(median["dpcompile"] / median["eager"], 3),
            "dpcompile_over_tensor_parallel": round(median["dpcompile"] / median["tensor_parallel"], 3) if peer is not None else None,
            "tensor_parallel_over_eager": round(median["tensor_parallel"] / median["eager"], 3) if peer is not None else None,
            "dpcompile_over_tensor_parallel_min": round(best["dpcompile"] / best["tensor_parallel"], 3) if peer is not None else None,
        },
        "load_average": list(os.getloadavg()),
        "peer_skipped": peer_skipped,
        "comm_elements_per_device": {
            "plan": {"forward": planned.forward, "backward": planned.backward, "total": planned.total},
            "gather_after_every_linear": {"forward": gather_every.forward, "backward": gather_every.backward, "total": gather_every.total},
            "plan_over_gather_every": round(planned.total / gather_every.total, 4),
            "forward_only_ratio": round(planned.forward / gather_every.forward, 4),
        },
        "repeats": args.repeats,
        "environment": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
