"""Ring attention: one device's queries against the key and value shards, one block at a time.

Context parallel's ring exchange (``context_parallel={"exchange": "ring"}``): where the all-gather
(:func:`dpcompile.runtime.sequence.attention_regathered`) concatenates every device's keys and values
before attending, the ring visits the shards one block at a time, its own first, then each other
device's in ring order (the shard of device ``r - 1``, ``r - 2``, ...); for causal attention only
the shards at or before its queries' positions are attended. Each block's attention returns its
output and log-sum-exp, merged online (``out = o1 e^(l1 - l) + o2 e^(l2 - l)``, ``l = logaddexp(l1,
l2)``), so no concatenated keys and values are ever built. A block runs on the CPU flash-attention
kernel where it applies (no mask; unmasked, or causal on the diagonal block), else on a math path
that returns the log-sum-exp too (a mask: its key columns of the block; a causal block cut
across).

Backward keeps the queries, the shards (held anyway), the merged output and log-sum-exp, and runs
each block's backward on them (each block's probabilities are its share of the whole softmax, so
the gradients are exact); each shard gets its own block's key and value gradients.

:func:`ring_attention` runs over virtual devices in one process; the same blocks move between the
ranks of a ``cp`` group by point-to-point sends in :mod:`dpcompile.runtime.sequence_ring_group`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from dpcompile.errors import DpCompileError

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
#: the keyword arguments of ``scaled_dot_product_attention`` a ring block serves (dropout only at 0)
RING_KWARGS = frozenset({"attn_mask", "scale", "enable_gqa", "dropout_p", "is_causal"})


def block_kind(query_start: int | None, rows: int, key_start: int, length: int) -> str:
    """How one block of keys is attended by queries at ``query_start ..`` (None: not causal):
    ``"full"`` (every query sees every key), ``"diagonal"`` (the same positions: causal as it is),
    ``"cut"`` (causal, the block's keys across the queries' positions otherwise) or ``"skip"``.

    >>> [block_kind(4, 2, k, 2) for k in (0, 2, 4, 6)]
    ['full', 'full', 'diagonal', 'skip']
    """
    if not rows or not length:
        return "skip"
    if query_start is None or key_start + length - 1 <= query_start:
        return "full"
    if key_start > query_start + rows - 1:
        return "skip"
    return "diagonal" if (key_start, length) == (query_start, rows) else "cut"


def _heads_of(query: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """``block``'s heads repeated to the queries' (grouped-query attention), as SDPA's ``enable_gqa``."""
    if block.dim() < 3 or block.shape[-3] == query.shape[-3]:
        return block
    return block.repeat_interleave(query.shape[-3] // block.shape[-3], dim=-3)


def _heads_summed(grad: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`_heads_of`: each key head's repeats summed."""
    if grad.shape == block.shape:
        return grad
    heads = block.shape[-3]
    return grad.unflatten(-3, (heads, grad.shape[-3] // heads)).sum(-3).reshape(block.shape)


def _uses_flash(query: torch.Tensor, mask: torch.Tensor | None, kind: str) -> bool:
    return (mask is None and kind in ("full", "diagonal") and query.device.type == "cpu"
            and query.dtype in (torch.float32, torch.float64))  # fmt: skip


def _scores(query: torch.Tensor, key: torch.Tensor, scale: float, mask: torch.Tensor | None, kind: str,
            query_start: int | None, key_start: int) -> torch.Tensor:  # fmt: skip
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if kind in ("diagonal", "cut"):
        rows, length = query.shape[-2], key.shape[-2]
        q_pos = torch.arange(query_start, query_start + rows, device=query.device)  # type: ignore[operator]
        k_pos = torch.arange(key_start, key_start + length, device=query.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return scores


def _probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(scores - lse)``, 0 on a row no key reaches (its log-sum-exp is -inf)."""
    return (scores - lse.masked_fill(lse.isneginf(), 0).unsqueeze(-1)).exp()


def block_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                    mask: torch.Tensor | None, kind: str, query_start: int | None,
                    key_start: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One block's ``(output, log-sum-exp)``: the CPU flash kernel where it applies, else the math
    (``scale`` None: the kernel's default, where the flash kernel runs)."""
    key, value = _heads_of(query, key), _heads_of(query, value)
    if _uses_flash(query, mask, kind):
        out, lse = _FLASH(query, key, value, 0.0, kind == "diagonal", scale=scale)
        return out, lse
    scores = _scores(query, key, scale, mask, kind, query_start, key_start)
    lse = torch.logsumexp(scores, -1)
    return torch.matmul(_probabilities(scores, lse), value), lse


def block_attention_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, scale: float | None, mask: torch.Tensor | None,
                             kind: str, query_start: int | None,
                             key_start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One block's ``(dq, dk, dv)`` from the merged ``out`` and ``lse``: its share of the softmax."""
    whole_key, whole_value = key, value
    key, value = _heads_of(query, key), _heads_of(query, value)
    if _uses_flash(query, mask, kind):
        dq, dk, dv = _FLASH_BACKWARD(grad, query, key, value, out, lse, 0.0, kind == "diagonal", scale=scale)
    else:
        p = _probabilities(_scores(query, key, scale, mask, kind, query_start, key_start), lse)
        dv = torch.matmul(p.transpose(-2, -1), grad)
        dp = torch.matmul(grad, value.transpose(-2, -1))
        ds = p * (dp - (grad * out).sum(-1, keepdim=True))
        dq = torch.matmul(ds, key) * scale
        dk = torch.matmul(ds.transpose(-2, -1), query) * scale
    return dq, _heads_summed(dk, whole_key), _heads_summed(dv, whole_value)


def merge_blocks(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
                 block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Two blocks' outputs merged by their log-sum-exps (a row neither reaches stays 0)."""
    if out is None or lse is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    at = merged.masked_fill(merged.isneginf(), 0)
    return out * (lse - at).exp().unsqueeze(-1) + block_out * (block_lse - at).exp().unsqueeze(-1), merged


def mask_columns(mask: torch.Tensor | None, start: int, length: int) -> torch.Tensor | None:
    """The block's key columns of a mask (a mask broadcast along the keys, whole)."""
    if mask is None or mask.shape[-1] == 1:
        return mask
    return mask.narrow(-1, start, length)


def ring_order(own: int, n: int) -> list[int]:
    """The shards a device visits: its own, then device ``own - 1``'s, ``own - 2``'s, ... (the ring).

    >>> ring_order(1, 4)
    [1, 0, 3, 2]
    """
    return [(own - step) % n for step in range(n)]


def ring_options(query: torch.Tensor, kwargs: dict[str, Any]) -> tuple[float, torch.Tensor | None]:
    """``(scale, mask)`` of a ring call's keyword arguments (the rest: what a ring block serves)."""
    unknown = set(kwargs) - RING_KWARGS
    if unknown or kwargs.get("dropout_p") not in (None, 0, 0.0) or kwargs.get("is_causal") not in (None, False):
        raise DpCompileError(
            f"ring attention cannot serve scaled_dot_product_attention's {sorted(unknown) or 'dropout or is_causal'}: "
            "use context_parallel={'exchange': 'all-gather'}"
        )
    scale = kwargs.get("scale")
    return (query.shape[-1] ** -0.5 if scale is None else float(scale)), kwargs.get("attn_mask")


def ring_attention(query: torch.Tensor, key_shards: Sequence[torch.Tensor], value_shards: Sequence[torch.Tensor],
                   dim: int, device: Any, own: int, positions: torch.Tensor | None = None,
                   **kwargs: Any) -> torch.Tensor:  # fmt: skip
    """Device ``own``'s queries against every device's key and value shards along ``dim`` (the
    keys' ``-2``), one block at a time in ring order, merged by log-sum-exp (see the module's
    docstring); ``positions``: causal at these query positions in the whole sequence, else
    ``scaled_dot_product_attention(**kwargs)`` (a mask: the device's query rows, every key column).

    >>> q, k = torch.randn(1, 1, 4, 2, requires_grad=True), torch.randn(1, 1, 4, 2)
    >>> out = ring_attention(q[:, :, 2:], [k[:, :, :2], k[:, :, 2:]], [k[:, :, :2], k[:, :, 2:]], 2, "cpu", 1,
    ...                      torch.arange(2, 4))
    >>> whole = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True)
    >>> torch.allclose(out, whole[:, :, 2:], atol=1e-6)
    True
    """
    if dim % query.dim() != query.dim() - 2:
        raise DpCompileError(f"ring attention runs along the keys' dim -2, not {dim}: use the all-gather exchange")
    scale, mask = ring_options(query, kwargs)
    if isinstance(positions, FakeTensor):  # no values (verify(fake_devices=)): the queries at their own shard's keys
        start = sum(int(k.shape[-2]) for k in key_shards[:own])
    else:
        start = int(positions[0]) if positions is not None and query.shape[-2] else None
        if positions is not None and start is None:
            start = 0
    plan = (scale, start, own, [int(k.shape[-2]) for k in key_shards])
    return _RingOverShards.apply(query, plan, mask, *key_shards, *value_shards)


def _blocks(plan: tuple[float, int | None, int, list[int]], rows: int) -> list[tuple[int, int, str]]:
    """``(shard, key offset, kind)`` of each block a device attends, in ring order."""
    _scale, start, own, lengths = plan
    offsets = [sum(lengths[:j]) for j in range(len(lengths))]
    out = []
    for j in ring_order(own, len(lengths)):
        kind = block_kind(start, rows, offsets[j], lengths[j])
        if kind != "skip":
            out.append((j, offsets[j], kind))
    return out


class _RingOverShards(torch.autograd.Function):
    """:func:`ring_attention`'s blocks, forward and backward (nothing concatenated, nothing recomputed
    but each block's scores in its backward kernel)."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, plan: Any, mask: torch.Tensor | None,
                *shards: torch.Tensor) -> torch.Tensor:  # fmt: skip
        if mask is not None and mask.requires_grad:
            raise DpCompileError("ring attention: a mask that needs a gradient (a learned bias) is the all-gather's to "
                                 "serve: use context_parallel={'exchange': 'all-gather'}")  # fmt: skip
        n = len(shards) // 2
        scale, start = plan[0], plan[1]
        out = lse = None
        for j, offset, kind in _blocks(plan, query.shape[-2]):
            key, value = shards[j].to(query.device), shards[n + j].to(query.device)
            o, lse_j = block_attention(query, key, value, scale, mask_columns(mask, offset, key.shape[-2]), kind,
                                       start, offset)  # fmt: skip
            out, lse = merge_blocks(out, lse, o, lse_j)
        if out is None or lse is None:  # no query rows here
            value = shards[n]
            out = query.new_zeros(*query.shape[:-1], value.shape[-1])
            lse = query.new_full(query.shape[:-1], float("-inf"))
        ctx.save_for_backward(query, out, lse, mask, *shards)
        ctx.plan = plan
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, out, lse, mask, *shards = ctx.saved_tensors
        n, (scale, start) = len(shards) // 2, ctx.plan[:2]
        grad = grad.contiguous()
        dq = torch.zeros_like(query)
        grads: list[torch.Tensor | None] = [None] * (2 * n)
        for j, offset, kind in _blocks(ctx.plan, query.shape[-2]):
            key, value = shards[j].to(query.device), shards[n + j].to(query.device)
            dq_j, dk, dv = block_attention_backward(grad, query, key, value, out, lse, scale,
                                                    mask_columns(mask, offset, key.shape[-2]), kind, start, offset)  # fmt: skip
            dq = dq + dq_j
            grads[j], grads[n + j] = dk.to(shards[j].device), dv.to(shards[n + j].device)
        return (dq, None, None, *grads)


__all__ = [
    "RING_KWARGS", "block_attention", "block_attention_backward", "block_kind", "mask_columns", "merge_blocks",
    "ring_attention", "ring_options", "ring_order",
]  # fmt: skip
