"""The planner's choice on models ``bench_planner.py`` does not list (issue 34), at its three budgets.

Tiny random-weight configurations of transformers' T5 (encoder-decoder), Whisper's encoder (audio
classification), DistilBERT's masked LM, Phi-3 and Gemma; torchvision's mobilenet_v2 and
shufflenet_v2; timm's mobilenetv3_small_050, regnetx_002 and lcnet_050 (BatchNorm CNNs). For each, as
``bench_planner.run_one`` does over virtual CPU devices (loose, medium and tight budgets; SGD): the layout
``plan="auto"`` chooses, then per device the predicted and the measured peak (``dpcompile.measure``)
and whether the measured one stayed within the budget.

    PYTHONPATH=. nice -n 10 python benchmarks/bench_planner_unseen.py [--devices 2] [--only t5,whisper_encoder]

Prints one line per device; writes nothing. ``--tightest``: instead, one budget per model, the least
any layout is predicted to need (``plan_layouts``' smallest peak; the next where that one does not build),
so that the choice's prediction is the budget itself and any device measured over it shows.

    PYTHONPATH=. nice -n 10 python benchmarks/bench_planner_unseen.py --tightest --only mlp_stack,gpt2,bert
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_planner  # noqa: E402  (defines torchvision's ops first)
from bench_planner import V, _tokens  # noqa: E402

import dpcompile  # noqa: E402
from dpcompile.analysis.memory import format_bytes  # noqa: E402
from dpcompile.devices import parse_devices  # noqa: E402
from dpcompile.planner import plan_layouts  # noqa: E402


def _hf(name: str) -> tuple[nn.Module, tuple, dict]:
    import transformers as T

    T.logging.set_verbosity_error()
    lm = _tokens("lm")
    if name == "t5":
        cfg = T.T5Config(num_layers=2, num_decoder_layers=2, d_model=64, d_kv=16, num_heads=4, d_ff=128,
                         dropout_rate=0.0, vocab_size=V, use_cache=False, decoder_start_token_id=0)  # fmt: skip
        return T.T5ForConditionalGeneration(cfg), (), lm
    if name == "whisper_encoder":
        cfg = T.WhisperConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                              decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
                              max_source_positions=32, dropout=0.0, attention_dropout=0.0, num_labels=3)  # fmt: skip
        g = torch.Generator().manual_seed(0)
        kw = {"input_features": torch.randn(8, 16, 64, generator=g), "labels": torch.randint(0, 3, (8,), generator=g)}
        return T.WhisperForAudioClassification(cfg), (), kw
    if name == "distilbert_mlm":
        cfg = T.DistilBertConfig(n_layers=3, dim=64, n_heads=4, hidden_dim=128, dropout=0, attention_dropout=0,
                                 vocab_size=V, max_position_embeddings=32)  # fmt: skip
        return T.DistilBertForMaskedLM(cfg), (), lm
    if name == "phi3":
        cfg = T.Phi3Config(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, vocab_size=V, max_position_embeddings=32, use_cache=False,
                           pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)  # fmt: skip
        return T.Phi3ForCausalLM(cfg), (), lm
    if name == "gemma":
        cfg = T.GemmaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                            intermediate_size=128, vocab_size=V, max_position_embeddings=32, use_cache=False)  # fmt: skip
        return T.GemmaForCausalLM(cfg), (), lm
    raise KeyError(name)


def _vision(name: str) -> tuple[nn.Module, tuple, dict]:
    x = torch.randn(8, 3, 32, 32)
    if name.startswith("timm_"):
        import timm

        return timm.create_model(name[5:], pretrained=False, num_classes=10), (x,), {}
    import torchvision

    if name == "tv_shufflenet_v2":
        return torchvision.models.shufflenet_v2_x0_5(weights=None, num_classes=10), (x,), {}
    return getattr(torchvision.models, name[3:])(weights=None, num_classes=10), (x,), {}


HF = ("t5", "whisper_encoder", "distilbert_mlm", "phi3", "gemma")
VISION = ("tv_mobilenet_v2", "tv_shufflenet_v2", "timm_mobilenetv3_small_050", "timm_regnetx_002", "timm_lcnet_050")
UNSEEN = {**{n: (lambda n=n: _hf(n)) for n in HF}, **{n: (lambda n=n: _vision(n)) for n in VISION}}
ORDER = ["t5", "tv_mobilenet_v2", "whisper_encoder", "timm_mobilenetv3_small_050", "distilbert_mlm",
         "timm_regnetx_002", "phi3", "tv_shufflenet_v2", "gemma", "timm_lcnet_050"]  # fmt: skip


def tightest(name: str, devices: list[str]) -> None:
    """``plan="auto"`` at the least budget that fits a layout: per device, predicted and measured."""
    torch.manual_seed(0)
    model, args, kwargs = bench_planner.MODELS[name]()
    labels = parse_devices(devices).labels()
    planned = plan_layouts(model, labels, dict.fromkeys(labels, 1 << 50), optimizer="sgd", training=True,
                           example_inputs=args or None, example_kwargs=kwargs or None, device=torch.device("cpu"))  # fmt: skip
    for budget in sorted({c.peak for c in planned.candidates if c.per_device}):
        torch.manual_seed(0)
        model, args, kwargs = bench_planner.MODELS[name]()
        try:
            pm = dpcompile.transform(model, devices, example_inputs=args or None, example_kwargs=kwargs or None,
                                     memory_per_device=budget, optimizer="sgd", plan="auto")  # fmt: skip
        except dpcompile.DpCompileError:  # the least predicted does not build (a 1F1B whose micro-batches meet)
            continue
        chosen = next(c for c in pm.candidates if c.rejected is None)
        measured = dpcompile.measure(pm, *args, **kwargs).peak_bytes
        for d, kinds in chosen.per_device.items():
            predicted = sum(kinds.values())
            print(f"  {name:<27} tightest {format_bytes(budget):>11} {chosen.spec.name:<24} {d:<6} "
                  f"predicted {format_bytes(predicted):>11} measured {format_bytes(measured[d]):>11} "
                  f"{(predicted - measured[d]) / measured[d]:+7.1%} {'within' if measured[d] <= budget else 'OVER'}",
                  flush=True)  # fmt: skip
        return


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--only", default="")
    parser.add_argument("--tightest", action="store_true", help="one budget per model: the least that fits a layout")
    options = parser.parse_args()
    bench_planner.MODELS.update(UNSEEN)
    devices = ["cpu"] * options.devices
    for name in options.only.split(",") if options.only else ORDER:
        if options.tightest:
            tightest(name, devices)
            continue
        for row in bench_planner.run_one(name, devices):
            if "predicted" not in row:
                continue
            for d, predicted in row["predicted"].items():
                measured = row["measured"][d]
                print(f"  {name:<27} {row['budget_kind']:<6} {format_bytes(row['budget']):>11} {row['choice']:<24} {d:<6} "
                      f"predicted {format_bytes(predicted):>11} measured {format_bytes(measured):>11} "
                      f"{(predicted - measured) / measured:+7.1%} {'within' if measured <= row['budget'] else 'OVER'}",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
