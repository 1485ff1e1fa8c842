"""Pictures of a program: graphviz source (``to_dot``) and ``draw`` (graphviz ``dot``, else matplotlib)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch.fx as fx

from dpcompile.errors import ArgumentError, DpCompileError
from dpcompile.inspect.nodes import device_labels, slot_of, target_name

__all__ = ["draw", "to_dot"]

log = logging.getLogger("dpcompile")

_PALETTE = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5"]
_COMM_COLOR = "#e41a1c"


def _device_color(slot: int) -> str:
    return _PALETTE[slot % len(_PALETTE)]


def to_dot(pm: fx.GraphModule) -> str:
    """Graphviz source: one cluster per device, nodes coloured by device, collectives in red."""
    labels = device_labels(pm)
    clusters: dict[int, list[str]] = {k: [] for k in range(len(labels))}
    loose: list[str] = []
    edges: list[str] = []

    def quote(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    for node in pm.graph.nodes:
        comm = node.meta.get("dpcompile_comm")
        slot = slot_of(node)
        label = f"{node.name}\\n{target_name(node)}"
        if comm is not None:
            kind = comm.kind + (" (io)" if comm.io else "")
            attrs = (
                f'label="{node.name}\\n{kind}" shape=box style="filled,bold" fillcolor="#fde0dd" '
                f'color="{_COMM_COLOR}" penwidth=2.5'
            )
            loose.append(f"  {quote(node.name)} [{attrs}];")
        elif node.op in ("placeholder", "output"):
            loose.append(f'  {quote(node.name)} [label="{node.name}" shape=oval style=filled fillcolor="#f0f0f0"];')
        else:
            slot = slot if slot is not None and slot < len(labels) else 0  # whole values live on devices[0]
            clusters[slot].append(
                f'    {quote(node.name)} [label="{label}" style=filled fillcolor="{_device_color(slot)}"];'
            )
        for inp in node.all_input_nodes:
            edges.append(f"  {quote(inp.name)} -> {quote(node.name)};")
    lines = [
        "digraph dpcompile {",
        '  rankdir=TB; node [shape=box fontname="Helvetica" fontsize=10]; edge [color="#555555"];',
        f'  label="{getattr(pm, "mode", "")} on {", ".join(labels)}"; labelloc=t;',
    ]
    for slot, body in clusters.items():
        if not body:
            continue
        lines += [
            f"  subgraph cluster_{slot} {{",
            f'    label="{labels[slot]}"; style="rounded,filled"; fillcolor="{_device_color(slot)}30";',
            *body,
            "  }",
        ]
    lines += loose + edges + ["}"]
    return "\n".join(lines) + "\n"


def draw(pm: fx.GraphModule, path: str | Path) -> Path:
    """Write a picture of ``pm``: SVG (or PNG, by suffix) via graphviz ``dot``, else PNG via matplotlib.

    One cluster per device, nodes coloured by device, collectives highlighted in red. Returns
    the path written (``.png`` replaces the suffix when matplotlib draws it); a ``.dot`` path
    writes the graphviz source only.

    >>> import torch, dpcompile
    >>> pm = dpcompile.transform(torch.nn.Linear(8, 4), ["cpu", "cpu"])
    >>> dpcompile.draw(pm, "/tmp/graph.svg")  # doctest: +SKIP
    PosixPath('/tmp/graph.svg')
    """
    if not isinstance(pm, fx.GraphModule):
        raise ArgumentError(f"draw needs a dpcompile.ParallelModule (from dpcompile.transform), got {type(pm).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentError(f"path={path!r}: expected a str or os.PathLike (a .svg, .png or .dot file)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    source = to_dot(pm)
    if path.suffix == ".dot":
        path.write_text(source)
        return path
    dot = shutil.which("dot")
    if dot is not None:
        fmt = path.suffix.lstrip(".") or "svg"
        done = subprocess.run([dot, f"-T{fmt}", "-o", str(path)], input=source, text=True, capture_output=True)
        if done.returncode == 0:
            return path
        log.warning("dot failed (%s); drawing with matplotlib instead", done.stderr.strip()[:200])
    return _draw_matplotlib(pm, path.with_suffix(".png"))


def _draw_matplotlib(pm: fx.GraphModule, path: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        raise DpCompileError(
            "draw needs graphviz's 'dot' (apt-get install graphviz) or matplotlib "
            "(pip install 'dpcompile[pictures]'); neither is installed"
        ) from None
    labels = device_labels(pm)
    columns = len(labels) + 1  # one per device, the last for collectives and whole values
    nodes = list(pm.graph.nodes)
    where: dict[str, tuple[float, float]] = {}
    for row, node in enumerate(nodes):
        slot = slot_of(node)
        if "dpcompile_comm" in node.meta or node.op in ("placeholder", "output"):
            column = len(labels)
        else:
            column = slot if slot is not None and slot < len(labels) else 0  # whole values live on devices[0]
        where[node.name] = (column, -row)
    fig, ax = plt.subplots(figsize=(3 + 2.2 * columns, max(4, 0.32 * len(nodes))))
    for node in nodes:
        x, y = where[node.name]
        for inp in node.all_input_nodes:
            x0, y0 = where[inp.name]
            ax.annotate("", xy=(x, y), xytext=(x0, y0), arrowprops={"arrowstyle": "->", "color": "#888888", "lw": 0.6})
    for node in nodes:
        x, y = where[node.name]
        comm = node.meta.get("dpcompile_comm")
        face = "#fde0dd" if comm else (_device_color(int(x)) if x < len(labels) else "#f0f0f0")
        edge = _COMM_COLOR if comm else "#333333"
        ax.text(
            x,
            y,
            node.name,
            ha="center",
            va="center",
            fontsize=7,
            bbox={"boxstyle": "round", "facecolor": face, "edgecolor": edge, "linewidth": 2 if comm else 0.8},
        )
    for k, label in enumerate([*labels, "collectives / whole"]):
        ax.text(k, 1, label, ha="center", va="bottom", fontsize=9, weight="bold")
    ax.set_xlim(-0.8, columns - 0.2)
    ax.set_ylim(-len(nodes), 2)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
