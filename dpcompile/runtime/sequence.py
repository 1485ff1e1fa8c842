"""Context parallelism's exchanges along the sequence, as generated code calls them.

Before lowering, two identity markers say what attention needs of a value (the single-device
program still runs as it did); ``insert_scatter_gather`` lowers them to an exchange:

==========================  ===================================================================
``sequence_whole(x, dim)``  every device needs all of ``x`` along ``dim`` (attention's keys and
                            values): lowered to :func:`gather_sequence`, an all-gather
``sequence_split(x, dim)``  every device needs its own rows of ``x`` along ``dim`` (a mask's
                            query rows): lowered to a scatter of the whole value, or nothing
                            where ``x`` is split there already
==========================  ===================================================================

``causal_attention`` is causal attention of a shard of queries against every key, at their
positions in the whole sequence; ``attention_regathered`` is a device's attention that gathers the
keys and values itself and gathers them again in backward, so only their shards are kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import FakeTensor

from dpcompile.runtime.comm import gather_tensors
from dpcompile.runtime.sequence_ring import block_attention, block_attention_backward, merge_blocks


def sequence_whole(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Marker: ``x`` is needed whole along the sequence ``dim`` on every device (identity here)."""
    return x


def sequence_split(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Marker: ``x`` is needed split along the sequence ``dim``, as the queries are (identity here)."""
    return x


def gather_sequence(shards: Sequence[torch.Tensor], dim: int, device: Any) -> torch.Tensor:
    """All-gather of keys or values along the sequence: every device's shard, concatenated along
    ``dim`` on ``device``, from where each device reads it. Backward hands each shard its slice.

    >>> gather_sequence([torch.zeros(1, 2, 8), torch.ones(1, 3, 8)], 1, "cpu").shape
    torch.Size([1, 5, 8])
    """
    return gather_tensors(list(shards), dim, device)


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """``scaled_dot_product_attention(..., is_causal=True)`` of queries at the consecutive
    ``positions`` (in the whole sequence) against every key from position 0: the keys are cut
    after the last query, the queries padded in front with zeros up to the first (rows computed
    and dropped), so the causal kernel runs as it is, with no mask of queries by keys.

    >>> q, k = torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    >>> whole = F.scaled_dot_product_attention(q, k, k, is_causal=True)
    >>> torch.allclose(causal_attention(q[:, :, 3:], k, k, torch.arange(3, 5)), whole[:, :, 3:], atol=1e-6)
    True
    """
    rows = query.shape[-2]
    start = _first_position(positions, key.shape[-2], rows) if rows else 0
    key, value = key.narrow(-2, 0, start + rows), value.narrow(-2, 0, start + rows)
    if start:
        query = torch.cat([query.new_zeros(*query.shape[:-2], start, query.shape[-1]), query], dim=-2)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, **kwargs)
    return out.narrow(-2, start, rows) if start else out


def _first_position(positions: torch.Tensor, key_rows: int, rows: int) -> int:
    """The position of the first query. A fake tensor (``verify(fake_devices=)``) has no values: its
    queries are taken as the keys' last rows, which keeps the output's shape and every device."""
    if isinstance(positions, FakeTensor):
        return key_rows - rows
    return int(positions[0])


def attention_regathered(
    query: torch.Tensor,
    key_shards: Sequence[torch.Tensor],
    value_shards: Sequence[torch.Tensor],
    dim: int,
    device: Any,
    positions: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """One device's attention against every device's keys and values, all-gathered along ``dim``
    (:func:`gather_sequence`) here, and again in backward: backward keeps the queries and the
    shards, not the gathered keys and values, and runs the gather and the attention again (as
    Megatron's and torchtitan's context parallel gather again). ``positions``: causal at these
    query positions (:func:`causal_attention`), else ``scaled_dot_product_attention(**kwargs)``.
    Causal on CPU, the queries one shard of the keys' split: :class:`_CausalOverShards`, which
    keeps the output and its log-sum-exp instead of running the attention again.

    >>> q, k = torch.randn(1, 1, 4, 2, requires_grad=True), torch.randn(1, 1, 4, 2)
    >>> out = attention_regathered(q[:, :, 2:], [k[:, :, :2], k[:, :, 2:]], [k[:, :, :2], k[:, :, 2:]], 2, "cpu",
    ...                            torch.arange(2, 4))
    >>> whole = F.scaled_dot_product_attention(q, k, k, is_causal=True)
    >>> torch.allclose(out, whole[:, :, 2:], atol=1e-6)
    True
    """

    own = _own_shard(query, key_shards, value_shards, dim, positions, kwargs)
    if own is not None:  # causal on CPU: nothing gathered is kept, nothing recomputed but the gather
        n = own + 1
        return _CausalOverShards.apply(query, kwargs.get("scale"), n, *key_shards[:n], *value_shards[:n])

    def attend(query: torch.Tensor, key_shards: list[torch.Tensor], value_shards: list[torch.Tensor]) -> torch.Tensor:
        key, value = gather_sequence(key_shards, dim, device), gather_sequence(value_shards, dim, device)
        if positions is None:
            return F.scaled_dot_product_attention(query, key, value, **kwargs)
        return causal_attention(query, key, value, positions, **kwargs)

    if not torch.is_grad_enabled():
        return attend(query, list(key_shards), list(value_shards))
    return torch.utils.checkpoint.checkpoint(
        attend, query, list(key_shards), list(value_shards), use_reentrant=False, preserve_rng_state=True
    )


def _own_shard(query: torch.Tensor, key_shards: Sequence[torch.Tensor], value_shards: Sequence[torch.Tensor],
               dim: int, positions: torch.Tensor | None, kwargs: dict[str, Any]) -> int | None:  # fmt: skip
    """The index of the shard whose positions are the queries' (causal on CPU, float32/float64, the
    same heads everywhere, only ``scale=``): where :class:`_CausalOverShards` runs; else None."""
    tensors = (query, *key_shards, *value_shards)
    if positions is None or not set(kwargs) <= {"scale"} or dim % query.dim() != query.dim() - 2:
        return None
    if not all(t.device.type == "cpu" and t.dtype == query.dtype and t.shape[:-2] == query.shape[:-2] for t in tensors):
        return None
    if query.dtype not in (torch.float32, torch.float64) or not query.shape[-2]:
        return None
    start, offset = int(positions[0]), 0
    for i, shard in enumerate(key_shards):
        if offset == start:
            return i if shard.shape[-2] == query.shape[-2] else None
        offset += shard.shape[-2]
    return None


class _CausalOverShards(torch.autograd.Function):
    """Causal attention of one shard's queries against the key and value shards up to its own (the
    last ``n`` given), in two blocks of CPU flash attention: the earlier shards' keys, gathered,
    unmasked (every query follows them), and its own, causal; merged by their log-sum-exps ``l1``,
    ``l2``: ``out = o1 exp(l1 - l) + o2 exp(l2 - l)``, ``l = logaddexp(l1, l2)`` (the ring's blocks:
    :mod:`dpcompile.runtime.sequence_ring`, with the earlier shards as one block).

    Backward keeps the queries, the shards (held anyway), ``out`` and ``l``, gathers the earlier
    keys and values again and runs each block's backward kernel on the merged ``out`` and ``l``
    (each block's probabilities are its share of the whole softmax, so the gradients are exact),
    then hands each shard its slice. Nothing is padded: a late shard computes its own rows only.
    """

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, scale: float | None, n: int, *shards: torch.Tensor) -> torch.Tensor:
        keys, values = shards[:n], shards[n:]
        out, lse = block_attention(query, keys[-1], values[-1], scale, None, "diagonal", 0, 0)
        if n > 1:
            earlier = block_attention(query, torch.cat(keys[:-1], -2), torch.cat(values[:-1], -2), scale, None, "full",
                                      None, 0)  # fmt: skip
            out, lse = merge_blocks(out, lse, *earlier)
        ctx.save_for_backward(query, out, lse, *shards)
        ctx.scale, ctx.n = scale, n
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, out, lse, *shards = ctx.saved_tensors
        n, scale, grad = ctx.n, ctx.scale, grad.contiguous()
        keys, values = shards[:n], shards[n:]
        dq, dk, dv = block_attention_backward(grad, query, keys[-1], values[-1], out, lse, scale, None, "diagonal", 0, 0)
        earlier_k: tuple[torch.Tensor, ...] = ()
        earlier_v: tuple[torch.Tensor, ...] = ()
        if n > 1:
            sizes = [k.shape[-2] for k in keys[:-1]]
            dq1, dk1, dv1 = block_attention_backward(grad, query, torch.cat(keys[:-1], -2), torch.cat(values[:-1], -2),
                                                     out, lse, scale, None, "full", None, 0)  # fmt: skip
            dq = dq + dq1
            earlier_k, earlier_v = dk1.split(sizes, -2), dv1.split(sizes, -2)
        return (dq, None, None, *earlier_k, dk, *earlier_v, dv)


def causal_over_shards(query: torch.Tensor, scale: float | None, keys: Sequence[torch.Tensor],
                       values: Sequence[torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """Causal attention of the queries at the last key shard's positions against ``keys`` and
    ``values`` (shards in order, the last the queries' own): :class:`_CausalOverShards`, CPU only."""
    return _CausalOverShards.apply(query, scale, len(keys), *keys, *values)


__all__ = [
    "attention_regathered", "causal_attention", "causal_over_shards", "gather_sequence", "sequence_split",
    "sequence_whole",
]  # fmt: skip
