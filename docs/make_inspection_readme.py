"""Regenerate README.d/inspection.md and docs/graph.svg from real runs.

    python docs/make_inspection_readme.py

Every table, diff and verification message in the README section is the output of the code
below, pasted into docs/inspection_template.md.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from example_model import MLP, Net, Scaled  # noqa: E402

import dpcompile  # noqa: E402


def _shorten(text: str, width: int = 118) -> str:
    return "\n".join(line if len(line) <= width else line[: width - 4] + " ..." for line in text.splitlines())


def main() -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(128, 32)
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    explain = str(dpcompile.explain(pm, x))
    dpcompile.draw(pm, HERE / "graph.svg")
    diff_lines = dpcompile.diff(model, pm).splitlines()
    diff = _shorten("\n".join(diff_lines[:16]) + "\n ...")
    verify_ok = str(dpcompile.verify(pm, model, x))

    mlp = MLP()
    xt = torch.randn(64, 512)
    tp = dpcompile.transform(mlp, ["cpu", "cpu"], tensor_parallel=True, example_inputs=(xt,))
    tp_text = str(dpcompile.explain(tp, xt)).split("\nNodes")[0].rstrip()
    shard = next(p for name, p in tp.named_parameters() if "shard1" in name)
    with torch.no_grad():
        shard.view(-1)[0] += 1.0
    verify_bad = _shorten("\n".join(str(dpcompile.verify(tp, mlp, xt)).splitlines()[:3]))

    scaled = Scaled()
    sp = dpcompile.transform(scaled, ["cpu", "cpu"])
    layout_bad = str(dpcompile.verify(sp, scaled, torch.randn(8, 4), fake_devices=4))
    layout_bad = "\n".join(
        textwrap.fill(line, 116, subsequent_indent="  ") for line in layout_bad.splitlines()
    )
    template = (HERE / "inspection_template.md").read_text()
    text = template.format(
        explain=explain, tp=tp_text, diff=diff, verify_ok=verify_ok, verify_bad=verify_bad, layout_bad=layout_bad
    )
    (HERE.parent / "README.d" / "inspection.md").write_text(text)


if __name__ == "__main__":
    main()
