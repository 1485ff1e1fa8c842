"""The CUDA paths, checked without a GPU: ``torch.cuda`` functions patched to describe a machine with
several GPUs, and fake tensors claiming ``cuda:k`` (FakeTensorMode raises on an op mixing devices)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from dpcompile import planned_mesh
from dpcompile.errors import ArgumentError
from dpcompile.mesh import local_device


def _gpus(monkeypatch, count: int, current: int) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_mesh_rank_that_never_set_its_device_is_warned(monkeypatch):
    """torchrun's LOCAL_RANK=2 on a 4-GPU host, still on cuda:0: a warning naming set_device (not a refusal: a
    rank given GPUs of its own by CUDA_VISIBLE_DEVICES=2,3 computes on its cuda:0 rightly)."""
    from dpcompile.runtime import rank_device

    monkeypatch.setattr(rank_device, "_WARNED", set())
    _gpus(monkeypatch, 4, 0)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.warns(UserWarning, match=r"LOCAL_RANK=2 but computes on cuda:0.*torch\.cuda\.set_device"):
        assert local_device(SimpleNamespace(device_type="cuda")) == torch.device("cuda", 0)


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


def _fake_gpus_fsdp_forward(monkeypatch, devices: list[str], **layout) -> tuple[torch.Tensor, set]:
    """A one-process FSDP program over fake ``devices`` run forward (no grad: autograd on fake CUDA
    tensors aborts a CPU-only torch); FakeTensorMode raises on any op mixing devices. Returns the output
    and each gather's ``(devices of its pieces, device of the whole)``."""
    import warnings

    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode

    import dpcompile
    from dpcompile.fake import FakeCudaOnCpuTorch, fake_copy
    from dpcompile.modules.fsdp_gather import GatherShards

    _gpus(monkeypatch, 8, 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gathers = set()
    forward = GatherShards.forward

    def recorded(self, *pieces):
        whole = forward(self, *pieces)
        gathers.add((tuple(str(p.device) for p in pieces), str(whole.device)))
        return whole

    monkeypatch.setattr(GatherShards, "forward", recorded)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = fake_copy(model, mode, torch.device(devices[0]))
    with mode, FakeCudaOnCpuTorch(), torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        pm = dpcompile.transform(fake, devices, data_parallel="fsdp", **layout)
        out = pm(torch.empty(6, 8, device=devices[0]))
    return out, gathers


def test_fsdp_copies_on_distinct_gpus_gather_and_compute_each_on_its_own(monkeypatch):
    """Each copy gathers every parameter on its own GPU from the pieces themselves (FSDP's all-gather),
    and computes there: before, copy 1's replica read copy 0's gather, on cuda:0 (a mixed-device op)."""
    out, gathers = _fake_gpus_fsdp_forward(monkeypatch, ["cuda:0", "cuda:1", "cuda:2"])
    assert (out.device, tuple(out.shape)) == (torch.device("cuda", 0), (6, 4))
    assert gathers == {(("cuda:0", "cuda:1", "cuda:2"), f"cuda:{r}") for r in range(3)}


def test_fsdp_copies_of_a_pipeline_on_distinct_gpus_gather_each_on_its_own(monkeypatch):
    """pp x dp: each stage's pieces lie on that stage's devices of the copies, each gathered on each."""
    out, gathers = _fake_gpus_fsdp_forward(monkeypatch, [f"cuda:{k}" for k in range(4)], mesh={"pp": 2, "dp": 2})
    assert out.device == torch.device("cuda", 0)
    assert gathers == {(("cuda:0", "cuda:1"), "cuda:0"), (("cuda:0", "cuda:1"), "cuda:1"),
                       (("cuda:2", "cuda:3"), "cuda:2"), (("cuda:2", "cuda:3"), "cuda:3")}  # fmt: skip


def test_calibration_waits_for_every_gpu_it_used(monkeypatch):
    """A measure on cuda:1 (current device cuda:0) is timed after cuda:1's work is done, and its copy
    to cuda:0 after both: ``torch.cuda.synchronize()`` alone waits for the current device's. A GPU this
    process never used (cuda:2: nothing reserved there) is left alone: synchronising it would open a context."""
    from dpcompile.analysis import timing

    _gpus(monkeypatch, 3, 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: {0: 0, 1: 2**20, 2: 0}[i])
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    timing.synchronize_all()
    assert waited == [0, 1]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # no CUDA work yet: nothing to wait for
    timing.synchronize_all()
    assert waited == [0, 1]


def test_calibration_keeps_the_measured_gpus_generator(monkeypatch):
    """Measuring on cuda:1 draws from cuda:1's generator: that one is kept and put back, not cuda:0's."""
    from dpcompile.analysis import timing

    _gpus(monkeypatch, 2, 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    forked = []
    monkeypatch.setattr(torch.random, "fork_rng", lambda devices: forked.append(list(devices)) or contextlib.nullcontext())
    timing.callers_generator_kept(torch.device("cuda", 1))
    timing.callers_generator_kept(torch.device("cpu"))
    assert forked == [[1], []]


class _Posted(Exception):
    """Raised by a patched collective once it has recorded the device of the tensor it was given."""


def test_an_nccl_groups_tensors_go_on_the_ranks_gpu(monkeypatch):
    """NCCL takes tensors on this rank's GPU (refusing CPU ones), gloo on the CPU."""
    import torch.distributed as dist

    from dpcompile.runtime.rank_device import group_device

    _gpus(monkeypatch, 2, 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert group_device() == torch.device("cuda", 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert group_device() == torch.device("cpu")


@pytest.mark.parametrize("site", ["sequence_sizes", "checkpoint_signal", "causal_check", "pipeline_steps"])
def test_flags_and_lengths_exchanged_over_a_group_are_made_on_its_device(monkeypatch, site):
    """Context parallel's sequence lengths, a checkpoint's failure flag, the balanced attention's causal
    check and a pipeline's step count over dp are made on ``group_device`` (this rank's GPU under NCCL,
    which refuses CPU tensors: "No backend type associated with device type cpu"), not on the CPU.
    The group's device is ``meta`` here, to tell it from the CPU; the collective records and stops."""
    import torch.distributed as dist

    from dpcompile.checkpoint import dtensors
    from dpcompile.modules import mesh_pipeline
    from dpcompile.runtime import distributed, sequence_balance

    for module in (distributed, dtensors, mesh_pipeline, sequence_balance):
        monkeypatch.setattr(module, "group_device", lambda group=None: torch.device("meta"), raising=False)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    posted = []

    def collective(tensor_or_list, *args, **kwargs):
        posted.append((args[0] if isinstance(tensor_or_list, list) else tensor_or_list).device)
        raise _Posted

    for name in ("all_reduce", "all_gather"):
        monkeypatch.setattr(dist, name, collective)
    with pytest.raises(_Posted):
        if site == "sequence_sizes":
            distributed.sequence_sizes(7, None)
        elif site == "checkpoint_signal":
            dtensors.signal(False)
        elif site == "causal_check":
            q = torch.zeros(1, 1, 4, 2)
            sequence_balance.balanced_attention_over_group(q, q, q, None, 2, [4, 4], mask=torch.ones(4, 8, dtype=torch.bool),
                                                           must_balance="cp")  # fmt: skip
        else:
            pm = SimpleNamespace(dp_group=object(), fsdp=object(), _ddp_options=None)
            mesh_pipeline._steps_alike_over_dp(pm, [(2, 1)])
    assert posted == [torch.device("meta")]


def test_copies_from_a_gpu_to_the_cpu_block(monkeypatch):
    """A gather onto ``output_device="cpu"``, an output moved there and a scatter including the CPU copy
    GPU memory to the CPU blocking: ``to("cpu", non_blocking=True)`` hands back pinned memory the copy
    may not have filled, which ``cat`` (or the user) would read unsynchronised. Onto GPUs: asynchronous."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dpcompile.fake import FakeCudaOnCpuTorch
    from dpcompile.runtime import comm

    copies = []
    to = torch.Tensor.to

    def recorded(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        copies.append((str(self.device), str(out.device), kwargs.get("non_blocking", False)))
        return out

    monkeypatch.setattr(torch.Tensor, "to", recorded)
    with FakeTensorMode(allow_non_fake_inputs=True), FakeCudaOnCpuTorch():
        parts = [torch.empty(2, 3, device="cuda:0"), torch.empty(2, 3, device="cuda:1")]
        assert comm.gather(parts, 0, "cpu").shape == (4, 3)
        comm.to_device(parts[1], "cpu")
        comm.scatter(torch.empty(4, 3, device="cuda:0"), ["cuda:0", "cpu"])
        comm.broadcast(parts[0], ["cuda:0", "cuda:1"])
    assert {c for c in copies if c[1] == "cpu"} == {("cuda:0", "cpu", False), ("cuda:1", "cpu", False)}
    assert ("cuda:0", "cuda:1", True) in copies
