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
from torch._subclasses import fake_tensor as _fake_tensor
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from dpcompile.devices import Devices, parse_devices
from dpcompile.errors import ArgumentError
from dpcompile.progress import step_bar
from dpcompile.runtime.structures import is_fake

__all__ = [
    "FakeCudaOnCpuTorch", "fake_copy", "fake_copy_to_trace", "fake_devices", "has_meta_tensors", "is_fake",
    "is_placeholder", "materialize",
]  # fmt: skip

log = logging.getLogger("dpcompile")


def _copy_storage_weak_refs_as_themselves() -> None:
    """``copy.deepcopy`` of a fake tensor copies its ``FakeTensorMode``, and with it the mode's map of
    constants, keyed by ``StorageWeakRef``: torch copies each key as a second object holding the same
    raw weak pointer, and both release it when freed. The storage's memory is freed while a weak count
    is still held, and the last release writes into whatever reuses it: heap corruption, a crash much
    later ("corrupted double-linked list"; a meta-built pipeline over a mesh hit it in its shape run).
    A weak reference is immutable, so a copy is the reference itself, as ``copy`` does for
    ``weakref.ref``::

        before: deepcopy(fake) -> two StorageWeakRef(cdata=X) -> X's weak count released twice
        after:  deepcopy(fake) -> one StorageWeakRef(cdata=X), shared by both modes' maps
    """
    from torch.multiprocessing.reductions import StorageWeakRef

    if "__deepcopy__" not in vars(StorageWeakRef):
        StorageWeakRef.__copy__ = lambda self: self  # type: ignore[method-assign]
        StorageWeakRef.__deepcopy__ = lambda self, memo: self  # type: ignore[method-assign]


_copy_storage_weak_refs_as_themselves()

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


_REAL_GPU_CONTEXT = _fake_tensor.init_gpu_context


def _gpu_context_of_real_devices_only(device: torch.device) -> None:
    """A fake tensor first made on ``device`` initialises that GPU's real context (so that its
    backward finds one). ``cuda:5`` on a machine with one GPU raises "invalid device ordinal"
    there (seen on an H200), and a fake tensor never runs a kernel: skip the GPUs this machine lacks."""
    if device.type == "cuda" and device.index is not None and torch.cuda.is_available():
        if device.index >= torch.cuda.device_count():
            return None
    return _REAL_GPU_CONTEXT(device)


_fake_tensor.init_gpu_context = _gpu_context_of_real_devices_only


def fake_devices(spec: int | Sequence[Any]) -> Devices:
    """``n`` (``cuda:0..n-1``) or a device list, parsed without checking the devices exist."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 1:
            raise ArgumentError(f"fake_devices={spec}: expected a positive number of fake GPUs (cuda:0..n-1), or a device list")
        spec = [f"cuda:{k}" for k in range(spec)]
    try:
        return parse_devices(spec, check_available=False)
    except ArgumentError as e:
        raise ArgumentError(f"fake_devices={spec!r}: {e}") from None


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


def meta_copy_to_pickle(model: nn.Module) -> nn.Module | None:
    """A deep copy of a fake-tensor ``model`` (:func:`fake_copy_to_trace`'s) with each parameter and
    buffer on meta, which pickle writes (a fake tensor holds its mode, which it cannot); ties kept.
    None where the copy fails or still holds fake tensors (in plain attributes)."""
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    try:
        copied = copy.deepcopy(model, memo)
    except Exception as e:  # noqa: BLE001 - the pickle carries programs instead
        log.debug("no meta copy of the model to pickle (%s)", e)
        return None
    held = [v for m in copied.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    return None if any(not t.is_meta for t in held if is_fake(t)) else copied


# ------------------------------------------------------------------------ meta models
def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the ``meta`` device (built under
    ``torch.device("meta")`` or accelerate's ``init_empty_weights``): it has shapes, no data."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def is_placeholder(t: torch.Tensor) -> bool:
    """A tensor with no data behind it: on ``meta``, or fake (:func:`is_fake` says both)."""
    return is_fake(t)


def materialize(
    root: nn.Module,
    device: Any = None,
    *,
    names: Any = None,
    memo: dict[int, torch.Tensor] | None = None,
) -> list[str]:
    """Give every meta or fake parameter and buffer of ``root`` real, uninitialised memory.

    Each becomes ``torch.empty`` of its shape and dtype on ``device`` (default: the device a fake
    tensor claims; a meta tensor needs ``device``), as ``nn.Module.to_empty`` does, but ties
    stay ties (one tensor shared by two modules stays one) and ``names`` (state-dict style,
    ``"layers.0.fc1.weight"``) limits it to those: a pipeline stage materialises only its
    own modules. ``memo`` (``{id(placeholder): tensor}``) carries ties across calls. Returns
    the names materialised; their values are garbage until loaded.

    >>> with torch.device("meta"):
    ...     lin = nn.Linear(4, 2)
    >>> materialize(lin, "cpu")
    ['weight', 'bias']
    >>> lin.weight.device
    device(type='cpu')
    """
    wanted = None if names is None else set(names)
    memo = {} if memo is None else memo
    done: list[str] = []
    modules = list(root.named_modules(remove_duplicate=False))
    bar = step_bar("Allocating weights", sum(len(m._parameters) + len(m._buffers) for _, m in modules))
    for path, module in modules:
        bar.update(len(module._parameters) + len(module._buffers))
        prefix = f"{path}." if path else ""
        for slots in (module._parameters, module._buffers):
            for name, t in list(slots.items()):
                if t is None or (wanted is not None and prefix + name not in wanted):
                    continue
                if id(t) not in memo and not is_placeholder(t):
                    continue
                if id(t) not in memo:
                    memo[id(t)] = _empty_like(t, device, prefix + name)
                slots[name] = memo[id(t)]
                done.append(prefix + name)
        if isinstance(module, nn.RNNBase):
            module._init_flat_weights()
    return list(dict.fromkeys(done))


def _empty_like(t: torch.Tensor, device: Any, name: str) -> torch.Tensor:
    """``t`` with real memory on ``device``: the same Python object where it can be swapped in
    place (a meta tensor: optimizers, fx copies and ties that hold it see the new memory),
    else a new tensor (a fake one, which its mode references)."""
    target = torch.device(device) if device is not None else t.device
    if target.type == "meta":
        raise ValueError(f"'{name}' is on meta: materialize(..., device=) needs a device")
    empty = torch.empty(t.shape, dtype=t.dtype, device=target)
    new = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    if type(t) in (torch.Tensor, nn.Parameter) and t.is_meta:  # not a FakeTensor
        try:
            torch.utils.swap_tensors(t, new)
            return t
        except RuntimeError:  # weak references to it: a new tensor instead
            pass
    return new
