"""Context parallelism (``mesh={"cp": N}``) on more transformers models, tiny configs, no annotation:
Mistral, Qwen2, Gemma, Phi (decoders with ``labels=``) and a T5 encoder (relative position bias, a
padding mask) and RoBERTa (position ids from a cumulative sum of the padding along the sequence) equal
eager (float64) on 2 and 4 virtual devices; so does a ViT, whose sequence is made inside the model (docs/context_parallel.md has
the table)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dpcompile
from tests.helpers import assert_lm_step_equals_eager, context_parallel_copies, model_gradients
from tests.thirdparty import import_or_skip

V = 64  # vocabulary


def _model(name: str, **decoder_config: object) -> nn.Module:
    """``name``'s tiny config (1 layer, hidden 32); ``decoder_config`` overrides a decoder's."""
    T = import_or_skip("transformers")
    ids = {"vocab_size": V, "use_cache": False, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    decoder = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64,
               "max_position_embeddings": 32, **ids, **decoder_config}  # fmt: skip
    if name == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(num_key_value_heads=2, **decoder))
    if name == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(num_key_value_heads=2, **decoder))
    if name == "gemma":
        return T.GemmaForCausalLM(T.GemmaConfig(num_key_value_heads=2, head_dim=8, **decoder))
    if name == "phi":
        return T.PhiForCausalLM(T.PhiConfig(resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, **decoder))
    if name == "t5":
        return T.T5EncoderModel(T.T5Config(num_layers=1, d_model=32, num_heads=4, d_kv=8, d_ff=64, vocab_size=V,
                                           dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))  # fmt: skip
    if name == "roberta":
        return T.RobertaForSequenceClassification(T.RobertaConfig(
            num_hidden_layers=1, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=V,
            max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1))  # fmt: skip
    raise ValueError(name)


def _inputs(name: str, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (2, seq), generator=g)
    if name == "roberta":  # left padding (pad id 1) over the first shard's border: positions count non-pads
        ids[0, :4] = 1
        return {"input_ids": ids, "attention_mask": (ids != 1).long(), "labels": torch.tensor([0, 1])}
    if name == "t5":
        mask = torch.ones(2, seq, dtype=torch.long)
        mask[0, seq - 3 :] = 0  # padding on the last device's tokens
        return {"input_ids": ids, "attention_mask": mask}
    return {"input_ids": ids, "labels": torch.randint(0, V, (2, seq), generator=g)}


def _assert_step_equals_eager(name: str, pm: nn.Module, model: nn.Module, eager: nn.Module, inputs: dict) -> None:
    """Outputs, the loss (a T5 encoder has none: its hidden states' weighted sum is backpropagated)
    and every parameter gradient of one step equal eager's. Gemma's norms compute in float32 (its
    own code): its gradients to float32 rounding."""
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if name == "gemma" else {}
    if name != "t5":
        assert_lm_step_equals_eager(pm, eager, inputs, model_gradients(model), **tolerance)
    else:
        out, expected = pm(**inputs).last_hidden_state, eager(**inputs).last_hidden_state
        torch.testing.assert_close(out, expected)
        weights = torch.linspace(0.5, 1.5, expected.numel(), dtype=torch.float64).view(expected.shape)
        (out * weights).sum().backward()
        (expected * weights).sum().backward()
        ours = dict(model.named_parameters())
        for p_name, p in eager.named_parameters():
            assert ours[p_name].grad is not None, f"no gradient reached {p_name}"
            torch.testing.assert_close(ours[p_name].grad, p.grad, msg=lambda m, p_name=p_name: f"grad {p_name}: {m}")
    model.zero_grad()
    eager.zero_grad()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma", "phi", "t5", "roberta"])
def test_context_parallel_more_models_equal_eager(name):
    """Built once, on 2 and 4 virtual devices: outputs, the loss and every gradient of one step equal
    eager's, on a length that divides the devices and one that does not (on 4: 7 tokens, the last
    shard short). RoBERTa's position ids, a cumsum of the padding along the sequence, are each
    device's running sum plus the earlier devices' totals."""
    torch.manual_seed(0)
    built = _model(name).double()
    for n, lengths, pm, model, eager in context_parallel_copies(built, lambda seq: _inputs(name, seq)):
        assert pm.code.count("dpcompile_runtime_attention_regathered(") == n  # keys and values gathered by each device
        if name == "roberta":
            assert pm.code.count("dpcompile_runtime_running_sum(") == n
        for seq in lengths:
            _assert_step_equals_eager(name, pm, model, eager, _inputs(name, seq, seed=seq))


@pytest.mark.slow
def test_context_parallel_decoder_padding_and_sliding_window_equal_eager():
    """A decoder with a padding mask (left padding, 3 tokens of the first row) and a sliding window of
    3 tokens (it crosses the shards' borders), built once, on 2 and 4 virtual devices: the causal
    mask is an explicit one, split by query rows; logits, loss and every gradient equal eager's."""

    def inputs(seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
        kwargs = _inputs("mistral", seq, seed)
        kwargs["attention_mask"] = torch.ones(2, seq, dtype=torch.long)
        kwargs["attention_mask"][0, :3] = 0
        return kwargs

    torch.manual_seed(0)
    built = _model("mistral", sliding_window=3).double()
    unwindowed = copy.deepcopy(built)
    unwindowed.config.sliding_window = None
    probe = inputs(13, seed=13)
    unpadded = {k: v for k, v in probe.items() if k != "attention_mask"}
    # both change eager's logits: equal to eager means both were applied
    assert not torch.allclose(built(**probe).logits, unwindowed(**probe).logits)
    assert not torch.allclose(built(**probe).logits, built(**unpadded).logits)
    for n, lengths, pm, model, eager in context_parallel_copies(built, inputs):
        assert pm.code.count("dpcompile_runtime_attention_regathered(") == n
        assert pm.code.count("attn_mask = ") == n  # each device's attention reads its query rows of the mask
        for seq in lengths:
            assert_lm_step_equals_eager(pm, eager, inputs(seq, seed=seq), model_gradients(model))
            model.zero_grad()
            eager.zero_grad()


def _vit(image_size: int) -> nn.Module:
    T = import_or_skip("transformers")
    return T.ViTForImageClassification(T.ViTConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=4, intermediate_size=64, image_size=image_size,
        patch_size=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("image_size", "n"), [(12, 2), (16, 4)])
def test_context_parallel_vit_splits_the_sequence_it_makes(image_size, n):
    """A ViT makes its sequence inside (patches, then a CLS token): the image goes whole to every
    device and the split starts at the first layer's input (after the position embeddings), views
    reading the shard's length. 9 patches and CLS (10 tokens) divide 2 devices; 16 and CLS (17) do
    not divide 4 (n * n + 1 never does). Logits, loss and every gradient equal eager."""
    torch.manual_seed(0)
    model = _vit(image_size).double()
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(image_size)
    inputs = {"pixel_values": torch.randn(2, 3, image_size, image_size, generator=g, dtype=torch.float64),
              "labels": torch.tensor([0, 2])}  # fmt: skip
    pm = dpcompile.transform(model, ["cpu"] * n, mesh={"cp": n}, example_kwargs=inputs, frontend="export")
    assert pm.code.count("dpcompile_runtime_attention_regathered(") == n
    assert "dpcompile_runtime_scatter(pixel_values" not in pm.code  # the image is whole on every device
    assert_lm_step_equals_eager(pm, eager, inputs, model_gradients(model))
