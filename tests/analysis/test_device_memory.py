"""The budget plan="auto" plans for without memory_per_device=: the devices' own memory, shared by
the devices on one physical memory."""

from __future__ import annotations

import pytest
import torch

from dpcompile.analysis import device_memory
from dpcompile.errors import ArgumentError


def test_virtual_devices_share_their_physical_memory(monkeypatch):
    monkeypatch.setattr(device_memory, "host_available_bytes", lambda: 3000)
    cpu = torch.device("cpu")
    budgets, words = device_memory.device_memory_budgets([cpu] * 3, ["cpu#0", "cpu#1", "cpu#2"])
    assert budgets == {"cpu#0": 1000, "cpu#1": 1000, "cpu#2": 1000}
    assert words.startswith(device_memory.UNGIVEN_BUDGET_WORDS) and "shared by 3 devices" in words


def test_meminfo_and_the_cgroup_limit_are_read(tmp_path):
    """``MemAvailable`` in kB; a cgroup v2 limit less its usage; "max" is no limit."""
    (tmp_path / "meminfo").write_text("MemTotal:  100 kB\nMemFree:  10 kB\nMemAvailable:  64 kB\n")
    assert device_memory._meminfo_available(tmp_path / "meminfo") == 64 * 1024
    (tmp_path / "memory.max").write_text("5000\n")
    (tmp_path / "memory.current").write_text("1200\n")
    assert device_memory._cgroup_room(tmp_path) == 3800
    (tmp_path / "memory.max").write_text("max\n")
    assert device_memory._cgroup_room(tmp_path) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_device_whose_memory_cannot_be_read_asks_for_a_budget():
    for device in (torch.device("cuda", 0), torch.device("meta")):
        with pytest.raises(ArgumentError, match=f"cannot read for {device}.*give a budget, e.g. memory_per_device="):
            device_memory.usable_memory_bytes(device)


def test_a_gpus_budget_is_its_free_memory_less_a_reserve(monkeypatch):
    """Not the total: what other processes hold is not ours, and the CUDA context and the allocator's
    fragmentation need room; two slots on one GPU share what is left, each GPU read by its own index."""
    gib = 2**30
    free = {0: 40 * gib, 1: 79 * gib}
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (asked.append(i), (free[i], 80 * gib))[1])
    cuda = [torch.device("cuda", 0), torch.device("cuda", 0), torch.device("cuda", 1)]
    budgets, words = device_memory.device_memory_budgets(cuda, ["cuda:0#0", "cuda:0#1", "cuda:1"])
    reserve = device_memory.cuda_reserve_bytes(80 * gib)
    assert reserve == int(4.5 * gib) and sorted(asked) == [0, 1]
    assert budgets == {"cuda:0#0": (40 * gib - reserve) // 2, "cuda:0#1": (40 * gib - reserve) // 2,
                       "cuda:1": 79 * gib - reserve}  # fmt: skip
    assert "cuda:0: free memory (torch.cuda.mem_get_info: 40.00 GiB of 80.00 GiB) less 4.50 GiB kept" in words
    assert "shared by 2 devices" in words


def test_a_gpus_budget_counts_what_this_process_already_holds_there(monkeypatch):
    """The model moved to the GPU before ``transform`` (and the allocator's cached blocks) is not free memory, but it
    is this program's: the plan counts the model's bytes itself, so what this process holds there is added back."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (30 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 6 * gib)
    size, where = device_memory.usable_memory_bytes(torch.device("cuda", 0))
    assert size == 36 * gib - device_memory.cuda_reserve_bytes(80 * gib)
    assert "and the 6.00 GiB this process's allocator holds" in where


def test_ranks_given_a_gpu_each_by_cuda_visible_devices_are_told_apart_by_uuid(monkeypatch):
    """Each rank of a torchrun job launched with one visible GPU per process calls its GPU cuda:0: the key that
    says which ranks share a GPU is its UUID where torch reads one, else the device's name."""
    uuids = iter(["aaaa", "bbbb"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"uuid": next(uuids)})())
    cuda0 = torch.device("cuda", 0)
    assert device_memory.memory_key(cuda0) != device_memory.memory_key(cuda0)  # two processes' views, two GPUs
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: (_ for _ in ()).throw(RuntimeError("no CUDA")))
    assert device_memory.memory_key(cuda0) == "cuda:0" and device_memory.memory_key(torch.device("cpu")) == "cpu"
