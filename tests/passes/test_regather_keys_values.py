"""``regather_keys_values``: on a lowered context-parallel program, each device's attention gathers
its keys and values itself (again in backward); an attention with dropout is left as it is."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile import runtime
from passes.regather_keys_values import find_regather_sites, regather_keys_values


class Block(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.qkv, self.dropout = nn.Linear(8, 24), dropout

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout).sum(1)


def _calls(gm: fx.GraphModule, target: object) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def _lowered_without_regather(model: nn.Module, x: torch.Tensor) -> fx.GraphModule:
    """The program context parallel lowers, with its attention calls put back on the gathered keys and
    values (what the pass starts from)."""
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,))
    gm = copy.deepcopy(pm)
    graph = gm.graph
    for node in _calls(gm, runtime.attention_regathered):
        query, key_shards, value_shards, dim, device, positions = node.args
        with graph.inserting_before(node):
            keys = graph.call_function(runtime.gather_sequence, (key_shards, dim, device))
            values = graph.call_function(runtime.gather_sequence, (value_shards, dim, device))
        node.target, node.args = runtime.causal_attention, (query, keys, values, positions)
    gm.recompile()
    return gm


def test_each_device_gathers_inside_its_attention_and_the_gathers_go():
    """Both devices' causal calls become attention_regathered over the shards; the shared gathers are
    erased; the program computes what it did (outputs and gradients, float64)."""
    torch.manual_seed(0)
    model = Block().double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    gm = _lowered_without_regather(model, x)
    want = gm(x)
    weight = next(gm.parameters())
    (want_grad,) = torch.autograd.grad(want.square().sum(), [weight])
    sites = find_regather_sites(gm)
    assert [s.attention.name for s in sites] == [n.name for n in _calls(gm, runtime.causal_attention)]
    assert len(sites) == 2
    result = regather_keys_values(gm)
    gm.recompile()
    assert result.modified
    assert not _calls(gm, runtime.gather_sequence) and not _calls(gm, runtime.causal_attention)
    calls = _calls(gm, runtime.attention_regathered)
    assert [len(c.args[1]) for c in calls] == [2, 2]  # every device's key shards
    got = gm(x)
    torch.testing.assert_close(got, want)
    (got_grad,) = torch.autograd.grad(got.square().sum(), [weight])
    torch.testing.assert_close(got_grad, want_grad)
    assert not regather_keys_values(gm).modified  # nothing left to rewrite


def test_attention_with_dropout_or_keys_on_two_dims_is_left_as_it_is():
    """dropout_p draws per element (the exact-random passes place its draws), and keys and values
    gathered along different dims are not one exchange: no site, nothing changed."""
    graph = fx.Graph()
    q, k0, k1, v0, v1 = (graph.placeholder(name) for name in ("q", "k0", "k1", "v0", "v1"))
    keys = graph.call_function(runtime.gather_sequence, ([k0, k1], 2, "cpu"))
    values = graph.call_function(runtime.gather_sequence, ([v0, v1], 2, "cpu"))
    values_on_1 = graph.call_function(runtime.gather_sequence, ([v0, v1], 1, "cpu"))
    dropped = graph.call_function(F.scaled_dot_product_attention, (q, keys, values), {"dropout_p": 0.1})
    two_dims = graph.call_function(F.scaled_dot_product_attention, (q, keys, values_on_1))
    graph.output((dropped, two_dims))
    gm = fx.GraphModule(nn.Module(), graph)
    assert find_regather_sites(gm) == []
    assert not regather_keys_values(gm).modified
    assert len(_calls(gm, runtime.gather_sequence)) == 3
