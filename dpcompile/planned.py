"""``plan="auto"`` and ``memory_per_device=`` with a named layout: the planner's predictions turned
into a built program (``transform`` hands itself in as ``build``: this module sits below it).

    planned_transform(model, ["cuda:0", "cuda:1"], arguments, (x, y), build=transform)
    → every layout of two devices predicted (dpcompile.planner), the fastest that fits built
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.fx as fx
from torch import nn

from dpcompile.analysis.layout_costs import LayoutSpec
from dpcompile.analysis.memory import format_budget_up
from dpcompile.capture import check_examples, check_signature
from dpcompile.devices import Devices, parse_devices
from dpcompile.errors import DpCompileError
from dpcompile.mesh import is_device_mesh
from dpcompile.modules.base import ParallelModule
from dpcompile.planned_mesh import planned_mesh_transform
from dpcompile.planner import UNBUILT, plan_layouts
from dpcompile.planning import device_budgets

__all__ = ["LAYOUT_DEFAULTS", "check_layout_fits", "planned_transform"]

#: keywords that name a layout: plan="auto" chooses them
LAYOUT_DEFAULTS = {"tensor_parallel": False, "pipeline": None, "mesh": None, "micro_batches": 1, "schedule": "gpipe",
                    "activation_checkpointing": False, "sequence_parallel": False}  # fmt: skip


def planned_transform(
    model: nn.Module, devices: Any, arguments: dict[str, Any], example_tuple: tuple | None, *, build: Callable[..., Any]
) -> ParallelModule:
    """``plan="auto"``: every layout predicted (``dpcompile.planner``), the fastest that fits built
    (by ``build``, ``transform`` itself, with the candidate's keywords)."""
    given = [f"{k}={arguments[k]!r}" for k, v in LAYOUT_DEFAULTS.items() if arguments[k] != v and arguments[k] is not None]
    if given:
        raise ValueError(f'plan="auto" chooses the layout itself: leave {", ".join(given)} out, or leave plan= out')
    if arguments["memory_per_device"] is None:
        raise ValueError('plan="auto" chooses the layout that fits memory_per_device=: give a budget, e.g. "24GiB"')
    if example_tuple is None and not arguments["example_kwargs"]:
        raise ValueError('plan="auto" predicts activations and step times from a fake run: give example_inputs= '
                         "(or example_kwargs=)")  # fmt: skip
    if not isinstance(model, fx.GraphModule):
        check_signature(model)
    check_examples(model, example_tuple, arguments["example_kwargs"])
    if is_device_mesh(devices):  # the layouts of the user's plain loop, over a mesh of the same ranks
        return planned_mesh_transform(model, devices, arguments, example_tuple, build=build)
    budgets = device_budgets(devices, arguments["memory_per_device"])
    parsed = parse_devices(devices)
    optimizer, training = arguments["optimizer"], arguments["training"]
    planned = plan_layouts(
        model, parsed.labels(), budgets, optimizer=optimizer, training=training, example_inputs=example_tuple,
        example_kwargs=arguments["example_kwargs"], device=parsed.primary,
    )  # fmt: skip
    for candidate in planned.fitting:
        options = {**arguments, **candidate.keywords(), "memory_per_device": None}
        try:
            pm = build(model, devices, **options)
            if candidate.spec.schedule == "1f1b" and training:  # its step is planned at the first call: plan it now
                examples = example_tuple or ()
                pm.recipe.one_f_one_b_step(pm, pm.call_key(*examples, **(arguments["example_kwargs"] or {})))
        except (DpCompileError, ValueError) as e:
            candidate.rejected, candidate.fits = f"{UNBUILT}{e}", False
            continue
        planned.choose(candidate)
        pm.memory_plan = planned.estimate(candidate, optimizer, training)
        pm.candidates = planned.candidates
        pm.calibration = planned.calibration
        return pm
    raise planned.no_fit_error(len(parsed.labels()))


def check_layout_fits(
    model: nn.Module, devices: Devices, spec: LayoutSpec, memory_per_device: Any, optimizer: str | None,
    training: bool, example_tuple: tuple | None, example_kwargs: Mapping[str, Any] | None,
) -> Any:  # fmt: skip
    """The planner's prediction for the layout the user named (a pipeline, dp copies), per device;
    a ``DpCompileError`` with the arithmetic where it does not fit the budget."""
    if example_tuple is None and not example_kwargs:
        raise ValueError(f"memory_per_device= with the layout {dict(spec.layout)} predicts each device's memory from "
                         "a fake run: give example_inputs= (or example_kwargs=)")  # fmt: skip
    if not isinstance(model, fx.GraphModule):
        check_signature(model)
    check_examples(model, example_tuple, example_kwargs)
    budgets = device_budgets(devices, memory_per_device)
    planned = plan_layouts(model, devices.labels(), budgets, optimizer=optimizer, training=training,
                           example_inputs=example_tuple, example_kwargs=example_kwargs, device=devices.primary,
                           specs=[spec])  # fmt: skip
    (candidate,) = planned.candidates
    if not candidate.fits:
        least = format_budget_up(candidate.peak) if candidate.per_device else None
        way_out = f"a budget of at least {least}, " if least else ""
        raise DpCompileError(
            f"memory_per_device=: the layout {spec.name} {candidate.rejected}; the way out: {way_out}more devices, "
            "another layout (plan='auto' with memory_per_device= chooses one), a lighter optimizer or a smaller batch"
        )
    return planned.estimate(candidate, optimizer, training)
