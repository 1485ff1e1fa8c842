"""``transform``: validate the arguments once into a :class:`~dpcompile.recipes.Recipe`, compile.

recipe = make_recipe(model, devices, ...)    # devices parsed, options checked: once
pm = recipe.compile(model, example_inputs)   # capture → passes → ParallelModule
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_leaves

from dpcompile.analysis.checkpoint_regions import checkpoint_paths, checkpoint_save_rule, checkpoint_words
from dpcompile.analysis.context_exchange import (
    DEFAULT_OPTIONS,
    ContextParallelOptions,
    check_exchange_composes,
    exchange_strategy,
    parse_context_parallel,
)
from dpcompile.analysis.layout_costs import LayoutSpec
from dpcompile.capture import capture_model, check_examples, check_frontend, check_signature, positional_examples
from dpcompile.capture.export import OTHER_MODE_PENDING
from dpcompile.capture.export_inputs import check_dynamic_dims
from dpcompile.capture.lazy import refuse_uninitialised
from dpcompile.capture.norms import deepcopy_module
from dpcompile.devices import parse_device, parse_devices
from dpcompile.errors import ArgumentError, DpCompileError, ExampleError, TraceError
from dpcompile.fake import has_meta_tensors
from dpcompile.fx_utils import copy_graph
from dpcompile.keywords import check_keywords_honoured, layout_of_keywords
from dpcompile.mesh import check_mesh, is_device_mesh, keywords_named_by, local_device
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.fsdp_one_process import shard_over_dp
from dpcompile.modules.other_mode import OtherModePending, waiting_in_place
from dpcompile.planned import (
    check_layout_fits,
    headroom,
    plan_checkpointing,
    planned_transform,
    predicted_cut,
    size_byte_budget,
)
from dpcompile.planning import plan_for_memory
from dpcompile.progress import reporting_steps
from dpcompile.recipes import DataParallelRecipe, PipelineRecipe, Recipe, SpmdRecipe, TensorParallelRecipe
from dpcompile.recipes.meta import compile_meta_model, compile_on_fake
from dpcompile.recipes.pipeline import check_pipeline_arguments
from dpcompile.recipes.pipeline_mesh import MeshPipelineRecipe, check_pipeline_mesh
from dpcompile.recipes.pipeline_tensor_parallel import stage_groups
from dpcompile.target import replicate_over_dp, resolve_target, strategies_of

TensorParallel = bool | Mapping[str, str]


def _reporting_progress(transform: Any) -> Any:
    """``transform`` under its ``progress=`` bars (:func:`dpcompile.progress.reporting_steps`)."""

    @functools.wraps(transform)
    def reporting(model: nn.Module, devices: Any, *, progress: bool | None = None, **options: Any) -> ParallelModule:
        _check_not_wrapped(model)
        with reporting_steps(progress):
            return transform(model, devices, progress=progress, **options)

    return reporting


def _check_not_wrapped(model: Any) -> None:
    """A program transform made, or a ``torch.compile`` wrapper, is refused naming the model to pass instead."""
    if isinstance(model, ParallelModule):
        raise ArgumentError(
            f"model is already a dpcompile.ParallelModule (a {model.mode} program); transform the original model "
            "instead (transform it again for another layout)"
        )
    if isinstance(model, nn.Module) and hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
        raise ArgumentError(
            "model is a torch.compile wrapper (OptimizedModule); transform the model itself "
            "(dpcompile.transform(model._orig_mod, ...)) and compile the program with pm.compile()"
        )
    if isinstance(model, nn.Module):
        refuse_uninitialised(model)


@_reporting_progress
def transform(
    model: nn.Module,
    devices: Any,
    *,
    tensor_parallel: TensorParallel = False,
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    frontend: str = "auto",
    batch_dim: int | None = None,
    output_device: Any = None,
    leaf_modules: Iterable[type[nn.Module]] = (),
    copy_replicas: bool = False,
    ddp_options: Mapping[str, Any] | None = None,
    dynamic_dims: Mapping[str, Sequence[int]] | Sequence[int] | None = None,
    pipeline: int | Sequence[str] | None = None,
    micro_batches: int = 1,
    schedule: str = "gpipe",
    data_parallel: str = "ddp",
    mixed_precision: Any = None,
    memory_per_device: Any = None,
    optimizer: str | None = None,
    training: bool = True,
    mesh: Mapping[str, int] | None = None,
    sequence_parallel: bool = False,
    activation_checkpointing: Any = False,
    exact_random: bool | None = None,
    plan: str | None = None,
    progress: bool | None = None,
    context_parallel: Mapping[str, Any] | None = None,
) -> ParallelModule:
    """Turn a single-device ``model`` into a multi-device :class:`ParallelModule`.

    >>> import torch, dpcompile
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
    >>> pm = dpcompile.transform(model, ["cpu", "cpu"])
    >>> torch.allclose(pm(torch.ones(3, 8)), model(torch.ones(3, 8)))
    True

    ``copy_replicas=True`` gives virtual devices real replicas (as distinct GPUs get), so the
    multi-GPU code path runs and can be tested on one device. ``ddp_options`` (over a mesh)
    are passed to ``DistributedDataParallel``; ``data_parallel="fsdp"`` shards
    parameters, gradients and optimizer state with FSDP2 instead (``mixed_precision=``: its
    ``MixedPrecisionPolicy``), and over a device list in one process (one piece per dp copy),
    see ``docs/fsdp.md``. ``memory_per_device=`` (``"24GiB"``, bytes,
    or ``{device: budget}``) with ``optimizer=`` and ``training=`` chooses the program that fits
    (``pm.strategy``), see ``docs/memory.md``. ``frontend=`` ``"fx"`` | ``"export"`` | ``"auto"``
    and ``example_kwargs=`` (HF models: ``input_ids=``, ``attention_mask=``, ``labels=``): see
    ``docs/frontends.md``. ``dynamic_dims=`` (``{"input_ids": [1]}``, or ``[1]`` for every tensor
    argument): dims besides the batch that vary between calls (a sequence length), which the
    export frontend keeps dynamic; see ``docs/guards.md``.
    ``pipeline=N`` (or the module paths where stages start),
    ``micro_batches=``, ``schedule=``: pipeline parallelism, see ``docs/pipeline.md``.
    ``mesh={"pp": 2, "tp": 2}`` names the dimensions of a device list (``docs/layouts.md``);
    ``pm.layout`` and ``pm.strategies`` say what each dimension does.
    ``context_parallel={"exchange": ..., "load_balance": ...}``: how a ``cp`` dimension exchanges keys
    and values (``docs/context_parallel.md``).
    ``progress=``: a bar per stage of the work (capture, passes, weights) on stderr, as
    ``save_checkpoint`` draws one: ``None`` where stderr is a terminal, ``True`` always, ``False`` never.
    """
    if plan == "auto":
        arguments = {k: v for k, v in locals().items() if k not in ("model", "devices", "plan")}
        return planned_transform(model, devices, arguments, _example_tuple(arguments["example_inputs"]), build=transform)
    if is_device_mesh(devices):
        local_device(devices)  # a rank likely on another rank's GPU (no torch.cuda.set_device) is warned before anything moves
    data_parallel = "ddp" if data_parallel == "replicate" else data_parallel
    pipeline, tensor_parallel = keywords_named_by(devices, pipeline=pipeline, tensor_parallel=tensor_parallel)
    schedule = schedule.lower() if isinstance(schedule, str) else schedule  # "1F1B", as torch spells its class
    check_keywords_honoured(
        devices, mesh=mesh, tensor_parallel=tensor_parallel, pipeline=pipeline, micro_batches=micro_batches,
        schedule=schedule, data_parallel=data_parallel, ddp_options=ddp_options, copy_replicas=copy_replicas,
        batch_dim=batch_dim, output_device=output_device, sequence_parallel=sequence_parallel,
        activation_checkpointing=activation_checkpointing, exact_random=exact_random, plan=plan,
        memory_per_device=memory_per_device, optimizer=optimizer, training=training, context_parallel=context_parallel,
    )  # fmt: skip
    context_options = parse_context_parallel(context_parallel)
    target = resolve_target(devices, mesh, pipeline=pipeline, tensor_parallel=tensor_parallel)
    dims = tuple(d for d, n in target.layout.items() if n > 1) if target is not None else (
        tuple(devices.mesh_dim_names or ()) if is_device_mesh(devices) else ())
    check_exchange_composes(context_options, dims)
    if context_options.exchange == "auto" and {"tp", "pp"} & set(dims):  # only the all-gather is lowered there
        context_options = dataclasses.replace(context_options, exchange="all-gather")
    fsdp_copies = _fsdp_in_one_process(devices, target, data_parallel, mixed_precision, memory_per_device, pipeline,
                                       tensor_parallel)  # fmt: skip
    if fsdp_copies:  # built as replication on a private copy, then each parameter sharded over dp
        model = _private_copy(model)
    copies, per_copy, dp_devices, sequence_split, sequence_copies = 1, None, None, False, 1
    if target is not None:  # mesh= over a device list: the same builders, devices in their order, dp composed over them
        arguments = replicate_over_dp(target, micro_batches)
        devices, pipeline, tensor_parallel = arguments["devices"], arguments["pipeline"], arguments["tensor_parallel"]
        copies, per_copy = arguments["dp_copies"], micro_batches if arguments["dp_copies"] > 1 else None
        dp_devices = arguments["dp_devices"]
        micro_batches = arguments["micro_batches"]
        sequence_split = arguments["context_parallel"]
        sequence_copies = arguments.get("sequence_copies", 1)
        batch_dim = _sequence_dim(batch_dim) if sequence_split else batch_dim
        if sequence_split and copies > 1:  # the export keeps the batch dynamic too: the copies split it
            dynamic_dims = _batch_also_dynamic(dynamic_dims)
    elif is_device_mesh(devices) and tuple(devices.mesh_dim_names or ()) in (("cp",), ("dp", "cp"), ("cp", "tp")):
        batch_dim = _sequence_dim(batch_dim)  # the frontend keeps the sequence dynamic
        if devices.ndim == 2:  # and the batch: dp ranks may hold different numbers of rows
            dynamic_dims = _batch_also_dynamic(dynamic_dims)
    estimate = None
    if memory_per_device is not None and pipeline is not None and is_device_mesh(devices):
        raise ArgumentError(
            "memory_per_device= does not plan pipeline stages over a DeviceMesh yet: give pipeline= alone, or "
            "plan the layout in one process (a device list with memory_per_device=)"
        )
    layout = target.layout if target is not None else layout_of_keywords(devices, pipeline, tensor_parallel)
    checkpoint_plan = layout_plan = None
    named = copies > 1 or pipeline is not None or sequence_split or (sequence_parallel and not is_device_mesh(devices))
    if memory_per_device is not None and (named or activation_checkpointing == "auto"):
        all_devices = target.canonical_devices() if target is not None else parse_devices(devices)
        spec = LayoutSpec(tuple((k, layout[k]) for k in ("pp", "dp", "cp", "tp") if layout.get(k, 1) > 1),
                          schedule if pipeline is not None else None, per_copy or micro_batches,
                          activation_checkpointing not in (False, None, "auto"),
                          sequence_parallel=bool(sequence_parallel))  # fmt: skip
        if activation_checkpointing == "auto":  # the layout as named; what to recompute chosen to fit
            checkpoint_plan = plan_checkpointing(model, all_devices, spec, memory_per_device, optimizer, training,
                                                 _example_tuple(example_inputs), example_kwargs)  # fmt: skip
            activation_checkpointing, estimate = checkpoint_plan.keyword, checkpoint_plan.estimate
        else:  # a named layout: checked, not chosen
            estimate, layout_plan = check_layout_fits(model, all_devices, spec, memory_per_device, optimizer, training,
                                                      _example_tuple(example_inputs), example_kwargs)  # fmt: skip
            if sequence_split:  # what the budget leaves each device beyond the prediction: the exchange's room
                context_options = dataclasses.replace(context_options, memory_headroom=headroom(layout_plan))
        pipeline = predicted_cut(pipeline, checkpoint_plan.chosen if checkpoint_plan else layout_plan.candidates[0])
        memory_per_device = None  # the layout is the user's: nothing left to choose
    sized = {k: n for k, n in layout.items() if k != "dp"} if is_device_mesh(devices) else layout  # a rank's examples
    activation_checkpointing = size_byte_budget(model, activation_checkpointing, sized, per_copy or micro_batches,
                                                _example_tuple(example_inputs), example_kwargs, training)  # fmt: skip
    recipe_options = {
        "frontend": frontend, "batch_dim": batch_dim, "output_device": output_device, "leaf_modules": leaf_modules,
        "copy_replicas": copy_replicas, "ddp_options": ddp_options, "pipeline": pipeline,
        "micro_batches": micro_batches, "schedule": schedule,
        "data_parallel": "ddp" if fsdp_copies is not None else data_parallel,
        "mixed_precision": mixed_precision, "activation_checkpointing": activation_checkpointing,
        "exact_random": exact_random is not False, "context_parallel": sequence_split,
        "context_options": context_options,
        "dp_micro_batches": per_copy, "dp_devices": dp_devices, "sequence_parallel": bool(sequence_parallel),
        "sequence_copies": sequence_copies,
    }  # fmt: skip
    example_tuple = _example_tuple(example_inputs)
    if memory_per_device is not None:
        if not isinstance(model, fx.GraphModule):
            check_signature(model)
        check_examples(model, example_tuple, example_kwargs)

        def fake_program(devices_k: Any, plan: Any) -> ParallelModule:
            """The tensor-parallel program transform would build over ``devices_k``, on fake tensors."""
            fake_recipe = make_recipe(model, devices_k, tensor_parallel=plan, **recipe_options)
            compile_one = functools.partial(
                _compile, fake_recipe, frontend=frontend, batch_dim=batch_dim, dynamic_dims=dynamic_dims
            )
            primary = fake_recipe.devices.primary  # type: ignore[attr-defined]
            with _gc_paused():
                return compile_on_fake(model, primary, example_tuple, example_kwargs, compile_one, allocate=False)

        tensor_parallel, estimate = plan_for_memory(
            model, devices, memory_per_device, optimizer, training, example_tuple, example_kwargs, tensor_parallel,
            fake_program, leaf_modules=tuple(leaf_modules or ()),
        )  # fmt: skip
    recipe = make_recipe(model, devices, tensor_parallel=tensor_parallel, **recipe_options)
    if not isinstance(model, fx.GraphModule):
        check_signature(model)
    check_examples(model, example_tuple, example_kwargs)
    _check_batch_dim_of_examples(batch_dim, example_tuple, example_kwargs)
    with _gc_paused():
        if has_meta_tensors(model):  # built on meta: capture and plan on fake tensors, allocate per device
            compile_one = functools.partial(
                _compile, recipe, frontend=frontend, batch_dim=batch_dim, dynamic_dims=dynamic_dims
            )
            pm = compile_meta_model(recipe, model, example_tuple, example_kwargs, compile_one)
        else:
            pm = _compile(
                recipe,
                model,
                example_tuple,
                example_kwargs,
                frontend=frontend,
                batch_dim=batch_dim,
                dynamic_dims=dynamic_dims,
                lazy_other_mode=not fsdp_copies or pipeline is None,  # FSDP's stages: built with both modes
                sharded_after=bool(fsdp_copies),
            )
    if fsdp_copies and fsdp_copies > 1:
        shard_over_dp(pm)
    pm.memory_options = {"optimizer": optimizer, "training": training}
    # what explain's memory_estimate profiles (not pickled; held: a weak reference died with the caller's model)
    pm.__dict__["profiled_model"] = model
    pm.memory_plan = estimate
    layout = target.layout if target is not None else layout_of_keywords(devices, pipeline, tensor_parallel)
    pm.layout = layout
    pm.strategies = strategies_of(layout, data_parallel=data_parallel, schedule=schedule)
    chosen = exchange_strategy(pm.graph.nodes) if "cp" in pm.strategies else None
    if chosen:  # each attention call's exchange (context_parallel=)
        pm.strategies["cp"] = chosen
    if sequence_parallel and "tp" in pm.strategies:
        pm.strategies["tp"] += " with sequence parallel"
    if recipe.checkpointed:
        pm.strategies["activation_checkpointing"] = checkpoint_words(recipe.checkpoint_save, recipe.checkpointed, pm)
    if estimate is not None and estimate.considered:  # memory_per_device= alone: what it weighed
        pm.candidates = estimate.considered
    if layout_plan is not None:  # the named layout's prediction: explain(pm, ...).candidates
        pm.candidates, pm.calibration = layout_plan.candidates, layout_plan.calibration
    if checkpoint_plan is not None:
        pm.candidates, pm.calibration = checkpoint_plan.planned.candidates, checkpoint_plan.planned.calibration
        pm.strategies["activation_checkpointing"] = checkpoint_plan.words(pm)
    return pm


def _compile(
    recipe: Recipe, model: nn.Module, example_tuple: tuple | None, example_kwargs: Mapping[str, Any] | None, *,
    frontend: str, batch_dim: int | None, dynamic_dims: Any = None, lazy_other_mode: bool = False,
    sharded_after: bool = False,
) -> ParallelModule:  # fmt: skip
    """``lazy_other_mode``: a program exported in one mode captures the other at its first call in it
    (:mod:`dpcompile.modules.other_mode`): built again (data parallel) or in place (``recipe.completes_other_mode``,
    or ``sharded_after``: ``model`` is a private copy FSDP shards next, its other mode exported from a stand-in)."""
    lazy_other_mode = lazy_other_mode and (recipe.lowers_capture or recipe.completes_other_mode)
    captured, examples, frontend_batch_dim = apply_frontend(
        model, frontend, example_tuple, example_kwargs, recipe.leaf_modules, batch_dim,
        flags_served=recipe.serves_flags, dynamic_dims=dynamic_dims,
        lazy_other_mode=lazy_other_mode,
    )  # fmt: skip
    lowering = recipe
    if recipe.serves_flags and frontend_batch_dim != recipe.batch_dim:  # type: ignore[attr-defined]
        lowering = dataclasses.replace(recipe, batch_dim=_check_batch_dim(frontend_batch_dim))
    pending = captured.meta.get(OTHER_MODE_PENDING) if isinstance(captured, fx.GraphModule) else None
    in_place = pending is not None and (not recipe.lowers_capture or sharded_after)
    first_mode = copy_graph(captured.graph) if in_place else None
    pm = lowering.compile(captured, examples)
    if first_mode is not None:  # a program that owns its state serves the other mode in place
        return waiting_in_place(pm, lowering, captured, first_mode, examples, sharded_after)
    if pending is not None:
        options = {"batch_dim": batch_dim, "dynamic_dims": dynamic_dims}
        both = functools.partial(_compile, recipe, model, example_tuple, example_kwargs, frontend="export", **options)
        object.__setattr__(pm, "_other_mode", OtherModePending(both, model))
    return pm


def apply_frontend(
    model: nn.Module,
    frontend: str,
    example_inputs: tuple | None,
    example_kwargs: Mapping[str, Any] | None,
    leaf_modules: tuple[type[nn.Module], ...],
    batch_dim: int | None,
    flags_served: bool,
    dynamic_dims: Any = None,
    lazy_other_mode: bool = False,
) -> tuple[nn.Module, tuple | None, int | None]:
    """The model as its frontend captures it (:func:`dpcompile.capture.capture_model`): the model
    itself where fx traces it (the recipe traces it, with its variants), else the exported
    program (a GraphModule over the model's own modules and parameters); and the examples as
    positional values in the program's argument order."""
    no_examples = example_inputs is None and not example_kwargs
    if isinstance(model, fx.GraphModule) or frontend == "fx" or (frontend == "auto" and no_examples):
        if dynamic_dims is not None and not isinstance(model, fx.GraphModule):
            check_dynamic_dims(model, dynamic_dims, example_inputs, example_kwargs)  # fx: every dim may vary
        return model, positional_examples(model, example_inputs, example_kwargs), batch_dim
    gm, info = capture_model(
        model, frontend=frontend, example_inputs=example_inputs, example_kwargs=example_kwargs,
        leaf_modules=leaf_modules, batch_dim=batch_dim, dynamic_dims=dynamic_dims, lazy_other_mode=lazy_other_mode,
    )  # fmt: skip
    if info.frontend == "fx" and (flags_served or not info.flags or frontend == "fx"):
        return model, info.example_inputs, batch_dim
    if info.frontend == "fx":  # fx needs flags fixed, which only data parallel re-checks per call
        try:
            gm, info = capture_model(
                model, frontend="export", example_inputs=example_inputs, example_kwargs=example_kwargs,
                batch_dim=batch_dim, dynamic_dims=dynamic_dims,
            )  # fmt: skip
        except TraceError:  # a dict or list argument export refuses: fx's program, as frontend="fx" gives
            return model, positional_examples(model, example_inputs, example_kwargs), batch_dim
    return gm, info.example_inputs, batch_dim if batch_dim is not None or not info.batch_dim else info.batch_dim


def make_recipe(
    model: object,
    devices: Any,
    *,
    tensor_parallel: TensorParallel = False,
    frontend: str = "auto",
    batch_dim: int | None = None,
    output_device: Any = None,
    leaf_modules: Iterable[type[nn.Module]] = (),
    copy_replicas: bool = False,
    ddp_options: Mapping[str, Any] | None = None,
    pipeline: int | Sequence[str] | None = None,
    micro_batches: int = 1,
    schedule: str = "gpipe",
    data_parallel: str = "ddp",
    mixed_precision: Any = None,
    activation_checkpointing: Any = False,
    exact_random: bool = True,
    context_parallel: bool = False,
    context_options: ContextParallelOptions = DEFAULT_OPTIONS,
    dp_micro_batches: int | None = None,
    dp_devices: tuple[tuple[str, ...], ...] | None = None,
    sequence_parallel: bool = False,
    sequence_copies: int = 1,
) -> Recipe:
    """The arguments of :func:`transform`, validated once, as a typed, picklable recipe."""
    if not isinstance(model, nn.Module):
        raise ArgumentError(f"model must be a torch.nn.Module or a torch.fx.GraphModule, got {type(model).__name__}")
    leaves = _check_leaf_modules(leaf_modules)
    check_frontend(frontend)
    plan = _check_plan_argument(tensor_parallel)
    common = {"leaf_modules": leaves, "frontend": frontend, "exact_random": bool(exact_random),
              "checkpointed": checkpoint_paths(model, activation_checkpointing),
              "checkpoint_save": checkpoint_save_rule(activation_checkpointing), "dp_micro_batches": dp_micro_batches,
              "dp_devices": dp_devices, "context_exchange": context_options.exchange,
              "context_load_balance": context_options.load_balance,
              "context_memory_headroom": context_options.memory_headroom}  # fmt: skip
    _check_data_parallel(data_parallel, mixed_precision, is_device_mesh(devices))
    if pipeline is not None:
        stages, micro, schedule_name = check_pipeline_arguments(pipeline, micro_batches, schedule)
        common.update(stages=stages, micro_batches=micro, schedule=schedule_name)
        if is_device_mesh(devices):  # data parallel over a mesh's "dp": replicated or FSDP
            check_pipeline_mesh(tuple(devices.mesh_dim_names or ()), plan, data_parallel)  # fails here, not mid-compile
            return MeshPipelineRecipe(
                **common, mesh=devices, batch_dim=_check_batch_dim(batch_dim), plan=plan, data_parallel=data_parallel,
                mixed_precision=mixed_precision, ddp_options=dict(ddp_options or {}),
            )  # fmt: skip
        parsed = parse_devices(devices)
        out_device = _output_device(parsed, output_device)
        sharding = {} if plan is False else {  # each stage's layers sharded over its group of devices
            "plan": plan, "sequence_parallel": bool(sequence_parallel), "sequence_copies": sequence_copies}
        recipe = PipelineRecipe(
            **common, devices=parsed, output_device=out_device, batch_dim=_check_batch_dim(batch_dim),
            context_parallel=bool(context_parallel), **sharding,
        )  # fmt: skip
        if plan is not False:
            stage_groups(parsed, recipe.stage_count)  # the arithmetic, before anything is captured
        return recipe
    if is_device_mesh(devices):
        check_mesh(devices, plan)  # a mesh that cannot serve the plan fails here, not mid-compile
        return SpmdRecipe(
            **common, mesh=devices, plan=plan, ddp_options=dict(ddp_options or {}), data_parallel=data_parallel,
            mixed_precision=mixed_precision, sequence_parallel=bool(sequence_parallel),
        )  # fmt: skip
    parsed = parse_devices(devices)
    out_device = _output_device(parsed, output_device)
    if plan is not False:
        return TensorParallelRecipe(
            **common, devices=parsed, output_device=out_device, plan=plan, sequence_parallel=sequence_parallel
        )
    return DataParallelRecipe(
        **common, devices=parsed, output_device=out_device, batch_dim=_check_batch_dim(batch_dim),
        copy_replicas=bool(copy_replicas), context_parallel=bool(context_parallel),
    )  # fmt: skip


def _sequence_dim(batch_dim: object) -> int:
    """The dim context parallelism splits: the sequence of batch-first inputs, ``(batch, seq, ...)``."""
    if batch_dim is not None:
        raise ArgumentError(
            f"batch_dim={batch_dim!r} with mesh={{'cp': N}}: context parallel splits dim 1, the sequence of "
            "batch-first inputs (batch, seq, ...); leave batch_dim= out"
        )
    return 1


def _batch_also_dynamic(dynamic_dims: Any) -> list[int]:
    """``dynamic_dims=`` for dp copies of a context-parallel program: dim 0 (the batch the copies
    split) as well as the sequence, for every tensor argument."""
    if isinstance(dynamic_dims, Mapping):
        raise DpCompileError(
            f"dynamic_dims={dict(dynamic_dims)!r} with mesh={{'dp': D, 'cp': N}}: the batch and the sequence of every "
            "input vary already; give dynamic_dims= as a list of dims for every tensor argument, or leave it out"
        )
    return sorted({0, *(dynamic_dims or ())})


def _check_plan_argument(tensor_parallel: object) -> bool | dict[str, str]:
    """False (data parallel), True (automatic plan) or a ``{path: style}`` dict."""
    if tensor_parallel is None or tensor_parallel is False:
        return False
    if tensor_parallel is True:
        return True
    if isinstance(tensor_parallel, Mapping):
        for path in tensor_parallel:
            if not isinstance(path, str):
                raise ArgumentError(
                    f"tensor_parallel= plan key {path!r} is a {type(path).__name__}; keys are module paths as "
                    "model.named_modules() spells them, e.g. {'fc1': 'column', 'layers.0.fc2': 'row'}"
                )
        return dict(tensor_parallel)  # paths and styles are checked against the model (planning)
    raise ArgumentError(
        f"tensor_parallel={tensor_parallel!r}: expected False, True (automatic plan) or a dict {{path: style}}"
    )


def _check_data_parallel(data_parallel: object, mixed_precision: object, over_mesh: bool) -> None:
    if data_parallel not in ("ddp", "fsdp"):
        raise ArgumentError(f'data_parallel={data_parallel!r}: expected "ddp" (the default) or "fsdp"')
    if data_parallel == "fsdp" and not over_mesh:
        raise ArgumentError(
            'make_recipe builds data_parallel="fsdp" over a DeviceMesh only; over a device list, '
            'dpcompile.transform(model, devices, data_parallel="fsdp") builds replication and shards it over dp'
        )
    if mixed_precision is not None and data_parallel != "fsdp":
        raise ArgumentError('mixed_precision= is FSDP2\'s MixedPrecisionPolicy: pass it with data_parallel="fsdp"')


def _fsdp_in_one_process(devices: Any, target: Any, data_parallel: str, mixed_precision: Any,
                         memory_per_device: Any, pipeline: Any, tensor_parallel: Any) -> int | None:  # fmt: skip
    """The size of ``dp`` where ``data_parallel="fsdp"`` shards over a device list (None otherwise);
    refuses, by name, what one-process FSDP does not take."""
    if data_parallel != "fsdp" or is_device_mesh(devices):
        return None
    layout = target.layout if target is not None else layout_of_keywords(devices, pipeline, tensor_parallel)
    if "dp" not in layout:
        raise DpCompileError(
            f'data_parallel="fsdp" shards parameters over the dp dimension, and the layout {layout} has none: add one '
            "(mesh={'dp': 2, 'tp': 2}, or leave tensor_parallel= and pipeline= out for {'dp': n})"
        )
    if mixed_precision is not None:
        raise DpCompileError(
            "mixed_precision= is FSDP2's MixedPrecisionPolicy, over a DeviceMesh; in one process FSDP keeps the "
            "parameters' dtype: leave mixed_precision= out, or convert the model first (model.to(torch.bfloat16))"
        )
    if memory_per_device is not None:
        raise DpCompileError(
            'memory_per_device= does not predict data_parallel="fsdp" in one process yet: leave it out, or plan '
            "with replication (the default data_parallel=)"
        )
    return layout["dp"]


def _private_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` for FSDP to shard (the user's model keeps its parameters whole)."""
    return deepcopy_module(model)


def _output_device(parsed: Any, output_device: Any) -> Any:
    """``output_device=`` parsed (None: the first device), its errors naming the keyword."""
    if output_device is None:
        return parsed.primary
    try:
        return parse_device(output_device)
    except ArgumentError as e:
        raise ArgumentError(f"output_device={output_device!r}: {e}") from None


def _check_batch_dim(batch_dim: object) -> int | None:
    if batch_dim is None:
        return None
    if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
        raise ArgumentError(f"batch_dim={batch_dim!r} must be None (inferred) or a non-negative int")
    return batch_dim


def _check_batch_dim_of_examples(batch_dim: Any, example_tuple: tuple | None, example_kwargs: Any) -> None:
    """A ``batch_dim=`` that no example tensor has: nothing could be split (refused now, not at the call)."""
    if batch_dim is None or (example_tuple is None and not example_kwargs):
        return
    ranks = [t.dim() for t in tree_leaves([example_tuple, dict(example_kwargs or {})]) if isinstance(t, torch.Tensor)]
    ranks = [r for r in ranks if r > 0]
    if ranks and max(ranks) <= batch_dim:
        raise ArgumentError(
            f"batch_dim={batch_dim}, but no example tensor has dim {batch_dim} (the examples have at most {max(ranks)} "
            f"dims): pass a batch_dim below {max(ranks)}, or leave it out (inferred)"
        )


def _check_leaf_modules(leaf_modules: Iterable[type[nn.Module]] | type[nn.Module]) -> tuple[type[nn.Module], ...]:
    if isinstance(leaf_modules, type):  # leaf_modules=Block: one class, as leaf_modules=[Block]
        leaf_modules = (leaf_modules,)
    try:
        leaves = tuple(leaf_modules)
    except TypeError:
        raise ArgumentError(f"leaf_modules= must be a list of nn.Module subclasses, got {leaf_modules!r}") from None
    for leaf in leaves:
        if not (isinstance(leaf, type) and issubclass(leaf, nn.Module)):
            raise ArgumentError(f"leaf_modules must hold nn.Module subclasses, got {leaf!r}")
    return leaves


def _example_tuple(example_inputs: Any) -> tuple | None:
    """The positional examples as a tuple (one bare value: a tuple of one)."""
    if example_inputs is None:
        return None
    if isinstance(example_inputs, Mapping):
        raise ExampleError(
            f"example_inputs= takes the positional examples as a tuple, got a dict (keys {list(example_inputs)[:4]}); "
            "pass examples by name as example_kwargs={...}, or (d,) where forward takes one dict"
        )
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Compiling allocates many small objects that all live on; collecting them midway only
    costs time (superlinear in the graph's size)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


__all__ = ["make_recipe", "transform"]
