"""Progress bars for long saves, loads and transforms, on stderr: shown on a terminal, quiet otherwise.

``progress=None`` (the default) shows them where stderr is a terminal (over a mesh on rank 0 only),
``True`` always (every rank), ``False`` never, as transformers shows "Loading checkpoint shards".
No dependency: one line redrawn with ``\\r``, at most every ``REDRAW_S`` seconds and at the end.

A save or load draws one bar (:func:`progress_bar`). A transform draws one per stage of its work
(capture, passes, weights) from code that knows nothing of ``progress=``: :func:`reporting_steps`
opens them for the call, and each site asks :func:`step_bar` for its stage's bar, which is a
do-nothing bar outside, so a quiet transform pays one context-variable read per site::

    with reporting_steps(progress):            # transform
        bar = step_bar("Running passes", 12)   # infra.run_passes: a line, 12 more steps
        bar.update()                           # once per pass
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections.abc import Iterator
from typing import Any

from dpcompile.errors import ArgumentError

WIDTH = 30  # characters of the bar itself
REDRAW_S = 0.1


class Progress:
    """``update()`` once per step of ``total``; ``close()`` draws the last state and ends the line."""

    def __init__(self, what: str, total: int, stream: Any | None, done: int = 0):
        self.what, self.total, self.stream = what, max(0, total), stream
        self.done = min(self.total, max(0, done))
        self.started = self.drawn = time.monotonic()
        if stream is not None:
            self._draw()

    def update(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        now = time.monotonic()
        if self.stream is not None and (now - self.drawn >= REDRAW_S or self.done == self.total):
            self.drawn = now
            self._draw()

    def close(self) -> None:
        if self.stream is not None:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
            self.stream = None

    def _draw(self) -> None:
        share = self.done / self.total if self.total else 1.0
        filled = int(WIDTH * share)
        bar = "█" * filled + " " * (WIDTH - filled)
        seconds = time.monotonic() - self.started
        self.stream.write(f"\r{self.what}: {share:4.0%}|{bar}| {self.done}/{self.total} [{seconds:.1f}s]")
        self.stream.flush()


class QuietProgress:
    """A bar that draws nothing and counts nothing (a quiet transform's)."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


QUIET = QuietProgress()


class StepBars:
    """The bars of one operation's stages, each counting its steps across the operation. The stage
    that did the latest work has the line; work of another stage (weights placed inside a pass)
    ends that line and starts one of its own, which goes on from the stage's counts so far."""

    def __init__(self, stream: Any):
        self.stream, self.line = stream, None
        self.counts: dict[str, list[int]] = {}  # stage -> [done, total]

    def bar_for(self, what: str, steps: int) -> StageSteps:
        self.counts.setdefault(what, [0, 0])[1] += max(0, steps)
        self._show(what)
        return StageSteps(self, what)

    def advance(self, what: str, n: int) -> None:
        counts = self.counts[what]
        counts[0] = min(counts[1], counts[0] + n)
        self._show(what)
        self.line.update(counts[0] - self.line.done)

    def close(self) -> None:
        if self.line is not None:
            self.line.close()
            self.line = None

    def _show(self, what: str) -> None:
        done, total = self.counts[what]
        if self.line is not None and self.line.what == what:
            self.line.total = total
            return
        self.close()
        self.line = Progress(what, total, self.stream, done=done)


class StageSteps:
    """One stage's handle on :class:`StepBars`: ``update()`` once per step done."""

    def __init__(self, bars: StepBars, what: str):
        self.bars, self.what = bars, what

    def update(self, n: int = 1) -> None:
        self.bars.advance(self.what, n)


_STEP_BARS: contextvars.ContextVar[StepBars | None] = contextvars.ContextVar("dpcompile_step_bars", default=None)


@contextlib.contextmanager
def reporting_steps(progress: bool | None) -> Iterator[None]:
    """Stage bars on stderr for the work inside, where ``progress`` asks for them (as
    :func:`progress_bar`); a call inside another's (a planned transform building its choice) draws
    on the outer call's bars."""
    check_progress(progress)
    if _STEP_BARS.get() is not None or not _shown(progress):
        yield
        return
    bars = StepBars(sys.stderr)
    token = _STEP_BARS.set(bars)
    try:
        yield
    finally:
        _STEP_BARS.reset(token)
        bars.close()


def step_bar(what: str, steps: int) -> StageSteps | QuietProgress:
    """The bar of stage ``what``, ``steps`` more to do: ``update()`` once per step done."""
    bars = _STEP_BARS.get()
    return QUIET if bars is None else bars.bar_for(what, steps)


def check_progress(progress: Any) -> None:
    """Refuse a ``progress=`` that is not True, False or None."""
    if not (progress is None or isinstance(progress, bool)):
        raise ArgumentError(f"progress={progress!r}: expected True, False or None (a bar where stderr is a terminal)")


def progress_bar(what: str, total: int, progress: bool | None) -> Progress:
    """A bar on stderr where ``progress`` asks for one (None: stderr is a terminal, and this is rank 0
    of a process group, if any); else a bar that draws nothing."""
    check_progress(progress)
    return Progress(what, total, sys.stderr if _shown(progress) else None)


def _shown(progress: bool | None) -> bool:
    return progress is True or (progress is None and _is_terminal() and _first_rank())


def _is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def _first_rank() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


__all__ = ["QUIET", "Progress", "QuietProgress", "StageSteps", "StepBars", "check_progress", "progress_bar", "reporting_steps", "step_bar"]
