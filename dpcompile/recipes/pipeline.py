"""Pipeline parallelism in one process: capture → stages → micro-batches → a ParallelModule run by a PipelineExecutor.

    gm, flags, nones = capture_with_flags(model, ...)       # the model as a graph
    input_dims = infer_input_dims(gm, ...)                  # how a batch splits into micro-batches
    plan = find_stage_boundaries(gm, stages=N, weights=flops)  # balanced by the cost model
    program = pipeline_parallel_pipeline(gm, plan, M)       # split_stages → insert_scatter_gather
                                                            #   (micro-batches) → insert_stage_transfers
    place_stages(model, program)                            # each stage's modules to its device, in place

The module shares the model's parameters. Micro-batches are data parallelism's per-device
values on one device per stage, so a mean loss, BatchNorm statistics and every gradient are the
single-device ones (see ``passes/stage_transfers.py``). With ``plan`` (``tensor_parallel=``) each
stage's layers are sharded over its group of devices: the tensor-parallel step of
``recipes/pipeline_tensor_parallel.py`` (shard, then cut) builds that program instead.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

import passes
from dpcompile.analysis.batch_dims import infer_input_dims
from dpcompile.capture import capture
from dpcompile.devices import Devices
from dpcompile.errors import ArgumentError
from dpcompile.fx_utils import copy_graph, graph_module
from dpcompile.infra import run_passes
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.executors import hold_pipeline
from dpcompile.modules.other_mode import swap_program
from dpcompile.modules.pipeline import Stage
from dpcompile.modules.pipeline_1f1b import OneFOneBStep
from dpcompile.program_cache import CallKey
from dpcompile.recipes import pipeline_tensor_parallel as sharded
from dpcompile.recipes.base import Recipe, capture_with_flags, departing_trace, sharing_model
from dpcompile.recipes.data_parallel import without_sequence_replicated
from dpcompile.recipes.pipeline_stages import check_sequence_pipeline, place_stages, stage_weights
from passes.split_stages import StagePlan, follow_plan, stage_programs

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class PipelineRecipe(Recipe):
    """``stages`` (a count, or the module paths where stages 1.. start) over ``devices`` (one
    stage each), ``micro_batches`` per call, ``schedule`` (``"gpipe"`` or ``"1f1b"``).

    ``plan`` (``tensor_parallel=``: True or ``{path: style}``; False: none) shards each stage's
    layers over a group of ``len(devices) // stages`` devices (stage ``i`` on
    ``devices[i*T:(i+1)*T]``); ``check_available=False``: fake devices (placement checks)."""

    devices: Devices = Devices((torch.device("cpu"),))
    output_device: torch.device = torch.device("cpu")
    stages: int | tuple[str, ...] = 1
    micro_batches: int = 1
    schedule: str = "gpipe"
    batch_dim: int | None = None
    context_parallel: bool = False  # {"pp", "cp"}: the micro-batches are pieces of the sequence (batch_dim 1)
    plan: bool | Mapping[str, str] = False  # tensor parallel inside each stage
    check_available: bool = True
    sequence_parallel: bool = False  # with plan: each micro-batch's values between the pairs on sequence shards
    sequence_copies: int = 1  # {"dp", "cp", "tp"}: dp copies of the cp x tp program (dp_devices: every copy's pieces)

    @property
    def serves_flags(self) -> bool:  # type: ignore[override]
        return self.plan is False  # sharded stages are traced with their flags fixed, as tensor parallel

    @property
    def stage_count(self) -> int:
        return self.stages if isinstance(self.stages, int) else len(self.stages) + 1

    @property
    def strategy(self) -> str:  # type: ignore[override]
        return "pipeline" if self.stage_count > 1 else "data_parallel" if self.plan is False else "tensor_parallel"

    def fake_layout_fields(self, pm: ParallelModule) -> dict[str, Any]:
        return {} if self.plan is False else {"plan": dict(pm.plan) or True}

    @property
    def completes_other_mode(self) -> bool:  # type: ignore[override]
        return self.plan is False  # stages over the model's own modules (sharded ones own their shards)

    def complete_other_mode(self, pm: ParallelModule, merged: fx.GraphModule, examples: Sequence[Any] | None) -> Any:
        """The pipeline compiled again from ``merged`` over the model's own modules (which ``pm``'s stages
        hold, already on their devices): its program, capture and stages swapped into ``pm``."""
        return swap_program(pm, self.compile(merged, examples), "captured", "stages", "stage_plan")

    def compile(
        self,
        model: nn.Module,
        example_inputs: Sequence[Any] | None,
        *,
        none_args: frozenset[str] | None = None,
        flags: Mapping[str, Any] | None = None,
    ) -> ParallelModule:
        """``none_args``/``flags``: trace those arguments as None / as these values (the program of a call that
        departs from the examples, as ``verify(fake_devices=)`` rebuilds it); by default as the examples give them."""
        departs = {} if none_args is None else {"none_args": frozenset(none_args), "flags": dict(flags or {})}
        if self.plan is not False:
            return sharded.compile_sharded_stages(self, model, example_inputs, **departs)
        if self.context_parallel:
            check_sequence_pipeline(example_inputs)
        if departs:
            gm = capture(model, leaf_modules=self.leaf_modules, none_args=departs["none_args"], flags=departs["flags"] or None)
            flags, nones = departs["flags"], departs["none_args"]
        else:
            gm, flags, nones = capture_with_flags(model, self.leaf_modules, example_inputs)
        weights = stage_weights(gm, example_inputs)
        input_dims = infer_input_dims(gm, batch_dim=self.batch_dim, example_inputs=example_inputs)
        if self.context_parallel:  # attention marked before the stages are cut: each stage gathers its pieces' keys
            input_dims = without_sequence_replicated(gm, input_dims, example_inputs)
        gm, records = run_passes(gm, passes.frontend_pipeline(self.frontend_options(input_dims)))
        plan = passes.find_stage_boundaries(gm, stages=self.stages, weights=weights)
        if plan.stages != len(self.devices):
            raise ArgumentError(
                f"pipeline={_spelled(self.stages)} makes {plan.stages} stages, but {len(self.devices)} devices were "
                f"given; a pipeline runs one stage per device: pass {plan.stages} devices"
            )
        captured = graph_module(gm, copy_graph(gm.graph), type(model).__name__)
        programs = stage_programs(gm, plan, self.devices.strings())
        lowered = self.lower(gm, plan, self.micro_batches, input_dims, recompile=False)
        place_stages(lowered, self.devices, borrow=True, model=model)
        pm = ParallelModule(
            lowered, lowered.graph, recipe=self, devices=self.devices, mode="pipeline", input_dims=input_dims,
            output_device=self.output_device, captured=captured, records=records,
            **sharing_model(model, gm, flags, nones),
        )  # fmt: skip
        stages = [
            Stage(s, str(self.devices[s]), plan.module_paths[s], plan.weights[s], plan.param_bytes[s], programs[s])
            for s in range(plan.stages)
        ]
        hold_pipeline(pm, stages=stages, micro_batches=self.micro_batches, schedule=self.schedule, stage_plan=plan)
        return pm

    def _options(self, input_dims: Mapping[str, int | None] | None = None) -> passes.PipelineOptions:
        return passes.PipelineOptions(
            devices=self.devices, input_dims=dict(input_dims or {}), output_device=self.output_device,
            exact_random=self.exact_random, context_parallel=self.context_parallel and input_dims is not None,
            context_options=self.context_options, write_back_inputs=True,
        )

    def lower(
        self,
        gm: fx.GraphModule,
        plan: StagePlan,
        micro_batches: int,
        input_dims: Mapping[str, int | None],
        *,
        recompile: bool = True,
        split_always: bool = False,
    ) -> fx.GraphModule:
        """A captured (and tidied) graph lowered to the pipeline program for ``micro_batches``
        (``split_always``: split even one, for 1F1B, :meth:`one_f_one_b_step`)."""
        pipeline = passes.pipeline_parallel_pipeline(
            self._options(input_dims), plan=plan, micro_batches=micro_batches, split_always=split_always
        )
        finishing = passes.checkpoint_pipeline(self.checkpointed, self.checkpoint_save) + passes.dp_copies_pipeline(
            self.dp_micro_batches, self.dp_devices, prefix="cp" if self.context_parallel else "dp")
        borrowing = [functools.partial(passes.replicate_borrowed_modules, devices=self.devices)]
        lowered, _ = run_passes(gm, pipeline + borrowing + finishing, recompile=recompile)
        return lowered

    def frontend_options(self, input_dims: Mapping[str, int | None] | None) -> passes.PipelineOptions:
        """Attention marked before the stages are cut (context parallel): each stage gathers its pieces' keys."""
        return self._options(input_dims if self.context_parallel else None)

    def build_program(self, pm: ParallelModule, key: CallKey, args: tuple, kwargs: dict) -> fx.GraphModule | None:
        if self.plan is not False:
            return sharded.build_sharded_program(self, pm, key, args, kwargs)
        captured = departing_trace(self, pm, key, args, kwargs)  # None: the main trace
        if captured is None and key.devices == pm.micro_batches and not key.unbatched:
            return None
        gm, plan = _graph_to_lower(pm, captured, f"Pipeline{key.devices}")
        return self.lower(gm, plan, key.devices, {**pm.input_dims, **dict.fromkeys(key.unbatched)})

    def one_f_one_b_step(self, pm: ParallelModule, key: CallKey) -> OneFOneBStep:
        """The 1F1B step a training call as ``key`` (micro-batches, modes, None arguments, flags)
        runs: its program, lowered with the micro-batches split even where there is one (so a mean
        loss is always a partial sum and a count per micro-batch: the step back-propagates each sum
        over the whole batch's count), run as units of one stage and micro-batch."""
        if self.plan is not False:
            return sharded.sharded_one_f_one_b_step(self, pm, key)
        gm, plan = _graph_to_lower(pm, departing_trace(self, pm, key), f"OneFOneB{key.devices}")
        program = self.lower(gm, plan, key.devices, pm.input_dims, split_always=True)
        return OneFOneBStep(program, plan.stages, key.devices)


def _graph_to_lower(pm: ParallelModule, captured: fx.GraphModule | None, name: str) -> tuple[fx.GraphModule, StagePlan]:
    """A copy of the graph a call lowers (``pm``'s main trace where ``captured`` is None) and its stage plan."""
    owner, graph = (pm, pm.captured.graph) if captured is None else (captured, captured.graph)
    gm = graph_module(owner, copy_graph(graph), name)
    return gm, pm.stage_plan if captured is None else follow_plan(gm, pm.stage_plan)


def _spelled(stages: int | tuple[str, ...]) -> str:
    return str(stages) if isinstance(stages, int) else str(list(stages))


def check_pipeline_arguments(
    pipeline: object, micro_batches: object, schedule: object
) -> tuple[int | tuple[str, ...], int, str]:
    """``pipeline=`` (an int, or a list of module paths), ``micro_batches=`` and ``schedule=``, checked."""
    if isinstance(pipeline, bool) or not isinstance(pipeline, (int, list, tuple)):
        raise ArgumentError(
            f"pipeline={pipeline!r}: expected a number of stages, or a list of module paths where stages start"
        )
    stages = pipeline if isinstance(pipeline, int) else tuple(pipeline)
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ArgumentError(f"micro_batches={micro_batches!r} must be a positive int")
    if schedule not in SCHEDULES:
        raise ArgumentError(f"schedule={schedule!r}: expected one of {list(SCHEDULES)}")
    return stages, micro_batches, str(schedule)


__all__ = ["PipelineRecipe", "SCHEDULES", "check_pipeline_arguments", "place_stages"]
