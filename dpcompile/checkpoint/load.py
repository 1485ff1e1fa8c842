"""``load_checkpoint``: each device reads only its slices of a safetensors checkpoint."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dpcompile.checkpoint.buffers import compute_buffers
from dpcompile.checkpoint.files import DTYPE_OF, CheckpointError, find_tensors
from dpcompile.checkpoint.targets import Piece, Target, targets_of, tie_groups, unset_buffers
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.weights import UNSET_BUFFERS, WEIGHTS_SOURCE, weights_loaded

log = logging.getLogger("dpcompile")


def load_checkpoint(pm: ParallelModule, path: str | Path, *, strict: bool = True) -> ParallelModule:
    """Fill ``pm`` from the safetensors checkpoint at ``path``; each device reads only its slices.

    ``path``: a ``.safetensors`` file, or a folder holding ``model.safetensors``, or shards
    with ``model.safetensors.index.json`` (the layout transformers writes). Keys are the
    model's own ``state_dict`` keys; a tied key (an LM head tied to the embedding) may be left
    out, as transformers leaves it out. A row, column or vocab shard is read as a slice
    (``safe_open(...).get_slice``), never the full tensor. Every key, shape and dtype is
    checked before anything is written: with ``strict=True`` a missing or unexpected key
    raises :class:`~dpcompile.checkpoint.files.CheckpointError` listing them, and ``pm`` is
    left as it was. Non-persistent buffers that were on meta (rotary ``inv_freq``) are computed
    as the model's own code computes them, or the error names them. Returns ``pm``.

    >>> with torch.device("meta"):                                         # doctest: +SKIP
    ...     model = MyModel(config)
    >>> pm = dpcompile.transform(model, ["cpu"] * 4, tensor_parallel=True)  # doctest: +SKIP
    >>> dpcompile.load_checkpoint(pm, "ckpt/")                             # doctest: +SKIP
    """
    from safetensors import safe_open

    where = find_tensors(path)
    targets = targets_of(pm)
    ties = tie_groups(targets)
    pending = list(pm.__dict__.get(UNSET_BUFFERS, []))
    buffers = unset_buffers(pm, pending)
    missing = [k for k in targets if not any(t in where for t in ties[k])]
    unexpected = [k for k in where if k not in targets and k not in buffers]
    if strict and (missing or unexpected):
        raise CheckpointError(_key_report(path, missing, unexpected, len(targets)))
    present = {k: t for k, t in targets.items() if k in where}
    by_file: dict[Path, list[str]] = {}
    for key in [*present, *(name for name in buffers if name in where)]:
        by_file.setdefault(where[key], []).append(key)
    for file, keys in by_file.items():  # headers only: every shape and dtype before any write
        with safe_open(str(file), framework="pt", device="cpu") as f:
            _check_shapes(path, {k: present[k] for k in keys if k in present}, {k: f.get_slice(k) for k in keys})
    in_checkpoint = {name for name in buffers if name in where}
    to_compute = [n for n in buffers if n not in in_checkpoint]
    computed = compute_buffers(pm.__dict__[WEIGHTS_SOURCE], to_compute) if to_compute else {}
    # everything checked: from here on, write. The file is mapped again for each piece (its
    # header parsed again: ~1 ms): the pages a read touches leave this process's resident memory
    # when the mapping closes, so reading adds one piece to the program's memory, not one file
    written: set[int] = set()
    with torch.no_grad():
        for file, keys in by_file.items():
            for key in keys:
                if key in buffers:
                    with safe_open(str(file), framework="pt", device="cpu") as f:
                        buffers[key].copy_(f.get_tensor(key))
                    continue
                for piece in present[key].pieces:
                    if id(piece.tensor) not in written:
                        with safe_open(str(file), framework="pt", device="cpu") as f:
                            value = _read_piece(f.get_slice(key), present[key], piece)
                        piece.tensor.copy_(value)
                        written.add(id(piece.tensor))
                        del value
        for name, value in computed.items():
            buffers[name].copy_(value)
    if missing:
        log.warning(
            "load_checkpoint(strict=False): %d key(s) not in %s keep their values: %s", len(missing), path, missing[:8]
        )
    weights_loaded(pm)  # strict=False: what the checkpoint lacks is the caller's to fill
    log.debug("loaded %d tensors from %s", len(written), path)
    return pm


def _read_piece(slice_: Any, target: Target, piece: Piece) -> torch.Tensor:
    """The part of the checkpoint tensor ``piece`` holds, read as slices."""
    spec = piece.spec
    if spec is None:
        return slice_[:]
    dim, size = spec.dim, spec.sizes[piece.index]
    start = spec.offsets()[piece.index]
    if spec.sections == 1:
        return slice_[_index(dim, start, size)]
    block = target.shape[dim] // spec.sections  # a fused qkv: this shard's part of each block
    parts = [
        slice_[_index(dim, s * block + start // spec.sections, size // spec.sections)] for s in range(spec.sections)
    ]
    return torch.cat(parts, dim)


def _index(dim: int, start: int, size: int) -> tuple[slice, ...]:
    return (*[slice(None)] * dim, slice(start, start + size))


def _check_shapes(path: Any, targets: Mapping[str, Target], slices: Mapping[str, Any]) -> None:
    """Raise listing every key whose shape or kind of dtype differs from the model's."""
    wrong = []
    for key, target in targets.items():
        shape = tuple(slices[key].get_shape())
        dtype = DTYPE_OF.get(slices[key].get_dtype())
        if shape != target.shape:
            wrong.append(f"'{key}': checkpoint {list(shape)}, model {list(target.shape)}")
        elif dtype is None or dtype.is_floating_point != target.dtype.is_floating_point:
            wrong.append(f"'{key}': checkpoint {slices[key].get_dtype()}, model {target.dtype}")
    if wrong:
        raise CheckpointError(
            f"{len(wrong)} tensor(s) of {path} do not fit the model (nothing was loaded): {'; '.join(wrong[:8])}"
            + (f"; and {len(wrong) - 8} more" if len(wrong) > 8 else "")
        )


def _key_report(path: Any, missing: list[str], unexpected: list[str], total: int) -> str:
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the model's {total} keys are missing: {_listed(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} key(s) the model does not have: {_listed(unexpected)}")
    return (
        f"the checkpoint {path} does not match the model (nothing was loaded): {'; '.join(parts)}. Keys are the "
        "model's own state_dict keys; pass strict=False to load the keys both have"
    )


def _listed(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:10])
    return shown + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")


__all__ = ["load_checkpoint"]
