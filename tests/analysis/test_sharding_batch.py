"""An op no sharding rule names, asked of its batch rule with the sharded dim as the split dim
(dpcompile/analysis/sharding_batch.py): one rule table, asked on each dim, by the analysis itself
(apply_rule); proved op by op by tests/analysis/opinfo_shard.py."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

from dpcompile.analysis.sharding_batch import from_batch_rule
from dpcompile.analysis.sharding_layout import NeedsWhole, Sharded
from dpcompile.analysis.sharding_rules import apply_rule


def test_ops_without_a_sharding_rule_are_sharded_by_their_batch_rule():
    """``sin`` and a ``cumsum`` along another dim: their batch rules keep the shards (sin's pieces of 3
    and 1 columns, the same sizes out), and the analysis' apply_rule answers so too."""
    for fn, args in ((torch.sin, ()), (torch.cumsum, (1,))):
        gm, node = _one_op(fn, torch.rand(2, 5, 4), *args)
        assert from_batch_rule(_Layouts(-1), node, {}) == (Sharded(-1, (3, 1)), [])
        assert apply_rule(_Layouts(-1), node, {}) == (Sharded(-1, (3, 1)), [])


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
        from_batch_rule(_Layouts(dim), node, {})
