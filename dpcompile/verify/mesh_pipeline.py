"""``verify`` of a pipeline over a DeviceMesh: each rank compares what it holds, every rank the same verdict.

Each rank runs the eager model on the call's inputs (its parameters are the model's own, so every
rank can), then its stage through the schedule, and compares what it holds: the last stage the
model's outputs, every stage the gradients of its own parameters and its buffers. The ranks
exchange their findings (one ``all_gather_object`` over the pp group) and return the same
:class:`VerifyResult`. A rank that fails before the schedule (the eager run, inputs that differ
from another rank's) says so in an exchange before the schedule's first send, so every rank raises
the same :class:`DpCompileError` instead of one waiting in a collective the other never joins.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from dpcompile.errors import DpCompileError
from dpcompile.modules.spmd import is_communication_failure
from dpcompile.runtime.structures import tensor_leaves
from dpcompile.verify.result import Mismatch, VerifyResult, compare_structures, compare_tensors, first_line


def is_mesh_pipeline(pm: nn.Module) -> bool:
    return getattr(pm, "executor", None) == "pipelining"


def refuse_unsupported(pm: Any, fake_devices: Any) -> None:
    """What every rank refuses alike (the mesh's shape and the arguments), before any run."""
    names = tuple(pm.mesh.mesh_dim_names or ())
    if names != ("pp",):
        raise DpCompileError(
            f"verify of a pipeline over a mesh compares on a ('pp',) mesh, where every rank holds its stage's "
            f"whole parameters and the same batch; this mesh is {names}. Verify the same model over a ('pp',) "
            "mesh (dpcompile.transform(model, init_device_mesh(..., mesh_dim_names=('pp',)), pipeline=N)), or "
            "in one process (dpcompile.transform(model, ['cpu'] * N, pipeline=N, ...))"
        )
    if fake_devices is not None:
        raise DpCompileError(
            "verify(..., fake_devices=) builds the program for fake devices in one process; a pipeline over a "
            "mesh runs one stage per rank. Pass fake_devices= to verify of the same pipeline in one process "
            "(dpcompile.transform(model, ['cpu'] * N, pipeline=N, ...))"
        )


def input_fingerprint(args: tuple, kwargs: dict) -> list[tuple[str, str]]:
    """Each input's path, shape, dtype and a hash of its values: ranks compare these before the schedule."""
    out = []
    for path, t in tensor_leaves((list(args), dict(kwargs))):
        data = t.detach().cpu().contiguous().reshape(-1)
        digest = hashlib.sha1(data.view(torch.uint8).numpy().tobytes()).hexdigest()[:12] if data.numel() else ""
        out.append((path, f"{tuple(t.shape)} {t.dtype} {digest}"))
    return out


def ranks_with_other_inputs(ranks: list[int], fingerprints: list[Any]) -> list[str]:
    """The global ranks (as text) whose :func:`input_fingerprint` differs from the first rank's."""
    return [str(r) for r, seen in zip(ranks, fingerprints) if seen != fingerprints[0]]


def agree_before_schedule(pm: Any, error: BaseException | None, fingerprint: list) -> None:
    """One exchange over the pp group: where a rank failed or its inputs differ from rank 0's, raise
    the same :class:`DpCompileError` on every rank (chained from this rank's own error)."""
    import torch.distributed as dist

    own = None if error is None else f"{type(error).__name__}: {first_line(error)}"
    everyone: list[Any] = [None] * dist.get_world_size(pm.pp_group)
    dist.all_gather_object(everyone, (own, fingerprint), group=pm.pp_group)
    ranks = dist.get_process_group_ranks(pm.pp_group)
    failed = [f"rank {r}: {message}" for r, (message, _) in zip(ranks, everyone) if message is not None]
    if failed:
        raise DpCompileError(
            f"verify of a pipeline over a mesh failed before the pipeline ran, so it fails on every rank "
            f"({'; '.join(failed)})"
        ) from error
    differ = ranks_with_other_inputs(ranks, [seen for _, seen in everyone])
    if differ:
        raise DpCompileError(
            f"verify of a pipeline over a mesh needs the same inputs on every rank (each compares the pipeline "
            f"with the eager model on them), but global rank(s) {', '.join(differ)} passed other inputs than "
            f"rank {ranks[0]} (shapes, dtypes or values). Call verify(pm, model, *inputs) with the same inputs "
            "on every rank"
        ) from error


def loss_of(output: Any) -> torch.Tensor:
    """The model's mean loss: the one 0-dim floating output (every other output of a pipeline over a
    mesh is split along the batch, so has a batch dim)."""
    scalars = [t for _, t in tensor_leaves(output) if t.dim() == 0 and t.is_floating_point() and t.requires_grad]
    if len(scalars) != 1:
        raise DpCompileError(
            f"verify of a pipeline over a mesh backpropagates the model's own loss, as the schedule does, but the "
            f"model's output has {len(scalars)} scalar losses that require grad; return one mean loss"
        )
    return scalars[0]


def stage_names(pm: Any, model: nn.Module) -> tuple[list[str], list[str]]:
    """The model's names of the parameters and buffers this rank's stage holds (the same tensors)."""
    held_params = {id(p) for p in pm.parameters()}
    held_buffers = {id(b) for b in pm.buffers()}
    params = [n for n, p in model.named_parameters() if id(p) in held_params and p.requires_grad]
    buffers = [n for n, b in model.named_buffers() if id(b) in held_buffers]
    return params, buffers


def compare_held(
    pm: Any, model: nn.Module, expected: Any, actual: Any, expected_grads: dict | None, expected_buffers: dict,
    rtol: float | None, atol: float | None,
) -> tuple[list[Mismatch], dict[str, int]]:
    """This rank's comparison: the outputs (the last stage), its parameters' gradients (where the call
    was a training step: ``expected_grads`` not None) and its buffers."""
    mismatches: list[Mismatch] = []
    checked = {"outputs": 0, "parameter gradients": 0, "input gradients": 0, "buffers": 0}
    if pm.stage_index == pm.num_stages - 1:
        mismatches, checked["outputs"] = compare_structures(expected, actual, rtol, atol)
    params, buffers = stage_names(pm, model)
    own = dict(model.named_parameters())
    for name in params if expected_grads is not None else ():
        if (m := compare_tensors("gradient", name, expected_grads[name], own[name].grad, rtol, atol)) is not None:
            mismatches.append(m)
        checked["parameter gradients"] += 1
    now = dict(model.named_buffers())
    for name in buffers:
        if name in expected_buffers:
            if (m := compare_tensors("buffer", name, expected_buffers[name], now[name], rtol, atol)) is not None:
                mismatches.append(m)
            checked["buffers"] += 1
    where = f"stage {pm.stage_index}"
    for m in mismatches:
        m.name = f"{m.name} ({where})"
    return mismatches, checked


def run_stage(pm: Any, args: tuple, kwargs: dict) -> Any:
    """This rank's part of the schedule; a rank whose peer failed inside it hears of it as a
    :class:`DpCompileError` naming where to look."""
    import torch.distributed as dist

    try:
        return pm(*args, **kwargs)
    except (RuntimeError, dist.DistError) as e:
        if isinstance(e, DpCompileError) or not is_communication_failure(e):
            raise
        raise DpCompileError(
            f"verify of a pipeline over a mesh: the schedule's communication failed on global rank "
            f"{dist.get_rank()}: another rank most likely raised inside its stage first (see its log). "
            f"({first_line(e)})"
        ) from e


def agree_on_verdict(pm: Any, error: BaseException | None, mismatches: list[Mismatch], checked: dict[str, int],
                     notes: list[str]) -> VerifyResult:  # fmt: skip
    """One exchange over the pp group: every rank's findings, merged into the same result on every
    rank; where a rank failed to compare, the same :class:`DpCompileError` on every rank."""
    import torch.distributed as dist

    own = None if error is None else f"{type(error).__name__}: {first_line(error)}"
    everyone: list[Any] = [None] * dist.get_world_size(pm.pp_group)
    dist.all_gather_object(everyone, (own, mismatches, checked), group=pm.pp_group)
    ranks = dist.get_process_group_ranks(pm.pp_group)
    failed = [f"rank {r}: {message}" for r, (message, _, _) in zip(ranks, everyone) if message is not None]
    if failed:
        raise DpCompileError(
            f"verify of a pipeline over a mesh failed comparing, so it fails on every rank ({'; '.join(failed)})"
        ) from error
    merged = [m for _, found, _ in everyone for m in found]
    totals = {k: sum(seen[k] for _, _, seen in everyone) for k in checked}
    return VerifyResult(ok=not merged, mismatches=merged, checked=totals, notes=notes)
