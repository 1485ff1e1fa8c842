"""An op no sharding rule names asks its batch rule with the sharded dim as the split dim
(dpcompile/analysis/sharding_batch.py): one rule table, asked on each dim."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

import dpcompile
from dpcompile.analysis.sharding import analyze_sharding
from dpcompile.analysis.sharding_layout import NeedsWhole, Sharded
from dpcompile.analysis.sharding_rules import apply_rule
from tests.helpers import captured

PLAN = {"fc1": "column", "fc2": "row"}


class SinCumsum(nn.Module):
    """Between a column and a row layer: ``sin`` and a ``cumsum`` along the sequence, which no
    sharding rule names; their batch rules split them along the features."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 12), nn.Linear(12, 8)

    def forward(self, x):
        return self.fc2(torch.sin(self.fc1(x)).cumsum(1))


def test_ops_without_a_sharding_rule_stay_sharded_by_their_batch_rule():
    x = torch.randn(2, 5, 8)
    gm = captured(SinCumsum(), x)
    analysis = analyze_sharding(gm, styles=PLAN, n=3)
    assert analysis.gathered == {} and analysis.pairs == {"fc2": frozenset({"fc1"})}
    layouts = {n.name: analysis.layouts[n] for n in gm.graph.nodes if n.name in ("sin", "cumsum")}
    assert layouts == {
        "sin": Sharded(-1, (4, 4, 4), frozenset({"fc1"})),
        "cumsum": Sharded(-1, (4, 4, 4), frozenset({"fc1"})),
    }


def test_the_program_with_delegated_ops_equals_eager():
    model, x = SinCumsum(), torch.randn(2, 5, 8)
    for n in (2, 3):
        pm = dpcompile.transform(model, ["cpu"] * n, tensor_parallel=PLAN, example_inputs=(x,))
        torch.testing.assert_close(pm(x), model(x))


def _one_op(fn, x: torch.Tensor, *args) -> tuple[fx.GraphModule, fx.Node]:
    graph = fx.Graph()
    node = graph.call_function(fn, (graph.placeholder("x"), *args))
    graph.output(node)
    gm = fx.GraphModule(nn.Module(), graph)
    for n, v in zip(gm.graph.nodes, (x, fn(x, *args))):
        n.meta["val"] = v
    return gm, node


class _Layouts:
    """``x`` sharded on ``dim`` in pieces of 3 and 1, for asking one rule."""

    def __init__(self, dim: int):
        self.dim = dim

    def layout(self, node):
        return Sharded(self.dim, (3, 1)) if node.name == "x" else None

    def mark_tuple(self, node):  # pragma: no cover - no tuples here
        raise AssertionError


@pytest.mark.parametrize(
    ("fn", "args", "dim", "reason"),
    [
        (torch.squeeze, (), -1, r"per-device rewrite \(a running sum, squeeze\(\)\)"),  # a shard of 1 loses its dim
        (torch.cumsum, (0,), -3, r"per-device rewrite"),  # of integers along the sharded dim: a running sum per shard
        (torch.cumsum, (-1,), -1, r"its batch rule \(cumsum\) does not split it along the sharded dim"),
        (torch.sum, (-1,), -1, r"a partial sum per shard"),
        (torch.poisson, (), -1, r"a random draw"),
    ],
)
def test_what_a_batch_rule_splits_only_with_the_data_parallel_pass_help_needs_the_whole_tensor(fn, args, dim, reason):
    x = torch.randint(0, 5, (4, 1, 4)) if fn is torch.cumsum and dim == -3 else torch.rand(4, 1, 4)
    gm, node = _one_op(fn, x, *args)
    with pytest.raises(NeedsWhole, match=reason):
        apply_rule(_Layouts(dim), node, {})
