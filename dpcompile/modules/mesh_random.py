"""The random draws of a pipeline stage over a mesh (``exact_random=True``): each call, the plan of
every stage's sites (recorded once per input shape on fake tensors, from the whole program) and the
record the stage program draws through (:mod:`dpcompile.runtime.random_plan`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from dpcompile.analysis.random_ops import EXACT_RUNTIME
from dpcompile.fake import fake_copy
from dpcompile.runtime.random import RandomDraws
from dpcompile.runtime.random_plan import PlannedDraws, RecordingDraws, drawing


class FakeRunDraws(RandomDraws):
    """Draws for a run on fake tensors that only works out shapes: each piece drawn as it is shaped,
    touching no plan and no generator."""

    def piece(self, site: str, like: torch.Tensor, rows: Any, cols: Any, draw: Any) -> torch.Tensor:
        return draw(tuple(like.shape))


class StageRandomPlan:
    """``program``: the whole single-device program with its random sites drawing through the call's
    record (it shares the stages' modules); ``own``: the sites this rank's stage draws.

    The plan is recorded on a fake copy of ``program`` (no memory): FSDP, applied to the stage after
    this plan is made, turns the shared modules' parameters into DTensor shards and hooks their
    forward with collectives, neither of which a run that only works out shapes may touch. Which
    sites draw follows the shared modules' modes (``train``/``eval``, per module), copied to the fake
    copy before each recording."""

    def __init__(self, program: fx.GraphModule, own: frozenset[str], device: torch.device):
        self.modes_of = program
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.program = fake_copy(program, self.fake_mode, device)
        self.own = own
        self.sites = [n for n in self.program.graph.nodes if n.op == "call_function" and n.target in EXACT_RUNTIME]
        self._plans: dict[Any, list] = {}

    def record(self, inputs: tuple, batch: int | None, runs: list[tuple[int, int]], dp_group: Any) -> PlannedDraws | None:
        """This call's record: this rank's micro-batches (``runs`` of equal ones) are its pieces of the
        global batch, the dp ranks' equal local batches in rank order."""
        import torch.distributed as dist

        if not self.sites:
            return None
        dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        modes = {name: m.training for name, m in self.modes_of.named_modules()}  # which sites draw
        key = (tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in inputs),
               tuple(modes.values()))  # fmt: skip
        if key not in self._plans:
            for name, m in self.program.named_modules():
                m.training = modes.get(name, m.training)
            self._plans[key] = self._recorded(inputs, [batch or 0] * dp_size)
        local = [rows for micro, rows in runs for _ in range(micro)]
        return PlannedDraws(self._plans[key], local * dp_size, first_piece=dp_rank * len(local), own=self.own)

    def train(self, mode: bool) -> None:
        self.modes_of.train(mode)  # the other stages' modules too, which no stage program holds

    def _recorded(self, inputs: tuple, batch_sizes: list[int]) -> list:
        """Every site's whole shape and draw, in program order: the fake copy run as far as its last
        random site (what it writes into its fake buffers touches nothing real)."""
        recorder = RecordingDraws(batch_sizes)
        last = self.sites[-1]

        class UpToLastSite(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
                result = super().run_node(n)
                if n is last:
                    raise _Reached
                return result

        try:
            with self.fake_mode as mode, drawing(recorder), torch.no_grad():
                fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs]
                UpToLastSite(self.program).run(*fakes)
        except _Reached:
            pass
        return recorder.plan


class _Reached(Exception):
    """The run reached the last random site: what follows is not needed."""


__all__ = ["FakeRunDraws", "StageRandomPlan"]
