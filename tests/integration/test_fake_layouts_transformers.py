"""verify(fake_devices=) of transformers models captured by the export frontend (keyword inputs):
the program is rebuilt for fake CUDA devices from the same capture, and every op runs where its
slot says. Each case failed before: the check re-traced the model with fx (which GPT-2 and Llama
defeat), the vocab-parallel lookup on device 1 read token ids left on device 0, and a pipeline
stage's parameters read through an exported program stayed on the first stage's fake device."""

from __future__ import annotations

import warnings

import pytest
import torch

import dpcompile
from tests.thirdparty import import_or_skip

V = 32


def _tokens():
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(1, V, (4, 8), generator=g), "labels": torch.randint(0, V, (4, 8), generator=g)}


def _gpt2():
    T = import_or_skip("transformers")
    config = T.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=V, n_positions=16, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)  # fmt: skip
    return T.GPT2LMHeadModel(config)


def _llama():
    T = import_or_skip("transformers")
    config = T.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, vocab_size=V, max_position_embeddings=32, use_cache=False)  # fmt: skip
    return T.LlamaForCausalLM(config)


@pytest.mark.parametrize(
    ("make", "layout"),
    [(_gpt2, {"tp": 2}), (_llama, {"pp": 2})],
    ids=["gpt2-tp", "llama-pp"],
)
def test_fake_cuda_layout_of_an_exported_transformer_holds(make, layout):
    torch.manual_seed(0)
    model = make()
    n = 1
    for size in layout.values():
        n *= size
    kwargs = _tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(model, ["cpu"] * n, mesh=layout, example_kwargs=kwargs)
        result = dpcompile.verify(pm, model, fake_devices=n, **kwargs)
    assert result, str(result)
    assert result.checked["fake devices"] == n
    assert result.checked["placed nodes"] > 0
