"""Spawned gloo process groups for the tests of programs over a mesh: start ``world`` processes
running ``entry(rank, world, port, *args, results)``, collect one ``(rank, outcome)`` report per
rank within a bounded time, and never leave a process behind (but the fork server they start from,
which ends with the test process)."""

from __future__ import annotations

import json
import os
import queue
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: what the fork server imports once, so that each rank does not (``tests/gloo_rank_imports.py``)
RANK_IMPORTS = "tests.gloo_rank_imports"

#: programs the fork server captures once for every rank to copy (``export_for_ranks`` of the mesh
#: tests), keyed by test file and shapes. Here, not in the test file: pytest imports a test file
#: under its own name (``test_exact_random_mesh``, its folder on ``sys.path``) and the ranks unpickle
#: their checks from that module, while the fork server imports it as ``tests.integration....``:
#: two module objects, so a dict in the test file filled by the fork server is never the one the
#: ranks read. This module has one name everywhere.
CAPTURED: dict[tuple, Any] = {}

#: the environment variable naming the file where a test process asks its fork server to prepare
#: (``run_spawned(prepare=...)``); the fork server inherits it when it starts
PREPARE_REQUESTS_ENV = "DPCOMPILE_TEST_FORK_SERVER_REQUESTS"


def rank_context():
    """The multiprocessing context the ranks start from: a fork server (a clean process, started
    once per test process, that has imported torch, dpcompile and transformers) instead of a fresh
    interpreter per rank; each rank is a fork of that server, as independent as a spawned one."""
    os.environ[PREPARE_REQUESTS_ENV] = os.path.join(tempfile.gettempdir(), f"dpcompile-fork-server-{os.getpid()}.json")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([RANK_IMPORTS])
    return ctx


def run_spawned(entry: Callable[..., None], world: int, *args: Any, timeout: float,
                prepare: Sequence[str] = ()) -> dict[int, Any]:
    """Each rank's report (what ``entry`` put on its last argument, a queue); a rank that hung or
    crashed is missing from the result. ``prepare``: ``"module:function"`` names the fork server calls
    once, in itself, before it forks these ranks (each fills ``CAPTURED`` with programs the ranks copy
    instead of each capturing them again); a test process pays only for what its groups ask for."""
    ctx = rank_context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=entry, args=(r, world, port, *args, results), daemon=True) for r in range(world)]
    requests = os.environ[PREPARE_REQUESTS_ENV]
    with open(requests, "w") as f:  # read by the fork server as it forks each rank (gloo_rank_imports)
        json.dump(list(prepare), f)
    try:
        for p in procs:
            p.start()
    finally:
        os.remove(requests)
    outcomes: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world and time.monotonic() < deadline:
            try:
                rank, outcome = results.get(timeout=1.0)
                outcomes[rank] = outcome
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return outcomes


def run_checks(rank: int, world: int, port: int, checks: list[tuple[str, Callable[[], None]]], results: Any) -> None:
    """A spawned rank's body: join the gloo group, run each ``(name, check)`` and put ``(rank,
    {name: None or the traceback})`` on ``results``; the group is torn down whatever happened."""
    import os
    import traceback
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    outcome: dict[str, str | None] = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))  # fmt: skip
        for name, check in checks:
            try:
                check()
                outcome[name] = None
            except Exception:  # noqa: BLE001 - report every check
                outcome[name] = traceback.format_exc()
    except Exception:  # noqa: BLE001
        outcome["<setup>"] = traceback.format_exc()
    results.put((rank, outcome))
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def assert_group_passed(outcomes: dict[int, Any], world: int, *names: str, timeout: float | None = None) -> None:
    """Every rank of ``world`` reported, its setup passed, and each named check ran and passed on
    every rank; otherwise one failure listing each rank's traceback."""
    missing = [r for r in range(world) if r not in outcomes]
    within = f" within {timeout} s" if timeout is not None else ""
    assert not missing, f"ranks {missing} of {world} reported nothing{within} (hang or crash)"
    errors = []
    for rank in range(world):
        found = outcomes[rank]
        if found.get("<setup>") is not None:
            errors.append(f"rank {rank}, setup:\n{found['<setup>']}")
        for name in names:
            if name not in found:
                errors.append(f"rank {rank}: {name} did not run")
            elif found[name] is not None:
                errors.append(f"rank {rank}, {name}:\n{found[name]}")
    assert not errors, "\n".join(errors)
