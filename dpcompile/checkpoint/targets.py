"""Where each of a model's state keys lives in a program: whole, or as shards on their devices.

:func:`targets_of` answers for every kind of ``ParallelModule``: data parallel (the model's own
tensors), tensor parallel in one process (``pm.param_shards``: one shard per device) and over a
mesh (``pm.shards``: this rank's shard), FSDP's DTensors (this rank's rows). Loading reads each piece's slice of the checkpoint
tensor; saving puts the pieces back together, one key at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy
import torch
from torch import nn

from dpcompile.checkpoint.dtensors import localize
from dpcompile.checkpoint.files import Runs
from dpcompile.checkpoint.runs import rows_at_once, staging_budget
from dpcompile.checkpoint.stages import stage_targets
from dpcompile.errors import ArgumentError
from dpcompile.fx_utils import unalias
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.executors import executor_of
from dpcompile.runtime.distributed import MeshGroup
from dpcompile.runtime.tensor_parallel import ShardSpec, unshard


@dataclass
class Piece:
    """``tensor`` holds slice ``index`` of the full tensor under ``spec`` (None: all of it)."""

    tensor: torch.Tensor
    spec: ShardSpec | None = None
    index: int = 0


@dataclass
class Target:
    """A state key of the model: its full shape and dtype, and the pieces that hold it.

    ``gathered``: the pieces are every shard (one process); False where they are this rank's
    only (over a mesh), so the full tensor needs the other ranks: ``gather()`` (a collective,
    :mod:`dpcompile.checkpoint.dtensors`) puts it together on every rank.
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece] = field(default_factory=list)
    gathered: bool = True
    gather: Callable[[], torch.Tensor] | None = None
    tied: tuple[str, ...] | None = None  # the keys of the same tensor, where pieces cannot say (a pipeline's stages)

    def full(self) -> torch.Tensor:
        """The full tensor on the CPU (pieces put back together)."""
        if self.pieces[0].spec is None:
            return self.pieces[0].tensor.detach().to("cpu")
        if not self.gathered:
            raise ValueError(f"'{self.key}' is sharded across ranks; gather it first")
        spec = self.pieces[0].spec
        return unshard([p.tensor.detach() for p in self.pieces], spec, "cpu")

    def runs(self) -> torch.Tensor | Runs:
        """The full tensor for a file: whole where one piece holds it, else the runs of its pieces'
        bytes in order (:func:`shard_runs`), never put together."""
        spec = self.pieces[0].spec
        if spec is None:
            return self.pieces[0].tensor.detach().to("cpu")
        if not self.gathered:
            raise ValueError(f"'{self.key}' is sharded across ranks; gather it first")
        shards = [p.tensor for p in sorted(self.pieces, key=lambda p: p.index)]
        return Runs(self.shape, self.dtype, lambda: shard_runs(shards, spec))


def targets_of(pm: ParallelModule) -> dict[str, Target]:
    """``{state key: Target}`` for the model's persistent state, in the model's key order."""
    if executor_of(pm).runs_one_stage_per_rank:  # this rank's stage: every key listed, pieces where this rank holds it
        out = stage_targets(pm, Target, Piece)
        localize(pm, out)
        return out
    param_shards = getattr(pm, "param_shards", None)
    mesh_shards = getattr(pm, "shards", None)
    if isinstance(param_shards, dict) and hasattr(pm, "state_keys"):
        own = {unalias(k): v for k, v in pm.stored_state_dict(keep_vars=True).items()}
        aliases = getattr(pm, "state_aliases", {})
        out = {}
        for key in pm.state_keys:
            source = key if key in param_shards or key in own else aliases.get(key, key)
            if source in param_shards:
                spec, names = param_shards[source]
                first = own[names[0]]
                out[key] = Target(
                    key, _full_shape(first, spec), first.dtype, [Piece(own[n], spec, k) for k, n in enumerate(names)]
                )
            elif source in own:
                out[key] = Target(key, tuple(own[source].shape), own[source].dtype, [Piece(own[source])])
        return out
    own = {unalias(k): v for k, v in pm.stored_state_dict(keep_vars=True).items()}
    out = {key: Target(key, tuple(t.shape), t.dtype, [Piece(t)]) for key, t in own.items()}
    if isinstance(mesh_shards, dict) and mesh_shards:
        rank = MeshGroup(pm.mesh, pm.tp_dim).rank()
        sizes = {key: sum(spec.sizes) for key, spec in mesh_shards.items()}
        for key, spec in mesh_shards.items():
            if key in out:
                t = out[key].pieces[0].tensor
                shape = list(t.shape)
                shape[spec.dim] = sizes[key]
                out[key] = Target(key, tuple(shape), t.dtype, [Piece(t, spec, rank)], gathered=False)
    localize(pm, out)  # FSDP's DTensors: this rank's rows; gathers for what other ranks hold
    return out


def shard_runs(shards: list[torch.Tensor], spec: ShardSpec) -> Iterator[torch.Tensor]:
    """The bytes of the whole tensor in order, as runs of its ``shards`` (by sections for a fused
    qkv), never the whole tensor at once. Split on dim 0: each section of each shard in turn, the
    shards' own memory. Split past dim 0: blocks of rows (the dims before the split) cut from every
    shard and laid side by side in one staging buffer, reused from block to block (each run is
    valid until the next is asked for) and of at most
    :func:`~dpcompile.checkpoint.runs.staging_budget` bytes of the largest shard; where one row of
    the whole tensor is more than that, each shard's part of each row in turn."""
    outer = math.prod(shards[0].shape[: spec.dim])
    views = [s.detach().reshape(outer, spec.sections, -1) for s in shards]
    if outer == 1:
        for section in range(spec.sections):
            for view in views:
                yield view[0, section]
        return
    row_bytes = sum(v[0].numel() for v in views) * views[0].element_size()
    if row_bytes > max(staging_budget(v) for v in views):
        for row in range(outer):
            for section in range(spec.sections):
                for view in views:
                    yield view[row, section]
        return
    block = rows_at_once(row_bytes, max(staging_budget(v) for v in views))
    widths = [v.shape[2] for v in views]
    staging = torch.empty((min(block, outer), spec.sections, sum(widths)), dtype=views[0].dtype)
    on_host = all(v.device.type == "cpu" and v.is_contiguous() for v in views)
    for start in range(0, outer, block):
        out = staging[: min(block, outer - start)]
        if on_host:  # numpy's copy, one thread: torch's small parallel copies wait on a busy CPU
            parts = [v[start : start + out.shape[0]].view(torch.uint8).numpy() for v in views]
            numpy.concatenate(parts, axis=2, out=out.view(torch.uint8).numpy())
        else:
            column = 0
            for view, width in zip(views, widths):
                out[:, :, column : column + width].copy_(view[start : start + out.shape[0]])
                column += width
        yield out


def tie_groups(targets: dict[str, Target]) -> dict[str, list[str]]:
    """``{key: every key held by the same tensors}`` (an embedding and its tied LM head)."""
    by_tensor: dict[int, list[str]] = {}
    named = {key: list(t.tied) for key, t in targets.items() if t.tied is not None}
    for key, target in targets.items():
        if key in named:
            continue
        by_tensor.setdefault(id(target.pieces[0].tensor), []).append(key)
    return {**{key: keys for keys in by_tensor.values() for key in keys}, **named}


def unset_buffers(pm: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """``{name: buffer}`` of ``pm`` for the non-persistent buffers ``names``."""
    own = {unalias(k): b for k, b in pm.named_buffers()}
    return {name: own[name] for name in names if name in own}


def _full_shape(shard: torch.Tensor, spec: ShardSpec) -> tuple[int, ...]:
    shape = list(shard.shape)
    shape[spec.dim] = sum(spec.sizes)
    return tuple(shape)


def check_program(pm: object, what: str) -> None:
    """``pm`` is what ``transform`` returned (a model itself is refused by name, not deep inside)."""
    if not isinstance(pm, ParallelModule):
        raise ArgumentError(
            f"{what}(pm, path) needs the module dpcompile.transform returned, got {type(pm).__name__}: pass pm "
            "(its state_dict keys are the model's)"
        )


__all__ = ["Piece", "Target", "check_program", "shard_runs", "targets_of", "tie_groups", "unset_buffers"]
