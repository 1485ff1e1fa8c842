"""DeviceMesh helpers: is it a mesh, which mode it asks for, this process's device and batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dpcompile.errors import ArgumentError, DpCompileError
from dpcompile.runtime.rank_device import process_device
from dpcompile.runtime.structures import map_structure

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover - torch built without distributed
    DeviceMesh = None


def is_device_mesh(devices: object) -> bool:
    return DeviceMesh is not None and isinstance(devices, DeviceMesh)


def keywords_named_by(devices: Any, *, pipeline: Any, tensor_parallel: Any) -> tuple[Any, Any]:
    """``(pipeline, tensor_parallel)`` with what a ``DeviceMesh``'s dimension names turn on, as
    ``mesh=`` over a device list does: a ``"pp"`` dimension of size ``S > 1`` is ``pipeline=S`` (unless
    ``pipeline=`` names the cuts), a ``"tp"`` dimension is ``tensor_parallel=True`` (unless a plan is
    given). Anything else (a device list, a ``("dp",)`` or unnamed mesh) passes through.

    Before, ``init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))`` ran data parallel."""
    if not is_device_mesh(devices):
        return pipeline, tensor_parallel
    names = tuple(devices.mesh_dim_names or ())
    if "pp" in names and pipeline is None and devices.size(names.index("pp")) > 1:
        pipeline = devices.size(names.index("pp"))
    if "tp" in names and (tensor_parallel is False or tensor_parallel is None):
        tensor_parallel = True
    return pipeline, tensor_parallel


def check_mesh(mesh: Any, tensor_parallel: object) -> tuple[str, str | int | None, str | int | None]:
    """``(mode, dp_dim, tp_dim)`` for ``mesh`` and the ``tensor_parallel`` option."""
    if not dist.is_available() or not dist.is_initialized():
        raise ArgumentError(
            "a DeviceMesh needs an initialised process group: call torch.distributed.init_process_group() "
            "(torchrun sets the environment) before transform(model, mesh)"
        )
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    wants_tp = tensor_parallel is not False and tensor_parallel is not None
    if names in (("cp",), ("dp", "cp")):
        if wants_tp:
            raise DpCompileError(
                f"tensor_parallel= with a {names} mesh is not built yet: context parallel over a mesh splits the "
                "sequence (and the batch over 'dp') alone; leave tensor_parallel= out, or use a ('cp', 'tp'), ('tp',) "
                "or ('dp', 'tp') mesh"
            )
        return "spmd_context_parallel", names[0], None
    if names == ("cp", "tp"):  # the tensor-parallel program on this rank's part of the sequence
        if not wants_tp:
            raise DpCompileError(
                "a ('cp', 'tp') mesh needs tensor_parallel=True or a plan (its 'tp' dim shards the layers); for "
                "context parallel alone pass a ('cp',) mesh"
            )
        return "spmd_context_tensor_parallel", "cp", "tp"
    if mesh.ndim == 1:
        dim: str | int = names[0] if names else 0
        if wants_tp:
            return "spmd_tensor_parallel", None, dim
        return "spmd_data_parallel", dim, None
    if mesh.ndim == 2:
        if names != ("dp", "tp"):
            raise ArgumentError(
                f"a 2-D DeviceMesh must name its dimensions ('dp', 'tp'), got {names}; build it with "
                "init_device_mesh(device_type, (dp, tp), mesh_dim_names=('dp', 'tp'))"
            )
        if not wants_tp:
            raise ArgumentError(
                "a 2-D ('dp', 'tp') mesh needs tensor_parallel=True or a plan; for data parallel alone "
                "pass a 1-D mesh, e.g. init_device_mesh(device_type, (world_size,), mesh_dim_names=('dp',))"
            )
        return "spmd_2d", "dp", "tp"
    raise ArgumentError(f"DeviceMesh of {mesh.ndim} dimensions is not supported; pass a 1-D mesh or a 2-D ('dp', 'tp') mesh")


def check_fsdp_parameters(model: Any) -> None:
    """Refuse, before anything is sharded, a model with a 0-dim parameter under ``data_parallel="fsdp"``
    over a mesh: FSDP2's ``fully_shard`` refuses it only after sharding the blocks it met first (the
    user's model left holding DTensors)."""
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:
        raise ArgumentError(
            f'data_parallel="fsdp" over a mesh cannot shard 0-dim parameters (FSDP2\'s fully_shard refuses them), and '
            f"the model has {scalars[:5]}: make each a 1-element tensor (nn.Parameter(torch.tensor([value]))), or "
            "leave data_parallel= out (DDP replicates them); nothing was changed"
        )


def mesh_size(mesh: Any, dim: str | int) -> int:
    """How many processes ``mesh`` has along ``dim`` (a name or an index)."""
    return mesh.size(mesh.mesh_dim_names.index(dim)) if isinstance(dim, str) else mesh.size(dim)


def local_device(mesh: Any) -> torch.device:
    """The device this process computes on: CPU, or its current CUDA device (:func:`process_device`).

    >>> local_device(init_device_mesh("cpu", (2,)))  # doctest: +SKIP
    device(type='cpu')
    """
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    return process_device(kind)


def local_batch(value: Any, mesh: Any, dim: int = 0) -> Any:
    """This process's part of a global batch: every tensor of ``value`` split along ``dim``.

    Balanced ``tensor_split`` parts over the mesh's ``"dp"`` dimension (a 1-D mesh not named
    ``"tp"`` is all data parallel); tensor-parallel ranks of one dp group get the same part,
    and a ``("tp",)`` or ``("pp",)`` mesh gets the whole batch. A ``("cp",)`` mesh splits the
    sequence, dim 1 of batch-first inputs (a tensor without one, a classifier's labels, whole); a
    ``("dp", "cp")`` mesh splits the batch over ``dp``, then the sequence over ``cp``; a ``("cp", "tp")``
    mesh the sequence over ``cp`` (tp ranks of one cp rank get the same part).
    Non-tensor leaves are passed through.

    >>> x_local, y_local = local_batch((x, y), mesh)  # doctest: +SKIP
    """
    if not is_device_mesh(mesh):
        raise ArgumentError(
            f"local_batch(value, mesh): mesh must be a torch.distributed DeviceMesh (the one transform was given), "
            f"got {type(mesh).__name__}"
        )
    names = tuple(mesh.mesh_dim_names or ())
    if names == ("cp", "tp"):  # the cp rank's part of the sequence, the same on its tp ranks
        return local_batch(value, mesh["cp"])
    if names == ("dp", "cp"):  # the dp rank's rows, then its cp rank's part of their sequence
        return local_batch(local_batch(value, mesh["dp"], dim), mesh["cp"])
    if names == ("cp",):
        parts, rank, dim = mesh.size(0), mesh.get_local_rank(0), 1
    elif "dp" in names:
        parts, rank = mesh.size(names.index("dp")), mesh.get_local_rank("dp")
    elif mesh.ndim == 1 and names not in (("tp",), ("pp",)):
        parts, rank = mesh.size(0), mesh.get_local_rank(0)
    else:
        return value
    return map_structure(
        lambda leaf: torch.tensor_split(leaf, parts, dim)[rank]
        if isinstance(leaf, torch.Tensor) and leaf.dim() > dim
        else leaf,
        value,
    )
