"""Sequence parallelism on the tensor-parallel dimension (``sequence_parallel=True``) in one
process (over a gloo mesh: ``test_sequence_parallel_mesh.py``), alone and with ``dp``: between the column/row pairs, norms, dropout and residual adds run on sequence shards;
the row layer's all-reduce is a reduce-scatter and the next column layer's input an all-gather.
Outputs and every gradient equal eager (float64), for sequence lengths that divide the devices
and that do not; explain shows the activations each device holds with and without.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile import DpCompileError
from tests.helpers import full_gradients
from tests.thirdparty import import_or_skip

V = 64  # vocabulary


class Block(nn.Module):
    """A pre-norm block: two column/row pairs, dropout on the residual branch."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.fc3, self.fc4 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        x = x + self.drop(self.fc2(torch.relu(self.fc1(self.ln1(x)))))
        return x + self.fc4(nn.functional.gelu(self.fc3(self.ln2(x))))


class Stack(nn.Module):
    """Embedding, two blocks, a final norm and an LM head: ``(batch, seq)`` ids to logits."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, V)

    def forward(self, ids):
        return self.head(self.ln(self.blocks(self.emb(ids))))


def _ids(seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (2, seq), generator=torch.Generator().manual_seed(seed))


def _assert_grads_equal(pm: nn.Module, eager: nn.Module) -> None:
    got, want = full_gradients(pm), dict(eager.named_parameters())
    assert set(want) <= set(got)  # got names a tied weight twice too (GPT-2's lm_head and wte)
    for name, p in want.items():
        torch.testing.assert_close(got[name], p.grad, msg=lambda m, name=name: f"grad {name}: {m}")


@pytest.mark.parametrize(("n", "seq"), [(2, 8), (3, 13)])
def test_sequence_parallel_stack_equals_eager_in_training(n, seq):
    """Training mode (dropout drawn exactly): outputs and every gradient equal eager on n devices,
    for a sequence that divides them and one that does not."""
    torch.manual_seed(0)
    model = Stack().double().train()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * n, tensor_parallel=True, sequence_parallel=True, example_inputs=(_ids(seq),))
    ids = _ids(seq, seed=1)
    torch.manual_seed(5)
    got = pm(ids)
    torch.manual_seed(5)
    want = eager(ids)
    torch.testing.assert_close(got, want)
    weights = torch.linspace(0.5, 1.5, want.numel(), dtype=torch.float64).view(want.shape)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    _assert_grads_equal(pm, eager)


def test_sequence_parallel_code_reduce_scatters_and_all_gathers():
    """Every row layer (and the vocab-parallel lookup) reduce-scatters; every column layer's input is
    all-gathered; nothing between the pairs is all-reduced; the norms run once per shard."""
    ids = _ids(8)
    pm = dpcompile.transform(Stack(), ["cpu"] * 2, tensor_parallel=True, sequence_parallel=True, example_inputs=(ids,))
    tp = dpcompile.transform(Stack(), ["cpu"] * 2, tensor_parallel=True, example_inputs=(ids,))
    assert tp.code.count("reduce_to_device(") == 5 and "reduce_scatter" not in tp.code
    assert pm.code.count("reduce_scatter_to_devices(") == 5  # emb, fc2 and fc4 of both blocks
    assert pm.code.count("all_gather_to_devices(") == 5  # ln1, ln2 of both blocks, the final ln
    assert "reduce_to_device(" not in pm.code
    for name in ("blocks_0_fc2_reduce_scatter", "blocks_1_ln2_all_gather", "emb_reduce_scatter", "ln_all_gather"):
        assert f"{name} = " in pm.code
    assert 'getattr(self.blocks, "0").ln1(emb_reduce_scatter_dev1)' in pm.code  # the norm on shard 1's tokens
    assert pm.strategies == {"tp": "tensor parallel with sequence parallel"}


@pytest.mark.parametrize(("kwargs", "n"), [({"tensor_parallel": True}, 2), ({"mesh": {"pp": 2, "tp": 2}}, 4),
                                           ({"mesh": {"dp": 2, "tp": 2}}, 4)])  # fmt: skip
def test_sequence_parallel_norms_read_their_parameters_on_each_device(kwargs, n):
    """On distinct devices (fake CUDA) each shard's norm reads copies of the norm's parameters on its own
    device (``call_module_on_device``), and the program is well placed; on virtual devices it calls the
    module itself, as before."""
    model = Stack().double().train()
    ids = torch.cat([_ids(8), _ids(8, seed=2)])  # 4 rows: 2 per dp copy
    pm = dpcompile.transform(model, ["cpu"] * n, sequence_parallel=True, example_inputs=(ids,), **kwargs)
    assert "call_module_on_device" not in pm.code
    result = dpcompile.verify(pm, model, ids, fake_devices=n)
    assert result, str(result)


def test_sequence_parallel_another_length_at_call_time():
    """A program built on a sequence of 13 runs a call of 12 (shards of 6, 6) equal to eager."""
    model = Stack().eval()
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, sequence_parallel=True, example_inputs=(_ids(13),))
    for seq in (12, 5):
        torch.testing.assert_close(pm(_ids(seq, seed=seq)), model(_ids(seq, seed=seq)))


class EmbeddingDropoutStack(Stack):
    """Dropout straight on the (vocab-parallel) embedding's reduce-scatter, as Phi and T5 have it."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, ids):
        return self.head(self.ln(self.blocks(self.drop(self.emb(ids)))))


def test_sequence_parallel_dropout_at_another_length_at_call_time():
    """Training with dropout at lengths other than the example's 13: each shard takes its slice of the
    single-device mask by the call's own split (it raised: the slices were the example's; a dropout
    straight on a reduce-scatter's pieces still did)."""
    torch.manual_seed(0)
    model = EmbeddingDropoutStack().double().train()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, sequence_parallel=True, example_inputs=(_ids(13),))
    for seq in (12, 5):
        ids = _ids(seq, seed=seq)
        torch.manual_seed(seq)
        got = pm(ids)
        state = torch.get_rng_state()
        torch.manual_seed(seq)
        want = eager(ids)
        torch.testing.assert_close(got, want)
        assert torch.equal(state, torch.get_rng_state())
    got.sum().backward()
    want.sum().backward()
    _assert_grads_equal(pm, eager)


def test_sequence_parallel_explain_shows_the_saving():
    """explain: the collectives, each device's activations with and without sequence parallel, and a
    memory estimate below tensor parallel's on the first device."""
    ids = _ids(16)
    model = Stack()
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, sequence_parallel=True, example_inputs=(ids,))
    tp = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(ids,))
    report, alone = dpcompile.explain(pm, ids), dpcompile.explain(tp, ids)
    sp = report.sequence_parallel
    assert alone.sequence_parallel is None
    assert len(sp["reduce_scatters"]) == 5 and len(sp["all_gathers"]) == 5
    first, second = report.devices
    assert sp["activation_bytes"][first] < sp["activation_bytes_without"][first]
    assert sp["activation_bytes"][second] > sp["activation_bytes_without"][second]
    assert abs(sp["activation_bytes_without"][first] - alone.activation_bytes[first]) < 0.05 * alone.activation_bytes[first]
    peak = max(sp["activation_bytes"].values())
    assert peak < max(alone.activation_bytes.values())
    est, est_alone = report.memory_estimate, alone.memory_estimate
    assert est[first]["activations"] < est_alone[first]["activations"]
    assert "Sequence parallel on 'tp'" in str(report)


def test_sequence_parallel_without_a_sequence_changes_nothing():
    """An MLP on (batch, features): no sequence to split, the tensor-parallel program as it is."""
    mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(4, 8)
    pm = dpcompile.transform(mlp, ["cpu"] * 2, tensor_parallel=True, sequence_parallel=True, example_inputs=(x,))
    tp = dpcompile.transform(mlp, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    assert pm.code == tp.code
    torch.testing.assert_close(pm(x), mlp(x))


class FirstTokenClassifier(nn.Module):
    """A block on sequence shards, then a column/row pair on the first token (BERT's pooler, a ViT's
    classifier): that row layer's output has no sequence."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.emb, self.block = nn.Embedding(V, d), Block(d)
        self.dense, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, 3)

    def forward(self, ids):
        return self.out(torch.tanh(self.dense(self.block(self.emb(ids))[:, 0])))


def test_sequence_parallel_stops_before_a_layer_with_no_sequence_and_says_why():
    """The pair on the first token stays tensor parallel alone (its all-reduce kept), the rest on
    sequence shards; plan_reasons says which row layers reduce-scatter and why 'out' does not."""
    model = FirstTokenClassifier().eval()
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, sequence_parallel=True, example_inputs=(_ids(13),))
    assert pm.plan["out"] == "row"
    assert pm.code.count("reduce_scatter_to_devices(") == 3 and pm.code.count("reduce_to_device(") == 1
    assert "not on sequence shards: its output (2, 3) has no sequence dim" in pm.plan_reasons["out"]
    for path in ("emb", "block.fc2", "block.fc4"):
        assert pm.plan_reasons[path].endswith("sequence parallel: reduce-scattered on the sequence instead")
    torch.testing.assert_close(pm(_ids(12, seed=3)), model(_ids(12, seed=3)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mesh": {"pp": 2, "tp": 2}, "schedule": "1f1b"}, "sequence_parallel=True with schedule='1f1b' is not built"),
        ({"mesh": {"dp": 4}}, "add tensor_parallel="),
        ({"tensor_parallel": True, "memory_per_device": 1}, "memory_per_device=: the layout tp4[+]sp does not fit"),
    ],
)
def test_sequence_parallel_refused_where_not_built(kwargs, match):
    """Layouts sequence parallel does not run in are refused by name, before anything is built; a budget
    below the planner's prediction for tp with sequence parallel too."""
    with pytest.raises((ValueError, DpCompileError), match=match):
        dpcompile.transform(Stack(), ["cpu"] * 4, sequence_parallel=True, example_inputs=(_ids(8),), **kwargs)


def test_sequence_parallel_with_data_parallel_equals_eager_in_training():
    """mesh={"dp": 2, "tp": 2} on 4 devices, training with dropout and labels: each dp copy's part of the
    batch on sequence shards between the pairs (13 tokens: 7, 6); the loss, outputs, every gradient and the
    parameters after 2 AdamW steps equal eager's; a call of 12 tokens too."""
    torch.manual_seed(0)
    model = Stack().double().train()
    eager = copy.deepcopy(model)
    batch = lambda seq, seed: torch.cat([_ids(seq, seed), _ids(seq, seed + 100)])  # noqa: E731 - 4 rows, 2 per copy
    pm = dpcompile.transform(model, ["cpu"] * 4, mesh={"dp": 2, "tp": 2}, sequence_parallel=True,
                             example_inputs=(batch(13, 0),))  # fmt: skip
    assert pm.code.count("reduce_scatter_to_devices(") == 10  # 5 per dp copy, as tp alone has
    assert pm.code.count("all_gather_to_devices(") == 10 and "reduce_to_device(" not in pm.code
    assert pm.strategies["tp"] == "tensor parallel with sequence parallel"
    labels = batch(13, 7)
    optimizers = torch.optim.AdamW(pm.parameters(), lr=0.01), torch.optim.AdamW(eager.parameters(), lr=0.01)
    for step in range(2):
        losses, outputs = [], []
        for m in (pm, eager):
            torch.manual_seed(step)
            outputs.append(m(batch(13, step + 1)))
            losses.append(nn.functional.cross_entropy(outputs[-1].flatten(0, 1), labels.flatten()))
            losses[-1].backward()
        torch.testing.assert_close(*outputs)
        torch.testing.assert_close(*losses)
        if step == 0:
            _assert_grads_equal(pm, eager)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(pm.state_dict()[key], value, msg=lambda m, key=key: f"{key}: {m}")
    torch.manual_seed(3)
    got = pm(batch(12, 3))
    torch.manual_seed(3)
    torch.testing.assert_close(got, eager(batch(12, 3)))


def _transformers_model(name: str, layers: int = 2) -> nn.Module:
    T = import_or_skip("transformers")
    if name == "gpt2":
        config = T.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=V, n_positions=32, resid_pdrop=0.1,
                              embd_pdrop=0.1, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
        return T.GPT2LMHeadModel(config)
    config = T.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=64, vocab_size=V, max_position_embeddings=32, use_cache=False,
                           bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    return T.LlamaForCausalLM(config)


def _inputs(seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(1, V, (2, seq), generator=g), "labels": torch.randint(0, V, (2, seq), generator=g)}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "seq", "lookups"), [("gpt2", 13, 2), ("llama", 12, 1)])
def test_sequence_parallel_transformers_equal_eager(name, seq, lookups):
    """GPT-2 (training, dropout drawn exactly) and Llama (rotary, grouped-query heads, RMSNorm written
    out) on 2 devices, on a length that does not divide them (13) and one that does (12): logits and
    every gradient equal eager (float64); the loss, which transformers computes in float32, to float32
    rounding."""
    torch.manual_seed(0)
    model = _transformers_model(name).double().train()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, sequence_parallel=True,
                             example_kwargs=_inputs(seq))  # fmt: skip
    assert pm.code.count("reduce_scatter_to_devices(") == lookups + 4  # the lookups, each layer's two row layers
    assert pm.code.count("all_gather_to_devices(") == 5  # each layer's two norms and the final norm
    torch.manual_seed(seq)
    got = pm(**_inputs(seq, seed=seq))
    torch.manual_seed(seq)
    want = eager(**_inputs(seq, seed=seq))
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=1e-6)
    weights = torch.linspace(0.5, 1.5, want.logits.numel(), dtype=torch.float64).view(want.logits.shape)
    (got.logits * weights).sum().backward()
    (want.logits * weights).sum().backward()
    _assert_grads_equal(pm, eager)
