"""The stages of a pipeline in one process: a model split by depth, one stage per device, fed micro-batches.

A pipeline is a :class:`~dpcompile.modules.base.ParallelModule` run by a
:class:`~dpcompile.modules.executors.PipelineExecutor` (``pm.executor``: ``"gpipe"`` or ``"1f1b"``,
held by :func:`~dpcompile.modules.executors.hold_pipeline`), sharing the model's own modules and
parameters (each stage's modules live on its device), so an optimizer over ``model.parameters()``
trains it; with ``tensor_parallel=`` it owns its shards (its sharded state). ``pm.stages`` lists the
:class:`Stage` s: each one's device, the modules it holds and its program for one micro-batch
(``pm.stages[i].code``); ``pm.micro_batches``, ``pm.schedule``, ``pm.stage_plan``, ``pm.bubble_fraction``;
``pm.stage_groups`` each stage's devices where stages are sharded.

>>> import torch, dpcompile
>>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
>>> pm = dpcompile.transform(model, ["cpu", "cpu"], pipeline=2, micro_batches=2)
>>> [s.module_paths for s in pm.stages]
[('0', '1'), ('2', '3')]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import nn

from dpcompile.fx_utils import PicklableGraph
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


__all__ = ["Stage", "restore_stage"]
