"""``plan="auto"``: every layout one process's devices allow, predicted, and the fastest that fits.

:func:`enumerate_layouts` lists the layouts built in one process for ``n`` devices (data parallel,
tensor parallel, a pipeline with GPipe or 1F1B and 1, 2, 4 or 8 micro-batches, pipeline stages of
tensor-parallel shards), each with and without activation checkpointing of the repeated blocks, and
where the model has attention context parallel and tensor parallel with sequence parallel.
:func:`plan_layouts` predicts each one's peak bytes per device by kind and its step time from one
fake run of the model (:mod:`dpcompile.analysis.layout_costs`, :mod:`dpcompile.analysis.sequence_costs`,
constants from :mod:`dpcompile.analysis.calibration`) and ranks them: the fitting ones fastest first, each of the
others with the reason it was rejected. ``transform`` builds the first that builds
(see ``docs/planner.md``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpcompile.analysis.calibration import Calibration, calibrate, calibrate_mesh
from dpcompile.analysis.checkpoint_regions import lone_blocks, repeated_blocks
from dpcompile.analysis.device_memory import UNGIVEN_BUDGET_WORDS, device_memory_budgets
from dpcompile.analysis.layout_costs import LayoutSpec, batch_share, kept_levels
from dpcompile.analysis.memory import KINDS, MemoryEstimate, format_budget_up, format_bytes
from dpcompile.analysis.model_profile import ModelProfile, profile_model
from dpcompile.analysis.sequence_costs import no_one_sequence, predict_layout, splits_sequence
from dpcompile.errors import DpCompileError

__all__ = ["UNBUILT", "Candidate", "Planned", "batch_statistics_module", "checkpoint_ladder", "chosen_words", "default_budget_words", "enumerate_layouts", "has_blocks", "plan_layouts",
           "plan_mesh_layouts"]

MICRO_BATCHES = (1, 2, 4, 8)
UNBUILT = "predicted to fit, but could not be built: "


@dataclass
class Candidate:
    """One row of ``explain(pm, x).candidates``: a layout, its prediction and its fate."""

    spec: LayoutSpec
    per_device: dict[str, dict[str, int]] = field(default_factory=dict)
    step_time: float = 0.0
    rejected: str | None = None  # None: the one chosen
    fits: bool = False
    stage_starts: tuple[str, ...] = ()  # a pipeline's: the module paths where its predicted stages 1.. start
    budgets: dict[str, int] = field(default_factory=dict)  # the bytes per device it was judged against
    budget_source: str = "memory_per_device="  # or, where none was given, the devices' own memory (UNGIVEN_BUDGET_WORDS)

    @property
    def peak(self) -> int:
        return max((sum(k.values()) for k in self.per_device.values()), default=0)

    @property
    def layout(self) -> dict[str, int]:
        return dict(self.spec.layout)

    def keywords(self) -> dict[str, Any]:
        """The ``transform`` keywords that build this layout in one process."""
        spec = self.spec
        out: dict[str, Any] = {"activation_checkpointing": spec.checkpoint_keyword()}
        if spec.size("cp") > 1:  # the context-parallel program, with dp copies where dp > 1
            return {**out, "mesh": dict(spec.layout)}
        if spec.size("tp") > 1:
            out["tensor_parallel"] = True
        if spec.sequence_parallel:
            out["sequence_parallel"] = True
        if spec.size("pp") > 1:  # the stages cut where the prediction cuts them
            pipeline = list(self.stage_starts) or spec.size("pp")
            out.update(pipeline=pipeline, micro_batches=spec.micro_batches, schedule=spec.schedule)
        return out

    def to_dict(self) -> dict[str, Any]:
        peak_device = max(self.per_device, key=lambda d: sum(self.per_device[d].values()), default=None)
        return {
            "name": self.spec.name, "layout": self.layout, "schedule": self.spec.schedule,
            "micro_batches": self.spec.micro_batches if self.spec.size("pp") > 1 else None,
            "checkpointing": self.spec.checkpoint_keyword(), "sequence_parallel": self.spec.sequence_parallel,
            "predicted_peak_bytes": self.peak,
            "predicted_peak_by_kind": dict(self.per_device[peak_device]) if peak_device else {},
            "predicted_step_time": self.step_time, "fits": self.fits, "rejected": self.rejected,
            "budget_bytes": dict(self.budgets), "budget": self.budget_source,
        }  # fmt: skip

    def row(self) -> list[str]:
        why = "chosen" if self.rejected is None else self.rejected
        time = f"{self.step_time * 1e3:.3f} ms" if self.per_device and self.step_time else "-"
        return [self.spec.name, format_bytes(self.peak) if self.per_device else "-", time, why]


@dataclass
class Planned:
    """The ranked candidates: ``fitting`` fastest first (``transform`` builds the first that builds)."""

    candidates: list[Candidate]
    calibration: Calibration
    budgets: dict[str, int]
    budget_source: str = "memory_per_device="

    def judged_against(self, source: str) -> None:
        """Say where the budgets came from (the devices' own memory where none was given), on every candidate."""
        self.budget_source = source
        for c in self.candidates:
            c.budget_source = source

    @property
    def fitting(self) -> list[Candidate]:
        return sorted((c for c in self.candidates if c.fits), key=lambda c: (c.step_time, c.peak))

    def choose(self, chosen: Candidate, why: str | None = None) -> None:
        """Mark ``chosen``; every other fitting candidate is rejected as slower (or unbuilt), or ``why``."""
        chosen.rejected = None
        for c in self.candidates:
            if c is not chosen and c.fits and c.rejected is None:
                c.rejected = why or f"fits, but predicted slower than {chosen.spec.name} ({chosen.step_time * 1e3:.3f} ms)"

    def estimate(self, chosen: Candidate, optimizer: str | None, training: bool) -> MemoryEstimate:
        what = "planner: saved for backward per device (fake run)" if training else "planner: fake run"
        return MemoryEstimate({d: dict(k) for d, k in chosen.per_device.items()}, optimizer, training, what)

    def no_fit_error(self, devices: int) -> DpCompileError:
        """Nothing fits: the smallest predicted peak, with its arithmetic and the way out."""
        predicted = [c for c in self.candidates if c.per_device and not (c.rejected or "").startswith(UNBUILT)]
        budget = min(self.budgets.values())
        if not predicted:
            return DpCompileError(f"no layout over {devices} devices can be built for this model: "
                                  + "; ".join(f"{c.spec.name}: {c.rejected}" for c in self.candidates))  # fmt: skip
        least = min(predicted, key=lambda c: c.peak)
        device = max(least.per_device, key=lambda d: sum(least.per_device[d].values()))
        terms = " + ".join(f"{format_bytes(least.per_device[device][k])} {k}" for k in KINDS)
        given = f"memory_per_device={format_bytes(budget)}"
        if self.budget_source != "memory_per_device=":
            given = f"{format_bytes(budget)} per device ({self.budget_source}; memory_per_device= sets a budget)"
        return DpCompileError(
            f"no layout fits {given} on {devices} devices: of the "
            f"{len(self.candidates)} considered, the smallest predicted peak is {format_bytes(least.peak)} per device "
            f"({least.spec.name}: {terms}). The way out: a budget of at least {format_budget_up(least.peak)} "
            f"({least.peak} bytes), more devices, a lighter optimizer, or a smaller batch "
            "(explain(pm, x).candidates lists each layout's prediction)"
        )


def enumerate_layouts(n: int, *, batch: int | None, blocks: bool, sequence: bool = False) -> list[LayoutSpec]:
    """The layouts built in one process over ``n`` devices, fewest bytes moved first; each with
    activation checkpointing too where the model has repeated blocks; where it has a ``sequence``
    (attention found), then context parallel (``cp``, ``dp x cp``) and tensor parallel with
    sequence parallel, without checkpointing."""
    shapes: list[tuple[tuple[tuple[str, int], ...], str | None, int]] = [((("dp", n),), None, 1)]
    if n > 1:
        shapes.append(((("tp", n),), None, 1))
        for stages in [s for s in range(2, n + 1) if n % s == 0]:
            layout = (("pp", stages),) if stages == n else (("pp", stages), ("tp", n // stages))
            for m in MICRO_BATCHES:
                if m > 1 and (batch is None or m > batch):
                    continue
                shapes += [(layout, "gpipe", m)] + ([(layout, "1f1b", m)] if m > 1 else [])
    out = []
    for layout, schedule, m in shapes:
        for checkpointing in (False, True) if blocks else (False,):
            out.append(LayoutSpec(layout, schedule, m, checkpointing))
    if sequence and n > 1:
        out += [LayoutSpec((("dp", n // c), ("cp", c)) if c < n else (("cp", n),))
                for c in range(n, 1, -1) if n % c == 0]  # fmt: skip
        out.append(LayoutSpec((("tp", n),), sequence_parallel=True))
    return out


def checkpoint_ladder(profile: ModelProfile, spec: LayoutSpec) -> list[LayoutSpec]:
    """``activation_checkpointing="auto"``'s choices for ``spec``'s layout, least recomputed first:
    nothing; every repeated block keeping (the ``"auto"`` save rule) at most each byte budget at which
    it keeps something else, from the most kept down; every block keeping nothing."""
    plain = LayoutSpec(spec.layout, spec.schedule, spec.micro_batches, False)
    if not profile.blocks or not profile.training:
        return [plain]
    share = batch_share(profile.batch, spec.size("dp")) / spec.micro_batches
    row = next((u.row_bytes for u in profile.blocks if u.row_bytes), 0) * share
    saving = [LayoutSpec(spec.layout, spec.schedule, spec.micro_batches, True, level, row)
              for level in kept_levels(profile.units, share)] if row else []  # fmt: skip
    return [plain, *saving, LayoutSpec(spec.layout, spec.schedule, spec.micro_batches, True)]


#: a block's activation gradients alive in its backward, in units of its input, beyond the two the sweep
#: counts (its output's and its input's): measured 3.3-4 in all on a pre-norm transformer block; counted
#: where activation_checkpointing="auto" chooses
GRADIENT_TRANSIENT = 2


def _add_gradient_transient(candidate: Candidate, profile: ModelProfile) -> None:
    """``GRADIENT_TRANSIENT`` block inputs (the device's share) more activations on every device."""
    spec = candidate.spec
    share = batch_share(profile.batch, spec.size("dp")) / spec.micro_batches
    extra = round(GRADIENT_TRANSIENT * max((u.input_bytes for u in profile.blocks), default=0) * share)
    for kinds in candidate.per_device.values():
        kinds["activations"] += extra


def plan_layouts(
    model: nn.Module, labels: Sequence[str], budgets: Mapping[str, int], *, optimizer: str | None, training: bool,
    example_inputs: Sequence[Any] | None, example_kwargs: Mapping[str, Any] | None, device: torch.device,
    specs: Sequence[LayoutSpec] | None = None, calibration: Calibration | None = None,
    auto_checkpointing: bool = False,
) -> Planned:  # fmt: skip
    """Every layout of :func:`enumerate_layouts` (or ``specs``: the layout the user named, its
    devices ``labels`` in canonical order pp, dp, tp) predicted and judged against ``budgets``, with
    ``calibration``'s constants (default: ``device``'s); ``auto_checkpointing``: each layout with
    every choice of :func:`checkpoint_ladder` instead of with and without checkpointing."""
    profile = profile_model(model, tuple(example_inputs or ()), example_kwargs, optimizer=optimizer, training=training)
    calibration = calibration or calibrate(device)
    candidates = []
    if specs is None:
        specs = enumerate_layouts(len(labels), batch=profile.batch, blocks=bool(profile.blocks),
                                  sequence=profile.sequence is not None and calibration.ranks == 1)  # fmt: skip
    if auto_checkpointing:
        specs = [s for spec in specs if not spec.checkpointing
                 for s in ([spec] if splits_sequence(spec) else checkpoint_ladder(profile, spec))]  # fmt: skip
    coupled = batch_statistics_module(model) if training else None
    for spec in specs:
        prediction = predict_layout(profile, spec, calibration)
        candidate = Candidate(spec, budgets=dict(budgets))
        plain = LayoutSpec(spec.layout)
        if spec.sequence_parallel and no_one_sequence(profile) and plain in specs:  # the same program twice
            candidate.rejected = f"builds {plain.name}: no one sequence (the blocks' row layers disagree on dim 1)"
        elif coupled is not None and spec.schedule == "1f1b" and spec.micro_batches > 1:
            candidate.rejected = (f"cannot be built: BatchNorm '{coupled}' normalises with the whole batch's statistics, "
                                  "which 1F1B's micro-batches do not meet for (GPipe's do)")  # fmt: skip
        elif prediction.unbuildable:
            candidate.rejected = f"cannot be built: {prediction.unbuildable}"
        else:
            candidate.per_device = dict(zip(labels, prediction.per_device, strict=True))
            if auto_checkpointing and training:
                _add_gradient_transient(candidate, profile)
            candidate.step_time = prediction.step_time
            candidate.stage_starts = prediction.stage_starts
            over = [d for d, kinds in candidate.per_device.items() if sum(kinds.values()) > budgets[d]]
            candidate.fits = not over
            if over:
                d = max(over, key=lambda x: sum(candidate.per_device[x].values()))
                candidate.rejected = (f"does not fit: {format_bytes(sum(candidate.per_device[d].values()))} predicted "
                                      f"on {d} > {format_bytes(budgets[d])}")  # fmt: skip
        candidates.append(candidate)
    return Planned(candidates, calibration, dict(budgets))


def plan_mesh_layouts(
    model: nn.Module, labels: Sequence[str], budgets: Mapping[str, int] | None, *, optimizer: str | None, training: bool,
    example_inputs: Sequence[Any] | None, example_kwargs: Mapping[str, Any] | None,
    specs: Sequence[LayoutSpec] | None = None, auto_checkpointing: bool = False,
) -> Planned:  # fmt: skip
    """The layouts built over a ``DeviceMesh`` of ``len(labels)`` gloo processes on this machine (those
    of :func:`enumerate_layouts`, each with and without activation checkpointing where the model has
    repeated blocks; or ``specs``), predicted with the mesh's calibration
    (:func:`~dpcompile.analysis.calibration.calibrate_mesh`) and judged as :func:`plan_layouts` does them
    (``auto_checkpointing``: each layout with every choice of :func:`checkpoint_ladder`); ``budgets=None``:
    this host's available memory shared by the ranks (``transform`` over a mesh gathers every rank's instead)."""
    source = None
    if budgets is None:
        budgets, source = device_memory_budgets([torch.device("cpu")] * len(labels), labels)
    if specs is None:
        profile_batch = None
        for x in [*(example_inputs or ()), *(example_kwargs or {}).values()]:
            if isinstance(x, torch.Tensor) and x.dim():
                profile_batch = int(x.shape[0])
                break
        specs = enumerate_layouts(len(labels), batch=profile_batch, blocks=has_blocks(model))
    planned = plan_layouts(model, labels, budgets, optimizer=optimizer, training=training,
                           example_inputs=example_inputs, example_kwargs=example_kwargs, device=torch.device("cpu"),
                           specs=specs, calibration=calibrate_mesh(len(labels)), auto_checkpointing=auto_checkpointing)  # fmt: skip
    if source is not None:
        planned.judged_against(source)
    return planned


def chosen_words(pm: nn.Module, chosen: Candidate, budgets: Mapping[str, int], tried: int,
                 which: str = "the least recomputed") -> str:  # fmt: skip
    """``pm.strategies["activation_checkpointing"]`` where ``activation_checkpointing="auto"`` chose: what
    is recomputed, and why (the prediction against the budget)."""
    what = pm.strategies.get("activation_checkpointing", "nothing recomputed")
    return (f"{what} (activation_checkpointing='auto': predicted peak {format_bytes(chosen.peak)} per device <= "
            f"memory_per_device={format_bytes(min(budgets.values()))}, {which} of {tried} predicted; "
            "explain(pm, x).candidates)")  # fmt: skip


def batch_statistics_module(model: nn.Module) -> str | None:
    """The first BatchNorm of ``model`` that normalises with the batch's own statistics (in training, or
    without running statistics): 1F1B refuses it at its first step (its micro-batches would each be
    normalised alone), so no 1F1B layout of several micro-batches is a candidate; None where there is none."""
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or m.running_mean is None):
            return name
    return None


def default_budget_words(budgets: Mapping[str, int]) -> str:
    """``pm.strategies["memory_per_device"]`` where ``plan="auto"`` had no budget: what it planned for."""
    sizes = sorted(set(budgets.values()))
    each = format_bytes(sizes[0]) if len(sizes) == 1 else f"{format_bytes(sizes[0])}-{format_bytes(sizes[-1])}"
    return f"{each} per device ({UNGIVEN_BUDGET_WORDS}; explain(pm, x) says whose)"  # short: an export keeps strategy words


def has_blocks(model: nn.Module) -> bool:
    """Whether ``activation_checkpointing=True`` finds blocks to recompute in ``model`` (repeated, or lone)."""
    return bool(repeated_blocks(model) or lone_blocks(model))
