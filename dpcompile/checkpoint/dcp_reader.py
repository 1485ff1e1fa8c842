"""Reading a ``torch.distributed.checkpoint`` folder without trusting it.

torch's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle`` (a crafted file runs
code) and follows each item's ``relative_path`` and byte range as written (``../`` reads outside
the folder; a missing or short data file fails midway through the load, after some tensors were
written). :class:`CheckedReader` is that reader with ``.metadata`` unpickled from DCP's own
classes only (and torch's sizes, dtypes, layouts, paths), then checked as a schema before the
load plans a read:

* every tensor's size and chunks are non-negative ints, each chunk inside its tensor, the chunks'
  elements as many as the tensor's (none left unread);
* every item is stored in a plain file name of the folder (no ``/``, no ``..``, no link), a regular
  file, and its byte range lies inside that file;
* every chunk and byte item has its storage entry.

Before the load writes anything, every tensor item it will read is read and checked whole (its
records' CRC-32, ``torch.load`` of it: :mod:`dpcompile.checkpoint.dcp_items`).

``.metadata`` itself is at most :data:`METADATA_MAX_BYTES` (1 GiB: about six million chunks; checked
before it is read) and no value of its pickle may expand past a bound proportional to its size
(:func:`~dpcompile.checkpoint.pickle_bounds.check_expansion`: a few kilobytes sharing one tuple
forty levels deep would hang the unpickler hashing it). Any fault is a
:class:`~dpcompile.checkpoint.headers.CheckpointError` naming ``.metadata``.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import stat
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo

from dpcompile.checkpoint.headers import CheckpointError, file_name_text
from dpcompile.checkpoint.pickle_bounds import brief, check_expansion, expansion_limit

METADATA = ".metadata"
#: the largest ``.metadata`` read (about 160 bytes a chunk: six million chunks); raise it for a larger checkpoint
METADATA_MAX_BYTES = 1 << 30

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what a DCP ``.metadata`` holds; any other global is refused, never imported."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint's metadata does not hold")


def read_dcp_metadata(folder: Path) -> dcp_metadata.Metadata:
    """The checked ``Metadata`` of the DCP checkpoint in ``folder`` (see the module's docstring)."""
    file = folder / METADATA
    if _plain_file(file, file) > METADATA_MAX_BYTES:
        raise CheckpointError(
            f"{file} is larger than {METADATA_MAX_BYTES} bytes, more than a checkpoint's metadata holds; if it is one, "
            "raise dpcompile.checkpoint.dcp_reader.METADATA_MAX_BYTES", file=file,
        )  # fmt: skip
    try:
        with open(file, "rb") as f:
            raw = f.read(METADATA_MAX_BYTES + 1)
        if len(raw) > METADATA_MAX_BYTES:
            raise ValueError(f"it grew past {METADATA_MAX_BYTES} bytes while read")
        check_expansion(raw, expansion_limit(len(raw)))
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt pickle fails in many ways; each is named
        raise CheckpointError(
            f"{file} cannot be read as a torch.distributed.checkpoint's metadata ({type(e).__name__}: {brief(str(e))})", file=file
        ) from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not a checkpoint's Metadata", file=file)
    _check_items(file, metadata)
    _check_storage(file, folder, metadata)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    return metadata


class CheckedReader(FileSystemReader):
    """``FileSystemReader`` reading :func:`read_dcp_metadata`'s checked metadata."""

    def __init__(self, folder: Path):
        super().__init__(str(folder))
        self.folder = Path(folder)
        self.refused: CheckpointError | None = None  # an item refused before anything was written

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_dcp_metadata(self.folder)
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        from dpcompile.checkpoint.dcp_items import check_items

        try:
            check_items(self.folder, self, plan.items, planner)  # every item whole before the first is written
        except CheckpointError as e:
            self.refused = e  # torch wraps what read_data raises: the caller raises this one
            raise
        return super().read_data(plan, planner)


def _check_items(file: Path, metadata: Any) -> None:
    items = metadata.state_dict_metadata
    if not isinstance(items, dict):
        raise CheckpointError(f"{file}: its state_dict_metadata is a {type(items).__name__}, not a dict", file=file)
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    for fqn, md in items.items():
        def bad(what: str, fqn: Any = fqn) -> CheckpointError:
            return CheckpointError(f"{file}: the item {brief(fqn)} {what} (corrupt or edited)", file=file, key=brief(fqn))

        if not isinstance(fqn, str):
            raise bad("is not named by a string")
        if isinstance(md, dcp_metadata.BytesStorageMetadata):
            if dcp_metadata.MetadataIndex(fqn) not in storage:
                raise bad("has no storage entry")
            continue
        if not isinstance(md, dcp_metadata.TensorStorageMetadata):
            raise bad(f"is described by a {type(md).__name__}")
        if not _sizes(md.size) or not isinstance(getattr(md.properties, "dtype", None), torch.dtype):
            raise bad(f"has size {brief(md.size)} and properties {brief(md.properties)}: expected non-negative ints and a dtype")
        if not isinstance(md.chunks, list):
            raise bad("has no list of chunks")
        covered = sum(math.prod(getattr(c, "sizes", ())) for c in md.chunks if _sizes(getattr(c, "sizes", None)))
        if covered != math.prod(md.size):
            raise bad(f"has chunks of {covered} elements in all, its size {list(md.size)} has {math.prod(md.size)}")
        for chunk in md.chunks:
            if (
                not isinstance(chunk, dcp_metadata.ChunkStorageMetadata)
                or not _sizes(chunk.offsets) or not _sizes(chunk.sizes)
                or len(chunk.offsets) != len(md.size) or len(chunk.sizes) != len(md.size)
                or any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, md.size))
            ):  # fmt: skip
                raise bad(f"has a chunk {brief(chunk)} that is not inside its size {list(md.size)}")
            if dcp_metadata.MetadataIndex(fqn, chunk.offsets) not in storage:
                raise bad(f"has no storage entry for its chunk at {list(chunk.offsets)}")


def _check_storage(file: Path, folder: Path, metadata: Any) -> None:
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(f"{file}: its storage_data is a {type(storage).__name__}, not a dict", file=file)
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str):
            raise CheckpointError(f"{file}: the storage of {brief(index)} is described by {brief(info)}", file=file)
        name = info.relative_path
        if name in ("", ".", "..", METADATA) or "/" in name or "\\" in name or not file_name_text(name):
            raise CheckpointError(
                f"{file} stores {brief(getattr(index, 'fqn', index))} in {brief(name)}: a checkpoint's data files are plain "
                "file names in its folder", file=file,
            )  # fmt: skip
        if name not in sizes:
            sizes[name] = _plain_file(folder / name, file)
        offset, length = info.offset, info.length
        if not _natural(offset) or not _natural(length) or offset + length > sizes[name]:
            raise CheckpointError(
                f"{file} stores {brief(getattr(index, 'fqn', index))} at bytes [{brief(offset)}, +{brief(length)}) of {name}, which "
                f"holds {sizes[name]} (truncated or corrupt)", file=folder / name,
            )  # fmt: skip
        if info.transform_descriptors is not None and not (
            isinstance(info.transform_descriptors, (list, tuple)) and all(isinstance(t, str) for t in info.transform_descriptors)
        ):
            raise CheckpointError(
                f"{file}: the storage of {brief(index)} has transforms {brief(info.transform_descriptors)}", file=file
            )


def _plain_file(file: Path, blame: Path) -> int:
    """The size of ``file``: a regular file, not a link; else an error naming ``blame``."""
    try:
        mode = os.lstat(file)
    except OSError:
        raise CheckpointError(f"{blame} names {file.name}, which is not in {file.parent}", file=file) from None
    if stat.S_ISLNK(mode.st_mode):
        raise CheckpointError(f"{file} is a symbolic link: refused, as it may lead outside the checkpoint", file=file)
    if not stat.S_ISREG(mode.st_mode):
        raise CheckpointError(f"{file} is not a regular file", file=file)
    return mode.st_size


def _sizes(values: Any) -> bool:
    return isinstance(values, (torch.Size, tuple, list)) and all(_natural(v) for v in values)


def _natural(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


__all__ = ["METADATA", "METADATA_MAX_BYTES", "CheckedReader", "read_dcp_metadata"]
