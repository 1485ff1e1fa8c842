"""The random draws of a pipeline stage over a mesh (``exact_random=True``): each call, the plan of
every stage's sites (recorded once per input shape on fake tensors, from the whole program) and the
record the stage program draws through (:mod:`dpcompile.runtime.random_plan`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from dpcompile.analysis.random_ops import EXACT_RUNTIME
from dpcompile.runtime.random import RandomDraws
from dpcompile.runtime.random_plan import PlannedDraws, RecordingDraws, drawing


class FakeRunDraws(RandomDraws):
    """Draws for a run on fake tensors that only works out shapes: each piece drawn as it is shaped,
    touching no plan and no generator."""

    def piece(self, site: str, like: torch.Tensor, rows: Any, cols: Any, draw: Any) -> torch.Tensor:
        return draw(tuple(like.shape))


class StageRandomPlan:
    """``program``: the whole single-device program with its random sites drawing through the call's
    record; ``own``: the sites this rank's stage draws."""

    def __init__(self, program: fx.GraphModule, own: frozenset[str]):
        self.program = program
        self.own = own
        self.sites = [n for n in program.graph.nodes if n.op == "call_function" and n.target in EXACT_RUNTIME]
        self._plans: dict[Any, list] = {}

    def record(self, inputs: tuple, batch: int | None, runs: list[tuple[int, int]], dp_group: Any) -> PlannedDraws | None:
        """This call's record: this rank's micro-batches (``runs`` of equal ones) are its pieces of the
        global batch, the dp ranks' equal local batches in rank order."""
        import torch.distributed as dist

        if not self.sites:
            return None
        dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        modes = tuple(m.training for m in self.program.modules())  # which sites draw: the modules' modes
        key = (tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in inputs), modes)
        if key not in self._plans:
            self._plans[key] = self._recorded(inputs, [batch or 0] * dp_size)
        local = [rows for micro, rows in runs for _ in range(micro)]
        return PlannedDraws(self._plans[key], local * dp_size, first_piece=dp_rank * len(local), own=self.own)

    def train(self, mode: bool) -> None:
        self.program.train(mode)

    def _recorded(self, inputs: tuple, batch_sizes: list[int]) -> list:
        """Every site's whole shape and draw, in program order: the whole program run on fake tensors
        as far as its last random site (buffers put back)."""
        recorder = RecordingDraws(batch_sizes)
        last = self.sites[-1]
        buffers = [(b, b.detach().clone()) for b in self.program.buffers()]

        class UpToLastSite(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
                result = super().run_node(n)
                if n is last:
                    raise _Reached
                return result

        try:
            with FakeTensorMode(allow_non_fake_inputs=True) as mode, drawing(recorder), torch.no_grad():
                fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs]
                UpToLastSite(self.program).run(*fakes)
        except _Reached:
            pass
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
        return recorder.plan


class _Reached(Exception):
    """The run reached the last random site: what follows is not needed."""


__all__ = ["FakeRunDraws", "StageRandomPlan"]
