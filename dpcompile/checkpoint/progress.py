"""A progress bar for long saves and loads, on stderr: shown on a terminal, quiet otherwise.

``progress=None`` (the default) shows it where stderr is a terminal (over a mesh on rank 0 only),
``True`` always (every rank), ``False`` never, as transformers shows "Loading checkpoint shards".
No dependency: one line redrawn with ``\\r``, at most every ``REDRAW_S`` seconds and at the end.
"""

from __future__ import annotations

import sys
import time
from typing import Any

WIDTH = 30  # characters of the bar itself
REDRAW_S = 0.1


class Progress:
    """``update()`` once per step of ``total``; ``close()`` draws the last state and ends the line."""

    def __init__(self, what: str, total: int, stream: Any | None):
        self.what, self.total, self.done, self.stream = what, max(0, total), 0, stream
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


def check_progress(progress: Any) -> None:
    """Refuse a ``progress=`` that is not True, False or None."""
    if not (progress is None or isinstance(progress, bool)):
        raise ValueError(f"progress={progress!r}: expected True, False or None (a bar where stderr is a terminal)")


def progress_bar(what: str, total: int, progress: bool | None) -> Progress:
    """A bar on stderr where ``progress`` asks for one (None: stderr is a terminal, and this is rank 0
    of a process group, if any); else a bar that draws nothing."""
    check_progress(progress)
    shown = progress is True or (progress is None and _is_terminal() and _first_rank())
    return Progress(what, total, sys.stderr if shown else None)


def _is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def _first_rank() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


__all__ = ["Progress", "check_progress", "progress_bar"]
