"""PyTorch's OpInfo samples, sharded by the tensor-parallel sharding rules along a feature dim
(-1, -2, -3) in uneven pieces over 2 and 3 shards, run per shard and joined by the rule's layout,
must equal the op run whole. The sweep over every op is ``PYTHONPATH=. python -m
tests.analysis.opinfo_shard``; here one sample of each family the rules claim."""

from __future__ import annotations

import operator

import pytest

pytest.importorskip("expecttest")  # torch.testing._internal needs it (in the test extras)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.testing._internal.opinfo.core import SampleInput  # noqa: E402

from dpcompile.analysis import sharding_rules  # noqa: E402
from tests.analysis.opinfo_shard import run_sample, sweep, uneven  # noqa: E402

# one op of each family the sharding rules claim: element-wise, unary, softmax, matmul, attention,
# views, transpose / permute, split, cat, unsqueeze, expand, slicing, getitem, casts, cross-entropy
FAMILIES = {
    "add", "where", "nn.functional.gelu", "softmax", "bmm", "nn.functional.scaled_dot_product_attention", "view",
    "transpose", "permute", "split", "cat", "unsqueeze", "expand", "__getitem__", "float", "nn.functional.cross_entropy",
}  # fmt: skip
FIRST_SAMPLE_WHOLE = {"nn.functional.scaled_dot_product_attention", "bmm", "softmax", "__getitem__"}
# ops no sharding rule names: their batch rules shard them (sharding_batch, asked by apply_rule), proved the same way
BY_BATCH_RULE = {"log", "cumsum", "stack", "nn.functional.layer_norm", "amax"}


def test_opinfo_samples_sharded_by_their_rules_equal_the_whole_op():
    tally = sweep(1, ops=FAMILIES)
    assert tally.failed == [], "\n".join(tally.failed)
    sharded = {op for op, entry in tally.by_op.items() if entry["sharded"]}
    # each family's rule shards its first sample on some dim (the others it keeps whole, with its
    # reason); those whose first sample only reduces or slices the sharded dim are shown below
    assert sharded >= FAMILIES - FIRST_SAMPLE_WHOLE, FAMILIES - sharded
    assert tally.whole > 0 and tally.sharded >= 40, tally.line()


def test_ops_without_a_sharding_rule_are_sharded_by_their_batch_rule_and_equal_the_whole_op():
    tally = sweep(1, ops=BY_BATCH_RULE)
    assert tally.failed == [], "\n".join(tally.failed)
    by_batch_rule = {op for op, entry in tally.by_op.items() if entry["by_batch_rule"]}
    assert by_batch_rule == {"log", "cumsum", "stack"}, tally.by_op
    # their first samples normalise / reduce over the sharded dim: whole, in the batch rule's words (or,
    # before it is asked, because layer_norm's replicated weight spans the sharded dim)
    assert set(tally.by_op["nn.functional.layer_norm"]["whole"]) == {
        "its batch rule (layer_norm) does not split it along the sharded dim",
        "a replicated operand has a dim of the sharded extent",
    }
    assert all("reduction_along_other_dims" in why for why in tally.by_op["amax"]["whole"])


def test_attention_and_bmm_shard_along_the_heads_of_q_k_v():
    """Their OpInfo samples are (batch, seq, dim): sharded on -3 with q, k, v alike, each shard runs its rows."""
    q, k, v = torch.randn(4, 3, 8), torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    outcomes = dict(run_sample("call_function", F.scaled_dot_product_attention, SampleInput(q, args=(k, v))))
    assert outcomes["dim=-3 n=3 co"] == "sharded"
    assert outcomes["dim=-3 n=3"].startswith("whole: attention with q, k, v not all sharded")
    assert outcomes["dim=-1 n=2 co"].startswith("whole: ")  # the head dim: contracted
    outcomes = dict(
        run_sample("call_function", torch.bmm, SampleInput(torch.randn(5, 3, 4), args=(torch.randn(5, 4, 2),)))
    )
    assert outcomes["dim=-3 n=2 co"] == "sharded" and outcomes["dim=-1 n=2"].startswith("whole: a matmul")


def test_softmax_and_getitem_shard_along_a_dim_they_do_not_reduce_or_index():
    x = torch.randn(4, 5, 6)
    outcomes = dict(run_sample("call_function", torch.softmax, SampleInput(x, args=(1,))))
    assert outcomes["dim=-1 n=3"] == outcomes["dim=-3 n=2"] == "sharded"
    assert outcomes["dim=-2 n=2"] == "whole: softmax over the sharded dim"
    outcomes = dict(run_sample("call_function", operator.getitem, SampleInput(x, args=((slice(1, 3), None, 2),))))
    assert outcomes["dim=-1 n=3"] == "sharded"  # x[1:3, None, 2]: the last dim taken whole
    assert outcomes["dim=-2 n=2"] == outcomes["dim=-3 n=2"] == "whole: indexes or slices the sharded dim"


def test_a_wrong_rule_fails_by_its_run(monkeypatch):
    """A softmax rule that lets the sharded dim through (each shard normalised alone) is caught."""
    monkeypatch.setattr(sharding_rules, "softmax", lambda ctx, node, dim: (ctx.layout(node.args[0]), []))
    with pytest.raises(AssertionError, match=r"dim=-1 n=2: AssertionError: Tensor-likes are not close"):
        list(run_sample("call_function", torch.softmax, SampleInput(torch.randn(3, 5), args=(-1,))))


def test_a_rule_that_claims_the_wrong_shard_sizes_fails():
    """unsqueeze keeps the sizes; a rule that says otherwise is named by the sizes the shards hold."""
    real = sharding_rules.shape_rules.unsqueeze

    def wrong(ctx, node):
        layout, copies = real(ctx, node)
        return type(layout)(layout.dim, tuple(reversed(layout.sizes))), copies

    x = SampleInput(torch.randn(4, 7), args=(0,))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sharding_rules, "_RULES", tuple((f, wrong if r is real else r) for f, r in sharding_rules._RULES))
        with pytest.raises(AssertionError, match=r"the rule says shards of \(3, 4\) on dim -1, they hold \(4, 3\)"):
            list(run_sample("call_function", torch.unsqueeze, x))


def test_a_cast_to_a_device_needs_the_whole_tensor():
    outcomes = dict(run_sample("call_method", "to", SampleInput(torch.randn(3, 4), args=("cpu",))))
    assert set(outcomes.values()) == {"whole: a cast that moves the value to a device, or takes another tensor"}


def test_uneven_pieces():
    assert uneven(7, 2) == (4, 3) and uneven(6, 2) == (4, 2) and uneven(6, 3) == (3, 2, 1) and uneven(2, 2) == (1, 1)
    assert sum(uneven(25, 3)) == 25


def test_the_coverage_page_is_current():
    """docs/sharding_rules_coverage.md is what the rules and the sweep's figures write (regenerate it
    with the command it names)."""
    from dpcompile.analysis import sharding_coverage

    assert sharding_coverage.PAGE.read_text() == sharding_coverage.render(), (
        "run python -m dpcompile.analysis.sharding_coverage"
    )


def test_a_replicated_operand_spanning_the_sharded_dim_keeps_the_batch_rule_from_sharding():
    """prelu's weight spans the channels: sharded on them, each shard would read it whole (the
    every-sample sweep failed on prelu, and on diff's prepend, before sharding_batch refused them)."""
    tally = sweep(None, ops={"nn.functional.prelu"})
    assert tally.failed == [], "\n".join(tally.failed)
    assert "a replicated operand has a dim of the sharded extent" in tally.by_op["nn.functional.prelu"]["whole"]
    assert tally.by_op["nn.functional.prelu"]["by_batch_rule"] > 0  # where the weight is one number
