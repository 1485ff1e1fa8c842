"""Context parallel's attention over a process group: what :func:`~dpcompile.runtime.attention_regathered`
does over virtual devices, for one rank of a ``cp`` group holding its own shard of the sequence.

Not yet called by generated code (context parallelism over a ``DeviceMesh`` is not lowered yet,
``docs/context_parallel.md``): the kernel that lowering would call, checked against eager over a
gloo group (``tests/integration/test_attention_over_group.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.autograd import Function

from dpcompile.runtime.distributed import GroupLike, _all_reduce_, _gather, _group, _sizes_or_even
from dpcompile.runtime.sequence import causal_attention


class _GatherOntoOwners(Function):
    """All-gather along ``dim`` forward; backward sums every rank's gradient and keeps this rank's
    slice (a reduce-scatter, written as an all-reduce: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, sizes: tuple[int, ...]) -> torch.Tensor:
        rank = torch.distributed.get_rank(group)
        ctx.group, ctx.dim, ctx.start, ctx.length = group, dim, sum(sizes[:rank]), sizes[rank]
        return _gather(x, group, dim, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        summed = _all_reduce_(grad.contiguous().clone(), ctx.group)
        return summed.narrow(ctx.dim, ctx.start, ctx.length), None, None, None


def attention_over_group(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: GroupLike,
    dim: int,
    sizes: Sequence[int],
    positions: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """This rank's queries against every rank's keys and values, all-gathered along ``dim`` (shard
    lengths ``sizes`` in rank order, uneven allowed) here and again in backward: backward keeps this
    rank's queries, keys and values only; each key's and value's gradient is summed over the ranks
    onto its owner. ``positions``: causal at these query positions in the whole sequence, else
    ``scaled_dot_product_attention(**kwargs)`` (a mask: this rank's query rows).

    >>> out = attention_over_group(q_local, k_local, v_local, cp_group, 2, [4, 3], positions)  # doctest: +SKIP
    """
    g = _group(group)
    dim = dim % key.dim()
    shards = _sizes_or_even(key.size(dim), g, tuple(sizes))

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        keys = _GatherOntoOwners.apply(key, g, dim, shards)
        values = _GatherOntoOwners.apply(value, g, dim, shards)
        if positions is None:
            return F.scaled_dot_product_attention(query, keys, values, **kwargs)
        return causal_attention(query, keys, values, positions, **kwargs)

    if not torch.is_grad_enabled():
        return attend(query, key, value)
    return torch.utils.checkpoint.checkpoint(attend, query, key, value, use_reentrant=False, preserve_rng_state=True)


__all__ = ["attention_over_group"]
