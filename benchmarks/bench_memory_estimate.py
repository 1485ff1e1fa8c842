"""``explain(pm, x).memory_estimate`` and the planner's prediction against ``dpcompile.measure``.

For three small models of ``bench_planner.py`` (its MLP stack, GPT-2 tiny, torchvision's ViT) and a
list of layouts over virtual CPU devices (dp2, tp2, tp2+sp, pp2 GPipe and 1F1B with 2 micro-batches,
dp2xtp2 over 4, one-process FSDP over 2 and over dp2 copies of tp2 and of a pp2 pipeline (GPipe and
1F1B with 2 micro-batches) over 4, dp2 and pp2 with every repeated block checkpointed), each
built by its keywords with ``optimizer="sgd"`` (no state: the three count the same things), then:
the peak bytes per device ``explain``'s ``memory_estimate`` sums to, the planner's prediction of that
layout (``plan_layouts(..., specs=[spec])``; none for FSDP, which is no planner candidate: its
``explain`` estimate is the planner's model of it, ``dpcompile.analysis.fsdp_memory``) and the measured
peak of one training step (``dpcompile.measure``), with each one's error against the measured.

    DPCOMPILE_CACHE_DIR=/tmp/mem3cache PYTHONPATH=. python benchmarks/bench_memory_estimate.py [--only tv_vit]

Writes ``benchmarks/results/memory_estimate.json`` (with ``--only``, the rows of the models named
replace theirs) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_planner import MODELS  # noqa: E402  (defines torchvision's ops first)
from common import uptime  # noqa: E402

import dpcompile  # noqa: E402
from dpcompile.analysis.calibration import REFERENCE  # noqa: E402
from dpcompile.analysis.layout_costs import LayoutSpec  # noqa: E402
from dpcompile.devices import parse_devices  # noqa: E402
from dpcompile.inspect.predicted_memory import why_not_predicted  # noqa: E402
from dpcompile.planner import Candidate, plan_layouts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "memory_estimate.json"
NAMES = ["mlp_stack", "gpt2", "tv_vit"]

#: name: (devices, the planner's spec or None where it predicts none, transform's keywords)
LAYOUTS: dict[str, tuple[int, LayoutSpec | None, dict[str, Any]]] = {}


def _layout(name: str, n: int, spec: LayoutSpec | None, keywords: dict[str, Any] | None = None) -> None:
    LAYOUTS[name] = (n, spec, keywords if keywords is not None else Candidate(spec).keywords())


_layout("dp2", 2, LayoutSpec((("dp", 2),)))
_layout("tp2", 2, LayoutSpec((("tp", 2),)))
_layout("tp2+sp", 2, LayoutSpec((("tp", 2),), sequence_parallel=True))
_layout("pp2 gpipe mb2", 2, LayoutSpec((("pp", 2),), "gpipe", 2))
_layout("pp2 1f1b mb2", 2, LayoutSpec((("pp", 2),), "1f1b", 2))
_layout("dp2xtp2", 4, LayoutSpec((("dp", 2), ("tp", 2))), {"mesh": {"dp": 2, "tp": 2}})
_layout("fsdp2", 2, None, {"data_parallel": "fsdp"})
_layout("fsdp dp2xtp2", 4, None, {"mesh": {"dp": 2, "tp": 2}, "data_parallel": "fsdp"})
_layout("fsdp pp2xdp2 gpipe mb2", 4, None, {"mesh": {"pp": 2, "dp": 2}, "data_parallel": "fsdp", "micro_batches": 2})
_layout("fsdp pp2xdp2 1f1b mb2", 4, None,
        {"mesh": {"pp": 2, "dp": 2}, "data_parallel": "fsdp", "schedule": "1f1b", "micro_batches": 2})
_layout("dp2 +ckpt", 2, LayoutSpec((("dp", 2),), checkpointing=True))
_layout("pp2 gpipe mb2 +ckpt", 2, LayoutSpec((("pp", 2),), "gpipe", 2, checkpointing=True))


def _error(value: int | None, measured: int) -> float | None:
    return None if value is None else round((value - measured) / measured, 4)


def run_one(model_name: str, layout: str) -> dict[str, Any]:
    n, spec, keywords = LAYOUTS[layout]
    devices = ["cpu"] * n
    row: dict[str, Any] = {"model": model_name, "layout": layout}
    try:
        torch.manual_seed(0)
        model, args, kwargs = MODELS[model_name]()
        predicted = None
        labels = parse_devices(devices).labels()
        if spec is not None:
            planned = plan_layouts(model, labels, dict.fromkeys(labels, 1 << 50), optimizer="sgd", training=True,
                                   example_inputs=args or None, example_kwargs=kwargs or None,
                                   device=torch.device("cpu"), specs=[spec], calibration=REFERENCE)  # fmt: skip
            (candidate,) = planned.candidates
            predicted = {d: sum(k.values()) for d, k in candidate.per_device.items()} or None
        pm = dpcompile.transform(model, devices, example_inputs=args or None, example_kwargs=kwargs or None,
                                 optimizer="sgd", **keywords)  # fmt: skip
        row["built"] = dict(pm.strategies)
        row["estimate"] = "program count" if why_not_predicted(pm) else "planner's model"
        measured = dpcompile.measure(pm, *args, **kwargs)
        estimate = {d: sum(k.values()) for d, k in measured.memory_estimate.items()}
        row.update(measured=measured.peak_bytes, explain=estimate, planner=predicted,
                   explain_error={d: _error(estimate.get(d), m) for d, m in measured.peak_bytes.items()},
                   planner_error={d: _error((predicted or {}).get(d), m) for d, m in measured.peak_bytes.items()}
                   if predicted else None)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a benchmark reports and goes on
        row["error_message"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    _print_row(row)
    return row


def _percent(errors: dict[str, float | None] | None) -> str:
    if not errors:
        return "-"
    return " ".join("-" if e is None else f"{e * 100:+.1f}%" for e in errors.values())


def _print_row(row: dict[str, Any]) -> None:
    if "error_message" in row:
        print(f"{row['model']:10} {row['layout']:22} ERROR {row['error_message'][:120]}", flush=True)
        return
    measured = " ".join(f"{m / 1024:.0f}K" for m in row["measured"].values())
    print(f"{row['model']:10} {row['layout']:22} measured {measured:28} explain {_percent(row['explain_error']):32} "
          f"planner {_percent(row['planner_error'])}", flush=True)  # fmt: skip


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def within(key: str) -> tuple[int, int]:
        errors = [e for r in rows for e in (r.get(key) or {}).values() if e is not None]
        return sum(abs(e) <= 0.10 for e in errors), len(errors)

    explain_in, explain_all = within("explain_error")
    planner_in, planner_all = within("planner_error")
    return {"devices_explain_within_10pct": f"{explain_in}/{explain_all}",
            "devices_planner_within_10pct": f"{planner_in}/{planner_all}", "load": uptime()}  # fmt: skip


def markdown_table(rows: list[dict[str, Any]], before: list[dict[str, Any]]) -> str:
    """docs/memory.md's table: measured peaks, ``explain``'s error in ``before``'s results and now."""
    earlier = {(r["model"], r["layout"]): r for r in before}
    lines = ["| model | layout | measured peak per device | `memory_estimate` before | now |", "|---|---|---|---|---|"]
    for r in rows:
        if "error_message" in r:
            continue
        count = " (program count)" if r.get("estimate", "program count" if r.get("planner") is None else "") == "program count" else ""
        then = earlier.get((r["model"], r["layout"]), {})
        lines.append(f"| {r['model']} | {r['layout']} | {', '.join(f'{m / 1024:.0f}K' for m in r['measured'].values())} | "
                     f"{_signed(then.get('explain_error'))} | {_signed(r['explain_error'])}{count} |")  # fmt: skip
    return "\n".join(lines)


def _signed(errors: dict[str, float | None] | None) -> str:
    return ", ".join("-" if e is None else f"{e * 100:+.0f}%" for e in (errors or {}).values()) or "-"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma-separated models: their rows replace theirs")
    parser.add_argument("--layouts", default="", help="comma-separated layouts (default: all)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--table", type=Path, default=None,
                        help="print docs/memory.md's table of --results against these earlier results; run nothing")
    options = parser.parse_args()
    if options.table is not None:
        print(markdown_table(json.loads(options.results.read_text())["rows"], json.loads(options.table.read_text())["rows"]))
        return
    names = options.only.split(",") if options.only else NAMES
    layouts = options.layouts.split(",") if options.layouts else list(LAYOUTS)
    rows = [run_one(name, layout) for name in names for layout in layouts]
    if options.results.exists() and (options.only or options.layouts):
        done = {(r["model"], r["layout"]) for r in rows}
        kept = [r for r in json.loads(options.results.read_text())["rows"] if (r["model"], r["layout"]) not in done]
        rows = sorted(kept + rows, key=lambda r: (NAMES.index(r["model"]) if r["model"] in NAMES else 99,
                                                  list(LAYOUTS).index(r["layout"])))  # fmt: skip
    summary = _summary(rows)
    print(summary)
    options.results.parent.mkdir(exist_ok=True)
    options.results.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
