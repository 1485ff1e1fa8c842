"""What ``load`` checks before it builds anything: the manifest (every field), the files
(listed, present, size and sha256, nothing unlisted), the program's own fields and the
weights (names, shapes, dtypes as the program says)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from dpcompile.checkpoint.headers import CheckpointError, read_header
from dpcompile.checkpoint.headers import json_brackets as brackets  # the one scanner, for bytes here
from dpcompile.errors import ArgumentError
from dpcompile.export.common import (
    FORMAT,
    FORMAT_VERSION,
    KINDS,
    MANIFEST_FILE,
    MODULE_FILE,
    PICKLE_FILE,
    PROGRAM_FILE,
    PROGRAM_FORMAT,
    SUMMARY_FIELDS,
    WEIGHTS_FILE,
    ExportError,
    dtype_name,
)

__all__ = ["MAX_MANIFEST_BYTES", "MAX_NESTING", "MAX_PROGRAM_BYTES", "STRATEGY_WORDS", "check_manifest_hash", "manifest_hash", "read_json", "read_manifest"]

# how deep a manifest or program may nest lists and objects: real programs stay far below
# (a node's arguments: tuples of tuples); Python's parser would raise RecursionError near 1000
MAX_NESTING = 200
# how big manifest.json (it lists four files) and program.json (a graph of tens of thousands of
# nodes stays far below) may be: read whole and parsed, a larger file is refused before it is read
MAX_MANIFEST_BYTES = 1 << 20
MAX_PROGRAM_BYTES = 256 << 20
#: at most one list or object per this many bytes of manifest.json or program.json
BYTES_PER_CONTAINER = 8


#: the longest words of one ``pm.strategies`` entry a folder may hold: every recomputed block's path is
#: among them (30 blocks' were 300 characters, and a folder that export wrote was refused at load under 200)
STRATEGY_WORDS = 4000

def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def canonical_json(data: Any) -> bytes:
    return (json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def nesting(text: bytes) -> int:
    """How deep ``text`` (JSON) nests lists and objects, counted without parsing (no recursion)."""
    return brackets(text)[0]


def read_json(path: Path, limit: int = MAX_NESTING, *, max_bytes: int = MAX_PROGRAM_BYTES) -> Any:
    """The JSON value of the file ``path``, refused with an :class:`ExportError` naming the file
    where it cannot be read, holds more than ``max_bytes`` or nests deeper than ``limit`` (checked
    before parsing)."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise ExportError(
                f"{path} is {size} bytes, more than the {max_bytes} an export ever writes there; it was not written "
                "by dpcompile.export: re-export the module"
            )
        text = path.read_bytes()
    except OSError as e:
        raise ExportError(f"{path} cannot be read ({e}); re-export the module") from None
    depth, containers = brackets(text)
    if depth > limit:
        raise ExportError(
            f"{path} nests lists and objects {depth} deep, more than the {limit} an export ever writes; "
            "it was not written by dpcompile.export: re-export the module"
        )
    if containers > len(text) // BYTES_PER_CONTAINER + 64:  # each ~64 bytes parsed: 256 MB of [],[] would take 5 GB
        raise ExportError(
            f"{path} holds {containers} lists and objects in {len(text)} bytes, more than one per {BYTES_PER_CONTAINER} "
            "(an export writes one per 40 or so, indented); it was not written by dpcompile.export: re-export the module"
        )
    try:
        return json.loads(text, object_pairs_hook=functools.partial(_unique_keys, path), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise ExportError(f"{path} cannot be read as JSON ({e!s:.200}); re-export the module") from None


def _unique_keys(path: Path, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object of ``pairs``, refused where it names a key twice: export never writes one, and which
    of the two a reader takes is the parser's choice (Python's the last), not the writer's."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ExportError(f"{path} names the key {key!r:.60} twice in one object; it was edited: re-export the module")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    """``NaN`` / ``Infinity``, which export never writes (a float's ``{"float": "nan"}`` instead)."""
    raise ValueError(f"{name} is not JSON (an export writes no bare {name})")


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The checked manifest of an export folder: every field known and valid, every file in
    the folder listed and every listed file present with its size and sha256."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path={path!r}: expected a str or os.PathLike, the folder that dpcompile.export wrote")
    folder = Path(path)
    if not folder.is_dir():
        raise ExportError(f"{folder} is not a folder; pass the folder that dpcompile.export wrote")
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file() or manifest_path.is_symlink():
        _not_a_plain_file(manifest_path)
        raise ExportError(f"{folder} has no {MANIFEST_FILE}; it is not a dpcompile export (or it is incomplete)")
    manifest = read_json(manifest_path, max_bytes=MAX_MANIFEST_BYTES)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ExportError(f"{manifest_path} is not a dpcompile export manifest (format {found!r})")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ExportError(
            f"{folder} uses export format version {version!r}; this dpcompile reads version {FORMAT_VERSION}. "
            "Load it with the dpcompile version that wrote it, or re-export"
        )
    if set(manifest) != {"format", "format_version", "files", "program"}:
        raise ExportError(f"{manifest_path} has fields {sorted(manifest)}; it was changed or written by another tool: re-export")
    files = manifest["files"]
    summary = manifest["program"]
    if not isinstance(summary, dict) or set(summary) != set(SUMMARY_FIELDS):
        raise ExportError(f"{manifest_path} has no valid 'program' summary; re-export the module")
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and set(v) == {"sha256", "size"} and isinstance(v["sha256"], str) and type(v["size"]) is int
        for v in files.values()
    ):
        raise ExportError(f"{manifest_path} has no valid 'files' table; re-export the module")
    if files.get(PROGRAM_FILE, {}).get("size", 0) > MAX_PROGRAM_BYTES:
        raise ExportError(f"{manifest_path} lists a {PROGRAM_FILE} of more than {MAX_PROGRAM_BYTES} bytes; re-export the module")
    required = {MODULE_FILE, PROGRAM_FILE, WEIGHTS_FILE} | ({PICKLE_FILE} if summary.get("trust_code") is True else set())
    listed = set(files)
    present = {p.name for p in folder.iterdir()} - {MANIFEST_FILE}
    if listed != required:
        raise ExportError(
            f"{manifest_path} lists {sorted(listed)}; an export of this kind lists exactly {sorted(required)} "
            "(a missing entry is never skipped): re-export the module"
        )
    if present - listed:
        raise ExportError(f"{folder} holds {sorted(present - listed)}, which {MANIFEST_FILE} does not list; remove it or re-export")
    for name in sorted(listed):
        file = folder / name
        if not file.is_file() or file.is_symlink():
            _not_a_plain_file(file)
            raise ExportError(f"{folder} is missing {name}; the export is incomplete, re-export the module")
        if file.stat().st_size != files[name]["size"] or sha256_of(file) != files[name]["sha256"]:
            raise ExportError(f"{file} does not match the size and checksum in {MANIFEST_FILE}; it was changed or truncated")
    return manifest


def _not_a_plain_file(file: Path) -> None:
    """Raise naming what ``file`` is where it is there but not a regular file (a link, a folder)."""
    if file.is_symlink():
        raise ExportError(f"{file} is a symbolic link: refused, as it may lead outside the export; copy the file in or re-export")
    if file.exists():
        raise ExportError(f"{file} is not a regular file; re-export the module")


def read_program(folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    program = read_json(folder / PROGRAM_FILE, max_bytes=MAX_PROGRAM_BYTES)
    keys = {"format", "format_version", "kind", "class_name", "dpcompile_version", "torch_version", "trust_code",
            "pickled_because", "config", "training", "tensors", "modules", "data"}  # fmt: skip
    if not isinstance(program, dict) or set(program) != keys or program["format"] != PROGRAM_FORMAT:
        raise ExportError(f"{folder / PROGRAM_FILE} is not a dpcompile program of this version; re-export")
    if program["format_version"] != FORMAT_VERSION or program["kind"] not in KINDS:
        raise ExportError(f"{folder / PROGRAM_FILE}: version {program['format_version']!r}, kind {program['kind']!r:.40}")
    config = program["config"]
    fields = {"devices", "output_device", "input_dims", "plan", "tensor_parallel"}
    if program["kind"].startswith("pipeline"):  # config.pipeline: the stages (export/pipeline.py)
        fields.add("pipeline")
    if isinstance(config, dict) and "data_parallel" in config:  # written only for FSDP's pieces
        if config["data_parallel"] != "fsdp":
            raise ExportError(f"{folder / PROGRAM_FILE}: data_parallel {config['data_parallel']!r:.40} (only \"fsdp\" is written)")
        fields.add("data_parallel")
    if isinstance(config, dict) and "mesh" in config and program["kind"] == "data_parallel":  # exported over a mesh
        from dpcompile.export.mesh_section import checked_mesh_section

        checked_mesh_section(config["mesh"])
        fields.add("mesh")
    if isinstance(config, dict) and "layout" in config:  # pm.layout (older folders lack it)
        layout = config["layout"]
        if not isinstance(layout, list) or not all(  # pairs: the order of the dimensions places the devices
            isinstance(p, list) and len(p) == 2 and p[0] in ("pp", "dp", "cp", "tp") and type(p[1]) is int and p[1] >= 1
            for p in layout
        ) or len({p[0] for p in layout}) != len(layout):
            raise ExportError(f"{folder / PROGRAM_FILE}: layout {layout!r:.80} is not [['pp'|'dp'|'cp'|'tp', size], ...]")
        words = config.get("strategies")
        if not isinstance(words, dict) or not all(isinstance(k, str) and isinstance(v, str) and len(v) < STRATEGY_WORDS
                                                  for k, v in words.items()):  # fmt: skip
            raise ExportError(f"{folder / PROGRAM_FILE}: strategies {words!r:.80} is not {{dimension: words}}")
        fields |= {"layout", "strategies"}
    if isinstance(config, dict) and "memory_options" in config:  # transform's optimizer= and training= (older folders lack it)
        options = config["memory_options"]
        if (not isinstance(options, dict) or set(options) != {"optimizer", "training"} or type(options["training"]) is not bool
                or options["optimizer"] not in (None, "sgd", "sgd_momentum", "adam", "adamw")):  # fmt: skip
            raise ExportError(f"{folder / PROGRAM_FILE}: memory_options {options!r:.80} is not {{optimizer, training}}")
        fields.add("memory_options")
    if not isinstance(config, dict) or set(config) != fields:
        raise ExportError(f"{folder / PROGRAM_FILE}: a config it cannot read")
    devices = config["devices"]
    if not isinstance(devices, list) or not devices or not all(isinstance(d, str) for d in devices):
        raise ExportError(f"{folder / PROGRAM_FILE}: devices {devices!r:.60}")
    derived = {k: program[k] for k in SUMMARY_FIELDS if k != "devices"} | {"devices": devices}
    if derived != manifest["program"]:
        differ = sorted(k for k in SUMMARY_FIELDS if derived.get(k) != manifest["program"].get(k))
        raise ExportError(f"{MANIFEST_FILE} and {PROGRAM_FILE} disagree on {differ}; the folder was edited: re-export")
    if program["trust_code"] is not (program["pickled_because"] is not None):
        raise ExportError(f"{folder / PROGRAM_FILE}: trust_code and pickled_because disagree")
    if (program["modules"] is None) is not program["trust_code"] or (program["data"] is None) is not program["trust_code"]:
        raise ExportError(f"{folder / PROGRAM_FILE}: a data program must carry its modules and programs")
    tensors = program["tensors"]
    if not isinstance(tensors, dict):
        raise ExportError(f"{folder / PROGRAM_FILE}: no tensor table")
    for key, info in tensors.items():
        if (
            not isinstance(info, dict)
            or set(info) != {"shape", "dtype", "parameter", "requires_grad", "slot"}
            or not isinstance(info["shape"], list)
            or not all(type(s) is int and s >= 0 for s in info["shape"])
            or not isinstance(getattr(torch, str(info["dtype"]), None), torch.dtype)
            or type(info["parameter"]) is not bool
            or type(info["requires_grad"]) is not bool
            or not (info["slot"] is None or (type(info["slot"]) is int and 0 <= info["slot"] < len(devices)))
        ):
            raise ExportError(f"{folder / PROGRAM_FILE}: tensor {key!r:.60} is described as {info!r:.80}")
    return program


def read_weights(folder: Path, program: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of weights.safetensors, checked against the program's table (names, shapes, dtypes)."""
    import safetensors
    import safetensors.torch

    info = program["tensors"]
    try:  # the header as the format defines it first (no key twice, offsets end to end): safetensors takes either
        read_header(folder / WEIGHTS_FILE)
    except CheckpointError as e:
        raise ExportError(f"{e}; re-export the module") from None
    try:
        with safetensors.safe_open(str(folder / WEIGHTS_FILE), framework="pt") as f:
            names = set(f.keys())
            if names != set(info):
                missing, extra = sorted(set(info) - names), sorted(names - set(info))
                raise ExportError(f"{WEIGHTS_FILE} and {PROGRAM_FILE} disagree: missing {missing[:5]}, unexpected {extra[:5]}")
        weights = safetensors.torch.load_file(str(folder / WEIGHTS_FILE))
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"cannot read {folder / WEIGHTS_FILE}: {type(e).__name__}: {e}") from e
    for key, t in weights.items():
        want = info[key]
        if list(t.shape) != want["shape"] or dtype_name(t.dtype) != want["dtype"]:
            raise ExportError(
                f"{WEIGHTS_FILE}: tensor {key!r} is {dtype_name(t.dtype)}{list(t.shape)}, the program needs "
                f"{want['dtype']}{want['shape']}; the folder was edited: re-export"
            )
        if want["requires_grad"] and not want["parameter"]:
            raise ExportError(f"{PROGRAM_FILE}: buffer {key!r} cannot require grad")
        if t.dtype == torch.bool and bool((t.view(torch.uint8) > 1).any()):  # torch's ops disagree on such a bool
            raise ExportError(f"{WEIGHTS_FILE}: bool tensor {key!r} holds bytes other than 0 and 1; the folder was edited: re-export")
    # each tensor its own allocation (after the bool check: a copy makes every byte 0 or 1): load_file's are views into
    # the file's mapping at 8-byte offsets, which CPU kernels round otherwise on some machines (AMD EPYC: 1e-17 apart)
    return {key: t.clone() for key, t in weights.items()}


def manifest_hash(path: str | Path) -> str:
    """The sha256 of an export folder's ``manifest.json``: hand it to whoever loads the folder
    over a channel you trust, for ``dpcompile.load(path, expected_hash=...)``.

    >>> manifest_hash("exported")  # doctest: +SKIP
    '3f2a...'
    """
    file = Path(path) / MANIFEST_FILE
    if not file.is_file() or file.is_symlink():
        raise ExportError(f"{Path(path)} has no {MANIFEST_FILE}; it is not a dpcompile export (or it is incomplete)")
    return sha256_of(file)


def check_manifest_hash(folder: Path, expected: str) -> None:
    """Refuse ``folder`` unless its manifest's sha256 is ``expected`` (the trusted hash)."""
    if not isinstance(expected, str) or len(expected) != 64 or any(c not in "0123456789abcdefABCDEF" for c in expected):
        raise ArgumentError(
            f"expected_hash must be a sha256 in hex (64 characters, as the export's manifest_hash), got {expected!r:.80}"
        )
    actual = manifest_hash(folder)
    if actual != expected.lower():
        raise ExportError(
            f"{folder / MANIFEST_FILE} has sha256 {actual}, not the expected {expected.lower()}: the folder is not "
            "the one whose hash you were given (edited, or another export); do not load it"
        )
