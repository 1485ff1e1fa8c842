"""Data parallelism on third-party models the test suite does not hold: split, and equal to eager?

Tiny random-weight models from transformers 5.x (the export frontend, ``example_kwargs=``),
timm and torchvision (the fx frontend, ``example_inputs=``), on 4 virtual CPU devices. For each:

* ``frontend``: the frontend that captured it (``auto``: fx, export where fx fails);
* ``split``: the share of forward FLOPs that runs split (``dpcompile.explain(...).split_flop_fraction``);
* ``eval``: eval outputs on a batch of 8 equal eager; ``uneven``: on a batch of 7;
* ``train``: in training mode, on a batch of 7, the loss (or outputs), every parameter gradient and
  every buffer equal eager, with float64 re-check of rounding (``dpcompile.verify``). The program
  trained is transformed in training mode (``model.train()`` before ``transform``, as a user who
  trains does): an exported program keeps the mode it was exported in (``if self.training:``).

    PYTHONPATH=. python benchmarks/dp_models_sweep.py                 # every model
    PYTHONPATH=. python benchmarks/dp_models_sweep.py clip_text bart  # some
    PYTHONPATH=. python benchmarks/dp_models_sweep.py --out benchmarks/results/dp_models_sweep_before.json

Writes ``benchmarks/results/dp_models_sweep.json`` (or ``--out``) and prints one line per model.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.append(
    str(Path(__file__).resolve().parents[1])
)  # after PYTHONPATH: the dpcompile it names is the one measured
from tests.thirdparty import define_torchvision_ops  # noqa: E402

define_torchvision_ops()
warnings.simplefilter("ignore")
import timm  # noqa: E402
import torchvision  # noqa: E402
import transformers as T  # noqa: E402

import dpcompile  # noqa: E402

T.logging.set_verbosity_error()
V = 96
DEVICES = ["cpu"] * 4


def _decoder(cls: Any, config_cls: Any, **kw: Any) -> Any:
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, use_cache=False, pad_token_id=0)  # fmt: skip
    base.update(kw)
    return lambda: cls(config_cls(**base))


def _seq2seq(cls: Any, config_cls: Any, **kw: Any) -> Any:
    base = dict(vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, decoder_start_token_id=2,
                eos_token_id=2, bos_token_id=0, use_cache=False)  # fmt: skip
    base.update(kw)
    return lambda: cls(config_cls(**base))


def _encoder(cls: Any, config_cls: Any, **kw: Any) -> Any:
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)  # fmt: skip
    base.update(kw)
    return lambda: cls(config_cls(**base))


def hf_models() -> dict[str, tuple[Any, str]]:
    """``{name: (factory, input kind)}``: kinds ``lm`` (labels = ids), ``cls`` (padded, labels),
    ``s2s`` (labels only: the decoder input is ``shift_tokens_right(labels)``), ``clip``."""
    return {
        "clip_text": (
            lambda: T.CLIPTextModel(
                T.CLIPTextConfig(
                    vocab_size=V,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    max_position_embeddings=16,
                    eos_token_id=V - 1,
                )
            ),
            "clip",
        ),  # fmt: skip
        "bart_labels": (_seq2seq(T.BartForConditionalGeneration, T.BartConfig), "s2s"),
        "marian_labels": (_seq2seq(T.MarianMTModel, T.MarianConfig, decoder_vocab_size=V), "s2s"),
        "pegasus_labels": (_seq2seq(T.PegasusForConditionalGeneration, T.PegasusConfig), "s2s"),
        "mbart_labels": (_seq2seq(T.MBartForConditionalGeneration, T.MBartConfig), "s2s"),
        "t5_labels": (
            lambda: T.T5ForConditionalGeneration(
                T.T5Config(
                    vocab_size=V,
                    d_model=32,
                    d_kv=8,
                    num_heads=4,
                    d_ff=64,
                    num_layers=1,
                    num_decoder_layers=1,
                    dropout_rate=0.0,
                    decoder_start_token_id=0,
                    pad_token_id=0,
                    use_cache=False,
                )
            ),
            "s2s",
        ),  # fmt: skip
        "phi": (_decoder(T.PhiForCausalLM, T.PhiConfig, resid_pdrop=0.0, embd_pdrop=0.0), "lm"),
        "falcon": (_decoder(T.FalconForCausalLM, T.FalconConfig, hidden_dropout=0.0, attention_dropout=0.0), "lm"),
        "bloom": (
            lambda: T.BloomForCausalLM(
                T.BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4, use_cache=False, pad_token_id=0)
            ),
            "lm",
        ),  # fmt: skip
        "gpt_neo": (
            lambda: T.GPTNeoForCausalLM(
                T.GPTNeoConfig(
                    vocab_size=V,
                    hidden_size=32,
                    num_layers=2,
                    num_heads=4,
                    attention_types=[[["global", "local"], 1]],
                    max_position_embeddings=64,
                    use_cache=False,
                    embed_dropout=0.0,
                    attention_dropout=0.0,
                    resid_dropout=0.0,
                )
            ),
            "lm",
        ),  # fmt: skip
        "gemma2": (_decoder(T.Gemma2ForCausalLM, T.Gemma2Config, head_dim=8, num_key_value_heads=2), "lm"),
        "stablelm": (_decoder(T.StableLmForCausalLM, T.StableLmConfig, num_key_value_heads=2), "lm"),
        "mixtral_moe": (
            _decoder(
                T.MixtralForCausalLM, T.MixtralConfig, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
            ),
            "lm",
        ),  # fmt: skip
        "qwen2_moe": (
            _decoder(
                T.Qwen2MoeForCausalLM,
                T.Qwen2MoeConfig,
                num_key_value_heads=2,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
            ),
            "lm",
        ),  # fmt: skip
        "qwen2_cls": (
            _decoder(T.Qwen2ForSequenceClassification, T.Qwen2Config, num_key_value_heads=2, num_labels=3),
            "cls",
        ),
        "llama_cls": (
            _decoder(T.LlamaForSequenceClassification, T.LlamaConfig, num_key_value_heads=2, num_labels=3),
            "cls",
        ),
        "gpt2_cls": (
            lambda: T.GPT2ForSequenceClassification(
                T.GPT2Config(
                    vocab_size=V,
                    n_embd=32,
                    n_layer=2,
                    n_head=4,
                    n_positions=64,
                    resid_pdrop=0.0,
                    embd_pdrop=0.0,
                    attn_pdrop=0.0,
                    pad_token_id=0,
                    num_labels=3,
                    use_cache=False,
                )
            ),
            "cls",
        ),  # fmt: skip
        "deberta_v2": (_encoder(T.DebertaV2ForSequenceClassification, T.DebertaV2Config), "cls"),
        "mpnet": (_encoder(T.MPNetForSequenceClassification, T.MPNetConfig), "cls"),
        "xlm_roberta": (_encoder(T.XLMRobertaForSequenceClassification, T.XLMRobertaConfig, pad_token_id=1), "cls"),
    }


def vision_models() -> dict[str, tuple[Any, str]]:
    tv = torchvision.models

    def tvm(name: str, **kw: Any) -> Any:
        return lambda: getattr(tv, name)(weights=None, num_classes=5, **kw)

    def tim(name: str, **kw: Any) -> Any:
        return lambda: timm.create_model(name, pretrained=False, num_classes=5, **kw)

    return {
        "tv_resnet34": (tvm("resnet34"), "img"),
        "tv_mobilenet_v2": (tvm("mobilenet_v2"), "img"),
        "tv_mobilenet_v3_small": (tvm("mobilenet_v3_small"), "img"),
        "tv_shufflenet_v2": (tvm("shufflenet_v2_x0_5"), "img"),
        "tv_squeezenet": (tvm("squeezenet1_1"), "img64"),
        "tv_densenet121": (tvm("densenet121"), "img"),
        "tv_mnasnet": (tvm("mnasnet0_5"), "img"),
        "tv_regnet": (tvm("regnet_y_400mf"), "img"),
        "timm_resnet10t": (tim("resnet10t"), "img"),
        "timm_mobilenetv3": (tim("mobilenetv3_small_050"), "img"),
        "timm_regnetx": (tim("regnetx_002"), "img"),
        "timm_deit_tiny": (tim("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=2), "img"),
        "timm_lcnet": (tim("lcnet_050"), "img"),
        "timm_ghostnet": (tim("ghostnet_050"), "img"),
        "timm_swin": (
            tim(
                "swin_tiny_patch4_window7_224",
                img_size=32,
                window_size=2,
                depths=(1, 1),
                num_heads=(1, 2),
                embed_dim=16,
                drop_path_rate=0.0,
            ),
            "img",
        ),  # fmt: skip
    }


def inputs(kind: str, b: int, seed: int) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(seed)
    if kind.startswith("img"):
        size = 64 if kind == "img64" else 32
        return (torch.randn(b, 3, size, size, generator=g),), {}
    ids = torch.randint(3, V - 1, (b, 8), generator=g)
    if kind == "clip":
        ids[:, -1] = V - 1
        ids[0, 5] = V - 1
        return (), {"input_ids": ids}
    if kind == "cls":
        ids[0, 6:] = 0
        ids[-1, 3:] = 0
        mask = (ids != 0).long()
        return (), {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (b,), generator=g)}
    if kind == "lm":
        return (), {"input_ids": ids, "labels": ids}
    labels = torch.randint(3, V, (b, 5), generator=g)
    labels[0, 3:] = -100
    return (), {"input_ids": ids, "labels": labels}


def main_output(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "pooler_output", "last_hidden_state"):
        if getattr(out, key, None) is not None:
            return getattr(out, key)
    raise TypeError(type(out))


def frontend_of(pm: Any) -> str:
    graph = pm.captured.graph
    return "export" if any(isinstance(n.target, torch._ops.OpOverload) for n in graph.nodes) else "fx"


def run(name: str, factory: Any, kind: str) -> dict[str, Any]:
    res: dict[str, Any] = {}
    torch.manual_seed(0)
    model = factory().eval()
    eager = copy.deepcopy(model)
    args, kwargs = inputs(kind, 4, 0)
    try:
        pm = dpcompile.transform(model, DEVICES, example_inputs=args or None, example_kwargs=kwargs or None)
    except Exception as e:  # noqa: BLE001 - a sweep records every failure
        res["captured"] = f"FAIL {type(e).__name__}: {str(e)[:200]}"
        return res
    res["captured"] = frontend_of(pm)
    args, kwargs = inputs(kind, 8, 8)
    try:
        res["split"] = dpcompile.explain(pm, *args, **kwargs).split_flop_fraction
    except Exception as e:  # noqa: BLE001
        res["split"] = None
        res["explain"] = f"FAIL {type(e).__name__}: {str(e)[:200]}"
    for label, b in (("eval", 8), ("uneven", 7)):
        args, kwargs = inputs(kind, b, b)
        try:
            with torch.no_grad():
                torch.testing.assert_close(main_output(pm(*args, **kwargs)), main_output(eager(*args, **kwargs)),
                                           atol=3e-5, rtol=1e-4)  # fmt: skip
            res[label] = "ok"
        except Exception as e:  # noqa: BLE001
            res[label] = f"FAIL {type(e).__name__}: {str(e)[:200]}"
    model.train()
    args, kwargs = inputs(kind, 4, 0)
    try:
        pm = dpcompile.transform(model, DEVICES, example_inputs=args or None, example_kwargs=kwargs or None)
        args, kwargs = inputs(kind, 7, 3)
        result = dpcompile.verify(pm, model, *args, **kwargs)
        # a non-persistent buffer (transformers' position_ids) is in no state_dict: nothing to compare
        transient = {n for n, _ in model.named_buffers()} - set(model.state_dict())
        wrong = [m for m in result.mismatches if not (m.kind == "buffer" and m.name in transient)]
        res["train"] = "ok" if not wrong else "FAIL " + "; ".join(str(m) for m in wrong)[:300]
        if wrong and all(m.kind in ("gradient", "input gradient", "buffer", "output") for m in wrong):
            res["train_float64"] = float64_step_equal(factory, kind)
            if res["train_float64"] == "ok":
                res["train"] = "ok (float64; float32 differs by rounding)"
    except Exception as e:  # noqa: BLE001
        res["train"] = f"FAIL {type(e).__name__}: {str(e)[:200]}"
    return res


def float64_step_equal(factory: Any, kind: str) -> str:
    """The training step again with the model in float64: outputs, every gradient (of the parameters
    and of the float inputs) and every buffer equal eager to 1e-7? Made as the float32 step is (transformed in training mode, both trained),
    with the same seed before each forward (the same dropout masks where the program draws them
    in the eager order, as virtual CPU devices do)."""
    torch.manual_seed(0)
    model = factory().double().train()
    eager = copy.deepcopy(model)
    args, kwargs = inputs(kind, 4, 0)
    args = tuple(a.double() if a.is_floating_point() else a for a in args)
    try:
        pm = dpcompile.transform(model, DEVICES, example_inputs=args or None, example_kwargs=kwargs or None)
        args, kwargs = inputs(kind, 7, 3)
        args = tuple(a.double() if a.is_floating_point() else a for a in args)
        ours_args, theirs_args = ([a.clone().requires_grad_(a.is_floating_point()) for a in args] for _ in range(2))
        torch.manual_seed(1)  # the same dropout masks in both runs
        ours = pm(*ours_args, **kwargs)
        torch.manual_seed(1)
        theirs = eager(*theirs_args, **kwargs)
        loss = getattr(ours, "loss", None)
        (loss if loss is not None else main_output(ours).sum()).backward()
        loss = getattr(theirs, "loss", None)
        (loss if loss is not None else main_output(theirs).sum()).backward()
        torch.testing.assert_close(main_output(ours), main_output(theirs), rtol=1e-7, atol=1e-9)
        grads = dict(eager.named_parameters())
        for name, p in model.named_parameters():
            if p.grad is not None or grads[name].grad is not None:
                torch.testing.assert_close(
                    p.grad, grads[name].grad, rtol=1e-7, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}"
                )
        for i, (a, b) in enumerate(zip(ours_args, theirs_args)):
            if a.requires_grad:
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-7, atol=1e-9, msg=lambda m, i=i: f"input {i}: {m}")
        # the buffers after the step (batch norm's running statistics, its momentum and batch count)
        theirs_state, ours_state = eager.state_dict(), pm.state_dict()
        buffers = [n for n, _ in model.named_buffers() if n in theirs_state]
        for name in buffers:
            torch.testing.assert_close(
                ours_state[name], theirs_state[name], rtol=1e-7, atol=1e-9, msg=lambda m, n=name: f"buffer {n}: {m}"
            )
        return "ok"
    except Exception as e:  # noqa: BLE001
        return f"FAIL {type(e).__name__}: {str(e)[:200]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "dp_models_sweep.json"))
    options = parser.parse_args()
    models = {**hf_models(), **vision_models()}
    names = options.names or list(models)
    results = {}
    for name in names:
        factory, kind = models[name]
        t0 = time.time()
        try:
            res = run(name, factory, kind)
        except Exception as e:  # noqa: BLE001 - building the model itself failed
            res = {"captured": f"FAIL building: {type(e).__name__}: {str(e)[:200]}"}
        res["seconds"] = round(time.time() - t0, 1)
        results[name] = res
        split = res.get("split")
        print(f"{name:22s} {str(res.get('captured'))[:60]:8s} split={'-' if split is None else f'{100 * split:.0f}%'} "
              f"eval={res.get('eval', '-')[:80]} uneven={res.get('uneven', '-')[:80]} train={res.get('train', '-')[:160]}",
              flush=True)  # fmt: skip
        out = Path(options.out)  # after every model: a sweep cut short keeps what it measured
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
