"""The tensor-parallel step of a one-process pipeline (``PipelineRecipe`` with ``plan``):
``transform(model, devices, pipeline=S, tensor_parallel=True | {path: style}, micro_batches=M)``.

``len(devices) == S * T``: stage ``i`` runs on ``devices[i*T:(i+1)*T]``, its linear layers sharded
over those ``T`` devices. The existing passes, composed:

    owned = copy.deepcopy(model)                        # as tensor parallelism: pm owns its shards
    gm = capture(owned); styles = plan_for(gm, plan, T)  # the tensor-parallel plan, for T shards
    stage_plan = find_stage_boundaries(gm, stages=S)    # cut by depth, on the unsharded graph
    gm = shard_linear(gm, plan=styles)                  # one shard's program (SPMD form)
    gm = split_stages → insert_scatter_gather → insert_stage_transfers   # micro-batches, stages, sends
    gm = expand_shards(gm, devices=T shards)            # one node per shard: fc1_mb0_dev1
    place_shards(gm, groups)                            # stage s, shard k on devices[s*T + k]

Micro-batches are split before the shards are expanded, so each micro-batch's column → row pair
runs on its stage's devices, and a mean loss, BatchNorm and every gradient keep the
single-device values. Values that cross a stage boundary are whole (replicated or gathered):
a cut between a column layer and the row layer it feeds is refused, with the way out.

The order is the other way round from a mesh's (``recipes/pipeline_mesh.py``: cut, then shard
each stage's program): here the stages and micro-batches are nodes of one program, and
``expand_shards`` must run after ``insert_scatter_gather`` so each micro-batch's pair stays on its
stage's devices, so the one shard's program is written before the cut.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

import passes
from dpcompile.analysis.batch_dims import infer_input_dims
from dpcompile.analysis.cost import plan_cost
from dpcompile.analysis.sharding import embedding_paths, linear_paths, resolve_plan
from dpcompile.capture import EXPORTED_FROM
from dpcompile.capture.inputs import check_inputs
from dpcompile.capture.norms import computed_attributes_detached
from dpcompile.devices import Devices
from dpcompile.errors import ArgumentError, DpCompileError
from dpcompile.fake import FakeCudaOnCpuTorch, fake_copy, fake_copy_to_trace
from dpcompile.fx_utils import bind_inputs, copy_graph, graph_module, unalias
from dpcompile.infra import info_of, run_passes
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.carried import modes_applied
from dpcompile.modules.executors import hold_pipeline, hold_stage_groups
from dpcompile.modules.fsdp_one_process import tensor_parallel_shards
from dpcompile.modules.pipeline import Stage
from dpcompile.modules.pipeline_1f1b import OneFOneBStep
from dpcompile.modules.sharded_state import hold_shards, param_bytes_per_slot
from dpcompile.modules.tensor_parallel import watch_source_parameters
from dpcompile.planning import plan_for
from dpcompile.program_cache import CallKey
from dpcompile.recipes.data_parallel import refuse_features_as_sequence, without_sequence_replicated
from dpcompile.recipes.pipeline_stages import check_sequence_pipeline, place_stages, stage_weights, unpair_across_cuts
from dpcompile.recipes.tensor_parallel import (
    aliased_plan,
    capture_to_shard,
    describe_choices,
    share_tied_shards,
    tied_groups,
    tied_state_keys,
    unaliased_findings,
)
from passes.borrowed_modules import replicate_borrowed_modules, send_borrowed_reads
from passes.split_stages import STAGE, StagePlan, stage_programs
from passes.stage_shards import (
    borrow_shapes,
    inside_sharded_regions,
    name_own_sources,
    place_shard_values,
    read_each_parameter_once,
    restore_shard_layouts,
    shard_findings,
    stages_of_shards,
    tidy_micro_batch_names,
)


def _starves_a_stage(plan: StagePlan) -> bool:
    """Whether a stage of ``plan`` does under half its equal share of the work (one of 2 stages of
    ``Residual`` holding only the loss, with every block before it)."""
    total = sum(plan.weights)
    return total > 0 and min(plan.weights) < 0.5 * total / len(plan.weights)


def compile_sharded_stages(
    recipe: Any,
    model: nn.Module,
    example_inputs: Sequence[Any] | None,
    *,
    none_args: frozenset[str] = frozenset(),
    flags: Mapping[str, Any] | None = None,
) -> ParallelModule:
    """``PipelineRecipe.compile`` with a ``plan``; ``none_args``/``flags``: a program for a call
    that departs from the first one (:func:`build_sharded_program`)."""
    if recipe.context_parallel:
        check_sequence_pipeline(example_inputs)
    groups = stage_groups(recipe.devices, recipe.stage_count)
    shards = len(groups[0])
    state_keys, state_aliases = list(model.state_dict().keys()), tied_state_keys(model)
    gm, flags, none_args, _ = capture_to_shard(model, recipe.leaf_modules, example_inputs, none_args, flags)
    captured_code = gm.code
    weights = stage_weights(gm, example_inputs)
    input_dims = infer_input_dims(gm, batch_dim=recipe.batch_dim, example_inputs=example_inputs)
    if recipe.context_parallel:
        input_dims = without_sequence_replicated(gm, input_dims, example_inputs)
        refuse_features_as_sequence(gm, input_dims, example_inputs)
    styles, reasons = plan_for(gm, aliased_plan(recipe.plan), shards, model)
    options = passes.PipelineOptions(  # a write into an input made functional and copied back, as pipeline=S does
        devices=groups[0], output_device=groups[0].primary, plan=styles, write_back_inputs=True
    )
    gm, records = run_passes(gm, passes.frontend_pipeline(options))
    inside = inside_sharded_regions(gm, resolve_plan(gm, plan=styles, n=shards).analysis.layouts)
    stage_plan = passes.find_stage_boundaries(gm, stages=recipe.stages, weights=weights, no_cut_before=inside)
    if recipe.plan is True and _starves_a_stage(stage_plan):  # pairs kept whole at any cost: a residual stream
        # sharded end to end leaves no cut but before the loss; cut where the weight is shared, pairs split there
        stage_plan = passes.find_stage_boundaries(gm, stages=recipe.stages, weights=weights)
    if recipe.plan is True and inside.intersection(stage_plan.starts):  # no cut keeps every pair in one stage
        styles, unpaired = unpair_across_cuts(gm, styles, stage_plan)
        reasons.update(unpaired)
        options = dataclasses.replace(options, plan=styles)
    if stage_plan.stages * shards != len(recipe.devices):
        raise ArgumentError(
            f"pipeline={recipe.stages!r} makes {stage_plan.stages} stages of {shards} tensor-parallel shards "
            f"({stage_plan.stages} x {shards} = {stage_plan.stages * shards}), but {len(recipe.devices)} devices "
            "were given"
        )
    shapes = {n.name: {k: n.meta[k] for k in ("val", "tensor_meta") if k in n.meta} for n in gm.graph.nodes}
    gm, shard_records = run_passes(gm, passes.spmd_tensor_parallel_pipeline(options))
    records += shard_records
    if recipe.context_parallel:  # attention marked on one shard's program: each shard gathers its own heads
        borrow_shapes(gm, shapes)
        if recipe.sequence_copies > 1:  # {"dp", "cp", "tp"}: the batch split into the copies first
            passes.split_one_shard_batch(gm, copies=recipe.sequence_copies, device=groups[0].primary, shapes=shapes)
        if recipe.micro_batches > 1:  # one piece (a call shorter than cp) reads its own keys: nothing to gather
            gm, exchange_records = run_passes(gm, passes.sequence_exchange_on_shards(input_dims))
            records += exchange_records
    shard_info = unaliased_findings(info_of(shard_records, "shard_linear"))
    plan = stages_of_shards(gm, stage_plan)
    borrow_shapes(gm, shapes)
    name_own_sources(gm)
    stage_devices = Devices(tuple(g.primary for g in groups))
    programs = detached(stage_programs(gm, plan, stage_devices.strings()))
    shard_shapes = {n.name: {k: n.meta[k] for k in ("val", "tensor_meta") if k in n.meta} for n in gm.graph.nodes}
    lowered, expand_records = lower_sharded(recipe, gm, plan, recipe.micro_batches, input_dims, shard_shapes)
    records += expand_records
    place_shards(lowered, groups)
    if placing := passes.place_copies_pipeline(recipe.dp_micro_batches, recipe.dp_devices):  # dp copies, each on its devices
        lowered, _ = run_passes(lowered, placing)
    # a tied name forward never reads (BERT's cls.predictions.bias, its decoder's bias sharded): the shards
    param_shards = share_tied_shards(lowered, tied_groups(model), info_of(expand_records, "expand_shards")["param_shards"])
    applied = {path: "replicate" for path in [*linear_paths(model), *embedding_paths(model)]}
    applied.update(shard_info["plan"])
    described = describe_choices(applied, shard_info)
    reasons = {unalias(p): why for p, why in reasons.items()}
    reasons = {p: reasons.get(p, described.get(p, "")) for p in {**described, **reasons}}
    pm = ParallelModule(
        lowered,
        lowered.graph,
        recipe=recipe,
        devices=recipe.devices,
        mode="pipeline_tensor_parallel",
        input_dims=input_dims,
        output_device=recipe.output_device,
        plan=applied,
        records=records,  # no captured program kept: it would hold the whole, unsharded layers
        class_name=type(model).__name__,
        share_all_of=lowered,
        source=source_to_compile_again(model, groups[0].primary) if recipe.check_available else None,
        flags=flags,
        none_args=none_args,
        shares_source=False,
        exported_from=model.meta.get(EXPORTED_FROM) if isinstance(model, fx.GraphModule) else None,  # checked at each call
    )
    hold_shards(
        pm,
        state_keys=state_keys,
        param_shards=param_shards,
        plan_reasons=reasons,
        comm_cost=plan_cost(shard_info["comms"], shards),
        captured_code=captured_code,
        state_aliases=state_aliases,
    )
    hold_stage_groups(pm, groups)
    if isinstance(model, fx.GraphModule) and (exported := model.meta.get(EXPORTED_FROM)) is not None:
        pm.__dict__["exported_inputs"] = (exported.inputs, type(exported.model).__name__)  # build_program checks
    if example_inputs is not None and recipe.check_available:  # shapes for the programs export builds ahead
        pm.__dict__[EXAMPLE_SHAPES] = [_on_meta(v) for v in example_inputs]
    held = param_bytes_per_slot(pm)
    stages = [
        Stage(s, ",".join(groups[s].strings()), stage_plan.module_paths[s], stage_plan.weights[s],
              sum(held[s * shards + k] for k in range(shards)), programs[s])
        for s in range(stage_plan.stages)
    ]  # fmt: skip
    hold_pipeline(pm, stages=stages, micro_batches=recipe.micro_batches, schedule=recipe.schedule, stage_plan=plan)
    pm.train(model.training)
    if recipe.check_available:
        watch_source_parameters(model)  # an optimizer over model.parameters() would train nothing: loud
    return pm


def lower_sharded(
    recipe: Any, gm: fx.GraphModule, plan: StagePlan, micro_batches: int, input_dims: Mapping[str, int | None],
    shapes: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[fx.GraphModule, list]:
    """One shard's program (``gm``, staged by ``plan``) lowered to micro-batches on the stages,
    then its shards expanded over each stage's devices (the parameters are cut here)."""
    groups = stage_groups(recipe.devices, recipe.stage_count)
    found, specs = shard_findings(gm)
    stage_devices = Devices(tuple(g.primary for g in groups))
    options = passes.PipelineOptions(
        devices=stage_devices, input_dims=dict(input_dims), output_device=recipe.output_device
    )
    pipeline = passes.pipeline_parallel_pipeline(
        options, plan=plan, micro_batches=micro_batches, split_always=recipe.schedule == "1f1b"
    )
    lowered, _ = run_passes(gm, pipeline, recompile=False)
    restore_shard_layouts(lowered, found, specs)
    sequence_records = shard_sequence(lowered, shapes or {}, groups[0]) if recipe.sequence_parallel else []
    expand = functools.partial(passes.expand_shards, devices=groups[0], output_device=groups[0].primary)
    exact = passes.exact_random_pipeline(passes.PipelineOptions(devices=groups[0], exact_random=recipe.exact_random))
    expanded, records = run_passes(lowered, [expand, *exact], recompile=False)
    records = sequence_records + records
    read_each_parameter_once(expanded)
    tidy_micro_batch_names(expanded)
    finishing = passes.checkpoint_pipeline(recipe.checkpointed, recipe.checkpoint_save) + passes.dp_copies_pipeline(
        recipe.dp_micro_batches, prefix="cp" if recipe.context_parallel else "dp")
    if recipe.sequence_copies > 1:  # x_dp1_cp0: copy 1's piece 0
        pieces = len(recipe.dp_devices or ()) // recipe.sequence_copies  # cp's, whatever a short call splits into
        finishing.append(functools.partial(passes.number_copies_of_pieces, pieces=pieces))
    expanded, _ = run_passes(expanded, finishing, recompile=False)
    expanded.recompile()
    return expanded, records


def shard_sequence(gm: fx.GraphModule, shapes: Mapping[str, Mapping[str, Any]], devices: Devices) -> list:
    """``shard_sequence`` over a stage's ``devices`` on each micro-batch (a dp copy's part of the
    batch) of the lowered program: its nodes read the whole batch's shape records (``shapes``) for the pass, which splits the
    sequence (dim 1) and never the batch, and are left without them after."""
    borrowed = [n for n in gm.graph.nodes
                if "val" not in n.meta and "tensor_meta" not in n.meta and n.op != "get_attr"]  # fmt: skip
    for node in borrowed:  # fc2_all_reduce_mb1: fc2_all_reduce's record
        record = shapes.get(re.sub(r"_mb\d+$", "", node.name))
        source = node.args[0] if node.args else None
        if record is None and node.meta.get("dpcompile_pass") == "insert_stage_transfers" and isinstance(source, fx.Node):
            # a value sent to the next stage (a residual across the cut): its source's record, so the pass
            # splits it on the sequence where the next stage's region reads it, as it splits any input
            record = {k: source.meta[k] for k in ("val", "tensor_meta") if k in source.meta}
        node.meta.update(record or {})
    gm, records = run_passes(gm, [functools.partial(passes.shard_sequence, devices=devices)], recompile=False)
    made = {id(n.meta["val"]) for n in borrowed if "val" in n.meta}
    for node in gm.graph.nodes:
        if node in borrowed or id(node.meta.get("val")) in made:
            node.meta.pop("val", None)
            node.meta.pop("tensor_meta", None)
        stages = [a.meta[STAGE] for a in node.all_input_nodes if STAGE in a.meta]
        made_here = node.op != "output" and node.meta.get("dpcompile_pass") != "insert_stage_transfers"
        if STAGE not in node.meta and stages and made_here:  # a node the pass made: its inputs' stage (the
            node.meta[STAGE] = max(stages)  # output's send has none: it goes to the output device)
    return records


def build_sharded_program(
    recipe: Any, pm: ParallelModule, key: CallKey, args: tuple, kwargs: dict
) -> fx.GraphModule | None:
    """``PipelineRecipe.build_program`` with a ``plan``: the program for fewer micro-batches (a
    small batch), another mode or other arguments left None: compiled again on the fake copy of
    the model with ``pm``'s plan, its code run on ``pm``'s shards."""
    source = pm.traced_model
    if source is None:
        raise pm.cannot_trace_again(key)
    if (exported := pm.__dict__.get("exported_inputs")) is not None and (args or kwargs):  # export fixed these
        check_inputs(exported[0], args, kwargs, exported[1])
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    values = bind_inputs(pm, args, kwargs) if args or kwargs else _example_shapes(pm, key)
    with modes_applied(source, key.modes), mode, FakeCudaOnCpuTorch(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        example = None if values is None else tree_map(
            lambda v: mode.from_tensor(v.detach()).to(recipe.devices.primary) if isinstance(v, torch.Tensor) else v,
            values,
        )  # fmt: skip
        variant = dataclasses.replace(recipe, plan=dict(pm.plan), micro_batches=key.devices, check_available=False)
        built = compile_sharded_stages(variant, source, example, none_args=key.none_args, flags=dict(key.flags))
    if built.param_shards != tensor_parallel_shards(pm):
        raise DpCompileError(
            f"the call ({key.describe()}) takes another path through forward, whose layers shard "
            "differently; transform the model for that call (example_inputs= of it)"
        )
    return (
        None
        if built.code == pm.code
        else graph_module(pm, copy_graph(built.graph), "PipelineTensorParallelVariant")
    )


def sharded_one_f_one_b_step(recipe: Any, pm: ParallelModule, key: CallKey) -> OneFOneBStep:
    """``PipelineRecipe.one_f_one_b_step`` with a ``plan``: the program a training call as ``key``
    runs (lowered with its micro-batches split even where there is one, see :func:`lower_sharded`),
    run as units of one stage and micro-batch, each unit's shards and their collectives together."""
    program = pm.program_cache.program(key, (), {})
    program = pm if program is None else program
    return OneFOneBStep(program, recipe.stage_count, key.devices)


def source_to_compile_again(model: nn.Module, device: torch.device) -> nn.Module | None:
    """A fake-tensor copy of ``model`` that ``build_program`` compiles again for a call with fewer
    micro-batches (a small batch) or in another mode. A program ``torch.export`` captured has no
    forward to trace again, but is one: its fake copy (without the model it came from) compiles as
    it did. None where there is no copy."""
    if not (isinstance(model, fx.GraphModule) and EXPORTED_FROM in model.meta):
        return fake_copy_to_trace(model, device)
    meta = model.meta
    model.meta = {k: v for k, v in meta.items() if k != EXPORTED_FROM}  # not a fake copy of the whole model too
    try:
        return fake_copy(model, FakeTensorMode(allow_non_fake_inputs=True), device)
    except Exception:  # noqa: BLE001 - variants are a refinement; the main program stands
        return None
    finally:
        model.meta = meta


def stage_groups(devices: Devices, stages: int) -> list[Devices]:
    """``devices`` cut into ``stages`` groups of ``len(devices) // stages``, in order."""
    if stages < 1 or len(devices) % stages:
        raise ArgumentError(
            f"pipeline= with tensor_parallel= runs each of the {stages} stages on an equal group of devices, but "
            f"{len(devices)} devices do not divide into {stages} groups ({len(devices)} % {stages} = "
            f"{len(devices) % stages if stages else len(devices)}); pass stages x shards devices"
        )
    t = len(devices) // stages
    return [Devices(tuple(devices[s * t + k] for k in range(t))) for s in range(stages)]


def place_shards(gm: fx.GraphModule, groups: Sequence[Devices]) -> None:
    """Put stage ``s``'s shard ``k`` on ``groups[s][k]`` (:func:`~passes.stage_shards.place_shard_values`)
    and its parameters there; the rest of stage ``s``'s state on ``groups[s][0]``, in place (a whole
    module tied across stages: :func:`~passes.borrowed_modules.replicate_borrowed_modules`). A shard
    a later stage reads too (a weight tied across stages: the LM head's and the embedding's rows)
    stays with the first stage that reads it; the later stage's shard ``k`` gets it sent to its own
    device each call (:func:`~passes.borrowed_modules.send_borrowed_reads`), its gradient summed back."""
    reads = place_shard_values(gm, groups)
    primaries = Devices(tuple(g.primary for g in groups))
    place_stages(gm, primaries, borrow=True)
    replicate_borrowed_modules(gm, devices=primaries)  # a whole (replicated) module tied across stages
    home: dict[int, int] = {}
    borrowed: dict[fx.Node, str] = {}
    for node, (s, k) in reads.items():
        parent_path, _, name = str(node.target).rpartition(".")
        parent = gm.get_submodule(parent_path)
        param = getattr(parent, name)
        device = groups[s][k]
        first = home.setdefault(id(param), s)
        if groups[first][k] != device:
            borrowed[node] = str(device)
            continue
        if param.device != device:
            if getattr(param, "fake_mode", None) is not None:  # a placement check on fake GPUs: in place, as
                with param.fake_mode:  # place_stages does, so a module tied to this one holds it too
                    param.data = param.detach().to(device)
                param.fake_device = torch.device(device)
            else:
                param.data = param.data.to(device)
    send_borrowed_reads(gm, borrowed)
    gm.recompile()


def detached(programs: Sequence[fx.GraphModule]) -> list[fx.GraphModule]:
    """Copies of the stage programs holding meta tensors (they are for reading: ``pm.stages[i].code``;
    the full, unsharded weights they were made from are not kept)."""
    out = []
    for program in programs:
        memo: dict[int, Any] = computed_attributes_detached(program, {}, "meta")
        for t in [*program.parameters(), *program.buffers()]:
            meta = t.detach().to("meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
        out.append(copy.deepcopy(program, memo))
    return out


#: ``pm.__dict__`` key: the examples transform was given, as meta tensors (shapes and dtypes only)
EXAMPLE_SHAPES = "example_shapes"


def _on_meta(value: Any) -> Any:
    return tree_map(lambda v: torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v, value)


def _example_shapes(pm: ParallelModule, key: CallKey) -> list[Any] | None:
    """The examples' shapes for a program built without a call's inputs (export builds every mode's
    ahead): the plan transform applied shards attention by heads only where shapes show them, so a
    build without shapes would shard otherwise and be refused. Arguments the key leaves None, None."""
    examples = pm.__dict__.get(EXAMPLE_SHAPES)
    if examples is None:
        return None
    names = [str(n.target).lstrip("*") for n in pm.graph.nodes if n.op == "placeholder"]
    return [None if name in key.none_args else value for name, value in zip(names, examples)]

__all__ = [
    "build_sharded_program",
    "compile_sharded_stages",
    "place_shards",
    "sharded_one_f_one_b_step",
    "stage_groups",
]
