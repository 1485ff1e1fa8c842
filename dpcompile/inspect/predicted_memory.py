"""``explain(pm, x).memory_estimate`` from the planner's model: the prediction ``plan="auto"`` makes
for the layout ``pm`` was built as (:mod:`dpcompile.analysis.layout_costs`,
:mod:`dpcompile.analysis.sequence_costs`), on a fake run of the call's inputs.

The planner's layout of a built program is read from what was built, not from what was asked:
``tensor_parallel=True, sequence_parallel=True`` where the pass found no one sequence is tensor
parallel alone; dp copies of a pipeline are predicted with the micro-batches of each copy; one-process
FSDP from the replicated layout's prediction with each device's pieces (:mod:`dpcompile.analysis.fsdp_memory`).
Where the planner predicts no such layout (:func:`why_not_predicted`), ``explain`` keeps the program
count of :func:`dpcompile.analysis.program_memory.program_memory`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch.fx as fx
from torch import nn

from dpcompile.analysis.calibration import REFERENCE
from dpcompile.analysis.fsdp_memory import fsdp_one_process, fsdp_over_copies
from dpcompile.analysis.layout_costs import LayoutSpec
from dpcompile.analysis.model_profile import ModelProfile, profile_model
from dpcompile.analysis.program_memory import fsdp_pieces, held_parameter_bytes, program_memory
from dpcompile.analysis.sequence_costs import predict_layout
from dpcompile.inspect.nodes import copy_labels
from dpcompile.inspect.replayed_model import replayed_model
from dpcompile.modules.fsdp_gather import whole_on_meta
from passes.sequence_parallel import SEQUENCE_MARK

__all__ = ["built_layout", "planner_memory", "profiled_model", "why_not_predicted"]

ORDER = ("pp", "dp", "cp", "tp")  # the planner's order of a layout's dimensions (its devices: tp innermost)


def profiled_model(pm: nn.Module) -> nn.Module | None:
    """The model ``transform`` was given (what the planner profiled; a frontend's graph is not cut into
    the same units); for a program loaded from a folder, its modules running the single-device graph the
    folder keeps (:func:`dpcompile.inspect.replayed_model.replayed_model`); None for a graph given to
    transform, or a loaded program of tensor-parallel shards."""
    if "profiled_model" not in pm.__dict__:  # loaded (dpcompile.load) or unpickled
        return replayed_model(pm)
    model = pm.__dict__.get("profiled_model")
    return model if isinstance(model, nn.Module) and not isinstance(model, fx.GraphModule) else None


def why_not_predicted(pm: nn.Module) -> str | None:
    """Why the planner's model has no prediction for ``pm``'s layout (None: it has one)."""
    recipe = getattr(pm, "recipe", None)
    if "profiled_model" not in pm.__dict__ and pm.__dict__.get("captured") is None:
        return "a program loaded (dpcompile.load) or unpickled that keeps no single-device model (tensor-parallel shards)"
    if recipe is None or not getattr(pm, "layout", None) or profiled_model(pm) is None:
        return "not a program transform built in one process from a model (an nn.Module, not a graph)"
    if pm.__dict__.get("mesh") is not None:
        return "a program over a DeviceMesh (one rank's share)"
    if "fsdp" in str((getattr(pm, "strategies", None) or {}).get("dp", "")) and not fsdp_pieces(pm):
        return "FSDP in one process whose parameters are not stored as pieces yet"
    if getattr(recipe, "leaf_modules", ()):
        return "leaf_modules= (their Linears run whole)"
    if isinstance(getattr(recipe, "plan", None), Mapping):
        return "an explicit tensor_parallel= plan"
    return None


def built_layout(pm: nn.Module) -> LayoutSpec:
    """The planner's :class:`LayoutSpec` of the program ``pm`` is (see the module's docstring)."""
    recipe = pm.recipe
    layout = tuple((dim, pm.layout[dim]) for dim in ORDER if pm.layout.get(dim, 1) > 1)
    pipeline = dict(layout).get("pp", 1) > 1
    micro = (getattr(recipe, "dp_micro_batches", None) or getattr(pm, "micro_batches", 1)) if pipeline else 1
    sequence = any(n.meta.get(SEQUENCE_MARK) for n in pm.graph.nodes)
    chosen = next((c.spec for c in getattr(pm, "candidates", None) or () if c.rejected is None), None)
    checkpointed = bool(getattr(recipe, "checkpointed", ()))
    spec = LayoutSpec(layout, getattr(pm, "schedule", None) if pipeline else None, micro, checkpointed,
                      sequence_parallel=sequence)  # fmt: skip
    if chosen is not None and chosen.checkpointing and checkpointed and chosen.layout == layout:
        return LayoutSpec(layout, spec.schedule, micro, True, chosen.save_bytes, chosen.row_bytes, sequence)
    return spec


def planner_memory(
    pm: nn.Module, labels: Sequence[str], args: Sequence[Any], kwargs: Mapping[str, Any], *, optimizer: str | None,
    training: bool, params: Mapping[str, int] | None = None,
) -> dict[str, dict[str, int]] | None:  # fmt: skip
    """The planner's bytes per device by kind for ``pm(*args, **kwargs)``, keyed by ``labels`` (the
    devices in the planner's order: pp, dp, cp, tp); None where it has no prediction for this program
    (:func:`why_not_predicted`, a layout it does not predict, a fake run it cannot make). ``params``: the
    parameter bytes each device holds (``explain``'s ``param_bytes``; FSDP's pieces)."""
    if why_not_predicted(pm) is not None or not (args or kwargs):
        return None
    spec = built_layout(pm)
    model = profiled_model(pm)
    if model is None:
        return None
    try:
        if fsdp_pieces(pm):  # profiled as the model was before its parameters were stored as pieces
            model = whole_on_meta(model)
            if model is None:
                return None
        profile = profile_model(model, tuple(args), dict(kwargs) or None, optimizer=optimizer, training=training)
        prediction = predict_layout(profile, spec, REFERENCE)
    except Exception:  # noqa: BLE001 - then the program count
        return None
    checkpointed = set(getattr(pm.recipe, "checkpointed", ()))
    if checkpointed and (checkpointed != {u.name for u in profile.blocks}
                         or (spec.save_bytes is None and getattr(pm.recipe, "checkpoint_save", "nothing") != "nothing")):
        return None  # not the planner's checkpointing: every repeated block, keeping nothing or its chosen budget
    if prediction.unbuildable or len(prediction.per_device) != len(labels):
        return None
    per_device = prediction.per_device
    if _fsdp_over_dp(pm):  # data parallel's sweep with each device's pieces and the first device's gathers
        pieces = held_parameter_bytes(pm, labels, [None] * len(labels))  # type: ignore[list-item]
        stored = fsdp_pieces(pm)
        gathered = sum(p.numel() * p.element_size() for name, p in pm.named_parameters() if name in stored)
        per_device = fsdp_one_process(profile, spec, per_device, [pieces[label] for label in labels], gathered)
    elif fsdp_pieces(pm):  # dp copies of a pipeline or of tensor-parallel shards, each parameter in pieces
        per_device = _fsdp_copies(pm, profile, spec, per_device, labels, params, optimizer, training)
        if per_device is None:
            return None
    return {label: dict(kinds) for label, kinds in zip(labels, per_device)}


def _fsdp_over_dp(pm: nn.Module) -> bool:
    """One-process FSDP over data parallelism alone (each device a copy holding one piece of each parameter)."""
    return bool(fsdp_pieces(pm)) and getattr(getattr(pm, "recipe", None), "replicates_model", False)


def _fsdp_copies(
    pm: nn.Module, profile: ModelProfile, spec: LayoutSpec, replicated: Sequence[Mapping[str, int]],
    labels: Sequence[str], params: Mapping[str, int] | None, optimizer: str | None, training: bool,
) -> list[dict[str, int]] | None:  # fmt: skip
    """:func:`dpcompile.analysis.fsdp_memory.fsdp_over_copies` of ``pm``: each device's pieces (as explain
    counts them, with their gradients and state) and, on copy 0's devices, what they gather: every
    copy's pieces of the same place, whole."""
    found = copy_labels(pm)
    if params is None or found is None or set(found[1]) != set(labels) or spec.size("cp") > 1:
        return None  # (dp copies of context-parallel shards: not predicted)
    held = program_memory(pm, params, optimizer=optimizer, training=training, activations=0, share=1.0)
    copies = found[0]
    gathered = dict.fromkeys(labels, 0)
    for k, label in enumerate(copies[0]):
        gathered[label] = sum(params.get(copy[k], 0) for copy in copies)
    # each copy making its own gradients (as a rank over a mesh does): what a pipeline stage's other copies hold
    own = predict_layout(profile, spec, dataclasses.replace(REFERENCE, ranks=len(labels))).per_device
    return fsdp_over_copies(profile, spec, replicated, [held[label] for label in labels],
                            [gathered[label] for label in labels], own if len(own) == len(labels) else None)  # fmt: skip
