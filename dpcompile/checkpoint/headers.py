"""One validation pass over a checkpoint before anything is read: the index json and every file's header.

:func:`read_checkpoint` returns a :class:`Checkpoint` (``{key: Entry}``: the file, dtype,
shape and byte range of each tensor) or raises :class:`CheckpointError` naming the file and,
where one is to blame, the key. What it checks is a schema, not a list of known faults:

* the index json: at most ``MAX_JSON_BYTES``, nesting at most ``MAX_NESTING`` deep, an object
  whose ``weight_map`` is an object of string keys mapping to file-name strings; each name
  relative, without ``..``, inside the folder, a regular file, no symlink on the way (unless
  ``allow_symlinks=True``: the Hugging Face cache links its snapshot files into ``blobs/``);
* each safetensors header, as the format defines it: an 8-byte little-endian length that fits
  the file, a JSON object (no duplicate keys, bounded nesting) of ``{key: {"dtype", "shape",
  "data_offsets"}}`` plus an optional ``__metadata__`` of strings; a known dtype; a shape of
  non-negative ints (``[]`` for a 0-dim tensor); offsets whose length is the shape's bytes,
  laid end to end from 0 to exactly the end of the file;
* the shard set: every key of the index is in the header of the file it names, and no key is
  held by two files.

After it, safetensors reads only what was checked.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dpcompile.errors import DpCompileError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
MAX_JSON_BYTES = 100_000_000
MAX_NESTING = 64
#: at most one list or object per this many bytes of a safetensors header or an index json (each
#: ~64 bytes parsed: a 100 MB header of ``[],[],...`` took 2.7 GB); the densest dpcompile writes or
#: transformers' headers hold is one per 17 bytes (an entry of a 1-letter key, ``[]`` shape)
BYTES_PER_CONTAINER = 8
#: an error's message keeps this many characters at each end (a key read from a file can be megabytes)
MESSAGE_END = 2000

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
DTYPE_OF: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPES.items()}
ITEM_SIZE: dict[str, int] = {name: torch.empty((), dtype=dtype).element_size() for dtype, name in DTYPES.items()}


class CheckpointError(DpCompileError):
    """A checkpoint that cannot be read, or does not fit the program. ``file`` and ``key`` name
    what is to blame (None where nothing single is)."""

    def __init__(self, message: str, *, file: str | Path | None = None, key: str | None = None):
        if len(message) > 2 * MESSAGE_END:  # a key from the file may be megabytes: its head and the advice kept
            cut = len(message) - 2 * MESSAGE_END
            message = f"{message[:MESSAGE_END]} [... {cut} characters cut ...] {message[-MESSAGE_END:]}"
        super().__init__(message)
        self.file = None if file is None else Path(file)
        self.key = key


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint, as its file's header describes it."""

    key: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offsets in the file's data section
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPE_OF[self.dtype]


@dataclass
class Checkpoint:
    """``path`` as given, and ``entries``: ``{key: Entry}`` for every tensor it holds, checked."""

    path: Path
    entries: dict[str, Entry]

    def files(self) -> list[Path]:
        return sorted({e.file for e in self.entries.values()})


def read_checkpoint(path: str | Path, *, allow_symlinks: bool = False, stem: str = "model") -> Checkpoint:
    """Validate the checkpoint at ``path`` (a ``.safetensors`` file, or a folder holding
    ``model.safetensors`` or shards with ``model.safetensors.index.json``); nothing is read
    from a tensor's data. ``stem="optimizer"``: the folder's ``optimizer.safetensors`` (or its
    index) instead, where ``save_checkpoint(..., optimizer=)`` writes the optimizer's state.

    >>> read_checkpoint("ckpt/").entries["fc.weight"]  # doctest: +SKIP
    Entry(key='fc.weight', file=PosixPath('ckpt/model.safetensors'), dtype='F32', shape=(8, 4), ...)
    """
    path = Path(path)
    single_name, index_name = f"{stem}.safetensors", f"{stem}.safetensors.index.json"
    if not path.exists():
        raise CheckpointError(
            f"no checkpoint at {path}: expected a .safetensors file or a folder holding {single_name}", file=path
        )
    if not path.is_dir():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path} is not a .safetensors file; pass a .safetensors file or a checkpoint folder", file=path)
        _regular_file(path, path.parent, allow_symlinks, path)
        return Checkpoint(path, read_header(path))
    index = path / index_name
    if index.exists() or index.is_symlink():
        _regular_file(index, path, allow_symlinks, index)
        weight_map = read_index(index)
        files = {name: _inside(path, name, index, allow_symlinks) for name in sorted(set(weight_map.values()))}
        headers = {name: read_header(file) for name, file in files.items()}
        return Checkpoint(path, _shard_set(index, weight_map, headers))
    single = path / single_name
    if single.exists() or single.is_symlink():
        _regular_file(single, path, allow_symlinks, single)
        return Checkpoint(path, read_header(single))
    found = sorted(p.name for p in path.glob("*.safetensors"))
    if not found and any(path.glob("*.distcp")):
        raise CheckpointError(
            f"{path} holds torch.distributed.checkpoint data files (*.distcp) but no regular file .metadata: "
            "the save did not finish, or .metadata was removed; load another checkpoint", file=path,
        )  # fmt: skip
    raise CheckpointError(
        f"{path} holds neither {single_name} nor {index_name}"
        + (f" (it has {', '.join(found[:4])}: write the index json that maps keys to them)" if found else ""),
        file=path,
    )


def read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of an index json, checked: ``{key: file name}``, both strings."""
    size = index.stat().st_size
    if size > MAX_JSON_BYTES:
        raise CheckpointError(f"{index} is {size} bytes, more than an index json can be ({MAX_JSON_BYTES})", file=index)
    try:
        text = index.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index} cannot be read as UTF-8 text: {e}", file=index) from None
    data = parse_json(text, index, "the index json", sparse=True)
    if not isinstance(data, dict):
        raise CheckpointError(f"{index} holds a JSON {type(data).__name__}, not an object with a 'weight_map'", file=index)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{index} has no 'weight_map' object (the layout transformers writes: {{\"weight_map\": {{key: file}}}})",
            file=index,
        )
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"{index} maps '{key}' to {name!r}, not a file name", file=index, key=key)
    return weight_map


def read_header(file: Path) -> dict[str, Entry]:
    """``{key: Entry}`` from the header of the safetensors ``file``, checked against the format."""
    return _read_header(file)[0]


def read_metadata(file: Path) -> dict[str, str]:
    """The ``__metadata__`` of the safetensors ``file``'s header (checked as :func:`read_header`
    checks it), the file not mapped."""
    return _read_header(file)[1]


def _read_header(file: Path) -> tuple[dict[str, Entry], dict[str, str]]:
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file} is {size} bytes: too short for a safetensors header (truncated?)", file=file)
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{file}: the header claims {n} bytes, but the file has {size - 8} after the length (truncated or corrupt)",
                    file=file,
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{file} cannot be read: {e}", file=file) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{file}: the safetensors header is not UTF-8 text (corrupt)", file=file) from None
    if not text.startswith("{"):
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object (corrupt)", file=file)
    header = parse_json(text, file, "the safetensors header", sparse=True)
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object (corrupt)", file=file)
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{file}: '__metadata__' must map strings to strings", file=file)
    entries = {key: _entry(file, key, info) for key, info in header.items()}
    data = size - 8 - n
    at = 0
    for e in sorted(entries.values(), key=lambda e: (e.start, e.end)):
        if e.start != at:
            raise CheckpointError(
                f"{file}: '{e.key}' starts at byte {e.start} of the data, expected {at} (tensors overlap or leave a gap)",
                file=file, key=e.key,
            )  # fmt: skip
        at = e.end
    if at != data:
        raise CheckpointError(
            f"{file}: the header describes {at} bytes of tensor data, the file holds {data} (truncated or corrupt)",
            file=file,
        )
    return entries, metadata


def _entry(file: Path, key: str, info: Any) -> Entry:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{file}: '{key}' {what}", file=file, key=key)

    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise bad("is not described by exactly 'dtype', 'shape' and 'data_offsets'")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_OF:
        raise bad(f"has dtype {dtype!r}, which dpcompile does not read (it reads {', '.join(DTYPE_OF)})")
    if not isinstance(shape, list) or not all(_natural(s) for s in shape):
        raise bad(f"has shape {shape!r}: expected a list of non-negative ints ([] for a 0-dim tensor)")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_natural(o) for o in offsets):
        raise bad(f"has data_offsets {offsets!r}: expected [begin, end], non-negative ints")
    numel = math.prod(shape)
    if offsets[1] - offsets[0] != numel * ITEM_SIZE[dtype]:
        raise bad(
            f"is {dtype} {shape} ({numel * ITEM_SIZE[dtype]} bytes), but its data_offsets {offsets} hold "
            f"{offsets[1] - offsets[0]}"
        )
    return Entry(key, file, dtype, tuple(shape), offsets[0], offsets[1])


def _natural(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _shard_set(index: Path, weight_map: Mapping[str, str], headers: Mapping[str, dict[str, Entry]]) -> dict[str, Entry]:
    """Every key of the index in the file it names; no key in two files."""
    held: dict[str, str] = {}
    for name, entries in headers.items():
        for key in entries:
            if key in held:
                raise CheckpointError(
                    f"'{key}' is held by both {held[key]} and {name} in {index.parent}: the shards do not agree",
                    file=index.parent / name, key=key,
                )  # fmt: skip
            held[key] = name
    out = {}
    for key, name in weight_map.items():
        entry = headers[name].get(key)
        if entry is None:
            raise CheckpointError(
                f"{index} maps '{key}' to {name}, which does not hold it"
                + (f" ({held[key]} does)" if key in held else ""),
                file=index.parent / name, key=key,
            )  # fmt: skip
        out[key] = entry
    for key, name in held.items():
        if key not in weight_map:
            raise CheckpointError(
                f"{name} holds '{key}', which {index} does not name: the index does not describe the shards",
                file=index.parent / name, key=key,
            )  # fmt: skip
    return out


def _inside(folder: Path, name: str, index: Path, allow_symlinks: bool) -> Path:
    """``folder / name`` for a file name of the index: relative, no ``..``, a regular file inside."""
    if not file_name_text(name):
        raise CheckpointError(
            f"{index} names {name!r}: not a file name (a NUL byte or an unpaired surrogate no path can hold)", file=index
        )
    parts = Path(name).parts
    if Path(name).is_absolute() or not parts or any(p in ("..", ".", "") for p in parts) or "\\" in name:
        raise CheckpointError(
            f"{index} names {name!r}: shard names must be relative to the folder, without '..'", file=index
        )
    _regular_file(folder / name, folder, allow_symlinks, index)
    return folder / name


def file_name_text(name: str) -> bool:
    """``name`` can be a path: no NUL byte, encodable (``os.lstat`` raises ``ValueError`` on either)."""
    try:
        os.fsencode(name)
    except UnicodeError:
        return False
    return "\x00" not in name


def _regular_file(file: Path, folder: Path, allow_symlinks: bool, blame: Path) -> None:
    """``file`` (under ``folder``) exists and is a regular file; no link on the way unless allowed."""
    here = folder
    rel = file.relative_to(folder).parts if file != folder else ()
    for part in rel:
        here = here / part
        try:
            mode = os.lstat(here).st_mode
        except OSError:
            raise CheckpointError(f"{blame} names {file.name}, which is not in {folder}", file=file) from None
        if stat.S_ISLNK(mode):
            if not allow_symlinks:
                raise CheckpointError(
                    f"{here} is a symbolic link: refused, as it may lead outside the checkpoint "
                    "(pass allow_symlinks=True to follow links, as the Hugging Face cache needs)",
                    file=here,
                )
    if not file.is_file():
        raise CheckpointError(f"{file} is not a regular file", file=file)


def parse_json(text: str, file: Path, what: str, *, sparse: bool = False) -> Any:
    """The JSON value of ``text`` (read from ``file``), refused where it nests deeper than
    ``MAX_NESTING``, names a key twice or is not JSON; ``sparse``: a format whose lists and objects are
    few (a safetensors header, an index json), refused past one per ``BYTES_PER_CONTAINER`` bytes."""
    depth, containers = json_brackets(text)
    if depth > MAX_NESTING:
        raise CheckpointError(f"{file}: {what} nests {depth} levels deep (at most {MAX_NESTING})", file=file)
    if sparse and containers > len(text) // BYTES_PER_CONTAINER + 64:
        raise CheckpointError(
            f"{file}: {what} holds {containers} lists and objects in {len(text)} bytes, more than one per "
            f"{BYTES_PER_CONTAINER} bytes: not a checkpoint's JSON (parsed, it would take ~{containers * 64 >> 20} MiB)",
            file=file,
        )  # fmt: skip

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise CheckpointError(f"{file}: {what} names '{k}' twice", file=file, key=k)
            out[k] = v
        return out

    try:
        return json.loads(text, object_pairs_hook=unique)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{file}: {what} is not valid JSON ({e})", file=file) from None


# a string: possessive, and an unclosed one (a lone backslash last too) ends the text, so that every
# match attempt that starts succeeds and the scan is linear
_STRING = re.compile(r'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_STRING_BYTES = re.compile(_STRING.pattern.encode(), re.DOTALL)


def json_brackets(text: str | bytes) -> tuple[int, int]:
    """How deep ``[``/``{`` nest in the JSON ``text``, and how many open (brackets inside strings not
    counted), in time linear in the text (a string pattern that backtracks took minutes on 400 KB of
    ``"\\``) and in memory a few times its size: the brackets are picked out with numpy and counted
    65,536 at a time (``re.sub`` of what is no bracket kept a piece per bracket, and a running depth
    of all at once 16 bytes each: 20 MB of ``[],[],...`` took 548 MB)."""
    import numpy as np

    outside = _STRING_BYTES.sub(b"", text) if isinstance(text, bytes) else _STRING.sub("", text).encode()
    chars = np.frombuffer(outside, dtype=np.uint8)
    brackets = chars[(chars == ord("[")) | (chars == ord("]")) | (chars == ord("{")) | (chars == ord("}"))]
    depth = deepest = opens = 0
    for at in range(0, brackets.size, 1 << 16):
        part = brackets[at : at + (1 << 16)]
        is_open = (part == ord("[")) | (part == ord("{"))
        running = np.cumsum(is_open.view(np.int8) * np.int8(2) - np.int8(1), dtype=np.int64) + depth
        deepest, depth, opens = max(deepest, int(running.max())), int(running[-1]), opens + int(is_open.sum())
    return deepest, opens


__all__ = [
    "DTYPES", "DTYPE_OF", "INDEX_FILE", "MAX_NESTING", "SINGLE_FILE", "Checkpoint", "CheckpointError", "Entry",
    "file_name_text", "json_brackets", "parse_json", "read_checkpoint", "read_header", "read_index", "read_metadata",
]  # fmt: skip
