"""A one-shot check on a machine with CUDA GPUs: does what runs on virtual CPU devices hold there?

    python benchmarks/gpu_check.py [--out benchmarks/results/gpu_check.json] [--cpu-smoke]

Finishes within 5 minutes on one or more GPUs (with one GPU, data parallelism runs on virtual
devices ``["cuda:0"] * 2``), downloads nothing, and writes JSON with one entry per section:

* ``dp_training_step``: forward, backward and SGD step of an MLP (1024 -> 4096 -> 1024) under
  ``dpcompile.transform(model, devices)`` against ``nn.DataParallel`` and against the eager model
  (whole batch on ``cuda:0``), timed in alternation; parameters compared with eager after the
  timed steps; also ``copy_replicas=True`` (persistent replicas, the distinct-GPU code path).
* ``rnn``: a 2-layer LSTM tagger under data parallelism, forward and backward: counts of the
  "not part of single contiguous chunk of memory" warning and of cuDNN weight re-flattens
  (``torch._cudnn_rnn_flatten_weight`` calls) after the first step; both must be 0.
* ``tp_forward``: tensor-parallel forward of the MLP against eager, outputs compared.
* ``explain_fake_8gpu``: the data-parallel program built for 8 fake GPUs, run forward and
  backward on fake tensors (``dpcompile.verify.check_layout``) and explained.
* ``exact_random``: random ops draw the single-device values on ``[cuda:0] * 2`` (dp, tp, gpipe): an
  MLP with dropout (float64, float32) and a hand-written GPT block with SDPA dropout (float32, the
  memory-efficient kernel's mask): 2 training steps' losses and gradients against eager from the
  same seeds, the CUDA generator's state after each, and exact against ``exact_random=False`` timed.

Each section records its own error instead of stopping the others; the exit status is 1 when
any section failed or a check did not hold. Without CUDA it prints why, writes
``{"skipped": true, ...}`` and exits 0. ``--cpu-smoke`` runs every section on virtual CPU
devices with small sizes (the code paths, not the figures) and writes nothing unless --out.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_check.json"
CHUNK_WARNING = "not part of single contiguous chunk of memory"


class MLP(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Tagger(nn.Module):
    def __init__(self, d: int, h: int, classes: int = 16):
        super().__init__()
        self.lstm = nn.LSTM(d, h, num_layers=2, batch_first=True)
        self.out = nn.Linear(h, classes)

    def forward(self, x):
        self.lstm.flatten_parameters()
        h, _ = self.lstm(x)
        return self.out(h)


class Config:
    def __init__(self, smoke: bool):
        self.smoke = smoke
        cuda = not smoke
        n = torch.cuda.device_count() if cuda else 0
        if cuda and n >= 2:
            self.devices = [f"cuda:{k}" for k in range(min(n, 4))]
        elif cuda:
            self.devices = ["cuda:0", "cuda:0"]
        else:
            self.devices = ["cpu", "cpu"]
        self.device = torch.device(self.devices[0])
        self.dp_ids = list(range(min(n, 4))) if cuda else None  # nn.DataParallel: the distinct GPUs
        self.d, self.h, self.batch = (1024, 4096, 256) if not smoke else (32, 64, 8)
        self.rnn = (256, 512, 64, 50) if not smoke else (8, 16, 4, 5)  # input, hidden, batch, steps
        self.rounds, self.iters = (15, 5) if not smoke else (2, 1)


def sync(cfg: Config) -> None:
    if cfg.device.type == "cuda":
        torch.cuda.synchronize()


def interleaved(cfg: Config, sides: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Median seconds per iteration of each side, alternating order every round, with the
    median of the per-round ratios of every side to the first."""
    for fn in sides.values():
        for _ in range(2):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(cfg.rounds):
        for name in list(sides) if r % 2 == 0 else list(reversed(sides)):
            sync(cfg)
            start = time.perf_counter()
            for _ in range(cfg.iters):
                sides[name]()
            sync(cfg)
            samples[name].append((time.perf_counter() - start) / cfg.iters)
    first = next(iter(sides))
    out: dict[str, Any] = {f"{name}_s": statistics.median(v) for name, v in samples.items()}
    for name in list(sides)[1:]:
        out[f"{first}_over_{name}"] = statistics.median(a / b for a, b in zip(samples[first], samples[name]))
    return out


def dp_training_step(cfg: Config) -> dict[str, Any]:
    import dpcompile

    torch.manual_seed(0)
    base = MLP(cfg.d, cfg.h)
    models = {name: copy.deepcopy(base).to(cfg.device) for name in ("dpcompile", "copy_replicas", "data_parallel", "eager")}
    runners: dict[str, nn.Module] = {
        "dpcompile": dpcompile.transform(models["dpcompile"], cfg.devices),
        "copy_replicas": dpcompile.transform(models["copy_replicas"], cfg.devices, copy_replicas=True),
        "data_parallel": nn.DataParallel(models["data_parallel"], device_ids=cfg.dp_ids),
        "eager": models["eager"],
    }
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(cfg.batch, cfg.d, generator=g).to(cfg.device)
    y = torch.randn(cfg.batch, cfg.d, generator=g).to(cfg.device)

    def step(name: str) -> Callable[[], None]:
        module, opt = runners[name], optimizers[name]

        def run():
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(module(x), y).backward()
            opt.step()

        return run

    result = interleaved(cfg, {name: step(name) for name in ("dpcompile", "data_parallel", "eager", "copy_replicas")})
    # every side ran the same number of steps on the same data from the same start
    ref = dict(models["eager"].named_parameters())
    for name in ("dpcompile", "copy_replicas", "data_parallel"):
        with torch.no_grad():
            diffs = [float((p - ref[k]).abs().max()) for k, p in models[name].named_parameters()]
        result[f"{name}_max_param_diff_vs_eager"] = max(diffs)
    result["copy_replicas_over_dpcompile"] = result["copy_replicas_s"] / result["dpcompile_s"]
    result["checks"] = {
        "parameters_match_eager": result["dpcompile_max_param_diff_vs_eager"] < 1e-3
        and result["copy_replicas_max_param_diff_vs_eager"] < 1e-3,
    }
    result.update(model=f"MLP {cfg.d}->{cfg.h}->{cfg.d}, batch {cfg.batch}, SGD", devices=cfg.devices,
                  data_parallel_device_ids=cfg.dp_ids)
    return result


def _count_flattens() -> tuple[list[int], Callable[[], None]]:
    """Count calls of cuDNN's weight flattening (a copy of every weight) until undone."""
    count = [0]
    original = getattr(torch, "_cudnn_rnn_flatten_weight", None)
    if original is None:
        return count, lambda: None

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    torch._cudnn_rnn_flatten_weight = counting

    def undo():
        torch._cudnn_rnn_flatten_weight = original

    return count, undo


def rnn(cfg: Config) -> dict[str, Any]:
    import dpcompile

    d, h, batch, steps = cfg.rnn
    out: dict[str, Any] = {"model": f"2-layer LSTM {d}->{h}, batch {batch}, {steps} steps, fwd+bwd", "devices": cfg.devices}
    ok = True
    for copy_replicas in (False, True):
        torch.manual_seed(0)
        model = Tagger(d, h).to(cfg.device)
        eager = copy.deepcopy(model)
        pm = dpcompile.transform(model, cfg.devices, copy_replicas=copy_replicas)
        x = torch.randn(batch, steps, d, device=cfg.device)
        warn_always = torch.is_warn_always_enabled()
        torch.set_warn_always(True)  # C++ warnings that fire once per process fire every time
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                pm(x).sum().backward()  # the first step may flatten once; what follows must not
                count, undo = _count_flattens()
                try:
                    for _ in range(3):
                        model.zero_grad(set_to_none=True)
                        pm(x).sum().backward()
                        sync(cfg)
                finally:
                    undo()
        finally:
            torch.set_warn_always(warn_always)
        eager(x).sum().backward()
        # two half batches against one whole batch through 50 float32 steps (TF32 on by default):
        # each gradient's largest error against its largest entry (3.4e-5 on an H200)
        grad_error = max(
            float((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30))
            for p, q in zip(model.parameters(), eager.parameters())
        )
        grads_equal = grad_error <= 1e-4
        chunk_warnings = sum(CHUNK_WARNING in str(w.message) for w in caught)
        key = "copy_replicas" if copy_replicas else "default"
        out[key] = {
            "chunk_warnings": chunk_warnings,
            "reflatten_copies": count[0],
            "gradients_match_eager": grads_equal,
            "gradient_error": grad_error,
            "other_warnings": sorted({str(w.message).splitlines()[0][:160] for w in caught} - {""})[:5],
        }
        ok = ok and chunk_warnings == 0 and count[0] == 0 and grads_equal
    out["checks"] = {"no_chunk_warning_no_reflatten_grads_equal": ok}
    return out


def tp_forward(cfg: Config) -> dict[str, Any]:
    import dpcompile

    torch.manual_seed(0)
    model = MLP(cfg.d, cfg.h).to(cfg.device)
    x = torch.randn(cfg.batch, cfg.d, device=cfg.device)
    pm = dpcompile.transform(model, cfg.devices, tensor_parallel=True)

    def forward(module):
        def run():
            with torch.no_grad():
                module(x)

        return run

    result = interleaved(cfg, {"dpcompile_tp": forward(pm), "eager": forward(model)})
    with torch.no_grad():
        same = torch.allclose(pm(x), model(x), rtol=1e-3, atol=1e-4)
    result.update(plan=dict(getattr(pm, "plan", {})), devices=cfg.devices, checks={"outputs_match_eager": bool(same)},
                  model=f"MLP {cfg.d}->{cfg.h}->{cfg.d}, batch {cfg.batch}, no_grad")
    return result


def _fake_program(model: nn.Module, devices: Any) -> nn.Module:
    """The data-parallel program of ``model`` (fake tensors) for ``devices`` that need not exist."""
    from dpcompile.recipes import DataParallelRecipe

    return DataParallelRecipe(devices=devices, output_device=devices.primary, copy_replicas=False).compile(model, None)


def explain_fake_8gpu(cfg: Config) -> dict[str, Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    import dpcompile
    from dpcompile.fake import fake_copy, fake_devices
    from dpcompile.verify import check_layout

    torch.manual_seed(0)
    model = MLP(cfg.d, cfg.h)
    x = torch.randn(cfg.batch, cfg.d)
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    layout = check_layout(pm, model, 8, x)  # builds the 8-GPU program on fake tensors, fwd + bwd
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_model = fake_copy(model, mode, torch.device("cuda:0"))
    devices = fake_devices(8)
    program = _fake_program(fake_model, devices)
    with mode, torch.no_grad():  # shapes and placement need no autograd (a CPU-only build cannot make fake CUDA grads)
        report = dpcompile.explain(program, torch.empty(cfg.batch, cfg.d, device="cuda:0"))
    summary = report.to_dict()
    return {
        "layout_ok": bool(layout),
        "layout": str(layout)[:2000],
        "param_bytes": summary.get("param_bytes"),
        "comm_elements_forward": summary.get("comm_elements_forward"),
        "comm_elements_backward": summary.get("comm_elements_backward"),
        "checks": {"layout_ok": bool(layout), "eight_devices": len(summary.get("param_bytes") or {}) == 8},
    }


class TinyGPT(nn.Module):
    """A GPT-style block written by hand (transformers does not import on every GPU image): embedding
    dropout, causal SDPA with ``dropout_p``, residual dropouts, an LM head."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, p: float = 0.1):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.proj = (nn.Linear(d, d) for _ in range(4))
        self.fc, self.out, self.head = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Linear(d, vocab)
        self.drop = nn.Dropout(p)
        self.heads, self.p = heads, p

    def forward(self, ids, labels):
        h = self.drop(self.emb(ids))
        b, t, d = h.shape
        x = self.ln1(h)
        q, k, v = (f(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.p, is_causal=True)
        h = h + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        h = h + self.drop(self.out(nn.functional.gelu(self.fc(self.ln2(h)))))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class DropoutMLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.25)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.fc2(self.drop(torch.relu(self.fc1(x)))), y)


def _generator_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _exact_random_case(cfg: Config, make: Callable[[], nn.Module], inputs: tuple, layout: dict) -> dict[str, Any]:
    """One model on one layout of ``["cuda:0"] * 2``: 2 training steps against eager from the same
    seeds (loss, gradients, the generator state after), then exact against per-device draws, timed."""
    import dpcompile

    devices = [cfg.devices[0]] * 2
    torch.manual_seed(0)
    model = make().to(cfg.device).train()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = dpcompile.transform(model, devices, example_inputs=inputs, **layout)
        out: dict[str, Any] = {"max_loss_diff": 0.0, "max_grad_diff": 0.0, "generator_equal": True}
        for step in range(2):
            for module in (model, reference):
                module.zero_grad(set_to_none=True)
            torch.manual_seed(10 + step)
            pm(*inputs).backward()
            state = _generator_state(cfg.device)
            torch.manual_seed(10 + step)
            loss = reference(*inputs)
            loss.backward()
            out["generator_equal"] &= bool(torch.equal(state, _generator_state(cfg.device)))
            torch.manual_seed(10 + step)
            got = pm(*inputs).detach()
            out["max_loss_diff"] = max(out["max_loss_diff"], float((got - loss.detach()).abs()))
        grads = {k: p.grad for k, p in pm.named_parameters() if p.grad is not None}
        if getattr(pm, "param_shards", None):
            out["max_grad_diff"] = None  # sharded parameters (tp): the loss and the generator say it
        else:
            out["max_grad_diff"] = max((float((grads[k] - p.grad).abs().max()) for k, p in reference.named_parameters()
                                        if k in grads and p.grad is not None), default=0.0)  # fmt: skip
        per_device = dpcompile.transform(copy.deepcopy(model), devices, example_inputs=inputs, exact_random=False,
                                         **layout)  # fmt: skip

        def step(program):
            def run():
                program(*inputs).backward()

            return run

        times = interleaved(cfg, {"exact": step(pm), "per_device": step(per_device)})
    out.update(times)
    out["warnings"] = sorted({str(w.message)[:200] for w in caught if "dpcompile" in str(w.message)})[:3]
    return out


def exact_random(cfg: Config) -> dict[str, Any]:
    """Random ops draw the single-device values on ``[device] * 2`` (dp, tp, gpipe): an MLP with dropout
    (float64 and float32) and a tiny GPT block (SDPA with dropout, float32: the memory-efficient
    kernel's mask on CUDA), each check on its own."""
    g = torch.Generator().manual_seed(0)
    d = cfg.d if cfg.smoke else 256
    x, y = (torch.randn(16, d, generator=g).to(cfg.device) for _ in range(2))
    ids = torch.randint(0, 64, (8, 16), generator=g).to(cfg.device)
    labels = torch.randint(0, 64, (8, 16), generator=g).to(cfg.device)
    layouts = {"dp": {}, "tp": {"tensor_parallel": True}, "gpipe": {"mesh": {"pp": 2}, "micro_batches": 2}}
    cases = {
        "mlp_float64": (lambda: DropoutMLP(d).double(), (x.double(), y.double())),
        "mlp_float32": (lambda: DropoutMLP(d), (x, y)),
        "gpt_sdpa_float32": (TinyGPT, (ids, labels)),
    }
    out: dict[str, Any] = {"devices": [cfg.devices[0]] * 2}
    checks: dict[str, bool] = {}
    smoke = {"mlp_float32_dp", "gpt_sdpa_float32_tp", "gpt_sdpa_float32_gpipe"}  # the code paths, quickly
    for name, (make, inputs) in cases.items():
        for label, layout in layouts.items():
            key = f"{name}_{label}"
            if cfg.smoke and key not in smoke:
                continue
            try:
                entry = _exact_random_case(cfg, make, inputs, layout)
                tolerance = 1e-9 if "float64" in name else 1e-4
                grad_ok = entry["max_grad_diff"] is None or entry["max_grad_diff"] <= 10 * tolerance
                checks[key] = entry["generator_equal"] and entry["max_loss_diff"] <= tolerance and grad_ok
            except Exception as e:  # noqa: BLE001 - record it, run the other cases
                entry = {"error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc()[-1500:]}
                checks[key] = False
            out[key] = entry
    out["checks"] = checks
    return out


SECTIONS: dict[str, Callable[[Config], dict[str, Any]]] = {
    "dp_training_step": dp_training_step,
    "rnn": rnn,
    "tp_forward": tp_forward,
    "explain_fake_8gpu": explain_fake_8gpu,
    "exact_random": exact_random,
}


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(k) for k in range(torch.cuda.device_count())]
        info["cudnn"] = torch.backends.cudnn.version()
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help=f"JSON path (default {RESULTS}; --cpu-smoke: none)")
    parser.add_argument("--cpu-smoke", action="store_true", help="run every section on virtual CPU devices, small")
    parser.add_argument("--only", choices=list(SECTIONS), action="append", help="run only these sections")
    args = parser.parse_args(argv)
    out_path = args.out if args.out is not None or args.cpu_smoke else RESULTS
    started = time.perf_counter()
    result: dict[str, Any] = {"script": "benchmarks/gpu_check.py", "machine": machine()}
    if not args.cpu_smoke and not torch.cuda.is_available():
        reason = f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda})"
        print(f"gpu_check: skipped: {reason}")
        result.update(skipped=True, reason=reason)
        if out_path is not None:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    cfg = Config(smoke=args.cpu_smoke)
    result.update(skipped=False, smoke=args.cpu_smoke, devices=cfg.devices, sections={})
    failed = []
    for name, section in SECTIONS.items():
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        try:
            entry = section(cfg)
            if not all((entry.get("checks") or {}).values()):
                failed.append(name)
        except Exception as e:  # noqa: BLE001 - record it, run the other sections
            entry = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            failed.append(name)
        entry["seconds"] = time.perf_counter() - t0
        result["sections"][name] = entry
        shown = {k: v for k, v in entry.items() if k not in ("traceback", "layout")}
        print(f"{name}: {json.dumps(shown, default=str)}", flush=True)
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
    result.update(failed=failed, seconds=time.perf_counter() - started)
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"wrote {out_path}")
    print(f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'all checks held'} in {result['seconds']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
