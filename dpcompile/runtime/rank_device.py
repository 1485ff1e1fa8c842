"""The device this process computes on, and the one a process group's collectives take their tensors on.

A tensor a collective is given must be on the group's device: a flag, a count or a length made with
``torch.tensor([...])`` lives on the CPU, which an NCCL group (``init_process_group("nccl")``) refuses
("No backend type associated with device type cpu")::

    before: flag = torch.tensor([1.0]);                            dist.all_reduce(flag, group=g)
    after:  flag = torch.tensor([1.0], device=group_device(g));    dist.all_reduce(flag, group=g)
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist


def process_device(kind: str) -> torch.device:
    """This process's current device of ``kind`` (its GPU: ``cuda:2`` on torchrun's ``LOCAL_RANK=2``). Where
    it is likely another rank's, a warning says so: ``LOCAL_RANK=k`` (k > 0 of several visible GPUs) while the
    current device is still ``cuda:0``, as when the rank never called ``torch.cuda.set_device`` (CUDA used
    before the ``DeviceMesh`` was built, which then leaves the device alone). Not refused: a rank shown two
    GPUs of its own (``CUDA_VISIBLE_DEVICES=2,3``) computes on its ``cuda:0`` rightly; ``plan="auto"`` refuses
    ranks that share a GPU, having gathered every rank's (by its UUID).

    >>> process_device("cuda")  # doctest: +SKIP  (torchrun, LOCAL_RANK=1, torch.cuda.set_device(1) called)
    device(type='cuda', index=1)
    """
    module = getattr(torch, kind, None)
    if module is None or not hasattr(module, "current_device"):
        return torch.device(kind)
    current = module.current_device()
    local_rank = os.environ.get("LOCAL_RANK", "")
    count = module.device_count() if hasattr(module, "device_count") else 0
    if local_rank.isdigit() and count > 1 and current == 0 and int(local_rank) % count != 0 and local_rank not in _WARNED:
        _WARNED.add(local_rank)
        warnings.warn(
            f"this process has LOCAL_RANK={local_rank} but computes on {kind}:0 ({kind}.current_device()), which "
            f"is the first rank's {kind} device unless this rank was given GPUs of its own: if not, call "
            f"torch.{kind}.set_device(int(os.environ['LOCAL_RANK'])) at the start of the script, before any {kind} "
            "work and before building the DeviceMesh",
            stacklevel=3,
        )
    return torch.device(kind, current)


_WARNED: set[str] = set()


def group_device(group: Any = None) -> torch.device:
    """Where ``group``'s collectives (the default group's: None) take their tensors: this process's GPU
    for NCCL, else the CPU (gloo; a group of both backends takes CPU tensors through gloo)."""
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return process_device("cuda")
    return torch.device("cpu")


__all__ = ["group_device", "process_device"]
