"""``transform``: validate the arguments once into a :class:`~dpcompile.recipes.Recipe`, compile.

    recipe = make_recipe(model, devices, ...)    # devices parsed, options checked: once
    pm = recipe.compile(model, example_inputs)   # capture → passes → ParallelModule
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch.fx as fx
from torch import nn

from dpcompile.capture import capture_model, check_examples, check_frontend, check_signature, positional_examples
from dpcompile.devices import parse_device, parse_devices
from dpcompile.errors import DpCompileError, ExampleError
from dpcompile.mesh import check_mesh, is_device_mesh
from dpcompile.modules.base import ParallelModule
from dpcompile.recipes import DataParallelRecipe, PipelineRecipe, Recipe, SpmdRecipe, TensorParallelRecipe
from dpcompile.recipes.pipeline import check_one_process_schedule, check_pipeline_arguments
from dpcompile.recipes.pipeline_mesh import MeshPipelineRecipe

TensorParallel = bool | Mapping[str, str]


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
    pipeline: int | Sequence[str] | None = None,
    micro_batches: int = 1,
    schedule: str = "gpipe",
) -> ParallelModule:
    """Turn a single-device ``model`` into a multi-device :class:`ParallelModule`.

    >>> import torch, dpcompile
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
    >>> pm = dpcompile.transform(model, ["cpu", "cpu"])
    >>> torch.allclose(pm(torch.ones(3, 8)), model(torch.ones(3, 8)))
    True

    ``copy_replicas=True`` gives virtual devices real replicas (as distinct GPUs get), so the
    multi-GPU code path runs and can be tested on one device. ``ddp_options`` (over a mesh)
    are passed to ``DistributedDataParallel``. ``frontend=`` ``"fx"`` | ``"export"`` | ``"auto"``
    and ``example_kwargs=`` (HF models: ``input_ids=``, ``attention_mask=``, ``labels=``): see
    ``docs/frontends.md``. ``pipeline=N`` (or the module paths where stages start),
    ``micro_batches=``, ``schedule=``: pipeline parallelism, see ``docs/pipeline.md``.
    """
    recipe = make_recipe(
        model,
        devices,
        tensor_parallel=tensor_parallel,
        frontend=frontend,
        batch_dim=batch_dim,
        output_device=output_device,
        leaf_modules=leaf_modules,
        copy_replicas=copy_replicas,
        ddp_options=ddp_options,
        pipeline=pipeline,
        micro_batches=micro_batches,
        schedule=schedule,
    )
    if not isinstance(model, fx.GraphModule):
        check_signature(model)
    example_tuple = _example_tuple(example_inputs)
    check_examples(model, example_tuple, example_kwargs)
    with _gc_paused():
        model, examples, frontend_batch_dim = _apply_frontend(
            model, frontend, example_tuple, example_kwargs, recipe.leaf_modules, batch_dim,
            flags_served=isinstance(recipe, (DataParallelRecipe, PipelineRecipe)),
        )  # fmt: skip
        if isinstance(recipe, (DataParallelRecipe, PipelineRecipe)) and frontend_batch_dim != recipe.batch_dim:
            recipe = dataclasses.replace(recipe, batch_dim=_check_batch_dim(frontend_batch_dim))
        return recipe.compile(model, examples)


def _apply_frontend(
    model: nn.Module,
    frontend: str,
    example_inputs: tuple | None,
    example_kwargs: Mapping[str, Any] | None,
    leaf_modules: tuple[type[nn.Module], ...],
    batch_dim: int | None,
    flags_served: bool,
) -> tuple[nn.Module, tuple | None, int | None]:
    """The model as its frontend captures it (:func:`dpcompile.capture.capture_model`): the model
    itself where fx traces it (the recipe traces it, with its variants), else the exported
    program (a GraphModule over the model's own modules and parameters); and the examples as
    positional values in the program's argument order."""
    no_examples = example_inputs is None and not example_kwargs
    if isinstance(model, fx.GraphModule) or frontend == "fx" or (frontend == "auto" and no_examples):
        return model, positional_examples(model, example_inputs, example_kwargs), batch_dim
    gm, info = capture_model(
        model, frontend=frontend, example_inputs=example_inputs, example_kwargs=example_kwargs,
        leaf_modules=leaf_modules, batch_dim=batch_dim,
    )  # fmt: skip
    if info.frontend == "fx" and (flags_served or not info.flags or frontend == "fx"):
        return model, info.example_inputs, batch_dim
    if info.frontend == "fx":  # fx needs flags fixed, which only data parallel re-checks per call
        gm, info = capture_model(
            model, frontend="export", example_inputs=example_inputs, example_kwargs=example_kwargs, batch_dim=batch_dim
        )
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
) -> Recipe:
    """The arguments of :func:`transform`, validated once, as a typed, picklable recipe."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module or a torch.fx.GraphModule, got {type(model).__name__}")
    leaves = _check_leaf_modules(leaf_modules)
    check_frontend(frontend)
    plan = _check_plan_argument(tensor_parallel)
    common = {"leaf_modules": leaves, "frontend": frontend}
    if pipeline is not None:
        return _pipeline_recipe(common, devices, plan, output_device, batch_dim, pipeline, micro_batches, schedule)
    if is_device_mesh(devices):
        check_mesh(devices, plan)  # a mesh that cannot serve the plan fails here, not mid-compile
        return SpmdRecipe(**common, mesh=devices, plan=plan, ddp_options=dict(ddp_options or {}))
    parsed = parse_devices(devices)
    out_device = parsed.primary if output_device is None else parse_device(output_device)
    if plan is not False:
        return TensorParallelRecipe(**common, devices=parsed, output_device=out_device, plan=plan)
    return DataParallelRecipe(
        **common, devices=parsed, output_device=out_device, batch_dim=_check_batch_dim(batch_dim),
        copy_replicas=bool(copy_replicas),
    )  # fmt: skip


def _pipeline_recipe(
    common: dict[str, Any], devices: Any, plan: object, output_device: Any, batch_dim: object,
    pipeline: object, micro_batches: object, schedule: object,
) -> PipelineRecipe | MeshPipelineRecipe:  # fmt: skip
    stages, micro, schedule_name = check_pipeline_arguments(pipeline, micro_batches, schedule)
    if is_device_mesh(devices):
        if plan is not False:
            raise DpCompileError("pipeline= with tensor_parallel= over a mesh is not built yet; use a ('pp', 'dp') mesh")
        return MeshPipelineRecipe(
            **common, mesh=devices, stages=stages, micro_batches=micro, schedule=schedule_name,
            batch_dim=_check_batch_dim(batch_dim),
        )  # fmt: skip
    check_one_process_schedule(schedule_name)
    if plan is not False:
        raise DpCompileError(
            "pipeline= with tensor_parallel= is not built yet; choose one: pipeline stages, or tensor-parallel shards"
        )
    parsed = parse_devices(devices)
    out_device = parsed.primary if output_device is None else parse_device(output_device)
    return PipelineRecipe(
        **common, devices=parsed, output_device=out_device, stages=stages, micro_batches=micro,
        schedule=schedule_name, batch_dim=_check_batch_dim(batch_dim),
    )  # fmt: skip


def _check_plan_argument(tensor_parallel: object) -> bool | dict[str, str]:
    """False (data parallel), True (automatic plan) or a ``{path: style}`` dict."""
    if tensor_parallel is None or tensor_parallel is False:
        return False
    if tensor_parallel is True:
        return True
    if isinstance(tensor_parallel, Mapping):
        for path in tensor_parallel:
            if not isinstance(path, str):
                raise ValueError(
                    f"tensor_parallel= plan key {path!r} is a {type(path).__name__}; keys are module paths as "
                    "model.named_modules() spells them, e.g. {'fc1': 'column', 'layers.0.fc2': 'row'}"
                )
        return dict(tensor_parallel)  # paths and styles are checked against the model (planning)
    raise ValueError(f"tensor_parallel={tensor_parallel!r}: expected False, True (automatic plan) or a dict {{path: style}}")


def _check_batch_dim(batch_dim: object) -> int | None:
    if batch_dim is None:
        return None
    if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
        raise ValueError(f"batch_dim={batch_dim!r} must be None (inferred) or a non-negative int")
    return batch_dim


def _check_leaf_modules(leaf_modules: Iterable[type[nn.Module]] | type[nn.Module]) -> tuple[type[nn.Module], ...]:
    if isinstance(leaf_modules, type):  # leaf_modules=Block: one class, as leaf_modules=[Block]
        leaf_modules = (leaf_modules,)
    try:
        leaves = tuple(leaf_modules)
    except TypeError:
        raise ValueError(f"leaf_modules= must be a list of nn.Module subclasses, got {leaf_modules!r}") from None
    for leaf in leaves:
        if not (isinstance(leaf, type) and issubclass(leaf, nn.Module)):
            raise ValueError(f"leaf_modules must hold nn.Module subclasses, got {leaf!r}")
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
