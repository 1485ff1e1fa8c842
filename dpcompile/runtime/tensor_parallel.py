"""Single-process tensor parallelism: the SPMD collectives, lowered onto several devices.

``passes.tensor_parallel.expand_shards`` replaces each call of
:mod:`dpcompile.runtime.collectives` (one shard's view) by one call below that sees every
shard at once, as a list with one entry per device. Each is built from differentiable
torch ops (``.to``, ``narrow``, ``cat``, ``+``), so autograd runs the matching backward:

=====================  =================================  ====================================
SPMD call              here, forward                      backward (autograd)
=====================  =================================  ====================================
``copy_to_shards``     ``copy_to_devices``: one copy      the copies' gradients summed: the
                       per device (free where it is)      all-reduce of *f*
``reduce_from_shards`` ``reduce_to_device``: sum of the   the gradient copied to each shard
                       partial sums on the output device
``gather_from_shards`` ``gather_to_device``: ``cat``      each shard gets its slice
``split_to_shards``    ``split_to_devices``: ``narrow``   the slices' gradients concatenated
=====================  =================================  ====================================

Replicated values (and replicated layers) live once, on ``devices[0]``; shard ``k`` of a
sharded parameter lives on ``devices[k]``. On virtual devices (``["cpu"] * n``) every move
is free and each shard still runs its own slice of the computation.

A parameter's split is a :class:`ShardSpec`; :func:`shard_of` cuts shard ``k`` out of the
full tensor and :func:`unshard` puts the shards back together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dpcompile.runtime import kept
from dpcompile.runtime.comm import moved

DeviceLike = torch.device | str


@dataclass(frozen=True)
class ShardSpec:
    """How a tensor is split: along ``dim`` into pieces of ``sizes`` (one per shard).

    ``sections > 1`` is a fused projection (qkv): ``dim`` holds ``sections`` equal blocks
    (q, k, v) and each block is split in proportion, so shard ``k`` holds its slice of every
    block (``sizes[k] / sections`` of each), Megatron's layout; ``sizes`` still sum to the
    whole dim.

    >>> ShardSpec(0, (4, 3, 3)).offsets()
    [0, 4, 7]
    >>> shard_of(torch.arange(12), ShardSpec(0, (6, 6), sections=3), 1)   # q, k, v of 4 each
    tensor([ 2,  3,  6,  7, 10, 11])
    """

    dim: int
    sizes: tuple[int, ...]
    sections: int = 1

    def offsets(self) -> list[int]:
        return [sum(self.sizes[:k]) for k in range(len(self.sizes))]


def shard_of(full: torch.Tensor, spec: ShardSpec, k: int) -> torch.Tensor:
    """Shard ``k`` of ``full`` under ``spec`` (a view where ``sections == 1``; ``.clone()`` it to own the memory)."""
    if full.size(spec.dim) != sum(spec.sizes):
        raise ValueError(
            f"cannot split dim {spec.dim} of size {full.size(spec.dim)} into shards {list(spec.sizes)} "
            f"(they sum to {sum(spec.sizes)})"
        )
    if spec.sections == 1:
        return full.narrow(spec.dim, spec.offsets()[k], spec.sizes[k])
    s = spec.sections
    blocks = full.chunk(s, spec.dim)
    return torch.cat([b.narrow(spec.dim, spec.offsets()[k] // s, spec.sizes[k] // s) for b in blocks], spec.dim)


def unshard(shards: Sequence[torch.Tensor], spec: ShardSpec, device: DeviceLike) -> torch.Tensor:
    """The full tensor from its shards, on ``device``."""
    device = torch.device(device)
    here = [s.to(device) for s in shards]
    if spec.sections == 1:
        return torch.cat(here, spec.dim)
    pieces = [m.chunk(spec.sections, spec.dim) for m in here]
    return torch.cat([p[i] for i in range(spec.sections) for p in pieces], spec.dim)


def regroup_sections(gathered: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The full tensor from the plain concatenation of its shards (an all-gather's result)."""
    if spec.sections == 1:
        return gathered
    return unshard(list(gathered.split(list(spec.sizes), spec.dim)), spec, gathered.device)


def _move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):  # a None or a list where forward wants a tensor: its op says so, as eager's
        return t
    return t if t.device == device else moved(t, device)


def copy_to_devices(x: torch.Tensor, devices: Sequence[DeviceLike]) -> tuple[torch.Tensor, ...]:
    """*f*: ``x`` on every device. Backward sums the copies' gradients (the all-reduce)."""
    return tuple(_move(x, torch.device(d)) for d in devices)


def call_module_on_device(module: torch.nn.Module, device: DeviceLike, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` reading its parameters and buffers on ``device`` (a norm called on
    device ``k``'s sequence slice): copies there, whose gradients autograd sums into the one parameter."""
    device = torch.device(device)
    state = {name: _move(t, device) for name, t in [*module.named_parameters(), *module.named_buffers()]}
    return kept.functional_call(module, state, args, kwargs)


def reduce_to_device(partials: Sequence[torch.Tensor], device: DeviceLike) -> torch.Tensor:
    """*g*: the sum of the shards' partial results on ``device``. Backward copies the gradient."""
    device = torch.device(device)
    total = _move(partials[0], device)
    for p in partials[1:]:
        total = total + _move(p, device)
    return total


def gather_to_device(shards: Sequence[torch.Tensor], dim: int, device: DeviceLike) -> torch.Tensor:
    """All-gather: the shards concatenated along ``dim`` on ``device``. Backward slices."""
    device = torch.device(device)
    if len(shards) == 1:
        return _move(shards[0], device)
    return torch.cat([_move(s, device) for s in shards], dim)


def split_to_devices(
    x: torch.Tensor, dim: int, sizes: Sequence[int], devices: Sequence[DeviceLike]
) -> tuple[torch.Tensor, ...]:
    """Slice ``k`` of ``x`` along ``dim`` (``sizes[k]`` wide) on device ``k``. Backward concatenates."""
    spec = ShardSpec(dim, tuple(sizes))
    return tuple(_move(shard_of(x, spec, k), torch.device(d)) for k, d in enumerate(devices))


def _sequence_sizes(length: int, sizes: Sequence[int]) -> list[int]:
    """``sizes`` where they cover ``length``; else the balanced ``tensor_split`` sizes of ``length``
    (a call with another sequence length than the example's)."""
    if sum(sizes) == length:
        return list(sizes)
    n = len(sizes)
    return [length // n + (1 if k < length % n else 0) for k in range(n)]


class _ReduceScatter(torch.autograd.Function):
    """Forward: slice ``k`` of the sum of the partials, summed on device ``k``. Backward: every partial's
    gradient is the slices' gradients concatenated (the all-gather), made once per distinct device."""

    @staticmethod
    def forward(ctx, dim, sizes, devices, *partials):  # noqa: ANN001, ANN205
        offsets = ShardSpec(dim, tuple(sizes)).offsets()
        ctx.dim, ctx.sources = dim, [p.device for p in partials]
        out = []
        for k, d in enumerate(devices):
            device = torch.device(d)
            total = _move(partials[0].narrow(dim, offsets[k], sizes[k]), device).clone()
            for p in partials[1:]:
                total += _move(p.narrow(dim, offsets[k], sizes[k]), device)
            out.append(total)
        ctx.shapes = [tuple(o.shape) for o in out]
        ctx.meta = [(o.dtype, o.device) for o in out]
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):  # noqa: ANN001, ANN205
        grads = [
            g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, shape, (dtype, device) in zip(grads, ctx.shapes, ctx.meta, strict=True)
        ]
        whole: dict[torch.device, torch.Tensor] = {}
        for device in ctx.sources:
            if device not in whole:
                whole[device] = torch.cat([_move(g, device) for g in grads], ctx.dim)
        return (None, None, None, *(whole[d] for d in ctx.sources))


def reduce_scatter_to_devices(
    partials: Sequence[torch.Tensor], dim: int, sizes: Sequence[int], devices: Sequence[DeviceLike]
) -> tuple[torch.Tensor, ...]:
    """Sequence parallelism's *g*: slice ``k`` along ``dim`` of the sum of ``partials``, on device
    ``k`` (only that slice is summed there). Backward: the slices' gradients gathered (all-gather),
    one tensor shared by the partials of one device (virtual devices)."""
    dim = dim % partials[0].dim()
    sizes = _sequence_sizes(partials[0].size(dim), sizes)
    return _ReduceScatter.apply(dim, sizes, list(devices), *partials)


class _LinearOfGathered(torch.autograd.Function):
    """A column layer on the all-gathered sequence that keeps only the slices for backward."""

    @staticmethod
    def forward(ctx, gathered, weight, bias, dim, transposed, *shards):  # noqa: ANN001, ANN205
        ctx.dim, ctx.transposed, ctx.has_bias = dim, transposed, bias is not None
        ctx.save_for_backward(weight, *shards)
        return linear_in_out(gathered, weight, bias) if transposed else torch.nn.functional.linear(gathered, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        weight, *shards = ctx.saved_tensors
        whole = torch.cat([_move(s, weight.device) for s in shards], ctx.dim)  # gathered again, not saved
        grad_input = grad @ weight.t() if ctx.transposed else grad @ weight
        flat_grad, flat_in = grad.reshape(-1, grad.shape[-1]), whole.reshape(-1, whole.shape[-1])
        grad_weight = flat_in.t() @ flat_grad if ctx.transposed else flat_grad.t() @ flat_in
        grad_bias = flat_grad.sum(0) if ctx.has_bias else None
        return (grad_input, grad_weight, grad_bias, None, None, *(None for _ in shards))


def linear_of_gathered(
    gathered: torch.Tensor, shards: Sequence[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor | None, dim: int,
    transposed: bool = False,
) -> torch.Tensor:  # fmt: skip
    """A column layer on ``gathered`` (the sequence ``shards`` concatenated along ``dim``) that saves the
    shards for backward, not ``gathered``, and concatenates them again there (Megatron's sequence
    parallel linear): the whole input is not held from forward to backward."""
    return _LinearOfGathered.apply(gathered, weight, bias, dim % gathered.dim(), transposed, *shards)


def whole_size(shards: Sequence[torch.Tensor], dim: int, index: int | None = None) -> torch.Size | int:
    """The size (``index``) or shape of the whole tensor whose slices along ``dim`` are ``shards``."""
    shape = list(shards[0].shape)
    shape[dim] = sum(s.size(dim) for s in shards)
    return torch.Size(shape) if index is None else shape[index]


def split_sequence_to_devices(
    x: torch.Tensor, dim: int, sizes: Sequence[int], devices: Sequence[DeviceLike]
) -> tuple[torch.Tensor, ...]:
    """Slice ``k`` of ``x`` along the sequence ``dim`` on device ``k``, balanced over the call's own
    length (``sizes`` are the example's). Backward concatenates."""
    return split_to_devices(x, dim, _sequence_sizes(x.size(dim), sizes), devices)


def all_gather_to_devices(shards: Sequence[torch.Tensor], dim: int, devices: Sequence[DeviceLike]) -> tuple[torch.Tensor, ...]:
    """Sequence parallelism's *f*: the slices concatenated along ``dim``, whole on every device (one
    tensor shared where the devices are one: virtual devices). Backward: the copies' gradients summed,
    each device keeping its slice (reduce-scatter)."""
    targets = [torch.device(d) for d in devices]
    whole: dict[torch.device, torch.Tensor] = {}
    for device in targets:
        if device not in whole:
            whole[device] = torch.cat([_move(s, device) for s in shards], dim)
    return tuple(whole[d] for d in targets)


def add_bias(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x + bias``: the bias a row-parallel Linear adds once, after the reduction, in the dtype
    ``F.linear`` would give: under ``torch.autocast`` the bias joins ``x``'s (bfloat16) dtype
    instead of promoting the output back to float32."""
    if bias.dtype != x.dtype and torch.is_autocast_enabled(x.device.type):
        bias = bias.to(x.dtype)
    return x + bias


def linear_in_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight (+ bias)`` for a weight stored ``(in, out)``, as transformers' ``Conv1D``
    (a shard of one: columns of ``weight`` for a column split, rows for a row split)."""
    out = torch.matmul(x, weight)
    return out if bias is None else out + bias


def masked_embedding(ids: torch.Tensor, weight: torch.Tensor, offset: int, padding_idx: int | None = None) -> torch.Tensor:
    """One shard's part of a vocab-parallel lookup (Megatron's VocabParallelEmbedding).

    ``weight`` holds rows ``offset .. offset + len(weight)`` of the table; ids outside them
    give zero rows (and no gradient), so the sum over shards (one all-reduce) is the lookup.

    >>> w = torch.arange(6.).view(3, 2)                 # rows 2, 3, 4 of a 6-row table
    >>> masked_embedding(torch.tensor([0, 3]), w, 2)
    tensor([[0., 0.],
            [2., 3.]])
    """
    local = moved(ids, weight.device) - offset  # the ids may still be where the input arrived
    outside = (local < 0) | (local >= weight.size(0))
    pad = None
    if padding_idx is not None:
        pad_local = (padding_idx % (weight.size(0) + offset) if padding_idx < 0 else padding_idx) - offset
        pad = pad_local if 0 <= pad_local < weight.size(0) else None
    out = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight, pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def shard_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """This shard's ``logsumexp`` over its classes, ``(N, 1)``: all-gathered, they give the whole one."""
    return logits.logsumexp(-1, keepdim=True)


def shard_target_logit(logits: torch.Tensor, target: torch.Tensor, offset: int) -> torch.Tensor:
    """The logit of each row's target class where this shard holds it, else 0 (summed over shards: the target logit)."""
    local = target - offset
    inside = (local >= 0) & (local < logits.size(-1))
    picked = logits.gather(-1, local.clamp(0, logits.size(-1) - 1).unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(~inside, 0.0)


def cross_entropy_from_parts(
    lse_parts: torch.Tensor, target_logit: torch.Tensor, target: torch.Tensor, reduction: str = "mean", ignore_index: int = -100
) -> torch.Tensor:
    """A vocab-parallel cross-entropy from every shard's logsumexp ``(N, shards)`` and the target
    logits ``(N,)``: ``logsumexp - target logit`` per row, reduced as ``F.cross_entropy`` does."""
    loss = lse_parts.logsumexp(-1) - target_logit
    valid = target != ignore_index
    loss = loss.masked_fill(~valid, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


def window_attention_shard(
    input: torch.Tensor,
    qkv_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    relative_position_bias: torch.Tensor,
    window_size: Sequence[int],
    num_heads: int,
    head_dim: int,
    head_offset: int,
    shift_size: Sequence[int],
    attention_dropout: float = 0.0,
    qkv_bias: torch.Tensor | None = None,
    training: bool = True,
) -> torch.Tensor:
    """One shard's part of torchvision's ``shifted_window_attention`` (Swin), sharded by heads.

    ``qkv_weight``/``qkv_bias`` hold this shard's ``num_heads`` heads of q, k and v (rows
    ``head_offset ..`` of each section), ``proj_weight`` the matching input columns of the
    projection; the result is this shard's partial sum of the projection, without its bias
    (the shards' parts are all-reduced and the bias added once). Windows, shifts, masks and
    padding are torchvision's, so the sum equals the whole call.
    """
    import torch.nn.functional as F

    B, H, W, C = input.shape
    c_local = num_heads * head_dim
    pad_r = (window_size[1] - W % window_size[1]) % window_size[1]
    pad_b = (window_size[0] - H % window_size[0]) % window_size[0]
    x = F.pad(input, (0, 0, 0, pad_r, 0, pad_b))
    _, pad_H, pad_W, _ = x.shape
    shift_size = list(shift_size)
    if window_size[0] >= pad_H:
        shift_size[0] = 0
    if window_size[1] >= pad_W:
        shift_size[1] = 0
    if sum(shift_size) > 0:
        x = torch.roll(x, shifts=(-shift_size[0], -shift_size[1]), dims=(1, 2))
    num_windows = (pad_H // window_size[0]) * (pad_W // window_size[1])
    x = x.view(B, pad_H // window_size[0], window_size[0], pad_W // window_size[1], window_size[1], C)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(B * num_windows, window_size[0] * window_size[1], C)
    qkv = F.linear(x, qkv_weight, qkv_bias)
    qkv = qkv.reshape(x.size(0), x.size(1), 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    q = q * head_dim**-0.5
    attn = q.matmul(k.transpose(-2, -1))
    attn = attn + relative_position_bias[:, head_offset : head_offset + num_heads]
    if sum(shift_size) > 0:
        attn_mask = x.new_zeros((pad_H, pad_W))
        h_slices = ((0, -window_size[0]), (-window_size[0], -shift_size[0]), (-shift_size[0], None))
        w_slices = ((0, -window_size[1]), (-window_size[1], -shift_size[1]), (-shift_size[1], None))
        count = 0
        for h in h_slices:
            for w in w_slices:
                attn_mask[h[0] : h[1], w[0] : w[1]] = count
                count += 1
        attn_mask = attn_mask.view(pad_H // window_size[0], window_size[0], pad_W // window_size[1], window_size[1])
        attn_mask = attn_mask.permute(0, 2, 1, 3).reshape(num_windows, window_size[0] * window_size[1])
        attn_mask = attn_mask.unsqueeze(1) - attn_mask.unsqueeze(2)
        attn_mask = attn_mask.masked_fill(attn_mask != 0, (-100.0)).masked_fill(attn_mask == 0, 0.0)
        attn = attn.view(x.size(0) // num_windows, num_windows, num_heads, x.size(1), x.size(1))
        attn = attn + attn_mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, num_heads, x.size(1), x.size(1))
    attn = F.softmax(attn, dim=-1)
    attn = F.dropout(attn, p=attention_dropout, training=training)
    x = attn.matmul(v).transpose(1, 2).reshape(x.size(0), x.size(1), c_local)
    x = F.linear(x, proj_weight)
    x = x.view(B, pad_H // window_size[0], pad_W // window_size[1], window_size[0], window_size[1], C)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(B, pad_H, pad_W, C)
    if sum(shift_size) > 0:
        x = torch.roll(x, shifts=(shift_size[0], shift_size[1]), dims=(1, 2))
    return x[:, :H, :W, :].contiguous()


__all__ = [
    "ShardSpec",
    "add_bias",
    "window_attention_shard",
    "cross_entropy_from_parts",
    "shard_logsumexp",
    "shard_target_logit",
    "masked_embedding",
    "linear_in_out",
    "regroup_sections",
    "copy_to_devices",
    "call_module_on_device",
    "gather_to_device",
    "reduce_to_device",
    "shard_of",
    "split_to_devices",
    "unshard",
    "split_sequence_to_devices",
    "reduce_scatter_to_devices",
    "all_gather_to_devices",
    "linear_of_gathered",
    "whole_size",
]
