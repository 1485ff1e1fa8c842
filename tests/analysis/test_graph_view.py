"""The networkx view of a graph: edges per use, Linear chains and groups through shard-transparent ops."""

from __future__ import annotations

from torch import nn

from dpcompile.analysis.graph_view import find_linear_chains, linear_groups, to_networkx
from dpcompile.analysis.sharding import is_shard_transparent
from tests.helpers import captured
from tests.models import MLP, Attention, NormAfterColumn


def test_graph_view_has_an_edge_per_use():
    """The networkx view links x→fc1→relu→fc2→output."""
    g = to_networkx(captured(MLP()))
    assert list(g.edges) == [("x", "fc1"), ("fc1", "relu"), ("relu", "fc2"), ("fc2", "output")]


def test_graph_view_finds_the_mlp_chain_and_groups_attention():
    """fc1 reaches fc2 through relu; q, k, v and out form one group."""
    gm = captured(MLP())
    modules = dict(gm.named_modules())
    linears = {n for n in gm.graph.nodes if n.op == "call_module"}
    assert find_linear_chains(gm, linears, lambda n: is_shard_transparent(n, modules)) == [("fc1", "fc2")]
    attention = captured(Attention())
    linears = {n for n in attention.graph.nodes if n.op == "call_module"}
    groups = linear_groups(attention, linears, lambda n: is_shard_transparent(n, {}))
    assert groups == [["q", "k", "v", "out"]]


def test_graph_view_does_not_chain_through_a_norm():
    """A LayerNorm between two Linears breaks the chain."""
    gm = captured(NormAfterColumn())
    modules = dict(gm.named_modules())
    linears = {n for n in gm.graph.nodes if n.op == "call_module" and isinstance(modules[n.target], nn.Linear)}
    assert find_linear_chains(gm, linears, lambda n: is_shard_transparent(n, modules)) == []
