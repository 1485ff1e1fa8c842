"""Sequence parallel x tensor parallel (``tensor_parallel=True, sequence_parallel=True``) on more
transformers models, tiny configs, random weights, no annotation, the export frontend: Mistral,
Qwen2 (QKV bias), Gemma (float32 norms, scaled embedding), Phi (partial rotary, parallel attention
and MLP), decoders with a padding mask and ``labels=``; a T5 encoder (relative position bias, a
padding mask, no labels), BERT and RoBERTa (padding masks, cumsum positions, a classifier on the
CLS token) and a ViT (its sequence made inside). Training, every ``nn.Dropout`` at 0.1 (drawn
exactly). Outputs, the loss and every gradient equal eager (float64) on a length that divides the
devices and one that does not; where a row layer's output has no sequence (a classifier), it stays
an all-reduce and ``pm.plan_reasons`` says why. GPT-2 and Llama: ``test_sequence_parallel.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dpcompile
from tests.helpers import full_gradients
from tests.integration.test_context_parallel import _inputs as _bert_inputs
from tests.integration.test_context_parallel import _transformers_model as _bert
from tests.integration.test_context_parallel_models import _inputs as _more_inputs
from tests.integration.test_context_parallel_models import _model, _vit

DECODERS = ("mistral", "qwen2", "gemma", "phi")
IMAGE = {2: 12, 4: 16}  # a ViT's tokens: 9 patches and CLS (10, divides 2), 16 and CLS (17, divides no 4)
#: (reduce-scatters, all-gathers): the lookups and each row layer; the norms before a column layer.
#: Gemma's tied embedding and head stay whole and run on the shards (its ids split, no collective);
#: Phi's one norm feeds attention and MLP; at 4 devices RoBERTa's 2 token types do not split.
COLLECTIVES = {"mistral": (3, 3), "qwen2": (3, 3), "gemma": (2, 2), "phi": (3, 2), "t5": (3, 2), "roberta": (5, 2),
               "bert": (5, 2), "vit": (2, 2)}  # fmt: skip
#: the row layers whose output has no sequence: tensor parallel alone there (an all-reduce)
ALL_REDUCED = {"roberta": "classifier.out_proj", "bert": "classifier", "vit": "classifier"}


def _build(name: str, n: int) -> nn.Module:
    model = _bert("bert") if name == "bert" else _vit(IMAGE[n]) if name == "vit" else _model(name)
    for module in model.modules():
        if isinstance(module, nn.Dropout):  # the configs' hidden dropout: on sequence shards
            module.p = 0.1
    return model.double().train()


def _inputs(name: str, n: int, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    if name == "vit":
        g = torch.Generator().manual_seed(seed)
        return {"pixel_values": torch.randn(2, 3, IMAGE[n], IMAGE[n], generator=g, dtype=torch.float64),
                "labels": torch.tensor([0, 2])}  # fmt: skip
    inputs = _bert_inputs(name, seq, seed) if name == "bert" else _more_inputs(name, seq, seed)
    if name in DECODERS:  # right padding on row 0: on the last device's tokens
        inputs["attention_mask"] = torch.ones(2, seq, dtype=torch.long)
        inputs["attention_mask"][0, seq - 2 :] = 0
    return inputs


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "n"),
    [("mistral", 2), ("qwen2", 2), ("gemma", 2), ("phi", 4), ("t5", 2), ("roberta", 2), ("bert", 2), ("vit", 2),
     ("vit", 4)],
)  # fmt: skip
def test_sequence_parallel_more_models_equal_eager(name, n):
    """One program per case, built at 12 tokens and called at 13 and 12 (a ViT: its one length):
    outputs, loss and every gradient equal eager's. transformers computes a decoder's loss in float32
    (and Gemma its norms): their gradients, through it, to float32 rounding."""
    torch.manual_seed(0)
    model = _build(name, n)
    eager = copy.deepcopy(model)
    example = _inputs(name, n, 12)
    dynamic = {k: [1] for k, v in example.items() if v.dim() == 2}  # the sequence varies between calls
    pm = dpcompile.transform(model, ["cpu"] * n, tensor_parallel=True, sequence_parallel=True, frontend="export",
                             example_kwargs=example, dynamic_dims=dynamic or None)  # fmt: skip
    assert (pm.code.count("reduce_scatter_to_devices("), pm.code.count("all_gather_to_devices(")) == COLLECTIVES[name]
    assert pm.strategies == {"tp": "tensor parallel with sequence parallel"}
    if name in ALL_REDUCED:
        assert "not on sequence shards: its output (2, " in pm.plan_reasons[ALL_REDUCED[name]]
        assert pm.code.count("reduce_to_device(") == 1
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if name in DECODERS else {}
    for seq in (13, 12) if name != "vit" else (IMAGE[n],):
        inputs = _inputs(name, n, seq, seed=seq)
        torch.manual_seed(seq)
        got = pm(**inputs)
        torch.manual_seed(seq)
        want = eager(**inputs)
        key = "last_hidden_state" if name == "t5" else "logits"
        out, expected = getattr(got, key), getattr(want, key)
        torch.testing.assert_close(out, expected)
        loss, expected_loss = (got.loss, want.loss) if name != "t5" else (0.0, 0.0)
        torch.testing.assert_close(loss, expected_loss)
        weights = torch.linspace(0.5, 1.5, expected.numel(), dtype=torch.float64).view(expected.shape)
        (loss + (out * weights).sum()).backward()
        (expected_loss + (expected * weights).sum()).backward()
        grads = full_gradients(pm)
        for p_name, p in eager.named_parameters():
            assert grads.get(p_name) is not None, f"no gradient reached {p_name}"
            torch.testing.assert_close(grads[p_name], p.grad, **tolerance, msg=lambda m, p_name=p_name: f"grad {p_name}: {m}")
        pm.zero_grad()
        eager.zero_grad()
