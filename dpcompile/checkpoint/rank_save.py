"""A save over a mesh in which each rank writes its own slices of each tensor, nothing gathered.

The files are those a one-process save writes (the same headers, the same bytes). The ranks agree
in three status exchanges (:func:`~dpcompile.checkpoint.dtensors.check_peers`) and one exchange of
what each holds, never a collective per tensor:

1. every rank sends the boxes of each tensor it holds (:func:`~.rank_writes.piece_blocks`) and a
   fingerprint of the files it would write; the leading rank (rank 0 of the mesh) its save token.
   Each rank works out who writes what (:func:`~.rank_writes.assign_writers`);
2. the leading rank creates every staged file at its full size (the header written) and stages the
   index and ``training_state.json``; status exchange (the files exist);
3. each rank writes its boxes in place (``os.pwrite``) and syncs; status exchange (all written);
4. the leading rank renames everything into place, the JSON last.

A failure on any rank before step 4 reaches the others at the next exchange; the leading rank then
removes the staged files, and the previous checkpoint stays as it was. Every rank must see the
folder (a shared filesystem, as ``torch.distributed.checkpoint`` needs too).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpcompile.checkpoint.dtensors import check_peers
from dpcompile.checkpoint.files import (
    INDEX_FILE,
    CheckpointError,
    StagedFiles,
    allocate_safetensors,
    remove_orphaned_staging,
    safetensors_header,
    stale_weight_files,
    tensor_bytes,
    weights_index,
)
from dpcompile.checkpoint.rank_writes import Block, Box, assign_writers, piece_blocks, target_blocks, write_blocks
from dpcompile.checkpoint.training import (
    TrainingSave,
    optimizer_files,
    save_stamp,
    stage_documents,
    stale_training_files,
)
from dpcompile.errors import ArgumentError
from dpcompile.progress import progress_bar

Layout = dict[Path, list[Any]]  # {file: [(key, shape, dtype)]}


def save_by_ranks(
    pm: Any,
    path: Path,
    weights: dict[Path, list[str]],
    targets: dict[str, Any],
    training: TrainingSave | None,
    max_shard_size: int | str,
    group: Any,
    progress: bool | None = None,
) -> None:
    """Write the checkpoint at ``path`` from every rank of ``group`` (each its own slices); the
    leading rank switches it over once all have written. A collective: call it on every rank."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    leader = rank == 0
    folder = path.parent if path.suffix == ".safetensors" else path
    layout: Layout = {file: [(k, targets[k].shape, targets[k].dtype) for k in keys] for file, keys in weights.items()}
    makers: dict[tuple[str, str], Callable[[], list[Block]]] = {
        (file.name, k): (lambda t=targets[k]: target_blocks(t)) for file, keys in weights.items() for k in keys
    }
    optimizer: Layout = optimizer_files(training, folder, max_shard_size) if training is not None else {}
    for file, entries in optimizer.items():
        for key, shape, _ in entries:
            makers[(file.name, key)] = _state_blocks(training, key, shape)
    layout.update(optimizer)
    shapes = {(file.name, key): shape for file, entries in layout.items() for key, shape, _ in entries}
    held = {name: [b.box for b in make()] for name, make in makers.items()}
    fingerprint = hashlib.sha256(repr([(f.name, [(k, tuple(s), str(d)) for k, s, d in e]) for f, e in layout.items()]).encode()).hexdigest()

    check_peers(pm)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (StagedFiles().token if leader else None, fingerprint, held), group=group)
    if any(other != fingerprint for _, other, _ in everyone):
        raise CheckpointError(
            "the ranks would save different tensors (their programs differ): transform the same model on every rank"
        )
    writes = assign_writers([boxes for _, _, boxes in everyone], shapes)[rank]
    staged = StagedFiles(everyone[0][0])  # the leading rank's token: its files' names and their stamp
    stamp = save_stamp(staged.token) if training is not None else None
    temps = {file: staged.temp(file) for file in layout}
    try:
        written: set[Path] = set()
        if leader:
            folder.mkdir(parents=True, exist_ok=True)
            for file, entries in layout.items():
                allocate_safetensors(temps[file], entries, stamp)
            if len(weights) > 1:
                total = sum(tensor_bytes(s, d) for file in weights for _, s, d in layout[file])
                staged.write_text(path / INDEX_FILE, weights_index(weights, total))
            if training is not None:
                written = set(optimizer) | stage_documents(staged, folder, training, optimizer)
        check_peers(pm)  # the files exist
        bar = progress_bar("Saving checkpoint", len(writes), progress)
        try:
            for file, entries in layout.items():
                mine = [(k, s, d, writes[(file.name, k)]) for k, s, d in entries if (file.name, k) in writes]
                if mine:
                    _write_own(temps[file], entries, stamp, mine, makers, file.name, bar)
        finally:
            bar.close()
        check_peers(pm)  # every rank has written its slices
        if leader:
            switch_over(staged, path, set(weights), written)
    except BaseException:
        if leader:
            staged.discard()
        raise


def switch_over(staged: StagedFiles, path: Path, weights: set[Path], training: set[Path]) -> None:
    """Rename the staged files into place (the index, then the JSON, last) and remove what the
    previous save left that the new one does not replace, and any dead save's staging files."""
    folder = path.parent if path.suffix == ".safetensors" else path
    stale = [] if path.suffix == ".safetensors" else stale_weight_files(path, weights, len(weights) > 1)
    stale += [] if path.suffix == ".safetensors" else stale_training_files(path, training)
    folders = [p for p in [*(final for _, final in staged.pending), *stale] if p.is_dir() and not p.is_symlink()]
    if folders:  # a rename onto it, or its removal, would fail halfway through the switch
        staged.discard()
        raise ArgumentError(
            f"{folders[0]} is a folder where the checkpoint has a file ({folders[0].name}); nothing was written: "
            "remove it, or save to another folder"
        )
    staged.commit()
    for old in stale:
        old.unlink(missing_ok=True)
    remove_orphaned_staging(folder)


def _state_blocks(training: Any, key: str, shape: Any) -> Callable[[], list[Block]]:
    """This rank's blocks of an optimizer state tensor: its slices where the parameter is sharded
    over the ranks, else the whole tensor (each rank holds it)."""
    local = training.optimizer.local.get(key)
    if local is not None:
        return local
    make = training.optimizer.tensors[key][2]
    return lambda: piece_blocks(shape, None, 0, make())


def _write_own(
    temp: Path,
    entries: list[Any],
    stamp: Any,
    mine: list[tuple[str, Any, Any, list[Box]]],
    makers: dict[tuple[str, str], Callable[[], list[Block]]],
    name: str,
    bar: Any,
) -> None:
    """Write this rank's boxes of ``mine`` into the staged file ``temp`` the leading rank created."""
    header, offsets = safetensors_header(entries, stamp)
    data = 8 + len(header)
    try:
        fd = os.open(temp, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise CheckpointError(
            f"{temp} (created by rank 0 of the mesh) is not there on this rank: over a mesh every rank writes its "
            "slices into the same files, so save to a folder every rank sees (a shared filesystem)",
            file=temp,
        ) from None
    try:
        for key, shape, dtype, boxes in mine:
            wanted = set(boxes)
            blocks = [b for b in makers[(name, key)]() if b.box in wanted]
            write_blocks(fd, data + offsets[key], shape, dtype, blocks)
            bar.update()
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["save_by_ranks", "switch_over"]
