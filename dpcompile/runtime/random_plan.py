"""One call's random draws for a pipeline stage over a mesh: every rank draws every site, in order.

A rank of a ``"pp"`` mesh runs only its stage, once per micro-batch. To draw the single-device
values and leave its generator where eager leaves it, it draws *every* site's whole tensor (its
own stage's and the others'), in the whole program's order, from its identically seeded generator:
no collective. The sites and their whole shapes come from a run of the whole program on fake
tensors (:class:`RecordingDraws`, once per input shape); the call then draws through that plan
(:class:`PlannedDraws`): a site of this stage draws the sites before it first, and ``finish``
draws what is left after the schedule ran. On CPU the other stages' draws cost their generation
(a mt19937 stream cannot skip ahead); their tensors are dropped at once.

    with drawing(PlannedDraws(plan, sizes, first_piece=dp_rank * len(local), own=stage_sites)) as draws:
        schedule.step(...)          # the stage program reads current_random_draws()
        draws.finish()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from dpcompile.runtime.random import RandomDraws

Draw = Callable[[tuple[int, ...]], torch.Tensor]
_CURRENT: list[RandomDraws] = []


def current_random_draws() -> RandomDraws:
    """The record of the call in progress (``drawing``); a stage program's first random site reads it."""
    if not _CURRENT:
        raise RuntimeError(
            "a pipeline stage's random sites draw through the call's plan: run the stage through its "
            "ParallelModule (pm(...)), not alone"
        )
    return _CURRENT[-1]


@contextlib.contextmanager
def drawing(record: RandomDraws) -> Iterator[RandomDraws]:
    """Make ``record`` the one :func:`current_random_draws` returns, for the ``with`` block."""
    _CURRENT.append(record)
    try:
        yield record
    finally:
        _CURRENT.pop()


class RecordingDraws(RandomDraws):
    """A run of the whole program (on fake tensors) that records each site's whole shape and how it
    is drawn, in program order: the plan of :class:`PlannedDraws`."""

    def __init__(self, batch_sizes: Sequence[int] | None = None):
        super().__init__(batch_sizes)
        self.plan: list[tuple[str, tuple[int, ...], Draw]] = []

    def whole(self, site: str, shape: tuple[int, ...], draw: Draw) -> torch.Tensor:
        if site not in self.drawn:
            self.plan.append((site, shape, draw))
        return super().whole(site, shape, draw)


class PlannedDraws(RandomDraws):
    """One call of a stage program: every site of ``plan`` drawn in order, this stage's (``own``)
    kept. ``batch_sizes``: every micro-batch of every dp rank, rank by rank; this rank's first is
    ``first_piece``, and the ``n``-th time a site is reached is this rank's ``n``-th micro-batch."""

    def __init__(self, plan: Sequence[tuple[str, tuple[int, ...], Draw]], batch_sizes: Sequence[int], *,
                 first_piece: int, own: frozenset[str]):  # fmt: skip
        super().__init__(batch_sizes)
        self.plan = list(plan)
        self.next_draw = 0
        self.first_piece = first_piece
        self.own = own
        self.reached: dict[str, int] = {}

    def rows_of(self, site: str, rows: tuple[int, int]) -> tuple[int, int]:
        count = self.reached.get(site, 0)
        self.reached[site] = count + 1
        return self.first_piece + count, rows[1]

    def replay_state(self) -> dict[str, int]:
        return dict(self.reached)

    @contextlib.contextmanager
    def replaying(self, state: dict[str, int]) -> Iterator[None]:
        """A recomputed region's sites count from where its first run counted (the same micro-batch's
        rows), and the count of the call goes on afterwards as it was."""
        now, self.reached = self.reached, dict(state)
        try:
            yield
        finally:
            self.reached = now

    def whole(self, site: str, shape: tuple[int, ...], draw: Draw) -> torch.Tensor:
        if site not in self.drawn:
            self._draw_through(site)
        if site not in self.drawn:
            raise RuntimeError(f"random site '{site}' is not in the call's plan of draws (sites {self._sites()})")
        whole = self.drawn[site]
        if tuple(whole.shape) != shape:
            raise RuntimeError(
                f"random site '{site}' draws {tuple(whole.shape)} in the whole program, this stage asks for {shape}: "
                "the global batch is the dp ranks' equal local batches (see docs/random.md)"
            )
        return whole

    def finish(self) -> None:
        """Draw the sites no stage of this rank reached (the later stages'), as eager does after them."""
        self._draw_through(None)

    def _draw_through(self, site: str | None) -> None:
        while self.next_draw < len(self.plan):
            name, shape, draw = self.plan[self.next_draw]
            self.next_draw += 1
            values = draw(shape)
            if name in self.own:
                self.drawn[name] = values
            if name == site:
                return

    def _sites(self) -> list[str]:
        return [name for name, _, _ in self.plan]


__all__ = ["PlannedDraws", "RecordingDraws", "current_random_draws", "drawing"]
