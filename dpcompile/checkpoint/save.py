"""``save_checkpoint``: the layout ``load_checkpoint`` reads, written tensor by tensor."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from dpcompile.checkpoint.dtensors import check_peers, ranks_of
from dpcompile.checkpoint.files import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    StagedFiles,
    parse_size,
    plan_files,
    shard_file_name,
    tensor_bytes,
    weights_index,
    write_safetensors,
)
from dpcompile.checkpoint.rank_save import save_by_ranks, switch_over
from dpcompile.checkpoint.stages import merge_stage_states
from dpcompile.checkpoint.targets import check_program, targets_of, tie_groups
from dpcompile.checkpoint.training import (
    check_training_objects,
    encode,
    prepare_training,
    save_stamp,
    take_part,
    write_training,
)
from dpcompile.errors import ArgumentError
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.executors import executor_of
from dpcompile.progress import check_progress, progress_bar

log = logging.getLogger("dpcompile")


def save_checkpoint(
    pm: ParallelModule,
    path: str | Path,
    *,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    max_shard_size: int | str = "5GB",
    format: str = "safetensors",
    progress: bool | None = None,
) -> Path:
    """Write ``pm``'s weights as full tensors under the model's keys, in transformers' layout.

    ``path`` ending in ``.safetensors`` is one file; any other ``path`` is a folder (created)
    holding ``model.safetensors``, or ``model-00001-of-0000n.safetensors`` files and
    ``model.safetensors.index.json`` where the tensors pass ``max_shard_size`` (bytes, or
    ``"5GB"``, ``"500MiB"``). A sharded tensor is written as the runs of its shards' bytes, never
    put together, so the model is never gathered. Of tied keys (an LM head tied to the
    embedding) only the first is written, as transformers does; ``load_checkpoint`` ties them
    back. Over a mesh it is a collective: call it on every rank; each rank writes its own slices
    into their place in the files (:mod:`dpcompile.checkpoint.rank_save`; every rank must see the
    folder) and rank 0 switches the checkpoint over. ``format="dcp"``: a
    ``torch.distributed.checkpoint`` folder instead (:mod:`dpcompile.checkpoint.dcp`), with the
    keys plain torch saves. Returns ``path``.

    A training checkpoint (a folder): with ``optimizer=`` its state, keyed by the model's
    parameter names, each state tensor in its parameter's whole layout
    (``optimizer.safetensors``), so that any layout and device count loads it; with
    ``lr_scheduler=`` its ``state_dict``; the RNG states; ``extra`` (a JSON-able dict, back as
    ``pm.checkpoint_extra`` after :func:`load_checkpoint`); all in ``training_state.json``
    beside the weights. The whole save is staged and switched over at the end.

    ``progress``: a bar on stderr, one step per tensor written (weights and optimizer state; over a
    mesh, per tensor this rank writes): None (default) where stderr is a terminal (rank 0 over a
    mesh), True always, False never. ``format="dcp"`` draws none.

    >>> dpcompile.save_checkpoint(pm, "ckpt/", max_shard_size="2GB")  # doctest: +SKIP
    PosixPath('ckpt')
    >>> dpcompile.save_checkpoint(pm, "ckpt/", optimizer=opt, lr_scheduler=sched, extra={"step": 100})  # doctest: +SKIP
    PosixPath('ckpt')
    """
    check_progress(progress)  # a bad progress= is refused before anything is written
    check_program(pm, "save_checkpoint")
    if format not in ("safetensors", "dcp"):
        raise ArgumentError(f"format={format!r}: expected format='safetensors' or format='dcp' (torch.distributed.checkpoint)")
    if getattr(pm, "needs_weights", False):
        raise CheckpointError(
            "this program has no weights yet (built on meta): dpcompile.load_checkpoint(pm, path) first"
        )
    check_training_objects(optimizer, lr_scheduler)
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentError(f"path={path!r}: expected a str or os.PathLike (a .safetensors file or a folder)")
    path = Path(path)
    _check_destination(path)
    if path.suffix == ".safetensors" and not (optimizer is None and lr_scheduler is None and extra is None):
        raise ArgumentError(
            f"{path}: a training checkpoint (optimizer=, lr_scheduler=, extra=) is a folder; pass a folder path"
        )
    if format == "dcp":
        from dpcompile.checkpoint import dcp

        dcp.check_dcp_target(path)
    training = prepare_training(pm, optimizer, lr_scheduler, extra)  # checked whole before a byte is written
    check_peers(pm)  # over a mesh: a rank whose arguments failed above stops the others before any exchange
    if executor_of(pm).runs_one_stage_per_rank:  # each stage's optimizer holds its own parameters: every rank plans them all
        merge_stage_states(training.optimizer if training is not None else None)
        if training is not None and training.optimizer is not None:
            training.document["optimizer"] = encode(training.optimizer.meta)
    if format == "dcp":  # each rank its own blocks (a pipeline's stage: its stage's), through torch's planner
        dcp.save_dcp(pm, path, training)
        log.debug("saved %s as a torch.distributed.checkpoint", path)
        return path
    targets = targets_of(pm)
    ties = tie_groups(targets)
    keys = [k for k in targets if ties[k][0] == k]
    sizes = [(k, tensor_bytes(targets[k].shape, targets[k].dtype)) for k in keys]
    if path.suffix == ".safetensors":
        files = {path: keys}
    else:
        groups = plan_files(sizes, parse_size(max_shard_size))
        names = [SINGLE_FILE] if len(groups) == 1 else [shard_file_name(k, len(groups)) for k in range(len(groups))]
        files = {path / name: group for name, group in zip(names, groups)}
    over, group = ranks_of(pm)
    if over:  # every rank writes its own slices into the files
        save_by_ranks(pm, path, files, targets, training, max_shard_size, group, progress)
        log.debug("saved %d tensors in %d file(s) under %s, each rank its slices", len(keys), len(files), path)
        return path
    writes = _is_writer(pm)
    optimizer_tensors = training.optimizer.tensors if training is not None and training.optimizer is not None else {}
    bar = progress_bar("Saving checkpoint", len(keys) + len(optimizer_tensors), progress if writes else False)
    for k, (shape, dtype, maker) in list(optimizer_tensors.items()):
        optimizer_tensors[k] = (shape, dtype, _counted(maker, bar))

    def make(key: str):
        bar.update()
        target = targets[key]
        if target.gathered:
            return target.runs()  # a sharded tensor: its shards' bytes in order, never put together
        return target.gather()  # this rank's shard: the others' come by all-gather, one tensor at a time

    if writes:
        (path.parent if path.suffix == ".safetensors" else path).mkdir(parents=True, exist_ok=True)
    # every file is written beside its final name and renamed into place at the end: a save that
    # fails midway leaves the previous checkpoint as it was, and loadable
    staged = StagedFiles()
    stamp = save_stamp(staged.token) if training is not None else None  # every file of a training save: its token
    try:
        for file, group_keys in files.items():
            entries = [(k, targets[k].shape, targets[k].dtype) for k in group_keys]
            if writes:
                write_safetensors(staged.temp(file), entries, make, stamp)
            else:  # the other ranks take part in the all-gathers only
                for k in group_keys:
                    if not targets[k].gathered:
                        make(k)
        if writes and len(files) > 1:
            staged.write_text(path / INDEX_FILE, weights_index(files, sum(size for _, size in sizes)))
        written: set[Path] = set()
        if training is not None and writes:
            written = write_training(staged, path, training, max_shard_size)
        elif training is not None:  # the other ranks take part in the gathers of the optimizer's state
            take_part(training)
    except BaseException:
        staged.discard()
        raise
    finally:
        bar.close()
    if writes:
        switch_over(staged, path, set(files), written)
    log.debug("saved %d tensors in %d file(s) under %s", len(keys), len(files), path)
    return path


def _check_destination(path: Path) -> None:
    """``ValueError`` where the save cannot land at ``path``: a ``.safetensors`` path that is a folder,
    a folder path that is a file, or a file on the way; nothing written yet."""
    if path.suffix == ".safetensors" and path.is_dir():
        raise ArgumentError(f"{path} is a folder: a path ending in .safetensors is written as one file; pass another path")
    if path.suffix != ".safetensors" and path.exists() and not path.is_dir():
        raise ArgumentError(
            f"{path} is a file: a checkpoint folder goes there; pass a folder path, or a path ending in .safetensors"
        )
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ArgumentError(f"{parent} is a file, so {path} cannot be created under it")
            break


def _counted(make: Any, bar: Any) -> Any:
    def counted() -> Any:
        bar.update()
        return make()

    return counted


def _is_writer(pm: ParallelModule) -> bool:
    """Rank 0 writes over a mesh; in one process the process does."""
    mesh = getattr(pm, "mesh", None)
    if mesh is None:
        return True
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


__all__ = ["save_checkpoint"]
