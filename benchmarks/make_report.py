"""Write docs/benchmarks.md and docs/benchmarks.png from the JSON under benchmarks/results/.

    python benchmarks/make_report.py

Reads ``overhead.json`` (and ``overhead_base.json``, the same script run on the code before
the performance work, for the "before" column), ``spmd_tp.json`` and ``gpu_check.json``
where present. Every figure in the page comes from those files; nothing is typed in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def fmt(value: float | None, digits: int = 2, suffix: str = "×") -> str:
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def overhead_rows(after: dict, before: dict | None) -> list[tuple[str, float | None, float | None, float]]:
    """(what, before, after, target) ratios, lower is better except the compile speedup."""
    rows = []
    for n in (2, 4):
        for grad in ("nograd", "grad"):
            key = f"{n}dev_{grad}"
            label = f"small MLP, {n} devices, {'forward+backward' if grad == 'grad' else 'no_grad forward'}: / hand split"
            rows.append((label, _small(before, key), _small(after, key), 1.1))
    rows.append(("large MLP 1024→4096→1024, forward+backward: / hand split", _large(before, "ratio"), _large(after, "ratio"), 1.03))
    rows.append(("large MLP, copy_replicas=True / virtual path", _large(before, "copy_replicas_over_virtual"),
                 _large(after, "copy_replicas_over_virtual"), 1.03))
    return rows


def copy_floor_rows(after: dict, before: dict | None) -> list[str]:
    """copy_replicas against the hand split whose device 1 runs a copy of the weights."""
    a = _large(after, "copy_replicas_over_hand_split_copy")
    if a is None:
        return []
    return [
        f"| large MLP, copy_replicas=True / hand split with a copy of the weights on device 1 | "
        f"{fmt(_large(before, 'copy_replicas_over_hand_split_copy'), 3)} | {fmt(a, 3)} | — |",
        f"| large MLP, that hand split with a copy / the hand split (what a copy costs on one CPU) | "
        f"{fmt(_large(before, 'hand_split_copy_over_hand_split'), 3)} | {fmt(_large(after, 'hand_split_copy_over_hand_split'), 3)} | — |",
    ]


def _small(result: dict | None, key: str) -> float | None:
    return (result or {}).get("small", {}).get(key, {}).get("ratio")


def _large(result: dict | None, key: str) -> float | None:
    return (result or {}).get("large", {}).get(key)


def plot(rows, spmd: dict | None, path: Path, spmd_before: dict | None = None, before_label: str = "before") -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels, before, after, targets = [], [], [], []
    short = ["2 dev\nno_grad", "2 dev\ngrad", "4 dev\nno_grad", "4 dev\ngrad", "large\nMLP", "copy_replicas\n/ virtual"]
    for (_what, b, a, t), s in zip(rows, short):
        labels.append(s)
        before.append(b or 0.0)
        after.append(a or 0.0)
        targets.append(t)
    if spmd:
        for key, s in (("tp", "SPMD TP\nd=1024"), ("tp_small", "SPMD TP\nd=128")):
            entry = spmd.get("across_runs", {}).get(key)
            if entry:
                labels.append(s)
                before.append(((spmd_before or {}).get("across_runs", {}).get(key) or {}).get("median_ratio") or 0.0)
                after.append(entry["median_ratio"])
                targets.append(1.0 if key == "tp" else 0.8)
    fig, ax = plt.subplots(figsize=(11, 4.2))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], before, 0.4, label=f"before (DP: {before_label}; SPMD: 50fa188)", color="#bbbbbb")
    ax.bar([x + 0.2 for x in xs], after, 0.4, label="after", color="#3a78b5")
    for x, t in zip(xs, targets):
        ax.plot([x - 0.45, x + 0.45], [t, t], color="#d62728", lw=2)
    ax.plot([], [], color="#d62728", lw=2, label="target (at most)")
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("time ratio (lower is better)")
    ax.set_ylim(0, max([*before, *after, *targets]) * 1.15)
    ax.set_title("dpcompile against hand-written per-device code and against DTensor (CPU, this 2-core box)")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    after, before = load("overhead"), load("overhead_base")
    spmd, gpu, spmd_before = load("spmd_tp"), load("gpu_check"), load("spmd_tp_base")
    out: list[str] = ["# Benchmarks: what dpcompile costs at run time", ""]
    out += [
        "Generated from `benchmarks/results/*.json` by `python benchmarks/make_report.py`; every",
        "figure comes from a script in `benchmarks/`, and every ratio was measured within one run",
        "of it, both sides in alternation. The machine is a shared 2-core CPU box, so single",
        "figures wander by 10–20%: read the ratios, and the medians over runs where given.",
        "",
    ]
    if after:
        rows = overhead_rows(after, before)
        out += [
            "## Data parallel on virtual CPU devices: the program against hand-written code",
            "",
            f"`{after.get('command', 'python benchmarks/bench_overhead.py')}` (dpcompile {after.get('dpcompile')}; "
            f"before: the same script on {before.get('dpcompile') if before else '—'}). Clock: this thread's CPU time, "
            "torch on one thread; each ratio is the median over rounds of the ratio within a round (the sides alternate).",
            "The hand split is the user's model run on `x.tensor_split(n)` chunks and `torch.cat`: the",
            "same per-device work, with nothing generated.",
            "",
            "| ratio | before | after | target |",
            "|---|---|---|---|",
        ]
        for what, b, a, t in rows:
            out.append(f"| {what} | {fmt(b, 3)} | {fmt(a, 3)} | ≤ {t}× |")
        out += copy_floor_rows(after, before)
        comp = after.get("compile", {})
        for key in ("nograd", "grad"):
            c = comp.get(key)
            old = ((before or {}).get("compile", {}).get(key) or {})
            if c:
                out.append(
                    f"| `torch.compile(pm)` speedup over `pm`, small MLP, 2 devices, {key} "
                    f"({c['graph_breaks']} graph breaks, outputs equal: {c['outputs_equal']}) | "
                    f"{fmt(old.get('speedup'))} | {fmt(c['speedup'])} | ≥ 1.2× |"
                )
            if c and "speedup_pm_compile" in c:
                out.append(
                    f"| `pm.compile()` (in place, dpcompile's inductor options) speedup over `pm`, {key} "
                    f"(outputs equal: {c['outputs_equal_pm_compile']}) | {fmt(old.get('speedup_pm_compile'))} | "
                    f"{fmt(c['speedup_pm_compile'])} | ≥ 1.2× |"
                )
        out += [
            "",
            "`copy_replicas=True` gives device 1 its own copy of every weight, as a distinct GPU has.",
            "The copies persist between steps and are refreshed only where a parameter changed",
            "(version counters), so a step without an optimizer update copies nothing, and the",
            "gradients are reduce-added onto the originals as before. The \"hand split with a copy\"",
            "rows were meant as the physical floor of any replica on one CPU; on this shared box",
            "the large-MLP figures (50 ms steps) still move by ±5–10% between runs, so read those",
            "rows as \"within noise\", not as gains or losses.",
            "",
        ]
        if plot(rows, spmd, DOCS / "benchmarks.png", spmd_before, (before or {}).get("dpcompile", "before")):
            out += ["![ratios before and after, with targets](benchmarks.png)", ""]
        call = after.get("call", {})
        if call:
            out += [
                "### Where the remaining time of `pm(x)` goes (small MLP, no_grad, µs per call)",
                "",
                "`forward` is the generated program; `forward_prebound_modules` the same runtime and",
                "module calls with every submodule looked up once, outside the call; `pm_call` adds",
                "`ParallelModule.__call__` (batch-size check, program lookup; before, also fx's `call_wrapped`).",
                "`module_lookup_self` is `getattr(pm.layers, \"0\")`, what the code read before for device 0;",
                "`module_lookup_replica` the same read through a replica root, what it reads now on every device.",
                "",
                "| | " + " | ".join(call) + " |",
                "|---|" + "---|" * len(call),
            ]
            keys = [k for k in next(iter(call.values())) if k != "unit"]
            for k in keys:
                out.append(f"| `{k}` | " + " | ".join(f"{call[n].get(k, float('nan')):.1f}" for n in call) + " |")
            out.append("")
    if spmd and "across_runs" in spmd:
        out += [
            "## SPMD tensor parallel against DTensor's `parallelize_module`",
            "",
            f"`{spmd['command']}`: {spmd['runs']} launches of 2 gloo processes, alternating which side is",
            "built first; in each, the median over rounds of the paired per-round ratio (each round's time",
            "is the slower rank's). The table gives the median over launches; \"before\" is the same",
            "script on 50fa188 (" + (f"`{spmd_before['command']}`" if spmd_before else "not measured") + ").",
            "",
            "| MLP | no_grad forward, before | no_grad forward | (peer built first / dpcompile first) | forward with grad | target |",
            "|---|---|---|---|---|---|",
        ]
        for key, entry in spmd["across_runs"].items():
            old_entry = ((spmd_before or {}).get("across_runs") or {}).get(key) or {}
            out.append(
                f"| {entry.get('model')} | {fmt(old_entry.get('median_ratio'), 3)} | {fmt(entry.get('median_ratio'), 3)} | "
                f"{fmt(entry.get('median_ratio_peer_first'), 3)} / {fmt(entry.get('median_ratio_dpcompile_first'), 3)} | "
                f"{fmt(entry.get('median_with_grad_ratio'), 3)} | {entry.get('target', '')} |"
            )
        out.append("")
    out += ["## On GPUs", ""]
    if gpu and not gpu.get("skipped"):
        out.append(f"`python benchmarks/gpu_check.py` on {gpu['machine'].get('gpus')}: failed sections {gpu.get('failed')}.")
        out.append("")
        out.append("```json")
        out.append(json.dumps({k: {kk: vv for kk, vv in v.items() if kk not in ('traceback', 'layout')}
                               for k, v in gpu.get("sections", {}).items()}, indent=1, default=str)[:6000])
        out.append("```")
    else:
        out += [
            "`python benchmarks/gpu_check.py` is prepared for a one-shot run on a CUDA machine (within",
            "5 minutes, nothing downloaded): DP training step against `nn.DataParallel` and eager, an",
            "LSTM under DP with no chunk-of-memory warning and no re-flatten copies, TP forward against",
            "eager, and explain on a fake 8-GPU placement. It has not been run on a GPU yet"
            + (" (the last run skipped: " + gpu.get("reason", "") + ")." if gpu else "."),
        ]
    out += ["", "Compile time, tensor parallel against the `tensor-parallel` package and SPMD data parallel",
            "against DDP: [benchmarks_more.md](benchmarks_more.md).", ""]
    (DOCS / "benchmarks.md").write_text("\n".join(out))
    print(f"wrote {DOCS / 'benchmarks.md'}")


if __name__ == "__main__":
    main()
