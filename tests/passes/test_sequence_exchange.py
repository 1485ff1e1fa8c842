"""``insert_sequence_exchange`` and the rules context parallelism adds: attention over split
queries, the exchange markers, a table sliced to a split size."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile import runtime
from dpcompile.analysis.batch_dims import propagate
from dpcompile.analysis.placement import REPLICATED, Split, Whole
from passes.context_parallel import find_sequence_attention, insert_sequence_exchange
from tests.helpers import captured


class Attend(nn.Module):
    def __init__(self, causal: bool = False):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


class TableRows(nn.Module):
    """Adds rows of a table sliced to the sequence length, in ATen's spelling (what export writes)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(40.0).view(10, 4))

    def forward(self, x):
        return x + torch.ops.aten.slice.Tensor(self.table, 0, 0, x.size(1))


def _qkv(seq: int = 6) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(2, 2, seq, 4) for _ in range(3))


def _placement_of_attention(gm: fx.GraphModule, dims: dict) -> object:
    placements = propagate(gm, dims)
    return next(p for n, p in placements.items() if n.op == "call_function" and n.target is F.scaled_dot_product_attention)


def test_sdpa_rule_splits_queries_against_whole_keys():
    """Queries split on their sequence dim, keys and values the same on every device: split."""
    gm = captured(Attend(), *_qkv())
    assert _placement_of_attention(gm, {"q": 2, "k": None, "v": None}) == Split(2)


def test_sdpa_rule_refuses_split_keys_and_a_causal_flag():
    """Split keys (each device would see only its own) and is_causal (read against local rows) run whole."""
    assert isinstance(_placement_of_attention(captured(Attend(), *_qkv()), {"q": 2, "k": 2, "v": 2}), Whole)
    causal = captured(Attend(causal=True), *_qkv())
    assert isinstance(_placement_of_attention(causal, {"q": 2, "k": None, "v": None}), Whole)


def test_sequence_markers_place_keys_whole_and_mask_rows_split():
    """sequence_whole of a split value is whole on every device; sequence_split of a replicated one is split."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    table = graph.placeholder("table")
    whole = graph.call_function(runtime.sequence_whole, (x, 1))
    rows = graph.call_function(runtime.sequence_split, (table, 0))
    graph.output((whole, rows))
    placements = propagate(fx.GraphModule(nn.Module(), graph), {"x": 1, "table": None})
    assert placements[whole] == Whole(batch=False)
    assert placements[rows] == Split(0)
    assert propagate(fx.GraphModule(nn.Module(), graph), {"x": None, "table": None})[whole] == REPLICATED


def test_insert_sequence_exchange_marks_keys_values_and_causal_positions():
    """Keys and values marked whole, is_causal made causal attention at the queries' positions; the
    program still computes what it did on one device; a second run changes nothing."""
    q, k, v = _qkv()
    gm = captured(Attend(causal=True), q, k, v)
    assert len(find_sequence_attention(gm)) == 1
    result = insert_sequence_exchange(gm, input_dims={"q": 2, "k": 2, "v": 2})
    gm.recompile()
    assert result.modified
    assert [n.target for n in gm.graph.nodes].count(runtime.sequence_whole) == 2
    attention = next(n for n in gm.graph.nodes if n.target is runtime.causal_attention)
    assert attention.args[3].name.endswith("query_positions")
    placements = propagate(gm, {"q": 2, "k": 2, "v": 2})
    assert placements[attention] == Split(2)
    torch.testing.assert_close(gm(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    count = len(gm.graph.nodes)
    assert not insert_sequence_exchange(gm, input_dims={"q": 2, "k": 2, "v": 2}).modified
    assert len(gm.graph.nodes) == count


def test_insert_sequence_exchange_without_attention_is_a_no_op():
    """A graph without attention is left as it is."""
    gm = captured(nn.Linear(4, 4), torch.randn(2, 3, 4))
    before = len(gm.graph.nodes)
    assert not insert_sequence_exchange(gm, input_dims={"input": 1}).modified
    assert len(gm.graph.nodes) == before


def test_table_sliced_to_a_split_size_gives_each_device_its_rows():
    """table[:seq_len] with the sequence split: each device adds its own rows (runtime.rows_of_shard),
    equal to eager for a length that does not divide the devices."""
    model = TableRows()
    x = torch.randn(2, 5, 4)
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, batch_dim=1, example_inputs=(x,))
    assert "dpcompile_runtime_rows_of_shard" in pm.code
    torch.testing.assert_close(pm(x), model(x))
    assert runtime.rows_of_shard(torch.arange(10), 0, [3, 2], 1).tolist() == [3, 4]
