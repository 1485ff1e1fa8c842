"""Fake tensors on GPUs this machine lacks: on a machine with one real GPU, a fake tensor on
``cuda:5`` must not touch the real ``cuda:5`` (PyTorch initialises each GPU's context the first time
a fake tensor claims it, which raised "invalid device ordinal" on a one-GPU H200)."""

from __future__ import annotations

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode

import dpcompile.fake


def test_fake_tensors_on_gpus_beyond_the_machine_leave_the_real_ones_alone(monkeypatch):
    initialised = []
    monkeypatch.setattr(dpcompile.fake, "_REAL_GPU_CONTEXT", initialised.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert fake_tensor.init_gpu_context is dpcompile.fake._gpu_context_of_real_devices_only
    fake_tensor.init_gpu_context(torch.device("cuda", 5))
    fake_tensor.init_gpu_context(torch.device("cuda", 0))
    assert initialised == [torch.device("cuda", 0)]


def test_fake_tensors_still_claim_any_gpu():
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(2, 3, device="cuda:7")
        y = x.to("cuda:5") * 2
    assert (x.device, y.device, y.shape) == (torch.device("cuda", 7), torch.device("cuda", 5), (2, 3))
