"""``load_checkpoint``: each device reads only its slices of a safetensors checkpoint."""

from __future__ import annotations

import logging
import math
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dpcompile.checkpoint.buffers import compute_buffers
from dpcompile.checkpoint.headers import CheckpointError, Entry, read_checkpoint
from dpcompile.checkpoint.keys import Conversion, place_keys
from dpcompile.checkpoint.rank_writes import blocks_of_piece, piece_blocks
from dpcompile.checkpoint.slices import cut, read_blocks, read_entry, read_piece, unfit_values, wraps
from dpcompile.checkpoint.targets import Target, check_program, targets_of, tie_groups, unset_buffers
from dpcompile.checkpoint.training import check_training_objects, read_training
from dpcompile.errors import ArgumentError
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.weights import NEEDS_WEIGHTS, UNSET_BUFFERS, WEIGHTS_SOURCE, unset_keys, weights_partly_loaded
from dpcompile.progress import check_progress, progress_bar

log = logging.getLogger("dpcompile")


def load_checkpoint(
    pm: ParallelModule,
    path: str | Path,
    *,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    strict: bool = True,
    key_mapping: Mapping[str, str] | None = None,
    allow_symlinks: bool = False,
    progress: bool | None = None,
) -> ParallelModule:
    """Fill ``pm`` from the safetensors checkpoint at ``path``; each device reads only its slices.

    ``path``: a ``.safetensors`` file, or a folder holding ``model.safetensors``, or shards
    with ``model.safetensors.index.json`` (the layout transformers writes). Keys are the
    model's own ``state_dict`` keys, or names transformers' ``from_pretrained`` maps to them
    (legacy ``LayerNorm.gamma``/``beta``, ``attention.attention.query``, per-expert weights:
    the model's conversion mapping, and ``key_mapping={regex: replacement}`` as
    ``from_pretrained`` takes it); a tied key (an LM head tied to the embedding) may be left
    out, as transformers leaves it out. A row, column or vocab shard reads only its bytes of the
    file, straight into the shard (never the full tensor, the file never mapped).

    Before anything is read, the index json and every file's header are validated, and every
    key, shape and dtype (0-dim tensors, non-persistent buffers included) is checked against
    the program: any fault raises :class:`~dpcompile.checkpoint.headers.CheckpointError` naming
    the file and the key, and ``pm`` is left as it was. ``strict=True``: a missing or unexpected
    key is such a fault. Non-persistent buffers that were on meta (rotary ``inv_freq``) are
    computed as the model's own code computes them, or the error names them. A symbolic link in
    the checkpoint is refused unless ``allow_symlinks=True`` (the Hugging Face cache's snapshot
    folders link into ``blobs/``). ``progress``: a bar on stderr, one step per tensor of the
    weights read ("Loading checkpoint"): None (default) where stderr is a terminal (rank 0 over a
    mesh), True always, False never. Returns ``pm``.

    A training checkpoint (``save_checkpoint(..., optimizer=, lr_scheduler=, extra=)``) loads
    into any layout and device count: ``optimizer`` (built on this program's parameters) gets
    the saved state of its own parameters, each piece read as its slice of the whole tensor;
    ``lr_scheduler`` its state; the RNG states are restored; ``extra`` is set as
    ``pm.checkpoint_extra``. The optimizer's kind, param groups (by model key), every state key,
    shape and dtype are checked before anything is set; a fault raises ``CheckpointError`` and
    changes nothing.

    >>> with torch.device("meta"):                                         # doctest: +SKIP
    ...     model = MyModel(config)
    >>> pm = dpcompile.transform(model, ["cpu"] * 4, tensor_parallel=True)  # doctest: +SKIP
    >>> dpcompile.load_checkpoint(pm, "ckpt/")                             # doctest: +SKIP
    """
    check_progress(progress)  # a bad progress= is refused before anything is read
    check_program(pm, "load_checkpoint")
    _check_arguments(path, strict, key_mapping)
    check_training_objects(optimizer, lr_scheduler)
    if Path(path).is_dir() and (Path(path) / ".metadata").is_file() and not (Path(path) / "model.safetensors").exists():
        from dpcompile.checkpoint import dcp  # a torch.distributed.checkpoint folder

        if key_mapping is not None:
            raise ArgumentError(f"{path} is a torch.distributed.checkpoint: key_mapping= applies to safetensors checkpoints")
        return dcp.load_dcp(pm, Path(path), optimizer, lr_scheduler, strict)
    checkpoint = read_checkpoint(path, allow_symlinks=allow_symlinks)
    training = read_training(pm, Path(path), optimizer, lr_scheduler, strict, checkpoint.files())  # checked and read; nothing set yet
    targets = targets_of(pm)
    ties = tie_groups(targets)
    buffers = unset_buffers(pm, list(pm.__dict__.get(UNSET_BUFFERS, [])))
    source = _source_model(pm)
    placement = place_keys(checkpoint.entries, [*targets, *buffers], source, key_mapping)
    converted = _converted_shapes(placement.converted.values())  # conversions run on meta: shapes only
    unexpected = list(placement.unplaced)
    for key, (conversion, _) in converted.items():
        if key in placement.direct:
            entry = conversion.sources[0][1]
            raise CheckpointError(
                f"both '{placement.direct[key].key}' and '{entry.key}' (by transformers' conversion) of {path} fill the "
                f"model's '{key}': remove one", file=entry.file, key=entry.key,
            )  # fmt: skip
    for key, (conversion, _) in list(converted.items()):
        if key not in targets and key not in buffers:
            unexpected += [e.key for _, e, _ in conversion.sources]
            del converted[key]
    placed = {*placement.direct, *converted}
    missing = [k for k in targets if not any(t in placed for t in ties[k])]
    still_unset = unset_keys(pm, missing)  # built on meta: what neither this load nor an earlier one filled
    if not placed and targets:  # strict=False too: a load that fills nothing is a mistake, not a no-op
        raise CheckpointError(
            _key_report(path, missing, sorted(set(unexpected)), len(targets), placement.renamed, source, none=True),
            file=path, key=(missing or unexpected or [None])[0],
        )  # fmt: skip
    if strict and (missing or unexpected):
        raise CheckpointError(
            _key_report(path, missing, sorted(set(unexpected)), len(targets), placement.renamed, source),
            file=path, key=(missing or unexpected)[0],
        )  # fmt: skip
    shapes = {k: (e.shape, e.torch_dtype, e) for k, e in placement.direct.items()}
    shapes.update((k, (tuple(t.shape), t.dtype, c.sources[0][1])) for k, (c, t) in converted.items())
    _check_shapes(path, {k: (tuple(t.shape), t.dtype) for k, t in targets.items()}, shapes)
    _check_shapes(path, {k: (tuple(b.shape), b.dtype) for k, b in buffers.items()}, shapes)
    _check_values(placement.direct, {k: t.dtype for k, t in targets.items()} | {k: b.dtype for k, b in buffers.items()})
    _check_ties(path, placement.direct, ties, {k: t.dtype for k, t in targets.items()})
    to_compute = [n for n in buffers if n not in placed]
    computed = compute_buffers(pm.__dict__[WEIGHTS_SOURCE], to_compute) if to_compute else {}
    # everything checked: from here on, write. Each piece's boxes are read from the file straight
    # into it (never mapped: the pages read stay the page cache's, not this process's), so reading
    # adds at most one bounded staging buffer to the program's memory
    written: set[int] = set()
    conversions = {id(c): c for c, _ in converted.values()}.values()
    bar = progress_bar("Loading checkpoint", len(placement.direct) + len(conversions), progress)
    try:
        with torch.no_grad():
            for key, entry in placement.direct.items():
                _fill(entry, targets.get(key), buffers.get(key), written)
                bar.update()
            for conversion in conversions:
                bar.update()
                values = conversion.run(lambda e: read_entry(e, None))
                for key, value in values.items():
                    if key in converted:
                        _write(key, targets.get(key), buffers.get(key), written, lambda index, v=value: cut(v, index))
                del values
            for name, value in computed.items():
                buffers[name].copy_(value)
    except Exception as e:
        pm.__dict__[NEEDS_WEIGHTS] = True  # partly written: the program must not run on it
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(
            f"reading {path} failed after its headers were checked (a file changed or cannot be read: "
            f"{type(e).__name__}: {e}); the program is partly written and waits for a load again",
            file=path,
        ) from e
    finally:
        bar.close()
    if missing and not still_unset:
        log.warning(
            "load_checkpoint(strict=False): %d key(s) not in %s keep their values: %s", len(missing), path, missing[:8]
        )
    log.debug("loaded %d tensors from %s", len(written), path)
    training.finish(pm)  # strict=False: what the checkpoint lacks is the caller's to fill
    if still_unset:  # a program built on meta has no values to keep: it waits for them (pm.needs_weights)
        weights_partly_loaded(pm, still_unset)
        log.warning(
            "load_checkpoint(strict=False): %d key(s) not in %s have no values yet (the model was built on meta); "
            "the program runs once a load fills them: %s", len(still_unset), path, still_unset[:8]
        )
    return pm


def _source_model(pm: ParallelModule) -> Any:
    """The model ``pm`` was built from (its class and config say which names transformers maps), or None."""
    exported = getattr(pm.__dict__.get("_exported_check"), "guard", None)
    for model in (pm.__dict__.get(WEIGHTS_SOURCE), pm.__dict__.get("traced_model"), getattr(exported, "model", None)):
        if model is not None:
            return model
    return None


def _fill(entry: Entry, target: Target | None, buffer: torch.Tensor | None, written: set[int]) -> None:
    """Read into every piece of ``entry``'s key its boxes of the file (:func:`read_blocks`): no
    copy of the piece beside it, at most one bounded staging buffer."""
    if target is None:
        if buffer is not None:
            read_blocks(entry, piece_blocks(tuple(buffer.shape), None, 0, buffer))
        return
    for piece in target.pieces:
        if id(piece.tensor) not in written:
            read_blocks(entry, blocks_of_piece(target.shape, piece))
            written.add(id(piece.tensor))


def _write(key: str, target: Target | None, buffer: torch.Tensor | None, written: set[int], read: Any) -> None:
    """Copy into every piece of ``key`` the part ``read(index)`` gives (``index``: a slice tuple, or
    None for the whole tensor)."""
    if target is None:
        if buffer is not None:
            buffer.copy_(read(None))
        return
    for piece in target.pieces:
        if id(piece.tensor) not in written:
            value = read_piece(read, target, piece)
            piece.tensor.copy_(value)
            written.add(id(piece.tensor))
            del value


def _converted_shapes(conversions: Any) -> dict[str, tuple[Conversion, torch.Tensor]]:
    """``{model key: (conversion, meta tensor)}``: each conversion run on meta tensors."""
    out: dict[str, tuple[Conversion, torch.Tensor]] = {}
    for conversion in conversions:
        values = conversion.run(lambda e: torch.empty(e.shape, dtype=e.torch_dtype, device="meta"))
        out.update((key, (conversion, value)) for key, value in values.items())
    return out


def _check_shapes(path: Any, model: Mapping[str, tuple[tuple[int, ...], torch.dtype]], found: Mapping[str, Any]) -> None:
    """Raise naming every key of ``model`` whose shape or kind of dtype differs in the checkpoint."""
    wrong: list[tuple[str, Entry]] = []
    for key, (shape, dtype) in model.items():
        if key not in found:
            continue
        got_shape, got_dtype, entry = found[key]
        if tuple(got_shape) != tuple(shape):
            wrong.append((f"'{key}': checkpoint {list(got_shape)}, model {list(shape)} ({entry.file.name})", entry))
        elif got_dtype.is_floating_point != dtype.is_floating_point or (got_dtype == torch.bool) != (dtype == torch.bool):
            wrong.append((f"'{key}': checkpoint {got_dtype}, model {dtype} ({entry.file.name})", entry))
    if wrong:
        raise CheckpointError(
            f"{len(wrong)} tensor(s) of {path} do not fit the model (nothing was loaded): "
            f"{'; '.join(w for w, _ in wrong[:8])}" + (f"; and {len(wrong) - 8} more" if len(wrong) > 8 else ""),
            file=wrong[0][1].file, key=wrong[0][1].key,
        )  # fmt: skip


def _check_values(entries: Mapping[str, Entry], dtypes: Mapping[str, torch.dtype]) -> None:
    """Read before anything is written where the model's dtype might not hold every value of the file's
    (:func:`~dpcompile.checkpoint.slices.unfit_values`: a BOOL's bytes, integers past the model's range)."""
    for key, entry in entries.items():
        want = dtypes.get(key)
        if want is None or not math.prod(entry.shape) or not (entry.torch_dtype == torch.bool or wraps(entry.torch_dtype, want)):
            continue
        value = torch.empty(tuple(entry.shape), dtype=entry.torch_dtype)
        read_blocks(entry, piece_blocks(tuple(entry.shape), None, 0, value))
        what = unfit_values(value, want)
        if what is not None:
            raise CheckpointError(
                f"{entry.file}: '{entry.key}' {what} (corrupt, edited, or another model's; nothing was loaded)",
                file=entry.file, key=entry.key,
            )  # fmt: skip


def _check_ties(
    path: Any, entries: Mapping[str, Entry], ties: Mapping[str, list[str]], dtypes: Mapping[str, torch.dtype]
) -> None:
    """Keys the model ties (one tensor: an LM head tied to the embedding) that the checkpoint holds
    twice hold the same values, or the load is refused: only one of them could be loaded, and which
    one the user meant is not ours to guess (``torch.save(model.state_dict())`` writes both, equal)."""
    done: set[str] = set()
    for key in entries:
        group = [k for k in ties.get(key, [key]) if k in entries]
        if key in done or len(group) < 2:
            continue
        done.update(group)
        first = entries[group[0]]
        for other in group[1:]:
            entry = entries[other]
            if not _same_values(first, entry, dtypes.get(other)):
                raise CheckpointError(
                    f"{path}: '{first.key}' ({first.file.name}) and '{entry.key}' ({entry.file.name}) fill "
                    f"'{group[0]}' and '{other}', which the model ties (one tensor), but hold different values "
                    "(nothing was loaded): remove one of them from the checkpoint (transformers saves a tied weight "
                    "once), or make them equal", file=entry.file, key=entry.key,
                )  # fmt: skip


def _same_values(a: Entry, b: Entry, dtype: torch.dtype | None) -> bool:
    """Whether two checked entries hold the same tensor: the same bytes where their dtypes agree
    (compared a few MiB at a time), else the same values once cast to the model's ``dtype``."""
    if (a.file, a.start, a.end) == (b.file, b.start, b.end):
        return True
    if a.shape != b.shape:
        return False
    if a.dtype != b.dtype:
        want = dtype or torch.float64
        return torch.equal(read_entry(a, None).to(want), read_entry(b, None).to(want))
    chunk = 4 << 20
    with open(a.file, "rb") as fa, open(b.file, "rb") as fb:
        at_a = 8 + struct.unpack("<Q", fa.read(8))[0] + a.start
        at_b = 8 + struct.unpack("<Q", fb.read(8))[0] + b.start
        for offset in range(0, a.end - a.start, chunk):
            n = min(chunk, a.end - a.start - offset)
            if os.pread(fa.fileno(), n, at_a + offset) != os.pread(fb.fileno(), n, at_b + offset):
                return False
    return True


def _key_report(
    path: Any, missing: list[str], unexpected: list[str], total: int, renamed: Mapping[str, str], model: Any,
    none: bool = False,
) -> str:
    """What the keys of the checkpoint and the model disagree on; ``none``: no key of the checkpoint is the model's."""
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the model's {total} keys are missing: {_listed(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} key(s) the model does not have: {_listed(unexpected)}")
    how = "the model's own state_dict keys"
    if renamed or unexpected:
        how += f", or names transformers' from_pretrained maps to them (for {type(model).__name__}; key_mapping= adds more)"
    prefix = _wrapper_prefix(missing, unexpected)
    hint = (
        f". Its keys carry the prefix '{prefix}' (a wrapper's: DistributedDataParallel's 'module.', torch.compile's "
        f"'_orig_mod.'): pass key_mapping={{r'^{re.escape(prefix)}': ''}} to strip it"
        if prefix else ""
    )
    if none:
        return f"no key of the checkpoint {path} is a key of the model (nothing was loaded): {'; '.join(parts)}{hint}. Keys are {how}"
    return (
        f"the checkpoint {path} does not match the model (nothing was loaded): {'; '.join(parts)}{hint}. Keys are "
        f"{how}; pass strict=False to load the keys both have"
    )


def _wrapper_prefix(missing: list[str], unexpected: list[str]) -> str | None:
    """The prefix (``module.``, ``_orig_mod.``, ...) that the checkpoint's unexpected keys add to the
    model's missing ones, where it is the same for all of them that end in a missing key."""
    missing_keys = set(missing)
    lengths = sorted({len(k) for k in missing_keys}, reverse=True)  # a suffix is as long as a missing key: no slice
    prefixes = set()  # of every position tried (a key of a million dots took minutes)
    for key in unexpected:
        at = next((len(key) - n for n in lengths if len(key) > n and key[-n - 1] == "." and key[-n:] in missing_keys),
                  None)  # the longest suffix  # fmt: skip
        if at is not None:
            prefixes.add(key[:at])
        if len(prefixes) > 1:
            return None
    return prefixes.pop() if prefixes else None


def _check_arguments(path: Any, strict: Any, key_mapping: Any) -> None:
    """``ValueError`` naming the keyword for a ``path``, ``strict`` or ``key_mapping`` of the wrong kind."""
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentError(f"path={path!r}: expected a str or os.PathLike (a .safetensors file or a checkpoint folder)")
    if not isinstance(strict, bool):
        raise ArgumentError(f"strict={strict!r}: expected True or False")
    if key_mapping is None:
        return
    if not isinstance(key_mapping, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in key_mapping.items()):
        raise ArgumentError(f"key_mapping={key_mapping!r}: expected {{regex: replacement}}, both strings, as from_pretrained takes it")
    for pattern in key_mapping:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ArgumentError(f"key_mapping= pattern {pattern!r} is not a regular expression ({e})") from None


def _listed(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:10])
    return shown + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")


__all__ = ["load_checkpoint"]
