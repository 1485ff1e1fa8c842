"""The CUDA paths, checked without a GPU: ``torch.cuda`` functions patched to describe a machine with
several GPUs, and fake tensors claiming ``cuda:k`` (FakeTensorMode raises on an op mixing devices)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dpcompile import planned_mesh
from dpcompile.errors import ArgumentError
from dpcompile.mesh import local_device


def _gpus(monkeypatch, count: int, current: int) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_mesh_rank_that_never_set_its_device_is_refused(monkeypatch):
    """torchrun's LOCAL_RANK=2 on a 4-GPU host, still on cuda:0: refused, naming set_device."""
    _gpus(monkeypatch, 4, 0)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ArgumentError, match=r"LOCAL_RANK=2 but computes on cuda:0.*torch\.cuda\.set_device"):
        local_device(SimpleNamespace(device_type="cuda"))


def test_mesh_rank_computes_on_the_device_it_set(monkeypatch):
    """Its own GPU once set; one visible GPU per rank (CUDA_VISIBLE_DEVICES) is cuda:0 for every rank."""
    mesh = SimpleNamespace(device_type="cuda")
    monkeypatch.setenv("LOCAL_RANK", "2")
    _gpus(monkeypatch, 4, 2)
    assert local_device(mesh) == torch.device("cuda", 2)
    _gpus(monkeypatch, 1, 0)
    assert local_device(mesh) == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "0")
    _gpus(monkeypatch, 4, 0)
    assert local_device(mesh) == torch.device("cuda", 0)


def test_plan_auto_refuses_ranks_of_one_host_on_one_gpu(monkeypatch):
    """No LOCAL_RANK to tell: the gathered ranks' devices show two on cuda:0 of one host; every rank
    refuses alike (it is the gathered list each reads) rather than plan for half a GPU each."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    _gpus(monkeypatch, 2, 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (40 * 2**30, 80 * 2**30))
    mine = []
    monkeypatch.setattr(planned_mesh, "_gathered", lambda value: (mine.append(value), [value, value])[1])
    with pytest.raises(ArgumentError, match=r"ranks \[0, 1\] all compute on cuda:0 of .*set_device"):
        planned_mesh._ranks_own_memory(SimpleNamespace(device_type="cuda"))
    assert mine[0][1] == "cuda:0"
