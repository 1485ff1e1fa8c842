"""DTensors made whole together: one all-gather per mesh and dtype, not one per tensor.

A ``state_dict()`` of an FSDP program makes every parameter whole. ``DTensor.full_tensor()`` one at
a time is a collective per parameter (DTensor's dispatch, then a gloo round trip each); FSDP's row
shards (``Shard(0)`` over a 1-D mesh) of one dtype are gathered in one flat buffer instead::

    rank 0 holds rows 0-1 of w (3 x 2) and rows 0-1 of b (4,); rank 1 rows 2 of w and 2-3 of b
    flat on rank r: w's rows padded to 2 rows, then b's padded to 2  ->  all_gather_single
    whole w: the ranks' first 4 elements, as (4, 2), rows [:3]; whole b: the next 2 of each, [:4]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist


def _gathered_by_rows(value: Any) -> bool:
    """A DTensor sharded by rows over a 1-D mesh, with no gradient to keep (a state_dict's values)."""
    from torch.distributed.tensor import DTensor, Shard

    return (
        isinstance(value, DTensor) and value.device_mesh.ndim == 1 and value.dim() > 0 and not value.requires_grad
        and len(value.placements) == 1 and type(value.placements[0]) is Shard and value.placements[0].dim == 0
    )  # fmt: skip


def full_tensors(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with every DTensor whole (``full_tensor()``'s values), anything else as it is.

    Row shards over a 1-D mesh are gathered together, one ``all_gather_single`` per (mesh,
    dtype); any other DTensor by its own ``full_tensor()``. A collective: every rank of the meshes
    calls it with the same keys in the same order (as ``state_dict()`` gives them)."""
    from torch.distributed.tensor import DTensor

    out = dict(values)
    together: dict[tuple[Any, torch.dtype], list[str]] = {}
    for key, value in values.items():
        if _gathered_by_rows(value):
            together.setdefault((value.device_mesh, value.dtype), []).append(key)
        elif isinstance(value, DTensor):
            out[key] = value.full_tensor()
    for (mesh, dtype), keys in together.items():
        out.update(_gather_rows(mesh, dtype, {key: values[key] for key in keys}))
    return out


def _gather_rows(mesh: Any, dtype: torch.dtype, shards: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The whole tensors of ``shards`` (DTensors of ``dtype``, rows split as ``torch.chunk`` splits
    them: ``ceil(rows / world)`` a rank, the last ranks fewer or none) from one all-gather."""
    world = mesh.size()
    pieces, layout = [], []
    for key, shard in shards.items():
        rows, rest = shard.shape[0], tuple(shard.shape[1:])
        chunk, per_row = -(-rows // world), math.prod(rest)
        local = shard.to_local().detach().reshape(-1)
        padded = local.new_zeros(chunk * per_row)
        padded[: local.numel()] = local
        pieces.append(padded)
        layout.append((key, rows, rest, chunk))
    flat = torch.cat(pieces)
    gathered = flat.new_empty(world * flat.numel())
    dist.all_gather_single(gathered, flat, group=mesh.get_group())
    by_rank = gathered.view(world, flat.numel())
    out, offset = {}, 0
    for key, rows, rest, chunk in layout:
        size = chunk * math.prod(rest)
        out[key] = by_rank[:, offset : offset + size].reshape(world * chunk, *rest)[:rows].clone()
        offset += size
    return out


__all__ = ["full_tensors"]
