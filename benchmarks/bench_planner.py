"""The planner's predictions against what its choice then measures.

For each model (tiny random-weight configurations of transformers, torchvision and timm models, and
an MLP stack), three budgets per device: loose (data parallel fits with room), medium (between the
smallest predicted peak and data parallel's) and tight (5% above the smallest predicted peak; of those
that build, where the smallest does not). For
each: ``transform(..., memory_per_device=budget, optimizer="sgd", plan="auto")`` on virtual CPU
devices, then ``dpcompile.measure`` of one training step: the chosen layout, the predicted and the
measured peak bytes of each device (parameters held plus the peak allocated during the step; plain
SGD keeps no state, so the two count the same things), their error, and whether every device stayed
within the budget (a 1F1B pipeline is measured running its own 1F1B step). Also the seconds planning a 32-layer decoder takes (``plan_layouts`` alone).

    PYTHONPATH=. python benchmarks/bench_planner.py [--devices 2] [--only gpt2,bert]

Writes ``benchmarks/results/planner.json`` and prints the table and its summary; with ``--only`` the
rows of the models named replace theirs in the last results (the others kept).
"""

from __future__ import annotations

import argparse
import json
import re
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

define_torchvision_ops()
warnings.simplefilter("ignore")

from common import ResidualStack  # noqa: E402

import dpcompile  # noqa: E402
from dpcompile.analysis.calibration import calibrate  # noqa: E402
from dpcompile.analysis.memory import format_bytes  # noqa: E402
from dpcompile.devices import parse_devices  # noqa: E402
from dpcompile.planner import plan_layouts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "planner.json"
V = 128


def _tokens(kind: str, b: int = 8, seq: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, V, (b, seq), generator=g)
    kw = {"input_ids": ids, "attention_mask": torch.ones(b, seq, dtype=torch.long)}
    kw["labels"] = torch.randint(0, 2, (b,), generator=g) if kind == "cls" else ids.clone()
    return kw


def _hf(name: str) -> tuple[nn.Module, tuple, dict]:
    import transformers as T

    T.logging.set_verbosity_error()
    small = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
    drop = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    common = {"vocab_size": V, "max_position_embeddings": 32}
    if name == "gpt2":
        cfg = T.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=V, n_positions=32, resid_pdrop=0, embd_pdrop=0,
                           attn_pdrop=0, use_cache=False)  # fmt: skip
        return T.GPT2LMHeadModel(cfg), (), _tokens("lm")
    if name == "bert":
        return T.BertForSequenceClassification(T.BertConfig(**small, **drop, **common)), (), _tokens("cls")
    if name == "roberta":
        cfg = T.RobertaConfig(**small, **drop, **common, pad_token_id=1)
        return T.RobertaForSequenceClassification(cfg), (), _tokens("cls")
    if name == "distilbert":
        cfg = T.DistilBertConfig(n_layers=4, dim=64, n_heads=4, hidden_dim=128, dropout=0, attention_dropout=0,
                                 seq_classif_dropout=0, **common)  # fmt: skip
        return T.DistilBertForSequenceClassification(cfg), (), _tokens("cls")
    if name in ("llama", "mistral", "qwen2"):
        config = {"llama": T.LlamaConfig, "mistral": T.MistralConfig, "qwen2": T.Qwen2Config}[name]
        cfg = config(**small, num_key_value_heads=2, use_cache=False, **common)
        model = {"llama": T.LlamaForCausalLM, "mistral": T.MistralForCausalLM, "qwen2": T.Qwen2ForCausalLM}[name]
        return model(cfg), (), _tokens("lm")
    if name == "opt":
        cfg = T.OPTConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, ffn_dim=128, dropout=0,
                          attention_dropout=0, word_embed_proj_dim=64, use_cache=False, **common)  # fmt: skip
        return T.OPTForCausalLM(cfg), (), _tokens("lm")
    if name == "vit_hf":
        cfg = T.ViTConfig(**small, **drop, image_size=32, patch_size=8, num_labels=3)
        g = torch.Generator().manual_seed(0)
        kw = {"pixel_values": torch.randn(8, 3, 32, 32, generator=g), "labels": torch.randint(0, 3, (8,), generator=g)}
        return T.ViTForImageClassification(cfg), (), kw
    if name == "t5_encoder":
        cfg = T.T5Config(num_layers=4, d_model=64, d_kv=16, num_heads=4, d_ff=128, dropout_rate=0.0, vocab_size=V,
                         use_cache=False)  # fmt: skip
        return T.T5EncoderModel(cfg), (), {k: v for k, v in _tokens("lm").items() if k != "labels"}
    if name == "gpt_neox":
        cfg = T.GPTNeoXConfig(**small, hidden_dropout=0.0, attention_dropout=0.0, use_cache=False, **common)
        return T.GPTNeoXForCausalLM(cfg), (), _tokens("lm")
    raise KeyError(name)


def _vision(name: str) -> tuple[nn.Module, tuple, dict]:
    x = torch.randn(8, 3, 32, 32)
    if name.startswith("timm_"):
        import timm

        if name == "timm_vit_tiny":
            return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=4), (x,), {}
        if name == "timm_mixer":
            from timm.models.mlp_mixer import MlpMixer

            return MlpMixer(img_size=32, patch_size=8, num_blocks=4, embed_dim=64, num_classes=10), (x,), {}
        return timm.create_model(name[5:], pretrained=False, num_classes=10), (x,), {}
    import torchvision

    tvm = torchvision.models
    if name == "tv_vit":
        model = tvm.VisionTransformer(image_size=32, patch_size=8, num_layers=4, num_heads=2, hidden_dim=64, mlp_dim=128)
        return model, (x,), {}
    return getattr(tvm, name[3:])(weights=None, num_classes=10), (x,), {}


def _long_sequence_decoder() -> tuple[nn.Module, tuple, dict]:
    """Batch 1, 512 tokens: a causal decoder of Megatron's blocks, where context parallel and tensor
    parallel with sequence parallel are candidates (not in ``ORDER``: ``--only decoder_long``)."""
    from bench_sequence_parallel import Decoder

    return Decoder(d=64, heads=4, layers=4), (torch.randn(1, 512, 64),), {}


def _long_sequence_llama() -> tuple[nn.Module, tuple, dict]:
    """transformers' Llama (2 layers, width 32) with ``labels=``, batch 1, 384 tokens, no padding mask
    (not in ``ORDER``: ``--only llama_long``)."""
    import transformers as T

    T.logging.set_verbosity_error()
    cfg = T.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, use_cache=False, vocab_size=V, max_position_embeddings=512)  # fmt: skip
    kwargs = _tokens("lm", b=1, seq=384)
    del kwargs["attention_mask"]
    return T.LlamaForCausalLM(cfg), (), kwargs


MODELS = {
    "mlp_stack": lambda: (ResidualStack(), (torch.randn(8, 32, 16), torch.randn(8, 32, 8)), {}),
    "decoder_long": _long_sequence_decoder,
    "llama_long": _long_sequence_llama,
    **{n: (lambda n=n: _hf(n)) for n in ("gpt2", "bert", "roberta", "distilbert", "llama", "mistral", "qwen2", "opt", "vit_hf",
                                             "t5_encoder", "gpt_neox")},
    **{n: (lambda n=n: _vision(n)) for n in ("tv_resnet18", "tv_mobilenet_v3_small", "tv_vit", "tv_squeezenet1_0",
                                             "timm_vit_tiny", "timm_mixer", "timm_resnet10t", "timm_convnext_atto",
                                             "timm_efficientnet_b0")},
}  # fmt: skip


#: families interleaved, so a run stopped early still spans them
ORDER = ["mlp_stack", "gpt2", "tv_resnet18", "bert", "timm_vit_tiny", "llama", "tv_vit", "distilbert", "timm_mixer",
         "vit_hf", "roberta", "tv_mobilenet_v3_small", "qwen2", "timm_resnet10t", "opt", "mistral",
         "tv_squeezenet1_0", "t5_encoder", "timm_convnext_atto", "gpt_neox", "timm_efficientnet_b0"]  # fmt: skip


def budgets_for(model: nn.Module, args: tuple, kwargs: dict, devices: list[str]) -> dict[str, int]:
    """Loose, medium and tight budgets from the planner's own predictions (no program built)."""
    labels = parse_devices(devices).labels()
    planned = plan_layouts(model, labels, dict.fromkeys(labels, 1 << 50), optimizer="sgd", training=True,
                           example_inputs=args, example_kwargs=kwargs, device=torch.device("cpu"))  # fmt: skip
    peaks = [c.peak for c in planned.candidates if c.per_device]
    dp = next(c.peak for c in planned.candidates if c.spec.layout == (("dp", len(devices)),) and not c.spec.checkpointing)
    least = min(peaks)
    return {"loose": int(dp * 1.25), "medium": int((least + dp) / 2), "tight": int(least * 1.05)}


def run_one(name: str, devices: list[str]) -> list[dict[str, Any]]:
    rows = []
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name]()
    budgets = budgets_for(model, args, kwargs, devices)
    for label, budget in budgets.items():
        torch.manual_seed(0)
        model, args, kwargs = MODELS[name]()
        row: dict[str, Any] = {"model": name, "budget_kind": label, "budget": budget}
        try:
            start = time.perf_counter()
            for attempt in range(6):
                try:
                    pm = dpcompile.transform(model, devices, example_inputs=args or None, example_kwargs=kwargs or None,
                                             memory_per_device=budget, optimizer="sgd", plan="auto")  # fmt: skip
                    break
                except dpcompile.DpCompileError as e:
                    least = _least_buildable(str(e)) if label == "tight" and attempt < 5 else None
                    if least is None:
                        raise
                    # the smallest predicted layouts do not build (a 1F1B whose micro-batches meet): tight is 5%
                    # above the smallest that does, as the no-fit error names it
                    row["budget"] = budget = int(least * 1.05)
                    torch.manual_seed(0)
                    model, args, kwargs = MODELS[name]()
            row["transform_s"] = round(time.perf_counter() - start, 2)
            chosen = next(c for c in pm.candidates if c.rejected is None)
            row["choice"] = chosen.spec.name
            measured = dpcompile.measure(pm, *args, **kwargs)
            predicted = {d: sum(k.values()) for d, k in chosen.per_device.items()}
            errors = {d: (predicted[d] - measured.peak_bytes[d]) / measured.peak_bytes[d] for d in predicted}
            worst = max(errors, key=lambda d: abs(errors[d]))
            row.update(
                predicted=predicted, measured=measured.peak_bytes, worst_device=worst, error=round(errors[worst], 4),
                peak_error=round((max(predicted.values()) - max(measured.peak_bytes.values()))
                                 / max(measured.peak_bytes.values()), 4),
                held=max(measured.peak_bytes.values()) <= budget, predicted_step_s=chosen.step_time,
                measured_step_s=measured.step_time,
            )  # fmt: skip
        except dpcompile.DpCompileError as e:
            row["error_message"] = str(e)[:300]
        except Exception as e:  # noqa: BLE001 - a benchmark reports and goes on
            row["error_message"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
        rows.append(row)
        _print_row(row)
    return rows


def _least_buildable(message: str) -> int | None:
    """The smallest predicted peak of a layout that builds, as a no-fit error names it (None: another error)."""
    found = re.search(r"a budget of at least .*? \((\d+) bytes\)", message)
    return int(found.group(1)) if found and message.startswith("no layout fits") else None


def _print_row(row: dict[str, Any]) -> None:
    if "error" not in row:
        print(f"{row['model']:<22} {row['budget_kind']:<7} {format_bytes(row['budget']):>11}  "
              f"FAILED: {row.get('error_message', '')[:150]}", flush=True)  # fmt: skip
        return
    print(
        f"{row['model']:<22} {row['budget_kind']:<7} {format_bytes(row['budget']):>11}  {row['choice']:<24} "
        f"pred {format_bytes(max(row['predicted'].values())):>11} meas {format_bytes(max(row['measured'].values())):>11} "
        f"peak err {row['peak_error']:+7.1%}  worst device err {row['error']:+7.1%}  held {row['held']}",
        flush=True,
    )


def decoder_planning_seconds(layers: int = 32) -> float:
    """Seconds ``plan_layouts`` takes on a ``layers``-layer Llama decoder (tiny width) over 8 devices."""
    import transformers as T

    cfg = T.LlamaConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, use_cache=False, vocab_size=V, max_position_embeddings=64)  # fmt: skip
    model = T.LlamaForCausalLM(cfg)
    kwargs = _tokens("lm", b=8, seq=32)
    labels = [f"cpu#{i}" for i in range(8)]
    start = time.perf_counter()
    planned = plan_layouts(model, labels, dict.fromkeys(labels, 1 << 30), optimizer="adamw", training=True,
                           example_inputs=(), example_kwargs=kwargs, device=torch.device("cpu"))  # fmt: skip
    seconds = time.perf_counter() - start
    print(f"planning a {layers}-layer decoder over 8 devices: {len(planned.candidates)} layouts in {seconds:.2f} s")
    return seconds


def main() -> None:
    global RESULTS
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated models: their rows replace theirs in planner.json")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the JSON file written (and merged into)")
    options = parser.parse_args()
    RESULTS = options.results
    names = [n for n in options.only.split(",") if n] or ORDER
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(ORDER)}")
    devices = ["cpu"] * options.devices
    kept, decoder_seconds = _kept_rows(options.devices, names) if options.only else ([], None)
    decoder_seconds = decoder_seconds if options.only and decoder_seconds else round(decoder_planning_seconds(), 2)
    rows: list[dict[str, Any]] = []
    for name in names:
        rows += run_one(name, devices)
        _write(options.devices, _summary(_merged(kept, rows), decoder_seconds), _merged(kept, rows))  # survives a stop
    summary = _summary(_merged(kept, rows), decoder_seconds)
    print(json.dumps(summary, indent=1))
    _write(options.devices, summary, _merged(kept, rows))


def _kept_rows(devices: int, names: list[str]) -> tuple[list[dict[str, Any]], float | None]:
    """The rows of models not rerun (``--only``) from the last results over as many devices."""
    if not RESULTS.exists():
        return [], None
    last = json.loads(RESULTS.read_text())
    if last.get("devices") != devices:
        return [], None
    return [r for r in last["rows"] if r["model"] not in names], last["summary"].get("decoder32_planning_s")


def _merged(kept: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every row in ``ORDER``'s order of models (the budgets of one model in their own order)."""
    rank = {n: i for i, n in enumerate(ORDER)}
    return sorted(kept + rows, key=lambda r: rank.get(r["model"], len(rank)))


def _write(devices: int, summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"devices": devices, "summary": summary, "rows": rows}, indent=1))


def _summary(rows: list[dict[str, Any]], decoder_seconds: float | None) -> dict[str, Any]:
    measured = [r for r in rows if "error" in r]
    within = [r for r in measured if abs(r["peak_error"]) <= 0.10]
    every_device = [r for r in measured if abs(r["error"]) <= 0.10]
    return {
        "runs": len(rows), "models": len({r["model"] for r in rows}), "measured": len(measured),
        "budget_held": sum(r["held"] for r in measured),
        "peak_within_10pct": len(within),
        "every_device_within_10pct": len(every_device),
        "median_abs_peak_error": sorted(abs(r["peak_error"]) for r in measured)[len(measured) // 2] if measured else None,
        "max_abs_peak_error": max((abs(r["peak_error"]) for r in measured), default=None),
        "max_abs_device_error": max((abs(r["error"]) for r in measured), default=None),
        "decoder32_planning_s": decoder_seconds,
        "calibration": calibrate("cpu").__dict__,
    }  # fmt: skip


if __name__ == "__main__":
    main()
