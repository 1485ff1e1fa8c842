"""Reading parts of a checkpoint tensor: a slice of one entry (``safe_open(...).get_slice``, never
the whole tensor), and the part a program's piece holds (a row, column, vocab or fused-qkv shard)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dpcompile.checkpoint.headers import CheckpointError, Entry
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


__all__ = ["cut", "read_entry", "read_piece"]
