"""What a ``"dp"`` dimension adds to a pipeline stage over a mesh: FSDP2 or DDP on the stage, and the state.

- **FSDP on a stage** (``data_parallel="fsdp"``), as torchtitan composes them: the stage is cut
  first (and sharded over ``"tp"`` where there is one), then ``fully_shard`` wraps it over the
  ``"dp"`` sub-mesh. The root ``PipelineStage`` runs is that FSDP module, so the engine's own
  FSDP handling applies: parameters stay unsharded between micro-batches (no all-gather per
  micro-batch: ``reshard_after_forward=False``, torchtitan's choice with a pipeline), gradients
  accumulate unreduced until the last micro-batch's backward, then one reduce-scatter per step.
  The reduce-scatter sums (divide factor 1): each micro-batch's loss is already its share of the
  whole global batch's mean. A model built on meta is sharded once its stage has memory
  (``MeshPipelineExecutor.materialized``), as the ``("dp", "tp")`` mesh path does.
- **DDP on a stage** (``ddp_options=``): ``DistributedDataParallel`` over ``"dp"`` with those
  options, its all-reduce in the last micro-batch's backward (:func:`stage_under_ddp`); without
  ``ddp_options=`` one all-reduce per gradient after the step (``modules/mesh_pipeline.py``).
- **The full state** (``pm.state_dict()``): every rank gets the model's keys with whole tensors,
  put together from every stage (FSDP shards all-gathered over ``"dp"``, tensor-parallel shards
  over ``"tp"``, then each stage's tensors broadcast over ``"pp"``), one tensor at a time.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.errors import StateDictError
from dpcompile.modules.mesh_stage import TensorsOnWire
from dpcompile.modules.spmd import full_tensor, gathered_whole
from dpcompile.modules.weights import no_values
from dpcompile.runtime.dtensor_gather import full_tensors


def shard_stage_over_dp(program: fx.GraphModule, dp_mesh: Any, options: Mapping[str, Any]) -> TensorsOnWire:
    """``program`` under one FSDP2 root over ``dp_mesh`` (a 1-D mesh): the module every schedule's
    ``PipelineStage`` runs (its wiring is set per micro-batch shape: :meth:`TensorsOnWire.rewire`).
    Collective over ``dp_mesh``."""
    from torch.distributed.fsdp import fully_shard

    root = TensorsOnWire(program, {}, 0, None)
    fully_shard(root, mesh=dp_mesh, reshard_after_forward=False, **options)
    root.set_gradient_divide_factor(1.0)  # type: ignore[operator]  # summed: each loss is its share of the mean
    # a divide factor other than dp's size makes FSDP2 reduce float32 with PREMUL_SUM, which gloo lacks:
    # a plain SUM (then a divide by 1) instead, on every backend
    root.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    return root


def stage_under_ddp(program: fx.GraphModule, dp_group: Any, device: torch.device,
                    options: Mapping[str, Any]) -> nn.parallel.DistributedDataParallel:  # fmt: skip
    """``program`` under one ``DistributedDataParallel`` over ``dp_group`` with ``options``
    (``ddp_options=``: ``bucket_cap_mb``, ``gradient_as_bucket_view``, ...): the module every
    schedule's ``PipelineStage`` runs, rewired per micro-batch shape as FSDP's root is.
    ``PipelineStage`` runs each micro-batch's forward and backward under ``no_sync`` but the last
    backward's, so DDP all-reduces once per step, in its buckets. DDP averages over ``dp``: each
    micro-batch's loss is scaled by the size of ``dp`` to give the sum (``_step``). Parameters
    forward never reads are left out, as :func:`~dpcompile.modules.spmd.build_ddp` does. Collective
    over ``dp_group`` (DDP broadcasts the first dp rank's parameters and buffers)."""
    from dpcompile.modules.spmd import unused_parameters

    root = TensorsOnWire(program, {}, 0, None)
    kwargs: dict[str, Any] = {"process_group": dp_group}
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    kwargs.update(options)
    unused = unused_parameters(program)
    if unused and not kwargs.get("find_unused_parameters"):
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            root, [f"program.{name}" for name in unused]
        )
    return nn.parallel.DistributedDataParallel(root, **kwargs)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: writes reach it); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_rows_shape(shape: torch.Size, parts: int, index: int) -> torch.Size:
    """The shape of FSDP2's shard ``index`` of ``parts`` of a tensor of ``shape`` (``torch.chunk``
    rows; a rank past the last chunk holds none)."""
    chunks = torch.chunk(torch.empty(shape, device="meta"), parts) if len(shape) else ()
    if not len(shape):
        return shape
    return chunks[index].shape if index < len(chunks) else torch.Size((0, *shape[1:]))


@contextlib.contextmanager
def sharded_parameters_swapped(modules: list[nn.Module], whole: Any) -> Iterator[None]:
    """Every FSDP-sharded parameter (a DTensor) of ``modules`` replaced by ``whole(p)``, a plain
    tensor of its whole shape, for the block; the shards are put back afterwards."""
    from torch.distributed.tensor import DTensor

    swapped = []
    for module in modules:
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if isinstance(p, DTensor):
                    swapped.append((sub, name, p))
                    sub._parameters[name] = nn.Parameter(whole(p), requires_grad=p.requires_grad)
    try:
        yield
    finally:
        for sub, name, p in swapped:
            sub._parameters[name] = p


def whole_parameters_on_fake(modules: list[nn.Module], device: torch.device) -> contextlib.AbstractContextManager:
    """Inside a ``FakeTensorMode``: every FSDP-sharded parameter of ``modules`` seen as an empty
    (fake) tensor of its whole shape, so the stage's shapes can be worked out without a gather."""
    return sharded_parameters_swapped(modules, lambda p: torch.empty(p.shape, dtype=p.dtype, device=device))


def full_state_dict(pm: Any) -> dict[str, torch.Tensor]:
    """The model's state (its keys, whole tensors) on every rank of the mesh: a collective.

    This stage's tensors are made whole (``full_tensor()`` over ``"dp"`` for FSDP, the ``"tp"``
    gather for tensor-parallel shards), then every stage's are broadcast over ``"pp"``, in one
    order on every rank."""
    import torch.distributed as dist

    from dpcompile.fx_utils import unalias

    held: dict[str, torch.Tensor] = {}
    for name, value in sorted(pm.program.state_dict(keep_vars=True).items()):
        name = unalias(name)
        if name in pm.state_ties:  # not a non-persistent buffer, nor a constant the program made
            held[name] = value.detach()
    held = full_tensors(held)  # FSDP's row shards over "dp" whole: one flat all-gather a dtype
    mine = {name: whole_tensor(value, pm.shards.get(name), pm.tp_group) for name, value in held.items()}
    listed: list[Any] = [None] * dist.get_world_size(pm.pp_group)
    dist.all_gather_object(listed, [(n, tuple(t.shape), t.dtype) for n, t in mine.items()], group=pm.pp_group)
    out: dict[str, torch.Tensor] = {}
    for stage, entries in enumerate(listed):
        sent = [entry for entry in entries if entry[0] not in out]  # not a tied weight another stage sent already
        out.update(_broadcast_flat(pm, sent, mine if stage == pm.stage_index else None, stage))
    found = {key: next((n for n in names if n in out), None) for key, names in pm.state_ties.items()}
    return {key: out[source] for key, source in found.items() if source is not None}


def _broadcast_flat(pm: Any, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                    mine: Mapping[str, torch.Tensor] | None, stage: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """``entries`` (name, shape, dtype) of ``stage``'s tensors (``mine`` on that stage) on every pp
    rank: one broadcast of a flat buffer per dtype, not one per tensor."""
    import torch.distributed as dist

    src = dist.get_global_rank(pm.pp_group, stage)
    out: dict[str, torch.Tensor] = {}
    for dtype in dict.fromkeys(dtype for _, _, dtype in entries):
        same = [(name, shape) for name, shape, d in entries if d == dtype]
        sizes = [math.prod(shape) for _, shape in same]
        if mine is not None:
            flat = torch.cat([mine[name].reshape(-1) for name, _ in same])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=pm.device)
        dist.broadcast(flat, src=src, group=pm.pp_group)
        out.update((name, piece.view(shape).clone()) for (name, shape), piece in zip(same, flat.split(sizes)))
    return out


def load_whole_state(pm: Any, state_dict: Mapping[str, Any], strict: bool) -> Any:
    """Whole tensors under the model's keys loaded into this rank's stage: each key the stage holds
    cut to this tp rank's shard (``pm.shards``), and for FSDP's DTensors to this dp rank's rows; the
    other stages' keys are theirs. Not a collective. Every key is checked before the first copy: a
    refused load changes nothing."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.nn.modules.module import _IncompatibleKeys

    from dpcompile.fx_utils import unalias
    from dpcompile.runtime.tensor_parallel import shard_of

    if not isinstance(state_dict, Mapping):
        raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict).__name__}.")
    missing = [k for k in pm.state_ties if k not in state_dict]
    unexpected = [k for k in state_dict if k not in pm.state_ties]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(pm).__name__} (nothing was loaded): missing keys {missing}, "
            f"unexpected keys {unexpected}"
        )
    own = {unalias(k): v for k, v in pm.program.state_dict(keep_vars=True).items()}
    tp_rank = dist.get_rank(pm.tp_group) if pm.tp_group is not None else 0
    copies = []  # (destination, value), all checked first
    for key, names in pm.state_ties.items():
        held = next((n for n in names if n in own), None)
        if held is None or key not in state_dict:
            continue  # another stage's
        value, spec, destination = state_dict[key], pm.shards.get(held), own[held]
        if not isinstance(value, torch.Tensor):
            raise RuntimeError(f"{key} is a {type(value).__name__}, not a tensor (nothing was loaded)")
        if no_values(key, value):
            raise StateDictError(no_values(key, value))
        if spec is not None:
            if value.dim() <= spec.dim or value.size(spec.dim) != sum(spec.sizes):
                raise RuntimeError(
                    f"size mismatch for {key}: got {tuple(value.shape)}, the sharded parameter has {sum(spec.sizes)} "
                    f"along dim {spec.dim} (shards {list(spec.sizes)}) (nothing was loaded)"
                )
            value = shard_of(value, spec, tp_rank)
        if isinstance(destination, DTensor):  # FSDP's rows of this dp rank
            mesh = destination.device_mesh
            chunks = torch.chunk(value, mesh.size()) if value.dim() else (value,)
            rank = mesh.get_local_rank()
            value = chunks[rank] if rank < len(chunks) else value[:0]
        if value.shape != local(destination).shape:
            raise RuntimeError(
                f"size mismatch for {key}: got {tuple(state_dict[key].shape)}, this stage's piece is "
                f"{tuple(local(destination).shape)} of {tuple(destination.shape)} (nothing was loaded)"
            )
        copies.append((local(destination), value))
    with torch.no_grad():
        for destination, value in copies:
            destination.copy_(value)
    return _IncompatibleKeys(missing, unexpected)


def whole_tensor(value: torch.Tensor, spec: Any, tp_group: Any) -> torch.Tensor:
    """``value`` whole: all-gathered over ``"dp"`` where it is an FSDP shard (a DTensor), then over
    ``tp_group`` where ``spec`` says it is a tensor-parallel shard (a collective over both)."""
    value = full_tensor(value)
    return value if spec is None else gathered_whole(value, spec, tp_group)


__all__ = [
    "full_state_dict",
    "load_whole_state",
    "local",
    "local_rows_shape",
    "shard_stage_over_dp",
    "stage_under_ddp",
    "whole_parameters_on_fake",
    "whole_tensor",
]
