"""Ring attention over the ranks of a ``cp`` group: the key and value blocks move by point-to-point sends.

One rank's part of :func:`dpcompile.runtime.sequence_ring.ring_attention` (the same blocks, kernels
and merge), for context parallel over a ``DeviceMesh`` (``passes.lower_sequence_to_rank`` writes
calls of :func:`ring_attention_over_group` for the attention calls the ring serves).

Forward, ``N - 1`` steps: each rank sends the block it holds (its own first; keys and values in one
message) to the next rank and receives the previous rank's, attending the block it holds while the
next one travels, so it holds at most two blocks. Backward goes round again with each block's key
and value gradients travelling with it, each rank adding its queries' share; after ``N - 1`` steps
rank ``r`` holds block ``r + 1`` with every rank's share, and one last send hands it to its owner.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dpcompile.errors import DpCompileError
from dpcompile.runtime.distributed import GroupLike, process_group
from dpcompile.runtime.sequence_ring import (
    block_attention,
    block_attention_backward,
    block_kind,
    mask_columns,
    merge_blocks,
    ring_options,
)


def _packed(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpacked(flat: torch.Tensor, *shapes: torch.Size) -> list[torch.Tensor]:
    out, at = [], 0
    for shape in shapes:
        size = shape.numel()
        out.append(flat[at : at + size].view(shape))
        at += size
    return out


class _Ring:
    """Where each block of a rank's ring lies: its shapes, offsets and how it is attended."""

    def __init__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sizes: list[int],
                 start: int | None, group: Any) -> None:  # fmt: skip
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.offsets = [sum(sizes[:j]) for j in range(len(sizes))]
        self.sizes = sizes
        self.key_shapes = [key.shape[:-2] + (s, key.shape[-1]) for s in sizes]
        self.value_shapes = [value.shape[:-2] + (s, value.shape[-1]) for s in sizes]
        self.kinds = [block_kind(start, query.shape[-2], self.offsets[j], s) for j, s in enumerate(sizes)]

    def held(self, step: int) -> int:
        """The block this rank holds at ``step``: block ``rank - step``'s."""
        return (self.rank - step) % self.world

    def buffer(self, block: int, like: torch.Tensor, factor: int = 1) -> torch.Tensor:
        numel = self.key_shapes[block].numel() + self.value_shapes[block].numel()
        return like.new_empty(factor * numel)


class _RingOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                plan: Any) -> torch.Tensor:  # fmt: skip
        group, sizes, scale, start = plan
        if mask is not None and mask.requires_grad:
            raise DpCompileError("ring attention over a group: a mask that needs a gradient (a learned bias) is the "
                                 "all-gather's to serve: use context_parallel={'exchange': 'all-gather'}")  # fmt: skip
        ring = _Ring(query, key, value, sizes, start, group)
        held = _packed(key, value)
        out = lse = None
        for step in range(ring.world):
            j = ring.held(step)
            incoming = None
            if step < ring.world - 1:
                incoming = ring.buffer(ring.held(step + 1), held)
                works = _start(held, incoming, group)
            if ring.kinds[j] != "skip":
                k, v = _unpacked(held, ring.key_shapes[j], ring.value_shapes[j])
                o, lse_j = block_attention(query, k, v, scale, mask_columns(mask, ring.offsets[j], sizes[j]),
                                           ring.kinds[j], start, ring.offsets[j])  # fmt: skip
                out, lse = merge_blocks(out, lse, o, lse_j)
            if incoming is not None:
                _finish(works)
                held = incoming
        if out is None or lse is None:
            out = query.new_zeros(*query.shape[:-1], value.shape[-1])
            lse = query.new_full(query.shape[:-1], float("-inf"))
        ctx.save_for_backward(query, key, value, out, lse, mask)
        ctx.plan = plan
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse, mask = ctx.saved_tensors
        group, sizes, scale, start = ctx.plan
        ring = _Ring(query, key, value, sizes, start, group)
        grad = grad.contiguous()
        dq = torch.zeros_like(query)
        held = _packed(key, value, torch.zeros_like(key), torch.zeros_like(value))  # the block and its gradients
        for step in range(ring.world):
            j = ring.held(step)
            k, v, dk, dv = _unpacked(held, ring.key_shapes[j], ring.value_shapes[j], ring.key_shapes[j],
                                     ring.value_shapes[j])  # fmt: skip
            if ring.kinds[j] != "skip":
                dq_j, dk_j, dv_j = block_attention_backward(
                    grad, query, k, v, out, lse, scale, mask_columns(mask, ring.offsets[j], sizes[j]), ring.kinds[j],
                    start, ring.offsets[j],
                )  # fmt: skip
                dq += dq_j
                dk += dk_j
                dv += dv_j
            if step < ring.world - 1:
                incoming = ring.buffer(ring.held(step + 1), held, factor=2)
                _finish(_start(held, incoming, group))
                held = incoming
        # rank r holds block r + 1 with every rank's share of its gradients: hand them to the owner
        if ring.world > 1:
            j = ring.held(ring.world - 1)
            _k, _v, dk, dv = _unpacked(held, ring.key_shapes[j], ring.value_shapes[j], ring.key_shapes[j],
                                       ring.value_shapes[j])  # fmt: skip
            mine = ring.buffer(ring.rank, held)
            _finish(_start(_packed(dk, dv), mine, group))
            dk, dv = _unpacked(mine, key.shape, value.shape)
        return dq, dk, dv, None, None


def _start(send: torch.Tensor, receive: torch.Tensor, group: Any) -> list[Any]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    to, frm = (rank + 1) % world, (rank - 1) % world
    if group is not None:
        to, frm = dist.get_global_rank(group, to), dist.get_global_rank(group, frm)
    return [dist.isend(send.contiguous(), to, group=group), dist.irecv(receive, frm, group=group)]


def _finish(works: list[Any]) -> None:
    for work in works:
        work.wait()


def ring_attention_over_group(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: GroupLike, dim: int,
                              sizes: list[int], positions: torch.Tensor | None = None,
                              **kwargs: Any) -> torch.Tensor:  # fmt: skip
    """This rank's queries against every rank's keys and values along ``dim`` (the keys' ``-2``;
    shard lengths ``sizes`` in rank order, uneven allowed), the blocks passed round the ``group``'s
    ring (see the module's docstring); ``positions``: causal at these query positions in the whole
    sequence, else ``scaled_dot_product_attention(**kwargs)`` (a mask: this rank's query rows).

    >>> out = ring_attention_over_group(q_local, k_local, v_local, cp_group, 2, [4, 3], positions)  # doctest: +SKIP
    """
    g = process_group(group)
    if dim % key.dim() != key.dim() - 2:
        raise ValueError(f"ring attention runs along the keys' dim -2, not {dim}")
    scale, mask = ring_options(query, kwargs)
    start = (int(positions[0]) if query.shape[-2] else 0) if positions is not None else None
    plan = (g, [int(s) for s in sizes], scale, start)
    return _RingOverGroup.apply(query, key.contiguous(), value.contiguous(), mask, plan)


__all__ = ["ring_attention_over_group"]
