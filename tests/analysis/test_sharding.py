"""The sharding analysis: finding Linear layers, splitting sizes, layouts and the ops shards pass through."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpcompile.analysis.sharding import aligned_split, analyze_sharding, find_linear_sites, is_shard_transparent
from tests.helpers import captured
from tests.models import MLP, NormAfterColumn, Shared, Tied


# ---------------------------------------------------------------------- finders
def test_find_linear_sites_reports_features_and_bias():
    """Each called Linear is found by path with its in/out features and bias."""
    sites = find_linear_sites(captured(MLP(8, 16, 4)))
    assert [(p, s.in_features, s.out_features, s.bias, s.blocker) for p, s in sites.items()] == [
        ("fc1", 8, 16, True, None),
        ("fc2", 16, 4, True, None),
    ]


def test_find_linear_sites_finds_a_root_linear_as_empty_path():
    """A model that is itself an nn.Linear traces to F.linear; its site path is ''."""
    sites = find_linear_sites(captured(nn.Linear(6, 3)))
    assert list(sites) == [""] and sites[""].out_features == 3


def test_find_linear_sites_blocks_a_shared_layer():
    """A Linear called twice gets a blocker saying so."""
    assert "called 2 times" in find_linear_sites(captured(Shared()))["fc"].blocker


def test_find_linear_sites_blocks_tied_weights():
    """A Linear whose weight is also read directly gets a blocker."""
    assert "tied" in find_linear_sites(captured(Tied()))["fc"].blocker


def test_aligned_split_balances_uneven_and_respects_granularity():
    """10 over 3 is (4, 3, 3); 12 over 2 in whole 4s is (8, 4); too few units raise."""
    assert aligned_split(10, 3) == (4, 3, 3)
    assert aligned_split(12, 2, 4) == (8, 4)
    with pytest.raises(ValueError, match="12 cannot be split into 4 shards of whole 4s"):
        aligned_split(12, 4, 4)


# ---------------------------------------------------------------------- analysis
def test_analyze_sharding_pairs_column_with_row_without_gathers():
    """An MLP planned column→row needs only f on the input and g after the row layer."""
    gm = captured(MLP(), torch.randn(4, 8))
    analysis = analyze_sharding(gm, styles={"fc1": "column", "fc2": "row"}, n=2)
    assert [(c.kind, c.backward) for c in analysis.comms] == [("identity", "all_reduce"), ("all_reduce", None)]
    assert analysis.pairs == {"fc2": frozenset({"fc1"})}
    assert analysis.row_sizes["fc2"] == analysis.column_sizes["fc1"] == (8, 8)


def test_analyze_sharding_gathers_before_layer_norm():
    """A LayerNorm needs the whole feature dim, so a column output is all-gathered before it."""
    gm = captured(NormAfterColumn(), torch.randn(4, 8))
    analysis = analyze_sharding(gm, styles={"fc1": "column", "fc2": "row"}, n=2)
    kinds = [c.kind for c in analysis.comms]
    assert "all_gather" in kinds and "split" in kinds
    assert "norm" in analysis.gathered["fc1"][0]


def test_is_shard_transparent_accepts_elementwise_and_rejects_norm():
    """relu is transparent, LayerNorm is not."""
    gm = captured(NormAfterColumn())
    modules = dict(gm.named_modules())
    by_name = {n.name: n for n in gm.graph.nodes}
    assert not is_shard_transparent(by_name["norm"], modules)
    assert is_shard_transparent(next(n for n in captured(MLP()).graph.nodes if n.name == "relu"), {})
