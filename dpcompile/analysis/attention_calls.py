"""What the planner's fake run records of each scaled-dot-product attention call of a unit
(``model_profile.Unit``): its keys' and values' bytes, FLOPs, causality and heads
(:func:`record_attention`), and where its q, k, v come from and the masks it reads (:func:`attention_reads`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["CAUSAL_AT", "attention_reads", "record_attention"]

#: where each scaled-dot-product attention op takes ``is_causal`` (its position in the op's arguments)
CAUSAL_AT = {"_scaled_dot_product_flash_attention_for_cpu": 4, "_scaled_dot_product_flash_attention": 4,
             "_scaled_dot_product_efficient_attention": 6, "_scaled_dot_product_cudnn_attention": 6,
             "_scaled_dot_product_attention_math": 5, "scaled_dot_product_attention": 5}  # fmt: skip


def record_attention(unit: Any, op: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """One attention call ``op(*args, **kwargs)`` of ``unit``: its keys' and values' bytes, its FLOPs
    (two matmuls of the queries by the keys' length), and whether it is causal (``is_causal``)."""
    query, key, value = args[:3]
    unit.attention_kv_bytes += sum(t.numel() * t.element_size() for t in (key, value))
    rows = query.numel() // query.shape[-1]  # batch x heads x queries
    unit.attention_flops += 4.0 * rows * key.shape[-2] * query.shape[-1]
    at = CAUSAL_AT.get(op)
    causal = kwargs.get("is_causal", args[at] if at is not None and len(args) > at else False)
    unit.attention_causal = unit.attention_causal and causal is True
    if query.dim() == 4 and not unit.attention_heads:  # (batch, heads, queries, head width)
        unit.attention_heads, unit.attention_width = int(query.shape[1]), int(query.shape[1] * query.shape[-1])


def attention_reads(unit: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
                    column_of: Callable[[torch.Tensor], tuple[int, int] | None]) -> list[torch.Tensor]:  # fmt: skip
    """Adds to ``unit.attention_columns`` the (rows, cols) of the column layers whose pairs' values the call
    reads as q, k, v (``column_of``: a value's, through views and rotations; None where none), and returns
    the masks (or biases) it reads beside them."""
    for t in args[:3]:
        column = column_of(t) if isinstance(t, torch.Tensor) else None
        if column is not None:
            unit.attention_columns.add(column)
    return [t for t in [*args[3:], *kwargs.values()] if isinstance(t, torch.Tensor) and t.dim() >= 2]
