"""Reading parts of a checkpoint tensor: the boxes a program's piece holds (a row, column, vocab or
fused-qkv shard, FSDP's rows) read from the file into the piece (:func:`read_blocks`), and a slice
of one entry as a new tensor (``safe_open(...).get_slice``, never the whole tensor) where a
conversion needs the values."""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from dpcompile.checkpoint.headers import CheckpointError, Entry
from dpcompile.checkpoint.rank_writes import Block, Box
from dpcompile.checkpoint.runs import (
    STAGING_BYTES,
    BoxRuns,
    host_bytes,
    is_host_layout,
    pread_runs,
    rows_at_once,
    staging_budget,
)
from dpcompile.checkpoint.targets import Piece, Target


@contextlib.contextmanager
def _reading(entry: Entry) -> Iterator[Any]:
    """``safe_open`` of ``entry``'s file; any failure a CheckpointError naming the file and key."""
    from safetensors import safe_open

    try:
        with safe_open(str(entry.file), framework="pt", device="cpu") as f:
            yield f
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors' own errors name neither file nor key
        raise CheckpointError(f"{entry.file}: '{entry.key}' cannot be read ({type(e).__name__}: {e})",
                              file=entry.file, key=entry.key) from None  # fmt: skip


def read_entry(entry: Entry, index: tuple[slice, ...] | None) -> torch.Tensor:
    """The tensor of ``entry``, or its part ``index`` read as a slice (never the whole tensor)."""
    with _reading(entry) as f:
        return f.get_slice(entry.key)[... if index is None else index]  # `...`: every rank, 0-dim too


def read_blocks(entry: Entry, blocks: Sequence[Block]) -> None:
    """Fill each block's view with its box of ``entry``'s tensor, read from the file (``preadv``),
    never mapped: straight into the view where its memory is laid out as the file's bytes (a CPU
    shard of the file's dtype), else a few rows at a time through one staging buffer of at most
    :func:`~dpcompile.checkpoint.runs.staging_budget` bytes of the view (cast as ``copy_`` casts).
    Only the bytes the blocks hold are read: one read per run (a row of a column shard)."""
    try:
        fd = os.open(entry.file, os.O_RDONLY)
        try:
            (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            at = 8 + length + entry.start
            for block in blocks:
                _read_block(fd, at, entry, block)
        finally:
            os.close(fd)
    except OSError as e:
        raise CheckpointError(f"{entry.file}: '{entry.key}' cannot be read ({type(e).__name__}: {e})",
                              file=entry.file, key=entry.key) from None  # fmt: skip


def _read_block(fd: int, at: int, entry: Entry, block: Block) -> None:
    view, box, dtype = block.view, block.box, entry.torch_dtype
    if not view.numel():
        return
    if not box.sizes:
        view, box = view.reshape(1), Box((0,), (1,))
    shape = tuple(entry.shape) or (1,)
    runs = BoxRuns(shape, box.starts, box.sizes, dtype.itemsize)
    direct = is_host_layout(view, dtype)
    step = rows_at_once(runs.row_bytes, STAGING_BYTES if direct else staging_budget(view))
    staging = None if direct else torch.empty((min(step, box.sizes[0]), *box.sizes[1:]), dtype=dtype)
    for first in range(0, box.sizes[0], step):
        rows = view.narrow(0, first, min(step, box.sizes[0] - first))
        out = rows if staging is None else staging[: rows.shape[0]]
        _pread(fd, out, at, runs.runs(first, rows.shape[0]), entry)
        if staging is not None:
            rows.copy_(out)


def _pread(fd: int, out: torch.Tensor, at: int, runs: list[tuple[int, int]], entry: Entry) -> None:
    if not pread_runs(fd, host_bytes(out), at, runs):
        raise CheckpointError(f"{entry.file} ends before the bytes of '{entry.key}' (it changed after its header "
                              "was checked)", file=entry.file, key=entry.key)  # fmt: skip


def unfit_values(value: torch.Tensor, dtype: torch.dtype) -> str | None:
    """What of ``value`` (read from a checkpoint) ``dtype`` would not hold as it is, or None: a bool's
    byte other than 0 or 1 (torch takes a 2 for a bool no op agrees on: it prints True, yet ``.all()``
    is False), or an integer outside ``dtype``'s range (``copy_`` wraps it: 300 into int8 is 44)."""
    if value.dtype == torch.bool:
        bad = int((value.view(torch.uint8) > 1).sum())
        return f"is BOOL but {bad} of its bytes are neither 0 nor 1" if bad else None
    if not wraps(value.dtype, dtype):
        return None
    info = torch.iinfo(dtype)
    wide = value.to(torch.int64)  # a uint64 past int64's range turns negative: outside too
    bad = int(((wide < info.min) | (wide > info.max)).sum())
    return f"is {value.dtype} with {bad} value(s) outside the model's {dtype} [{info.min}, {info.max}]" if bad else None


def wraps(saved: torch.dtype, model: torch.dtype) -> bool:
    """Whether copying integers of ``saved`` into ``model`` can wrap some of them."""
    if saved.is_floating_point or model.is_floating_point or torch.bool in (saved, model) or saved == model:
        return False
    if saved.is_complex or model.is_complex:
        return False
    a, b = torch.iinfo(saved), torch.iinfo(model)
    return a.min < b.min or a.max > b.max


def cut(value: torch.Tensor, index: tuple[slice, ...] | None) -> torch.Tensor:
    return value if index is None else value[index]


def read_piece(read: Any, target: Target, piece: Piece) -> torch.Tensor:
    """The part of the checkpoint tensor ``piece`` holds, read as slices."""
    spec = piece.spec
    if spec is None:
        return read(None)
    dim, size = spec.dim, spec.sizes[piece.index]
    start = spec.offsets()[piece.index]
    if spec.sections == 1:
        return read(_index(dim, start, size))
    block = target.shape[dim] // spec.sections  # a fused qkv: this shard's part of each block
    parts = [read(_index(dim, s * block + start // spec.sections, size // spec.sections)) for s in range(spec.sections)]
    return torch.cat(parts, dim)


def _index(dim: int, start: int, size: int) -> tuple[slice, ...]:
    return (*[slice(None)] * dim, slice(start, start + size))


__all__ = ["cut", "read_blocks", "read_entry", "read_piece", "unfit_values", "wraps"]
