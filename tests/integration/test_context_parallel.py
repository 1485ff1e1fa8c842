"""Context parallelism in one process (``mesh={"cp": N}``): the sequence split over virtual
devices with no annotations, attention's keys and values all-gathered. Outputs, the loss and
every gradient equal the eager model (float64), for sequence lengths that divide the devices
and that do not; a sequence-indexed table that no rule splits is refused by name.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile import DpCompileError
from dpcompile.analysis.memory import parse_budget
from tests.helpers import (
    assert_lm_step_equals_eager,
    assert_square_sum_step_equals_eager,
    context_parallel_copies,
    model_gradients,
)
from tests.thirdparty import import_or_skip

V = 64  # vocabulary


class CausalSelfAttention(nn.Module):
    """One causal attention block over ``(batch, seq, 16)``, positions from ``arange``."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.pos = nn.Embedding(32, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        h = x + self.pos(torch.arange(s, device=x.device))
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(b, s, d)) + h


class CachedRotaryTable(CausalSelfAttention):
    """Rotary-style scaling read from a cached table sliced by the sequence length (``reverse``:
    read backwards, which no rule splits: each device would need another device's rows)."""

    def __init__(self, reverse: bool = False):
        super().__init__()
        self.reverse = reverse
        self.register_buffer("cos_cached", torch.randn(32, 8))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        cos = self.cos_cached[: q.shape[2]]
        if self.reverse:
            cos = cos.flip(0)
        a = F.scaled_dot_product_attention(q * cos, k * cos, v, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(b, s, d))


class PaddedSelfAttention(CausalSelfAttention):
    """Bidirectional attention with a padding mask of one query row, ``(b, 1, 1, seq)``."""

    def forward(self, x, keep):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        return self.out(a.transpose(1, 2).reshape(b, s, d))


class LeftPaddedPositions(CausalSelfAttention):
    """Positions counted over the tokens a padding mask keeps (``cumsum`` along the sequence, as
    RoBERTa numbers its positions), then bidirectional attention over the kept keys."""

    def forward(self, x, keep):
        b, s, d = x.shape
        positions = torch.cumsum(keep.long(), 1) * keep
        h = x + self.pos(positions)
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep.bool()[:, None, None, :])
        return self.out(a.transpose(1, 2).reshape(b, s, d))


def assert_blocks_over_cp_mesh_equal_eager(mesh, context_parallel: dict, in_code: str, not_in_code: str = "") -> None:
    """Run on each rank of a ``("cp",)`` gloo mesh of 2: a causal block and a padding-mask block at 7
    tokens (4 and 3) with ``context_parallel=``: this rank's output and every gradient equal eager,
    each program's code holding ``in_code`` (and not ``not_in_code``)."""
    import torch.distributed as dist

    from dpcompile.mesh import local_batch

    mine = torch.tensor_split(torch.arange(7), 2)[dist.get_rank()]
    x = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 1:3] = False
    for model, args in ((CausalSelfAttention().double(), (x,)), (PaddedSelfAttention().double(), (x, keep))):
        eager = copy.deepcopy(model)
        pm = dpcompile.transform(model, mesh, example_inputs=local_batch(args, mesh), context_parallel=context_parallel)
        assert in_code in pm.code and not (not_in_code and not_in_code in pm.code), pm.code
        got, want = pm(*local_batch(args, mesh)), eager(*args)
        torch.testing.assert_close(got, want[:, mine])
        weights = torch.linspace(0.5, 1.5, want.numel(), dtype=torch.float64).view(want.shape)
        (got * weights[:, mine]).sum().backward()
        (want * weights).sum().backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name, model=model: f"{type(model).__name__}.{name}: {m}")


def _transformers_model(name: str) -> nn.Module:
    T = import_or_skip("transformers")
    if name == "gpt2":
        config = T.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=V, n_positions=32, resid_pdrop=0.0,
                              embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
        return T.GPT2LMHeadModel(config)
    if name == "llama":
        config = T.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=64, vocab_size=V, max_position_embeddings=32, use_cache=False,
                               bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
        return T.LlamaForCausalLM(config)
    config = T.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                          vocab_size=V, max_position_embeddings=32, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, pad_token_id=0)  # fmt: skip
    return T.BertForSequenceClassification(config)


def _inputs(name: str, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kwargs = {"input_ids": torch.randint(1, V, (2, seq), generator=g)}
    if name == "bert":
        mask = torch.ones(2, seq, dtype=torch.long)
        mask[0, seq - 3 :] = 0  # padding on the last device's tokens
        kwargs.update(attention_mask=mask, labels=torch.tensor([0, 1]))
    else:
        kwargs["labels"] = torch.randint(0, V, (2, seq), generator=g)
    return kwargs


def assert_step_equals_eager(pm: nn.Module, model: nn.Module, eager: nn.Module, inputs: dict) -> None:
    """Outputs, loss and every parameter gradient of one step equal eager's."""
    assert_lm_step_equals_eager(pm, eager, inputs, model_gradients(model))
    model.zero_grad()
    eager.zero_grad()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_context_parallel_transformers_equal_eager(name):
    """GPT-2 (labels), Llama (rotary, grouped-query heads) and BERT (a padding mask), built once, on
    2 and 4 virtual devices: a sequence that divides them and one that does not, equal to eager; the
    decoders called with one token too (a program on one device)."""
    torch.manual_seed(0)
    built = _transformers_model(name).double()
    for n, lengths, pm, model, eager in context_parallel_copies(built, lambda seq: _inputs(name, seq)):
        # keys and values gathered by each device, again in backward
        assert pm.code.count("dpcompile_runtime_attention_regathered(") == n
        for seq in lengths:
            assert_step_equals_eager(pm, model, eager, _inputs(name, seq, seed=seq))
        if name != "bert":  # a call of one token: its program runs on one device
            got, want = pm(**_inputs(name, 1, seed=1)), eager(**_inputs(name, 1, seed=1))
            torch.testing.assert_close(got.logits, want.logits)
            torch.testing.assert_close(got.loss, want.loss, equal_nan=True)  # no next token to predict: nan, as eager's


def test_context_parallel_causal_attention_sees_earlier_shards():
    """is_causal=True with the queries split: each shard's queries see every earlier key, on
    3 devices and a length of 7 (shards of 3, 2, 2), outputs and gradients equal eager."""
    torch.manual_seed(0)
    model = CausalSelfAttention().double()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 3, mesh={"cp": 3}, example_inputs=(x,))
    # each device gathers keys and values inside its causal attention call (again in backward)
    assert pm.code.count("dpcompile_runtime_attention_regathered") == 3
    assert "dpcompile_runtime_gather_sequence" not in pm.code
    assert "dpcompile_runtime_batch_arange" in pm.code  # each shard's own query positions
    got, want = pm(x), eager(x)
    assert_square_sum_step_equals_eager(model, eager, got, want)


def test_context_parallel_padding_mask_is_gathered_along_keys():
    """A padding mask of one query row, split with the tokens, is all-gathered along the keys:
    every device's queries skip the padded keys of every device, equal to eager."""
    torch.manual_seed(0)
    model = PaddedSelfAttention().double()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 1:3] = False  # padding on the first device's tokens, read by the second's queries
    pm = dpcompile.transform(model, ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x, keep))
    assert pm.code.count("dpcompile_runtime_gather_sequence") == 1  # the mask; keys and values inside attention
    assert pm.code.count("dpcompile_runtime_attention_regathered") == 2
    got, want = pm(x, keep), eager(x, keep)
    assert_square_sum_step_equals_eager(model, eager, got, want)


def test_context_parallel_positions_counted_over_the_mask_are_each_shards_running_sum():
    """A cumsum of a padding mask along the sequence, split over 3 devices (shards of 3, 2, 2):
    each device adds the earlier devices' totals to its own running sum; equal to eager."""
    torch.manual_seed(0)
    model = LeftPaddedPositions().double()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    keep = torch.ones(2, 7, dtype=torch.long)
    keep[0, :4] = 0  # left padding across the first shard's border
    pm = dpcompile.transform(model, ["cpu"] * 3, mesh={"cp": 3}, example_inputs=(x, keep))
    assert pm.code.count("dpcompile_runtime_running_sum(") == 3
    got, want = pm(x, keep), eager(x, keep)
    assert_square_sum_step_equals_eager(model, eager, got, want)


def test_context_parallel_program_saves_and_exports(tmp_path):
    """A context-parallel program round-trips through torch.save and dpcompile.export / load."""
    model = CausalSelfAttention()
    x = torch.randn(2, 7, 16)
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,))
    torch.save(pm, tmp_path / "pm.pt")
    torch.testing.assert_close(torch.load(tmp_path / "pm.pt", weights_only=False)(x), model(x))
    dpcompile.export(pm, tmp_path / "exported")
    torch.testing.assert_close(dpcompile.load(tmp_path / "exported")(x), model(x))


def test_context_parallel_layout_and_strategy_are_named():
    """pm.layout and pm.strategies say what the cp dimension does."""
    x = torch.randn(2, 6, 16)
    pm = dpcompile.transform(CausalSelfAttention(), ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,))
    assert pm.layout == {"cp": 2}
    assert pm.strategies == {"cp": "context parallel (all-gather keys/values)"}


def test_context_parallel_explain_names_the_exchange_and_activations():
    """explain names the cp dimension, the exchange chosen (and the others) and each device's activations."""
    x = torch.randn(2, 8, 16)
    pm = dpcompile.transform(CausalSelfAttention(), ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,))
    report = dpcompile.explain(pm, x)
    cp = report.context_parallel
    assert (cp["dimension"], cp["size"], cp["exchange"]) == ("cp", 2, "all-gather keys/values")
    assert cp["attention"] == ["scaled_dot_product_attention"]
    assert any("ring" in other for other in cp["not_chosen"])
    assert set(cp["activation_bytes"]) == set(report.devices) and all(b > 0 for b in cp["activation_bytes"].values())
    assert "Context parallel: 'cp' of size 2 splits the sequence (dim 1); exchange: all-gather keys/values" in str(report)
    exchanges = {c.name: c for c in report.collectives if c.kind == "all_gather"}
    assert set(exchanges) == {"scaled_dot_product_attention_keys", "scaled_dot_product_attention_values"}
    keys = exchanges["scaled_dot_product_attention_keys"]
    assert keys.elements == 2 * 2 * 8 * 8  # (batch, heads, seq, head dim): the gathered keys, counted once
    assert (keys.forward, keys.backward) == (128, 256)  # backward gathers again and reduce-scatters the gradients


def test_context_parallel_cached_rotary_table_gives_each_device_its_rows():
    """A table sliced to the sequence length is split with it (each device its own rows), equal to eager."""
    torch.manual_seed(0)
    model = CachedRotaryTable().double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,))
    assert "dpcompile_runtime_rows_of_shard" in pm.code
    torch.testing.assert_close(pm(x), model(x))


def test_context_parallel_unsplit_rotary_table_is_refused_by_name():
    """A table read backwards, which no rule splits, fails loudly naming the value and the
    attention, instead of every device reading the wrong rows."""
    x = torch.randn(2, 6, 16)
    with pytest.raises(DpCompileError, match=r"attention 'scaled_dot_product_attention' cannot run on sequence "
                       r"shards: the value 'flip' .*cos = cos.flip\(0\)"):  # fmt: skip
        dpcompile.transform(CachedRotaryTable(reverse=True), ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,))


def test_context_parallel_refuses_what_it_would_ignore():
    """batch_dim= (the sequence is dim 1) is refused by name; memory_per_device= is checked against the
    planner's prediction of cp2 (a budget below it refused with that peak, one at it builds)."""
    x = torch.randn(2, 6, 16)
    with pytest.raises(ValueError, match="context parallel splits dim 1"):
        dpcompile.transform(CausalSelfAttention(), ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,), batch_dim=0)
    with pytest.raises(DpCompileError, match=r"the layout cp2 does not fit: .* predicted on cpu#0") as caught:
        dpcompile.transform(CausalSelfAttention(), ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,),
                            memory_per_device=1)  # fmt: skip
    least = str(caught.value).split("a budget of at least ")[1].split(",")[0]  # e.g. "13.95 KiB": fits passed back
    pm = dpcompile.transform(CausalSelfAttention(), ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,),
                             memory_per_device=least)  # fmt: skip
    assert pm.layout == {"cp": 2} and 0 < pm.memory_plan.peak <= parse_budget(least)
    (row,) = dpcompile.explain(pm, x).candidates  # the named layout's prediction
    assert (row["name"], row["rejected"], row["predicted_peak_bytes"]) == ("cp2", None, pm.memory_plan.peak)


def test_context_parallel_needs_examples():
    """Without examples there are no shapes to find the sequence and attention's by."""
    with pytest.raises(DpCompileError, match="example_inputs= or example_kwargs="):
        dpcompile.transform(CausalSelfAttention(), ["cpu"] * 2, mesh={"cp": 2})
