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
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from dpcompile.errors import DpCompileError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
DTYPE_OF: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPES.items()}


class CheckpointError(DpCompileError):
    """A checkpoint that cannot be read, or does not fit the program."""


def find_tensors(path: str | Path) -> dict[str, Path]:
    """``{key: file holding it}`` for the checkpoint at ``path``.

    >>> find_tensors("ckpt/")  # doctest: +SKIP
    {'model.embed_tokens.weight': PosixPath('ckpt/model-00001-of-00002.safetensors'), ...}
    """
    from safetensors import safe_open

    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path} is not a .safetensors file; pass a .safetensors file or a checkpoint folder")
        with safe_open(str(path), framework="pt") as f:
            return dict.fromkeys(f.keys(), path)
    if not path.is_dir():
        raise CheckpointError(
            f"no checkpoint at {path}: expected a .safetensors file or a folder holding {SINGLE_FILE}"
        )
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, Mapping):
            raise CheckpointError(f"{index} has no 'weight_map' (the layout transformers writes: {{key: file}})")
        absent = sorted({name for name in weight_map.values() if not (path / name).is_file()})
        if absent:
            raise CheckpointError(f"{index} names files that are not in {path}: {', '.join(absent[:5])}")
        return {key: path / name for key, name in weight_map.items()}
    if (path / SINGLE_FILE).is_file():
        return find_tensors(path / SINGLE_FILE)
    found = sorted(p.name for p in path.glob("*.safetensors"))
    raise CheckpointError(
        f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}"
        + (f" (it has {', '.join(found[:4])}: write the index json that maps keys to them)" if found else "")
    )


def write_safetensors(
    path: str | Path,
    entries: Sequence[tuple[str, Sequence[int], torch.dtype]],
    make: Callable[[str], torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write a safetensors file holding ``entries`` (key, shape, dtype), asking ``make(key)``
    for each tensor only when its bytes are due: one tensor in memory at a time. Returns the
    bytes of tensor data written. ``safetensors.safe_open`` reads it as any other."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for key, shape, dtype in entries:
        if dtype not in DTYPES:
            raise CheckpointError(f"'{key}' is {dtype}, which safetensors cannot hold")
        size = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for key, shape, dtype in entries:
            tensor = make(key)
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise CheckpointError(
                    f"'{key}': made {tuple(tensor.shape)} {tensor.dtype}, announced {tuple(shape)} {dtype}"
                )
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            f.write(memoryview(data.numpy()))
    return offset


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


def shard_file_name(k: int, n: int) -> str:
    """``model-00001-of-00003.safetensors``, as transformers names shards."""
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def parse_size(size: int | str) -> int:
    """Bytes of ``"5GB"``, ``"500MiB"``, ``"10KB"`` or an int (transformers' spelling: GB = 10**9)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size={size} must be positive")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if match is None:
        raise ValueError(f"max_shard_size={size!r}: expected bytes (an int) or a size such as '5GB' or '500MiB'")
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


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


__all__ = [
    "DTYPES", "DTYPE_OF", "INDEX_FILE", "SINGLE_FILE", "CheckpointError", "find_tensors", "parse_size", "plan_files",
    "shard_file_name", "write_safetensors",
]  # fmt: skip
