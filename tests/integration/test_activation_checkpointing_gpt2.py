"""``activation_checkpointing=True`` on a transformers GPT-2 (tiny config, random weights, float64)
through the export frontend: each block ``transformer.h.i`` recomputed in backward, the loss and
every gradient equal eager's with data parallelism, tensor parallelism and a pipeline."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import dpcompile
from dpcompile.capture import capture_model
from tests.helpers import full_gradients
from tests.thirdparty import import_or_skip

V = 64
pytestmark = pytest.mark.slow  # one torch.export of GPT-2: ~10 s


@pytest.fixture(scope="module")
def gpt2():
    T = import_or_skip("transformers")
    torch.manual_seed(0)
    config = T.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=V, n_positions=16, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)  # fmt: skip
    reference = T.GPT2LMHeadModel(config).double()
    g = torch.Generator().manual_seed(0)
    kwargs = {"input_ids": torch.randint(1, V, (4, 8), generator=g), "labels": torch.randint(0, V, (4, 8), generator=g)}
    expected = reference(**kwargs)
    expected.loss.backward()
    model = copy.deepcopy(reference)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported, _ = capture_model(model, frontend="export", example_kwargs=kwargs)  # once: each layout lowers it
    return reference, model, exported, kwargs, expected


@pytest.mark.parametrize("layout", [{}, {"tensor_parallel": True}, {"pipeline": 2}])
@pytest.mark.xdist_group("activation_checkpointing_gpt2")  # its tests share the module's GPT-2 export: one worker builds it
def test_activation_checkpointing_gpt2_equals_eager(gpt2, layout):
    """Every block recomputed: loss and every gradient as eager's, the blocks' checkpoint calls in the code."""
    reference, model, exported, kwargs, expected = gpt2
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(exported, ["cpu"] * 2, example_kwargs=kwargs, activation_checkpointing=True, **layout)
    assert "transformer.h.0" in pm.strategies["activation_checkpointing"]
    assert "= dpcompile_runtime_checkpoint(transformer_h_1" in pm.code
    out = pm(**kwargs)
    out.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss)
    got = full_gradients(pm) if layout.get("tensor_parallel") else {n: p.grad for n, p in model.named_parameters()}
    for name, q in reference.named_parameters():
        torch.testing.assert_close(got[name], q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


@pytest.mark.xdist_group("activation_checkpointing_gpt2")
def test_auto_save_rule_gpt2_equals_eager(gpt2):
    """``save="auto"`` on GPT-2's ``Conv1D`` projections, priced per row by their sizes: of c_attn (3d),
    attention (d), c_proj (d) and c_fc (4d), half the width (4.5d) keeps attention, then c_attn (the
    most FLOPs that fit); the loss and every gradient equal eager's."""
    reference, model, exported, kwargs, expected = gpt2
    model.zero_grad()
    spec = {"regions": True, "save": "auto", "budget": 0.5}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(exported, ["cpu"] * 2, example_kwargs=kwargs, activation_checkpointing=spec)
    assert "budget 0.5" in pm.strategies["activation_checkpointing"]
    regions = [m for n, m in pm.named_children() if n.endswith("_region")]
    assert len(regions) == 4  # 2 blocks x 2 devices
    for region in regions:
        lines = region.code.splitlines()
        marked = [lines[i + 1] for i, line in enumerate(lines[:-1]) if "keep_outputs(True)" in line]
        assert len(marked) == 2
        assert ".attn.c_attn(" in marked[0] and "scaled_dot_product_attention" in marked[1]
    _assert_loss_and_gradients_equal_eager(pm, kwargs, expected, model, reference)


@pytest.mark.xdist_group("activation_checkpointing_gpt2")
def test_mlp_token_tiles_gpt2_equals_eager(gpt2):
    """Each block's MLP (``Conv1D`` -> GELU written out in aten ops -> ``Conv1D``) in 2 token tiles
    keeping c_fc's output, on two devices; the loss and every gradient equal eager's."""
    reference, model, exported, kwargs, expected = gpt2
    model.zero_grad()
    spec = {"regions": ["transformer.h.0.mlp", "transformer.h.1.mlp"], "save": "matmuls", "tiles": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(exported, ["cpu"] * 2, example_kwargs=kwargs, activation_checkpointing=spec)
    assert pm.code.count("dpcompile_runtime_token_tiles(") == 4  # 2 blocks x 2 devices
    assert "transformer_h_1_mlp_dev1_tile1 = dpcompile_runtime_checkpoint(transformer_h_1_mlp_dev1_region" in pm.code
    _assert_loss_and_gradients_equal_eager(pm, kwargs, expected, model, reference)


@pytest.mark.xdist_group("activation_checkpointing_gpt2")
def test_checkpointing_one_block_under_dp_tp_equals_eager(gpt2):
    """``transformer.h.0`` recomputed under ``dp x tp`` (``cp x tp``: test_context_parallel_tp.py): one
    region per copy, across its shards (the shards' nodes get their stage the way the stamped ones
    have it, so a block's residual adds and its sharded layers are one region, not regions that read
    each other's outputs)."""
    reference, model, exported, kwargs, expected = gpt2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(exported, ["cpu"] * 4, mesh={"dp": 2, "tp": 2}, example_kwargs=kwargs,
                                 activation_checkpointing=["transformer.h.0"])  # fmt: skip
    regions = [m for n, m in pm.named_children() if n.endswith("_region")]
    assert len(regions) == 2  # one per copy (its two micro-batches' shards)
    for region in regions:
        assert "weight_shard0" in region.code and "weight_shard1" in region.code
    out = pm(**kwargs)
    out.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss)
    got = full_gradients(pm)
    for name, q in reference.named_parameters():
        torch.testing.assert_close(got[name], q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


def _assert_loss_and_gradients_equal_eager(pm, kwargs, expected, model, reference) -> None:
    """One step of ``pm``: its loss equals eager's and every gradient of ``model`` equals ``reference``'s."""
    out = pm(**kwargs)
    out.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss)
    for name, q in reference.named_parameters():
        got = dict(model.named_parameters())[name].grad
        torch.testing.assert_close(got, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")
