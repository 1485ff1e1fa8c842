"""The one batch-rule table: every core ATen op is in it, its fx spellings ask the same rule, and
docs/batch_rules_coverage.md is written from it."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from dpcompile.analysis.batch_rules import BATCH_RULES, coverage, rule_for
from dpcompile.analysis.batch_rules.checks import BatchRuleError, check_placement
from dpcompile.analysis.batch_rules.modules import per_sample_dim0
from dpcompile.analysis.batch_rules.table import OWN_RULES, TABLE, core_ops, spellings
from dpcompile.analysis.placement import Split, Tuple

aten = torch.ops.aten


def test_every_core_aten_op_has_a_rule_or_an_explicit_whole():
    """All of torch.export's core opset: each overload's packet has an entry, a whole one with its reason."""
    ops = core_ops()
    assert len(ops) > 150
    missing = [op for op in ops if op.split(".")[1] not in TABLE]
    assert missing == []
    assert all(e.whole is None or len(e.whole) > 20 for e in TABLE.values())
    for overload in (aten.add.Tensor, aten.gather.default, aten.convolution.default, aten.sort.default):
        entry = TABLE[overload._opname]
        assert entry.whole is None and BATCH_RULES.function_rule(overload) is entry.rule
    assert TABLE["nonzero"].whole and BATCH_RULES.function_rule(aten.nonzero.default) is TABLE["nonzero"].rule


def test_fx_spellings_resolve_to_the_rule_of_their_aten_op():
    """torch.acos, x.acos() and aten.acos ask one rule; no spelling has a second one, but those
    whose rule of their own is documented (batch norm's synced statistics)."""
    others = {}
    for entry in TABLE.values():
        _, other = spellings(entry)
        for target, rule in other:
            if target not in OWN_RULES:
                others[f"{entry.op}: {target}"] = rule
    assert others == {}
    same, _ = spellings(TABLE["native_layer_norm"])
    assert {F.layer_norm, torch.nn.LayerNorm} <= set(same)
    same, _ = spellings(TABLE["convolution"])
    assert {F.conv2d, torch.nn.Conv2d, torch.nn.ConvTranspose2d} <= set(same)


def test_one_rule_for_a_function_a_method_and_an_aten_node():
    """Nodes of both frontends look the same rule up: torch.gather, x.gather() and aten.gather.default."""
    graph = fx.Graph()
    x, index = graph.placeholder("x"), graph.placeholder("index")
    nodes = [
        graph.call_function(torch.gather, (x, 1, index)),
        graph.call_method("gather", (x, 1, index)),
        graph.call_function(aten.gather.default, (x, 1, index)),
    ]
    rules = {rule_for(n, None) for n in nodes}
    assert rules == {TABLE["gather"].rule}


def test_the_coverage_page_is_current():
    """docs/batch_rules_coverage.md is what the table writes (regenerate it with the command it names)."""
    assert coverage.PAGE.read_text() == coverage.render(), "run python -m dpcompile.analysis.batch_rules.coverage"


def test_a_placement_the_example_output_cannot_have_names_the_rule_and_the_op():
    """One split for an ATen op's tuple of tensors, or a dim past the output's rank, is refused
    when the program is built (check_placement runs on every rule's answer in propagation)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    pool = graph.call_function(aten.max_pool2d_with_indices.default, (x, [2, 2]))
    pool.meta["val"] = aten.max_pool2d_with_indices.default(torch.randn(5, 3, 4, 4), [2, 2])
    check_placement(pool, Tuple((Split(0), Split(0))), TABLE["max_pool2d_with_indices"].rule, "pool")
    with pytest.raises(BatchRuleError, match=r"batch rule per_sample_dim0 for aten.max_pool2d.* one split for a tuple"):
        check_placement(pool, Split(0), per_sample_dim0, "aten.max_pool2d_with_indices")
    relu = graph.call_function(aten.relu.default, (x,))
    relu.meta["val"] = torch.randn(5, 3)
    with pytest.raises(BatchRuleError, match="split on dim 2, but the output has 2 dims"):
        check_placement(relu, Split(2), TABLE["relu"].rule, "aten.relu")
