"""``PipelineModule``: a model split by depth into stages, one per device, fed micro-batches.

It is a :class:`~dpcompile.modules.base.ParallelModule` sharing the model's own modules and
parameters (each stage's modules live on its device), so an optimizer over
``model.parameters()`` trains it. ``pm.stages`` lists the stages: each one's device, the
modules it holds and its program for one micro-batch (``pm.stages[i].code``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from dpcompile.fx_utils import reserve_names
from dpcompile.modules.base import ParallelModule


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


class PipelineModule(ParallelModule):
    """A pipeline over ``pm.devices`` (one stage each) with ``pm.micro_batches`` micro-batches.

    >>> import torch, dpcompile
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    >>> pm = dpcompile.transform(model, ["cpu", "cpu"], pipeline=2, micro_batches=2)
    >>> [s.module_paths for s in pm.stages]
    [('0', '1'), ('2', '3')]
    """

    own_attributes = ParallelModule.own_attributes | frozenset({"stages", "micro_batches", "schedule", "stage_plan"})

    def set_pipeline(self, *, stages: list[Stage], micro_batches: int, schedule: str, stage_plan: Any) -> None:
        """Record the stages and key the program cache by micro-batches (a batch of ``b`` below
        ``micro_batches`` runs ``b`` micro-batches of one sample)."""
        object.__setattr__(self, "stages", list(stages))
        object.__setattr__(self, "micro_batches", micro_batches)
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "stage_plan", stage_plan)
        main = self.program_cache.main_key
        self.program_cache.reset(main._replace(devices=micro_batches), self._build_program)

    def _devices_for(self, args: tuple, kwargs: dict) -> int:
        """How many micro-batches a call runs: ``micro_batches``, or the batch size if smaller."""
        n = self.__dict__.get("micro_batches", 1)
        if not self._split_inputs or n == 1:
            return n
        batch = self.batch_size(args, kwargs)
        if batch is None or self._is_unbatched(args, kwargs):
            return 1
        return min(batch, n)

    @property
    def bubble_fraction(self) -> float:
        """The GPipe bubble ``(S-1)/(M+S-1)``: the share of a step each device waits."""
        s, m = len(self.stages), self.micro_batches
        return (s - 1) / (m + s - 1)

    def __reduce__(self):
        from dpcompile.errors import DpCompileError

        raise DpCompileError(
            "a pipeline program cannot be pickled or exported yet; save the model's state_dict "
            "(pm.state_dict() has the model's keys) and call dpcompile.transform again where it is loaded"
        )


reserve_names(PipelineModule.own_attributes)
