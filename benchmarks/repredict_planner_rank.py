"""The step times a run of ``bench_planner_rank.py`` measured, predicted again by the current cost model,
by the model without its pipeline terms (``step_time.SCHEDULE_ACTION_OPS`` 0, each transfer a
whole all-reduce latency: the model before them) and by the model without the latency of a collective
reached after computing (``synced_collective_s`` 0: each data- or tensor-parallel collective at the
back-to-back latency, the model before it), with the run's own calibration: Spearman's rank
correlation of each against the same measurements (no step is run again, so they compare on one
set of noise). A run recorded before the calibration measured ``page_in_bytes_per_s`` (what GPipe's
order pays for the micro-batches a stage holds beyond 1F1B's first stage) is re-predicted with that
figure measured now, on this machine, as ``calibrate_mesh`` does (printed; ``--page-in`` names one); so is
one recorded before it measured ``microbatch_weight_s_per_byte`` (a micro-batch's cost per byte of its stage's
weights; ``--weight-ms-per-mib`` names one, in ms per MiB).

    PYTHONPATH=. python benchmarks/repredict_planner_rank.py [benchmarks/results/planner_rank.json] [--only mlp_stack] [--page-in 1e9] [--weight-ms-per-mib 0.4]

A run's ``message_s`` (a ping-pong's latency, which calibrations measured before) is left out: a transfer
costs the latency of a collective reached after computing, as it does now.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_planner_rank import RESULTS, plan, spearman  # noqa: E402


@contextlib.contextmanager
def _calibration_of(run: dict[str, Any], **changed: float) -> Any:
    """``calibrate_mesh`` reads the run's calibration (a cache of it, in a directory of its own), with
    ``changed`` figures."""
    from dpcompile.analysis import calibration

    known = {f.name for f in dataclasses.fields(calibration.Calibration)} - {"source"}
    figures = {k: v for k, v in run["calibration"].items() if k in known} | changed
    with tempfile.TemporaryDirectory() as d:
        before = os.environ.get("DPCOMPILE_CACHE_DIR")
        os.environ["DPCOMPILE_CACHE_DIR"] = d
        found = calibration.Calibration(**figures)
        calibration._write_cache(calibration.cache_path(f"gloo{found.ranks}"), found)
        try:
            yield
        finally:
            if before is None:
                del os.environ["DPCOMPILE_CACHE_DIR"]
            else:
                os.environ["DPCOMPILE_CACHE_DIR"] = before


@contextlib.contextmanager
def _without_pipeline_terms() -> Any:
    from dpcompile.analysis import step_time

    saved = (step_time.SCHEDULE_ACTION_OPS, step_time.MESSAGES_ON_PATH, step_time.message_seconds)
    step_time.SCHEDULE_ACTION_OPS, step_time.MESSAGES_ON_PATH = 0, 1.0
    step_time.message_seconds = lambda c: c.collective_latency_s
    try:
        yield
    finally:
        step_time.SCHEDULE_ACTION_OPS, step_time.MESSAGES_ON_PATH, step_time.message_seconds = saved


def page_in_figure(run: dict[str, Any], world: int, given: float | None) -> dict[str, float]:
    """``{"page_in_bytes_per_s": ...}`` where the run's calibration lacks it: ``given``, else measured now."""
    if run["calibration"].get("page_in_bytes_per_s"):
        return {}
    if given is None:
        from dpcompile.analysis import calibration, timing

        with timing.threads(1):
            given = calibration._page_in_bytes_per_s(min(world, calibration.available_cores()))
    return {"page_in_bytes_per_s": given}


def weight_figure(run: dict[str, Any], given_ms_per_mib: float | None) -> dict[str, float]:
    """``{"microbatch_weight_s_per_byte": ...}`` where the run's calibration lacks it: ``given_ms_per_mib``, else
    measured now."""
    if run["calibration"].get("microbatch_weight_s_per_byte"):
        return {}
    if given_ms_per_mib is not None:
        return {"microbatch_weight_s_per_byte": given_ms_per_mib * 1e-3 / 2**20}
    from dpcompile.analysis import calibration, timing

    with timing.threads(1):
        return {"microbatch_weight_s_per_byte": calibration._microbatch_weight_seconds_per_byte()}


def predicted(name: str, world: int) -> dict[str, float]:
    fitting, _, _ = plan(name, world)
    return {c.spec.name: c.step_time for c in fitting}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="?", default=str(RESULTS))
    parser.add_argument("--only", default="")
    parser.add_argument("--page-in", type=float, default=None, help="bytes/s for runs whose calibration lacks it")
    parser.add_argument("--weight-ms-per-mib", type=float, default=None,
                        help="a micro-batch's ms per MiB of weights, for runs whose calibration lacks it")
    ns = parser.parse_args()
    data = json.loads(Path(ns.results).read_text())
    page_in: dict[str, float] | None = None
    pooled: dict[str, tuple[list[float], list[float]]] = {"before": ([], []), "unsynced": ([], []), "now": ([], [])}
    for name, run in data["models"].items():
        if ns.only and name not in ns.only.split(","):
            continue
        rows = [r for r in run["rows"] if r["measured_s"] is not None]
        if page_in is None:  # one figure for the whole file
            page_in = page_in_figure(run, data["world"], ns.page_in)
            if page_in:
                print(f"page_in_bytes_per_s (not in the run's calibration): {page_in['page_in_bytes_per_s'] / 1e9:.2f} GB/s")
            page_in |= weight_figure(run, ns.weight_ms_per_mib)
            if "microbatch_weight_s_per_byte" in page_in:
                print("microbatch_weight_s_per_byte (not in the run's calibration): "
                      f"{page_in['microbatch_weight_s_per_byte'] * 2**20 * 1e3:.3f} ms per MiB")  # fmt: skip
        with _calibration_of(run, **page_in):
            now = predicted(name, data["world"])
            with _without_pipeline_terms():
                before = predicted(name, data["world"])
        with _calibration_of(run, **page_in, synced_collective_s=0.0):
            unsynced = predicted(name, data["world"])
        line = [f"{name} (load: {run.get('uptime_after', '?').split('load average:')[-1].strip()})"]
        for label, table in (("before", before), ("unsynced", unsynced), ("now", now)):
            done = [r for r in rows if r["layout"] in table]
            xs, ys = [table[r["layout"]] for r in done], [r["measured_s"] for r in done]
            rho = spearman(xs, ys)
            line.append(f"{label} rho={rho:.2f}" if rho is not None else f"{label} rho=-")
            if len(done) > 1:
                px, py = statistics.median(xs), statistics.median(ys)
                pooled[label][0].extend(x / px for x in xs)
                pooled[label][1].extend(y / py for y in ys)
        print("  ".join(line))
        for r in rows:
            print(f"    {r['layout']:16s} measured {r['measured_s'] * 1e3:8.1f} ms  predicted before "
                  f"{before.get(r['layout'], float('nan')) * 1e3:8.1f}  unsynced {unsynced.get(r['layout'], float('nan')) * 1e3:8.1f}"
                  f"  now {now.get(r['layout'], float('nan')) * 1e3:8.1f}")  # fmt: skip
    for label, (xs, ys) in pooled.items():
        rho = spearman(xs, ys)
        print(f"pooled {label}: {rho:.2f}" if rho is not None else f"pooled {label}: -")


if __name__ == "__main__":
    main()
