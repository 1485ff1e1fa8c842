"""Moving values between devices, each step differentiable with the opposite step as backward.

=========  =========================  ============================
forward    what it does               backward
=========  =========================  ============================
scatter    split along ``dim``        gather the gradient chunks
broadcast  copy to every device       reduce-add the gradients
gather     concatenate along ``dim``  scatter the gradient
=========  =========================  ============================

Virtual devices (a device equal to the source) cost nothing: a scatter chunk is a view, a
broadcast returns the tensor itself, and autograd sums the gradients of shared tensors.
Between CUDA devices the coalesced, stream-aware kernels of ``torch.cuda.comm`` are used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd import Function

from dpcompile.runtime.structures import children, is_fake, map_structure, rebuild

DeviceLike = torch.device | str


def _cuda_comm_ok(tensors: Sequence[torch.Tensor], devices: Sequence[torch.device]) -> bool:
    return (
        all(d.type == "cuda" for d in devices)
        and all(t.is_cuda and not is_fake(t) for t in tensors)
        and torch.cuda.is_available()
    )


# Generated code spells devices as literals (``['cpu', 'cpu']``), the same few on every call:
# their parsed form is made once. (Keys are the literal's items; hashing a short tuple of
# strings costs far less than building torch.device objects.)
_PARSED: dict[tuple[Any, ...], tuple[torch.device, ...]] = {}
_UNIFORM: dict[tuple[torch.device, ...], torch.device | None] = {}


def as_devices(devices: Sequence[DeviceLike]) -> tuple[torch.device, ...]:
    key = tuple(devices)
    parsed = _PARSED.get(key)
    if parsed is None:
        parsed = tuple(d if isinstance(d, torch.device) else torch.device(d) for d in key)
        _PARSED[key] = parsed
        _UNIFORM[parsed] = parsed[0] if parsed and all(d == parsed[0] for d in parsed) else None
    return parsed


_ONE: dict[Any, torch.device] = {}


def as_device(device: DeviceLike) -> torch.device:
    if isinstance(device, torch.device):
        return device
    parsed = _ONE.get(device)
    if parsed is None:
        parsed = _ONE[device] = as_devices((device,))[0]
    return parsed


def moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` copied to ``device``: onto a GPU asynchronously; onto the CPU blocking, since
    ``cuda_t.to("cpu", non_blocking=True)`` returns pinned memory the copy may not have filled yet,
    which the host would read (a ``cat`` of the gathered parts, the output handed back) unsynchronised.

        before: out = torch.cat([t.to("cpu", non_blocking=True) for t in parts])   # may read unwritten memory
        after:  out = torch.cat([moved(t, cpu) for t in parts])                     # waits for each copy
    """
    return t.to(device, non_blocking=device.type != "cpu")


def uniform_device(devices: tuple[torch.device, ...]) -> torch.device | None:
    """The one device all of ``devices`` are (virtual devices), else None."""
    return _UNIFORM[devices]


def split_sizes(n: int, parts: int) -> list[int]:
    """Balanced sizes, as ``tensor_split`` makes them: ``split_sizes(9, 4) == [3, 2, 2, 2]``."""
    base, extra = divmod(n, parts)
    return [base + (1 if k < extra else 0) for k in range(parts)]


class _CudaScatter(Function):
    @staticmethod
    def forward(ctx, devices, dim, tensor):
        ctx.dim, ctx.source = dim, tensor.device
        sizes = split_sizes(tensor.size(dim), len(devices))
        return torch.cuda.comm.scatter(tensor, [d.index for d in devices], sizes, dim)

    @staticmethod
    def backward(ctx, *grads):
        return None, None, _CudaGather.apply(ctx.source, ctx.dim, *grads)


class _CudaGather(Function):
    @staticmethod
    def forward(ctx, destination, dim, *tensors):
        ctx.dim = dim
        ctx.devices = [t.device for t in tensors]
        ctx.sizes = [t.size(dim) for t in tensors]
        return torch.cuda.comm.gather(tensors, dim, destination.index)

    @staticmethod
    def backward(ctx, grad):
        chunks = torch.cuda.comm.scatter(grad.contiguous(), [d.index for d in ctx.devices], ctx.sizes, ctx.dim)
        return (None, None, *chunks)


def scatter_tensor(tensor: torch.Tensor, devices: Sequence[DeviceLike], dim: int) -> tuple[torch.Tensor, ...]:
    devices = as_devices(devices)
    chunks = torch.tensor_split(tensor, len(devices), dim)
    if uniform_device(devices) == tensor.device:  # virtual devices: the chunks are views, nothing moves
        return chunks
    if _cuda_comm_ok([tensor], devices) and len(set(devices)) == len(devices):
        return tuple(_CudaScatter.apply(devices, dim, tensor))
    return tuple(c if c.device == d else moved(c, d) for c, d in zip(chunks, devices))


def scatter(value: Any, devices: Sequence[DeviceLike], dim: int = 0) -> tuple[Any, ...]:
    """Split every tensor of ``value`` along ``dim`` into one balanced chunk per device.

    Non-tensor leaves (None, numbers, strings) go to every device unchanged; tensors with
    fewer than ``dim + 1`` dimensions are copied to every device whole.
    """
    devices = as_devices(devices)
    if isinstance(value, torch.Tensor) and value.dim() > dim:  # the common case, without the walk
        if uniform_device(devices) == value.device:  # virtual devices: views
            return torch.tensor_split(value, len(devices), dim)
        return scatter_tensor(value, devices, dim)

    def split_leaf(leaf):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > dim:
            return scatter_tensor(leaf, devices, dim)
        if isinstance(leaf, torch.Tensor):
            return broadcast(leaf, devices)
        return tuple(leaf for _ in devices)

    return _transpose_structure(value, split_leaf, len(devices))


def _transpose_structure(value: Any, per_leaf, n: int) -> tuple[Any, ...]:
    """Turn a structure of n-tuples (``per_leaf`` applied to each leaf) into n structures."""
    kids = children(value)
    if kids is None:
        return per_leaf(value)
    parts = [_transpose_structure(kid, per_leaf, n) for kid in kids]
    return tuple(rebuild(value, [p[k] for p in parts]) for k in range(n))


def broadcast(value: Any, devices: Sequence[DeviceLike]) -> tuple[Any, ...]:
    """A copy of ``value`` (any structure) on every device; the same object where it already is."""
    devices = as_devices(devices)

    def copy_leaf(leaf):
        if not isinstance(leaf, torch.Tensor):
            return tuple(leaf for _ in devices)
        if uniform_device(devices) == leaf.device:
            return (leaf,) * len(devices)
        return tuple(leaf if leaf.device == d else moved(leaf, d) for d in devices)

    if isinstance(value, torch.Tensor):
        return copy_leaf(value)
    return _transpose_structure(value, copy_leaf, len(devices))


def to_device(value: Any, device: DeviceLike) -> Any:
    """``value`` (any structure) moved to ``device``; differentiable, free where it already is."""
    device = as_device(device)
    if isinstance(value, torch.Tensor):
        return value if value.device == device else moved(value, device)
    return map_structure(
        lambda leaf: moved(leaf, device)
        if isinstance(leaf, torch.Tensor) and leaf.device != device
        else leaf,
        value,
    )


def gather_tensors(tensors: Sequence[torch.Tensor], dim: int, device: DeviceLike) -> torch.Tensor:
    device = as_device(device)
    if (
        device.type == "cuda"
        and len(tensors) > 1
        and _cuda_comm_ok(tensors, [device])
        and len({t.device for t in tensors}) == len(tensors)
    ):
        return _CudaGather.apply(device, dim, *tensors)
    here = tensors
    for t in tensors:
        if t.device != device:
            here = [t if t.device == device else moved(t, device) for t in tensors]
            break
    if len(here) == 1:
        return here[0]
    if here[0].dim() == 0:
        raise ValueError(
            "cannot gather 0-dim tensors along a batch dimension; a per-replica scalar "
            "should have been reduced, not gathered"
        )
    return torch.cat(here, dim)


class _TakeFirst:
    """A ``gather`` dim meaning: the value is the same on every device; take the first."""

    def __repr__(self) -> str:
        return "TAKE_FIRST"


TAKE_FIRST = _TakeFirst()


def gather(values: Sequence[Any], dim: Any, device: DeviceLike) -> Any:
    """Concatenate per-device values (same structure each) along ``dim`` on ``device``.

    ``dim`` is an int for every tensor leaf, or a structure like the values holding an int
    (or ``TAKE_FIRST``) per leaf, e.g. ``(0, (1, 1))`` for an LSTM's ``out, (h, c)``.
    Non-tensor leaves are taken from the first device.
    """
    if type(dim) is int and isinstance(values[0], torch.Tensor):  # the common case, without the walk
        return gather_tensors(values, dim, device)
    if isinstance(dim, int) or dim is TAKE_FIRST:
        def join(*leaves):
            if isinstance(leaves[0], torch.Tensor) and dim is not TAKE_FIRST:
                return gather_tensors(leaves, dim, device)
            return to_device(leaves[0], device)

        return map_structure(join, *values)
    parts = [children(v) for v in values]
    return rebuild(values[0], [gather([p[i] for p in parts], d, device) for i, d in enumerate(dim)])


class Broadcast(Function):
    """Copy tensors from one device to several; backward reduce-adds the gradients.

    ``Broadcast.apply(devices, packed_groups, *tensors)`` returns ``len(devices) * len(tensors)``
    tensors, device-major. Each group of ``packed_groups`` (lists of indices, e.g. one RNN's
    weights) comes out as views into one buffer per device: with the source's exact layout
    where the source tensors already share one storage (flattened cuDNN weights), else laid
    end to end in the group's order.
    """

    @staticmethod
    def forward(ctx, devices, packed_groups, *tensors):
        ctx.source = tensors[0].device
        ctx.count = len(tensors)
        outputs = copy_tensors_to_devices(tensors, devices, packed_groups)
        nondiff = [o for per_device in outputs for o, t in zip(per_device, tensors) if not t.requires_grad]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return tuple(o for per_device in outputs for o in per_device)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *sum_to_source(ctx, grads))


def sum_to_source(ctx, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Per input of a broadcast (``ctx.count`` of them, from ``ctx.source``), the sum of its
    copies' gradients (``grads`` device-major), on the source device."""
    per_input: list[torch.Tensor | None] = []
    for i in range(ctx.count):
        parts = [g for g in grads[i :: ctx.count] if g is not None]
        if not parts:
            per_input.append(None)
        elif len(parts) > 1 and _cuda_comm_ok(parts, [ctx.source]) and len({p.device for p in parts}) == len(parts):
            per_input.append(torch.cuda.comm.reduce_add(parts, ctx.source.index))
        else:
            total = parts[0].to(ctx.source)
            for p in parts[1:]:
                total = total + p.to(ctx.source)
            per_input.append(total)
    return per_input


def _shares_one_storage(tensors: Sequence[torch.Tensor]) -> bool:
    if any(is_fake(t) or t.numel() == 0 for t in tensors):
        return False
    return len({t.untyped_storage().data_ptr() for t in tensors}) == 1


def copy_tensors_to_devices(
    tensors: Sequence[torch.Tensor], devices: Sequence[torch.device], packed_groups: Sequence[Sequence[int]]
) -> list[list[torch.Tensor]]:
    out: list[list[torch.Tensor | None]] = [[None] * len(tensors) for _ in devices]
    grouped = {i for group in packed_groups for i in group}
    singles = [i for i in range(len(tensors)) if i not in grouped]
    source_device = tensors[0].device if tensors else None
    coalesce = (
        singles
        and _cuda_comm_ok([tensors[i] for i in singles], devices)
        and len({source_device, *devices}) == len(devices) + 1  # distinct GPUs, none the source
    )
    if coalesce:
        source = tensors[singles[0]].device.index
        copies = torch.cuda.comm.broadcast_coalesced(
            [tensors[i].detach() for i in singles], [source] + [d.index for d in devices]
        )[1:]
        for k, per_device in enumerate(copies):
            for i, c in zip(singles, per_device):
                out[k][i] = c
    else:
        for k, device in enumerate(devices):
            for i in singles:
                out[k][i] = tensors[i].detach().to(device, copy=True)
    for group in packed_groups:
        members = [tensors[i] for i in group]
        for k, device in enumerate(devices):
            views = copy_span(members, device) if _shares_one_storage(members) else pack_contiguous(members, device)
            for i, v in zip(group, views):
                out[k][i] = v
    return out  # type: ignore[return-value]


def copy_span(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Copy the storage span covering ``tensors`` once; return views with the same layout."""
    lo = min(t.storage_offset() for t in tensors)
    hi = max(t.storage_offset() + _extent(t) for t in tensors)
    span = torch.empty(0, dtype=tensors[0].dtype, device=tensors[0].device)
    span.set_(tensors[0].untyped_storage(), lo, (hi - lo,), (1,))
    buffer = span.detach().to(device, copy=True)
    return [buffer.as_strided(t.shape, t.stride(), t.storage_offset() - lo) for t in tensors]


def _extent(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def pack_contiguous(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Copies of ``tensors`` laid end to end in one new buffer on ``device``, in order.

    The buffer is assembled on the source and moved in one transfer.
    """
    buffer = torch.cat([t.detach().reshape(-1) for t in tensors]).to(device, copy=True)
    views, offset = [], 0
    for t in tensors:
        views.append(buffer.narrow(0, offset, t.numel()).view(t.shape))
        offset += t.numel()
    return views
