"""What an attacker with write access to an export folder does after editing ``program.json``:
regenerate ``module.py`` with dpcompile's own code (where the edited program still decodes
without the module tree's checks) and recompute every checksum in the manifest."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dpcompile.export.build import readable_programs
from dpcompile.export.common import ExportError
from dpcompile.export.source import program_source


def rehash(folder: Path) -> None:
    """Recompute every size and checksum in the manifest (the manifest attests only to itself)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for name in list(manifest["files"]):
        if (folder / name).exists():
            data = (folder / name).read_bytes()
            manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def regenerate_module_py(folder: Path, program: dict) -> bool:
    """Write the module.py dpcompile would make for ``program`` (decoded without the tree, so
    only the vocabulary of call targets is checked); False where even that refuses it."""
    try:
        readable = readable_programs(program["data"], None)
        text = program_source(
            readable, class_name=program["class_name"], mode=program["kind"], devices=program["config"]["devices"]
        )
    except (ExportError, Exception):  # noqa: BLE001 - the attacker keeps the old module.py
        return False
    (folder / "module.py").write_text(text)
    return True


def write_program(folder: Path, program: dict) -> None:
    """Write an edited program, its module.py where dpcompile can regenerate it, and the rehashed manifest."""
    (folder / "program.json").write_text(json.dumps(program))
    regenerate_module_py(folder, program)
    rehash(folder)


def nodes(program: dict) -> list[dict]:
    return program["data"]["graph"]["nodes"]


def first(program: dict, op: str, target: str | None = None) -> dict:
    return next(n for n in nodes(program) if n["op"] == op and (target is None or n["target"] == target))


def insert_before_output(program: dict, *new: dict) -> None:
    """Add nodes just before the output node and make the output return the last one beside the rest."""
    graph = nodes(program)
    out = graph.pop()
    graph.extend(new)
    out["args"] = {"tuple": [{"tuple": [out["args"]["tuple"][0], {"node": new[-1]["name"]}]}]}
    graph.append(out)


def call(name: str, op: str, target: str, *args, **kwargs) -> dict:
    return {
        "op": op,
        "name": name,
        "target": target,
        "args": {"tuple": list(args)},
        "kwargs": {"dict": list(map(list, kwargs.items()))},
    }
