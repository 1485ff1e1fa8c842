"""Does the planner rank layouts as they run? Predicted against measured step time over gloo.

For 5 models (an MLP stack, GPT-2, Llama, BERT, ViT; tiny random-weight configurations) the planner's
candidate table for a mesh of ``--world`` gloo processes on this machine (the layouts built over a
``DeviceMesh``: data parallel, tensor parallel, pipelines with GPipe / 1F1B and 1-8 micro-batches;
predicted with the mesh's calibrated constants), the 8 fastest predicted that fit, each then built
with ``transform(model, mesh, **keywords)`` and timed over a few training steps (forward, backward)
in spawned gloo processes. Candidates are interleaved within each repeat and the median of the
repeats is kept (the machine is shared). Spearman's rank correlation of predicted against measured,
per model and over all rows (each model's times divided by its median first, so the pooled rank
compares layouts rather than models).

    PYTHONPATH=. nice -n 5 python benchmarks/bench_planner_rank.py [--world 2] [--repeats 8] [--steps 1] [--only gpt2]
    PYTHONPATH=. python benchmarks/bench_planner_rank.py --decoder   # planning a 32-layer decoder, timed

Writes ``benchmarks/results/planner_rank.json`` (``--only`` and ``--decoder`` merge into it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.thirdparty import define_torchvision_ops  # noqa: E402

define_torchvision_ops()  # transformers imports torchvision, which needs its ops defined
warnings.simplefilter("ignore")

from common import ResidualStack, spawn_ranks, uptime  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "planner_rank.json"
V = 128
TOP = 8


def _tokens(kind: str, b: int = 8, seq: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, V, (b, seq), generator=g)
    kw = {"input_ids": ids}
    kw["labels"] = torch.randint(0, 2, (b,), generator=g) if kind == "cls" else ids.clone()
    return kw


def build(name: str) -> tuple[nn.Module, tuple, dict]:
    """``(model, args, kwargs)``: one training batch of 8; the same on every rank (seeded)."""
    torch.manual_seed(0)
    if name == "mlp_stack":
        g = torch.Generator().manual_seed(1)
        return ResidualStack(8, 256), (torch.randn(8, 64, 16, generator=g), torch.randn(8, 64, 8, generator=g)), {}
    import transformers as T

    T.logging.set_verbosity_error()
    small = {"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 512}
    drop = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    if name == "gpt2":
        cfg = T.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=V, n_positions=64, resid_pdrop=0, embd_pdrop=0,
                           attn_pdrop=0, use_cache=False)  # fmt: skip
        return T.GPT2LMHeadModel(cfg), (), _tokens("lm")
    if name == "llama":
        cfg = T.LlamaConfig(**small, num_key_value_heads=2, use_cache=False, vocab_size=V, max_position_embeddings=64)
        return T.LlamaForCausalLM(cfg), (), _tokens("lm")
    if name == "bert":
        cfg = T.BertConfig(**small, **drop, vocab_size=V, max_position_embeddings=64)
        return T.BertForSequenceClassification(cfg), (), _tokens("cls")
    if name == "vit":
        cfg = T.ViTConfig(**small, **drop, image_size=32, patch_size=4, num_labels=3)
        g = torch.Generator().manual_seed(1)
        kw = {"pixel_values": torch.randn(8, 3, 32, 32, generator=g), "labels": torch.randint(0, 3, (8,), generator=g)}
        return T.ViTForImageClassification(cfg), (), kw
    raise KeyError(name)


MODELS = ["mlp_stack", "gpt2", "llama", "bert", "vit"]


# ------------------------------------------------------------------------------------ one rank
def _loss_of(out: Any) -> torch.Tensor | None:
    if out is None:
        return None
    if isinstance(out, torch.Tensor):
        return out
    return getattr(out, "loss", None) if not isinstance(out, dict) else out.get("loss")


def _program(model: nn.Module, args: tuple, kwargs: dict, keywords: dict, world: int) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    role = "pp" if keywords.get("pipeline") else "tp" if keywords.get("tensor_parallel") else "dp"
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(role,))
    options = {k: v for k, v in keywords.items() if k != "activation_checkpointing" or v}
    if options.get("pipeline"):
        options["pipeline"] = world
    pm = dpcompile.transform(model, mesh, example_inputs=args or None, example_kwargs=kwargs or None, **options)
    return pm, mesh


def _step(pm: Any, mesh: Any, args: tuple, kwargs: dict, pipelined: bool) -> None:
    from dpcompile.mesh import local_batch

    a, kw = local_batch((args, kwargs), mesh)
    out = pm(*a, **kw)
    if not pipelined:
        _loss_of(out).backward()
    for p in pm.parameters():
        p.grad = None


def rank_main(rank: int, world: int, port: int, name: str, keywords: list[dict], repeats: int, steps: int,
              results: Any) -> None:  # fmt: skip
    """Build every candidate, then ``repeats`` rounds over them (interleaved, each round starting one
    candidate later): ``steps`` timed steps each, between barriers. Puts ``(rank, {"seconds": [[per repeat] per candidate], "errors": [...]})``."""
    from datetime import timedelta

    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    report: dict[str, Any] = {"seconds": [[] for _ in keywords], "errors": [None] * len(keywords)}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))  # fmt: skip
        model, args, kwargs = build(name)
        if kwargs:
            from dpcompile.capture import capture_model

            model, _ = capture_model(model, frontend="export", example_kwargs=kwargs)
        programs: list[Any] = []
        for i, kw in enumerate(keywords):
            try:
                import copy

                pm, mesh = _program(copy.deepcopy(model), args, kwargs, kw, world)
                _step(pm, mesh, args, kwargs, bool(kw.get("pipeline")))  # warm up
                programs.append((pm, mesh, bool(kw.get("pipeline"))))
            except Exception:  # noqa: BLE001 - reported, the others still run
                report["errors"][i] = traceback.format_exc(limit=3)[-1500:]
                programs.append(None)
            ok = torch.tensor([0.0 if programs[-1] is None else 1.0])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank skips a candidate one rank could not build
            if ok.item() == 0.0:
                programs[-1] = None
        for r in range(repeats):
            order = list(range(len(programs)))
            order = order[r % len(order):] + order[:r % len(order)]  # each candidate in turn first: no place favoured
            for i in order:
                program = programs[i]
                if program is None:
                    continue
                pm, mesh, pipelined = program
                dist.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    _step(pm, mesh, args, kwargs, pipelined)
                dist.barrier()
                report["seconds"][i].append((time.perf_counter() - start) / steps)
    except Exception:  # noqa: BLE001
        report["fatal"] = traceback.format_exc()[-3000:]
    results.put((rank, report))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def measure(name: str, keywords: list[dict], world: int, repeats: int, steps: int, timeout: float) -> dict:
    reports = spawn_ranks(rank_main, world, name, keywords, repeats, steps, timeout=timeout)
    if 0 not in reports:
        return {"fatal": f"rank 0 did not report within {timeout:.0f} s"}
    return reports[0]


# ------------------------------------------------------------------------------------ planning
def plan(name: str, world: int) -> tuple[list[Any], Any, float]:
    """The candidates over a gloo mesh of ``world`` processes, fitting ones fastest first."""
    from dpcompile.planner import plan_mesh_layouts

    model, args, kwargs = build(name)
    labels = [f"rank{r}" for r in range(world)]
    start = time.perf_counter()
    planned = plan_mesh_layouts(model, labels, dict.fromkeys(labels, 1 << 50), optimizer="sgd", training=True,
                                example_inputs=args, example_kwargs=kwargs)  # fmt: skip
    return planned.fitting, planned.calibration, time.perf_counter() - start


def spearman(xs: list[float], ys: list[float]) -> float | None:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    if len(xs) < 3:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else None


def decoder_planning_seconds(layers: int = 32) -> dict[str, float]:
    """Seconds planning a ``layers``-layer Llama decoder (tiny width) takes: over 8 devices in one
    process (``plan_layouts``, as ``bench_planner.py`` times it) and over a mesh of 8 processes
    (``plan_mesh_layouts``, its calibration cached beforehand)."""
    import transformers as T

    from dpcompile.analysis.calibration import calibrate_mesh
    from dpcompile.planner import plan_layouts, plan_mesh_layouts

    cfg = T.LlamaConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, use_cache=False, vocab_size=V, max_position_embeddings=64)  # fmt: skip
    model, kwargs = T.LlamaForCausalLM(cfg), _tokens("lm", b=8, seq=32)
    labels = [f"cpu#{i}" for i in range(8)]
    budgets = dict.fromkeys(labels, 1 << 30)
    calibrate_mesh(8)
    out = {}
    for name, plan in (("one_process", plan_layouts), ("mesh", plan_mesh_layouts)):
        extra = {"device": torch.device("cpu")} if plan is plan_layouts else {}
        start = time.perf_counter()
        planned = plan(model, labels, budgets, optimizer="adamw", training=True, example_inputs=(),
                       example_kwargs=kwargs, **extra)  # fmt: skip
        out[name] = time.perf_counter() - start
        print(f"planning a {layers}-layer decoder over 8 ({name}): {len(planned.candidates)} layouts in {out[name]:.2f} s")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", default="")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--cached-calibration", action="store_true", help="plan with the cached calibration")
    parser.add_argument("--decoder", action="store_true", help="only time planning a 32-layer decoder (merged)")
    ns = parser.parse_args()
    if ns.decoder:
        data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        data["decoder32_planning_s"] = {**decoder_planning_seconds(), "uptime": uptime()}
        RESULTS.write_text(json.dumps(data, indent=1, default=str))
        return
    names = [n for n in MODELS if not ns.only or n in ns.only.split(",")]
    previous = json.loads(RESULTS.read_text()) if ns.only and RESULTS.exists() else {}
    rows_by_model: dict[str, Any] = dict(previous.get("models", {}))
    if not ns.cached_calibration:  # measured now, the machine's load as it is for this run; planning reads it back
        from dpcompile.analysis.calibration import calibrate_mesh

        os.environ["DPCOMPILE_CALIBRATION"] = "fresh"
        calibrate_mesh(ns.world)
        del os.environ["DPCOMPILE_CALIBRATION"]
    calibration = None
    for name in names:
        fitting, calibration, planning_s = plan(name, ns.world)
        top = fitting[:TOP]
        t0 = time.perf_counter()
        report = measure(name, [c.keywords() for c in top], ns.world, ns.repeats, ns.steps, ns.timeout)
        rows = []
        for i, c in enumerate(top):
            seconds = report.get("seconds", [[]] * len(top))[i]
            rows.append({"layout": c.spec.name, "keywords": c.keywords(), "predicted_s": c.step_time,
                         "measured_s": statistics.median(seconds) if seconds else None,
                         "measured_min_s": min(seconds) if seconds else None, "repeats_s": seconds,
                         "error": (report.get("errors") or [None] * len(top))[i]})  # fmt: skip
        done = [r for r in rows if r["measured_s"] is not None]
        rho = spearman([r["predicted_s"] for r in done], [r["measured_s"] for r in done])
        rho_min = spearman([r["predicted_s"] for r in done], [r["measured_min_s"] for r in done])
        rows_by_model[name] = {"rho": rho, "rho_of_min": rho_min, "rows": rows, "planning_s": planning_s, "fatal": report.get("fatal"),
                               "measure_wall_s": time.perf_counter() - t0, "calibration": calibration.__dict__,
                               "uptime_after": uptime()}  # fmt: skip
        print(f"{name}: rho={rho} (of the fastest repeats: {rho_min}; {len(done)}/{len(rows)} measured, "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
        for r in rows:
            measured = f"{r['measured_s'] * 1e3:8.2f}" if r["measured_s"] else "       -"
            print(f"  {r['layout']:28s} predicted {r['predicted_s'] * 1e3:8.2f} ms  measured {measured} ms"
                  + (f"  {r['error'].splitlines()[-1]}" if r["error"] else ""), flush=True)  # fmt: skip
        if report.get("fatal"):
            print(report["fatal"], flush=True)
    pooled_p, pooled_m = [], []
    for entry in rows_by_model.values():
        done = [r for r in entry["rows"] if r["measured_s"] is not None]
        if len(done) < 2:
            continue
        mp_, mm = statistics.median(r["predicted_s"] for r in done), statistics.median(r["measured_s"] for r in done)
        pooled_p += [r["predicted_s"] / mp_ for r in done]
        pooled_m += [r["measured_s"] / mm for r in done]
    per_model = {k: v["rho"] for k, v in rows_by_model.items()}
    summary = {"per_model_rho": per_model, "pooled_rho": spearman(pooled_p, pooled_m),
               "per_model_rho_of_min": {k: v.get("rho_of_min") for k, v in rows_by_model.items()},
               "min_rho": min((v for v in per_model.values() if v is not None), default=None)}  # fmt: skip
    print(json.dumps(summary, indent=1))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "command": f"PYTHONPATH=. nice -n {os.nice(0)} python benchmarks/bench_planner_rank.py " + " ".join(sys.argv[1:]),
        "world": ns.world, "repeats": ns.repeats, "steps": ns.steps, "cores": os.cpu_count(),
        "uptime": uptime(),
        "calibration": None if calibration is None else calibration.__dict__,
        "summary": summary, "models": rows_by_model,
        **({"decoder32_planning_s": previous["decoder32_planning_s"]} if "decoder32_planning_s" in previous else {}),
    }, indent=1, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
