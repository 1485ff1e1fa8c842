"""Data parallelism on third-party models with the constructs that once gave wrong numbers or ran whole.

A representative few of ``benchmarks/dp_models_sweep.py`` (which runs more than 30): CLIP's text
pooler and a padded ``*ForSequenceClassification`` (indexing by ``arange(B)``), BART trained with
``labels=`` alone (``shift_tokens_right`` writes into a new tensor), GPT-2's ``Conv1D``, BLOOM's
ALiBi (``baddbmm`` over a ``B*H`` leading dim), and a vision model with in-place activations and
BatchNorm. Each runs on a
batch of 5 over 2 virtual devices (uneven chunks) in training mode: outputs, every gradient and
every buffer equal eager (``dpcompile.verify``, float64 re-check), and the forward runs split.
"""

from __future__ import annotations

import pytest
import torch

import dpcompile
from tests.thirdparty import import_or_skip, import_torchvision

pytestmark = pytest.mark.slow  # a torch.export capture per transformers model: about 10 s each on 2 cores

V = 64


def _ids(b: int, pad: bool) -> torch.Tensor:
    ids = torch.randint(3, V - 1, (b, 8), generator=torch.Generator().manual_seed(b))
    if pad:
        ids[0, 6:] = 0
        ids[-1, 3:] = 0
    return ids


def clip_text():
    T = import_or_skip("transformers")
    config = T.CLIPTextConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=4, max_position_embeddings=16, eos_token_id=V - 1)  # fmt: skip

    def inputs(b):
        ids = _ids(b, pad=False)
        ids[:, -1] = V - 1
        ids[0, 4] = V - 1
        return {"input_ids": ids}

    return T.CLIPTextModel(config), inputs


def qwen2_classifier():
    T = import_or_skip("transformers")
    config = T.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, pad_token_id=0, num_labels=3, use_cache=False)  # fmt: skip

    def inputs(b):
        ids = _ids(b, pad=True)
        return {"input_ids": ids, "labels": torch.arange(b) % 3}

    return T.Qwen2ForSequenceClassification(config), inputs


def bart_labels_only():
    T = import_or_skip("transformers")
    config = T.BartConfig(vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                          dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1,
                          decoder_start_token_id=2, use_cache=False)  # fmt: skip

    def inputs(b):
        labels = _ids(b, pad=False)[:, :5].contiguous()
        labels[0, 3:] = -100
        return {"input_ids": _ids(b, pad=False), "labels": labels}

    return T.BartForConditionalGeneration(config), inputs


def gpt2_classifier():
    T = import_or_skip("transformers")
    config = T.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0, pad_token_id=0, num_labels=3, use_cache=False)  # fmt: skip

    def inputs(b):
        return {"input_ids": _ids(b, pad=True), "labels": torch.arange(b) % 3}

    return T.GPT2ForSequenceClassification(config), inputs


def bloom_lm():  # ALiBi: a bias from the mask's cumsum over a B*H leading dim, added by baddbmm
    T = import_or_skip("transformers")
    config = T.BloomConfig(vocab_size=V, hidden_size=32, n_layer=1, n_head=4, use_cache=False, pad_token_id=0)

    def inputs(b):
        ids = _ids(b, pad=False)
        return {"input_ids": ids, "labels": ids}

    return T.BloomForCausalLM(config), inputs


def _image(b):
    return (torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(b)),)


def tv_mobilenet_v3():
    return import_torchvision().models.mobilenet_v3_small(weights=None, num_classes=5), _image


MODELS = {
    "clip_text": clip_text,
    "qwen2_classifier": qwen2_classifier,
    "bart_labels_only": bart_labels_only,
    "gpt2_classifier": gpt2_classifier,
    "tv_mobilenet_v3": tv_mobilenet_v3,
    "bloom_lm": bloom_lm,
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_dp_model_training_step_equals_eager_and_runs_split(name):
    """Outputs, every gradient and buffer equal eager on uneven chunks; all forward FLOPs run split."""
    torch.manual_seed(0)
    model, make = MODELS[name]()
    example = make(4)
    args, kwargs = (example, {}) if isinstance(example, tuple) else ((), example)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=args or None, example_kwargs=kwargs or None)
    batch = make(5)
    args, kwargs = (batch, {}) if isinstance(batch, tuple) else ((), batch)
    assert dpcompile.explain(pm, *args, **kwargs).split_flop_fraction == 1.0
    model.train()
    pm.train()
    result = dpcompile.verify(pm, model, *args, **kwargs)
    transient = {n for n, _ in model.named_buffers()} - set(model.state_dict())  # in no state_dict
    assert [m for m in result.mismatches if not (m.kind == "buffer" and m.name in transient)] == [], str(result)
