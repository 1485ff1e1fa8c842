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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dpcompile.runtime.comm import gather_tensors


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


__all__ = ["gather_sequence", "sequence_split", "sequence_whole"]
