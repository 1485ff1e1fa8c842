"""How calibration times what it measures, apart from what it measures (:mod:`dpcompile.analysis.calibration`):
a thunk's best and mean seconds, every GPU's queued work waited for around each run, the thread count
fixed for a while, the caller's random generators put back after (and its no_grad, inference or fake modes
left for real tensors with gradients).

    best_seconds(lambda: a @ b)             # the machine at its best: the least of 5 runs, GPUs synchronised
    mean_seconds(lambda: x.clone())         # the machine as it is now: runs filling 0.1 s, load included
    with threads(1), callers_generator_kept(torch.device("cuda", 1)):
        ...                                 # one thread; cuda:1's and the CPU's generators restored after
"""

from __future__ import annotations

import contextlib
import time

import torch

__all__ = ["best_seconds", "callers_generator_kept", "mean_seconds", "synchronize_all", "threads"]


class threads:  # lower case: read as a function, ``with threads(1):``
    """Within the block torch runs ``n`` threads; the count before is put back after."""

    def __init__(self, n: int) -> None:
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.before)


def callers_generator_kept(device: torch.device) -> contextlib.AbstractContextManager:
    """The measures draw random tensors: the caller's generator (``device``'s, ``cuda:1``'s for a measure
    on ``cuda:1``, not the current device's; and the CPU's) is put back after them, so a first plan draws
    what a cached one does; and they run on real tensors with gradients, whatever the caller's modes."""
    on = []
    if device.type == "cuda" and torch.cuda.is_available():
        on = [device.index if device.index is not None else torch.cuda.current_device()]
    stack = contextlib.ExitStack()
    stack.enter_context(torch.random.fork_rng(devices=on))
    # real tensors with gradients, whatever the caller's modes (a plan made under no_grad, inference_mode or a
    # fake mode): the measures train small blocks
    stack.enter_context(torch._subclasses.fake_tensor.unset_fake_temporarily())
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.enable_grad())
    return stack


def best_seconds(run, repeats: int = 5) -> float:  # noqa: ANN001 - a thunk
    """The least seconds of ``repeats`` runs of ``run`` (after one to warm up), each waited for on every GPU."""
    run()  # warm up
    best = float("inf")
    for _ in range(repeats):
        synchronize_all()
        start = time.perf_counter()
        run()
        synchronize_all()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def mean_seconds(run, window: float = 0.1) -> float:  # noqa: ANN001 - a thunk
    """Seconds per run, over as many runs as fill ``window`` seconds: the machine as it is now, its
    load included (a step over a mesh pays every wait for the CPU), where :func:`best_seconds` is
    the machine at its best."""
    run()  # warm up
    count, start = 0, time.perf_counter()
    while True:
        run()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= window:
            return max(elapsed / count, 1e-9)


def synchronize_all() -> None:
    """Every GPU's queued work done: a measure on ``cuda:1`` (or a copy from it to ``cuda:0``) is not
    waited for by ``torch.cuda.synchronize()``, which waits for the current device's alone. Only GPUs
    this process has used (memory reserved there, or the current one): synchronising another would open a
    CUDA context on it, a few hundred MiB of another rank's GPU held for the life of the process."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        current = torch.cuda.current_device()
        for index in range(torch.cuda.device_count()):
            if index == current or torch.cuda.memory_reserved(index) > 0:
                torch.cuda.synchronize(index)
