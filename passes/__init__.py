"""The graph passes of dpcompile and every pipeline that orders them, on one screen.

    capture ─► hoist_flatten_parameters ─┬─► insert_scatter_gather                (data parallel)
                                         ├─► insert_sequence_exchange ─► choose_context_exchanges ─► insert_scatter_gather ─► regather_keys_values ─► ring_exchange ─► all_to_all_exchange (context parallel)
                                         ├─► split_batch_into_copies ─► insert_sequence_exchange ─► ... (dp x cp, one process)
                                         ├─► shard_linear ─► [shard_sequence ─►] expand_shards (tensor, sequence parallel)
                                         ├─► shard_linear ─► [split_one_shard_batch ─►] insert_sequence_exchange ─► (pipeline) ─► expand_shards ([dp x] cp x tp)
                                         ├─► [shard_linear ─►] lower_to_collectives (SPMD over a DeviceMesh)
                                         ├─► (context parallel's passes, N virtual devices) ─► lower_sequence_to_rank ('cp' mesh)
                                         ├─► split_stages ─► [insert_scatter_gather] ─► insert_stage_transfers (pipeline)
                                         └─► split_stages ─► insert_scatter_gather ─► cut_stage (pipeline, one "pp" rank)
    ... ─► draw_random_whole ─► checkpoint_activations ─► [name_dp_copies ─► place_dp_copies] (one process)

Every one-process lowering ends with ``draw_random_whole`` where ``exact_random=True`` (the default:
random ops draw the single-device values), then ``checkpoint_activations`` where
``activation_checkpointing=`` names regions (a recomputed region reads the draws its call made). See ``passes/README.md`` for the invariants every pass
keeps and why the order is this one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from dpcompile.analysis.context_exchange import DEFAULT_OPTIONS, ContextParallelOptions
from dpcompile.devices import Devices
from dpcompile.infra import Pass
from dpcompile.runtime.sequence_balance import AUTO_MIN_LENGTH
from passes.all_to_all_exchange import all_to_all_exchange, find_all_to_all_sites
from passes.balance_causal_attention import balance_causal_attention, find_balance_sites
from passes.borrowed_modules import find_module_homes, replicate_borrowed_modules
from passes.checkpoint_activations import CheckpointRegion, checkpoint_activations, find_checkpoint_regions
from passes.choose_exchange import choose_context_exchanges, find_exchange_sites
from passes.collectives import find_collective_sites, lower_to_collectives
from passes.context_parallel import find_sequence_attention, insert_sequence_exchange, markers_take_shard_layouts
from passes.cut_stage import cut_stage
from passes.data_parallel import insert_scatter_gather
from passes.decompose_attention import decompose_attention
from passes.exact_random import draw_random_whole, find_random_sites, number_random_sites
from passes.exact_random_mesh import rank_batch_input, stamp_rank_cols, stamp_rank_rows
from passes.expand_shards import expand_shards
from passes.flatten_parameters import find_flatten_sites, hoist_flatten_parameters
from passes.functionalize import find_mutations, functionalize_mutations
from passes.name_dp_copies import find_copies_of_pieces, find_piece_names, name_dp_copies, number_copies_of_pieces
from passes.place_dp_copies import copy_device_maps, find_copy_nodes, place_dp_copies
from passes.regather_keys_values import find_regather_sites, regather_keys_values
from passes.ring_exchange import find_ring_sites, ring_exchange
from passes.sequence_copies import split_batch_into_copies, split_one_shard_batch
from passes.sequence_parallel import find_sequence_region, shard_sequence
from passes.sequence_rank import find_rank_sites, lower_sequence_to_rank
from passes.sequence_seed import split_sequence_made_inside
from passes.shard_linear import find_linear_sites, shard_linear
from passes.split_stages import StagePlan, find_stage_boundaries, split_stages
from passes.stage_transfers import insert_stage_transfers


@dataclass
class PipelineOptions:
    """Everything the passes need to know, decided by ``transform`` before they run."""

    devices: Devices
    input_dims: dict[str, int | None] = field(default_factory=dict)
    output_device: torch.device | None = None
    copy_replicas: bool = False
    plan: dict[str, str] = field(default_factory=dict)  # tensor parallel: {module path: style} to apply
    write_back_inputs: bool = False  # data parallel: writes into inputs made functional, copied back at the end
    exact_random: bool = False  # random ops draw the single-device values (draw_random_whole, last)
    context_parallel: bool = False  # the split dim is the sequence: attention's exchanges made explicit first
    context_options: ContextParallelOptions = DEFAULT_OPTIONS  # context_parallel=: the exchange asked for
    context_ranks: bool = False  # context parallel over a DeviceMesh: the devices are ranks, running at once
    sequence_parallel: bool = False  # tensor parallel: activations between the pairs on sequence shards


def exact_random_pipeline(options: PipelineOptions) -> list[Pass]:
    """``draw_random_whole`` where ``options.exact_random``: after lowering, which stamps each piece's place."""
    return [draw_random_whole] if options.exact_random else []


def frontend_pipeline(options: PipelineOptions) -> list[Pass]:
    """Passes that tidy the captured graph, whatever the parallelism (context parallel: then
    ``insert_sequence_exchange`` marks what attention needs of the sequence)."""
    exchange = (
        [functools.partial(split_sequence_made_inside, input_dims=options.input_dims),
         functools.partial(insert_sequence_exchange, input_dims=options.input_dims)]
        if options.context_parallel
        else []
    )  # fmt: skip
    attention = functools.partial(decompose_attention, dropping_only=True)  # its dropout a site drawn exactly
    if options.write_back_inputs:
        return [hoist_flatten_parameters, functools.partial(functionalize_mutations, inputs=True), attention, *exchange]
    return [hoist_flatten_parameters, functionalize_mutations, attention, *exchange]


def data_parallel_pipeline(options: PipelineOptions) -> list[Pass]:
    """Lower a tidied graph to explicit per-device data-parallel code (context parallel: each
    attention call's exchange chosen first, ``choose_context_exchanges``; after the lowering it
    gathers its keys and values again in backward, ``regather_keys_values``, or runs on the ring or
    the all-to-all where chosen, and causal calls are balanced where asked, ``balance_pipeline``)."""
    lower = functools.partial(
        insert_scatter_gather,
        devices=options.devices,
        input_dims=options.input_dims,
        output_device=options.output_device,
        copy_replicas=options.copy_replicas,
    )
    if not options.context_parallel:
        return [lower, *exact_random_pipeline(options)]
    cp = options.context_options
    return [
        functools.partial(choose_context_exchanges, options=cp, world=len(options.devices),
                          ranks=options.context_ranks),
        lower,
        regather_keys_values,
        ring_exchange,
        functools.partial(all_to_all_exchange, options=cp),
        *balance_pipeline(options),
        *exact_random_pipeline(options),
    ]


def balance_pipeline(options: PipelineOptions) -> list[Pass]:
    """``balance_causal_attention`` where ``load_balance=True`` (every attention must be causal), or
    ``"auto"`` over a DeviceMesh (``options.context_ranks``: the ranks run at once, so the last one's
    extra work is everyone's wait; on virtual devices of one process they run in turn: off)."""
    balance = options.context_options.load_balance
    if balance is False or (balance == "auto" and not options.context_ranks):
        return []
    shortest = 0 if balance is True else AUTO_MIN_LENGTH
    return [functools.partial(balance_causal_attention, required=balance is True, min_length=shortest)]


def sequence_copies_pipeline(options: PipelineOptions, *, copies: int, batch_dims: dict[str, int | None]) -> list[Pass]:
    """``dp`` copies of a context-parallel program (``mesh={"dp": D, "cp": C}``): the batch split
    into ``copies`` pieces (``split_batch_into_copies``), then each piece's attention marked
    (``insert_sequence_exchange``), before :func:`data_parallel_pipeline` splits the sequence."""
    return [
        functools.partial(split_batch_into_copies, copies=copies, batch_dims=batch_dims, device=options.devices.primary),
        functools.partial(insert_sequence_exchange, input_dims=options.input_dims),
    ]


def sequence_exchange_on_shards(input_dims: dict[str, int | None]) -> list[Pass]:
    """``{"cp", "tp"}``: attention marked on ``shard_linear``'s one-shard program, each marker taking
    its input's shard layout (``markers_take_shard_layouts``), so each shard gathers its own heads."""
    return [functools.partial(insert_sequence_exchange, input_dims=dict(input_dims)), markers_take_shard_layouts]


def spmd_tensor_parallel_pipeline(options: PipelineOptions) -> list[Pass]:
    """``shard_linear`` alone: the program of one shard, collectives explicit.

    ``options.plan`` is the ``{module path: style}`` dict to apply (already chosen by
    ``dpcompile.planning`` for ``tensor_parallel=True``).
    """
    return [functools.partial(shard_linear, plan=dict(options.plan), devices=options.devices)]


def tensor_parallel_pipeline(options: PipelineOptions) -> list[Pass]:
    """Lower a tidied graph to single-process tensor-parallel code over ``options.devices``."""
    return [
        *spmd_tensor_parallel_pipeline(options),
        *([functools.partial(shard_sequence, devices=options.devices)] if options.sequence_parallel else []),
        functools.partial(expand_shards, devices=options.devices, output_device=options.output_device),
        *exact_random_pipeline(options),
    ]


def spmd_pipeline(
    options: PipelineOptions, *, mesh: Any, dp_dim: str | int | None = None, tp_dim: str | int | None = None
) -> list[Pass]:
    """Lower one rank's program (captured, or ``shard_linear``'s) to torch.distributed collectives."""
    return [functools.partial(lower_to_collectives, mesh=mesh, dp_dim=dp_dim, tp_dim=tp_dim)]


def pipeline_parallel_pipeline(
    options: PipelineOptions, *, plan: StagePlan, micro_batches: int, split_always: bool = False
) -> list[Pass]:
    """Lower a tidied graph to one program over the stages' devices: stages stamped, micro-batches
    split as data parallelism splits a batch (over ``micro_batches`` virtual devices), then each
    stage placed on its device with explicit sends, in GPipe order. ``split_always``: split even one
    micro-batch (1F1B backwards each micro-batch's loss *sum*, which the split writes). The random
    sites are numbered first, whether or not this pipeline draws them (a pipeline of tensor-parallel
    stages, dp x tp's copies, draws after ``expand_shards``)."""
    out: list[Pass] = [number_random_sites, functools.partial(split_stages, plan=plan)]
    if micro_batches > 1 or split_always:
        micro = Devices((options.devices.primary,) * micro_batches)
        out.append(functools.partial(insert_scatter_gather, devices=micro, input_dims=options.input_dims,
                                     output_device=options.devices.primary))  # fmt: skip
    out.append(functools.partial(
        insert_stage_transfers, plan=plan, devices=options.devices, micro_batches=micro_batches,
        output_device=options.output_device,
    ))  # fmt: skip
    return out + exact_random_pipeline(options)


def rank_rows_pipeline(options: PipelineOptions, *, dp_rank: int | None, dp_size: int | None = None,
                       scopes: tuple[str, ...] = ()) -> list[Pass]:  # fmt: skip
    """``stamp_rank_rows`` on a captured program that one data-parallel rank of a mesh runs on its
    part of the batch (``options.input_dims``): where its random draws' rows lie (``scopes``: the
    modules called whole, FSDP's blocks)."""
    if dp_rank is None or not options.exact_random:  # each rank draws its own: no rows to stamp
        return []
    return [functools.partial(stamp_rank_rows, input_dims=dict(options.input_dims), dp_rank=dp_rank, scopes=scopes,
                              dp_size=dp_size or 1)]  # fmt: skip


def exact_random_rank_pipeline(options: PipelineOptions, *, tp_rank: int | None, dp_size: int | None,
                               scopes: tuple[str, ...] = ()) -> list[Pass]:  # fmt: skip
    """One rank's program over a mesh: its random sites' columns stamped (``tp_rank``), then, where
    ``options.exact_random``, ``draw_random_whole`` over the ``dp_size`` ranks' batches."""
    out: list[Pass] = [] if tp_rank is None else [functools.partial(stamp_rank_cols, tp_rank=tp_rank)]
    if options.exact_random:
        rank_batch = rank_batch_input(options.input_dims, dp_size) if dp_size else None
        out.append(functools.partial(draw_random_whole, rank_batch=rank_batch, scopes=scopes))
    return out


def checkpoint_pipeline(paths: tuple[str, ...], save: str = "nothing") -> list[Pass]:
    """``checkpoint_activations`` over ``paths`` keeping what ``save`` names, last on a lowered program
    (nothing where no paths)."""
    return [functools.partial(checkpoint_activations, paths=paths, save=save)] if paths else []


def dp_copies_pipeline(
    micro_batches_per_copy: int | None, copies: tuple[tuple[str, ...], ...] | None = None, *, prefix: str = "dp"
) -> list[Pass]:
    """``name_dp_copies`` where a ``dp`` dimension made copies of the program, each of
    ``micro_batches_per_copy`` pieces, then :func:`place_copies_pipeline` (nothing without a
    ``dp`` dimension): last, after every rename."""
    if micro_batches_per_copy is None:
        return []
    named: list[Pass] = [functools.partial(name_dp_copies, micro_batches=micro_batches_per_copy, prefix=prefix)]
    return named + place_copies_pipeline(micro_batches_per_copy, copies)


def place_copies_pipeline(micro_batches_per_copy: int | None, copies: tuple[tuple[str, ...], ...] | None) -> list[Pass]:
    """``place_dp_copies`` onto each copy's devices (``copies``), after the program is placed on
    copy 0's devices (a pipeline of tensor-parallel stages places its shards last)."""
    if micro_batches_per_copy is None or copies is None:
        return []
    return [functools.partial(place_dp_copies, copies=copies, micro_batches=micro_batches_per_copy)]


def default_pipeline(options: PipelineOptions) -> list[Pass]:
    return frontend_pipeline(options) + data_parallel_pipeline(options)


__all__ = [
    "PipelineOptions",
    "split_sequence_made_inside",
    "default_pipeline",
    "frontend_pipeline",
    "data_parallel_pipeline",
    "hoist_flatten_parameters",
    "find_flatten_sites",
    "functionalize_mutations",
    "find_mutations",
    "insert_scatter_gather",
    "insert_sequence_exchange",
    "regather_keys_values",
    "balance_causal_attention",
    "balance_pipeline",
    "find_balance_sites",
    "find_regather_sites",
    "choose_context_exchanges",
    "find_exchange_sites",
    "ring_exchange",
    "find_ring_sites",
    "all_to_all_exchange",
    "find_all_to_all_sites",
    "find_sequence_attention",
    "lower_sequence_to_rank",
    "find_rank_sites",
    "lower_to_collectives",
    "find_collective_sites",
    "spmd_pipeline",
    "shard_linear",
    "find_linear_sites",
    "shard_sequence",
    "sequence_copies_pipeline",
    "sequence_exchange_on_shards",
    "markers_take_shard_layouts",
    "split_batch_into_copies",
    "split_one_shard_batch",
    "find_sequence_region",
    "decompose_attention",
    "draw_random_whole",
    "number_random_sites",
    "exact_random_pipeline",
    "exact_random_rank_pipeline",
    "rank_rows_pipeline",
    "stamp_rank_cols",
    "stamp_rank_rows",
    "find_random_sites",
    "expand_shards",
    "tensor_parallel_pipeline",
    "spmd_tensor_parallel_pipeline",
    "StagePlan",
    "find_stage_boundaries",
    "split_stages",
    "insert_stage_transfers",
    "pipeline_parallel_pipeline",
    "cut_stage",
    "CheckpointRegion",
    "find_checkpoint_regions",
    "checkpoint_activations",
    "checkpoint_pipeline",
    "dp_copies_pipeline",
    "find_piece_names",
    "find_module_homes",
    "name_dp_copies",
    "number_copies_of_pieces",
    "find_copies_of_pieces",
    "copy_device_maps",
    "find_copy_nodes",
    "place_dp_copies",
    "replicate_borrowed_modules",
    "place_copies_pipeline",
]
