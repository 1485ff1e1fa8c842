"""Causal load balancing of context parallel's attention (``context_parallel={"load_balance": True}``):
inside each causal attention call device ``r`` computes the query chunks ``r`` and ``2N - 1 - r`` of
``2N`` (zig-zag), everything else stays on its own tokens. Outputs, loss and every gradient equal
eager (float64; float32 to rounding) for a causal block, GPT-2 and Llama on 2 and 4 virtual devices,
at lengths that divide and that do not; the work per device is counted; a non-causal attention asked
to balance is refused by name. Over a ``("cp",)`` gloo mesh: the checks at the end, run by the shared
spawned groups of ``test_context_parallel_mesh.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import dpcompile
from dpcompile import DpCompileError
from dpcompile.runtime.sequence_balance import (
    balanced_attention,
    balanced_rows_back,
    balanced_sizes,
    causal_rows_keys,
    zigzag_chunks,
    zigzag_pieces,
)
from tests.helpers import assert_cp_rank_lm_step_equals_eager, assert_square_sum_step_equals_eager
from tests.integration.test_context_parallel import (
    CausalSelfAttention,
    PaddedSelfAttention,
    _inputs,
    assert_step_equals_eager,
)
from tests.integration.test_context_parallel import _transformers_model as transformers_model

BALANCED = {"load_balance": True}


def test_zigzag_layout_moves_every_row_once_and_evens_out_causal_work():
    """Every device's rows go to exactly one place and back, each device's chunks are ``r`` and
    ``2N-1-r``; the causal work (query rows x keys) per device: max/min 6.99 contiguous, 1.0 zig-zag
    at 4096 tokens on 4 devices; uneven lengths stay within a chunk's rows."""
    for sizes in ([4, 4], [7, 6], [2, 2, 2, 1], [1, 1, 1, 0], [5, 5, 5]):
        length, world = sum(sizes), len(sizes)
        pieces = zigzag_pieces(sizes)
        for owner, size in enumerate(sizes):
            rows = sorted(i for p in pieces if p.owner == owner for i in range(p.source_start, p.source_start + p.length))
            assert rows == list(range(size))
        for dest in range(world):
            chunks = zigzag_chunks(length, world, dest)
            want = [i for start, end in chunks for i in range(start, end)]
            got = sorted((sum(sizes[: p.owner]) + p.source_start + k, p.dest_start + k)
                         for p in pieces if p.dest == dest for k in range(p.length))  # fmt: skip
            assert [g for g, _ in got] == want and [d for _, d in got] == list(range(len(want)))
    contiguous, balanced = causal_rows_keys(4096, 4, False), causal_rows_keys(4096, 4, True)
    assert sum(contiguous) == sum(balanced) == 4096 * 4097 // 2
    assert max(contiguous) / min(contiguous) == pytest.approx(3670528 / 524800) and len(set(balanced)) == 1
    assert balanced_sizes(13, 4) == [4, 3, 3, 3]
    assert causal_rows_keys(13, 2, True) == [10 + 36, 18 + 27]  # chunks of 4, 3, 3, 3: rows 0-3 with 10-12, 4-6 with 7-9


@pytest.mark.parametrize("n, lengths", [(2, (12, 13)), (4, (8, 7))])
def test_balanced_causal_block_equals_eager(n, lengths):
    """A causal block's outputs and gradients equal eager's (float64), each device's attention the
    zig-zag call (its rows taken back after), at a length that divides 2N and one that does not; in
    float32 to rounding."""
    for seq in lengths:
        torch.manual_seed(seq)
        model = CausalSelfAttention().double()
        eager = copy.deepcopy(model)
        x = torch.randn(2, seq, 16, dtype=torch.float64)
        pm = dpcompile.transform(model, ["cpu"] * n, mesh={"cp": n}, example_inputs=(x,), context_parallel=BALANCED)
        assert pm.code.count("dpcompile_runtime_balanced_attention(") == n
        assert pm.code.count("dpcompile_runtime_balanced_rows_back(") == n
        assert "attention_regathered" not in pm.code
        got, want = pm(x), eager(x)
        assert_square_sum_step_equals_eager(model, eager, got, want)
    model = CausalSelfAttention()
    x = torch.randn(2, lengths[1], 16)
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * n, mesh={"cp": n}, example_inputs=(x,),
                             context_parallel=BALANCED)  # fmt: skip
    torch.testing.assert_close(pm(x), model(x))


def test_a_balanced_program_saves_and_exports(tmp_path):
    """A balanced program round-trips through torch.save and dpcompile.export / load (its runtime calls
    are dpcompile.runtime's)."""
    model = CausalSelfAttention()
    x = torch.randn(2, 7, 16)
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,),
                             context_parallel=BALANCED)  # fmt: skip
    torch.save(pm, tmp_path / "pm.pt")
    torch.testing.assert_close(torch.load(tmp_path / "pm.pt", weights_only=False)(x), model(x))
    dpcompile.export(pm, tmp_path / "exported")
    loaded = dpcompile.load(tmp_path / "exported")
    assert "dpcompile_runtime_balanced_attention(" in loaded.code
    torch.testing.assert_close(loaded(x), model(x))


@pytest.mark.slow
@pytest.mark.parametrize("name, layouts", [("gpt2", ((2, (12, 13)), (4, (8, 7)))), ("llama", ((4, (8, 7)),))])
def test_balanced_transformers_equal_eager(name, layouts):
    """GPT-2 (labels; its causal mask moves with the query rows), export frontend, built once, balanced
    on 2 devices (12 and 13 tokens) and 4 (8 and 7), and Llama (rotary, grouped-query heads) on 4 (Llama
    on 2: same program, left out for time): logits, loss and every gradient equal eager."""
    torch.manual_seed(0)
    built = transformers_model(name).double()
    for n, lengths in layouts:
        model, eager = copy.deepcopy(built), copy.deepcopy(built)
        pm = dpcompile.transform(model, ["cpu"] * n, mesh={"cp": n}, example_kwargs=_inputs(name, lengths[0]),
                                 frontend="export", context_parallel=BALANCED)  # fmt: skip
        assert pm.code.count("dpcompile_runtime_balanced_attention(") == n
        for seq in lengths:
            assert_step_equals_eager(pm, model, eager, _inputs(name, seq, seed=seq))


def test_balancing_a_non_causal_attention_is_refused_by_name():
    """A padding mask (every query sees every kept key: nothing to balance) with load_balance=True is a
    DpCompileError naming the attention and the reason; the model is untouched. Beside 'tp' too."""
    model = PaddedSelfAttention()
    before = copy.deepcopy(model.state_dict())
    x, keep = torch.randn(2, 7, 16), torch.ones(2, 7, dtype=torch.bool)
    with pytest.raises(DpCompileError, match=r"attention 'scaled_dot_product_attention' .*cannot be balanced: it "
                                             r"is not causal"):  # fmt: skip
        dpcompile.transform(model, ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x, keep), context_parallel=BALANCED)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(DpCompileError, match="not beside 'tp' yet"):
        dpcompile.transform(CausalSelfAttention(), ["cpu"] * 4, mesh={"cp": 2, "tp": 2}, example_inputs=(x,),
                            context_parallel=BALANCED)  # fmt: skip


class LongCausalBlock(CausalSelfAttention):
    """The causal block with positions up to 1024 (long enough for "auto" to balance over a mesh)."""

    def __init__(self):
        super().__init__()
        self.pos = torch.nn.Embedding(1024, 16)


class BandedAttention(CausalSelfAttention):
    """Attention with a mask of queries by keys that lets a query see 2 later keys (not causal), built
    from positions as transformers builds its masks (whole, then split by query rows)."""

    def forward(self, x):
        b, s, d = x.shape
        i = torch.arange(s, device=x.device)
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=(i[:, None] - i[None, :]).abs() <= 2)
        return self.out(a.transpose(1, 2).reshape(b, s, d))


def test_balancing_a_mask_that_is_not_causal_is_refused_by_name_when_it_runs():
    """A mask split by query rows may be causal (transformers' decoders) or not (a band, BERT's
    padding): load_balance=True checks it at each call and refuses the one that is not, by name."""
    x = torch.randn(2, 8, 16)
    pm = dpcompile.transform(BandedAttention(), ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,),
                             context_parallel=BALANCED)  # fmt: skip
    with pytest.raises(DpCompileError, match="attention 'scaled_dot_product_attention' is not causal: its mask lets"):
        pm(x)


def test_masked_zigzag_attention_is_exact_whether_or_not_the_mask_is_causal():
    """The runtime under 'auto': a causal mask with padding cuts each chunk's keys at its end, a
    bidirectional padding mask makes each chunk attend every key; both equal whole attention and its
    gradients (float64), 13 tokens on 2 devices and 7 on 4; under ``min_length`` each device its own rows."""
    torch.manual_seed(0)
    for length, world in ((13, 2), (7, 4)):
        q = torch.randn(2, 2, length, 4, dtype=torch.float64, requires_grad=True)
        keep = torch.ones(2, 1, 1, length, dtype=torch.bool)
        keep[0, ..., :2] = False  # left padding
        eye = torch.eye(length, dtype=torch.bool)
        for mask in ((torch.ones(length, length, dtype=torch.bool).tril() & keep) | eye, keep | eye):
            mask = mask.expand(2, 1, length, length)
            whole = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
            qs, ms = q.split(balanced_sizes(length, world), 2), mask.split(balanced_sizes(length, world), 2)
            outs = [balanced_attention(qs, qs, qs, 2, r, masks=ms) for r in range(world)]
            got = torch.cat([balanced_rows_back(outs, 2, r) for r in range(world)], 2)
            torch.testing.assert_close(got, whole)
            short = [balanced_attention(qs, qs, qs, 2, r, masks=ms, min_length=length + 1) for r in range(world)]
            assert [o.shape[2] for o in short] == balanced_sizes(length, world)  # under min_length: own rows
            torch.testing.assert_close(torch.cat([balanced_rows_back(short, 2, r, min_length=length + 1)
                                                  for r in range(world)], 2), whole)  # fmt: skip
            weights = torch.randn_like(whole)
            want_grad = torch.autograd.grad((whole * weights).sum(), q)[0]
            torch.testing.assert_close(torch.autograd.grad((got * weights).sum(), q)[0], want_grad)


def test_explain_says_whether_balancing_is_on_and_each_devices_share():
    """explain's cp section: on (every device a quarter of the causal work) or off with the reason
    ('auto' in one process leaves the program as it was: the last device's share the largest)."""
    x = torch.randn(2, 16, 16)
    on = dpcompile.transform(CausalSelfAttention(), ["cpu"] * 4, mesh={"cp": 4}, example_inputs=(x,),
                             context_parallel=BALANCED)  # fmt: skip
    report = dpcompile.explain(on, x)
    balance = report.context_parallel["load_balance"]
    assert balance["on"] and list(balance["shares"].values()) == [0.25] * 4
    assert "causal load balancing: on (zig-zag chunks" in str(report)
    off = dpcompile.transform(CausalSelfAttention(), ["cpu"] * 4, mesh={"cp": 4}, example_inputs=(x,))
    assert "balanced_attention" not in off.code
    balance = dpcompile.explain(off, x).context_parallel["load_balance"]
    shares = [round(s * 136) for s in balance["shares"].values()]  # 16 tokens: 136 (row, key) pairs
    assert not balance["on"] and "over a DeviceMesh only" in balance["why"] and shares == [10, 26, 42, 58]


# ---------------------------------------------------------------- over a ("cp",) gloo mesh
# run by test_context_parallel_mesh.py's shared spawned groups (CHECKS, CHECKS_4)


def check_balanced_models_over_a_cp_mesh() -> None:
    """2 ranks, load_balance=True: GPT-2 with labels at 12 and 13 tokens (its causal mask's rows move
    with the query rows), each rank's logits, the loss and every parameter gradient equal eager's; the
    rank program exchanges query and output rows by all-to-all. A mask that is not causal (a band) is
    refused by name on both ranks when it runs."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.mesh import local_batch

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    for name in ("gpt2",):  # Llama: checked in one process (the rank lowering is the same), left out for time
        torch.manual_seed(0)
        model = transformers_model(name).double()
        eager = copy.deepcopy(model)
        pm = dpcompile.transform(model, mesh, example_kwargs=local_batch(_inputs(name, 12), mesh), frontend="export",
                                 context_parallel=BALANCED)  # fmt: skip
        assert "balanced_attention_over_group" in pm.code, pm.code
        for seq in (12, 13):
            assert_cp_rank_lm_step_equals_eager(pm, model, eager, _inputs(name, seq, seed=seq), mesh)
    x = torch.randn(2, 8, 16)
    pm = dpcompile.transform(BandedAttention(), mesh, example_inputs=(local_batch(x, mesh),), context_parallel=BALANCED)
    try:  # each rank finds later keys in its own rows of the band
        pm(local_batch(x, mesh))
    except DpCompileError as error:  # on every rank alike (one all-reduce of each rank's check)
        assert "attention 'scaled_dot_product_attention' is not causal" in str(error)
    else:
        raise AssertionError("a mask that is not causal ran under load_balance=True")


def check_balanced_block_on_four_ranks() -> None:
    """4 ranks, load_balance=True: a causal block at 8 tokens (chunks of 1) and 7 (shards 2, 2, 2, 1;
    an empty chunk), and "auto" (the default) at 1024 tokens (balanced from AUTO_MIN_LENGTH): each
    rank's outputs and every gradient equal eager's."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.mesh import local_batch

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    for seq, balance in ((8, True), (7, True), (1024, "auto")):
        torch.manual_seed(seq)
        model = LongCausalBlock().double()
        eager = copy.deepcopy(model)
        x = torch.randn(2, seq, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seq))
        pm = dpcompile.transform(model, mesh, example_inputs=(local_batch(x, mesh),),
                                 context_parallel={"load_balance": balance})  # fmt: skip
        assert ("min_length = 1024" in pm.code) == (balance == "auto"), pm.code
        mine = torch.tensor_split(torch.arange(seq), 4)[dist.get_rank()]
        got, want = pm(local_batch(x, mesh)), eager(x)
        torch.testing.assert_close(got, want[:, mine])
        weights = torch.linspace(0.5, 1.5, want.numel(), dtype=torch.float64).view(want.shape)
        (got * weights[:, mine]).sum().backward()
        (want * weights).sum().backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"grad {name}: {m}")


def test_load_balance_true_keeps_auto_off_the_all_to_all(monkeypatch):
    """At 128 tokens of 2 heads of 256 ``"auto"`` takes the all-to-all (the reference gloo figures); with
    ``load_balance=True`` it balances the all-gather instead (the all-to-all's calls are not the all-gather's
    causal query rows to balance: it was refused as 'not causal'), equal to eager, explain saying why."""
    monkeypatch.setenv("DPCOMPILE_CALIBRATION", "off")
    from tests.integration.test_context_parallel_all_to_all import GroupedQueryAttention

    torch.manual_seed(0)
    model = GroupedQueryAttention(heads=2, kv_heads=2, head_dim=256).double()
    eager = copy.deepcopy(model)
    x = torch.randn(1, 128, 16, dtype=torch.float64)
    auto = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,))
    assert auto.strategies["cp"] == "context parallel (head-to-sequence all-to-all)"
    pm = dpcompile.transform(model, ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,), context_parallel=BALANCED)
    assert pm.code.count("dpcompile_runtime_balanced_attention(") == 2 and "sequence_of_heads" not in pm.code
    (call,) = dpcompile.explain(pm, x).context_parallel["calls"]
    assert call["exchange"] == "all-gather" and "load_balance=True" in call["why_not"]["all-to-all"]
    got, want = pm(x), eager(x)
    assert_square_sum_step_equals_eager(model, eager, got, want)


@pytest.mark.parametrize("options, call", [(BALANCED, "balanced_attention("), ({}, "attention_regathered(")])
def test_the_other_modes_program_splits_the_sequence_as_the_first_did(options, call):
    """pm.eval() after a training transform traces the model again: that trace is tidied with the
    sequence dims and the call's shapes, so attention is split as in training (it ran whole on one
    device before, and load_balance=True refused the eval call)."""
    torch.manual_seed(0)
    model = CausalSelfAttention().double()
    eager = copy.deepcopy(model).eval()
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,), context_parallel=options)
    pm.eval()
    torch.testing.assert_close(pm(x), eager(x))
    assert pm.program_for_call(x).code.count(f"dpcompile_runtime_{call}") == 2
