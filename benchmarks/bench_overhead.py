"""What does the generated program cost beyond the per-device work it does?

    python benchmarks/bench_overhead.py [--rounds 31] [--quick]

(It re-runs itself with glibc malloc settings that keep large buffers out of mmap: see
MALLOC_SETTINGS.)

Each case runs, in the same process and in alternation, a transformed model
against the same per-device work written by hand: the batch split with ``tensor_split``, the
user's model run on each chunk, the results concatenated (and, with grad, ``sum().backward()``).

1. Small MLP (10 layers, d=64, batch 32) on 2 and 4 virtual CPU devices, under ``no_grad`` and
   with forward+backward (target: <= 1.1x the hand split).
2. Large MLP (1024 -> 4096 -> 1024, batch 64) on 2 virtual devices, forward+backward
   (target: <= 1.03x the hand split), and ``copy_replicas=True`` (the code path of distinct
   GPUs: persistent replicas) against the virtual path (target: <= 1.03x).
3. The per-call overhead of ``ParallelModule.__call__`` itself: the generated ``forward``
   called directly against ``pm(x)``, and each call-path step timed alone.
4. ``torch.compile(pm)`` and ``pm.compile()`` (in place, dpcompile's inductor options) against
   ``pm`` on the small MLP (target: >= 1.2x faster), with the graph-break count from
   ``torch._dynamo.explain``.

Times are minima over rounds; ratios are medians over rounds of the paired per-round ratio.
Results: results/overhead.json.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DeepMLP, write_result  # noqa: E402

import dpcompile  # noqa: E402


class WideMLP(nn.Module):
    def __init__(self, d: int = 1024, h: int = 4096):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def min_interleaved(fns: dict[str, Callable[[], Any]], *, rounds: int, inner: int, warmup: int = 3) -> dict[str, float]:
    """Seconds per call of each function: min over rounds of the mean of ``inner`` calls,
    the functions alternating (and their order reversed every other round). The clock is
    this thread's CPU time: on a shared machine, time the scheduler gives other processes
    is not ours (torch runs on one thread here, so the thread's time is all the work)."""
    return interleaved_samples(fns, rounds=rounds, inner=inner, warmup=warmup)[0]


def interleaved_samples(
    fns: dict[str, Callable[[], Any]], *, rounds: int, inner: int, warmup: int = 3
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """``(min seconds per call of each, every round's seconds per call of each)``."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            fn = fns[name]
            start = time.thread_time()
            for _ in range(inner):
                fn()
            samples[name].append((time.thread_time() - start) / inner)
    return {name: min(v) for name, v in samples.items()}, samples


def paired_ratio(samples: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of a / b within each round: adjacent measurements share the
    machine's momentary load, so this resists the drift of a shared box better than a ratio
    of two minima taken at different moments."""
    return statistics.median(x / y for x, y in zip(samples[a], samples[b]))


def hand_split(model: nn.Module, n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x):
        return torch.cat([model(chunk) for chunk in x.tensor_split(n)])

    return run


def steps(model: nn.Module, pm: nn.Module, x: torch.Tensor, n: int, grad: bool) -> dict[str, Callable[[], Any]]:
    by_hand = hand_split(model, n)
    if not grad:
        def nograd(f):
            def run():
                with torch.no_grad():
                    f(x)
            return run

        return {"dpcompile": nograd(pm), "hand_split": nograd(by_hand)}

    def train(f):
        def run():
            model.zero_grad(set_to_none=True)
            f(x).sum().backward()
        return run

    return {"dpcompile": train(pm), "hand_split": train(by_hand)}


def small_mlp(rounds: int) -> dict:
    out = {}
    for n in (2, 4):
        for grad in (False, True):
            torch.manual_seed(0)
            model = DeepMLP(10, 64)
            pm = dpcompile.transform(model, ["cpu"] * n)
            x = torch.randn(32, 64)
            times, samples = interleaved_samples(steps(model, pm, x, n, grad), rounds=rounds, inner=20)
            key = f"{n}dev_{'grad' if grad else 'nograd'}"
            out[key] = {**times, "ratio": paired_ratio(samples, "dpcompile", "hand_split"),
                        "ratio_of_minima": times["dpcompile"] / times["hand_split"]}
            print(f"small MLP {key:12s} dpcompile {times['dpcompile'] * 1e6:7.1f} us  hand split "
                  f"{times['hand_split'] * 1e6:7.1f} us  ratio {out[key]['ratio']:.3f}", flush=True)
    return out


def large_mlp(rounds: int) -> dict:
    torch.manual_seed(0)
    model = WideMLP()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    pm_copy = dpcompile.transform(model, ["cpu"] * 2, copy_replicas=True)
    x = torch.randn(64, 1024)
    fns = steps(model, pm, x, 2, True)
    fns["copy_replicas"] = steps(model, pm_copy, x, 2, True)["dpcompile"]
    # the floor of any persistent replica on one CPU: device 1 runs a copy of the weights made
    # beforehand (so the second pass over each weight no longer finds it in cache), and its
    # gradients are summed onto the originals, as copy_replicas does
    twin = copy.deepcopy(model)
    pairs = list(zip(model.parameters(), twin.parameters()))

    def hand_split_copy():
        model.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
        first, second = x.tensor_split(2)
        torch.cat([model(first), twin(second)]).sum().backward()
        for p, q in pairs:
            p.grad += q.grad

    fns["hand_split_copy"] = hand_split_copy
    times, samples = interleaved_samples(fns, rounds=rounds, inner=2)
    out = {
        **times,
        "ratio": paired_ratio(samples, "dpcompile", "hand_split"),
        "copy_replicas_over_virtual": paired_ratio(samples, "copy_replicas", "dpcompile"),
        "copy_replicas_over_hand_split_copy": paired_ratio(samples, "copy_replicas", "hand_split_copy"),
        "hand_split_copy_over_hand_split": paired_ratio(samples, "hand_split_copy", "hand_split"),
    }
    print(f"large MLP fwd+bwd: dpcompile {times['dpcompile'] * 1e3:.2f} ms  hand split {times['hand_split'] * 1e3:.2f} ms"
          f"  ratio {out['ratio']:.3f}; copy_replicas {times['copy_replicas'] * 1e3:.2f} ms"
          f" ({out['copy_replicas_over_virtual']:.3f}x virtual, {out['copy_replicas_over_hand_split_copy']:.3f}x the hand"
          f" split with a copy of the weights, which is {out['hand_split_copy_over_hand_split']:.3f}x the hand split)", flush=True)
    return out


def call_path(rounds: int) -> dict:
    """Where the time of ``pm(x)`` goes, layer by layer of the call path (microseconds):
    ``forward`` is the generated program with its runtime calls; each next entry adds one
    layer: ``nn.Module.__call__`` (hooks), ``ParallelModule.__call__`` (batch size, program
    lookup), ``pm(x)`` (the call as users make it). ``batch_size`` and ``program_for_call`` are
    ParallelModule's two call-time checks alone; ``runtime_*`` the runtime calls of the
    program alone, against ``tensor_split`` / ``cat``, which the hand split calls instead."""
    out = {}
    for n in (2, 4):
        out[f"{n}dev"] = _call_path(n, rounds)
    return out


def _call_path(n: int, rounds: int) -> dict:
    from dpcompile import runtime
    from dpcompile.modules.base import ParallelModule

    torch.manual_seed(0)
    model = DeepMLP(10, 64)
    pm = dpcompile.transform(model, ["cpu"] * n)
    x = torch.randn(32, 64)
    args, kwargs = (x,), {}
    chunks = list(x.tensor_split(n))
    devices = ["cpu"] * n
    layers = list(model.layers)
    root = runtime.replicate({"layers": model.layers}, devices[1:])[0]

    def prebound() -> torch.Tensor:
        # the generated program's runtime calls and module calls, with every module looked up
        # once outside the call: what forward would cost if its module lookups were free
        runtime.replicate({"layers": model.layers}, devices[1:])  # virtual devices: aliases of the originals
        outs = []
        for chunk in runtime.scatter(x, devices, 0):
            for layer in layers:
                chunk = torch.relu(layer(chunk))
            outs.append(chunk)
        return runtime.gather(outs, 0, "cpu")

    fns = {
        "forward": lambda: pm.forward(x),
        "forward_prebound_modules": prebound,
        "module_call": lambda: nn.Module.__call__(pm, x),
        "parallel_module_call": lambda: ParallelModule.__call__(pm, x),
        "pm_call": lambda: pm(x),
        "hand_split": lambda: torch.cat([model(c) for c in x.tensor_split(n)]),
        "batch_size": lambda: pm.batch_size(args, kwargs),
        "program_for_call": lambda: pm.program_for_call(*args, **kwargs),
        "runtime_replicate": lambda: runtime.replicate({"layers": model.layers}, devices[1:]),
        "runtime_scatter": lambda: runtime.scatter(x, devices, 0),
        "runtime_gather": lambda: runtime.gather(chunks, 0, "cpu"),
        "tensor_split": lambda: x.tensor_split(n),
        "cat": lambda: torch.cat(chunks),
        "module_lookup_self": lambda: getattr(pm.layers, "0"),
        "module_lookup_replica": lambda: getattr(root.layers, "0"),  # what generated code reads
    }
    with torch.no_grad():
        times = min_interleaved(fns, rounds=rounds, inner=50)
    us = {k: v * 1e6 for k, v in times.items()}
    us["overhead_total"] = us["pm_call"] - us["hand_split"]
    us["overhead_call_path"] = us["pm_call"] - us["forward"]  # ParallelModule.__call__ (and fx's wrapper, before)
    us["overhead_module_lookups"] = us["forward"] - us["forward_prebound_modules"]  # the code's module lookups
    us["overhead_runtime_calls"] = us["forward_prebound_modules"] - us["hand_split"]  # replicate/scatter/gather
    print(f"call path {n} devices (us): " + ", ".join(f"{k} {v:.1f}" for k, v in us.items()), flush=True)
    return us | {"unit": "us"}


def compiled(rounds: int) -> dict:
    """``torch.compile(pm)`` with torch's defaults, and ``pm.compile()`` (in place, with
    dpcompile's inductor options), each against the eager ``pm``."""
    import torch._dynamo

    out = {}
    for grad in (False, True):
        torch.manual_seed(0)
        model = DeepMLP(10, 64)
        pm = dpcompile.transform(model, ["cpu"] * 2)
        in_place = dpcompile.transform(model, ["cpu"] * 2)
        x = torch.randn(32, 64)
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(pm)(x)
        torch._dynamo.reset()
        cpm = torch.compile(pm)
        in_place.compile()
        fns = {
            "eager_pm": steps(model, pm, x, 2, grad)["dpcompile"],
            "compiled_pm": steps(model, cpm, x, 2, grad)["dpcompile"],
            "pm_compile": steps(model, in_place, x, 2, grad)["dpcompile"],
        }
        with torch.no_grad():
            cpm(x)
            equal = torch.allclose(cpm(x), pm(x), rtol=1e-5, atol=1e-6)
            equal_in_place = torch.allclose(in_place(x), pm(x), rtol=1e-5, atol=1e-6)
        times, samples = interleaved_samples(fns, rounds=rounds, inner=20)
        key = "grad" if grad else "nograd"
        out[key] = {
            **times,
            "speedup": paired_ratio(samples, "eager_pm", "compiled_pm"),
            "speedup_pm_compile": paired_ratio(samples, "eager_pm", "pm_compile"),
            "graph_breaks": explanation.graph_break_count,
            "graphs": explanation.graph_count,
            "outputs_equal": bool(equal),
            "outputs_equal_pm_compile": bool(equal_in_place),
        }
        print(f"small MLP 2 devices {key}: pm {times['eager_pm'] * 1e6:.1f} us, torch.compile(pm) "
              f"{times['compiled_pm'] * 1e6:.1f} us ({out[key]['speedup']:.2f}x), pm.compile() "
              f"{times['pm_compile'] * 1e6:.1f} us ({out[key]['speedup_pm_compile']:.2f}x), "
              f"graph breaks {explanation.graph_break_count}, equal {equal} / {equal_in_place}", flush=True)
        del fns, cpm, in_place, pm, model  # nothing of this round alive while the next compiles
        gc.collect()
    return out


def _nograd(f, x):
    with torch.no_grad():
        return f(x)


# glibc's malloc otherwise maps and unmaps every large buffer (the 16 MB weight gradients) once
# its adaptive threshold wanders below them, and the page faults, counted in thread time, swamp
# the differences being measured; a long training process settles where these settings start.
MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**32)}


def _with_steady_malloc() -> None:
    """Re-run this script with MALLOC_SETTINGS in the environment unless they are there."""
    if all(os.environ.get(k) == v for k, v in MALLOC_SETTINGS.items()) or os.environ.get("DPCOMPILE_BENCH_RAW_MALLOC"):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_SETTINGS})


def main() -> None:
    _with_steady_malloc()
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--quick", action="store_true", help="fewer rounds, no JSON")
    parser.add_argument("--only", choices=["small", "large", "call", "compile"], default=None)
    parser.add_argument("--name", default="overhead", help="results/<name>.json")
    parser.add_argument("--code-label", default=None, help="which dpcompile was measured (default: its git commit)")
    a = parser.parse_args()
    torch.set_num_threads(1)
    rounds = 7 if a.quick else a.rounds
    parts = {"small": small_mlp, "large": large_mlp, "call": call_path, "compile": compiled}
    result = {name: fn(rounds if name != "large" else max(5, rounds // 2)) for name, fn in parts.items()
              if a.only in (None, name)}
    if not a.quick and a.only is None:
        meta = {"command": "python benchmarks/bench_overhead.py " + " ".join(sys.argv[1:]), "rounds": rounds,
                "dpcompile": a.code_label or _commit(), "clock": "thread CPU time, torch.set_num_threads(1); times: min over rounds; ratios: median over rounds of the paired per-round ratio"}
        print(f"wrote {write_result(a.name, {**meta, **result})}")


def _commit() -> str:
    import subprocess

    where = Path(dpcompile.__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--", "."], capture_output=True, text=True)
        return head.stdout.strip() + ("+uncommitted" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
