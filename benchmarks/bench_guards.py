"""What the guards cost per call: ``pm.program_for_call(x)`` on a model forward enters ~50 modules.

Two checkouts cannot be imported in one process (both are ``dpcompile``), so each is timed in a
child process, in alternation, and every child also times a fixed reference workload (building
a 50-element tuple of ids): the figure compared is ``program_for_call / reference`` within one
process, which the load of a shared machine moves far less than raw microseconds.

    PYTHONPATH=. python benchmarks/bench_guards.py --baseline /work/main   # this checkout vs main

Models: ``nested`` (50 entered modules as plain attributes, watched by both versions) and
``module_list`` (the same blocks in an ``nn.ModuleList``: main took the list for a leaf and
watched none of its blocks; this checkout watches them, at every depth). Writes
``benchmarks/results/guards.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "guards.json"


def _child(model_kind: str, rounds: int, inner: int) -> dict[str, float]:
    import torch
    from torch import nn

    import dpcompile

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.scale = 1.0

        def forward(self, x):
            return self.fc(x) * self.scale

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()
            self.use_residual = True

        def forward(self, x):
            h = self.inner(x)
            return h + x if self.use_residual else h

    class Nested(nn.Module):
        def __init__(self, n: int):
            super().__init__()
            self.n = n
            for i in range(n):
                setattr(self, f"block{i}", Block())

        def forward(self, x):
            for i in range(self.n):
                x = getattr(self, f"block{i}")(x)
            return x

    class Listed(nn.Module):
        def __init__(self, n: int):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(n))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = Nested(25) if model_kind == "nested" else Listed(25)  # 1 + 25 blocks + 25 inners (+ the list)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    x = torch.randn(4, 8)
    assert pm.program_for_call(x) is pm
    objects = [object() for _ in range(50)]

    def reference() -> tuple:
        return tuple(map(id, objects))

    def lookup() -> object:
        return pm.program_for_call(x)

    samples: dict[str, list[float]] = {"lookup": [], "reference": []}
    for fn in (lookup, reference):
        for _ in range(100):
            fn()
    for r in range(rounds):
        for name, fn in (("lookup", lookup), ("reference", reference)) if r % 2 == 0 else (("reference", reference), ("lookup", lookup)):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - start) / inner)
    ratio = statistics.median(a / b for a, b in zip(samples["lookup"], samples["reference"]))
    return {"lookup_us": min(samples["lookup"]) * 1e6, "reference_us": min(samples["reference"]) * 1e6, "ratio": ratio}


def _run_child(path: str, model_kind: str, rounds: int, inner: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": path}
    command = [sys.executable, __file__, "--child", model_kind, "--rounds", str(rounds), "--inner", str(inner)]
    out = subprocess.run(command, env=env, cwd=path, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a checkout to compare with (e.g. /work/main)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3, help="child processes per checkout and model, alternated")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.rounds, args.inner)))
        return
    here = str(Path(__file__).resolve().parent.parent)
    checkouts = {"this": here, **({"baseline": args.baseline} if args.baseline else {})}
    results: dict[str, dict[str, object]] = {}
    for model_kind in ("nested", "module_list"):
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
        for _ in range(args.repeats):
            for name, path in checkouts.items():
                runs[name].append(_run_child(path, model_kind, args.rounds, args.inner))
        entry: dict[str, object] = {
            name: {
                "lookup_us": round(min(r["lookup_us"] for r in rs), 2),
                "ratio_to_reference": round(statistics.median(r["ratio"] for r in rs), 3),
            }
            for name, rs in runs.items()
        }
        if "baseline" in runs:
            entry["this_vs_baseline"] = round(entry["this"]["ratio_to_reference"] / entry["baseline"]["ratio_to_reference"], 3)  # type: ignore[index]
        results[model_kind] = entry
        print(model_kind, json.dumps(entry))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
