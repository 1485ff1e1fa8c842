"""Data parallelism on a FRESH set of third-party models (issue 30): split, and equal to eager?

Families that no test or benchmark of the project held when this was written (none of the 35 of
``benchmarks/dp_models_sweep.py``, nor of ``tests/thirdparty.py`` and the integration tests): state
spaces (Mamba, Mamba2, Falcon-Mamba, RWKV), audio (Wav2Vec2, HuBERT, WavLM, Whisper's encoder),
video (VideoMAE, TimeSformer, ViViT, torchvision's 3D ResNets), hierarchical and convolutional
vision transformers, long-sequence encoders, ... Tiny random-weight configurations, on 4 virtual
CPU devices; transformers 5.x through the export frontend (``example_kwargs=``), timm and
torchvision through fx. The measure is ``benchmarks.dp_models_sweep.run``'s (``split``,
``eval`` on 8, ``uneven`` on 7, ``train`` on 7 with a float64 re-check) plus ``whole``: the first
op ``dpcompile.explain(...).whole`` lists (target and reason), the whole op with the most FLOPs,
and how many nodes run whole.

    PYTHONPATH=. python benchmarks/dp_models_sweep_fresh.py                 # every model
    PYTHONPATH=. python benchmarks/dp_models_sweep_fresh.py mamba wav2vec2  # some
    PYTHONPATH=. python benchmarks/dp_models_sweep_fresh.py --out benchmarks/results/dp_models_sweep_fresh_before.json

Each model is bounded to ``--limit`` seconds (90); one that runs past it is recorded as such.
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH
import dpcompile  # noqa: E402
from benchmarks import dp_models_sweep as base  # noqa: E402  (defines the torchvision ops, imports timm)
from benchmarks.dp_models_sweep import V, _decoder, _encoder, _seq2seq  # noqa: E402

T, timm, torchvision = base.T, base.timm, base.torchvision
_old_inputs = base.inputs
NOTDROP = dict(hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
               final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0)  # fmt: skip
AUDIO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16),
             conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
             num_labels=3, **NOTDROP)  # fmt: skip
VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
           attention_probs_dropout_prob=0.0, num_labels=3)  # fmt: skip


def inputs(kind: str, b: int, seed: int) -> tuple[tuple, dict]:
    """The old sweep's kinds, and: ``audio`` (a waveform of 400 samples), ``mel`` (16 mel bins x 32
    frames), ``hfimg`` (an image, labels), ``video`` (4 frames of 32x32, transformers' layout
    ``(B, T, C, H, W)``), ``tvvideo`` (torchvision's ``(B, C, T, H, W)``), ``nomask`` (token ids and
    labels, no attention mask), ``perceiver`` (``inputs=`` ids). Float tensors go positionally (the
    float64 re-check casts those), labels by keyword."""
    g = torch.Generator().manual_seed(seed)
    labels = {"labels": torch.randint(0, 3, (b,), generator=g)}
    shapes = {"audio": (b, 400), "mel": (b, 16, 32), "hfimg": (b, 3, 32, 32), "hfimg64": (b, 3, 64, 64),
              "video": (b, 4, 3, 32, 32)}  # fmt: skip
    if kind in shapes:
        return (torch.randn(*shapes[kind], generator=g),), labels
    if kind == "tvvideo":
        return (torch.randn(b, 3, 4, 32, 32, generator=g),), {}
    if kind in ("nomask", "perceiver"):
        ids = torch.randint(3, V - 1, (b, 8), generator=g)
        return (), {"inputs" if kind == "perceiver" else "input_ids": ids, **labels}
    return _old_inputs(kind, b, seed)


base.inputs = inputs  # the old sweep's run() and float64 re-check build their batches with these kinds


def hf_models() -> dict[str, tuple[Any, str]]:
    def hf(model_cls: Any, config_cls: Any, **kw: Any) -> Any:
        return lambda: model_cls(config_cls(**kw))

    ssm = dict(
        vocab_size=V, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4, use_cache=False
    )
    return {
        # state spaces, recurrences
        "mamba": (hf(T.MambaForCausalLM, T.MambaConfig, **ssm), "lm"),
        "falcon_mamba": (hf(T.FalconMambaForCausalLM, T.FalconMambaConfig, **ssm), "lm"),
        "mamba2": (
            hf(
                T.Mamba2ForCausalLM,
                T.Mamba2Config,
                vocab_size=V,
                hidden_size=32,
                num_heads=4,
                head_dim=16,
                state_size=8,
                n_groups=1,
                num_hidden_layers=2,
                expand=2,
                chunk_size=4,
                use_cache=False,
            ),
            "lm",
        ),  # fmt: skip
        "rwkv": (
            hf(
                T.RwkvForCausalLM,
                T.RwkvConfig,
                vocab_size=V,
                hidden_size=32,
                num_hidden_layers=2,
                attention_hidden_size=32,
                intermediate_size=64,
                context_length=64,
                use_cache=False,
            ),
            "lm",
        ),  # fmt: skip
        "recurrent_gemma": (
            hf(
                T.RecurrentGemmaForCausalLM,
                T.RecurrentGemmaConfig,
                vocab_size=V,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=4,
                lru_width=32,
                attention_window_size=8,
                conv1d_width=4,
                head_dim=8,
                block_types=["recurrent", "attention"],
                use_cache=False,
                pad_token_id=0,
            ),
            "lm",
        ),  # fmt: skip
        # decoders of families not held
        "gptj": (
            hf(
                T.GPTJForCausalLM,
                T.GPTJConfig,
                vocab_size=V,
                n_embd=32,
                n_layer=2,
                n_head=4,
                rotary_dim=4,
                n_positions=64,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                use_cache=False,
            ),
            "lm",
        ),  # fmt: skip
        "gpt_bigcode": (
            hf(
                T.GPTBigCodeForCausalLM,
                T.GPTBigCodeConfig,
                vocab_size=V,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=64,
                multi_query=True,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                use_cache=False,
            ),
            "lm",
        ),  # fmt: skip
        "mpt": (
            hf(
                T.MptForCausalLM,
                T.MptConfig,
                vocab_size=V,
                d_model=32,
                n_heads=4,
                n_layers=2,
                max_seq_len=64,
                use_cache=False,
            ),
            "lm",
        ),  # fmt: skip
        "biogpt": (
            _decoder(T.BioGptForCausalLM, T.BioGptConfig, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
            "lm",
        ),  # fmt: skip
        # encoders of families not held
        "xlnet": (
            hf(
                T.XLNetForSequenceClassification,
                T.XLNetConfig,
                vocab_size=V,
                d_model=32,
                n_layer=2,
                n_head=4,
                d_inner=64,
                dropout=0.0,
                num_labels=3,
                use_mems_train=False,
            ),
            "cls",
        ),  # fmt: skip
        "deberta": (_encoder(T.DebertaForSequenceClassification, T.DebertaConfig), "cls"),
        "mobilebert": (
            _encoder(
                T.MobileBertForSequenceClassification,
                T.MobileBertConfig,
                embedding_size=16,
                intra_bottleneck_size=16,
                true_hidden_size=16,
                num_feedforward_networks=1,
            ),
            "cls",
        ),  # fmt: skip
        "convbert": (_encoder(T.ConvBertForSequenceClassification, T.ConvBertConfig, embedding_size=32), "cls"),
        "squeezebert": (
            _encoder(
                T.SqueezeBertForSequenceClassification,
                T.SqueezeBertConfig,
                embedding_size=32,
                q_groups=1,
                k_groups=1,
                v_groups=1,
                post_attention_groups=1,
                intermediate_groups=1,
                output_groups=1,
            ),
            "cls",
        ),  # fmt: skip
        "funnel": (
            hf(
                T.FunnelForSequenceClassification,
                T.FunnelConfig,
                vocab_size=V,
                block_sizes=[1, 1],
                d_model=32,
                n_head=4,
                d_head=8,
                d_inner=64,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
                num_labels=3,
            ),
            "cls",
        ),  # fmt: skip
        "nystromformer": (
            _encoder(
                T.NystromformerForSequenceClassification,
                T.NystromformerConfig,
                num_landmarks=4,
                segment_means_seq_len=8,
                pad_token_id=0,
            ),
            "nomask",
        ),  # fmt: skip
        "esm": (
            _encoder(
                T.EsmForSequenceClassification,
                T.EsmConfig,
                pad_token_id=0,
                mask_token_id=1,
                position_embedding_type="rotary",
            ),
            "cls",
        ),  # fmt: skip
        "longformer": (
            _encoder(
                T.LongformerForSequenceClassification,
                T.LongformerConfig,
                attention_window=[4, 4],
                pad_token_id=1,
                sep_token_id=2,
                bos_token_id=0,
                eos_token_id=2,
            ),
            "cls",
        ),  # fmt: skip
        "fnet": (_encoder(T.FNetForSequenceClassification, T.FNetConfig, hidden_dropout_prob=0.0), "nomask"),
        "perceiver": (
            hf(
                T.PerceiverForSequenceClassification,
                T.PerceiverConfig,
                vocab_size=V,
                d_model=32,
                d_latents=32,
                num_latents=8,
                num_blocks=1,
                num_self_attends_per_block=1,
                num_self_attention_heads=4,
                num_cross_attention_heads=1,
                max_position_embeddings=8,
                attention_probs_dropout_prob=0.0,
                num_labels=3,
            ),
            "perceiver",
        ),  # fmt: skip
        # long-sequence seq2seq
        "longt5": (
            hf(
                T.LongT5ForConditionalGeneration,
                T.LongT5Config,
                vocab_size=V,
                d_model=32,
                d_kv=8,
                num_heads=4,
                d_ff=64,
                num_layers=1,
                num_decoder_layers=1,
                local_radius=2,
                global_block_size=4,
                encoder_attention_type="transient-global",
                dropout_rate=0.0,
                decoder_start_token_id=0,
                pad_token_id=0,
                use_cache=False,
            ),
            "s2s",
        ),  # fmt: skip
        "pegasus_x": (
            _seq2seq(
                T.PegasusXForConditionalGeneration,
                T.PegasusXConfig,
                block_size=4,
                num_global_tokens=2,
                num_attention_heads=4,
            ),
            "s2s",
        ),  # fmt: skip
        # audio
        "wav2vec2": (hf(T.Wav2Vec2ForSequenceClassification, T.Wav2Vec2Config, **AUDIO), "audio"),
        "hubert": (hf(T.HubertForSequenceClassification, T.HubertConfig, **AUDIO), "audio"),
        "wavlm": (
            hf(T.WavLMForSequenceClassification, T.WavLMConfig, num_buckets=16, max_bucket_distance=32, **AUDIO),
            "audio",
        ),  # fmt: skip
        "whisper_encoder": (
            hf(
                T.WhisperForAudioClassification,
                T.WhisperConfig,
                num_mel_bins=16,
                d_model=32,
                encoder_layers=2,
                encoder_attention_heads=4,
                encoder_ffn_dim=64,
                max_source_positions=16,
                num_labels=3,
                dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
            ),
            "mel",
        ),  # fmt: skip
        # video
        "videomae": (
            hf(
                T.VideoMAEForVideoClassification,
                T.VideoMAEConfig,
                image_size=32,
                patch_size=8,
                num_frames=4,
                tubelet_size=2,
                **VIT,
            ),
            "video",
        ),  # fmt: skip
        "timesformer": (
            hf(
                T.TimesformerForVideoClassification,
                T.TimesformerConfig,
                image_size=32,
                patch_size=8,
                num_frames=4,
                **VIT,
            ),
            "video",
        ),  # fmt: skip
        "vivit": (
            hf(
                T.VivitForVideoClassification, T.VivitConfig, image_size=32, num_frames=4, tubelet_size=[2, 8, 8], **VIT
            ),
            "video",
        ),  # fmt: skip
        # images, transformers' implementations
        "swinv2": (
            hf(
                T.Swinv2ForImageClassification,
                T.Swinv2Config,
                image_size=32,
                patch_size=4,
                embed_dim=16,
                depths=[1, 1],
                num_heads=[1, 2],
                window_size=2,
                num_labels=3,
                drop_path_rate=0.0,
            ),
            "hfimg",
        ),  # fmt: skip
        "convnextv2": (
            hf(
                T.ConvNextV2ForImageClassification,
                T.ConvNextV2Config,
                num_stages=2,
                hidden_sizes=[16, 32],
                depths=[1, 1],
                num_labels=3,
                image_size=32,
            ),
            "hfimg",
        ),  # fmt: skip
        "poolformer": (
            hf(
                T.PoolFormerForImageClassification,
                T.PoolFormerConfig,
                hidden_sizes=[16, 32],
                depths=[1, 1],
                num_encoder_blocks=2,
                patch_sizes=[7, 3],
                strides=[4, 2],
                padding=[2, 1],
                num_labels=3,
            ),
            "hfimg",
        ),  # fmt: skip
        "segformer": (
            hf(
                T.SegformerForImageClassification,
                T.SegformerConfig,
                num_encoder_blocks=2,
                depths=[1, 1],
                sr_ratios=[2, 1],
                hidden_sizes=[16, 32],
                patch_sizes=[7, 3],
                strides=[4, 2],
                num_attention_heads=[1, 2],
                mlp_ratios=[2, 2],
                num_labels=3,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                classifier_dropout_prob=0.0,
                drop_path_rate=0.0,
            ),
            "hfimg",
        ),  # fmt: skip
        "dinov2": (
            hf(
                T.Dinov2ForImageClassification,
                T.Dinov2Config,
                image_size=32,
                patch_size=8,
                mlp_ratio=2,
                **{k: v for k, v in VIT.items() if k != "intermediate_size"},
            ),
            "hfimg",
        ),  # fmt: skip
        "mobilevit": (
            hf(
                T.MobileViTForImageClassification,
                T.MobileViTConfig,
                image_size=64,
                hidden_sizes=[32, 48, 64],
                neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 96],
                num_attention_heads=2,
                num_labels=3,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                classifier_dropout_prob=0.0,
            ),
            "hfimg64",
        ),  # fmt: skip
    }


def vision_models() -> dict[str, tuple[Any, str]]:
    tv = torchvision.models

    def tvm(name: str, **kw: Any) -> Any:
        return lambda: getattr(tv, name)(weights=None, num_classes=5, **kw)

    def tvv(name: str) -> Any:
        return lambda: getattr(tv.video, name)(weights=None, num_classes=5)

    def tim(name: str, **kw: Any) -> Any:
        return lambda: timm.create_model(name, pretrained=False, num_classes=5, **kw)

    return {
        "tv_r3d_18": (tvv("r3d_18"), "tvvideo"),
        "tv_mc3_18": (tvv("mc3_18"), "tvvideo"),
        "tv_r2plus1d_18": (tvv("r2plus1d_18"), "tvvideo"),
        "tv_googlenet": (tvm("googlenet", aux_logits=False, init_weights=True), "img64"),
        "tv_efficientnet_v2": (tvm("efficientnet_v2_s"), "img"),
        "timm_rexnet": (tim("rexnet_100"), "img"),
        "timm_tinynet": (tim("tinynet_e"), "img"),
        "timm_edgenext": (tim("edgenext_xx_small"), "img64"),
        "timm_repvit": (tim("repvit_m0_9"), "img64"),
        "timm_fastvit": (tim("fastvit_t8"), "img64"),
        "timm_cait": (tim("cait_xxs24_224", img_size=32, patch_size=8, depth=2, depth_token_only=1), "img"),
        "timm_nf_regnet": (tim("nf_regnet_b0"), "img"),
        "timm_hrnet": (tim("hrnet_w18_small"), "img64"),
        "timm_maxvit": (tim("maxvit_nano_rw_256", img_size=64), "img64"),
        "timm_gcvit": (tim("gcvit_xxtiny", img_size=64), "img64"),
    }


class _Timeout(BaseException):  # not caught by the sweep's own `except Exception`
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout


_REPORTS: list[Any] = []
_explain = dpcompile.explain


def _recording_explain(pm: Any, *args: Any, **kwargs: Any) -> Any:
    """``dpcompile.explain``, keeping its report: the old sweep's run() explains a batch of 8."""
    report = _explain(pm, *args, **kwargs)
    _REPORTS.append(report)
    return report


dpcompile.explain = _recording_explain  # in this process only: base.run's call records its report


def whole_ops(report: Any) -> dict[str, Any]:
    """From ``explain(...).whole`` on a batch of 8: the first whole op, the heaviest, how many."""
    whole = report.whole
    if not whole:
        return {"whole_nodes": 0}
    heaviest = max(whole, key=lambda w: w.get("flops") or 0)
    return {"whole_nodes": len(whole), "first_whole": {k: whole[0][k] for k in ("target", "reason", "source")},
            "heaviest_whole": {k: heaviest[k] for k in ("target", "reason", "flops")},
            "whole_targets": dict(collections.Counter(str(w["target"]) for w in whole))}  # fmt: skip


def measure(factory: Any, kind: str) -> dict[str, Any]:
    _REPORTS.clear()
    res = base.run("", factory, kind)
    if _REPORTS:
        res.update(whole_ops(_REPORTS[-1]))
    return res


def equal(res: dict[str, Any]) -> bool:
    return all(str(res.get(k, "")).startswith("ok") for k in ("eval", "uneven", "train"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "dp_models_sweep_fresh.json"))
    parser.add_argument("--limit", type=int, default=90, help="seconds per model")
    options = parser.parse_args()
    models = {**hf_models(), **vision_models()}
    names = options.names or list(models)
    results: dict[str, Any] = {}
    signal.signal(signal.SIGALRM, _alarm)
    for name in names:
        factory, kind = models[name]
        t0 = time.time()
        signal.alarm(options.limit)
        try:
            res = measure(factory, kind)
        except _Timeout:
            res = {"captured": f"SKIP: over {options.limit} s"}
        except Exception as e:  # noqa: BLE001 - building the model itself failed
            res = {"captured": f"FAIL building: {type(e).__name__}: {str(e)[:200]}"}
        finally:
            signal.alarm(0)
        res["seconds"] = round(time.time() - t0, 1)
        results[name] = res
        split = res.get("split")
        first = res.get("first_whole") or {}
        print(f"{name:20s} {str(res.get('captured'))[:60]:8s} split={'-' if split is None else f'{100 * split:.0f}%'} "
              f"eval={str(res.get('eval', '-'))[:60]} uneven={str(res.get('uneven', '-'))[:60]} "
              f"train={str(res.get('train', '-'))[:100]} whole={first.get('target', '-')} ({res['seconds']} s)",
              flush=True)  # fmt: skip
        out = Path(options.out)  # after every model: a sweep cut short keeps what it measured
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    ran = [r for r in results.values() if r.get("split") is not None]
    high = sum(r["split"] >= 0.95 for r in ran)
    eq = sum(equal(r) for r in ran)
    both = sum(r["split"] >= 0.95 and equal(r) for r in ran)
    print(
        f"{len(ran)} models, {high} >= 95% split, {eq} equal eager ({both} both); "
        f"{len(results) - len(ran)} not measured: {[n for n, r in results.items() if r.get('split') is None]}"
    )
    tops = collections.Counter(str((r.get("first_whole") or {}).get("target")) for r in ran if r.get("first_whole"))
    print("first whole op by models:", tops.most_common())


if __name__ == "__main__":
    main()
