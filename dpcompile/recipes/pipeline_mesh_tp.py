"""Tensor parallel inside a pipeline stage: a ``("pp", "tp")`` mesh.

Each process first gets its stage's program from ``cut_stage`` (its pp rank's, for one
micro-batch), exactly as on a ``("pp",)`` mesh; that program is then rewritten by the same
tensor-parallel lowering a ``("tp",)`` mesh uses (``shard_linear`` → ``lower_to_collectives``
over ``"tp"``), on a private copy of the stage's modules whose parameters are cut into this tp
rank's shards::

    stage = cut_stage(..., stage=pp rank)              # inputs: what the stage receives; outputs: what it sends
    sharded = copy(stage) → broadcast from tp rank 0 → shard_linear(plan) → lower_to_collectives(tp)

Every tp rank of a stage is fed the same micro-batch (the stage's inputs are whole: replicated
over tp) and ends with the whole outputs (``shard_linear`` gathers a sharded value where it
leaves the program), which is what ``PipelineStage`` sends on; tp rank ``t`` of stage ``i``
sends to tp rank ``t`` of stage ``i + 1`` (the pp group of ``mesh["pp"]`` holds one tp rank of
every stage).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

import passes
from dpcompile.devices import Devices
from dpcompile.errors import DpCompileError
from dpcompile.fx_utils import propagate_shapes, unalias
from dpcompile.infra import info_of, run_passes
from dpcompile.mesh import local_device, mesh_size
from dpcompile.planning import plan_for
from dpcompile.recipes.constants import deepcopy_on_fake
from dpcompile.recipes.spmd import broadcast_state, keep_own_shards
from dpcompile.recipes.tensor_parallel import aliased_plan, unaliased_findings
from dpcompile.runtime.tensor_parallel import ShardSpec


@dataclass(frozen=True)
class ShardedStage:
    """A stage's tensor-parallel program: ``program`` (holds this tp rank's shards), ``shards``
    (``{"layers.0.weight": ShardSpec(0, (4, 4))}``, the model's names), ``plan`` (the styles
    applied) and ``reasons`` (why a layer stayed whole)."""

    program: fx.GraphModule
    shards: dict[str, ShardSpec]
    plan: dict[str, str]
    reasons: dict[str, str]


def shard_stage(
    stage: fx.GraphModule,
    *,
    model: nn.Module,
    mesh: Any,
    plan: bool | Mapping[str, str],
    example_inputs: Sequence[Any] | None = None,
    exact_random: bool = False,
    finishing: Sequence[Any] = (),
) -> ShardedStage:
    """``stage`` (a ``cut_stage`` program sharing ``model``'s modules) sharded over ``mesh``'s
    ``"tp"`` dimension by ``plan`` (True: the automatic plan; a ``{path: style}`` dict may name
    layers of every stage, each stage applies its own). ``stage`` and ``model`` are left unchanged.
    ``example_inputs``: the stage's inputs for one micro-batch, so views of sharded heads can be
    proven to split (without them such layers stay whole, as on a ``("tp",)`` mesh). ``finishing``: passes
    run last on the sharded program (``passes.checkpoint_pipeline``: the stage's regions recomputed).

    Collective: every rank of the stage's tp group must call it (the shards are cut from tp rank 0's
    parameters, broadcast first, as a ``("tp",)`` mesh does).
    """
    tp_size, tp_rank = mesh_size(mesh, "tp"), mesh.get_local_rank("tp")
    own = deepcopy_on_fake(stage)  # the stage's modules only; the user's model keeps its full parameters
    broadcast_state(own, mesh.get_group("tp"))
    if passes.decompose_attention(own).modified:  # nn.MultiheadAttention written out, so heads can be sharded
        own.recompile()
    if example_inputs is not None:
        propagate_shapes(own, list(example_inputs))
    styles, reasons = plan_for(own, aliased_plan(plan), tp_size, model)
    options = passes.PipelineOptions(devices=Devices((local_device(mesh),) * tp_size), plan=dict(styles))
    lowering = passes.spmd_tensor_parallel_pipeline(options) + passes.spmd_pipeline(options, mesh=mesh, tp_dim="tp")
    if exact_random:  # each random site draws through the call's plan, keeping this rank's columns
        lowering[1:1] = [functools.partial(passes.stamp_rank_cols, tp_rank=tp_rank),
                         functools.partial(passes.draw_random_whole, planned=True)]  # fmt: skip
    own, records = run_passes(own, lowering + list(finishing))
    info = unaliased_findings(info_of(records, "shard_linear"))
    specs = dict(info.get("param_shards", {}))
    keep_own_shards(own, own, specs, tp_rank)
    held = {unalias(path) for path, _ in stage.named_modules()}  # an explicit plan names other stages' layers too
    applied = {path: style for path, style in info.get("plan", styles).items() if path in held}
    why = {
        **{unalias(p): r for p, r in reasons.items()},
        **{p: f"replicate: {r}" for p, r in info.get("reasons", {}).items()},
    }
    why = {path: reason for path, reason in why.items() if path in held}
    return ShardedStage(own, {unalias(t): spec for t, spec in specs.items()}, applied, why)


def tied_shards(
    shared: Sequence[tuple[torch.Tensor, tuple[int, ...]]],
    stage: fx.GraphModule,
    sharded: ShardedStage,
    *,
    mesh: Any,
) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """``shared`` (a weight tied across stages: the model's parameter, the stages that read it) for
    the stage's tensor-parallel program: this tp rank's copy of it (its shard, one parameter however
    many modules of the stage read it); on a stage that does not read it, zeros shaped as the readers'
    copies. Each reader's tp rank ``t`` then holds the same rows, so the copies' gradients are summed
    over the pp group of ``t`` (``modules/mesh_pipeline.py``). Readers that shard it
    unlike each other are refused, with the way out. Collective over ``"pp"``."""
    import torch.distributed as dist

    names: dict[int, list[str]] = {}
    for name, p in stage.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    held: list[tuple[str, ShardSpec | None] | None] = []  # per tied weight: (a path of it here, its spec)
    for p, _ in shared:
        found = names.get(id(p), [])
        spec = next((sharded.shards[unalias(n)] for n in found if unalias(n) in sharded.shards), None)
        held.append((found[0], spec) if found else None)
    listed: list[Any] = [None] * mesh_size(mesh, "pp")
    with unset_fake_temporarily():  # a meta model compiles under a fake mode: the objects are sent for real
        dist.all_gather_object(listed, [None if h is None else h[1] for h in held], group=mesh.get_group("pp"))
    tp_rank = mesh.get_local_rank("tp")
    out = []
    for i, ((p, stages), mine) in enumerate(zip(shared, held)):
        specs = {s: listed[s][i] for s in stages}
        if len(set(specs.values())) > 1:
            readers = ", ".join(f"stage {s}: {'whole' if spec is None else spec}" for s, spec in specs.items())
            raise DpCompileError(
                f"the weight tied across stages {stages} ('{unalias(mine[0]) if mine else 'a tied parameter'}') is sharded "
                f"over 'tp' unlike on each stage ({readers}); each stage's copy must hold the same rows to sum their "
                "gradients. Plan its readers alike (an embedding's 'vocab' with its LM head's 'column', or "
                "'replicate' for both), or untie them"
            )
        if mine is not None:
            out.append((sharded.program.get_parameter(mine[0]), stages))
            continue
        spec = next(iter(specs.values()))
        shape = list(p.shape)
        if spec is not None:
            shape[spec.dim] = spec.sizes[tp_rank]
        out.append((torch.zeros(shape, dtype=p.dtype, device=local_device(mesh)), stages))
    return out


__all__ = ["ShardedStage", "shard_stage", "tied_shards"]
