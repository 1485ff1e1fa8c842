"""Context parallel by the head-to-sequence all-to-all (``context_parallel={"exchange": "all-to-all"}``):
each device attends the whole sequence for its share of the heads. Outputs, loss and every gradient
equal eager (float64) for a causal block and a padding-mask block on 2 and 3 virtual devices (lengths
that divide and that do not), GPT-2 and Llama from transformers on 2 and 4 (Llama's grouped-query
heads too: where its key/value heads divide, and refused by name / left to the all-gather under
``"auto"`` where they do not); the runtime's exchanges against a plain split. The checks over a
``("cp",)`` gloo mesh (``check_*`` below) run in ``test_context_parallel_mesh.py``'s spawned group.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile import DpCompileError
from dpcompile.analysis.heads_exchange import all_to_all_applies
from dpcompile.runtime import heads_of_sequence, sequence_of_heads
from tests.helpers import assert_cp_rank_lm_step_equals_eager
from tests.integration.test_context_parallel import (
    CausalSelfAttention,
    PaddedSelfAttention,
    _transformers_model,
    assert_blocks_over_cp_mesh_equal_eager,
    assert_step_equals_eager,
)
from tests.integration.test_context_parallel import _inputs as lm_inputs

ALL_TO_ALL = {"exchange": "all-to-all"}


class GroupedQueryAttention(nn.Module):
    """Causal attention with ``heads`` query heads over ``kv_heads`` key/value heads (``enable_gqa``)."""

    def __init__(self, heads: int = 4, kv_heads: int = 2, head_dim: int = 4):
        super().__init__()
        self.shape = (heads, kv_heads, head_dim)
        self.q = nn.Linear(16, heads * head_dim)
        self.kv = nn.Linear(16, 2 * kv_heads * head_dim)
        self.out = nn.Linear(heads * head_dim, 16)

    def forward(self, x):
        (b, s, _), (h, hkv, d) = x.shape, self.shape
        q = self.q(x).view(b, s, h, d).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, hkv, d).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(a.transpose(1, 2).reshape(b, s, h * d))


class PerHeadBias(CausalSelfAttention):
    """Bidirectional attention with a float mask of one bias per head, ``(heads, seq, seq)``, made from
    positions and a learned slope per head (ALiBi's form): each device reads its heads' rows."""

    def __init__(self):
        super().__init__(dim=16, heads=4)
        self.slopes = nn.Parameter(torch.linspace(0.1, 0.8, 4))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        positions = torch.arange(s, device=x.device)
        bias = -(positions[:, None] - positions[None, :]).abs().to(x.dtype) * self.slopes[:, None, None]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(a.transpose(1, 2).reshape(b, s, d))


class RowBias(CausalSelfAttention):
    """A float mask of each token's own bias, ``(b, 1, seq, 1)``: split with the tokens (its keys
    broadcast), so no whole mask exists to narrow; it reads a parameter (a gradient through the mask)."""

    def forward(self, x, keep):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        bias = self.qkv.weight[0, 0] * keep.to(x.dtype)[:, None, :, None]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(a.transpose(1, 2).reshape(b, s, d))


def _assert_equals_eager(model: nn.Module, args: tuple, n: int, exchange: dict | None = ALL_TO_ALL,
                         mesh: dict | None = None, examples: tuple | None = None) -> str:  # fmt: skip
    """``model`` over ``n`` virtual devices (``mesh``, else ``{"cp": n}``; built for ``examples``, else
    ``args``): output and every gradient of a weighted sum equal eager's (float64; float32 inputs: to
    float32 rounding); returns the code."""
    model = model.to(args[0].dtype)
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * n, mesh=mesh or {"cp": n}, example_inputs=examples or args,
                             context_parallel=exchange)  # fmt: skip
    got, want = pm(*args), eager(*args)
    torch.testing.assert_close(got, want)
    weights = torch.linspace(0.5, 1.5, want.numel(), dtype=want.dtype).view(want.shape)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"grad {name}: {m}")
    return pm.code


def test_the_exchanges_hand_each_device_its_heads_and_back():
    """heads_of_sequence gives device r its heads over the whole sequence; sequence_of_heads gives it
    back its shard of every head; the pair is the identity, and so is its backward (uneven shards)."""
    whole = torch.randn(2, 6, 7, 3, dtype=torch.float64, requires_grad=True)
    sizes = [3, 2, 2]
    shards = list(whole.split(sizes, 2))
    heads = [heads_of_sequence(shards, r, 2, sizes, "cpu") for r in range(3)]
    torch.testing.assert_close(heads[1], whole[:, 2:4])
    back = [sequence_of_heads(heads, r, 2, sizes, "cpu") for r in range(3)]
    torch.testing.assert_close(back[2], whole[:, :, 5:])
    weights = torch.randn(whole.shape, dtype=torch.float64)
    torch.cat(back, 2).mul(weights).sum().backward()
    torch.testing.assert_close(whole.grad, weights)


@pytest.mark.parametrize("n, seq", [(2, 8), (2, 7), (3, 7)])
def test_causal_block_by_all_to_all_equals_eager(n, seq):
    """is_causal=True over the whole sequence, each device its heads (6 heads: 3 or 2 each), outputs
    and gradients equal eager; the code exchanges queries, keys, values and outputs, gathers nothing."""
    torch.manual_seed(0)
    code = _assert_equals_eager(CausalSelfAttention(dim=24, heads=6), (torch.randn(2, seq, 24, dtype=torch.float64),), n)
    assert code.count("dpcompile_runtime_sequence_of_heads(") == n
    assert code.count("dpcompile_runtime_heads_of_sequence(") == 3 * n  # queries, keys, values
    assert "attention_regathered" not in code and "gather_sequence" not in code
    assert code.count("is_causal = True") == n


def test_float32_dp_copies_and_refusals_beside_tp_or_pp():
    """float32 to rounding on 2 devices; dp copies ({"dp": 2, "cp": 2}: each copy's sequence by the
    all-to-all) equal eager in float64; beside 'tp' or 'pp' (not built) refused by name before anything
    is built."""
    torch.manual_seed(0)
    code = _assert_equals_eager(CausalSelfAttention(), (torch.randn(2, 7, 16),), 2)
    assert code.count("sequence_of_heads(") == 2
    code = _assert_equals_eager(CausalSelfAttention(), (torch.randn(3, 7, 16, dtype=torch.float64),), 4,
                                mesh={"dp": 2, "cp": 2})  # fmt: skip
    assert code.count("sequence_of_heads(") == 4 and "attention_regathered" not in code
    x = torch.randn(2, 7, 16)
    for mesh, extra in (({"cp": 2, "tp": 2}, {"tensor_parallel": True}), ({"pp": 2, "cp": 2}, {"pipeline": 2})):
        with pytest.raises(DpCompileError, match=r"'all-to-all'} with '(tp|pp)' in the mesh is not built yet"):
            dpcompile.transform(nn.Sequential(CausalSelfAttention(), CausalSelfAttention()), ["cpu"] * 4, mesh=mesh,
                                example_inputs=(x,), context_parallel=ALL_TO_ALL, **extra)  # fmt: skip


def test_padding_mask_block_by_all_to_all_equals_eager():
    """A non-causal block with a padding mask of one query row (gathered along the keys), padding on
    the first device's tokens, on 2 devices at 7 tokens: each device reads the mask whole."""
    torch.manual_seed(0)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 1:3] = False
    code = _assert_equals_eager(PaddedSelfAttention(), (torch.randn(2, 7, 16, dtype=torch.float64), keep), 2)
    assert code.count("dpcompile_runtime_heads_share(") == 2 and "attention_regathered" not in code


def test_a_mask_per_head_gives_each_device_its_heads_and_saves(tmp_path):
    """A float mask of one bias per head (its slopes learned): each device reads its heads of the whole
    mask, output and every gradient (the slopes' too) equal eager; the program round-trips torch.save,
    and explain names the all-to-all as the exchange."""
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    code = _assert_equals_eager(PerHeadBias(), (x,), 2)
    assert code.count("dpcompile_runtime_heads_share(") == 2
    model = PerHeadBias().double()
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,),
                             context_parallel=ALL_TO_ALL)  # fmt: skip
    torch.save(pm, tmp_path / "pm.pt")
    torch.testing.assert_close(torch.load(tmp_path / "pm.pt", weights_only=False)(x), model(x))
    cp = dpcompile.explain(pm, x).context_parallel
    assert (cp["exchange"], cp["attention"]) == ("head-to-sequence all-to-all", ["scaled_dot_product_attention"])
    assert not any("all-to-all" in other for other in cp["not_chosen"])


def test_a_mask_split_with_the_tokens_is_exchanged_like_the_queries():
    """A mask whose rows each device computes from its own tokens is exchanged as the queries are
    (each device all of its rows), output and every gradient equal eager, on 2 devices at 7 tokens."""
    torch.manual_seed(0)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 1:3] = False
    code = _assert_equals_eager(RowBias(), (torch.randn(2, 7, 16, dtype=torch.float64), keep), 2)
    assert "mask_heads_dev1 = dpcompile_runtime_heads_of_sequence(" in code


def test_grouped_query_heads_divide_or_are_refused_by_name():
    """4 query heads over 2 key/value heads: on 2 devices each gets 2 and 1, equal eager; on 4 the
    key/value heads do not divide: asked by name, a DpCompileError naming the attention, the head
    counts and the exchange that works; under "auto", the all-gather, the reason in explain."""
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    code = _assert_equals_eager(GroupedQueryAttention(), (x,), 2)
    assert "enable_gqa = True" in code and code.count("sequence_of_heads(") == 2
    model = GroupedQueryAttention()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(DpCompileError, match=r"attention 'scaled_dot_product_attention' cannot run as the head-to-seq"
                       r"uence all-to-all over 4 devices because its 2 key/value heads do not divide over 4 devices.*"
                       r"'all-gather'"):  # fmt: skip
        dpcompile.transform(model, ["cpu"] * 4, mesh={"cp": 4}, example_inputs=(x.float(),), context_parallel=ALL_TO_ALL)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    code = _assert_equals_eager(GroupedQueryAttention(), (x,), 4, exchange={"exchange": "auto"})
    assert "attention_regathered" in code and "sequence_of_heads" not in code
    pm = dpcompile.transform(GroupedQueryAttention(), ["cpu"] * 4, mesh={"cp": 4}, example_inputs=(x.float(),))
    cp = dpcompile.explain(pm, x.float()).context_parallel
    assert cp["exchange"] == "all-gather keys/values"
    (call,) = cp["calls"]
    assert call["attention"] == "scaled_dot_product_attention" and call["exchange"] == "all-gather"
    assert "its 2 key/value heads do not divide over 4 devices" in call["why_not"]["all-to-all"]


def test_heads_that_do_not_divide_are_named():
    """all_to_all_applies names what stops the all-to-all (the cost model's question)."""
    assert all_to_all_applies((2, 4, 8, 8), (2, 4, 8, 8), 4) is None
    assert all_to_all_applies((2, 6, 8, 8), (2, 6, 8, 8), 4) == "its 6 query heads do not divide over 4 devices"
    assert "mask (2, 3, 8, 8)" in all_to_all_applies((2, 6, 8, 8), (2, 6, 8, 8), 2, mask=(2, 3, 8, 8))
    assert all_to_all_applies((2, 4, 8, 8), (2, 4, 8, 8), 2, dropout=0.1) == "it has dropout_p=0.1"


@pytest.mark.slow
@pytest.mark.parametrize("name, n, gqa", [("gpt2", 2, False), ("llama", 2, True), ("llama", 4, False)])
def test_transformers_by_all_to_all_equal_eager(name, n, gqa, monkeypatch):
    """GPT-2 (4 heads) on 2 devices and Llama (4 query heads, 2 key/value heads) on 2 and 4, with
    labels=, frontend="export": logits, loss and every gradient equal eager at a length that divides
    the devices and one that does not. Llama on 2 with grouped-query attention in the kernel
    (transformers' enable_gqa: each device 2 query and 1 key/value head); on 4 as transformers runs
    it by default (its keys and values repeated to 4 heads before attention). GPT-2 on 4: not run
    here (each transform of a model costs seconds of the suite); the blocks above run on 3."""
    if gqa:
        monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    torch.manual_seed(0)
    model = _transformers_model(name).double()
    eager = copy.deepcopy(model)
    lengths = {2: (12, 13), 4: (8, 7)}[n]
    pm = dpcompile.transform(model, ["cpu"] * n, mesh={"cp": n}, example_kwargs=lm_inputs(name, lengths[0]),
                             frontend="export", context_parallel=ALL_TO_ALL)  # fmt: skip
    assert pm.code.count("dpcompile_runtime_sequence_of_heads(") == n and "attention_regathered" not in pm.code
    assert ("enable_gqa = True" in pm.code) == gqa
    assert pm.strategies["cp"] == "context parallel (head-to-sequence all-to-all)"
    for seq in lengths:
        assert_step_equals_eager(pm, model, eager, lm_inputs(name, seq, seed=seq))


# ------------------------------------------------------------------ over a ("cp",) gloo mesh of 2 ranks


def check_all_to_all_over_a_cp_mesh() -> None:
    """Run by test_context_parallel_mesh.py's spawned group of 2: a causal block and a padded block at
    7 tokens (4 and 3), and a 1-layer GPT-2 with labels= at 12 tokens, by the all-to-all
    (dist.all_to_all over gloo, uneven shards): this rank's output, the loss and every gradient."""
    from dpcompile.mesh import local_batch
    from tests.integration.test_context_parallel_mesh import _cp_mesh, _gpt2, _inputs

    mesh = _cp_mesh()
    assert_blocks_over_cp_mesh_equal_eager(mesh, ALL_TO_ALL, "heads_over_group", not_in_code="attention_over_group")
    torch.manual_seed(0)
    model = _gpt2()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, mesh, example_kwargs=local_batch(_inputs(12, 0), mesh), frontend="export",
                             context_parallel=ALL_TO_ALL)  # fmt: skip
    assert "sequence_over_group" in pm.code, pm.code
    assert_cp_rank_lm_step_equals_eager(pm, model, eager, _inputs(12, 12), mesh)  # the blocks: uneven shards


def test_auto_takes_the_all_to_all_where_the_cost_model_finds_it_fastest(monkeypatch):
    """At 2,048 tokens of 2 heads of 32 the all-to-all moves fewer bytes than the all-gather (its queries, keys, values
    and output, ``(N-1)/N**2`` each way, against the keys and values' ``(N-1)/N`` three times), and the
    bytes outweigh its extra messages (the reference gloo figures, not this machine's cached ones): ``"auto"``
    lowers it, equal to eager; explain says why the others lost."""
    monkeypatch.setenv("DPCOMPILE_CALIBRATION", "off")
    torch.manual_seed(0)
    x = torch.randn(1, 2048, 16, dtype=torch.float64)
    model = GroupedQueryAttention(heads=2, kv_heads=2, head_dim=32)
    code = _assert_equals_eager(model, (x,), 2, exchange=None)
    assert code.count("sequence_of_heads(") == 2 and "attention_regathered" not in code
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,))
    assert pm.strategies["cp"] == "context parallel (head-to-sequence all-to-all)"
    (call,) = dpcompile.explain(pm, x).context_parallel["calls"]
    assert call["exchange"] == "all-to-all"
    assert call["why_not"]["all-gather"].startswith("slower: ") and call["why_not"]["ring"].startswith("slower: ")


def test_a_sequence_shorter_than_the_devices_runs_where_the_heads_do_not_divide_its_devices():
    """Built by name for 4 devices (4 heads), called with 3 tokens: the call runs on 3 devices, where
    4 heads do not divide, so that call's program takes the all-gather (it was refused, naming a 'cp'
    size the user never gave), equal to eager, explain saying why; 8 tokens run the all-to-all again."""
    torch.manual_seed(0)
    model = GroupedQueryAttention(heads=4, kv_heads=4).double()
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    _assert_equals_eager(model, (torch.randn(2, 3, 16, dtype=torch.float64),), 4, examples=(x,))
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 4, mesh={"cp": 4}, example_inputs=(x,),
                             context_parallel=ALL_TO_ALL)  # fmt: skip
    (call,) = dpcompile.explain(pm, x[:, :3]).context_parallel["calls"]
    assert call["exchange"] == "all-gather" and "4 query heads do not divide over 3 devices" in call["why_not"]["all-to-all"]
    torch.testing.assert_close(pm(x), model(x))
    assert pm.code.count("sequence_of_heads(") == 4
