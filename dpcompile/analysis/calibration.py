"""The cost model's constants, measured on the machine at hand: FLOP/s of a matmul and bytes/s of a
device-to-device copy, from a short run (well under a second), cached per device type and torch version.

Over a mesh of ``n`` gloo processes (:func:`calibrate_mesh`) also: the FLOP/s of one rank's thread,
the seconds of dispatch each forward op of a training step costs (its backward's included), the
latency and bytes/s of a gloo all-reduce between ``n`` ranks and the seconds of one the ranks reach after
computing (a pipeline's transfers cost that latency too; measured between gloo groups on threads of this
process: no process started), the rate at which each rank pages in memory new to it with the others doing
so at once, the seconds each byte of a stage's weights costs one micro-batch and each forward op a checkpointed
block runs again costs (:mod:`dpcompile.analysis.calibration_steps`), and the CPU cores the ranks share; cached per
``n`` as well, measured again where the cores changed. Inside a process group the first rank's
figures are broadcast, so that every rank plans alike.

The cache is a JSON file in ``$DPCOMPILE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/dpcompile``, else
``~/.cache/dpcompile``). ``DPCOMPILE_CALIBRATION=off`` skips both the run and the cache and uses
:data:`REFERENCE` (fixed figures, for tests that need the same numbers everywhere);
``DPCOMPILE_CALIBRATION=fresh`` runs again and rewrites the cache.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from datetime import timedelta
from pathlib import Path

import torch

from dpcompile.analysis.calibration_steps import (
    microbatch_weight_seconds_per_byte as _microbatch_weight_seconds_per_byte,
)
from dpcompile.analysis.calibration_steps import recompute_op_seconds as _recompute_op_seconds
from dpcompile.analysis.timing import best_seconds, callers_generator_kept, mean_seconds, threads

log = logging.getLogger("dpcompile")

__all__ = ["REFERENCE", "Calibration", "cache_path", "cached_mesh", "calibrate", "calibrate_mesh", "reference_mesh"]

#: the cache's format: a file of another version is measured again
CACHE_VERSION = 10  # 10: recompute_op_s; 9: the concurrency, the median of 3 readings; 8: microbatch_weight_s_per_byte; 7: page_in_bytes_per_s (6: no message_s; 5: synced_collective_s, the concurrency on processes)


@dataclass(frozen=True)
class Calibration:
    """``flops_per_s``: a float32 matmul's FLOP/s; ``copy_bytes_per_s``: a device-to-device copy's
    bytes/s; ``source``: ``"measured"``, ``"cache"`` or ``"reference"`` (calibration off).

    Over a mesh (``ranks`` > 1, :func:`calibrate_mesh`): ``flops_per_s`` is one rank's (one
    thread), ``op_seconds`` the dispatch each forward op of a training step costs (its backward's
    included), ``collective_latency_s`` and ``collective_bytes_per_s`` a gloo all-reduce's fixed
    cost and the bytes each rank sends per second, ``cores`` the CPU cores the ranks share,
    ``concurrency`` how many ranks they run at once (measured: less than ``min(ranks, cores)`` where
    other work holds the cores) and ``synced_collective_s`` the seconds a rank spends in an all-reduce
    its ranks reach after computing (a tensor-parallel step's: its peers' threads woken, the peer still
    computing waited for; far more than the back-to-back ``collective_latency_s`` on a busy machine; a
    pipeline's transfers pay it too); ``page_in_bytes_per_s`` the bytes/s of memory new to the process
    (its first touch: the page faults, the kernel zeroing the pages) each rank pages in with every rank
    doing so at once (what GPipe's order pays for the micro-batches a stage holds beyond 1F1B's);
    ``microbatch_weight_s_per_byte`` the seconds one micro-batch's forward and backward cost per byte of the
    weights it runs through, beyond their FLOPs and ops (reading them again, writing and adding their gradient);
    ``recompute_op_s`` the seconds each forward op of a checkpointed block costs run again in backward."""

    flops_per_s: float
    copy_bytes_per_s: float
    device: str = "cpu"
    source: str = "measured"
    ranks: int = 1
    cores: int = 0
    op_seconds: float = 0.0
    collective_latency_s: float = 0.0
    collective_bytes_per_s: float = 0.0
    concurrency: float = 0.0  # how many of the ranks the CPUs run at once (0: as many as the cores allow)
    synced_collective_s: float = 0.0  # an all-reduce after computing (0: the back-to-back collective_latency_s)
    page_in_bytes_per_s: float = 0.0  # memory new to a rank, every rank paging in at once (0: not measured)
    microbatch_weight_s_per_byte: float = 0.0  # a micro-batch's cost per weight byte (0: not measured)
    recompute_op_s: float = 0.0  # a forward op a checkpointed block runs again in backward (0: not measured)


#: what ``DPCOMPILE_CALIBRATION=off`` uses: round figures of one CPU core (50 GFLOP/s, 5 GB/s)
REFERENCE = Calibration(flops_per_s=5e10, copy_bytes_per_s=5e9, device="any", source="reference")


def reference_mesh(ranks: int) -> Calibration:
    """What ``DPCOMPILE_CALIBRATION=off`` uses over a mesh of ``ranks`` processes: :data:`REFERENCE`
    with round gloo figures (20 us a forward op, 100 us and 1 GB/s an all-reduce, after computing too),
    one core a rank, new memory paged in at 1 GB/s."""
    return replace(REFERENCE, ranks=ranks, cores=ranks, op_seconds=2e-5, collective_latency_s=1e-4,
                   collective_bytes_per_s=1e9, concurrency=float(ranks), synced_collective_s=1e-4,
                   page_in_bytes_per_s=1e9)  # fmt: skip


def cache_path(device_type: str) -> Path:
    """Where the calibration of ``device_type`` (``"gloo2"``: a mesh of 2) is cached (see the module's docstring)."""
    root = os.environ.get("DPCOMPILE_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(base) / "dpcompile")
    return Path(root) / f"calibration-{device_type}-torch{torch.__version__.split('+')[0]}.json"


def _setting() -> str:
    return os.environ.get("DPCOMPILE_CALIBRATION", "").lower()


def _off() -> bool:
    return _setting() in ("off", "0", "false", "no")


#: a cache file is a dozen numbers; a larger one is not ours and is measured again, never read
CACHE_MAX_BYTES = 64 * 1024


def _read_cache(path: Path, *, fresh_too: bool = False, **expected: object) -> Calibration | None:
    """The cached calibration at ``path``; None where there is none, it is unreadable (not a JSON
    object of the figures, a figure that is not a finite number of its range, larger than
    :data:`CACHE_MAX_BYTES`), of another format version, was measured where ``expected`` (the
    cores) differs, or ``DPCOMPILE_CALIBRATION`` is ``fresh`` (unless ``fresh_too``: a reader that
    measures nothing)."""
    if (_setting() == "fresh" and not fresh_too) or not path.is_file():
        return None
    try:
        if path.stat().st_size > CACHE_MAX_BYTES:
            raise ValueError(f"larger than {CACHE_MAX_BYTES} bytes")
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        if data.get("version") != CACHE_VERSION or any(data.get(k) != v for k, v in expected.items()):
            log.debug("calibration cache %s is stale: measuring again", path)
            return None
        names = {f.name for f in fields(Calibration)} - {"source"}
        found = Calibration(**{k: data[k] for k in names}, source="cache")
        _check_figures(found)
        return found
    except (ValueError, KeyError, TypeError, OSError, RecursionError) as e:
        log.debug("calibration cache %s unreadable (%s): measuring again", path, e)
        return None


def _check_figures(found: Calibration) -> None:
    """Raises ValueError unless every figure is of its type and range: rates positive, times and
    counts non-negative, all finite (an edited cache would otherwise plan with NaN or divide by 0)."""

    def number(x: object) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    if not (number(found.flops_per_s) and found.flops_per_s > 0 and number(found.copy_bytes_per_s) and found.copy_bytes_per_s > 0):
        raise ValueError(f"rates {found.flops_per_s!r} FLOP/s, {found.copy_bytes_per_s!r} B/s: expected positive numbers")
    rest = (found.op_seconds, found.collective_latency_s, found.collective_bytes_per_s, found.concurrency,
            found.synced_collective_s, found.page_in_bytes_per_s, found.microbatch_weight_s_per_byte,
            found.recompute_op_s)  # fmt: skip
    if not all(number(x) and x >= 0 for x in rest):
        raise ValueError(f"figures {rest!r}: expected non-negative numbers")
    if not isinstance(found.device, str) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= low for n, low in ((found.ranks, 1), (found.cores, 0))
    ):  # fmt: skip
        raise ValueError(f"device {found.device!r}, ranks {found.ranks!r}, cores {found.cores!r}")


def _write_cache(path: Path, measured: Calibration) -> None:
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {k: v for k, v in asdict(measured).items() if k != "source"}
        staging.write_text(json.dumps({**data, "version": CACHE_VERSION}))
        staging.replace(path)
    except OSError as e:  # a read-only home, a folder at its name: the figures still hold for this process
        log.debug("cannot cache the calibration at %s: %s", path, e)
        try:
            staging.unlink(missing_ok=True)  # never a file per process left behind
        except OSError:
            pass


def calibrate(device: torch.device | str = "cpu") -> Calibration:
    """The constants for ``device``'s type: from the cache, else measured now and cached."""
    device = torch.device(device)
    if _off():
        return REFERENCE
    path = cache_path(device.type)
    cached = _read_cache(path)
    if cached is not None:
        return cached
    with callers_generator_kept(device):
        measured = Calibration(_matmul_flops_per_s(device), _copy_bytes_per_s(device), device.type, "measured")
    _write_cache(path, measured)
    return measured


def calibrate_mesh(ranks: int) -> Calibration:
    """The constants of a mesh of ``ranks`` gloo processes on this machine's CPUs: from the cache
    (where the cores are the same), else measured now and cached. In an initialized process group
    the first rank's figures, broadcast to the others: every rank of the group calls it."""
    if _off():
        return reference_mesh(ranks)
    grouped = torch.distributed.is_available() and torch.distributed.is_initialized()
    if grouped and torch.distributed.get_rank() != 0:
        return _agree(None, ranks)
    cores = available_cores()
    path = cache_path(f"gloo{ranks}")
    found = _read_cache(path, cores=cores)
    if found is None:
        with threads(1), callers_generator_kept(torch.device("cpu")):  # a rank's compute: one thread, as torchrun's
            # the concurrency read three times, between the other measures: a burst of other work lasting a
            # second moves one reading, not their median (one reading of 0.3 s cached 1.2 on a quiet 2-core VM
            # that ran the ranks at 1.6-2.0, and the rank benchmark's order with it)
            at_once = [_concurrency(min(ranks, cores))]
            flops, ops, copy = _rank_flops_per_s(), _op_seconds(), _rank_copy_bytes_per_s()
            at_once.append(_concurrency(min(ranks, cores)))
            page_in = _page_in_bytes_per_s(min(ranks, cores))
            weights = _microbatch_weight_seconds_per_byte()
            recompute = _recompute_op_seconds()
            at_once.append(_concurrency(min(ranks, cores)))
        try:
            latency, bandwidth = _gloo_all_reduce(ranks)
            with threads(1), callers_generator_kept(torch.device("cpu")):
                synced = _gloo_synced_seconds(ranks)
        except RuntimeError as e:  # no loopback gloo here (a host name that does not resolve): round figures
            log.warning("cannot time gloo (%s): the cost model uses %s", e, "100 us and 1 GB/s")
            ref = reference_mesh(ranks)
            latency, bandwidth, synced = ref.collective_latency_s, ref.collective_bytes_per_s, ref.synced_collective_s
        found = Calibration(flops, copy, "cpu", "measured", ranks, cores, ops, latency, bandwidth,
                            statistics.median(at_once), synced, page_in, weights, recompute)  # fmt: skip
        _write_cache(path, found)
    return _agree(found, ranks) if grouped else found


def cached_mesh(ranks: int, *, agree: bool = False) -> Calibration:
    """The constants of a mesh of ``ranks`` gloo processes without measuring anything: the cache
    :func:`calibrate_mesh` wrote where it holds (the same cores; ``DPCOMPILE_CALIBRATION=fresh`` too:
    nothing is measured here), else :func:`reference_mesh` (so too with ``DPCOMPILE_CALIBRATION=off``).
    ``agree`` in an initialized process group: the first rank's, broadcast (every rank of the group
    calls it)."""
    if _off():
        return reference_mesh(ranks)
    grouped = agree and torch.distributed.is_available() and torch.distributed.is_initialized()
    if grouped and torch.distributed.get_rank() != 0:
        return _agree(None, ranks)
    found = _read_cache(cache_path(f"gloo{ranks}"), fresh_too=True, cores=available_cores()) or reference_mesh(ranks)
    return _agree(found, ranks) if grouped else found


def available_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


#: the figures rank 0 broadcasts (every number a rank does not know itself)
_NUMBERS = tuple(f.name for f in fields(Calibration) if f.name not in ("device", "source", "ranks"))


def _agree(mine: Calibration | None, ranks: int) -> Calibration:
    """Rank 0's ``mine``, on every rank of the default process group."""
    from dpcompile.runtime.rank_device import group_device  # the GPU under NCCL, which refuses CPU tensors

    values = torch.tensor([float(getattr(mine, k)) for k in _NUMBERS] if mine else [0.0] * len(_NUMBERS),
                          dtype=torch.float64, device=group_device())  # fmt: skip
    torch.distributed.broadcast(values, src=0)
    if mine is not None:
        return mine
    got = dict(zip(_NUMBERS, values.tolist()))
    got["cores"] = int(got["cores"])
    return Calibration(device="cpu", source="rank 0", ranks=ranks, **got)


def _matmul_flops_per_s(device: torch.device) -> float:
    n = 512 if device.type == "cpu" else 2048
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    return 2 * n**3 / best_seconds(lambda: a @ b)


def _copy_bytes_per_s(device: torch.device) -> float:
    """A copy from ``device`` to the next device of its type (to itself where there is one)."""
    other = device
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        other = torch.device("cuda", ((device.index or 0) + 1) % torch.cuda.device_count())
    x = torch.randn(4 * 2**20 // 4, device=device)  # 4 MiB
    return x.numel() * x.element_size() / best_seconds(lambda: x.to(other, copy=True))


def _rank_flops_per_s(n: int = 256) -> float:
    """One rank's float32 matmul FLOP/s (``n x n`` products, load included)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / mean_seconds(lambda: a @ b)


#: a worker process of :func:`_concurrency`: per line read (seconds), how many chunks of a busy loop it ran in them
_BUSY_LOOP = """import sys, time
for line in sys.stdin:
    stop, count = time.perf_counter() + float(line), 0
    while time.perf_counter() < stop:
        for _ in range(200):
            pass
        count += 1
    print(count, flush=True)
"""


def _concurrency(workers: int, window: float = 0.6, rounds: int = 6) -> float:
    """How many of ``workers`` processes computing at once the CPUs run side by side: their busy
    loops' throughput over one process's (between 1 and ``workers``; load included), the median over
    ``rounds`` of one process alone then all of them, each a ``window / (2 rounds)``: a burst of other
    work during one of them moves one ratio, not the figure.

    Processes, as the ranks are (plain Python, no torch: each starts in tens of milliseconds): threads
    of this process read 1.0-2.0 at random under load, where 2 processes' matmuls then ran 1.8x one
    process's (load average 18, 2 cores; ``benchmarks/probe_tp_waits.py --concurrency``). Where no
    process can be started, :func:`_thread_concurrency`."""
    if workers <= 1:
        return 1.0
    span = window / (2 * rounds)
    try:
        procs = [subprocess.Popen([sys.executable, "-c", _BUSY_LOOP], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True) for _ in range(workers)]  # fmt: skip
    except OSError as e:
        log.debug("cannot start a process to measure the concurrency (%s): threads instead", e)
        return _thread_concurrency(workers)
    try:

        def burst(k: int) -> int:
            for p in procs[:k]:
                p.stdin.write(f"{span}\n")
                p.stdin.flush()
            return sum(int(p.stdout.readline()) for p in procs[:k])

        burst(workers)  # warm up
        ratios = []
        for _ in range(rounds):
            alone = burst(1)
            ratios.append(burst(workers) / max(alone, 1))
    except (OSError, ValueError) as e:  # a worker died (a count not read)
        log.debug("a process measuring the concurrency failed (%s): threads instead", e)
        return _thread_concurrency(workers)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return _median_in(ratios, workers)


def _median_in(ratios: list[float], workers: int) -> float:
    ratios = sorted(ratios)
    median = (ratios[(len(ratios) - 1) // 2] + ratios[len(ratios) // 2]) / 2
    return min(max(median, 1.0), float(workers))


def _thread_concurrency(workers: int, n: int = 384, window: float = 0.1, rounds: int = 4) -> float:
    """How many of ``workers`` threads computing at once the CPUs run side by side: their matmuls'
    throughput over one thread's (between 1 and ``workers``; one thread each, load included), the
    median over ``rounds`` of one thread alone then all of them, each a ``window / (2 rounds)``: a
    burst of other work during one of them moves one ratio, not the figure. The products are large
    enough (``n x n``: about a millisecond) that a thread seldom holds the GIL: ranks are processes,
    and threads queueing for the GIL behind one the load preempted would read as CPUs that run
    fewer ranks at once (measured under load: 1.0, the floor, where the ranks then ran side by
    side)."""
    if workers <= 1:
        return 1.0
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up
    span = window / (2 * rounds)

    def count_for(threads: int) -> float:
        done = [0] * threads
        stop = time.perf_counter() + span

        def work(rank: int) -> None:
            while True:
                a @ b  # noqa: B018 - the matmul is the work (it releases the GIL)
                done[rank] += 1
                if time.perf_counter() >= stop:
                    return

        start = time.perf_counter()
        _on_threads(work, threads)
        return sum(done) / (time.perf_counter() - start)  # matmuls a second

    ratios = []
    for _ in range(rounds):
        alone = count_for(1)
        ratios.append(count_for(workers) / alone)
    return _median_in(ratios, workers)


def _rank_copy_bytes_per_s() -> float:
    """The bytes/s one rank's memory-bound op writes (a 4 MiB copy, load included)."""
    x = torch.randn(2**20)
    return x.numel() * x.element_size() / mean_seconds(lambda: x.clone())


def _page_in_bytes_per_s(workers: int, size: int = 40 << 20, rounds: int = 3) -> float:
    """Bytes/s of memory new to the process that each of ``workers`` threads pages in (its first touch: a
    page fault and the kernel zeroing the page), all of them at once, as a pipeline's ranks do: a
    ``size`` tensor (above glibc's largest mmap threshold, 32 MiB: always new memory) filled, less
    filling one already touched; the median over ``rounds`` and the threads.

    Not the copy bytes/s: on a 2-core VM a 4 MiB clone ran at 13-40 GB/s, new memory at 0.7-2.5 GB/s
    alone and 0.35-1.8 GB/s each with two threads at once (load averages 2-11; two processes' fills of
    new memory: 0.75-0.97 GB/s at load 5), where two threads' fills of touched memory did not slow each
    other."""
    workers = max(1, workers)
    numel = size // 4
    touched = [torch.ones(numel) for _ in range(workers)]
    seconds: list[float] = []

    def run(rank: int) -> None:
        for _ in range(rounds):
            start = time.perf_counter()
            torch.empty(numel).fill_(1.0)
            fresh = time.perf_counter() - start
            start = time.perf_counter()
            touched[rank].fill_(1.0)
            seconds.append(max(fresh - (time.perf_counter() - start), 1e-9))

    _on_threads(run, workers)
    seconds.sort()
    return size / seconds[len(seconds) // 2]


def _op_seconds(ops: int = 64) -> float:
    """Seconds per forward op of a training step on tensors too small to compute anything: ``ops``
    pointwise ops forward, then their backward (load included)."""
    x = torch.ones(4, 4, requires_grad=True)

    def step() -> None:
        h = x
        for _ in range(ops):
            h = h * 1.5
        h.sum().backward()

    return mean_seconds(step) / (ops + 1)


def _gloo_all_reduce(ranks: int, large: int = 1 << 20) -> tuple[float, float]:
    """``(latency s, bytes/s each rank sends)`` of a gloo all-reduce among ``ranks`` groups on
    threads of this process (a tiny tensor's mean time; a 4 MiB tensor's ring bytes over its mean
    time less that)."""
    from torch.distributed import HashStore, ProcessGroupGloo

    store = HashStore()
    groups: list = [None] * ranks
    seconds: dict[tuple[int, int], float] = {}

    def join(rank: int) -> None:
        groups[rank] = ProcessGroupGloo(store, rank, ranks, timedelta(seconds=60))

    def reduce(rank: int, numel: int, repeats: int) -> None:
        x = torch.ones(numel)
        groups[rank].allreduce([x]).wait()  # warm up
        start = time.perf_counter()
        for _ in range(repeats):
            groups[rank].allreduce([x]).wait()
        seconds[(rank, numel)] = (time.perf_counter() - start) / repeats  # the mean: every wait for the CPU counts

    _on_threads(join, ranks)
    _on_threads(lambda r: reduce(r, 1, 200), ranks)
    _on_threads(lambda r: reduce(r, large, 10), ranks)
    latency = max(seconds[(r, 1)] for r in range(ranks))
    big = max(seconds[(r, large)] for r in range(ranks))
    sent = 2 * (ranks - 1) / ranks * large * 4
    return latency, sent / max(big - latency, 1e-9)


def _gloo_synced_seconds(ranks: int, work_s: float = 1e-3, calls: int = 24) -> float:
    """Seconds a rank spends in each gloo all-reduce (of a few floats) that ends ``work_s`` of computing,
    as a tensor-parallel step's do: ``ranks`` gloo groups on threads of this process, each computing
    (matmuls, the GIL released) then reducing, ``calls`` times; the mean over the calls and ranks.

    Back to back (:func:`_gloo_all_reduce`) a call finds its peers' threads awake; after computing, each
    call waits for the peers' gloo threads to be woken and scheduled, and for the peer still computing
    (the ranks' computing drifts apart where the CPUs are shared): in tensor-parallel steps over 2
    processes, 2.4 ms a call at load average 2 and 5-9 ms at 8-16, where back to back one takes
    0.1-0.4 ms (``benchmarks/probe_tp_waits.py``)."""
    from torch.distributed import HashStore, ProcessGroupGloo

    store = HashStore()
    groups: list = [None] * ranks
    waited = [0.0] * ranks
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    products = max(1, round(work_s / best_seconds(lambda: a @ b)))

    def join(rank: int) -> None:
        groups[rank] = ProcessGroupGloo(store, rank, ranks, timedelta(seconds=60))

    def steps(rank: int) -> None:
        x = torch.ones(16)
        groups[rank].allreduce([x]).wait()  # warm up
        for _ in range(calls):
            for _ in range(products):
                a @ b  # noqa: B018 - the computing between the calls
            start = time.perf_counter()
            groups[rank].allreduce([x]).wait()
            waited[rank] += time.perf_counter() - start

    _on_threads(join, ranks)
    _on_threads(steps, ranks)
    return max(sum(waited) / (ranks * calls), 1e-9)


def _on_threads(run, ranks: int) -> None:  # noqa: ANN001 - run(rank)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
