"""Every tensor item a DCP load reads, checked whole before the first is written.

torch's ``FileSystemReader`` reads a checkpoint item by item, each ``torch.load``-ed from its byte
range and copied into the program: a damaged item found after others were copied leaves the program
half-loaded, and a flipped byte of tensor data loads silently (``torch.load`` does not check the
CRC-32 that ``torch.save`` wrote beside each record). :func:`check_items` reads each tensor item the
plan names first, as the load will:

* its zip records against their CRC-32 (records ``torch.save`` wrote without one, CRC 0, are not
  checked), in bounded chunks;
* ``torch.load(weights_only=True)`` of it on meta (no data read): a tensor, into which the request's box
  fits, whose storage its data records hold; where the destination's dtype might not hold its values
  (a bool, integers of a wider dtype), loaded for real: a bool's bytes 0 or 1, integers in range;

so that a fault raises :class:`~dpcompile.checkpoint.headers.CheckpointError` naming the data file and
the item before anything is written. It costs one more read of the bytes the load reads (and their
CRC-32), in 1 MiB chunks: a load of 48 MB takes about 2.3 times as long (``benchmarks/bench_dcp_item_check.py``);
only the values of bools and integers are read into memory, an item at a time. Items stored through
transforms (``transform_descriptors``) are left to the load.
"""

from __future__ import annotations

import io
import os
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType

from dpcompile.checkpoint.headers import CheckpointError
from dpcompile.checkpoint.pickle_bounds import brief
from dpcompile.checkpoint.slices import unfit_values, wraps

_CHUNK = 1 << 20


def check_items(folder: Path, reader: Any, items: Any, planner: Any) -> None:
    """Read and check every tensor item of ``items`` (``ReadItem``\\ s of a load plan) through
    ``reader`` (a ``FileSystemReader`` whose ``storage_data`` is set), against the tensor ``planner``
    resolves each into; raises naming the first fault."""
    done: set[Any] = set()
    for item in items:
        if item.type == LoadItemType.BYTE_IO or item.storage_index in done:
            continue
        done.add(item.storage_index)
        info = reader.storage_data[item.storage_index]
        if info.transform_descriptors:
            continue
        file = folder / info.relative_path
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            want = planner.resolve_tensor(item).dtype
            _check_item(file, item, _Window(fd, info.offset, info.length), _Window(fd, info.offset, info.length), want)
        finally:
            os.close(fd)


def _check_item(file: Path, item: Any, records: Any, whole: Any, want: torch.dtype) -> None:
    name = brief(getattr(item.storage_index, "fqn", item.storage_index))

    def bad(what: str) -> CheckpointError:
        return CheckpointError(
            f"{file.name}: the item {name} {what} (corrupt or edited); nothing was loaded: save again", file=file, key=name
        )

    data = 0  # bytes of the tensor records (archive/data/<key>)
    try:
        with zipfile.ZipFile(records) as archive:
            for info in archive.infolist():
                if info.CRC == 0:
                    info.CRC = None  # written without a CRC-32 (torch.serialization.set_crc32_options(False))
                if "/data/" in info.filename and "/.data/" not in info.filename:
                    data += info.file_size
                with archive.open(info) as record:
                    while record.read(_CHUNK):
                        pass
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError, KeyError) as e:
        raise bad(f"is not the zip torch.save writes, or a record fails its CRC-32 ({type(e).__name__}: {brief(str(e))})") from None
    try:  # on meta: the pickle and the tensor's layout, no data read (its records were read above)
        tensor = torch.load(whole, map_location="meta", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load fails on a damaged item in many ways; each is named
        raise bad(f"cannot be loaded ({type(e).__name__}: {brief(str(e))})") from None
    offsets, lengths = list(item.storage_offsets), list(item.lengths)
    if (
        not isinstance(tensor, torch.Tensor)
        or tensor.dim() != len(lengths)
        or any(o + n > s for o, n, s in zip(offsets, lengths, tensor.shape))
    ):  # fmt: skip
        what = f"a {type(tensor).__name__}" if not isinstance(tensor, torch.Tensor) else f"a tensor of shape {list(tensor.shape)}"
        raise bad(f"holds {what}, not one holding the box at {offsets} of {lengths}")
    if data < tensor.untyped_storage().nbytes():
        raise bad(f"holds {data} bytes of tensor data, its tensor's storage {tensor.untyped_storage().nbytes()}")
    if tensor.dtype == torch.bool or wraps(tensor.dtype, want):  # the values matter: read them (rare, small)
        whole.seek(0)
        value = torch.load(whole, map_location="cpu", weights_only=True)
        unfit = unfit_values(value[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))], want)
        if unfit is not None:
            raise bad(unfit)


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of the open file ``fd`` as a seekable file (``os.pread``)."""

    def __init__(self, fd: int, offset: int, length: int):
        super().__init__()
        self.fd, self.start, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        new = {0: 0, 1: self.pos, 2: self.length}[whence] + pos
        if new < 0:
            raise ValueError(f"seek to {new}, before the item's first byte")
        self.pos = new
        return new

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos) if n else b""
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


__all__ = ["check_items"]
