"""Fake-tensor tools: models and programs that claim to live on devices this machine lacks.

* :func:`fake_copy`: a copy of a model whose tensors are fake (no memory) on a device;
* :class:`FakeCudaOnCpuTorch`: lets a CPU-only torch run the ops it refuses on fake CUDA tensors;
* :func:`fake_devices`: a device list of ``cuda:0..n-1`` that need not exist.

Used to trace variants of tensor-parallel programs without memory, and by ``verify`` to
check the placement of real multi-GPU programs on a machine without GPUs.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from dpcompile.devices import Devices, parse_devices
from dpcompile.runtime.structures import is_fake

__all__ = ["FakeCudaOnCpuTorch", "fake_copy", "fake_copy_to_trace", "fake_devices", "is_fake"]

log = logging.getLogger("dpcompile")

_NO_CUDA = "not linked with support for cuda"


class FakeCudaOnCpuTorch(TorchFunctionMode):
    """Lets a CPU-only torch run the ops it refuses on fake CUDA tensors.

    ``Tensor.contiguous``, indexing (``x[:, -1]``) and ``copy_`` take a CUDA device guard in
    their Python bindings, which a torch built without CUDA cannot give, even for fake
    tensors ("PyTorch is not linked with support for cuda devices"). Such an op is run on CPU
    copies of its fake tensors and the result moved back to their device. Values are fake
    anyway (only shapes, dtypes and devices matter), and an op that mixes CUDA devices still
    fails.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            if _NO_CUDA not in str(e):
                raise
            refused = e
        devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.device.type != "cpu"}
        if len(devices) != 1:
            raise RuntimeError(f"{getattr(func, '__name__', func)}: tensors on {sorted(map(str, devices))}") from refused
        (device,) = devices

        def to_cpu(x: Any) -> Any:
            return x.to("cpu") if isinstance(x, torch.Tensor) and x.device == device else x

        out = func(*tree_map(to_cpu, args), **tree_map(to_cpu, kwargs))
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("__") and args:  # in place (copy_): the tensor itself
            return args[0]
        return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x, out)


def fake_devices(spec: int | Sequence[Any]) -> Devices:
    """``n`` (``cuda:0..n-1``) or a device list, parsed without checking the devices exist."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = [f"cuda:{k}" for k in range(spec)]
    return parse_devices(spec, check_available=False)


def fake_copy(model: nn.Module, mode: Any, device: torch.device) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are fake tensors on ``device``
    (ties kept: a tensor shared by two modules stays one tensor)."""
    with FakeCopyMode(mode):
        fake = copy.deepcopy(model)
    memo: dict[int, torch.Tensor] = {}
    with mode:
        for m in fake.modules():
            for name, p in m._parameters.items():
                if p is not None:
                    if id(p) not in memo:
                        memo[id(p)] = nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
                    m._parameters[name] = memo[id(p)]
            for name, b in m._buffers.items():
                if b is not None:
                    if id(b) not in memo:
                        memo[id(b)] = b.to(device)
                    m._buffers[name] = memo[id(b)]
            if isinstance(m, nn.RNNBase):
                m._init_flat_weights()
    return fake


def fake_copy_to_trace(model: nn.Module, device: torch.device) -> nn.Module | None:
    """A fake-tensor copy of ``model`` (no memory) to trace again for a call that takes another
    path through forward; None where there is no forward to trace or the copy fails."""
    if isinstance(model, fx.GraphModule) or type(model).forward is nn.Module.forward:
        return None
    try:
        return fake_copy(model, FakeTensorMode(allow_non_fake_inputs=True), device)
    except Exception as e:  # noqa: BLE001 - variants are a refinement; the main program stands
        log.debug("no fake copy of the model for variants (%s)", e)
        return None
