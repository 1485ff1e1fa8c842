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

import torch.fx as fx
from torch import nn

from dpcompile.devices import Devices
from dpcompile.fx_utils import PicklableGraph, reserve_names
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.executors import bubble_fraction, hold_pipeline, hold_stage_groups
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

    def set_pipeline(self, *, stages: list[Stage], micro_batches: int, schedule: str, stage_plan: Any) -> None:
        """Record the stages and hold the pipeline's executor (:func:`hold_pipeline`)."""
        hold_pipeline(self, stages=stages, micro_batches=micro_batches, schedule=schedule, stage_plan=stage_plan)

    def set_stage_groups(self, groups: Sequence[Devices]) -> None:
        """Record the devices of each stage and the device slot of every parameter (:func:`hold_stage_groups`)."""
        hold_stage_groups(self, groups)

    bubble_fraction = property(bubble_fraction, doc="The bubble ``(S-1)/(M+S-1)`` of GPipe and of 1F1B")


reserve_names(PipelineModule.own_attributes)
