"""Tensor parallelism on the transformers people use: Conv1D, fused qkv, vocab-parallel
embeddings with a tied LM head, timm / torchvision ViTs; the optimizer trap made loud."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from tests.thirdparty_tp import (
    GPT2MLP,
    FusedChunkAttention,
    GPT2Block,
    TinyGPT2,
    TinyGPT2WithLoss,
    conv1d,
    import_vision,
)

pytest.importorskip("transformers")


def _train_both(pm, reference, inputs, steps: int = 3, lr: float = 0.1) -> None:
    """Three SGD steps of ``pm`` and of ``reference``: outputs, and state after, equal.

    (SGD, not Adam: Adam scales gradients that are zero up to rounding, such as a key bias's
    under softmax, to full-size steps, so rounding alone would tell the runs apart.)"""
    opt = torch.optim.SGD(pm.parameters(), lr=lr, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr, momentum=0.9)
    for _ in range(steps):
        out, want = pm(*inputs), reference(*inputs)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
        for o, loss in ((opt, out), (ref_opt, want)):
            o.zero_grad()
            (loss.float() ** 2).mean().backward()
            o.step()
    got, ref = pm.state_dict(), reference.state_dict()
    assert list(got) == list(ref)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], atol=1e-4, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


def _sharded_fraction(pm, model) -> float:
    """Bytes of Linear-like and embedding weights that are sharded, over all of them."""
    kinds = (nn.Linear, nn.Embedding, conv1d())
    seen, total, sharded = set(), 0, 0
    for path, m in model.named_modules():
        if isinstance(m, kinds):
            for name, p in m.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                key = f"{path}.{name}" if path else name
                total += p.numel()
                sharded += p.numel() * (key in pm.param_shards)
    return sharded / total


def test_conv1d_column_and_row():
    """transformers' Conv1D (weight (in, out)) is split column then row: weights cut on the right dims."""
    mlp = GPT2MLP(16)
    x = torch.randn(2, 5, 16)
    pm = dpcompile.transform(mlp, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    assert pm.plan == {"c_fc": "column", "c_proj": "row"}
    assert tuple(pm.c_fc.weight_shard0.shape) == (16, 32) and tuple(pm.c_proj.weight_shard0.shape) == (32, 16)
    assert pm.code.count("reduce_to_device") == 1 and "gather_to_device" not in pm.code
    _train_both(pm, copy.deepcopy(mlp), (x,))


def test_conv1d_explicit_plan_names_it():
    """A plan may name a Conv1D layer like an nn.Linear."""
    mlp = GPT2MLP(8)
    x = torch.randn(3, 8)
    pm = dpcompile.transform(mlp, ["cpu"] * 2, tensor_parallel={"c_fc": "row"}, example_inputs=(x,))
    assert pm.plan["c_fc"] == "row" and pm.plan["c_proj"] == "replicate"
    torch.testing.assert_close(pm(x), mlp(x))


def test_fused_qkv_split_sharded_per_section():
    """GPT-2's c_attn(x).split(C, 2): each shard holds whole heads of q, k and v, no gather."""
    block = GPT2Block(16, 4)
    x = torch.randn(2, 5, 16)
    pm = dpcompile.transform(block, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    assert pm.plan["attn.c_attn"] == "column" and pm.plan["attn.c_proj"] == "row"
    spec, _ = pm.param_shards["attn.c_attn.weight"]
    assert spec.sections == 3 and spec.sizes == (24, 24)
    assert pm.code.count("reduce_to_device") == 2 and "gather_to_device" not in pm.code  # Megatron: 2 per block
    assert "split(8, dim = 2)" in pm.code  # the local section width
    _train_both(pm, copy.deepcopy(block), (x,))


def test_fused_qkv_chunk_uneven_heads():
    """chunk(3) of a fused Linear with 3 heads on 2 shards: 2 heads + 1 head of each of q, k, v."""
    m = FusedChunkAttention()
    x = torch.randn(2, 4, 12)
    pm = dpcompile.transform(m, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    assert pm.plan == {"qkv": "column", "out": "row"}
    assert pm.param_shards["qkv.weight"][0].sizes == (24, 12)
    _train_both(pm, copy.deepcopy(m), (x,))


def test_tied_embedding_and_lm_head_stay_tied():
    """Vocab-parallel embedding + tied LM head: one parameter per shard, grads from both uses, 3 steps equal eager."""
    model = TinyGPT2()
    ids = torch.randint(0, 128, (2, 8))
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(ids,))
    assert pm.plan["wte"] == "vocab" and pm.plan["lm_head"] == "column"
    assert pm.wte.weight_shard0 is pm.lm_head.weight_shard0  # one parameter, as in the model
    assert pm.code.count("masked_embedding") == 4  # two embeddings x two shards
    _train_both(pm, copy.deepcopy(model), (ids,))
    sd = pm.state_dict()
    torch.testing.assert_close(sd["wte.weight"], sd["lm_head.weight"])
    assert _sharded_fraction(pm, model) >= 0.9


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_cross_entropy_never_gathers_logits(reduction):
    """F.cross_entropy on vocab-sharded logits: logsumexp parts gathered, the logits never; 3 steps equal eager."""

    class LM(TinyGPT2WithLoss):
        def forward(self, ids, labels):
            logits = TinyGPT2.forward(self, ids)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), reduction=reduction)

    model = LM(layers=1)
    ids = torch.randint(0, 128, (2, 8))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100  # ignored
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(ids, labels))
    assert pm.plan["lm_head"] == "column"
    gathers = [line for line in pm.code.splitlines() if "gather_to_device" in line]
    assert len(gathers) == 1 and "logsumexp" in gathers[0], gathers
    _train_both(pm, copy.deepcopy(model), (ids, labels), lr=1e-3)


def test_tied_head_left_whole_keeps_embedding_whole():
    """A plan that keeps the tied head whole keeps the embedding whole too, and says why."""
    model = TinyGPT2(layers=1)
    ids = torch.randint(0, 128, (2, 8))
    pm = dpcompile.transform(
        model, ["cpu"] * 2, tensor_parallel={"wte": "vocab", "lm_head": "replicate"}, example_inputs=(ids,)
    )
    assert pm.plan["wte"] == "replicate"
    assert "tied to the LM head 'lm_head'" in pm.plan_reasons["wte"]
    assert pm.wte.weight is pm.lm_head.weight
    _train_both(pm, copy.deepcopy(model), (ids,))


def test_masked_embedding_padding_idx():
    """A vocab-parallel embedding with padding_idx: same output, and no gradient for the padding row."""
    model = nn.Sequential(nn.Embedding(10, 4, padding_idx=7), nn.Tanh())
    ids = torch.tensor([[7, 1, 9, 3]])
    pm = dpcompile.transform(model, ["cpu"] * 3, tensor_parallel=True, example_inputs=(ids,))
    assert pm.plan == {"0": "vocab"}
    _train_both(pm, copy.deepcopy(model), (ids,))
    torch.testing.assert_close(pm.state_dict()["0.weight"][7], model[0].weight[7].detach())  # never trained


def test_optimizer_over_model_parameters_is_loud():
    """The trap: an optimizer built over the original model's parameters raises at step, naming pm.parameters()."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pm(torch.randn(3, 4)).sum().backward()
    with pytest.raises(dpcompile.DpCompileError, match=r"pm\.parameters\(\)"):
        opt.step()
    model(torch.randn(3, 4)).sum().backward()  # the model used eagerly still trains
    opt.step()
    torch.optim.SGD(pm.parameters(), lr=0.1).step()


def test_layers_left_whole_say_why():
    """Every Linear-like or embedding layer left whole has a reason a user can act on."""
    model = TinyGPT2(layers=1)
    ids = torch.randint(0, 128, (2, 8))
    pm = dpcompile.transform(model, ["cpu"] * 3, tensor_parallel=True, example_inputs=(ids,))  # 4 heads over 3
    for path, style in pm.plan.items():
        if style == "replicate":
            reason = pm.plan_reasons[path]
            assert reason and reason != "replicate: left whole", (path, reason)


@pytest.fixture(scope="module")
def vision():
    import_vision()


class _Call(nn.Module):
    """``forward(x)`` only: timm's forward has an optional ``attn_mask`` the tracer keeps."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x)


def test_timm_vit_megatron_layout(vision):
    """timm ViT (tiny config): qkv column per section, proj row, fc1 column, fc2 row; 2 all-reduces per block."""
    import timm

    model = _Call(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                                    num_classes=10, embed_dim=64, num_heads=4))  # fmt: skip
    x = torch.randn(2, 3, 32, 32)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    for b in range(2):
        assert pm.plan[f"m.blocks.{b}.attn.qkv"] == "column" and pm.plan[f"m.blocks.{b}.attn.proj"] == "row"
    assert "gather_to_device" not in pm.code
    assert pm.code.count("reduce_to_device") == 2 * 2 + 1  # two per block, and the head
    assert _sharded_fraction(pm, model) >= 0.9
    _train_both(pm, copy.deepcopy(model), (x,))


def test_torchvision_vit_mha_sharded_by_heads(vision):
    """torchvision ViT: nn.MultiheadAttention written out, in_proj per section, out_proj row; 2 all-reduces per block."""
    import torchvision

    model = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128
    )
    x = torch.randn(2, 3, 32, 32)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    for b in range(2):
        layer = f"encoder.layers.encoder_layer_{b}"
        assert pm.plan[f"{layer}.self_attention"] == "column" and pm.plan[f"{layer}.self_attention.out_proj"] == "row"
        assert pm.param_shards[f"{layer}.self_attention.in_proj_weight"][0].sections == 3
    assert pm.code.count("reduce_to_device") == 2 * 2
    assert _sharded_fraction(pm, model) >= 0.9
    _train_both(pm, copy.deepcopy(model), (x,))


def test_cross_attention_mha_kept_whole_says_why():
    """An nn.MultiheadAttention used as cross-attention stays one call, and plan_reasons says why."""

    class Cross(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 4, batch_first=True)

        def forward(self, x, y):
            return self.attn(x, y, y, need_weights=False)[0]

    model = Cross()
    x, y = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x, y))
    assert pm.plan["attn"] == "replicate" and "not self-attention" in pm.plan_reasons["attn"]
    assert "inside 'attn'" in pm.plan_reasons["attn.out_proj"]
    torch.testing.assert_close(pm(x, y), model(x, y))


def test_torchvision_swin_window_attention_sharded_by_heads(vision):
    """torchvision Swin: qkv/proj inside shifted_window_attention sharded by heads (heads 2 and 4); 3 steps equal eager."""
    import torchvision

    model = torchvision.models.SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                                               window_size=[4, 4], num_classes=10, stochastic_depth_prob=0.0)  # fmt: skip
    x = torch.randn(2, 3, 32, 32)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    for block in ("features.1.0", "features.1.1", "features.3.0", "features.3.1"):
        assert pm.plan[f"{block}.attn.qkv"] == "column" and pm.plan[f"{block}.attn.proj"] == "row"
        assert pm.plan[f"{block}.mlp.0"] == "column" and pm.plan[f"{block}.mlp.3"] == "row"
        name = block.replace(".", "_")
        assert sum(1 for n in pm.graph.nodes if n.name.startswith(name) and n.name.endswith("all_reduce")) == 2
    assert "gather_to_device" not in pm.code
    assert _sharded_fraction(pm, model) >= 0.9
    _train_both(pm, copy.deepcopy(model), (x,))


def test_multihead_attention_dropout_follows_the_mode():
    """An nn.MultiheadAttention with dropout, written out: pm.eval() runs it without dropout, as the model."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 4, dropout=0.5, batch_first=True)

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]

    model = Block()
    x = torch.randn(2, 5, 16)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    assert pm.plan == {"attn": "column", "attn.out_proj": "row"}
    pm.eval()
    model.eval()
    torch.testing.assert_close(pm(x), model(x))
    assert dpcompile.verify(pm, model, x)
