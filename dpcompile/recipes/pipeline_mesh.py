"""Pipeline parallelism over a mesh's ``"pp"`` dimension, run by ``torch.distributed.pipelining``.

    gm = capture(model)                                        # every rank, the same graph
    plan = find_stage_boundaries(gm, stages=N, weights=flops)  # the same plan on every rank
    program = split_stages → insert_scatter_gather (one device: mean losses as sums and counts)
              → cut_stage(stage=pp rank)                       # this rank's stage, for one micro-batch
    PipelineStage(program, pp rank, N, device, group=pp) + ScheduleGPipe / Schedule1F1B

A ``"dp"`` dimension beside ``"pp"`` averages gradients over its ranks (each feeds its own part
of the batch, ``dpcompile.mesh.local_batch``), exactly: the loss is the mean over the whole
global batch. A ``"tp"`` dimension (with ``tensor_parallel=``) shards each stage's layers over
its ranks (:func:`shard_stage`): the stage's program, once cut, is rewritten by the tensor-parallel
lowering a ``("tp",)`` mesh uses (``shard_linear`` → ``lower_to_collectives`` over ``"tp"``) on a
private copy of the stage's modules, cut into this tp rank's shards. Every tp rank of a stage is fed
the same micro-batch and ends with the whole outputs, which ``PipelineStage`` sends on: tp rank ``t``
of stage ``i`` to tp rank ``t`` of stage ``i + 1``. Both on a ``("pp", "dp", "tp")`` mesh. The order is torchtitan's: cut the stage, shard it over ``"tp"``, then data
parallel over ``"dp"``: replicated (one all-reduce per step; ``ddp_options=``: DDP on the stage with
those options) or ``data_parallel="fsdp"`` (``fully_shard`` on the stage: :mod:`dpcompile.modules.mesh_stage_dp`;
a model built on meta is sharded once each rank has allocated its stage).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx._symbolic_trace import _assert_is_none
from torch.nn.utils.parametrize import ParametrizationList

import passes
from dpcompile.analysis.batch_dims import infer_input_dims
from dpcompile.analysis.linear_sites import linear_like_leaves
from dpcompile.capture import EXPORTED_FROM
from dpcompile.devices import Devices
from dpcompile.errors import ArgumentError, DpCompileError
from dpcompile.fake import is_fake, meta_copy_to_pickle
from dpcompile.fx_utils import ancestors, copy_graph, graph_module, propagate_shapes, unalias
from dpcompile.infra import info_of, run_passes
from dpcompile.mesh import check_fsdp_parameters, local_device, mesh_size
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.mesh_exported_inputs import hold_exported_inputs
from dpcompile.modules.mesh_pipeline import (
    attach_shards,
    example_stage_inputs,
    hold_ddp,
    mesh_pipeline_module,
    shard_over_dp,
)
from dpcompile.modules.mesh_random import StageRandomPlan
from dpcompile.modules.mesh_stage import batch_norm_dp_refusal, batch_norm_refusal, batch_statistics_sites, writes
from dpcompile.planning import plan_for
from dpcompile.recipes.base import Recipe, capture_with_flags
from dpcompile.recipes.constants import deepcopy_on_fake
from dpcompile.recipes.pipeline import stage_weights
from dpcompile.recipes.spmd import broadcast_state, example_specs, keep_own_shards
from dpcompile.recipes.tensor_parallel import aliased_plan, tied_groups, unaliased_findings
from dpcompile.runtime.tensor_parallel import ShardSpec
from passes.checkpoint_activations import paths_run_in
from passes.cut_stage import cut_stage, find_row_meetings, find_shared_parameters
from passes.stage_transfers import node_stages


@dataclass(frozen=True)
class MeshPipelineRecipe(Recipe):
    """``stages`` (a count or module paths) over the ``"pp"`` dimension of ``mesh``; ``plan``:
    tensor parallel inside each stage over a ``"tp"`` dimension (True or ``{path: style}``)."""

    mesh: Any = None
    stages: int | tuple[str, ...] = 1
    micro_batches: int = 1
    schedule: str = "gpipe"
    batch_dim: int | None = None
    plan: bool | Mapping[str, str] = field(default=False)
    data_parallel: str = "ddp"
    mixed_precision: Any = field(default=None, compare=False)
    ddp_options: Mapping[str, Any] | None = field(default=None, compare=False)  # DDP over "dp" on each stage

    strategy: ClassVar[str] = "pipeline"

    def compile(self, model: nn.Module, example_inputs: Sequence[Any] | None) -> ParallelModule:
        import torch.distributed as dist

        names = tuple(self.mesh.mesh_dim_names or ())
        check_pipeline_mesh(names, self.plan, self.data_parallel)
        if self.data_parallel == "fsdp":
            check_fsdp_parameters(model)
        pp_size = self.mesh.size(names.index("pp"))
        pp_rank = self.mesh.get_local_rank("pp")
        pp_group = self.mesh.get_group("pp")
        dp_group = self.mesh.get_group("dp") if "dp" in names else None
        device = local_device(self.mesh)
        leaves = self.leaf_modules + (linear_like_leaves() if self.plan is not False else ())
        gm, _, nones = capture_with_flags(model, leaves, example_inputs, optional_as_none=example_inputs is not None)
        call_names = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
        left_none = drop_arguments_left_none(gm, nones)
        weights = stage_weights(gm, example_inputs)
        input_dims = infer_input_dims(gm, batch_dim=self.batch_dim, example_inputs=example_inputs)
        options = passes.PipelineOptions(devices=Devices((device,)), input_dims=dict(input_dims), output_device=device)
        gm, _ = run_passes(gm, passes.frontend_pipeline(options))
        dims = ordered_input_dims(gm, input_dims, self.micro_batches)
        plan = passes.find_stage_boundaries(gm, stages=self.stages, weights=weights)
        if plan.stages != pp_size:
            raise ArgumentError(
                f"pipeline={self.stages!r} makes {plan.stages} stages, but the mesh's 'pp' dimension has {pp_size} "
                f"ranks; a pipeline runs one stage per pp rank"
            )
        pipeline = [
            functools.partial(passes.split_stages, plan=plan),
            functools.partial(passes.insert_scatter_gather, devices=Devices((device,)), input_dims=input_dims,
                              output_device=device),
        ]  # fmt: skip
        gm, _ = run_passes(gm, pipeline)
        refuse_stateful_weights(gm, self.micro_batches)
        writes_once = hoist_writes(gm, plan, self.micro_batches)  # run once a call, apart from the stages
        whole = graph_module(gm, copy_graph(gm.graph), "WholeProgram")
        random_plan = self._random_plan(gm)
        dp_size = self.mesh.size(names.index("dp")) if "dp" in names else 1
        sites = batch_statistics_sites(whole) if self.micro_batches > 1 or dp_size > 1 else []
        if sites and dp_size > 1:  # each dp rank's pipeline would see its share of the batch alone
            raise batch_norm_dp_refusal(sites, dp_size)
        if sites:  # in eval mode BatchNorm's running statistics serve any micro_batches (checked per call too)
            raise batch_norm_refusal(sites, self.micro_batches)
        if self.micro_batches > 1 and (meetings := find_row_meetings(whole)):
            combiner, reader = meetings[0]
            raise DpCompileError(
                f"'{reader.name}' reads '{combiner.name}', which mixes the rows of the batch (a statistic over the "
                f"batch dim), over a mesh with micro_batches={self.micro_batches}: torch.distributed.pipelining runs "
                "each micro-batch apart, so it would be each micro-batch's statistic, not the batch's. Use "
                "micro_batches=1, or run the pipeline in one process (devices=[...]), where it is the batch's"
            )
        shared = [(gm.get_parameter(name), stages) for name, stages in find_shared_parameters(gm, plan)]
        check_checkpointed_run(whole, self.checkpointed)
        gm, records = cut_on_every_stage(gm, plan, pp_rank, pp_group)
        checkpointing = passes.checkpoint_pipeline(paths_run_in(gm, self.checkpointed), self.checkpoint_save)
        found = info_of(records, "cut_stage")
        own_sites = frozenset(site.source for site in passes.find_random_sites(gm))  # this stage's
        if self.exact_random and self.plan is False:  # with "tp", shard_stage rewrites the sharded program
            gm, _ = run_passes(gm, [functools.partial(passes.draw_random_whole, planned=True)])
        if self.plan is False:  # last, as in one process; with "tp" on the sharded program, after shard_stage
            gm, _ = run_passes(gm, checkpointing)
        program = graph_module(gm, gm.graph, f"{type(model).__name__}Stage{pp_rank}")
        hold_unread_state(model, whole, program if pp_rank == 0 else None)
        if not any(is_fake(t) for t in (*program.parameters(), *program.buffers())):
            program.to(device)  # a meta model's fake stage already claims it: compile_on_fake allocates it
        last_rank = dist.get_global_rank(pp_group, pp_size - 1)
        pm = mesh_pipeline_module(
            program,
            recipe=self,
            mesh=self.mesh,
            stage_index=pp_rank,
            num_stages=pp_size,
            device=device,
            pp_group=pp_group,
            dp_group=dp_group,
            micro_batches=self.micro_batches,
            schedule=self.schedule,
            outputs=found.get("outputs"),
            whole=whole,
            live_in=found["inputs"],
            module_paths=plan.module_paths[pp_rank],
            last_rank=last_rank,
            has_loss=found["has_loss"],
            count=found["count"],
            shared=shared,
            writes_once=writes_once.get(pp_rank),
            random_plan=StageRandomPlan(random_plan, own_sites, device) if random_plan is not None else None,
            input_dims=dims,
        )
        if self.plan is not False:  # tensor parallel inside the stage, over the mesh's "tp" dimension
            examples = None if example_inputs is None else example_stage_inputs(pm, tuple(example_inputs))
            sharded = shard_stage(program, model=model, mesh=self.mesh, plan=self.plan, example_inputs=examples,
                                  exact_random=self.exact_random,
                                  finishing=checkpointing)  # fmt: skip
            attach_shards(pm, sharded.program, shards=sharded.shards, plan=sharded.plan, reasons=sharded.reasons)
            pm.shared = tied_shards(pm.shared, program, sharded, mesh=self.mesh)
            pm.tp_group = self.mesh.get_group("tp")
        pm.__dict__.update(call_names=call_names, left_none=left_none)  # forward's arguments; those traced as None
        hold_exported_inputs(pm, model.meta.get(EXPORTED_FROM) if isinstance(model, fx.GraphModule) else None)
        pm.state_ties = state_ties(model)  # before FSDP: fully_shard swaps the model's tied tensors apart
        # what dpcompile.export over the mesh copies (structure only) and records (the examples' shapes)
        pm.__dict__.update(model_on_meta=meta_copy_to_pickle(model), example_specs=example_specs(example_inputs))
        if self.data_parallel == "fsdp":  # FSDP over "dp" last, on the (sharded) stage
            options = {} if self.mixed_precision is None else {"mp_policy": self.mixed_precision}
            shard_over_dp(pm, self.mesh["dp"], options)
        elif self.ddp_options and dp_group is not None:  # DDP over "dp" last, as FSDP
            hold_ddp(pm, dict(self.ddp_options))
        return pm

    def _random_plan(self, gm: fx.GraphModule) -> fx.GraphModule | None:
        """The whole program with its random sites drawing through the call's record: run on fake
        tensors, it gives every stage's sites and shapes in order (None where nothing is drawn exactly)."""
        if not self.exact_random:
            return None
        program = graph_module(gm, copy_graph(gm.graph), "WholeRandomPlan")
        program, records = run_passes(program, [functools.partial(passes.draw_random_whole, planned=True)])
        return program if info_of(records, "draw_random_whole").get("exact") else None

    def build_program(self, pm: Any, key: Any, args: tuple, kwargs: dict) -> fx.GraphModule | None:
        return None


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


def check_checkpointed_run(whole: fx.GraphModule, paths: Sequence[str]) -> None:
    """The ``DpCompileError`` of a path of ``activation_checkpointing=`` that no stage runs (each stage
    checkpoints the paths it runs, so a path missing from one stage is no error)."""
    missing = [p for p in paths if p not in paths_run_in(whole, [p])]
    if missing:
        raise DpCompileError(
            f"activation_checkpointing names {missing[0]!r}, but no operation of the program runs in it (a module "
            "forward does not call); leave it out of the list"
        )


def refuse_stateful_weights(gm: fx.GraphModule, micro_batches: int) -> None:
    """A weight computed by a parametrization holding state (``parametrizations.spectral_norm``'s power
    iteration updates ``_u``/``_v`` in training), called by a stage's program: ``PipelineStage`` runs that
    program once per micro-batch, so the iteration would run ``micro_batches`` times a call (measured on a
    2-process gloo group: every gradient off). Refused by name, with the layouts where it runs once."""
    if micro_batches == 1:
        return
    for node in gm.graph.nodes:
        module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        if isinstance(module, ParametrizationList) and module.training and any(True for _ in module.buffers()):
            raise DpCompileError(
                f"'{node.target}' computes a weight with a parametrization that updates its state in training "
                f"(spectral_norm's power iteration), and over a mesh torch.distributed.pipelining runs each stage's "
                f"program once per micro-batch: with micro_batches={micro_batches} it would iterate {micro_batches} "
                "times a call. Run the pipeline in one process (devices=[...]: once a call, under GPipe and 1F1B), "
                "pass micro_batches=1, or transform the model in eval mode"
            )


def hoist_writes(gm: fx.GraphModule, plan: Any, micro_batches: int) -> dict[int, fx.GraphModule]:
    """Writes ``forward`` makes in place that read no input (a step counter ``self.calls.add_(1)``, an
    EMA of a parameter) taken out of ``gm`` into one program per stage, which its rank runs once per
    call before the schedule (``PipelineStage`` runs a stage's program once per micro-batch). Other
    writes run as often as eager runs them only with one micro-batch and inside one stage; refused
    otherwise, naming them and the ways out."""
    stages = node_stages(gm, plan)
    found = [n for n in gm.graph.nodes if writes(n)]
    reads_inputs = {n for n in gm.graph.nodes if n.op == "placeholder"}
    for n in gm.graph.nodes:
        if any(a in reads_inputs for a in n.all_input_nodes):
            reads_inputs.add(n)
    once = [n for n in found if n not in reads_inputs and all(u in found for u in n.users)]
    rest = [n for n in found if n not in once]
    crossing = [n for n in rest if any(u.op != "output" and stages.get(u) != stages.get(n) for u in n.users)]
    if rest and (micro_batches > 1 or crossing):
        why = (
            f"runs each stage's program once per micro-batch, so with micro_batches={micro_batches} each write would "
            f"run {micro_batches} times a call"
            if micro_batches > 1
            else f"cannot send a written tensor to another stage ({', '.join(n.name for n in crossing)} is read there)"
        )
        raise DpCompileError(
            f"forward writes into tensors in place from the batch ({', '.join(n.name for n in rest)}: an EMA of "
            f"an activation), and over a mesh torch.distributed.pipelining {why}. Run the pipeline in one process "
            "(devices=[...]: every write runs once per call, as eager, under GPipe and 1F1B), pass micro_batches=1 "
            "with each write and its readers in one stage (pipeline=[...module paths...]), or make the write outside "
            "forward"
        )
    chains: dict[fx.Node, list[fx.Node]] = {}  # writes into one tensor (ema.mul_(0.9).add_(w)) stay together,
    for n in once:  # on the last of their stages: it holds what they read (split_stages put w there)
        root = n
        while isinstance(root.args[0], fx.Node) and root.args[0] in once:
            root = root.args[0]
        chains.setdefault(root, []).append(n)
    stage_of = {n: max(stages[w] for w in chain) for chain in chains.values() for n in chain}
    programs: dict[int, fx.GraphModule] = {}
    for stage in sorted(set(stage_of.values())):
        mine = [n for n in once if stage_of[n] == stage]
        needed = set().union(*(ancestors(n) for n in mine))
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in gm.graph.nodes:
            if node in needed:
                env[node] = graph.node_copy(node, env.__getitem__)
        graph.output(None)
        programs[stage] = graph_module(gm, graph, f"WritesOnceStage{stage}")
    hoisted = set().union(*(ancestors(n) for n in once))
    for node in reversed(list(gm.graph.nodes)):  # the writes, then what only they read
        if node in once or (node in hoisted and node.op != "placeholder" and not node.users):
            gm.graph.erase_node(node)
    return programs


def ordered_input_dims(gm: fx.GraphModule, input_dims: Mapping[str, int | None], micro_batches: int
                       ) -> tuple[int | None, ...]:  # fmt: skip
    """Each input's batch dim in forward's order (None: it goes whole to every micro-batch).
    ``torch.distributed.pipelining`` splits micro-batches along one dim, 0, and merges the outputs
    along it: another batch dim (``batch_dim=1``, a time-major RNN's input) with ``micro_batches`` > 1
    is refused by name (it would split the sequence, silently)."""
    names = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
    dims = tuple(input_dims.get(name, 0) for name in names)
    other = [(name, d) for name, d in zip(names, dims) if d not in (None, 0)]
    if other and micro_batches > 1:
        listed = ", ".join(f"'{name}' along dim {d}" for name, d in other)
        raise DpCompileError(
            f"over a mesh a pipeline splits its micro-batches along dim 0 (torch.distributed.pipelining's chunks), "
            f"and the batch runs through {listed} (batch_dim=, or a time-major input): with micro_batches="
            f"{micro_batches} that would split another dim. Put the batch first (x.transpose(0, 1) outside the "
            "model, batch_first=True), pass micro_batches=1, or run the pipeline in one process (devices=[...])"
        )
    return dims


def state_ties(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every key of ``model.state_dict()`` with the keys of the same tensor (tied weights), its own first."""
    tied = {key: group for group in tied_groups(model) for key in group}
    return {key: (key, *(n for n in tied.get(key, ()) if n != key)) for key in model.state_dict(keep_vars=True)}


def cut_on_every_stage(gm: fx.GraphModule, plan: Any, pp_rank: int, pp_group: Any) -> tuple[fx.GraphModule, Any]:
    """``cut_stage`` of this rank's stage, where a refusal of one stage's cut (the last stage's outputs,
    neither split along the batch nor a mean loss) is every stage's: the ranks agree (one exchange over
    ``pp``) and each raises. Before: the last stage's rank raised and the others built their stages,
    then waited for it in their first step."""
    from dpcompile.modules.mesh_failure import built_on_every_rank

    def refusal(failed: list[tuple[int, str]]) -> DpCompileError:
        stage, message = failed[0]
        return DpCompileError(f"stage {stage} of the pipeline refused its cut, so every stage refuses it: {message}")

    cut = functools.partial(run_passes, gm, [functools.partial(cut_stage, plan=plan, stage=pp_rank)])
    return built_on_every_rank(cut, pp_group, refusal, caught=DpCompileError)


def drop_arguments_left_none(gm: fx.GraphModule, nones: frozenset[str]) -> frozenset[str]:
    """The optional arguments the examples leave None (``bias=None`` under ``if bias is not None:``),
    traced as None, taken out of the program: a stage is cut once and never traced again, so a call
    leaves them None (checked before the step, ``_shape_inputs``) and no stage receives them.

    Before: traced as a tensor (fx's proxy is never None), every call was refused ("missing argument
    'bias'") or split ``bias`` over the micro-batches. After: ``pm(x, labels)`` runs the examples' branch."""
    dropped = set()
    for node in list(gm.graph.nodes):
        if node.op != "placeholder" or str(node.target) not in nones:
            continue
        for user in list(node.users):
            if user.target is _assert_is_none and not user.users:
                gm.graph.erase_node(user)  # the check that the call left it None: made before the step instead
        if not node.users:
            gm.graph.erase_node(node)
            dropped.add(str(node.target))
    gm.recompile()
    return frozenset(dropped)


def hold_unread_state(model: nn.Module, whole: fx.GraphModule, first_stage: fx.GraphModule | None) -> None:
    """The model's state no stage reads (a ``steps`` counter, a spare layer: fx's programs hold only
    what their graph reads) held by the whole program and by the first stage, so that ``state_dict()``,
    ``load_state_dict`` and checkpoints have every key of the model, as one process has.

    Before: ``pm.state_dict()`` lacked ``steps``, and ``save_checkpoint`` raised "'steps' is not in the
    whole program". After: stage 0 holds ``steps`` (the model's tensor), whole on every rank."""
    from torch.fx.graph_module import _copy_attr

    held = {unalias(k) for k in whole.state_dict(keep_vars=True)}
    unread = [names[0] for names in state_ties(model).values() if not held.intersection(names)]
    for key in unread:
        for program in (whole, first_stage):
            if program is not None:
                _copy_attr(model, program, key)


def check_pipeline_mesh(names: tuple[str, ...], plan: object = False, data_parallel: str = "ddp") -> None:
    """A mesh for ``pipeline=``: a ``"pp"`` dimension, and ``"dp"``, ``"tp"`` or both beside it
    (``"tp"`` with ``tensor_parallel=``, and only with it; ``data_parallel="fsdp"`` with ``"dp"``)."""
    if "pp" not in names:
        raise ArgumentError(
            f"pipeline= over a DeviceMesh needs a dimension named 'pp', got mesh_dim_names={names}; e.g. "
            "init_device_mesh('cuda', (pp, dp), mesh_dim_names=('pp', 'dp'))"
        )
    others = set(names) - {"pp", "dp", "tp"}
    if others:
        raise DpCompileError(
            f"pipeline= over a mesh composes with 'dp' and 'tp' dimensions; mesh_dim_names={names} names "
            f"{sorted(others)}, which is not built yet: use a ('pp', 'dp', 'tp') mesh or a part of it"
        )
    tensor_parallel = plan is not False and plan is not None
    if "tp" in names and not tensor_parallel:
        raise ArgumentError(
            "a ('pp', 'tp') mesh shards each stage's layers over 'tp': pass tensor_parallel=True (the automatic "
            "plan) or a {path: style} plan, or use a ('pp',) / ('pp', 'dp') mesh"
        )
    if tensor_parallel and "tp" not in names:
        raise ArgumentError(
            f"tensor_parallel= with pipeline= shards each stage over the mesh's 'tp' dimension, and mesh_dim_names="
            f"{names} has none; build a ('pp', 'tp') mesh, e.g. init_device_mesh('cuda', (pp, tp), "
            "mesh_dim_names=('pp', 'tp'))"
        )
    if data_parallel == "fsdp" and "dp" not in names:
        raise ArgumentError(
            f"data_parallel=\"fsdp\" shards each stage over the mesh's 'dp' dimension, and mesh_dim_names={names} "
            "has none; build a ('pp', 'dp') or ('pp', 'dp', 'tp') mesh, or leave data_parallel= out"
        )


__all__ = ["MeshPipelineRecipe", "ShardedStage", "check_checkpointed_run", "check_pipeline_mesh", "hoist_writes", "shard_stage",
           "state_ties", "tied_shards"]
