"""Causal load balancing of context parallel's attention: zig-zag chunks, as generated code calls it.

Under causal attention, a device whose queries sit late in the sequence attends more keys: with the
sequence split into ``N`` contiguous shards, the last device does about ``2N - 1`` times the first
one's work. Inside the attention call only, the sequence is cut into ``2N`` balanced chunks and
device ``r`` computes the queries of chunks ``r`` and ``2N - 1 - r`` (one early, one late: the
zig-zag layout of Megatron's and torchtitan's context parallel), each against the keys up to its
chunk's end; the query rows are exchanged before and the output rows sent back after, so every op
outside attention still runs on the device's own contiguous tokens.

==================================================  ==========================================================
one process (device ``r`` of ``N``)                  rank ``r`` of a ``cp`` group
==================================================  ==========================================================
``balanced_attention([q_0, ...], [k_0, ...],         ``balanced_attention_over_group(q_r, k_r, v_r, cp_group,
[v_0, ...], dim, r)``: ``r``'s chunks' outputs       dim, sizes)``: the query rows and the output rows moved
``balanced_rows_back([o_0, ...], dim, r)``:          by ``dist.all_to_all_single`` (gloo has it on CPU, uneven
device ``r``'s own rows, in order                    splits too), keys and values all-gathered as today
==================================================  ==========================================================

Exact in backward: the exchanges are plain differentiable ops (``narrow``, ``cat``, ``to``) or an
all-to-all whose backward is the reverse all-to-all. Lengths that do not divide by ``2N`` get
balanced uneven chunks (``tensor_split`` sizes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from dpcompile.errors import DpCompileError
from dpcompile.runtime.rank_device import group_device
from dpcompile.runtime.sequence import causal_over_shards
from dpcompile.runtime.sequence_all_to_all import exchange_pieces
from dpcompile.runtime.sequence_mesh import balanced_sizes


def _bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


#: ``load_balance="auto"``: the shortest sequence (tokens) whose causal attention is balanced over a
#: mesh; below it the two all-to-alls cost more than the work they even out (``docs/context_parallel.md``)
AUTO_MIN_LENGTH = 1024


def zigzag_chunks(length: int, world: int, rank: int, balanced: bool = True) -> list[tuple[int, int]]:
    """The ``(start, end)`` positions of device ``rank``'s two chunks: ``rank`` and ``2N - 1 - rank``
    (not ``balanced``: its own contiguous shard).

    >>> zigzag_chunks(8, 2, 0), zigzag_chunks(8, 2, 1), zigzag_chunks(8, 2, 1, balanced=False)
    ([(0, 2), (6, 8)], [(2, 4), (4, 6)], [(4, 8)])
    """
    if not balanced:
        return [_bounds(balanced_sizes(length, world))[rank]]
    chunks = _bounds(balanced_sizes(length, 2 * world))
    return [chunks[rank], chunks[2 * world - 1 - rank]]


@dataclass(frozen=True)
class Piece:
    """Rows ``[source_start, source_start + length)`` of device ``owner``'s shard, which are rows
    ``[dest_start, ...)`` of device ``dest``'s zig-zag queries (its two chunks, in position order)."""

    owner: int
    dest: int
    source_start: int
    dest_start: int
    length: int


def zigzag_pieces(sizes: Sequence[int], balanced: bool = True) -> list[Piece]:
    """Where every device's contiguous rows (``sizes``, in device order) go in the zig-zag layout.

    >>> [(p.owner, p.dest, p.source_start, p.dest_start, p.length) for p in zigzag_pieces([4, 4])]
    [(0, 0, 0, 0, 2), (1, 0, 2, 2, 2), (0, 1, 2, 0, 2), (1, 1, 0, 2, 2)]
    """
    world, owners = len(sizes), _bounds(sizes)
    pieces = []
    for dest in range(world):
        offset = 0
        for start, end in zigzag_chunks(sum(sizes), world, dest, balanced):
            for owner, (s, e) in enumerate(owners):
                lo, hi = max(start, s), min(end, e)
                if lo < hi:
                    pieces.append(Piece(owner, dest, lo - s, offset, hi - lo))
                    offset += hi - lo
    return pieces


def causal_rows_keys(length: int, world: int, balanced: bool) -> list[int]:
    """Each device's causal attention work, counted as the (query row, key) pairs it computes:
    contiguous shards (``balanced=False``: row ``i`` of the whole sequence sees ``i + 1`` keys) or
    the zig-zag chunks.

    >>> causal_rows_keys(8, 2, False), causal_rows_keys(8, 2, True)
    ([10, 26], [18, 18])
    """

    def pairs(start: int, end: int) -> int:
        return (end * (end + 1) - start * (start + 1)) // 2

    if not balanced:
        return [pairs(s, e) for s, e in _bounds(balanced_sizes(length, world))]
    return [sum(pairs(s, e) for s, e in zigzag_chunks(length, world, r)) for r in range(world)]


def _attention_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    options = dict(kwargs)
    if options.get("dropout_p") in (0, 0.0):
        del options["dropout_p"]
    if options.get("dropout_p"):
        raise DpCompileError("context parallel's load-balanced attention does not run dropout: pass load_balance=False")
    return options


def _fast_kernel(query: torch.Tensor, key: torch.Tensor, options: dict[str, Any]) -> bool:
    """CPU flash attention in two blocks (``_CausalOverShards``): CPU, float32/float64, the same
    heads for queries and keys, only ``scale=``."""
    return (set(options) <= {"scale"} and query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64)
            and key.dtype == query.dtype and key.shape[:-2] == query.shape[:-2])  # fmt: skip


def _sees_a_later_key(mask: torch.Tensor, end: int) -> bool:
    """Whether a mask's rows let a query see a key at ``end`` or later (bool: True there; float: not -inf)."""
    if mask.shape[-1] <= end:
        return False
    tail = mask[..., end:]
    return bool(tail.any()) if mask.dtype == torch.bool else bool((tail != float("-inf")).any())


def _not_causal(name: str) -> DpCompileError:
    return DpCompileError(
        f"context_parallel={{'load_balance': True}}: attention '{name}' is not causal: its mask lets a query see a "
        "later key, so there is no work to balance; pass load_balance='auto' (leaves such calls unbalanced) or False"
    )


def _chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, start: int, end: int,
                     options: dict[str, Any], mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Causal attention of the queries at positions ``[start, end)`` against keys ``[0, end)`` (dim -2).
    With ``mask`` (its rows for these queries, every key): the keys up to ``end`` where the mask hides
    every later one (a causal mask, padded or not), else every key (exact either way)."""
    rows = end - start
    if rows == 0:
        return query.new_zeros(*query.shape[:-1], value.shape[-1])
    if mask is not None:
        seen = key.shape[-2] if _sees_a_later_key(mask, end) else end
        return F.scaled_dot_product_attention(query, key.narrow(-2, 0, seen), value.narrow(-2, 0, seen),
                                              attn_mask=mask.narrow(-1, 0, seen), **options)  # fmt: skip
    if _fast_kernel(query, key, options):
        keys = [key.narrow(-2, 0, start), key.narrow(-2, start, rows)] if start else [key.narrow(-2, 0, rows)]
        values = [value.narrow(-2, 0, start), value.narrow(-2, start, rows)] if start else [value.narrow(-2, 0, rows)]
        return causal_over_shards(query, options.get("scale"), keys, values)
    mask = torch.ones(rows, end, dtype=torch.bool, device=query.device).tril(start)  # row i sees keys <= start + i
    return F.scaled_dot_product_attention(query, key.narrow(-2, 0, end), value.narrow(-2, 0, end), attn_mask=mask,
                                          **options)  # fmt: skip


def zigzag_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, length: int, world: int, rank: int,
                     options: dict[str, Any], balanced: bool = True, mask: torch.Tensor | None = None,
                     must_balance: str | None = None) -> torch.Tensor:  # fmt: skip
    """Device ``rank``'s two chunks' causal attention: ``query`` (and ``mask``) hold their rows (dim
    -2) in position order, ``key`` and ``value`` the whole sequence. ``must_balance``: the attention's
    name, a ``DpCompileError`` where the mask lets a chunk's query see a key past the chunk."""
    outs, offset = [], 0
    for start, end in zigzag_chunks(length, world, rank, balanced):
        part = query.narrow(-2, offset, end - start)
        rows = mask.narrow(-2, offset, end - start) if mask is not None else None
        if must_balance and rows is not None and end > start and _sees_a_later_key(rows, end):
            raise _not_causal(must_balance)
        outs.append(_chunk_attention(part, key, value, start, end, options, rows))
        offset += end - start
    return torch.cat(outs, -2)


def _check_sequence_dim(query: torch.Tensor, dim: int) -> None:
    if dim % query.dim() != query.dim() - 2:
        raise DpCompileError(f"load-balanced attention splits dim -2 of (batch, heads, seq, head_dim); got dim {dim}")


def balanced_attention(
    query_shards: Sequence[torch.Tensor],
    key_shards: Sequence[torch.Tensor],
    value_shards: Sequence[torch.Tensor],
    dim: int,
    rank: int,
    min_length: int = 0,
    masks: Sequence[torch.Tensor] | None = None,
    must_balance: str | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Device ``rank``'s zig-zag chunks of causal self-attention: their query rows taken from the
    devices that hold them, every device's keys and values gathered, on ``query_shards[rank]``'s
    device. Returns the two chunks' output rows in position order (:func:`balanced_rows_back`
    hands them back). A sequence shorter than ``min_length``: the device's own rows, unbalanced.
    ``masks``: every device's rows of an attention mask (transformers' causal mask), moved with the
    queries; a chunk whose mask rows show a later key attends every key (exact, not balanced), or,
    ``must_balance`` (``load_balance=True``: the attention's name), is a ``DpCompileError``.

    >>> q = torch.randn(1, 1, 8, 4)
    >>> whole = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    >>> shards = list(q.split(4, 2))
    >>> outs = [balanced_attention(shards, shards, shards, 2, r) for r in range(2)]
    >>> torch.allclose(balanced_rows_back(outs, 2, 1), whole[:, :, 4:], atol=1e-6)
    True
    """
    query = query_shards[rank]
    _check_sequence_dim(query, dim)
    sizes = [q.shape[-2] for q in query_shards]
    world, length = len(sizes), sum(sizes)
    if sizes != balanced_sizes(length, world) or sum(k.shape[-2] for k in key_shards) != length:
        raise DpCompileError(
            f"load-balanced causal attention needs self-attention over balanced shards: queries {sizes}, keys "
            f"{[k.shape[-2] for k in key_shards]}; pass context_parallel={{'load_balance': False}}"
        )
    device, balanced = query.device, length >= min_length
    pieces = [p for p in zigzag_pieces(sizes, balanced) if p.dest == rank]
    key = torch.cat([k.to(device) for k in key_shards], -2)
    value = torch.cat([v.to(device) for v in value_shards], -2)
    mine, mask = _rows_of(query_shards, pieces, device), _rows_of(masks, pieces, device) if masks else None
    return zigzag_attention(mine, key, value, length, world, rank, _attention_options(kwargs), balanced, mask,
                            must_balance)  # fmt: skip


def _rows_of(shards: Sequence[torch.Tensor], pieces: Sequence[Piece], device: Any) -> torch.Tensor:
    """The ``pieces``' rows (dim -2) of every device's shard, in order, on ``device``."""
    parts = [shards[p.owner].narrow(-2, p.source_start, p.length).to(device) for p in pieces]
    return torch.cat(parts or [shards[0].narrow(-2, 0, 0).to(device)], -2)


def balanced_rows_back(outputs: Sequence[torch.Tensor], dim: int, rank: int, min_length: int = 0) -> torch.Tensor:
    """Device ``rank``'s own contiguous rows of the attention output, from every device's zig-zag
    chunks (``outputs``: :func:`balanced_attention`'s, in device order), on ``outputs[rank]``'s device."""
    own = outputs[rank]
    _check_sequence_dim(own, dim)
    world = len(outputs)
    length = sum(o.shape[-2] for o in outputs)
    pieces = [p for p in zigzag_pieces(balanced_sizes(length, world), length >= min_length) if p.owner == rank]
    pieces.sort(key=lambda p: p.source_start)
    parts = [outputs[p.dest].narrow(-2, p.dest_start, p.length).to(own.device) for p in pieces]
    return torch.cat(parts or [own.narrow(-2, 0, 0)], -2)


class _AllToAllRows(Function):
    """Rows along dim -2 exchanged (:func:`~dpcompile.runtime.sequence_all_to_all.exchange_pieces`):
    ``send[j]`` rows to rank ``j``, ``recv[i]`` rows from rank ``i``; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return exchange_pieces(x, group, -2, send, -2, recv)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return exchange_pieces(grad, ctx.group, -2, ctx.recv, -2, ctx.send), None, None, None


def balanced_attention_over_group(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: Any,
    dim: int,
    sizes: Sequence[int],
    min_length: int = 0,
    mask: torch.Tensor | None = None,
    must_balance: str | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """This rank's rows of causal self-attention over a ``cp`` group, its work balanced: the query
    rows of its two zig-zag chunks received from their owners (one all-to-all), attended against the
    whole keys and values (all-gathered, their gradients summed onto the owners), and the output rows
    sent back to their owners (the reverse all-to-all). ``sizes``: every rank's length, rank order; a
    sequence shorter than ``min_length`` runs the unbalanced call, as it was (``attention_over_group``). ``mask``:
    this rank's rows of an attention mask, moved with the query rows (as :func:`balanced_attention`);
    ``must_balance``: a mask that lets a query see a later key is a ``DpCompileError`` on every rank
    (each rank checks its own rows, one all-reduce of the answer).

    >>> out = balanced_attention_over_group(q_local, k_local, v_local, cp_group, 2, [4, 3])  # doctest: +SKIP
    """
    from dpcompile.runtime.distributed import attention_over_group, gather_onto_owners, process_group

    g = process_group(group)
    _check_sequence_dim(query, dim)
    rank, world, sizes = dist.get_rank(g), dist.get_world_size(g), [int(s) for s in sizes]
    if must_balance and mask is not None:
        start = sum(sizes[:rank])
        later = torch.ones(mask.shape[-2], mask.shape[-1], dtype=torch.bool, device=mask.device).triu(start + 1)
        seen = (mask & later) if mask.dtype == torch.bool else (mask != float("-inf")) & later
        flag = torch.tensor([float(bool(seen.any()))], device=group_device(g))  # an NCCL group refuses CPU tensors
        dist.all_reduce(flag, group=g)
        if flag.item():
            raise _not_causal(must_balance)
    if sum(sizes) < min_length:  # the unbalanced call, as it was
        start = sum(sizes[:rank])
        if mask is None:
            positions = torch.arange(start, start + sizes[rank], device=query.device)
        else:
            positions, kwargs = None, {**kwargs, "attn_mask": mask}
        return attention_over_group(query, key, value, g, dim, sizes, positions, **kwargs)
    keys, values = gather_onto_owners(key, g, -2, sizes), gather_onto_owners(value, g, -2, sizes)
    options, length = _attention_options(kwargs), sum(sizes)
    pieces = zigzag_pieces(sizes)
    out_of = sorted((p for p in pieces if p.owner == rank), key=lambda p: p.dest)  # send order: by destination
    send = [sum(p.length for p in out_of if p.dest == j) for j in range(world)]
    recv = [sum(p.length for p in pieces if p.dest == rank and p.owner == i) for i in range(world)]
    mine = _AllToAllRows.apply(_rows_of([query] * world, out_of, query.device), g, send, recv)
    if mask is not None:
        rows = _rows_of([mask] * world, out_of, mask.device)
        mask = _AllToAllRows.apply(rows, g, send, recv)
    out = zigzag_attention(mine, keys, values, length, world, rank, options, mask=mask)
    back = _AllToAllRows.apply(out, g, recv, send)  # in send order; this rank's rows put back in position order
    offsets = [sum(p.length for p in out_of[:i]) for i in range(len(out_of))]
    order = sorted(range(len(out_of)), key=lambda i: out_of[i].source_start)
    parts = [back.narrow(-2, offsets[i], out_of[i].length) for i in order]
    return torch.cat(parts or [back.narrow(-2, 0, 0)], -2)


__all__ = [
    "AUTO_MIN_LENGTH", "Piece", "balanced_attention", "balanced_attention_over_group", "balanced_rows_back", "balanced_sizes",
    "causal_rows_keys", "zigzag_attention", "zigzag_chunks", "zigzag_pieces",
]  # fmt: skip
