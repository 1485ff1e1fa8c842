"""Context parallelism composed with the other strategies in one process, on virtual devices:
``mesh={"dp": 2, "cp": 2, "tp": 2}`` (dp copies of the cp x tp program).

Each layout trains a tiny GPT-like language model (token and position embeddings, causal
attention blocks, an LM head, a mean cross-entropy with ignored labels spread unevenly over the
rows) in float64: the logits, the loss, every gradient of two AdamW steps at a length that divides
the sequence pieces and one that does not, then the parameters and ``state_dict()`` equal eager's,
and ``explain`` places every piece on its own device.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from tests.helpers import full_gradients

VOCAB = 24


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP, GPT-2's block at ``dim`` features."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.dim, self.heads = dim, heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, h):
        b, s, _ = h.shape
        q, k, v = self.qkv(self.ln1(h)).split(self.dim, 2)  # a constant: the plan sees the sections
        heads = (b, s, self.heads, self.dim // self.heads)
        q, k, v = q.view(heads).transpose(1, 2), k.view(heads).transpose(1, 2), v.view(heads).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, s, self.dim))
        return h + self.out(F.gelu(self.fc(self.ln2(h))))


class TinyLM(nn.Module):
    """``layers`` blocks between token + position embeddings and an LM head; returns the logits
    and the mean cross-entropy over the labels not ignored (-100)."""

    def __init__(self, layers: int = 1, dim: int = 16, heads: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(32, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB)

    def forward(self, ids, labels):
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def lm_batch(rows: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels; row 0 ignores its first half, so the rows count different tokens."""
    g = torch.Generator().manual_seed(seed)
    ids, labels = torch.randint(0, VOCAB, (rows, seq), generator=g), torch.randint(0, VOCAB, (rows, seq), generator=g)
    labels[0, : seq // 2] = -100
    return ids, labels


def assert_trains_like_eager(pm: nn.Module, eager: nn.Module, rows: int) -> None:
    """Two AdamW steps, at 7 and 8 tokens (pieces of 4 and 3, then 4 and 4): logits, loss and every
    gradient of each step equal eager's, then every parameter and ``state_dict()``."""
    ours, theirs = torch.optim.AdamW(pm.parameters(), lr=1e-2), torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for seq in (7, 8):
        ids, labels = lm_batch(rows, seq, seed=seq)
        (logits, loss), (want_logits, want_loss) = pm(ids, labels), eager(ids, labels)
        torch.testing.assert_close(logits, want_logits)
        torch.testing.assert_close(loss, want_loss)
        weights = torch.linspace(0.5, 1.5, logits.numel(), dtype=torch.float64).view(logits.shape)
        (loss + (logits * weights).sum()).backward()
        (want_loss + (want_logits * weights).sum()).backward()
        grads = full_gradients(pm) if hasattr(pm, "param_shards") else {n: p.grad for n, p in pm.named_parameters()}
        for path, p in eager.named_parameters():
            assert grads.get(path) is not None, f"no gradient reached {path}"
            torch.testing.assert_close(grads[path], p.grad, msg=lambda m, path=path, seq=seq: f"grad {path} at {seq}: {m}")
        ours.step()
        theirs.step()
        ours.zero_grad()
        theirs.zero_grad()
    state, want = pm.state_dict(), eager.state_dict()
    assert list(state) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"{key} after two steps: {m}")


def build(layers: int, mesh: dict[str, int], rows: int = 3, **options) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = TinyLM(layers).double()
    eager = copy.deepcopy(model)
    devices = ["cpu"] * math.prod(mesh.values())
    pm = dpcompile.transform(model, devices, mesh=mesh, example_inputs=lm_batch(rows, 7, seed=0), **options)
    assert pm.layout == mesh and set(pm.strategies) == set(mesh)
    return pm, eager


@pytest.mark.parametrize(("data_parallel", "sequence_parallel"), [("replicate", False), ("fsdp", True)])
def test_dp_cp_tp_trains_like_eager(data_parallel, sequence_parallel):
    """dp copies of the cp x tp program: a batch of 3 over 2 copies (rows 2 and 1), each copy's
    sequence over 2 pieces, each piece's layers over 2 shards (each shard gathering its own heads'
    keys and values across the pieces of its copy); FSDP with each piece's values between the
    pairs on sequence shards too."""
    pm, eager = build(1, {"dp": 2, "cp": 2, "tp": 2}, data_parallel=data_parallel, sequence_parallel=sequence_parallel)
    assert ("tensor_parallel_split_sequence_to_devices(" in pm.code) == sequence_parallel
    assert "_keys_dev1 = dpcompile_runtime_gather_sequence(" in pm.code and "qkv_dp1_cp1_dev1 = " in pm.code
    if data_parallel == "fsdp":  # each tensor-parallel shard in one piece per (dp, cp) piece
        assert {len(names) for _, names in pm.param_shards.values()} == {4, 8}
    assert_trains_like_eager(pm, eager, rows=3)
    if not sequence_parallel:  # one token: fewer pieces than cp, a program built again for the call
        (logits, loss), (want_logits, want_loss) = pm(*lm_batch(2, 1, seed=1)), eager(*lm_batch(2, 1, seed=1))
        torch.testing.assert_close(logits, want_logits)
        torch.testing.assert_close(loss, want_loss)
    placed = {n.name: n.device for n in dpcompile.explain(pm, *lm_batch(3, 7, seed=0)).nodes}
    pieces = [f"blocks_0_qkv_dp{d}_cp{c}_dev{k}" for d in (0, 1) for c in (0, 1) for k in (0, 1)]
    assert [placed[name] for name in pieces] == [f"cpu#{i}" for i in range(8)]


@pytest.mark.parametrize("mesh", [{"pp": 2, "cp": 2}, {"pp": 2, "cp": 2, "tp": 2}])
def test_pp_cp_trains_like_eager(mesh):
    """Two stages (GPipe), each a context-parallel program over its own 2 devices: the pieces of the
    sequence are the pipeline's micro-batches, and each stage's attention gathers the keys and values
    of its own pieces only; with tp, each piece's layers sharded over 2 devices of its stage."""
    pm, eager = build(2, mesh, rows=2)
    gathered = [names.split(", ") for names in re.findall(r"dpcompile_runtime_gather_sequence\(\[([^\]]*)\]", pm.code)]
    assert len(gathered) == 2 * 2 * mesh.get("tp", 1)  # keys and values of each block, per shard
    for names in gathered:  # one stage's block, its 2 pieces
        assert len(names) == 2 and len({name.split("_")[1] for name in names}) == 1, names
    assert_trains_like_eager(pm, eager, rows=2)
    placed = {n.name: n.device for n in dpcompile.explain(pm, *lm_batch(2, 7, seed=0)).nodes}
    shards = [f"_dev{k}" for k in range(mesh.get("tp", 1))] if "tp" in mesh else [""]
    pieces = [f"blocks_{s}_qkv_cp{c}{k}" for s in (0, 1) for c in (0, 1) for k in shards]
    assert [placed[name] for name in pieces] == [f"cpu#{i}" for i in range(len(pieces))]


@pytest.mark.parametrize(
    ("mesh", "options", "match"),
    [
        ({"pp": 2, "cp": 2}, {"schedule": "1f1b"}, r"schedule='1f1b' with 'pp' and 'cp' is not built yet.*leave schedule= out"),
        ({"pp": 2, "cp": 2, "tp": 2}, {"schedule": "1f1b"}, r"schedule='1f1b' with 'pp' and 'cp'"),
        ({"pp": 2, "cp": 2}, {"micro_batches": 2}, r"micro_batches=2: a pipeline with 'cp' .* leave micro_batches= out"),
        ({"pp": 2, "cp": 2}, {"devices": ["cpu", "cpu:1", "cpu", "cpu:1"]}, r"copy 1 on \['cpu:1', 'cpu:1'\].*same devices"),
    ],
)
def test_pp_cp_refuses_what_is_not_built_by_name(mesh, options, match):
    """1F1B (a piece's backward would run before the other pieces' forward its attention reads),
    micro-batches of the batch beside the sequence's pieces, and pieces of the sequence on devices of
    their own (not placed yet): refused before anything is built."""
    torch.manual_seed(0)
    model = TinyLM(2).double()
    before = copy.deepcopy(model.state_dict())
    devices = options.pop("devices", ["cpu"] * math.prod(mesh.values()))
    with pytest.raises(dpcompile.DpCompileError, match=match):
        dpcompile.transform(model, devices, mesh=mesh, example_inputs=lm_batch(2, 7, 0), **options)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("mesh", [{"pp": 2, "tp": 2}, {"cp": 2, "tp": 2}])
def test_sequence_parallel_on_pipeline_stages_and_sequence_pieces_trains_like_eager(mesh):
    """sequence_parallel=True on each pipeline stage's tensor-parallel program (GPipe), and on each
    piece of the sequence of cp x tp: the values between the pairs split again over the shards."""
    pm, eager = build(2, mesh, rows=2, sequence_parallel=True)
    assert pm.strategies["tp"] == "tensor parallel with sequence parallel"
    assert "tensor_parallel_split_sequence_to_devices(" in pm.code
    assert_trains_like_eager(pm, eager, rows=2)
    placed = {n.name: n.device for n in dpcompile.explain(pm, *lm_batch(2, 7, seed=0)).nodes}
    outer = [f"blocks_{s}_qkv" for s in (0, 1)] if "pp" in mesh else [f"blocks_1_qkv_cp{c}" for c in (0, 1)]
    assert [placed[f"{name}_dev{k}"] for name in outer for k in (0, 1)] == ["cpu#0", "cpu#1", "cpu#2", "cpu#3"]
