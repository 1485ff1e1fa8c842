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


def test_every_op_of_the_export_training_ir_resolves_to_a_rule_or_a_reason():
    """The ops torch.export's default IR emits (not only core ATen) each resolve: a rule, a whole
    with its reason, an in-place op functionalised first, or a check the frontend drops."""
    from dpcompile.analysis.batch_rules.export_ir import EXPORT_IR_OPS, resolve

    assert len(EXPORT_IR_OPS) > 100
    unresolved = [op for op in EXPORT_IR_OPS if resolve(op)[0] == "none"]
    assert unresolved == []
    for op in ("tensor_split.indices", "pad.default", "linear.default", "dropout.default", "layer_norm.default",
               "group_norm.default", "linalg_vector_norm.default", "einsum.default", "argsort.default",
               "reshape_as.default", "unfold.default", "im2col.default", "to.dtype"):  # fmt: skip
        assert resolve(op)[0] == "rule", op
    assert resolve("add_.Tensor")[0] == "in place" and resolve("_assert_tensor_metadata.default")[0] == "dropped"


class _ExportZoo(torch.nn.Module):
    """Layers of common models, for what torch.export emits for them."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.gn = torch.nn.GroupNorm(2, 4)
        self.ln = torch.nn.LayerNorm(8)
        self.lin = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, img, seq):
        h = F.max_pool2d(torch.relu_(self.gn(self.conv(img))), 2)
        h = F.adaptive_avg_pool2d(F.pad(h, (1, 1, 1, 1)), 1).flatten(1)
        s = self.drop(F.gelu(self.lin(self.ln(seq))))
        q = s.view(s.shape[0], s.shape[1], 2, 4).transpose(1, 2)
        s = F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape_as(s)
        parts = torch.tensor_split(s, [2], dim=1)
        return h.sum(-1) + parts[0].norm(dim=-1).sum(-1) + parts[1].float().mean((1, 2))


def test_what_export_emits_for_small_models_resolves():
    """Every ATen op of a default torch.export of common layers resolves (none asks a missing rule),
    and the export frontend's program of them runs all split, equal to eager."""
    from dpcompile.analysis.batch_rules.export_ir import resolve

    program = torch.export.export(_ExportZoo(), (torch.randn(2, 3, 8, 8), torch.randn(2, 6, 8)), strict=False)
    emitted = {str(n.target).removeprefix("aten.") for n in program.graph.nodes if n.op == "call_function"
               and isinstance(n.target, torch._ops.OpOverload)}  # fmt: skip
    assert {"tensor_split.indices", "pad.default", "linear.default", "group_norm.default"} <= emitted
    assert [op for op in sorted(emitted) if resolve(op)[0] == "none"] == []
    import copy

    import dpcompile

    model = _ExportZoo()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 3, frontend="export", example_inputs=(torch.randn(4, 3, 8, 8), torch.randn(4, 6, 8)))
    inputs = (torch.randn(5, 3, 8, 8), torch.randn(5, 6, 8))
    torch.testing.assert_close(pm(*inputs), eager(*inputs))
    report = dpcompile.explain(pm, *inputs)
    assert report.whole == [] and report.split_flop_fraction == 1.0
