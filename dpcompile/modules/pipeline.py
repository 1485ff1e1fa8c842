"""``PipelineModule``: a model split by depth into stages, one per device, fed micro-batches.

It is a :class:`~dpcompile.modules.base.ParallelModule` sharing the model's own modules and
parameters (each stage's modules live on its device), so an optimizer over
``model.parameters()`` trains it. ``pm.stages`` lists the stages: each one's device, the
modules it holds and its program for one micro-batch (``pm.stages[i].code``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.devices import Devices
from dpcompile.fx_utils import PicklableGraph, reserve_names
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.hooks import call_with_hooks, run_writing_to_model
from dpcompile.modules.pickling import refuses_corrupt_state


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: ``index``, ``device``, the ``module_paths`` it holds, its forward
    ``flops`` (or parameter elements, see ``StagePlan.measure``), its ``param_bytes`` and its
    ``program`` for one micro-batch (inputs: what it receives; outputs: what it sends on)."""

    index: int
    device: str
    module_paths: tuple[str, ...]
    flops: int
    param_bytes: int
    program: fx.GraphModule

    @property
    def code(self) -> str:
        """The stage's program as Python."""
        return self.program.code

    def __reduce__(self) -> Any:
        """Pickled with its program as a graph and the modules it holds: fx would pickle the code
        and trace it again where loaded, which a tensor-parallel stage's runtime calls (that read
        values) refuse."""
        p = self.program
        held = {"modules": dict(p._modules), "parameters": dict(p._parameters), "buffers": dict(p._buffers)}
        fields = (self.index, self.device, self.module_paths, self.flops, self.param_bytes)
        return (restore_stage, (fields, PicklableGraph(p.graph), held, type(p).__name__))


@refuses_corrupt_state
def restore_stage(fields: tuple, graph: PicklableGraph, held: dict[str, dict], class_name: str) -> Stage:
    """The counterpart of :meth:`Stage.__reduce__`."""
    root = nn.Module()
    for kind in ("modules", "parameters", "buffers"):
        getattr(root, f"_{kind}").update(held[kind])
    return Stage(*fields, fx.GraphModule(root, graph.graph(), class_name))


class PipelineModule(ParallelModule):
    """A pipeline over ``pm.devices`` (one stage each) with ``pm.micro_batches`` micro-batches.

    >>> import torch, dpcompile
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    >>> pm = dpcompile.transform(model, ["cpu", "cpu"], pipeline=2, micro_batches=2)
    >>> [s.module_paths for s in pm.stages]
    [('0', '1'), ('2', '3')]

    With ``tensor_parallel=`` stage ``i`` runs on ``pm.stage_groups[i]`` (``devices[i*T:(i+1)*T]``), its
    layers sharded over them as ``pm.plan`` says; the program owns its shards (its sharded state:
    :mod:`dpcompile.modules.sharded_state`), so ``pm.parameters()`` are the shards and the replicated
    rest (build the optimizer over them), and ``pm.state_dict()`` has the model's keys, whole.
    """

    own_attributes = ParallelModule.own_attributes | frozenset(
        {"stages", "micro_batches", "schedule", "stage_plan", "one_f_one_b_steps", "stage_groups"}
    )
    #: a tensor-parallel pipeline's copy builds the program of a smaller batch (fewer micro-batches)
    #: from a meta copy of its private model
    pickles_private_source = property(lambda self: "param_shards" in self.__dict__)

    def set_pipeline(self, *, stages: list[Stage], micro_batches: int, schedule: str, stage_plan: Any) -> None:
        """Record the stages and key the program cache by micro-batches (a batch of ``b`` below
        ``micro_batches`` runs ``b`` micro-batches of one sample)."""
        object.__setattr__(self, "stages", list(stages))
        object.__setattr__(self, "micro_batches", micro_batches)
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "stage_plan", stage_plan)
        main = self.program_cache.main_key
        self.program_cache.reset(main._replace(devices=micro_batches), self._build_program)

    def set_stage_groups(self, groups: Sequence[Devices]) -> None:
        """Record the devices of each stage, and the device slot (``s * T + k``) of every parameter:
        stage ``s``'s shard ``k``, or its replicated rest on ``k == 0`` (``explain``'s bytes per device)."""
        object.__setattr__(self, "stage_groups", [tuple(g.strings()) for g in groups])
        slot_of: dict[int, int] = {}
        for node in self.graph.nodes:
            slot = node.meta.get("dpcompile_slot")
            if slot is None or node.op not in ("get_attr", "call_module"):
                continue
            parent, _, name = str(node.target).rpartition(".")
            target = str(node.target)
            value = self.get_submodule(target) if node.op == "call_module" else getattr(self.get_submodule(parent), name)
            for t in value.parameters() if isinstance(value, nn.Module) else [value]:
                slot_of.setdefault(id(t), slot)
        self.shard_param_slots = {name: slot_of.get(id(p), 0) for name, p in self.named_parameters()}

    def _devices_for(self, args: tuple, kwargs: dict) -> int:
        """How many micro-batches a call runs: ``micro_batches``, or the batch size if smaller."""
        n = self.__dict__.get("micro_batches", 1)
        if not self._split_inputs or n == 1:
            return n
        batch = self.batch_size(args, kwargs)
        if batch is None or self._is_unbatched(args, kwargs):
            return 1
        return min(batch, n)

    def run_program(self, program: fx.GraphModule, args: tuple, kwargs: dict) -> Any:
        """A training call of a ``"1f1b"`` pipeline runs the 1F1B step (forward and backward, see
        ``modules/pipeline_1f1b.py``); every other call runs the program (GPipe's order)."""
        if self.executor == "1f1b" and self.training and torch.is_grad_enabled():
            key = self.call_key(*args, **kwargs)
            steps = self.__dict__.setdefault("one_f_one_b_steps", {})
            if key not in steps:
                if len(steps) >= 8:  # keys that departed long ago (a changed model) are not kept forever
                    steps.pop(next(iter(steps)))
                steps[key] = self.recipe.one_f_one_b_step(self, key)
            step = steps[key]
            if self._shares_source and self._guard.root_hooks():  # the model's own forward hooks, as for GPipe
                return run_writing_to_model(
                    self, program, lambda: call_with_hooks(self.traced_model, lambda *a, **k: step(a, k), args, kwargs))
            return run_writing_to_model(self, program, lambda: step(args, kwargs))
        return super().run_program(program, args, kwargs)

    executor = property(lambda self: self.__dict__.get("schedule", "gpipe"), doc="``\"gpipe\"`` or ``\"1f1b\"``")

    @property
    def bubble_fraction(self) -> float:
        """The bubble ``(S-1)/(M+S-1)`` of GPipe and of 1F1B: the share of a step each device waits."""
        s, m = len(self.stages), self.micro_batches
        return (s - 1) / (m + s - 1)

    # ------------------------------------------------------------------ pickling
    def _extra_state_for_pickle(self) -> dict[str, Any]:
        """The stages, micro-batches, schedule and plan (names only), and a tensor-parallel pipeline's
        stage groups and parameter slots, beside the sharded state."""
        extra = {**super()._extra_state_for_pickle(), "pipeline": {
            name: self.__dict__[name] for name in ("stages", "micro_batches", "schedule", "stage_plan")}}
        if "stage_groups" in self.__dict__:
            extra["stage_groups"] = {name: self.__dict__[name] for name in ("stage_groups", "shard_param_slots")}
        return extra

    def _restore_extra_state(self, extra: dict[str, Any]) -> None:
        super()._restore_extra_state(extra)
        self.set_pipeline(**extra["pipeline"])
        for name, value in extra.get("stage_groups", {}).items():
            object.__setattr__(self, name, value)


reserve_names(PipelineModule.own_attributes)
