"""Context parallelism's head-to-sequence all-to-all (DeepSpeed Ulysses), as generated code calls it.

Each device holds its part of the sequence for every head, ``(batch, heads, s_r, head_dim)``. Before
attention the queries, keys and values are exchanged so that device ``r`` holds the WHOLE sequence
for its share of the heads (heads ``r*H/N`` to ``(r+1)*H/N``); it runs the ordinary attention, and
its output is exchanged back to sequence shards of every head. The heads (and the key/value heads
under grouped-query attention) must divide over the devices.

==============================================  ===============================================
one process (virtual devices)                   one rank of a ``cp`` group
==============================================  ===============================================
:func:`heads_of_sequence`: every shard's         :func:`heads_over_group`: ``all_to_all``, the
heads ``r``, concatenated along the sequence     shards' heads to their owners (uneven lengths)
:func:`sequence_of_heads`: every device's        :func:`sequence_over_group`: the reverse
heads, device ``r``'s rows of the sequence       ``all_to_all``
:func:`heads_share`: a whole value's heads ``r``  the same call, the rank's own index
==============================================  ===============================================

Autograd is exact: in one process the exchanges are narrows and concatenations (their backward is
the reverse exchange); over a group each exchange is an ``autograd.Function`` whose backward is the
other. Every head exchange keeps nothing for backward but the sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function

from dpcompile.runtime.distributed import GroupLike, gather_over_group, process_group

HEADS_DIM = -3  # (batch, heads, seq, head_dim): the heads' dim, counted from the end (a mask's too)


def heads_share(x: torch.Tensor, index: int, world: int, dim: int = HEADS_DIM) -> torch.Tensor:
    """Device ``index``'s share of ``x``'s heads (dim ``dim``) among ``world`` devices; ``x`` as it is
    where its heads broadcast (size 1: a mask shared by every head) or it has no heads dim.

    >>> heads_share(torch.arange(8).view(1, 4, 2, 1), 1, 2).flatten().tolist()
    [4, 5, 6, 7]
    """
    if x.dim() < -dim or x.shape[dim] == 1:
        return x
    per = x.shape[dim] // world
    return x.narrow(dim, index * per, per)


def heads_of_sequence(shards: Sequence[torch.Tensor], index: int, dim: int, sizes: Sequence[int], device: Any) -> torch.Tensor:
    """Device ``index``'s heads over the whole sequence: every device's shard (its ``sizes[k]``
    positions along ``dim``, every head), narrowed to the heads ``index`` owns, concatenated along
    ``dim`` on ``device``. Backward hands each shard its heads' slice back (the reverse exchange).

    >>> a, b = torch.zeros(1, 2, 3, 4), torch.ones(1, 2, 1, 4)
    >>> heads_of_sequence([a, b], 1, 2, [3, 1], "cpu").shape
    torch.Size([1, 1, 4, 4])
    """
    world = len(shards)
    return torch.cat([heads_share(s, index, world).to(device) for s in shards], dim)


def sequence_of_heads(outputs: Sequence[torch.Tensor], index: int, dim: int, sizes: Sequence[int], device: Any) -> torch.Tensor:
    """Device ``index``'s shard of the sequence (``sizes[index]`` positions along ``dim``) with every
    head: each device's attention output for its heads over the whole sequence, narrowed to those
    positions, concatenated along the heads on ``device``. Backward is the reverse exchange.

    >>> heads = [torch.zeros(1, 1, 4, 2), torch.ones(1, 1, 4, 2)]
    >>> sequence_of_heads(heads, 1, 2, [3, 1], "cpu").shape
    torch.Size([1, 2, 1, 2])
    """
    start = sum(int(s) for s in sizes[:index])
    parts = [o.narrow(dim, start, int(sizes[index])).to(device) for o in outputs]
    return torch.cat(parts, dim - 1)


# ---------------------------------------------------------------------------------- over a group


def exchange_pieces(x: torch.Tensor, group: dist.ProcessGroup | None, split_dim: int, split_sizes: Sequence[int],
                cat_dim: int, cat_sizes: Sequence[int]) -> torch.Tensor:  # fmt: skip
    """``x`` split along ``split_dim`` into ``split_sizes``, piece ``j`` sent to rank ``j``; the
    pieces received (``split_sizes[rank]`` along ``split_dim``, ``cat_sizes[j]`` along ``cat_dim``
    from rank ``j``) concatenated along ``cat_dim``. gloo's list ``all_to_all`` wants pieces of one
    shape, and uneven shards are not: one ``all_to_all_single`` of the pieces flattened, with their
    sizes. A boolean tensor travels as bytes."""
    boolean = x.dtype == torch.bool
    if boolean:
        x = x.to(torch.uint8)
    rank = dist.get_rank(group)
    send = [p.reshape(-1) for p in x.split(list(split_sizes), split_dim)]
    shapes = []
    for size in cat_sizes:
        shape = list(x.shape)
        shape[split_dim], shape[cat_dim] = split_sizes[rank], size
        shapes.append(shape)
    counts = [math.prod(shape) for shape in shapes]
    received = x.new_empty(sum(counts))
    dist.all_to_all_single(received, torch.cat(send), counts, [p.numel() for p in send], group=group)
    out = torch.cat([piece.view(shape) for piece, shape in zip(received.split(counts), shapes)], cat_dim)
    return out.bool() if boolean else out


class _HeadsOverGroup(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, sizes: tuple[int, ...]) -> torch.Tensor:
        world, heads = len(sizes), x.shape[dim - 1]
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return exchange_pieces(x, group, dim - 1, [heads // world] * world, dim, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _SequenceOverGroup.apply(grad, ctx.group, ctx.dim, ctx.sizes), None, None, None


class _SequenceOverGroup(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, sizes: tuple[int, ...]) -> torch.Tensor:
        world, heads = len(sizes), x.shape[dim - 1]
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return exchange_pieces(x, group, dim, sizes, dim - 1, [heads] * world)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _HeadsOverGroup.apply(grad, ctx.group, ctx.dim, ctx.sizes), None, None, None


def heads_over_group(x: torch.Tensor, group: GroupLike, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """This rank's heads over the whole sequence, from every rank's shard (``sizes``: every rank's
    length along ``dim``, uneven allowed): one ``all_to_all``; backward the reverse one. A value
    whose heads broadcast (a mask shared by every head: size 1) is all-gathered along ``dim``.

    >>> heads_over_group(q_local, cp_group, 2, [4, 3])  # doctest: +SKIP
    """
    dim = dim % x.dim()
    if x.shape[dim - 1] == 1:
        return gather_over_group(x, group, dim)
    return _HeadsOverGroup.apply(x, process_group(group), dim, tuple(int(s) for s in sizes))


def sequence_over_group(x: torch.Tensor, group: GroupLike, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """This rank's shard of the sequence with every head, from every rank's heads over the whole
    sequence: the reverse ``all_to_all`` of :func:`heads_over_group` (backward: that one).

    >>> sequence_over_group(out_heads, cp_group, 2, [4, 3])  # doctest: +SKIP
    """
    dim = dim % x.dim()
    return _SequenceOverGroup.apply(x, process_group(group), dim, tuple(int(s) for s in sizes))


__all__ = ["HEADS_DIM", "exchange_pieces", "heads_of_sequence", "heads_over_group", "heads_share", "sequence_of_heads",
           "sequence_over_group"]  # fmt: skip
