"""Context parallel's ring exchange (``context_parallel={"exchange": "ring"}``) and the cost model's choice.

The ring (each device's attention over the key and value shards one block at a time, merged by
log-sum-exp) equals eager: outputs, loss and every gradient in float64 (float32 to rounding) for a
causal block, a padding mask, GPT-2 and Llama (grouped-query heads) on 2 and 4 virtual devices at a
length that divides them and one that does not; over a ``("cp",)`` gloo mesh of 2 ranks in the shared
group of ``test_context_parallel_mesh.py`` (:data:`MESH_CHECKS`). ``"auto"`` keeps the all-gather on
these (the ring moves more bytes in more messages) unless only the ring's transient fits; what the
ring cannot serve falls back under ``"auto"`` with the reason and is refused by name when asked for.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile import DpCompileError
from dpcompile.analysis.context_exchange import DEFAULT_OPTIONS, AttentionShape, choose_exchange, exchange_costs
from tests.helpers import (
    CONTEXT_PARALLEL_LENGTHS,
    assert_cp_rank_lm_step_equals_eager,
    assert_square_sum_step_equals_eager,
)
from tests.integration.test_context_parallel import (
    CausalSelfAttention,
    PaddedSelfAttention,
    _inputs,
    _transformers_model,
    assert_blocks_over_cp_mesh_equal_eager,
    assert_step_equals_eager,
)

RING = {"exchange": "ring"}


def _assert_block_equals_eager(model, args, n, **tolerance):
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * n, mesh={"cp": n}, example_inputs=args, context_parallel=RING)
    assert pm.code.count("dpcompile_runtime_ring_attention(") == n
    assert "dpcompile_runtime_attention_regathered(" not in pm.code  # no keys or values gathered
    assert pm.strategies == {"cp": "context parallel (ring exchange of keys/values)"}
    got, want = pm(*args), eager(*args)
    torch.testing.assert_close(got, want, **tolerance)
    weights = torch.linspace(0.5, 1.5, want.numel(), dtype=want.dtype).view(want.shape)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tolerance, msg=lambda m, name=name: f"grad {name}: {m}")
    return pm


@pytest.mark.parametrize("n, seq", [(2, 8), (4, 7)])
def test_ring_causal_block_equals_eager(n, seq):
    """Causal: each device attends its own block on the diagonal, then the earlier shards' (float64)."""
    torch.manual_seed(0)
    x = torch.randn(2, seq, 16, dtype=torch.float64)
    _assert_block_equals_eager(CausalSelfAttention().double(), (x,), n)


def test_ring_causal_block_float32_equals_eager_to_rounding(tmp_path):
    """float32 to rounding; the program round-trips through torch.save."""
    torch.manual_seed(0)
    model, x = CausalSelfAttention(), torch.randn(2, 7, 16)
    expected = model(x).detach()
    pm = _assert_block_equals_eager(model, (x,), 2, atol=1e-5, rtol=1e-4)
    torch.save(pm, tmp_path / "pm.pt")
    torch.testing.assert_close(torch.load(tmp_path / "pm.pt", weights_only=False)(x), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("n", [2, 4])
def test_ring_padding_mask_equals_eager(n):
    """Bidirectional with a padding mask: each block gets its key columns of the mask (the math path)."""
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 1:3] = False  # padded keys on the first device, read by every device's queries
    _assert_block_equals_eager(PaddedSelfAttention().double(), (x, keep), n)


def test_ring_under_dp_copies_equals_eager():
    """``{"dp": 2, "cp": 2}``: each copy's attention on the ring over its 2 devices (3 rows: 2 and 1)."""
    torch.manual_seed(0)
    model = CausalSelfAttention().double()
    eager = copy.deepcopy(model)
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 4, mesh={"dp": 2, "cp": 2}, example_inputs=(x,), context_parallel=RING)
    assert pm.code.count("dpcompile_runtime_ring_attention(") == 4
    got, want = pm(x), eager(x)
    assert_square_sum_step_equals_eager(model, eager, got, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_ring_transformers_equal_eager(name):
    """GPT-2 (labels) on 2 virtual devices and Llama (rotary, grouped-query heads) on 4 (the suite's
    time: the causal block covers both counts), at a length that divides them and one that does not:
    logits, loss and every gradient equal eager."""
    torch.manual_seed(0)
    built = _transformers_model(name).double()
    devices = 2 if name == "gpt2" else 4
    for n, lengths in [(devices, CONTEXT_PARALLEL_LENGTHS[devices])]:
        model, eager = copy.deepcopy(built), copy.deepcopy(built)
        pm = dpcompile.transform(model, ["cpu"] * n, mesh={"cp": n}, example_kwargs=_inputs(name, lengths[0]),
                                 frontend="export", context_parallel=RING)  # fmt: skip
        assert pm.code.count("dpcompile_runtime_ring_attention(") == n
        for seq in lengths:
            assert_step_equals_eager(pm, model, eager, _inputs(name, seq, seed=seq))


@pytest.mark.parametrize("causal, mask", [(True, None), (False, "keys"), (False, "rows")])
def test_ring_runtime_equals_sdpa_with_grouped_query_heads(causal, mask):
    """The runtime alone, every device's call: 4 query heads over 2 key/value heads (``enable_gqa``),
    uneven shards (2, 2, 2, 1), causal or a mask of one row or of every query row; outputs and the
    gradients of queries, keys and values equal ``scaled_dot_product_attention`` on the whole (float64)."""
    from dpcompile.runtime.sequence_ring import ring_attention

    g = torch.Generator().manual_seed(0)
    lengths, (b, s, d) = [2, 2, 2, 1], (2, 7, 8)
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64, generator=g, requires_grad=True) for h in (4, 2, 2))
    attn_mask = None
    if mask == "keys":
        attn_mask = torch.ones(b, 1, 1, s, dtype=torch.bool)
        attn_mask[0, ..., 1:3] = False
    elif mask == "rows":
        attn_mask = torch.rand(b, 1, s, s, generator=g) > 0.3
        attn_mask[..., 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, enable_gqa=True)
    starts = [sum(lengths[:r]) for r in range(len(lengths))]
    keys, values = list(k.split(lengths, 2)), list(v.split(lengths, 2))
    got = torch.cat([
        ring_attention(q[:, :, a : a + n], keys, values, 2, "cpu", r, torch.arange(a, a + n) if causal else None,
                       enable_gqa=True, **({} if attn_mask is None else {"attn_mask": attn_mask if mask == "keys" else
                                                                         attn_mask[:, :, a : a + n]}))
        for r, (a, n) in enumerate(zip(starts, lengths))
    ], 2)  # fmt: skip
    torch.testing.assert_close(got, want)
    weights = torch.randn(want.shape, dtype=torch.float64, generator=g)
    expected = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for name, ours, theirs in zip("qkv", torch.autograd.grad((got * weights).sum(), (q, k, v)), expected):
        torch.testing.assert_close(ours, theirs, msg=lambda m, name=name: f"grad {name}: {m}")


def test_auto_keeps_the_all_gather_and_explain_shows_every_exchange():
    """``"auto"`` on the causal block: the all-gather (fewer bytes, fewer messages); explain's table
    gives each exchange's bytes, messages, transient and time, and why the others lost."""
    x = torch.randn(2, 8, 16)
    pm = dpcompile.transform(CausalSelfAttention(), ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,))
    assert pm.strategies == {"cp": "context parallel (all-gather keys/values)"}
    assert "attention_regathered" in pm.code and "ring_attention" not in pm.code
    cp = dpcompile.explain(pm, x).context_parallel
    (call,) = cp["calls"]
    assert (call["attention"], call["exchange"]) == ("scaled_dot_product_attention", "all-gather")
    kv = 2 * 2 * 8 * (8 + 8) * 4  # batch, heads, seq, key + value dims, float32
    assert call["costs"]["all-gather"]["transient_bytes"] == kv  # every shard of the keys and values
    assert call["costs"]["ring"]["transient_bytes"] == kv  # two blocks of half: as much on 2 devices
    assert call["costs"]["all-gather"]["bytes_moved"] == 3 * kv // 2  # gathered twice, gradients once
    assert call["costs"]["ring"]["bytes_moved"] == kv // 2 + 3 * kv // 2  # blocks, then blocks with gradients
    assert call["why_not"]["ring"].startswith("slower: ")
    assert call["why_not"]["all-to-all"].startswith("slower: ")
    text = str(dpcompile.explain(pm, x))
    assert "scaled_dot_product_attention: all-gather keys/values" in text
    assert "ring exchange of keys/values: 4,096 B moved in 3 messages, 2,048 B transient" in text


def test_auto_chooses_the_ring_where_only_its_transient_fits():
    """The cost model: at 4096 tokens on 4 devices the all-gather holds the whole keys and values, the
    ring two blocks; with room for the ring's only, ``"auto"`` takes it; with room for all, the all-gather
    (the 2 key/value heads do not divide over 4 devices: the all-to-all cannot serve the call)."""
    shape = AttentionShape(batch=1, heads=4, kv_heads=2, seq=4096, head_dim=16, value_dim=16, itemsize=4)
    costs = exchange_costs(shape, 4)
    assert costs["all-gather"].transient_bytes == shape.kv_bytes == 2 * costs["ring"].transient_bytes
    assert costs["all-gather"].seconds < costs["ring"].seconds
    assert choose_exchange(DEFAULT_OPTIONS, shape, 4).exchange == "all-gather"
    choice = choose_exchange(DEFAULT_OPTIONS, shape, 4, memory_bytes=costs["ring"].transient_bytes)
    assert choice.exchange == "ring"
    assert f"is over the {costs['ring'].transient_bytes:,} B left for it" in choice.why_not["all-gather"]
    served = choose_exchange(DEFAULT_OPTIONS, shape, 4, memory_bytes=1 << 20, cannot={"ring": "dropout in attention"})
    assert served.exchange == "all-gather" and served.why_not["ring"] == "cannot serve this call: dropout in attention"


def test_what_the_ring_cannot_serve_falls_back_or_is_refused_by_name():
    """bfloat16 (the ring merges in the queries' dtype): ``"auto"`` runs the all-gather, the reason
    recorded; ``"ring"`` by name names the attention call and the reason; beside tp, refused."""
    torch.manual_seed(0)
    model = CausalSelfAttention().to(torch.bfloat16)
    x = torch.randn(2, 8, 16, dtype=torch.bfloat16)
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,))
    (call,) = dpcompile.explain(pm, x).context_parallel["calls"]
    assert call["exchange"] == "all-gather" and "dtype torch.bfloat16" in call["why_not"]["ring"]
    with pytest.raises(DpCompileError, match=r"attention call 'scaled_dot_product_attention' cannot run on the ring: "
                                             r"dtype torch.bfloat16"):  # fmt: skip
        dpcompile.transform(model, ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,), context_parallel=RING)
    with pytest.raises(DpCompileError, match="with 'tp' in the mesh is not built yet"):
        dpcompile.transform(model, ["cpu"] * 4, mesh={"cp": 2, "tp": 2}, example_inputs=(x,), context_parallel=RING)


class EmbeddedBias(CausalSelfAttention):
    """Bidirectional attention with a float mask of one bias per head looked up by relative position
    in an embedding (T5's relative position bias): export keeps the embedding a module call."""

    def __init__(self):
        super().__init__(dim=16, heads=4)
        self.bias = nn.Embedding(32, 4)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        positions = torch.arange(s, device=x.device)
        bias = self.bias(positions[None, :] - positions[:, None] + 16).permute(2, 0, 1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(a.transpose(1, 2).reshape(b, s, d))


@pytest.mark.parametrize("learned", ["slope", "embedding"])
def test_a_learned_mask_on_the_ring_is_refused_when_built_and_auto_falls_back(learned):
    """A mask made from a parameter (a learned slope per head read as an attribute; T5's relative
    position bias, an embedding export keeps a module call) needs a gradient the ring does not give:
    ``"ring"`` by name is refused when the program is built, naming the call (shape propagation's
    values do not say the mask needs a gradient: it was a bare runtime error at the first call);
    ``"auto"`` runs the all-gather, explain saying why, equal to eager."""
    from tests.integration.test_context_parallel_all_to_all import PerHeadBias

    torch.manual_seed(0)
    model = (PerHeadBias() if learned == "slope" else EmbeddedBias()).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    with pytest.raises(DpCompileError, match=r"attention call 'scaled_dot_product_attention' cannot run on the ring: "
                                             r"its mask needs a gradient"):  # fmt: skip
        dpcompile.transform(model, ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,), frontend="export",
                            context_parallel=RING)  # fmt: skip
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,), frontend="export")
    (call,) = dpcompile.explain(pm, x).context_parallel["calls"]
    assert call["exchange"] == "all-gather" and "its mask needs a gradient" in call["why_not"]["ring"]
    got, want = pm(x), eager(x)
    assert_square_sum_step_equals_eager(model, eager, got, want)


# ------------------------------------------------------------------ over a ("cp",) gloo mesh of 2 ranks
# (run in the shared spawned group of test_context_parallel_mesh.py: MESH_CHECKS)


def check_ring_gpt2_over_mesh() -> None:
    """GPT-2 with ``labels=`` over 2 ranks on the ring: the rank's logits, the loss and every gradient
    equal eager's at 12 and 13 tokens."""
    from torch.distributed.device_mesh import init_device_mesh

    from dpcompile.mesh import local_batch

    torch.manual_seed(0)
    model = _transformers_model("gpt2").double()
    eager = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    pm = dpcompile.transform(model, mesh, example_kwargs=local_batch(_inputs("gpt2", 12), mesh), frontend="export",
                             context_parallel=RING)  # fmt: skip
    assert "ring_attention_over_group(" in pm.code and "distributed_attention_over_group(" not in pm.code, pm.code
    assert pm.strategies == {"cp": "context parallel (ring exchange of keys/values)"}
    # a length that does not divide: the blocks check covers the even one
    assert_cp_rank_lm_step_equals_eager(pm, model, eager, _inputs("gpt2", 13, seed=13), mesh)


def check_ring_blocks_over_mesh() -> None:
    """A causal block and a padding-mask block over 2 ranks at 7 tokens (4 and 3) on the ring."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    assert_blocks_over_cp_mesh_equal_eager(mesh, RING, "ring_attention_over_group")


MESH_CHECKS = (("ring_gpt2", check_ring_gpt2_over_mesh), ("ring_blocks", check_ring_blocks_over_mesh))
