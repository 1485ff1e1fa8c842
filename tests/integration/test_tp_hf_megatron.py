"""Megatron-LM's layout on transformers' GPT-2, Llama (rotary embeddings, grouped-query attention)
and BERT through the export frontend, with the automatic plan on 2 devices: per block one
all-reduce after attention and one after the MLP, nothing gathered; the loss computed in the model
on vocab-sharded logits without gathering them; the tied LM head one parameter; three SGD steps
equal eager. Tiny configs, each model transformed once per module."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from tests.thirdparty import import_or_skip

V = 128
BLOCKS = {"gpt2": r"transformer_h_(\d+)_", "llama": r"model_layers_(\d+)_", "bert": r"encoder_layer_(\d+)_"}


def _model(name: str) -> nn.Module:
    T = import_or_skip("transformers")
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=16, resid_pdrop=0.0,
                                              embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))  # fmt: skip
    if name == "llama":  # grouped-query attention (4 heads, 2 kv heads), tied LM head
        return T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                num_key_value_heads=2, intermediate_size=64, vocab_size=V,
                                                max_position_embeddings=16, use_cache=False, tie_word_embeddings=True))  # fmt: skip
    return T.BertModel(T.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                    vocab_size=V, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0), add_pooling_layer=False)  # fmt: skip


def _inputs(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, 8), generator=g)
    return {"input_ids": ids, "labels": ids} if name != "bert" else {"input_ids": ids}


_built: dict[str, tuple] = {}


@pytest.fixture(params=["gpt2", "llama", "bert"])
def built(request):
    """(name, the model's untouched copy, the program) for each model, built once."""
    name = request.param
    if name not in _built:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = _model(name).eval()
            pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_kwargs=_inputs(name))
        _built[name] = (name, model, pm)
    return _built[name]


def _collectives(pm) -> list[tuple[str, str]]:
    kinds = {"reduce_to_device": "all_reduce", "gather_to_device": "all_gather"}
    return [(kinds[n.target.__name__], n.name) for n in pm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "__name__", "") in kinds]  # fmt: skip


def test_one_all_reduce_after_attention_and_one_after_the_mlp_per_block(built):
    name, model, pm = built
    per_block: dict[str, list[str]] = {}
    for kind, node in _collectives(pm):
        if m := re.match(BLOCKS[name], node):
            per_block.setdefault(m.group(1), []).append(kind)
    assert per_block == {"0": ["all_reduce", "all_reduce"], "1": ["all_reduce", "all_reduce"]}, per_block
    whole = {p: why for p, why in pm.plan_reasons.items() if pm.plan[p] == "replicate"}
    assert all(why for why in whole.values()), whole


def test_loss_in_the_model_never_gathers_the_logits(built):
    """Only the returned logits are all-gathered; the loss takes each shard's logsumexp and target logit."""
    name, model, pm = built
    if name == "bert":
        pytest.skip("no loss in the model")
    gathers = [node for kind, node in _collectives(pm) if kind == "all_gather"]
    assert len(gathers) == 2 and any("logsumexp" in g for g in gathers), gathers
    assert "cross_entropy_from_parts" in pm.code
    out, want = pm(**_inputs(name, 1)), model(**_inputs(name, 1))
    torch.testing.assert_close(out.loss, want.loss, atol=2e-5, rtol=1e-5)


def test_sharded_bytes_and_per_device_bytes(built):
    name, model, pm = built
    conv1d = tuple({type(m) for m in model.modules() if type(m).__name__ == "Conv1D"})
    layers = {id(p): (f"{path}.{k}", p) for path, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding, *conv1d))
              for k, p in m.named_parameters(recurse=False)}  # fmt: skip
    sharded = sum(p.numel() for key, p in layers.values() if key in pm.param_shards)
    assert sharded / sum(p.numel() for _, p in layers.values()) >= 0.9
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() * 4 for p in params)
    shard_bytes = sum(p.numel() * 4 for _, p in layers.values() if _ in pm.param_shards)
    rest = total - shard_bytes
    assert max(pm.param_bytes_per_slot().values()) <= 1.1 * shard_bytes / 2 + rest


def _three_sgd_steps_equal_eager(pm, reference, inputs_for, loss_of, momentum=0.0):
    """Train ``pm`` and ``reference`` alike for 3 SGD steps (``inputs_for(step)`` the keyword inputs,
    ``loss_of(output)`` the loss): losses equal at every step, state dicts equal after; pm's state dict."""
    opt = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=momentum)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=momentum)
    for step in range(3):
        kwargs = inputs_for(step)
        losses = []
        for program, o in ((pm, opt), (reference, ref_opt)):
            loss = loss_of(program(**kwargs))
            o.zero_grad()
            loss.backward()
            o.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], atol=2e-5, rtol=1e-5)
    got, want = pm.state_dict(), reference.state_dict()
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-4, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")
    return got


def test_three_sgd_steps_equal_eager_and_tied_head_stays_tied(built):
    name, model, pm = built
    pm = copy.deepcopy(pm)
    reference = copy.deepcopy(model)

    def loss_of(out):
        return out.loss if name != "bert" else (out.last_hidden_state * torch.linspace(0.5, 1.5, 32)).pow(2).mean()

    got = _three_sgd_steps_equal_eager(pm, reference, lambda step: _inputs(name, step), loss_of, momentum=0.9)
    if name != "bert":  # one parameter per shard for both uses; both keys give the same full tensor
        emb = "transformer.wte.weight" if name == "gpt2" else "model.embed_tokens.weight"
        for head, table in zip(pm.param_shards["lm_head.weight"][1], pm.param_shards[emb][1]):
            assert pm.get_parameter(head) is pm.get_parameter(table)
        torch.testing.assert_close(got["lm_head.weight"], got[emb], atol=0, rtol=0)


def test_gqa_heads_that_do_not_split_alike_say_why():
    """6 heads over 3 kv heads on 2 devices: kv heads 2 + 1 repeat to 4 + 2 query heads, the query
    projection splits 3 + 3; attention stays whole and plan_reasons says why."""
    T = import_or_skip("transformers")
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=1, hidden_size=48, num_attention_heads=6,
                                             num_key_value_heads=3, intermediate_size=64, vocab_size=V,
                                             max_position_embeddings=16, use_cache=False)).eval()  # fmt: skip
    attn = "model.layers.0.self_attn"
    plan = {f"{attn}.q_proj": "column", f"{attn}.k_proj": "column", f"{attn}.v_proj": "column", f"{attn}.o_proj": "row"}
    kwargs = {"input_ids": torch.randint(0, V, (2, 8))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=plan, example_kwargs=kwargs)
    assert pm.plan[f"{attn}.q_proj"] == "replicate"
    assert "num_key_value_heads must divide" in pm.plan_reasons[f"{attn}.q_proj"]
    torch.testing.assert_close(pm(**kwargs).logits, model(**kwargs).logits, atol=2e-5, rtol=1e-4)


class _RotaryGQAttention(nn.Module):
    """Llama's attention written with torch functions (the fx frontend): rotate_half by ``x[..., :d]``
    slices, ``torch.cat`` and ``neg``, cos / sin ``unsqueeze``d over heads, kv heads repeated with
    ``repeat_interleave``, casts and dropout on the sharded values."""

    def __init__(self, d: int = 32, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv_heads, d // heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd)))

    @staticmethod
    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    def forward(self, x):
        b, t, _ = x.shape
        freqs = torch.arange(t, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None].unsqueeze(1), emb.sin()[None].unsqueeze(1)
        q = self.q(x).view(b, t, -1, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, -1, self.hd).transpose(1, 2).to(torch.float32)
        v = self.v(x).view(b, t, -1, self.hd).transpose(1, 2).contiguous()
        q = (q * cos + self.rotate_half(q) * sin).type_as(x)
        k = k * cos + self.rotate_half(k) * sin
        k = k.repeat_interleave(self.heads // self.kv, dim=1)
        v = v[:, :, None].expand(b, self.kv, self.heads // self.kv, t, self.hd).reshape(b, self.heads, t, self.hd)
        y = F.dropout(F.scaled_dot_product_attention(q, k, v, is_causal=True), 0.0, self.training)
        return self.o(y.transpose(1, 2).reshape(b, t, -1).clone())


def test_rotary_gqa_attention_in_torch_functions_is_megatron_style():
    torch.manual_seed(0)
    model = _RotaryGQAttention()
    x = torch.randn(2, 6, 32)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    assert pm.plan == {"q": "column", "k": "column", "v": "column", "o": "row"}
    assert [kind for kind, _ in _collectives(pm)] == ["all_reduce"]
    torch.testing.assert_close(pm(x), model(x), atol=2e-5, rtol=1e-4)


class _ConcatHeads(nn.Module):
    """Concatenates the head-sharded q with itself along the heads dim: that needs the whole q."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(16, 16), nn.Linear(32, 16)

    def forward(self, x):
        q = self.q(x).view(2, 4, 4, 4).transpose(1, 2)
        both = torch.cat([q, q[:, :1].expand(2, 4, 4, 4)[:, :4]], dim=1)  # along the sharded heads
        return self.o(both.transpose(1, 2).reshape(2, 4, 32))


def test_cat_or_slice_along_the_sharded_dim_gathers_and_stays_equal():
    torch.manual_seed(0)
    model = _ConcatHeads()
    x = torch.randn(2, 4, 16)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel={"q": "column", "o": "row"}, example_inputs=(x,))
    assert "all_gather" in [kind for kind, _ in _collectives(pm)]
    torch.testing.assert_close(pm(x), model(x), atol=2e-5, rtol=1e-4)


def test_t5_position_bias_sliced_by_heads_and_three_steps_equal_eager():
    """T5's relative position bias (one per head, the attention mask) is sliced for each shard's
    heads, not a reason to gather q, k, v: two all-reduces per encoder block, three per decoder
    block (self-attention, cross-attention, MLP), no all-gather; three SGD steps equal eager."""
    T = import_or_skip("transformers")
    torch.manual_seed(0)
    model = T.T5ForConditionalGeneration(T.T5Config(num_layers=1, num_decoder_layers=1, d_model=32, d_kv=8, num_heads=4,
                                                    d_ff=64, vocab_size=V, dropout_rate=0.0, use_cache=False,
                                                    decoder_start_token_id=0)).eval()  # fmt: skip
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    kwargs = {"input_ids": torch.randint(0, V, (2, 8), generator=g), "decoder_input_ids": torch.randint(0, V, (2, 5), generator=g)}
    plan = {}  # Megatron's plan, given (the automatic search over T5 takes tens of seconds; the benchmark runs it)
    for path, _ in model.named_modules():
        if path.endswith(("SelfAttention", "EncDecAttention")):
            plan.update({f"{path}.q": "column", f"{path}.k": "column", f"{path}.v": "column", f"{path}.o": "row"})
        elif path.endswith("DenseReluDense"):
            plan.update({f"{path}.wi": "column", f"{path}.wo": "row"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=plan, example_kwargs=kwargs)
    assert {pm.plan[p] for p in plan} == {"column", "row"}
    per_block: dict[str, list[str]] = {}
    for kind, node in _collectives(pm):
        if m := re.match(r"((?:en|de)coder_block_\d+)_", node):
            per_block.setdefault(m.group(1), []).append(kind)
    assert per_block == {"encoder_block_0": ["all_reduce"] * 2, "decoder_block_0": ["all_reduce"] * 3}, per_block
    # the state dict keys include `shared.weight`, tied to the embeddings forward reads
    _three_sgd_steps_equal_eager(
        pm, reference, lambda step: kwargs, lambda out: (out.logits * torch.linspace(0.5, 1.5, V)).pow(2).mean()
    )
