"""What a training step of one rank costs beyond its FLOPs and its ops' dispatch, measured for the mesh
calibration (:func:`~dpcompile.analysis.calibration.calibrate_mesh`): each byte of weights a micro-batch runs
through, and each forward op a checkpointed block runs again in backward. Both on the calling thread's CPU seconds (the
others' work on shared cores is not counted), the least of interleaved rounds."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["microbatch_weight_seconds_per_byte", "recompute_op_seconds"]


def microbatch_weight_seconds_per_byte(width: int = 256, rows: int = 256, count: int = 4, rounds: int = 8) -> float:
    """Seconds per byte of weights that one more micro-batch costs a stage, beyond its FLOPs and its ops'
    dispatch: an MLP block (``Linear(width, 4 width)``, ReLU, ``Linear(4 width, width)``: 2 MiB of weights at
    256) forward and backward on ``rows`` rows as one micro-batch and as ``count`` (their gradients
    accumulating, as a pipeline stage's do), less the same of a 16-wide block (the same ops: their dispatch),
    per micro-batch more and byte of weights beyond the narrow block's. The main thread's CPU seconds (others'
    work on the shared cores is not counted), the least of ``rounds`` interleaved runs of each; about 0.3 s.

    What it stands for: each micro-batch reads every weight again in forward and backward (out of the core's
    cache), writes its gradient and adds it into ``.grad``. A 4 MiB clone's bytes/s (``copy_bytes_per_s``)
    does not tell it: on a 2-core EPYC VM (load average 4-5) a stage of 4 such blocks cost 3.1-3.3 ms a
    micro-batch more, 2.7-2.8 beyond a 64-wide stage's (0.36-0.38 ms per MiB of the 7.5 MiB more: 16 passes at the
    clone's 44 GB/s, where the model counted 1.7), and this measure read 0.26-0.55 ms per MiB in six runs at load
    average 7 (the median of paired differences read 0.18-0.92: the least of each is steadier;
    ``benchmarks/probe_microbatch_cost.py``)."""

    def block(d: int) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.ReLU(), torch.nn.Linear(4 * d, d))

    with torch.random.fork_rng(devices=[]):  # the caller's generator as it was
        torch.manual_seed(0)
        wide, narrow = block(width), block(16)
        inputs = {wide: torch.randn(rows, width), narrow: torch.randn(rows, 16)}

    def run(module: torch.nn.Module, pieces: int) -> float:
        start = time.thread_time()
        for piece in inputs[module].chunk(pieces):
            module(piece).sum().backward()
        for p in module.parameters():
            p.grad = None
        return time.thread_time() - start

    cases = [(module, pieces) for module in (wide, narrow) for pieces in (1, count)]
    best = dict.fromkeys(cases, float("inf"))
    for r in range(rounds + 1):  # the first a warm-up; interleaved, the least of each kept
        for case in cases:
            seconds = run(*case)
            best[case] = min(best[case], seconds) if r else best[case]
    extra = (best[(wide, count)] - best[(wide, 1)] - best[(narrow, count)] + best[(narrow, 1)]) / (count - 1)
    more_bytes = sum(p.numel() * p.element_size() for p in wide.parameters()) - sum(
        p.numel() * p.element_size() for p in narrow.parameters())  # fmt: skip
    return max(extra, 1e-9) / more_bytes


class _Block(torch.nn.Module):
    """A pre-norm transformer block: causal attention of 4 heads, a GELU MLP."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.fc1, self.fc2 = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, -1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.out(attended)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops += 1
        return func(*args, **(kwargs or {}))


def recompute_op_seconds(rounds: int = 8) -> float:
    """Seconds each forward op of a checkpointed block costs run again in backward: its dispatch, the autograd
    graph it records again, checkpoint's hooks on the tensors it saves (packed in forward, packed again in the
    recompute, unpacked in backward: Python calls, several an op's own cost). A tiny transformer block (width
    32, 2 x 16 tokens: its FLOPs are nothing), traced by ``torch.fx`` as a program runs it, trained plainly and
    under ``dpcompile.runtime.checkpoint``, per ATen op its forward dispatches; about 0.1 s.

    On a 2-core VM at load average 5 it read 27-52 us an op, 2-3.5 of ``op_seconds``; re-predicting two quiet
    runs of ``bench_planner_rank.py`` at any figure from 15 to 40 us ranks every transformer's layouts at
    0.87-0.99, where counting a recompute at half a training op's dispatch ranked Llama's at 0.61."""
    from dpcompile.runtime.recompute import checkpoint

    with torch.random.fork_rng(devices=[]):  # the caller's generator as it was
        torch.manual_seed(0)
        block = fx.symbolic_trace(_Block())
        x = torch.randn(2, 16, 32, requires_grad=True)
    counted = _OpCount()
    with counted:
        block(x)

    def plain() -> None:
        block(x).sum().backward()

    def checkpointed() -> None:
        checkpoint(block, x, undo_writes=False).sum().backward()

    best = {plain: float("inf"), checkpointed: float("inf")}
    for r in range(rounds + 1):  # the first a warm-up
        for run in best:
            seconds = _thread_seconds(run)
            best[run] = min(best[run], seconds) if r else best[run]
    return max(best[checkpointed] - best[plain], 1e-9) / counted.ops


def _thread_seconds(run: Callable[[], None]) -> float:
    start = time.thread_time()
    run()
    return time.thread_time() - start
