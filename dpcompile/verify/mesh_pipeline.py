"""``verify`` of a pipeline over a DeviceMesh: each rank compares what it holds, every rank the same verdict.

Every rank is called with the same inputs, the whole global batch. Each rank runs the eager model on
them (its parameters are the model's own; FSDP's shards of this stage are gathered whole for it),
then its stage through the schedule on its dp share of the batch (:func:`dpcompile.mesh.local_batch`),
and compares what it holds: the last stage the model's outputs (the mean loss as eager's, which is
the whole global batch's; every other output as eager's rows of this dp share), every stage the
gradients of its own parameters (after dp's averaging; tensor-parallel and FSDP shards gathered
whole) and its buffers. The ranks exchange their findings over every dimension of the mesh and
return the same :class:`VerifyResult`. A rank that fails before the schedule (the eager run, inputs
that differ from another rank's) says so in an exchange before the schedule's first send, so every
rank raises the same :class:`DpCompileError` instead of one waiting in a collective the other never
joins; a rank that fails inside the schedule makes every rank raise at once
(:mod:`dpcompile.modules.mesh_failure`).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

import torch
from torch import nn

from dpcompile.errors import DpCompileError
from dpcompile.runtime.structures import map_structure, tensor_leaves
from dpcompile.verify.result import Mismatch, VerifyResult, compare_structures, compare_tensors, first_line


def refuse_unsupported(pm: Any, fake_devices: Any) -> None:
    """What every rank refuses alike (the arguments, a pipeline whose step failed), before any run."""
    if "step_failure" in pm.__dict__:
        raise DpCompileError(
            f"verify: {pm.step_failure}; the mesh's process groups were shut down then, so that no rank waited. "
            "Build the mesh and the pipeline again (dpcompile.transform(model, mesh, pipeline=...))"
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


def everyone(pm: Any, value: Any) -> list[tuple[int, Any]]:
    """``(global rank, value)`` of every rank of ``pm``'s mesh, in rank order, on every rank: one
    ``all_gather_object`` over each dimension's group in turn, each passing on what the last gathered."""
    import torch.distributed as dist

    found = {dist.get_rank(): value}
    for name in pm.mesh.mesh_dim_names:
        group = pm.mesh.get_group(name)
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, found, group=group)
        found = {rank: seen for part in gathered for rank, seen in part.items()}
    return sorted(found.items())


def agree_before_schedule(pm: Any, error: BaseException | None, fingerprint: list) -> None:
    """One exchange over the mesh: where a rank failed or its inputs differ from the first rank's,
    raise the same :class:`DpCompileError` on every rank (chained from this rank's own error)."""
    own = None if error is None else f"{type(error).__name__}: {first_line(error)}"
    seen = everyone(pm, (own, fingerprint))
    failed = [f"rank {r}: {message}" for r, (message, _) in seen if message is not None]
    if failed:
        raise DpCompileError(
            f"verify of a pipeline over a mesh failed before the pipeline ran, so it fails on every rank "
            f"({'; '.join(failed)})"
        ) from error
    ranks = [r for r, _ in seen]
    differ = ranks_with_other_inputs(ranks, [fingerprint for _, (_, fingerprint) in seen])
    if differ:
        raise DpCompileError(
            f"verify of a pipeline over a mesh needs the same inputs on every rank (each compares the pipeline "
            f"with the eager model on them: the whole global batch; verify feeds each dp rank its share), but "
            f"global rank(s) {', '.join(differ)} passed other inputs than rank {ranks[0]} (shapes, dtypes or "
            "values). Call verify(pm, model, *inputs) with the same inputs on every rank"
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


def whole_parameters(model: nn.Module) -> contextlib.AbstractContextManager:
    """Every FSDP-sharded parameter of ``model`` (a DTensor: this stage's, with ``data_parallel="fsdp"``)
    seen whole, as a plain parameter, for the eager run (a collective over dp: every rank of the
    stage gathers the same ones, in the same order); the shards are put back afterwards."""
    from dpcompile.modules.mesh_stage_dp import sharded_parameters_swapped

    return sharded_parameters_swapped([model], lambda p: p.full_tensor().detach().clone())


def model_names(model: nn.Module, kind: str) -> dict[int, list[str]]:
    """The model's names of each of its parameters (``kind="parameters"``) or buffers, tied ones all."""
    named = model.named_parameters if kind == "parameters" else model.named_buffers
    names: dict[int, list[str]] = {}
    for name, t in named(remove_duplicate=False):
        names.setdefault(id(t), []).append(name)
    return names


def held(pm: Any, model: nn.Module, kind: str) -> list[tuple[str, torch.Tensor]]:
    """This stage's parameters (or buffers) under the model's names: the model's own tensors (tied:
    under each name), or where the stage holds its own (tensor-parallel shards) its unaliased name."""
    from dpcompile.fx_utils import unalias

    names = model_names(model, kind)
    own = pm.program.named_parameters() if kind == "parameters" else pm.program.named_buffers()
    return [(n, t) for name, t in own for n in names.get(id(t), [unalias(name)])]


def whole_gradients(pm: Any, model: nn.Module) -> dict[str, torch.Tensor | None]:
    """This stage's gradients under the model's names, whole: FSDP shards all-gathered over dp,
    tensor-parallel shards gathered over tp (a collective: every rank of the stage, the same order)."""
    from dpcompile.fx_utils import unalias
    from dpcompile.modules.mesh_stage_dp import whole_tensor

    out: dict[str, torch.Tensor | None] = {}
    for name, p in held(pm, model, "parameters"):
        if name not in out:
            grad = p.grad
            out[name] = None if grad is None else whole_tensor(grad, pm.shards.get(unalias(name)), pm.tp_group)
    return out


def local_outputs(pm: Any, expected: Any) -> Any:
    """Eager's outputs as this dp rank's last stage returns them: the 0-dim loss (the whole global
    batch's mean) as it is, every other output's rows of this rank's share of the batch."""
    from dpcompile.mesh import local_batch

    return map_structure(
        lambda t: local_batch(t, pm.mesh) if isinstance(t, torch.Tensor) and t.dim() > 0 else t, expected
    )


def compare_held(
    pm: Any, model: nn.Module, expected: Any, actual: Any, expected_grads: dict | None,
    actual_grads: dict[str, torch.Tensor | None], expected_buffers: dict, rtol: float | None, atol: float | None,
) -> tuple[list[Mismatch], dict[str, list[str]]]:
    """This rank's comparison: the outputs (the last stage), its parameters' gradients (where the call
    was a training step: ``expected_grads`` not None) and its buffers; what it compared, by name."""
    import torch.distributed as dist

    mismatches: list[Mismatch] = []
    checked: dict[str, list[str]] = {"outputs": [], "parameter gradients": [], "input gradients": [], "buffers": []}
    if pm.stage_index == pm.num_stages - 1:
        mismatches, _ = compare_structures(local_outputs(pm, expected), actual, rtol, atol)
        checked["outputs"] = [path for path, _ in tensor_leaves(expected)]
    for name, grad in actual_grads.items() if expected_grads is not None else ():
        if (m := compare_tensors("gradient", name, expected_grads.get(name), grad, rtol, atol)) is not None:
            mismatches.append(m)
        checked["parameter gradients"].append(name)
    for name, b in held(pm, model, "buffers"):
        if name in expected_buffers:
            if (m := compare_tensors("buffer", name, expected_buffers[name], b, rtol, atol)) is not None:
                mismatches.append(m)
            checked["buffers"].append(name)
    where = f"stage {pm.stage_index}" + (f", global rank {dist.get_rank()}" if pm.mesh.ndim > 1 else "")
    for m in mismatches:
        m.name = f"{m.name} ({where})"
    return mismatches, checked


def run_stage(pm: Any, args: tuple, kwargs: dict) -> Any:
    """This rank's part of the schedule on its dp share of the batch (a rank that raises inside it
    makes every rank raise the same error at once: :mod:`dpcompile.modules.mesh_failure`)."""
    from dpcompile.mesh import local_batch

    args, kwargs = local_batch((tuple(args), dict(kwargs)), pm.mesh)
    return pm(*args, **kwargs)


def agree_on_verdict(pm: Any, error: BaseException | None, mismatches: list[Mismatch],
                     checked: dict[str, list[str]], notes: list[str]) -> VerifyResult:  # fmt: skip
    """One exchange over the mesh: every rank's findings, merged into the same result on every
    rank (each value counted once, however many ranks compared it); where a rank failed to
    compare, the same :class:`DpCompileError` on every rank."""
    own = None if error is None else f"{type(error).__name__}: {first_line(error)}"
    pairs = everyone(pm, (own, mismatches, checked))
    failed = [f"rank {r}: {message}" for r, (message, _, _) in pairs if message is not None]
    if failed:
        raise DpCompileError(
            f"verify of a pipeline over a mesh failed comparing, so it fails on every rank ({'; '.join(failed)})"
        ) from error
    merged = [m for _, (_, found, _) in pairs for m in found]
    totals = {k: len({name for _, (_, _, names) in pairs for name in names[k]}) for k in checked}
    return VerifyResult(ok=not merged, mismatches=merged, checked=totals, notes=notes)
