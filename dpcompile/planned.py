"""``plan="auto"`` and ``memory_per_device=`` with a named layout: the planner's predictions turned
into a built program (``transform`` hands itself in as ``build``: this module sits below it).

    planned_transform(model, ["cuda:0", "cuda:1"], arguments, (x, y), build=transform)
    → every layout of two devices predicted (dpcompile.planner), the fastest that fits built
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import nn

from dpcompile.analysis.checkpoint_regions import check_spec
from dpcompile.analysis.device_memory import device_memory_budgets
from dpcompile.analysis.layout_costs import LayoutSpec, batch_share
from dpcompile.analysis.memory import format_budget_up, format_bytes
from dpcompile.analysis.model_profile import profile_model
from dpcompile.analysis.sequence_costs import NOT_PREDICTED
from dpcompile.capture import check_examples, check_signature
from dpcompile.devices import Devices, parse_devices
from dpcompile.errors import ArgumentError, DpCompileError
from dpcompile.mesh import is_device_mesh
from dpcompile.modules.base import ParallelModule
from dpcompile.planned_mesh import planned_mesh_transform
from dpcompile.planner import UNBUILT, Candidate, Planned, chosen_words, default_budget_words, plan_layouts
from dpcompile.planning import device_budgets

__all__ = ["LAYOUT_DEFAULTS", "SUGGESTION_TRIES", "CheckpointPlan", "check_layout_fits", "headroom", "plan_checkpointing",
           "planned_transform", "predicted_cut", "size_byte_budget"]

#: keywords that name a layout: plan="auto" chooses them
LAYOUT_DEFAULTS = {"tensor_parallel": False, "pipeline": None, "mesh": None, "micro_batches": 1, "schedule": "gpipe",
                    "activation_checkpointing": False, "sequence_parallel": False}  # fmt: skip


def planned_transform(
    model: nn.Module, devices: Any, arguments: dict[str, Any], example_tuple: tuple | None, *, build: Callable[..., Any]
) -> ParallelModule:
    """``plan="auto"``: every layout predicted (``dpcompile.planner``), the fastest that fits built
    (by ``build``, ``transform`` itself, with the candidate's keywords)."""
    auto_checkpointing = arguments["activation_checkpointing"] == "auto"
    given = [f"{k}={arguments[k]!r}" for k, v in LAYOUT_DEFAULTS.items()
             if arguments[k] != v and arguments[k] is not None and not (k == "activation_checkpointing" and auto_checkpointing)]  # fmt: skip
    if given:
        raise ArgumentError(f'plan="auto" chooses the layout itself: leave {", ".join(given)} out, or leave plan= out')
    if example_tuple is None and not arguments["example_kwargs"]:
        raise ArgumentError('plan="auto" predicts activations and step times from a fake run: give example_inputs= '
                         "(or example_kwargs=)")  # fmt: skip
    if not isinstance(model, fx.GraphModule):
        check_signature(model)
    check_examples(model, example_tuple, arguments["example_kwargs"])
    if is_device_mesh(devices):  # the layouts of the user's plain loop, over a mesh of the same ranks
        return planned_mesh_transform(model, devices, arguments, example_tuple, build=build)
    parsed = parse_devices(devices)
    if arguments["memory_per_device"] is None:  # the devices' own memory (docs/planner.md)
        budgets, source = device_memory_budgets(parsed.devices, parsed.labels())
    else:
        budgets, source = device_budgets(devices, arguments["memory_per_device"]), None
    optimizer, training = arguments["optimizer"], arguments["training"]
    planned = plan_layouts(
        model, parsed.labels(), budgets, optimizer=optimizer, training=training, example_inputs=example_tuple,
        example_kwargs=arguments["example_kwargs"], device=parsed.primary, auto_checkpointing=auto_checkpointing,
    )  # fmt: skip
    if source is not None:
        planned.judged_against(source)
    def built(candidate: Candidate, budget: Any) -> Any:
        """``candidate``'s program, or None with the candidate marked unbuilt."""
        options = {**arguments, **candidate.keywords(), "memory_per_device": None}
        if candidate.spec.size("cp") > 1:  # checked again as a named layout: its exchanges get the budget's room
            options["memory_per_device"] = budget
        try:
            pm = build(model, devices, **options)
            if candidate.spec.schedule == "1f1b" and training:  # its step is planned at the first call: plan it now
                examples = example_tuple or ()
                pm.recipe.one_f_one_b_step(pm, pm.call_key(*examples, **(arguments["example_kwargs"] or {})))
        except (DpCompileError, ValueError) as e:
            candidate.rejected, candidate.fits = f"{UNBUILT}{e}", False
            return None
        return pm

    for candidate in planned.fitting:
        pm = built(candidate, arguments["memory_per_device"] or budgets)
        if pm is None:
            continue
        planned.choose(candidate)
        pm.memory_plan = planned.estimate(candidate, optimizer, training)
        pm.candidates = planned.candidates
        pm.calibration = planned.calibration
        if auto_checkpointing:
            pm.strategies["activation_checkpointing"] = chosen_words(pm, candidate, budgets, len(planned.candidates),
                                                                      "the fastest predicted")  # fmt: skip
        if source is not None:
            pm.strategies["memory_per_device"] = default_budget_words(budgets)
        return pm
    # the error suggests the smallest predicted peak as a budget: it must build when passed back (a 1F1B
    # layout over a model that updates its state from the whole batch in forward is refused only when built)
    tensors = [*model.parameters(), *model.buffers()]
    held = [t.data for t in tensors]  # a layout built for the suggestion may have moved them (distinct GPUs)
    try:
        for candidate in sorted((c for c in planned.candidates if c.per_device and not c.fits and c.rejected
                                 and not c.rejected.startswith(UNBUILT)), key=lambda c: c.peak)[:SUGGESTION_TRIES]:  # fmt: skip
            try:
                if built(candidate, candidate.peak) is not None:
                    break
            except Exception as e:  # noqa: BLE001 - only a suggestion: the no-fit error is the answer either way
                candidate.rejected, candidate.fits = f"{UNBUILT}{type(e).__name__}: {e}", False
    finally:
        for t, data in zip(tensors, held, strict=True):
            if t.data_ptr() != data.data_ptr() or t.device != data.device:
                t.data = data
    raise planned.no_fit_error(len(parsed.labels()))


#: how many of the smallest predicted layouts a no-fit error builds (and drops where they fail) before it suggests one
SUGGESTION_TRIES = 4


def _plan_named_layout(
    model: nn.Module, devices: Devices, spec: LayoutSpec, memory_per_device: Any, optimizer: str | None,
    training: bool, example_tuple: tuple | None, example_kwargs: Mapping[str, Any] | None, *, needs_examples: str,
    auto_checkpointing: bool = False,
) -> Planned:  # fmt: skip
    """The planner's candidates for the one layout ``spec`` (with each choice of what to recompute
    where ``auto_checkpointing``), after checking the examples its fake run needs."""
    if example_tuple is None and not example_kwargs:
        raise ArgumentError(f"{needs_examples} from a fake run: give example_inputs= (or example_kwargs=)")
    if not isinstance(model, fx.GraphModule):
        check_signature(model)
    check_examples(model, example_tuple, example_kwargs)
    budgets = device_budgets(devices, memory_per_device)
    return plan_layouts(model, devices.labels(), budgets, optimizer=optimizer, training=training,
                        example_inputs=example_tuple, example_kwargs=example_kwargs, device=devices.primary,
                        specs=[spec], auto_checkpointing=auto_checkpointing)  # fmt: skip


def check_layout_fits(
    model: nn.Module, devices: Devices, spec: LayoutSpec, memory_per_device: Any, optimizer: str | None,
    training: bool, example_tuple: tuple | None, example_kwargs: Mapping[str, Any] | None,
) -> tuple[Any, Planned]:  # fmt: skip
    """The planner's prediction for the layout the user named (a pipeline, dp copies, context or
    sequence parallel), per device, and its one candidate; a ``DpCompileError`` with the arithmetic
    where it does not fit the budget."""
    planned = _plan_named_layout(
        model, devices, spec, memory_per_device, optimizer, training, example_tuple, example_kwargs,
        needs_examples=f"memory_per_device= with the layout {dict(spec.layout)} predicts each device's memory",
    )  # fmt: skip
    (candidate,) = planned.candidates
    if NOT_PREDICTED in (candidate.rejected or ""):
        raise DpCompileError(f"memory_per_device=: {candidate.rejected.removeprefix('cannot be built: ')}; leave "
                             "memory_per_device= out for this layout (explain(pm, ...) reports each device's memory)")
    if not candidate.fits:
        least = format_budget_up(candidate.peak) if candidate.per_device else None
        way_out = f"a budget of at least {least}, " if least else ""
        raise DpCompileError(
            f"memory_per_device=: the layout {spec.name} {candidate.rejected}; the way out: {way_out}more devices, "
            "another layout (plan='auto' with memory_per_device= chooses one), a lighter optimizer or a smaller batch"
        )
    return planned.estimate(candidate, optimizer, training), planned


def predicted_cut(pipeline: Any, candidate: Candidate) -> Any:
    """``pipeline=N`` the user named with ``memory_per_device=``, as the module paths where ``candidate``'s
    prediction starts stages 1.. (``plan="auto"`` builds its choice so): the pass then cuts where the
    budget was checked, not by its own count of FLOPs; any other ``pipeline=`` as given."""
    starts = list(candidate.stage_starts)
    if type(pipeline) is int and starts and len(starts) == pipeline - 1:
        return starts
    return pipeline


def headroom(planned: Planned) -> int:
    """The bytes the tightest device of ``planned``'s one candidate has left under its budget beyond
    the prediction (0 where it is over)."""
    (candidate,) = planned.candidates
    return max(0, min(planned.budgets[d] - sum(kinds.values()) for d, kinds in candidate.per_device.items()))


@dataclass
class CheckpointPlan:
    """``activation_checkpointing="auto"`` decided for a named layout: the keyword to build with,
    the chosen candidate's prediction, and every candidate tried (``explain(pm, x).candidates``)."""

    keyword: Any
    estimate: Any
    planned: Planned
    chosen: Candidate

    def words(self, pm: nn.Module) -> str:
        """``pm.strategies["activation_checkpointing"]``: what was chosen and why."""
        return chosen_words(pm, self.chosen, self.planned.budgets, len(self.planned.candidates))


def plan_checkpointing(
    model: nn.Module, devices: Devices, spec: LayoutSpec, memory_per_device: Any, optimizer: str | None,
    training: bool, example_tuple: tuple | None, example_kwargs: Mapping[str, Any] | None,
) -> CheckpointPlan:  # fmt: skip
    """``activation_checkpointing="auto"`` on the layout ``spec``: the first of
    :func:`~dpcompile.planner.checkpoint_ladder` (nothing; every block keeping at most decreasing
    byte budgets; every block keeping nothing) whose predicted peak fits every device's budget; a
    ``DpCompileError`` naming the smallest predicted peak and what to change where none does."""
    planned = _plan_named_layout(
        model, devices, spec, memory_per_device, optimizer, training, example_tuple, example_kwargs,
        needs_examples='activation_checkpointing="auto" predicts each choice\'s peak', auto_checkpointing=True,
    )  # fmt: skip
    chosen = next((c for c in planned.candidates if c.fits), None)
    if chosen is None:
        predicted = [c for c in planned.candidates if c.per_device]
        least = min(reversed(predicted), key=lambda c: c.peak, default=None)  # ties: the one keeping the least
        if least is None:
            reasons = dict.fromkeys(str(c.rejected).removeprefix("cannot be built: ") for c in planned.candidates)
            raise DpCompileError(f"activation_checkpointing='auto': the layout {spec.name} cannot be built: "
                                 + "; ".join(reasons))  # every choice fails alike: each reason once
        device = max(least.per_device, key=lambda d: sum(least.per_device[d].values()))
        terms = " + ".join(f"{format_bytes(v)} {k}" for k, v in least.per_device[device].items())
        raise DpCompileError(
            f"activation_checkpointing='auto': no choice of what to recompute fits memory_per_device="
            f"{format_bytes(min(planned.budgets.values()))} on {spec.name.split(' ')[0]}: of the {len(planned.candidates)} "
            f"predicted, the smallest peak is {format_bytes(least.peak)} per device ({least.spec.name}: {terms} on "
            f"{device}). The way out: a budget of at least {format_budget_up(least.peak)} ({least.peak} bytes), more "
            "devices, plan='auto' (pipeline stages), a lighter optimizer or a smaller batch" + _no_blocks(planned, training)
        )
    planned.choose(chosen, f"fits, but recomputes more than {chosen.spec.name}")
    return CheckpointPlan(chosen.spec.checkpoint_keyword(), planned.estimate(chosen, optimizer, training), planned,
                          chosen)  # fmt: skip


def _no_blocks(planned: Planned, training: bool) -> str:
    """Why only recomputing nothing was predicted, where the model has no repeated blocks."""
    if not training or any(c.spec.checkpointing for c in planned.candidates):
        return ""
    return ("; the model has no repeated blocks (a ModuleList or Sequential of one block type) for 'auto' to "
            "recompute: name the modules, e.g. activation_checkpointing={'regions': ['encoder'], 'save': 'auto', "
            "'budget_bytes': '40MiB'}")  # fmt: skip


def size_byte_budget(
    model: nn.Module, activation_checkpointing: Any, layout: Mapping[str, int], micro_batches: int,
    example_tuple: tuple | None, example_kwargs: Mapping[str, Any] | None, training: bool,
) -> Any:  # fmt: skip
    """``{"save": "auto", "budget_bytes": n}`` with ``"row_bytes"``, the bytes of one value per row
    (token) of a repeated block on the busiest device, from a fake run of the examples (``ValueError``
    without them); any other ``activation_checkpointing=`` as given."""
    spec = activation_checkpointing
    if not isinstance(spec, Mapping) or "budget_bytes" not in spec or spec.get("row_bytes") is not None:
        return spec
    check_spec(dict(spec))
    if example_tuple is None and not example_kwargs:
        raise ArgumentError("activation_checkpointing 'budget_bytes' counts the bytes of a region's outputs, which "
                         "the examples size: give example_inputs= (or example_kwargs=), or 'row_bytes' (the bytes "
                         "one value per token takes on a device)")  # fmt: skip
    profile = profile_model(model, example_tuple or (), example_kwargs, optimizer=None, training=training)
    row = max((u.row_bytes for u in profile.blocks or profile.units), default=0)
    share = batch_share(profile.batch, layout.get("dp", 1)) / micro_batches
    return {**spec, "row_bytes": row * share or 1}
