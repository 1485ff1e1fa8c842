"""Timing helpers shared by the benchmarks: medians of interleaved runs, JSON results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results"


def uptime() -> str:
    """The machine's ``uptime`` line (its load averages), kept beside a run's figures."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def median_seconds(fn: Callable[[], Any], *, repeat: int = 7, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(fns: dict[str, Callable[[], Any]], *, rounds: int = 7, warmup: int = 2) -> dict[str, float]:
    """Median seconds of each function, run in alternation so machine noise hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    payload = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count()},
        **payload,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


class DeepMLP(nn.Module):
    """``layers`` Linear(d, d) + ReLU: the small model whose per-call overhead the benchmarks measure."""

    def __init__(self, layers: int, d: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class ResidualBlock(nn.Module):
    """Pre-norm MLP block with a residual: ``x + down(relu(up(norm(x))))``."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class ResidualStack(nn.Module):
    """``layers`` residual blocks between a 16-wide input and an 8-wide head, its MSE loss to ``y``."""

    def __init__(self, layers: int = 8, d: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.layers = nn.ModuleList(ResidualBlock(d) for _ in range(layers))
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return nn.functional.mse_loss(self.head(h), y)


def spawn_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float) -> dict[int, Any]:
    """Start ``world`` spawned processes running ``target(rank, world, port, *args, results)`` (``port``
    a free one on 127.0.0.1 for their process group) and collect
    one ``(rank, report)`` each from the queue ``results`` within ``timeout`` seconds; a rank that
    hung or crashed is missing from the result, and no process is left behind."""
    import queue
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    reports: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(reports) < world and time.monotonic() < deadline:
        try:
            rank, report = results.get(timeout=2.0)
            reports[rank] = report
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    return reports
