"""inspect is a tool: modules below the tools never import it, so it can import them without a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("dpcompile/__init__.py", "dpcompile/cli.py", "dpcompile/export.py", "dpcompile/verify/", "dpcompile/inspect/")
INSPECT_NAMES = {"inspect", "explain", "draw", "diff", "Report"}


def _imports_of_inspect(path: Path) -> list[str]:
    """``file:line`` of every import of ``dpcompile.inspect`` in ``path``, function-local ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            hits = [a.name for a in node.names if a.name == "dpcompile.inspect" or a.name.startswith("dpcompile.inspect.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = node.module
            hits = [module] if module == "dpcompile.inspect" or module.startswith("dpcompile.inspect.") else []
            if module == "dpcompile":
                hits = [f"dpcompile.{a.name}" for a in node.names if a.name in INSPECT_NAMES]
        else:
            continue
        found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {hit}" for hit in hits]
    return found


def test_inspect_layer_no_module_below_the_tools_imports_inspect():
    """Only the tools (inspect itself, verify, export, cli, the package's __init__) import dpcompile.inspect."""
    files = [*ROOT.joinpath("dpcompile").rglob("*.py"), *ROOT.joinpath("passes").rglob("*.py")]
    below = [f for f in files if not str(f.relative_to(ROOT)).startswith(TOOLS)]
    assert below, "no modules found: is ROOT right?"
    assert [hit for f in below for hit in _imports_of_inspect(f)] == []
