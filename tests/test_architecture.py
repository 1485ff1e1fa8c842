"""The import layers of dpcompile: imports only point down, no cycles, no private names across files.

    tools      dpcompile (the package), cli, demo, export, verify, inspect, checkpoint
    api        api, planned, planned_mesh
    recipes    recipes, planning
    modules    modules                      } modules and passes never import each other
    passes     passes                       }
    core       analysis, capture, infra, fx_utils, fake, program_cache, target, keywords
    bottom     runtime, devices, mesh, errors, progress

Built from the source with ``ast`` (every import, at module level or inside a function) and
checked with ``networkx``.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS = {
    "bottom": 0, "core": 1, "passes": 2, "modules": 2, "recipes": 3, "api": 4, "tools": 5,
}  # fmt: skip


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "passes":
        return "passes"
    if module == "dpcompile":
        return "tools"
    second = parts[1]
    return {
        "runtime": "bottom", "devices": "bottom", "mesh": "bottom", "errors": "bottom", "version": "bottom",
        "progress": "bottom",
        "analysis": "core", "capture": "core", "infra": "core", "fx_utils": "core", "fake": "core",
        "program_cache": "core", "target": "core", "keywords": "core",
        "modules": "modules",
        "recipes": "recipes", "planning": "recipes", "planner": "recipes",
        "api": "api", "planned": "api", "planned_mesh": "api",
        "cli": "tools", "__main__": "tools", "demo": "tools", "checkpoint": "tools", "export": "tools", "verify": "tools", "inspect": "tools",
    }[second]  # fmt: skip


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _package_modules() -> dict[str, Path]:
    files = [*(ROOT / "dpcompile").rglob("*.py"), *(ROOT / "passes").rglob("*.py")]
    return {_module_name(p): p for p in files}


def _resolve(target: str, known: dict[str, Path]) -> str | None:
    """The module of ours that ``import target`` loads (``a.b.name`` → ``a.b``), or None."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def import_graph() -> tuple[nx.DiGraph, list[tuple[str, str, str]]]:
    """``(graph of module → module it imports, [(importer, module, private name)])``."""
    known = _package_modules()
    graph = nx.DiGraph()
    private: list[tuple[str, str, str]] = []
    for name, path in known.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
                for alias in node.names:
                    owner = _resolve(base, known)
                    if owner and alias.name.startswith("_") and not alias.name.startswith("__") and owner != name:
                        private.append((name, owner, alias.name))
            for target in targets:
                imported = _resolve(target, known)
                if imported and imported != name:
                    graph.add_edge(name, imported)
    return graph, private


def test_architecture_imports_have_no_cycles():
    """No module imports (directly or through others) a module that imports it back."""
    graph, _ = import_graph()
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles: " + "; ".join(" → ".join([*c, c[0]]) for c in cycles[:5])


def test_architecture_imports_only_point_down():
    """Each import goes to a lower layer or stays in its own; modules and passes never import each other."""
    graph, _ = import_graph()
    upward = [
        f"{a} ({layer_of(a)}) imports {b} ({layer_of(b)})"
        for a, b in graph.edges
        if LAYERS[layer_of(b)] > LAYERS[layer_of(a)]
        or {layer_of(a), layer_of(b)} == {"modules", "passes"}
    ]
    assert not upward, "\n".join(upward)


def test_architecture_no_private_name_crosses_a_file():
    """``from dpcompile.x import _helper`` in another file: make the helper public or keep it home."""
    _, private = import_graph()
    assert not private, "\n".join(f"{a} imports {name} from {b}" for a, b, name in private)


def test_architecture_one_module_kind():
    """No class of ours subclasses ``ParallelModule``: what runs a program is the executor it holds
    (``modules/executors.py``), not a class of its own (a mesh pipeline's stage was the last one)."""
    subclasses = [
        f"{name}.{found.group(1)}"
        for name, path in _package_modules().items()
        for found in re.finditer(r"^\s*class (\w+)\(([^)]*)\)", path.read_text(), re.M)
        if re.search(r"\bParallelModule\b", found.group(2))
    ]
    assert not subclasses, f"subclasses of ParallelModule: {subclasses}; give the program an executor instead"


@pytest.mark.parametrize("module", sorted(_package_modules()))
def test_architecture_every_module_has_a_layer(module):
    """A new file must be placed in a layer (edit LAYERS above) before it lands."""
    assert layer_of(module) in LAYERS


def test_architecture_import_leaves_sympy_and_networkx_out():
    """``import dpcompile``, and a data-parallel program built and run without examples, load neither
    sympy (torch's symbolic sizes, imported where export or a fake run needs them) nor networkx (the
    tensor-parallel plan's graph view): both are lazy, a third of the import time."""
    code = (
        "import sys, torch, dpcompile\n"
        "loaded = lambda: [m for m in ('sympy', 'networkx', 'torch.fx.experimental.symbolic_shapes') if m in sys.modules]\n"
        "print(loaded())\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))\n"
        "dpcompile.transform(model, ['cpu', 'cpu'])(torch.randn(4, 4)).sum().backward()\n"
        "print(loaded())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "[]"], out.stdout + out.stderr
