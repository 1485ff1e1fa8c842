"""Safetensors files as transformers lays them out: one file, or shards with an index.

* :func:`find_tensors`: where each key of a checkpoint lives (``{key: file}``), from a
  ``.safetensors`` file, a folder with ``model.safetensors``, or a folder of shards with
  ``model.safetensors.index.json``;
* :func:`write_safetensors`: one safetensors file written tensor by tensor (each tensor
  made only when its bytes are written), so a model never sits in memory whole;
* :func:`plan_files`: the file names a checkpoint of given tensor sizes is saved under.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from dpcompile.checkpoint.headers import DTYPE_OF, DTYPES, INDEX_FILE, SINGLE_FILE, CheckpointError, read_checkpoint
from dpcompile.checkpoint.runs import host_bytes, is_host_layout, rows_at_once, staging_budget
from dpcompile.errors import ArgumentError


def find_tensors(path: str | Path, *, allow_symlinks: bool = False) -> dict[str, Path]:
    """``{key: file holding it}`` for the checkpoint at ``path``, every header and the index
    checked first (:func:`~dpcompile.checkpoint.headers.read_checkpoint`).

    >>> find_tensors("ckpt/")  # doctest: +SKIP
    {'model.embed_tokens.weight': PosixPath('ckpt/model-00001-of-00002.safetensors'), ...}
    """
    return {key: e.file for key, e in read_checkpoint(path, allow_symlinks=allow_symlinks).entries.items()}


class Runs:
    """A tensor of ``shape`` and ``dtype`` given as the runs of its bytes in order (``parts()``
    yields tensors whose bytes, one after the other, are the tensor's): a sharded tensor written
    shard by shard, never put together."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, parts: Callable[[], Iterable[torch.Tensor]]):
        self.shape, self.dtype, self.parts = tuple(shape), dtype, parts


def write_safetensors(
    path: str | Path,
    entries: Sequence[tuple[str, Sequence[int], torch.dtype]],
    make: Callable[[str], torch.Tensor | Runs],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write a safetensors file holding ``entries`` (key, shape, dtype), asking ``make(key)``
    for each tensor only when its bytes are due: one tensor in memory at a time (or a
    :class:`Runs`: its parts one after the other). Returns the bytes of tensor data written.
    ``safetensors.safe_open`` reads it as any other."""
    text, _ = safetensors_header(entries, metadata)
    written = 0
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    with os.fdopen(os.open(path, flags, 0o644), "wb") as f:  # a link at `path` is refused, not followed
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for key, shape, dtype in entries:
            tensor = make(key)
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise CheckpointError(
                    f"'{key}': made {tuple(tensor.shape)} {tensor.dtype}, announced {tuple(shape)} {dtype}"
                )
            size = sum(_write_part(f, part) for part in (tensor.parts() if isinstance(tensor, Runs) else [tensor]))
            del tensor
            if size != tensor_bytes(shape, dtype):
                raise CheckpointError(f"'{key}': {size} bytes made, {list(shape)} {dtype} announced")
            written += size
        f.flush()
        os.fsync(f.fileno())
    return written


def _write_part(f, part: torch.Tensor) -> int:
    """Write ``part``'s bytes: straight from its memory on the CPU (contiguous), else a few rows
    at a time through a staging buffer of at most :func:`~dpcompile.checkpoint.runs.staging_budget`
    bytes (a shard on an accelerator, a strided view). Returns the bytes written."""
    part = part.detach()
    if is_host_layout(part, part.dtype):
        f.write(memoryview(host_bytes(part)))
        return part.numel() * part.element_size()
    if part.dim() == 0:
        part = part.reshape(1)
    step = rows_at_once(part[0].numel() * part.element_size() if part.numel() else 1, staging_budget(part))
    staging = torch.empty((min(step, part.shape[0]), *part.shape[1:]), dtype=part.dtype)
    for first in range(0, part.shape[0], step):
        out = staging[: min(step, part.shape[0] - first)]
        out.copy_(part[first : first + out.shape[0]])
        f.write(memoryview(host_bytes(out)))
    return part.numel() * part.element_size()


def safetensors_header(
    entries: Sequence[tuple[str, Sequence[int], torch.dtype]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, dict[str, int]]:
    """The header bytes of a safetensors file holding ``entries`` (padded so the data starts 8-byte
    aligned, as safetensors writes it) and each key's byte offset in the data. The same entries
    and metadata give the same bytes on every rank."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offsets: dict[str, int] = {}
    offset = 0
    for key, shape, dtype in entries:
        if dtype not in DTYPES:
            raise CheckpointError(f"'{key}' is {dtype}, which safetensors cannot hold: save with format='dcp', which holds it")
        size = tensor_bytes(shape, dtype)
        header[key] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offsets[key] = offset
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8), offsets


def allocate_safetensors(
    path: Path, entries: Sequence[tuple[str, Sequence[int], torch.dtype]], metadata: Mapping[str, str] | None
) -> None:
    """Create the safetensors file ``path`` at its full size: the header written, the data left
    for the ranks to fill in place (:func:`~dpcompile.checkpoint.rank_writes.write_blocks`)."""
    text, offsets = safetensors_header(entries, metadata)
    data = sum(tensor_bytes(s, d) for _, s, d in entries)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    with os.fdopen(os.open(path, flags, 0o644), "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.truncate(8 + len(text) + data)
        f.flush()
        os.fsync(f.fileno())


class StagedFiles:
    """Files written beside their final names (``.model.safetensors.<token>.tmp``, same folder)
    and renamed into place together by :meth:`commit`; :meth:`discard` removes what was
    written. A save that fails before ``commit`` leaves every final name as it was.

    >>> staged = StagedFiles()                               # doctest: +SKIP
    >>> write_safetensors(staged.temp(folder / "model.safetensors"), entries, make)  # doctest: +SKIP
    >>> staged.commit()                                      # doctest: +SKIP
    """

    def __init__(self, token: str | None = None) -> None:
        self.token = token or f"{os.getpid()}-{os.urandom(4).hex()}"  # over a mesh: the leading rank's
        self.pending: list[tuple[Path, Path]] = []  # (temporary, final), renamed in this order

    def temp(self, final: Path) -> Path:
        """A fresh name for ``final``'s bytes, in its folder."""
        temp = final.parent / f".{final.name}.{self.token}.tmp"
        self.pending.append((temp, final))
        return temp

    def write_text(self, final: Path, text: str) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        with os.fdopen(os.open(self.temp(final), flags, 0o644), "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def commit(self) -> None:
        """Rename every file into place (``os.replace``: a link at a final name is replaced, not
        followed). A rename that fails puts back the files renamed before it: each previous file is
        kept as a hard link (``.<name>.prev.<token>.tmp``) until every rename is done, so the final
        names are all new or all as they were (never a mix of two saves that loads), and the staged
        files are removed. Where the
        filesystem has no hard links, the renames go on without that net."""
        renamed: list[tuple[Path | None, bool, Path]] = []  # (the previous file kept, one was there, final)
        try:
            for temp, final in self.pending:
                existed = os.path.lexists(final)
                renamed.append((self._keep(final) if existed else None, existed, final))
                os.replace(temp, final)
        except BaseException:
            for kept, existed, final in reversed(renamed[:-1]):
                if kept is not None:
                    os.replace(kept, final)
                elif not existed:
                    final.unlink(missing_ok=True)
            self._drop(renamed[-1:])
            self.discard()
            raise
        self._drop(renamed)
        for folder in {final.parent for _, final in self.pending}:
            _fsync_dir(folder)
        self.pending = []

    def _keep(self, final: Path) -> Path | None:
        """A hard link to the file (or link) at ``final``, to put it back; None where none can be made."""
        kept = final.parent / f".{final.name}.prev.{self.token}.tmp"
        try:
            kept.unlink(missing_ok=True)
            os.link(final, kept, follow_symlinks=False)
        except OSError:
            return None
        return kept

    @staticmethod
    def _drop(renamed: list[tuple[Path | None, bool, Path]]) -> None:
        for kept, _, _ in renamed:
            if kept is not None:
                kept.unlink(missing_ok=True)

    def discard(self) -> None:
        for temp, _ in self.pending:
            temp.unlink(missing_ok=True)
        self.pending = []


_STAGING = re.compile(r"^\..+\.(\d+)-[0-9a-f]{8}\.tmp$")


def remove_orphaned_staging(folder: Path) -> list[Path]:
    """Remove the staging files (:meth:`StagedFiles.temp`) a save killed midway left in ``folder``:
    those whose writing process is gone. A save still running elsewhere keeps its files."""
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _STAGING.match(entry.name)
        if match and entry.is_file() and not entry.is_symlink() and not _process_alive(int(match.group(1))):
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, under another user
        return True
    return True


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def stale_weight_files(folder: Path, new: set[Path], new_index: bool) -> list[Path]:
    """What the previous save left that the new one does not replace, removed once the new files
    are in place: its index where the new checkpoint is one file (the index would shadow it), and
    its shards the new set does not overwrite (``model-0000k-of-0000n.safetensors`` only, never a
    user's file)."""
    index = folder / INDEX_FILE
    if not (index.exists() or index.is_symlink()):
        return []
    old = [] if new_index else [index]
    try:
        names = set(json.loads(index.read_text()).get("weight_map", {}).values()) if index.is_file() else set()
    except (OSError, ValueError, AttributeError, TypeError):
        names = set()
    for name in names:
        file = folder / str(name)
        if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", str(name)) and file not in new and file.is_file():
            old.append(file)
    return old


def plan_files(sizes: Iterable[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """The keys of each file, in order, a new file started where the next tensor would pass
    ``max_shard_size`` bytes (a tensor bigger than that gets a file of its own)."""
    files: list[list[str]] = [[]]
    used = 0
    for key, size in sizes:
        if files[-1] and used + size > max_shard_size:
            files.append([])
            used = 0
        files[-1].append(key)
        used += size
    return files


def weights_index(files: Mapping[Path, Sequence[str]], total_size: int) -> str:
    """The index json of a sharded checkpoint (transformers' layout): ``{key: file name}``."""
    weight_map = {k: file.name for file, keys in files.items() for k in keys}
    return json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2)


def shard_file_name(k: int, n: int) -> str:
    """``model-00001-of-00003.safetensors``, as transformers names shards."""
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def parse_size(size: int | str) -> int:
    """Bytes of ``"5GB"``, ``"500MiB"``, ``"10KB"`` or an int (transformers' spelling: GB = 10**9)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ArgumentError(f"max_shard_size={size} must be positive")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if match is None:
        raise ArgumentError(f"max_shard_size={size!r}: expected bytes (an int) or a size such as '5GB' or '500MiB'")
    number, unit = float(match.group(1)), match.group(2)
    powers = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    return int(number * powers[unit])


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """The bytes of a tensor of ``shape`` and ``dtype``, as safetensors stores it."""
    return math.prod(int(s) for s in shape) * torch.empty((), dtype=dtype).element_size()


__all__ = [
    "DTYPES", "DTYPE_OF", "INDEX_FILE", "SINGLE_FILE", "CheckpointError", "Runs", "StagedFiles", "allocate_safetensors",
    "find_tensors", "parse_size", "plan_files", "safetensors_header", "shard_file_name", "stale_weight_files", "tensor_bytes", "write_safetensors", "weights_index",
]  # fmt: skip
