"""Write docs/benchmarks.md and docs/benchmarks.png from the JSON under benchmarks/results/.

    python benchmarks/make_report.py

Reads ``overhead.json`` (and ``overhead_base.json``, the same script run on the code before
the performance work, for the "before" column), ``spmd_tp.json``, ``pipeline.json``,
``tensor_parallel.json`` (each with its ``*_base.json``) and ``gpu_check.json`` where present,
and rewrites the figures of README.md's Benchmarks section (between its ``benchmarks:start`` /
``benchmarks:end`` markers). Every figure comes from those files; nothing is typed in.
"""

from __future__ import annotations

import json
import textwrap
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
    ax.bar([x - 0.2 for x in xs], before, 0.4, label=f"before ({before_label})", color="#bbbbbb")
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
            f"script on {_before_commit(before)} (" + (f"`{spmd_before['command']}`" if spmd_before else "not measured") + ").",
            "\"CPU time\" is the same median of the processes' CPU time (the larger rank's, gloo's threads",
            "included): the work each side does, which a box loaded many times over its cores moves far less.",
            *(["The forwards of \"before\" timed `parallelize_module`'s call without waiting for its all-reduce (its",
               "output is an `AsyncCollectiveTensor`, still in flight), which flattered it; the others wait for it."]
              if spmd.get("peer_output_waited") and spmd_before and not spmd_before.get("peer_output_waited") else []),
            "",
            "| MLP | no_grad forward, before | no_grad forward | (peer built first / dpcompile first) | forward with grad | training step | training step, CPU time | target |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for key, entry in spmd["across_runs"].items():
            old_entry = ((spmd_before or {}).get("across_runs") or {}).get(key) or {}
            out.append(
                f"| {entry.get('model')} | {fmt(old_entry.get('median_ratio'), 3)} | {fmt(entry.get('median_ratio'), 3)} | "
                f"{fmt(entry.get('median_ratio_peer_first'), 3)} / {fmt(entry.get('median_ratio_dpcompile_first'), 3)} | "
                f"{fmt(entry.get('median_with_grad_ratio'), 3)} | {fmt(entry.get('median_training_step_ratio'), 3)} | "
                f"{fmt(entry.get('median_training_step_cpu_ratio'), 3)} | {entry.get('target', '')} |"
            )
        out.append("")
    out += before_after_section(after, before, spmd, spmd_before)
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
    if write_readme_figures(readme_figures(after, spmd, load("pipeline"))):
        print(f"wrote {ROOT / 'README.md'} (its Benchmarks figures)")


def _before_commit(before: dict | None) -> str:
    """The commit the "before" files were measured on (recorded by bench_overhead.py)."""
    return (before or {}).get("dpcompile") or "the code before"


def _spmd(result: dict | None, key: str, field: str = "median_ratio") -> float | None:
    return ((result or {}).get("across_runs", {}).get(key) or {}).get(field)


def _get(result: dict | None, *path: str) -> float | None:
    for part in path:
        if not isinstance(result, dict):
            return None
        result = result.get(part)
    return result if isinstance(result, (int, float)) else None


def before_after_section(after: dict | None, before: dict | None, spmd: dict | None, spmd_before: dict | None) -> list[str]:
    """One table, before -> after, of the four run-time benchmarks' headline ratios."""
    pipeline, pipeline_before = load("pipeline"), load("pipeline_base")
    tp, tp_before = load("tensor_parallel"), load("tensor_parallel_base")
    rows = [
        ("`bench_overhead.py`", "small MLP, 2 virtual devices, no_grad: / hand split", _small(before, "2dev_nograd"), _small(after, "2dev_nograd"), "≤ 1.10"),
        ("`bench_overhead.py`", "small MLP, 4 virtual devices, no_grad: / hand split", _small(before, "4dev_nograd"), _small(after, "4dev_nograd"), "≤ 1.10"),
        ("`bench_overhead.py`", "small MLP, 2 virtual devices, forward+backward: / hand split", _small(before, "2dev_grad"), _small(after, "2dev_grad"), "≤ 1.10"),
        ("`bench_spmd.py`", "TP d=1024 over 2 gloo processes, no_grad: / `parallelize_module`", _spmd(spmd_before, "tp"), _spmd(spmd, "tp"), "≤ 1.0"),
        ("`bench_spmd.py`", "TP d=1024, forward with grad: / `parallelize_module`", _spmd(spmd_before, "tp", "median_with_grad_ratio"),
         _spmd(spmd, "tp", "median_with_grad_ratio"), "≤ 1.0"),
        ("`bench_spmd.py`", "TP d=1024, training step: / `parallelize_module`", _spmd(spmd_before, "tp", "median_training_step_ratio"),
         _spmd(spmd, "tp", "median_training_step_ratio"), "≤ 1.0"),
        ("`bench_spmd.py`", "TP d=128, no_grad: / `parallelize_module`", _spmd(spmd_before, "tp_small"), _spmd(spmd, "tp_small"), "≤ 0.8"),
        ("`bench_pipeline.py --mesh`", "4 virtual stages, training step: / the tutorial's loop", _get(pipeline_before, "ratio"), _get(pipeline, "ratio"), "≤ 1.05"),
        ("`bench_pipeline.py --mesh`", "2-process mesh, training step: / `torch.distributed.pipelining` by hand",
         _get(pipeline_before, "mesh_ratio"), _get(pipeline, "mesh_ratio"), "≤ 1.05"),
        ("`bench_tensor_parallel.py`", "TP d=1024 on 2 virtual devices, forward: / eager (medians)",
         _get(tp_before, "ratios", "dpcompile_over_eager"), _get(tp, "ratios", "dpcompile_over_eager"), "—"),
    ]
    if not any(b is not None for _, _, b, _, _ in rows):
        return []
    out = [
        "## Before and after the last performance round",
        "",
        f"Each script's headline ratio, \"before\" measured on {_before_commit(before)} (files `benchmarks/results/*_base.json`),",
        "\"after\" on the code of this page (`benchmarks/results/*.json`), both with the commands above and",
        "`python benchmarks/bench_pipeline.py --mesh`, `python benchmarks/bench_tensor_parallel.py`. The pipeline and",
        "one-process tensor-parallel scripts time sides in alternation but take medians, not paired ratios, so on",
        "this shared box their figures move by more than the other two.",
    ]
    loads = [(label, (r or {}).get("load_average")) for label, r in (("before", tp_before), ("after", tp))]
    if all(load for _, load in loads):
        out.append("The box's load averages (1, 5, 15 min) as `bench_tensor_parallel.py` ended, the last of the four: "
                   + "; ".join(f"{label} {', '.join(f'{v:.1f}' for v in load)}" for label, load in loads)
                   + " (two cores): ratios of a few percent are within the noise of such runs.")
    out += [
        "",
        "| script | ratio | before | after | target |",
        "|---|---|---|---|---|",
    ]
    out += [f"| {script} | {what} | {fmt(b, 3)} | {fmt(a, 3)} | {t} |" for script, what, b, a, t in rows]
    return [*out, ""]


def readme_figures(after: dict | None, spmd: dict | None, pipeline: dict | None) -> str | None:
    """The figures paragraph of README.md's Benchmarks section, from the results."""
    if not after or not spmd:
        return None

    def span(values: list[float | None]) -> str:
        shown = sorted(f"{v:.2f}" for v in values if v is not None)
        return "—" if not shown else shown[0] if shown[0] == shown[-1] else f"{shown[0]}–{shown[-1]}"

    compile_speedups = [(after.get("compile", {}).get(k) or {}).get("speedup") for k in ("nograd", "grad")]
    text = (
        "Scripts in `benchmarks/` measure ratios against a baseline in the same run. Against the same\n"
        f"per-device work written by hand, a data-parallel step of a large MLP costs {fmt(_large(after, 'ratio'))} (forward and\n"
        f"backward), a small one {span([_small(after, '2dev_grad'), _small(after, '4dev_grad')])}× "
        f"({span([_small(after, '2dev_nograd'), _small(after, '4dev_nograd')])}× without grad: Python call overhead);\n"
        f"`copy_replicas=True` keeps its replicas between steps ({fmt(_large(after, 'copy_replicas_over_virtual'))} the virtual path);\n"
        f"`torch.compile(pm)` runs {span(compile_speedups)}× faster with no graph break; SPMD tensor parallel runs at\n"
        f"{fmt(_spmd(spmd, 'tp'))} (d=1024) and {fmt(_spmd(spmd, 'tp_small'))} (d=128) DTensor's `parallelize_module`"
    )
    if (step := _spmd(spmd, "tp", "median_training_step_ratio")) is not None:
        text += f" (a d=1024 training step: {fmt(step)})"
    if pipeline and pipeline.get("ratio") is not None:
        text += (f"; a pipeline step costs\n{fmt(pipeline['ratio'])} the tutorial's loop on virtual devices and "
                 f"{fmt(pipeline.get('mesh_ratio'))} `torch.distributed.pipelining`\nby hand over a mesh")
    return textwrap.fill((text + ".").replace("\n", " "), width=104, break_on_hyphens=False, break_long_words=False)


README_START, README_END = "<!-- benchmarks:start (python benchmarks/make_report.py) -->", "<!-- benchmarks:end -->"


def write_readme_figures(text: str | None) -> bool:
    """Put ``text`` between README.md's markers (nothing is written where the markers are missing)."""
    readme = ROOT / "README.md"
    page = readme.read_text()
    if text is None or README_START not in page or README_END not in page:
        return False
    head, rest = page.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(f"{head}{README_START}\n{text}\n{README_END}{tail}")
    return True


if __name__ == "__main__":
    main()
