"""The budget ``plan="auto"`` plans for when no ``memory_per_device=`` is given: the devices' own memory.

    device_memory_budgets(["cuda:0", "cuda:1"])  → ({"cuda:0": 70.6 GiB, "cuda:1": 74.6 GiB},
                                                    "... free memory (torch.cuda.mem_get_info) less a reserve")
    device_memory_budgets(["cpu", "cpu"])        → ({"cpu#0": avail / 2, "cpu#1": avail / 2},
                                                    "the host's available memory ... shared by 2 devices")

A CUDA device's budget is its free memory now (``torch.cuda.mem_get_info(i)``: what other processes
and this one hold already is not ours) less ``cuda_reserve_bytes(total)`` (512 MiB and 5% of the device,
for the CUDA context, cuBLAS/NCCL workspaces and the caching allocator's fragmentation); a CPU device's
is the memory the host has available now (``MemAvailable``, within the cgroup's limit where the process
runs under one). Virtual devices on one physical device share it equally: two
``"cuda:0"`` slots get half of cuda:0 each, and every CPU slot a share of the host's memory.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from dpcompile.errors import ArgumentError

__all__ = ["UNGIVEN_BUDGET_WORDS", "budget_words", "cuda_reserve_bytes", "device_memory_budgets",
           "host_available_bytes", "memory_key", "usable_memory_bytes"]

#: how ``pm.strategies["memory_per_device"]`` and the candidates name a budget that was not given
UNGIVEN_BUDGET_WORDS = "no memory_per_device= given: the devices' own memory"


def _meminfo_available(path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What the cgroup (v2, else v1) still lets this process's group allocate; None without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):  # fmt: skip
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1 spells "no limit" as a huge number
            return None
        return max(int(limit) - usage, 0)
    return None


def host_available_bytes() -> int | None:
    """The bytes this host can still give the process (None where it cannot be told)."""
    available = _meminfo_available()
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            available = None
    room = _cgroup_room()
    known = [b for b in (available, room) if b is not None]
    return min(known) if known else None


def cuda_reserve_bytes(total: int) -> int:
    """What a GPU of ``total`` bytes keeps back from the budget: 512 MiB and 5% of it, for the CUDA
    context, cuBLAS and NCCL workspaces, and the caching allocator's fragmentation (4.5 GiB of 80 GiB)."""
    return 512 * 2**20 + total // 20


def usable_memory_bytes(device: torch.device) -> tuple[int, str]:
    """The memory ``device`` can give the program, and where the figure came from; ``ArgumentError``
    where it cannot be told. ``device`` must name its GPU (``cuda:1``, never ``cuda``): the current
    device is not asked, as a rank that never called ``torch.cuda.set_device`` would read ``cuda:0``'s."""
    why = ""
    if device.type == "cuda":
        if device.index is None:
            raise ArgumentError(f"usable_memory_bytes({device}): name the GPU (cuda:<index>), not the current device")
        try:
            free, total = torch.cuda.mem_get_info(device.index)
        except (RuntimeError, AssertionError) as e:  # no CUDA here, or no such device
            why = f" ({type(e).__name__}: {e})"
        else:
            # what this process's allocator holds (the model moved there before transform, cached blocks) is ours:
            # the plan counts the model's bytes itself
            ours = torch.cuda.memory_reserved(device.index)
            reserve = cuda_reserve_bytes(total)
            held = f", and the {_gib(ours)} this process's allocator holds" if ours else ""
            return max(int(free) + ours - reserve, 0), (
                f"free memory (torch.cuda.mem_get_info: {_gib(free)} of {_gib(total)}{held}) less {_gib(reserve)} kept "
                "for the CUDA context and the allocator's fragmentation:"
            )
    if device.type == "cpu":
        available = host_available_bytes()
        if available is not None:
            return available, "the host's available memory"
    raise ArgumentError(
        f'plan="auto" without memory_per_device= plans for the devices\' own memory, which dpcompile cannot read '
        f"for {device}{why}: give a budget, e.g. memory_per_device=\"24GiB\""
    )


def memory_key(device: torch.device) -> str:
    """The physical memory ``device`` draws on: every CPU slot the host's, a GPU its own (named by its UUID
    where torch reads one: ranks given one GPU each by ``CUDA_VISIBLE_DEVICES`` all call theirs ``cuda:0``)."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda" and device.index is not None:
        try:
            uuid = getattr(torch.cuda.get_device_properties(device.index), "uuid", None)
        except (RuntimeError, AssertionError):
            uuid = None
        if uuid is not None:
            return f"{device} (GPU-{uuid})"
    return str(device)


def device_memory_budgets(devices: Sequence[torch.device], labels: Sequence[str]) -> tuple[dict[str, int], str]:
    """Each slot's share of its physical device's memory (by label), and a sentence saying so."""
    sharing = Counter(memory_key(d) for d in devices)
    usable: dict[str, tuple[int, str]] = {}
    budgets = {}
    for label, device in zip(labels, devices, strict=True):
        key = memory_key(device)
        if key not in usable:
            usable[key] = usable_memory_bytes(device)
        budgets[label] = usable[key][0] // sharing[key]
    return budgets, budget_words(usable, sharing)


def budget_words(usable: dict[str, tuple[int, str]], sharing: Counter) -> str:
    """``UNGIVEN_BUDGET_WORDS`` and, per physical memory, its size, where it was read and how many share it."""
    words = [f"{key}: {source} {_gib(size)}" + (f", shared by {sharing[key]} devices" if sharing[key] > 1 else "")
             for key, (size, source) in usable.items()]  # fmt: skip
    return f"{UNGIVEN_BUDGET_WORDS}: {'; '.join(words)}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
