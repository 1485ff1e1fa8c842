"""FSDP's DTensor parameters in checkpoints, and the gathers a save makes over a mesh.

A program built with ``data_parallel="fsdp"`` holds each parameter as a ``DTensor`` sharded over
the ``dp`` processes (FSDP2: ``Shard(0)``, ``torch.chunk``'s rows). :func:`localize` rewrites the
checkpoint targets of such parameters so that the rest of the checkpoint code sees plain tensors:

* loading: the piece is this rank's local rows (``DTensor.to_local()``, which shares the
  parameter's memory) with the rows of the full tensor it holds (a :class:`ShardSpec` of three
  parts: before, this rank's, after), so each rank reads only its own slice of the file (on a
  ``("dp", "tp")`` mesh, where FSDP's rows and the tensor-parallel split lie on different dims,
  the rank reads its tensor-parallel slice and keeps its rows of it);
* saving: ``target.gather()`` puts one tensor together at a time (``full_tensor()`` over ``dp``,
  then the tensor-parallel all-gather over ``tp`` where the shard is one), on every rank.

Before every gather the ranks exchange a status (:func:`check_peers`): a rank that failed
(its disk, its path) says so at the next step instead of leaving the others waiting, and every
rank raises (:mod:`dpcompile.checkpoint.agreement`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dpcompile.checkpoint.files import CheckpointError
from dpcompile.mesh import is_device_mesh
from dpcompile.modules.executors import executor_of
from dpcompile.runtime.distributed import MeshGroup, all_gather
from dpcompile.runtime.rank_device import group_device
from dpcompile.runtime.tensor_parallel import ShardSpec, regroup_sections

__all__ = ["PeerFailed", "RowsOf", "check_peers", "gather_like", "is_dtensor", "localize", "ranks_of", "signal"]


class PeerFailed(CheckpointError):
    """Another rank of the mesh failed during the same save or load; this one stops with it."""


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def ranks_of(pm: Any) -> tuple[bool, Any]:
    """``(over processes, group)``: whether ``pm`` runs over a ``DeviceMesh`` of processes, and
    the process group of all its ranks (None: the default group, where the mesh spans it; a
    mesh over part of the processes: its own group, where it has one dim)."""
    import torch.distributed as dist

    mesh = getattr(pm, "mesh", None)
    if dist.is_available() and dist.is_initialized() and executor_of(pm).runs_one_stage_per_rank:
        return True, None  # a pipeline's stage over a mesh: every rank holds part of the model
    if not (dist.is_available() and dist.is_initialized() and is_device_mesh(mesh)):
        return False, None
    if mesh.size() == dist.get_world_size():
        return True, None
    return (True, mesh.get_group()) if mesh.ndim == 1 else (False, None)


def signal(failed: bool, group: Any = None) -> bool:
    """One status exchange between the ranks of ``group``: True where any reports a failure."""
    import torch.distributed as dist

    flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=group_device(group))  # NCCL: not on the CPU
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def check_peers(pm: Any) -> None:
    """Before a gather: raise :class:`PeerFailed` where another rank has failed (it sent its
    failure to this exchange instead of its part of the gather)."""
    over, group = ranks_of(pm)
    if over and signal(False, group):
        raise PeerFailed("another rank failed during this checkpoint; see its error")


def localize(pm: Any, targets: dict[str, Any]) -> None:
    """In place: each target of ``targets`` held by a DTensor reads and writes through this
    rank's local part, and each target whose full value needs other ranks (FSDP's or
    tensor-parallel shards over a mesh) gets ``gather``."""
    done: dict[int, tuple[Any, ShardSpec | None, int, Callable[[], torch.Tensor]]] = {}
    for key, target in targets.items():
        if not target.pieces:
            continue  # another stage of a pipeline holds it
        piece = target.pieces[0]
        tensor = piece.tensor
        if not is_dtensor(tensor):
            if not target.gathered:
                target.gather = _tensor_parallel_gather(pm, piece.tensor, piece.spec)
            continue
        if id(tensor) not in done:  # ties: one tensor, one local piece
            local, spec, index = _local_piece(key, target.shape, tensor, piece.spec, piece.index)
            done[id(tensor)] = (local, spec, index, _dtensor_gather(pm, tensor, piece.spec))
        local, spec, index, gather = done[id(tensor)]
        piece.tensor, piece.spec, piece.index = local, spec, index
        target.gathered, target.gather = False, gather


def _local_piece(
    key: str, full_shape: tuple[int, ...], tensor: Any, outer: ShardSpec | None, outer_index: int
) -> tuple[Any, ShardSpec | None, int]:
    """``(piece tensor, spec, index)``: this rank's part of the full tensor ``key`` as the load reads it.

    One block of rows of the full tensor (FSDP alone, or over a tensor-parallel shard split on
    the same dim): the local tensor and a spec of three parts (before, this rank's, after).
    FSDP's rows of a shard split on another dim (a row-parallel weight) or of a fused
    projection: the tensor-parallel shard is read and this rank's rows are cut from it
    (:class:`RowsOf`)."""
    starts, sizes = _local_region(tensor)
    partial = [d for d, (s, n) in enumerate(zip(starts, sizes)) if (s, n) != (0, tensor.shape[d])]
    local = tensor.to_local()
    if not partial:
        return local, outer, outer_index
    if len(partial) > 1:
        raise CheckpointError(f"'{key}': this rank's part is split on dims {partial}, not one block of rows")
    dim = partial[0]
    start, size = starts[dim], sizes[dim]
    if outer is None or (outer.dim == dim and outer.sections == 1):
        start += 0 if outer is None else outer.offsets()[outer_index]
        return local, ShardSpec(dim, (start, size, full_shape[dim] - start - size)), 1
    return RowsOf(local, dim, start, size), outer, outer_index


class RowsOf:
    """FSDP's rows ``start:start + size`` (along ``dim``) of a tensor-parallel shard, held in
    ``local``: a load reads the shard and copies this rank's rows out of it."""

    def __init__(self, local: torch.Tensor, dim: int, start: int, size: int):
        self.local, self.dim, self.start, self.size = local, dim, start, size

    def copy_(self, shard: torch.Tensor) -> RowsOf:
        self.local.copy_(shard.narrow(self.dim, self.start, self.size))
        return self

    def element_size(self) -> int:
        return self.local.element_size()


def _local_region(tensor: Any) -> tuple[list[int], list[int]]:
    """Start and size per dim of this rank's local part of ``tensor`` (a DTensor): ``Shard(d)``
    placements split as ``torch.chunk`` does, one mesh dim after another; others hold it whole."""
    from torch.distributed.tensor import Shard

    starts, sizes = [0] * tensor.dim(), list(tensor.shape)
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        raise CheckpointError("this rank is not in the mesh its parameters are sharded over")
    for mesh_dim, placement in enumerate(tensor.placements):
        if not isinstance(placement, Shard):
            continue
        d, world, rank = placement.dim, tensor.device_mesh.size(mesh_dim), coordinate[mesh_dim]
        chunk = -(-sizes[d] // world)
        begin = min(rank * chunk, sizes[d])
        starts[d] += begin
        sizes[d] = max(0, min(chunk, sizes[d] - begin))
    return starts, sizes


def gather_like(pm: Any, tensor: Any, spec: ShardSpec | None) -> Callable[[], torch.Tensor]:
    """A collective giving the full tensor of ``tensor`` on the CPU, laid out as a parameter:
    a DTensor's rows (FSDP), then the tensor-parallel shards under ``spec``, as for a weight."""
    if is_dtensor(tensor):
        return _dtensor_gather(pm, tensor, spec)
    return _tensor_parallel_gather(pm, tensor, spec)


def _dtensor_gather(pm: Any, tensor: Any, outer: ShardSpec | None) -> Callable[[], torch.Tensor]:
    def gather() -> torch.Tensor:
        check_peers(pm)
        with torch.no_grad():
            value = tensor.detach().full_tensor()
        return _gather_tensor_parallel(pm, value, outer) if outer is not None else value.to("cpu")

    return gather


def _tensor_parallel_gather(pm: Any, tensor: torch.Tensor, spec: ShardSpec | None) -> Callable[[], torch.Tensor]:
    def gather() -> torch.Tensor:
        check_peers(pm)
        return _gather_tensor_parallel(pm, tensor.detach(), spec)

    return gather


def _gather_tensor_parallel(pm: Any, shard: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    if spec is None:
        return shard.to("cpu")
    with torch.no_grad():
        gathered = all_gather(shard, MeshGroup(pm.mesh, pm.tp_dim).group, dim=spec.dim, sizes=list(spec.sizes))
    return regroup_sections(gathered, spec).to("cpu")
