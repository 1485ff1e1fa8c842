"""Bounded copies between a program's tensors and a checkpoint file's bytes.

A box of a whole tensor (a shard, a section of a fused qkv, FSDP's rows) lies in the file as runs
of contiguous bytes (:class:`BoxRuns`). A save writes them, a load reads them, a block of the box's
rows at a time: straight from or into the program's tensor where its bytes are already laid out so
(on the CPU, contiguous, the file's dtype), else through one staging buffer of at most
:func:`staging_budget` bytes: never more than ``STAGING_BYTES``, nor more than the block itself
(part of one device's piece) except for a single row. So a save or a load adds at most one piece
to the program's memory, whatever the tensor.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

STAGING_BYTES = 2 * 2**20  # the most bytes a save or a load copies at once (the block's own size where smaller)


def staging_budget(view: torch.Tensor) -> int:
    """The bytes a copy of ``view`` may stage at once: ``STAGING_BYTES``, or ``view``'s own bytes where fewer."""
    return max(1, min(STAGING_BYTES, view.numel() * view.element_size()))


def rows_at_once(row_bytes: int, budget: int) -> int:
    """How many rows of ``row_bytes`` a copy takes at once: as many as ``budget`` holds, one at least."""
    return max(1, budget // max(1, row_bytes))


def is_host_layout(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """``t``'s memory holds its bytes as the file does: read or written without a copy."""
    return t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()


def host_bytes(t: torch.Tensor):
    """A flat uint8 numpy view of ``t`` (on the CPU, contiguous): no copy."""
    return t.reshape(-1).view(torch.uint8).numpy()


@dataclass(frozen=True)
class BoxRuns:
    """Where the box ``starts``/``sizes`` of a row-major tensor of ``shape`` lies in its bytes.

    The dims after ``inner`` are whole in the box, so each run (one index of the dims before
    ``inner``, the box's part of dim ``inner``) is ``run`` contiguous bytes; where ``inner`` is 0 a
    block of the box's rows is a single run."""

    shape: tuple[int, ...]
    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    item: int

    @property
    def strides(self) -> list[int]:
        out = [1] * len(self.shape)
        for d in range(len(self.shape) - 2, -1, -1):
            out[d] = out[d + 1] * self.shape[d + 1]
        return out

    @property
    def inner(self) -> int:
        inner = len(self.shape) - 1
        while inner > 0 and self.sizes[inner] == self.shape[inner]:
            inner -= 1
        return inner

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (dim 0) of the box."""
        return self.item * math.prod(self.sizes[1:])

    @property
    def run(self) -> int:
        """Bytes of each run (where ``inner`` is 0: of each row of the box, a block of rows one run)."""
        if not self.shape:
            return self.item
        inner = self.inner
        return (self.sizes[inner] if inner else 1) * self.strides[inner] * self.item

    def runs(self, first: int, rows: int) -> list[tuple[int, int]]:
        """``[(byte offset in the tensor's data, bytes)]`` of the box's rows ``first:first + rows``,
        in the box's row-major order."""
        if not self.shape:
            return [(0, self.item)]
        strides, inner = self.strides, self.inner
        base = sum(s * st for s, st in zip(self.starts, strides)) + first * strides[0]
        if inner == 0:
            return [(base * self.item, rows * self.run)]
        within = [0]  # each run's offset within one row of dim 0 (elements)
        for d in range(1, inner):
            within = [w + i * strides[d] for w in within for i in range(self.sizes[d])]
        return [((base + r * strides[0] + w) * self.item, self.run) for r in range(rows) for w in within]


def pwrite_runs(fd: int, data, at: int, runs: Sequence[tuple[int, int]]) -> int:
    """Write ``data`` (a flat uint8 array) as ``runs`` after byte ``at`` of ``fd``, in order; the bytes written."""
    view, done = memoryview(data), 0
    for offset, size in runs:
        part = view[done : done + size]
        where = at + offset
        while part.nbytes:
            n = os.pwrite(fd, part, where)
            part, where = part[n:], where + n
        done += size
    return done


def pread_runs(fd: int, data, at: int, runs: Sequence[tuple[int, int]]) -> bool:
    """Fill ``data`` (a flat writable uint8 array) from ``runs`` after byte ``at`` of ``fd``, in
    order; False where the file ends before them."""
    view, done = memoryview(data), 0
    for offset, size in runs:
        part = view[done : done + size]
        where = at + offset
        while part.nbytes:
            n = os.preadv(fd, [part], where)
            if n <= 0:
                return False
            part, where = part[n:], where + n
        done += size
    return True


__all__ = [
    "STAGING_BYTES", "BoxRuns", "host_bytes", "is_host_layout", "pread_runs", "pwrite_runs", "rows_at_once", "staging_budget",
]  # fmt: skip
