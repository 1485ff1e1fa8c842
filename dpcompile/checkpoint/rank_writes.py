"""Over a mesh each rank writes its own slices of each tensor into their place in the files.

* :func:`piece_blocks`: the boxes of the whole tensor that a rank's piece holds (a tensor-parallel
  shard, by sections for a fused qkv; FSDP's rows, of a shard too), each with its local view;
* :func:`assign_writers`: from every rank's boxes (one exchange for the whole save), which rank
  writes which box: of the ranks holding the same box one writes it, by turns from key to key,
  once the distinct boxes are checked to tile each tensor exactly;
* :func:`write_blocks`: a rank's boxes written in place (``os.pwrite`` of their runs,
  :mod:`~dpcompile.checkpoint.runs`) into a file the leading rank created at its full size
  (:func:`~dpcompile.checkpoint.files.allocate_safetensors`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dpcompile.checkpoint.dtensors import RowsOf, is_dtensor
from dpcompile.checkpoint.files import CheckpointError
from dpcompile.checkpoint.runs import BoxRuns, host_bytes, is_host_layout, pwrite_runs, rows_at_once, staging_budget
from dpcompile.runtime.tensor_parallel import ShardSpec


@dataclass(frozen=True)
class Box:
    """The part ``starts[d]:starts[d] + sizes[d]`` (each dim) of a whole tensor."""

    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    def numel(self) -> int:
        return math.prod(self.sizes)

    def overlaps(self, other: Box) -> bool:
        return all(a < c + m and c < a + n for a, n, c, m in zip(self.starts, self.sizes, other.starts, other.sizes))


@dataclass
class Block:
    """``box`` of the whole tensor, held by ``view`` (a view of this rank's local tensor)."""

    box: Box
    view: torch.Tensor


def piece_blocks(
    shape: Sequence[int],
    spec: ShardSpec | None,
    index: int,
    local: torch.Tensor,
    rows: tuple[int, int, int] | None = None,
) -> list[Block]:
    """The blocks of the whole tensor (``shape``) that ``local`` holds: shard ``index`` under
    ``spec`` (None: the whole tensor), one block per section of a fused qkv; ``rows``
    (``(dim, start, size)`` in the shard's coordinates): ``local`` holds only those rows of the
    shard (FSDP's rows of a tensor-parallel shard). Empty blocks are left out."""
    if is_dtensor(local):
        local = local.to_local()
    local = local.detach()
    nd = len(shape)
    if nd == 0:
        return [Block(Box((), ()), local)]
    shard_shape = list(shape)
    if spec is None:
        dim, segments = 0, [(0, shape[0], 0)]
    else:
        dim, size, start, n = spec.dim, spec.sizes[index], spec.offsets()[index], spec.sections
        shard_shape[dim] = size
        block = shape[dim] // n  # a fused qkv: section s of the shard is in block s of the whole tensor
        segments = [(s * (size // n), size // n, s * block + start // n) for s in range(n)]
    row_dim, row_start, row_size = rows if rows is not None else (0, 0, shard_shape[0])
    out = []
    for shard_start, length, full_start in segments:
        lo, hi = [0] * nd, list(shard_shape)
        lo[dim], hi[dim] = shard_start, shard_start + length
        lo[row_dim], hi[row_dim] = max(lo[row_dim], row_start), min(hi[row_dim], row_start + row_size)
        if any(h <= low for low, h in zip(lo, hi)):
            continue
        shift = [0] * nd
        shift[row_dim] = row_start
        view = local[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, shift))]
        starts = list(lo)
        starts[dim] += full_start - shard_start
        out.append(Block(Box(tuple(starts), tuple(h - a for a, h in zip(lo, hi))), view))
    return out


def target_blocks(target: Any) -> list[Block]:
    """The blocks of a checkpoint target (:class:`~dpcompile.checkpoint.targets.Target`) its pieces
    hold here: every shard in one process, this rank's piece over a mesh (a shard, FSDP's rows,
    or the whole tensor)."""
    return [block for piece in target.pieces for block in blocks_of_piece(target.shape, piece)]


def blocks_of_piece(shape: Sequence[int], piece: Any) -> list[Block]:
    """The blocks of the whole tensor (``shape``) one piece (:class:`~dpcompile.checkpoint.targets.Piece`) holds."""
    if isinstance(piece.tensor, RowsOf):
        rows = piece.tensor
        return piece_blocks(shape, piece.spec, piece.index, rows.local, (rows.dim, rows.start, rows.size))
    return piece_blocks(shape, piece.spec, piece.index, piece.tensor)


def assign_writers(
    boxes_by_rank: Sequence[Mapping[str, Sequence[Box]]], shapes: Mapping[str, Sequence[int]]
) -> list[dict[str, list[Box]]]:
    """``[{key: boxes rank r writes}]``: every distinct box of each key written by one rank of
    those holding it (by turns from key to key, so replicated tensors are spread over the ranks).
    Raises :class:`CheckpointError`, before anything is written, where a key's distinct boxes
    do not tile its shape (overlap, or leave a gap)."""
    writes: list[dict[str, list[Box]]] = [{} for _ in boxes_by_rank]
    for turn, (key, shape) in enumerate(shapes.items()):
        holders: dict[Box, list[int]] = {}
        for rank, boxes in enumerate(boxes_by_rank):
            for box in boxes.get(key, ()):
                holders.setdefault(box, []).append(rank)
        _check_tiling(key, shape, list(holders))
        for box, ranks in holders.items():
            writes[ranks[turn % len(ranks)]].setdefault(key, []).append(box)
    return writes


def _check_tiling(key: str, shape: Sequence[int], boxes: list[Box]) -> None:
    numel = math.prod(shape)
    overlap = next(((a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :] if a.overlaps(b)), None)
    covered = sum(b.numel() for b in boxes)
    if overlap is not None or covered != numel:
        what = f"{overlap[0]} and {overlap[1]} overlap" if overlap else f"they hold {covered} of its {numel} elements"
        raise CheckpointError(
            f"'{key}' {list(shape)}: the ranks' pieces do not tile the whole tensor ({what}), so the ranks cannot "
            "write it slice by slice; this is a bug of dpcompile's layout, please report it"
        )


def write_blocks(fd: int, at: int, shape: Sequence[int], dtype: torch.dtype, blocks: Sequence[Block]) -> int:
    """Write each block's bytes where they lie in the whole tensor (row-major ``shape``, its data
    at byte ``at`` of the file ``fd``): straight from the block's memory where it is laid out as
    the file (a CPU shard), else a few of its rows at a time through one staging buffer of at most
    :func:`~dpcompile.checkpoint.runs.staging_budget` bytes. Returns the bytes written."""
    written = 0
    for block in blocks:
        if block.view.dtype != dtype or tuple(block.view.shape) != block.box.sizes:
            raise CheckpointError(
                f"a block {tuple(block.view.shape)} {block.view.dtype} does not fit {block.box} of {list(shape)} {dtype}"
            )
        written += _write_block(fd, at, tuple(shape), dtype, block)  # its staging freed before the next block's
    return written


def _write_block(fd: int, at: int, shape: tuple[int, ...], dtype: torch.dtype, block: Block) -> int:
    view, box = block.view, block.box
    if not view.numel():
        return 0
    if not shape:
        view, box, shape = view.reshape(1), Box((0,), (1,)), (1,)
    runs = BoxRuns(shape, box.starts, box.sizes, dtype.itemsize)
    step = rows_at_once(runs.row_bytes, staging_budget(view))
    staging = None if is_host_layout(view, dtype) else torch.empty((min(step, box.sizes[0]), *box.sizes[1:]), dtype=dtype)
    written = 0
    for first in range(0, box.sizes[0], step):
        rows = view.narrow(0, first, min(step, box.sizes[0] - first))
        written += pwrite_runs(fd, _host(rows, staging), at, runs.runs(first, rows.shape[0]))
    return written


def _host(rows: torch.Tensor, staging: torch.Tensor | None):
    """``rows``' bytes: their own memory, or copied into ``staging`` (reused from rows to rows of a block)."""
    if staging is None:
        return host_bytes(rows)
    out = staging[: rows.shape[0]]
    out.copy_(rows)
    return host_bytes(out)


__all__ = ["Block", "Box", "assign_writers", "blocks_of_piece", "piece_blocks", "target_blocks", "write_blocks"]
