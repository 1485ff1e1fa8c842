"""A seeded fuzzer of checkpoint folders for ``dpcompile.load_checkpoint``.

Each case starts from a good checkpoint of a small model with BatchNorm and a 0-dim parameter
(one file, or shards with an index) and applies one to three mutations drawn from:

* headers: random bytes, truncation, appended bytes, a header length that lies, a JSON header
  edited (dtype, shape, data_offsets, entries dropped, renamed or doubled, ``__metadata__``,
  not an object, nested deep);
* index files: malformed json, a list, an int, ``weight_map`` of the wrong type, values that are
  ints, lists, dicts, ``../`` or absolute paths, a symlink, deep nesting, keys dropped or added;
* shard sets: a missing file, an extra file, a key held by two files, a file renamed, a folder
  where a file should be.

:func:`run_cases` loads every case into one program and sorts the outcome: a clean load, a
``CheckpointError`` naming a file (``error.file`` set and its name in the message), or anything
else (a bug). On every error the program's parameters and buffers are compared with a
snapshot taken before; after a clean load they are put back. ``benchmarks/fuzz_checkpoint.py``
runs it at scale; ``tests/integration/test_checkpoint_fuzz.py`` runs 1,000 cases.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes
from torch import nn

import dpcompile
from dpcompile import CheckpointError

INDEX = "model.safetensors.index.json"


class FuzzModel(nn.Module):
    """BatchNorm (a 0-dim ``num_batches_tracked``), a 0-dim parameter, a conv and a linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 6)
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3))) / self.temperature


@dataclass
class Figures:
    cases: int = 0
    clean: int = 0
    errors: int = 0
    unchanged_on_error: int = 0
    bad: list[str] = field(default_factory=list)  # cases whose outcome was neither
    kinds: Counter = field(default_factory=Counter)  # how often each mutation was drawn
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"cases": self.cases, "clean_loads": self.clean, "checkpoint_errors": self.errors,
                "unchanged_on_error": self.unchanged_on_error, "other_outcomes": len(self.bad),
                "seconds": round(self.seconds, 2), "mutations": dict(sorted(self.kinds.items()))}  # fmt: skip


def program(tensor_parallel: bool = False) -> nn.Module:
    """A program of :class:`FuzzModel` built on meta and filled (``load_state_dict``) with trained weights."""
    torch.manual_seed(0)
    eager = FuzzModel()
    eager(torch.randn(4, 3, 6, 6))
    with torch.device("meta"):
        model = FuzzModel()
    pm = dpcompile.transform(model.eval(), ["cpu"] * 2, tensor_parallel=tensor_parallel,
                             example_inputs=(torch.randn(2, 3, 6, 6),))  # fmt: skip
    pm.load_state_dict(eager.eval().state_dict())
    return pm


def base_shards(pm: nn.Module, files: int) -> dict[str, dict[str, torch.Tensor]]:
    """``{file name: {key: tensor}}``: the program's state in one file or in ``files`` shards."""
    state = {k: v.detach().clone().contiguous() for k, v in pm.state_dict().items()}
    if files == 1:
        return {"model.safetensors": state}
    keys = list(state)
    names = [f"model-{k + 1:05d}-of-{files:05d}.safetensors" for k in range(files)]
    return {name: {key: state[key] for key in keys[k::files]} for k, name in enumerate(names)}


def pack(header: object, data: bytes, length: int | None = None) -> bytes:
    text = header if isinstance(header, (bytes, str)) else json.dumps(header)
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def split(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


class Case:
    """One folder being mutated: ``files`` (name → bytes), the index (a dict, or raw text), links."""

    def __init__(self, shards: dict[str, dict[str, torch.Tensor]], files: dict[str, bytes], rng: random.Random):
        self.rng = rng
        self.files: dict[str, bytes | None] = dict(files)  # None: a folder
        self.index: object = None
        if len(shards) > 1:
            self.index = {"metadata": {"total_size": 0}, "weight_map": {k: n for n, t in shards.items() for k in t}}
        self.links: dict[str, str] = {}  # name in the folder → "outside" or a file name inside

    def shard(self) -> str:
        return self.rng.choice(sorted(n for n, b in self.files.items() if b is not None) or ["model.safetensors"])

    def write(self, folder: Path, outside: Path) -> None:
        for name, raw in self.files.items():
            if raw is None:
                (folder / name).mkdir()
            else:
                (folder / name).write_bytes(raw)
        if self.index is not None and INDEX not in self.files:
            text = self.index if isinstance(self.index, (str, bytes)) else json.dumps(self.index)
            (folder / INDEX).write_bytes(text.encode() if isinstance(text, str) else text)
        for name, target in self.links.items():
            (folder / name).unlink(missing_ok=True)
            os.symlink(outside if target == "outside" else folder / target, folder / name)


# --- header mutations ------------------------------------------------------------------------


def _raw(case: Case) -> tuple[str, bytes]:
    name = case.shard()
    return name, case.files.get(name) or b""


def random_bytes(case: Case) -> None:
    name, raw = _raw(case)
    raw = bytearray(raw)
    for _ in range(case.rng.randint(1, 8)):
        if raw:
            at = case.rng.randrange(min(len(raw), 8 + case.rng.choice([16, 64, 400, len(raw)])))
            raw[at] = case.rng.randrange(256)
    case.files[name] = bytes(raw)


def truncate(case: Case) -> None:
    name, raw = _raw(case)
    case.files[name] = raw[: case.rng.randrange(max(1, len(raw)))]


def append(case: Case) -> None:
    name, raw = _raw(case)
    case.files[name] = raw + os.urandom(case.rng.randint(1, 64))


def length_lies(case: Case) -> None:
    name, raw = _raw(case)
    (n,) = struct.unpack("<Q", raw[:8]) if len(raw) >= 8 else (0,)
    lie = case.rng.choice([0, 1, n - 1, n + 1, n + 8, len(raw), 2**63, 2**64 - 1, case.rng.randrange(2**32)])
    case.files[name] = struct.pack("<Q", max(0, lie) % 2**64) + raw[8:]


DTYPES = ["F32", "F16", "BF16", "F64", "I64", "I32", "I8", "U8", "BOOL", "F8_E4M3", "C64", "U16", "", "f32", 7, None]


def edit_header(case: Case) -> None:
    """One edit of the JSON header of a shard (the data bytes kept)."""
    name, raw = _raw(case)
    try:
        header, data = split(raw)
    except (ValueError, struct.error, RecursionError):
        return random_bytes(case)
    if not isinstance(header, dict):
        return random_bytes(case)
    rng = case.rng
    keys = [k for k in header if k != "__metadata__"]
    key = rng.choice(keys) if keys else "x"
    info = header.get(key, {})
    how = rng.choice(["dtype", "shape", "offsets", "drop", "rename", "field", "metadata", "not_object", "deep",
                      "duplicate", "entry_type", "same_bytes_shape"])  # fmt: skip
    if how == "dtype" and isinstance(info, dict):
        info["dtype"] = rng.choice(DTYPES)
    elif how == "shape" and isinstance(info, dict):
        shape = list(info.get("shape", []))
        info["shape"] = rng.choice([shape + [1], shape[:-1], [], [-1], ["4"], [2.0], [True], None, [s + 1 for s in shape],
                                    [10**12], list(reversed(shape))])  # fmt: skip
    elif how == "same_bytes_shape" and isinstance(info, dict):  # a shape of the same size: only the model can tell
        n = 1
        for s in info.get("shape", []):
            n *= s
        info["shape"] = rng.choice([[n], [1, n], [n, 1], []]) if n != 1 else rng.choice([[1], [], [1, 1]])
    elif how == "offsets" and isinstance(info, dict):
        begin, end = info.get("data_offsets", [0, 0])
        info["data_offsets"] = rng.choice([[begin, end + 4], [begin + 4, end + 4], [end, begin], [begin], [-1, end],
                                           [begin, 10**15], "0,4", [begin, end, 0]])  # fmt: skip
    elif how == "drop":
        header.pop(key, None)
    elif how == "rename":
        header[key + rng.choice(["_x", ".gamma", ""])] = header.pop(key, info)
    elif how == "field" and isinstance(info, dict):
        info[rng.choice(["extra", "dtype", "shape"])] = rng.choice([1, "x", [], None])
        if rng.random() < 0.5:
            info.pop(rng.choice(["dtype", "shape", "data_offsets"]), None)
    elif how == "metadata":
        header["__metadata__"] = rng.choice([{"format": 1}, ["pt"], "pt", {"a": {"b": 1}}, None, {"format": "pt"}])
    elif how == "not_object":
        case.files[name] = pack(rng.choice([[1, 2], 3, "text", None, True]), data)
        return
    elif how == "deep":
        depth = rng.choice([10, 63, 65, 200, 5000])
        case.files[name] = pack("{" + '"a":' + "[" * depth + "]" * depth + "}", data)
        return
    elif how == "duplicate" and keys:
        text = json.dumps(header)
        entry = json.dumps({key: info})[1:-1]
        case.files[name] = pack(text[:-1] + ", " + entry + "}", data)
        return
    elif how == "entry_type":
        header[key] = rng.choice([1, "x", [0, 4], None, {"dtype": "F32"}])
    case.files[name] = pack(header, data)


# --- index mutations -------------------------------------------------------------------------


def edit_index(case: Case) -> None:
    rng = case.rng
    index = case.index if isinstance(case.index, dict) else {"weight_map": {}}
    weight_map = index.get("weight_map") if isinstance(index.get("weight_map"), dict) else {}
    key = rng.choice(sorted(weight_map)) if weight_map else "fc.weight"
    files = sorted({v for v in weight_map.values() if isinstance(v, str)})  # earlier edits may have left others
    how = rng.choice(["malformed", "list", "int", "string", "null", "map_type", "value_type", "parent", "absolute",
                      "symlink_out", "symlink_in", "deep", "drop_key", "add_key", "wrong_file", "dot", "subfolder",
                      "empty_name", "no_map", "bytes"])  # fmt: skip
    if how == "malformed":
        text = json.dumps(index)
        case.index = text[: rng.randrange(max(1, len(text)))]
    elif how == "list":
        case.index = [index]
    elif how == "int":
        case.index = rng.choice([0, 7, -1, 1e308])
    elif how == "string":
        case.index = "model.safetensors"
    elif how == "null":
        case.index = None if case.index is None else "null"
    elif how == "map_type":
        index["weight_map"] = rng.choice([[key], 3, "model.safetensors", None, [[key, "x"]]])
        case.index = index
    elif how == "value_type":
        weight_map[key] = rng.choice([3, None, [weight_map.get(key)], {"file": weight_map.get(key)}, True, 1.5])
        case.index = {**index, "weight_map": weight_map}
    elif how in ("parent", "absolute", "dot", "subfolder", "empty_name"):
        weight_map[key] = {"parent": "../outside.safetensors", "absolute": "/tmp/../etc/passwd",
                           "dot": "./" + str(weight_map.get(key)), "subfolder": "sub/../" + str(weight_map.get(key)),
                           "empty_name": ""}[how]  # fmt: skip
        case.index = {**index, "weight_map": weight_map}
    elif how in ("symlink_out", "symlink_in"):
        inside = [n for n, b in case.files.items() if b is not None]
        case.links["link.safetensors"] = "outside" if how == "symlink_out" or not inside else rng.choice(inside)
        weight_map[key] = "link.safetensors"
        case.index = {**index, "weight_map": weight_map}
    elif how == "deep":
        depth = rng.choice([20, 64, 65, 300, 20000])
        case.index = '{"metadata": ' + "[" * depth + "]" * depth + ', "weight_map": ' + json.dumps(weight_map) + "}"
    elif how == "drop_key" and weight_map:
        weight_map.pop(key)
        case.index = {**index, "weight_map": weight_map}
    elif how == "add_key":
        weight_map["not.a.key"] = rng.choice(files or ["model.safetensors"])
        case.index = {**index, "weight_map": weight_map}
    elif how == "wrong_file" and len(files) > 1:
        weight_map[key] = rng.choice([f for f in files if f != weight_map[key]])
        case.index = {**index, "weight_map": weight_map}
    elif how == "no_map":
        case.index = {"metadata": {}}
    elif how == "bytes":
        case.index = os.urandom(rng.randint(1, 64))


# --- shard-set mutations -----------------------------------------------------------------------


def edit_shards(case: Case, shards: dict[str, dict[str, torch.Tensor]]) -> None:
    rng = case.rng
    names = [n for n, b in case.files.items() if b is not None]
    how = rng.choice(["missing", "extra", "two_files", "rename", "folder", "extra_unnamed", "index_folder"])
    if how == "missing" and names:
        case.files.pop(rng.choice(names))
    elif how == "extra":
        case.files["extra.safetensors"] = safetensors_bytes({"stray": torch.zeros(2)})
        if isinstance(case.index, dict) and isinstance(case.index.get("weight_map"), dict):
            case.index["weight_map"]["stray"] = "extra.safetensors"
    elif how == "extra_unnamed":  # a file nothing names: ignored
        case.files["notes.safetensors"] = os.urandom(32)
    elif how == "two_files" and names:
        source = rng.choice([n for n in shards if n in case.files] or [None])
        if source is not None and shards[source]:
            key = rng.choice(sorted(shards[source]))
            target = rng.choice(names)
            if target != source:
                case.files[target] = safetensors_bytes({**shards.get(target, {}), key: shards[source][key]})
    elif how == "rename" and names:
        old = rng.choice(names)
        case.files[old + ".bak"] = case.files.pop(old)
    elif how == "folder" and names:
        case.files[rng.choice(names)] = None
    elif how == "index_folder":
        case.index = None
        case.files[INDEX] = None


MUTATIONS: dict[str, Callable[..., None]] = {
    "random_bytes": random_bytes, "truncate": truncate, "append": append, "length_lies": length_lies,
    "edit_header": edit_header, "edit_index": edit_index, "edit_shards": edit_shards,
}  # fmt: skip


def run_cases(n: int, seed: int = 0, pm: nn.Module | None = None, root: Path | None = None) -> Figures:
    """Load ``n`` mutated checkpoints into ``pm`` (default: :func:`program`); the figures of what happened."""
    pm = program() if pm is None else pm
    snapshot = {k: t.detach().clone() for k, t in [*pm.named_parameters(), *pm.named_buffers()]}
    layouts = {1: base_shards(pm, 1), 3: base_shards(pm, 3)}
    packed = {n: {name: safetensors_bytes(t) for name, t in shards.items()} for n, shards in layouts.items()}
    figures = Figures()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        outside = Path(tmp) / "outside.safetensors"
        outside.write_bytes(safetensors_bytes(layouts[1]["model.safetensors"]))
        for k in range(n):
            rng = random.Random(seed * 1_000_003 + k)
            layout = rng.choice([1, 3])
            shards = layouts[layout]
            case = Case(shards, packed[layout], rng)
            for _ in range(rng.choice([1, 1, 1, 2, 3])):
                kind = rng.choice(sorted(MUTATIONS))
                figures.kinds[kind] += 1
                MUTATIONS[kind](case, shards) if kind == "edit_shards" else MUTATIONS[kind](case)
            folder = Path(tmp) / f"case{k}"
            folder.mkdir()
            case.write(folder, outside)
            figures.cases += 1
            outcome = _load(pm, folder, strict=rng.random() < 0.8)
            if outcome is None:
                figures.clean += 1
                _restore(pm, snapshot)
            elif isinstance(outcome, CheckpointError) and outcome.file is not None and outcome.file.name in str(outcome):
                figures.errors += 1
                if _same(pm, snapshot):
                    figures.unchanged_on_error += 1
                else:
                    figures.bad.append(f"case {k} (seed {seed}): changed the program on error {outcome}")
                    _restore(pm, snapshot)
            else:
                figures.bad.append(f"case {k} (seed {seed}): {type(outcome).__name__}: {outcome}")
                _restore(pm, snapshot)
            shutil.rmtree(folder, ignore_errors=True)
    figures.seconds = time.perf_counter() - start
    return figures


def _load(pm: nn.Module, folder: Path, strict: bool) -> BaseException | None:
    try:
        dpcompile.load_checkpoint(pm, folder, strict=strict)
    except Exception as e:  # noqa: BLE001 - every outcome is sorted by the caller
        return e
    return None


def _same(pm: nn.Module, snapshot: dict[str, torch.Tensor]) -> bool:
    now = dict([*pm.named_parameters(), *pm.named_buffers()])
    return now.keys() == snapshot.keys() and all(torch.equal(now[k], v) for k, v in snapshot.items())


@torch.no_grad()
def _restore(pm: nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    now = dict([*pm.named_parameters(), *pm.named_buffers()])
    for k, v in snapshot.items():
        now[k].copy_(v)
    pm.__dict__["_needs_weights"] = False


__all__ = ["Figures", "FuzzModel", "program", "run_cases"]
