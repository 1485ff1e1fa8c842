"""name_dp_copies: a piece ``_mb<j>`` of a batch split over dp copies is named ``_dp<r>[_mb<m>]``."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from passes import find_piece_names, name_dp_copies, number_copies_of_pieces
from passes.name_dp_copies import COPY


def _pieces(n: int) -> fx.GraphModule:
    """A graph whose nodes are named as a lowering names ``n`` pieces: ``x_mb<j>``, ``fc_mb<j>_to_stage1``."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    outs = []
    for j in range(n):
        piece = graph.call_function(torch.relu, (x,))
        piece._rename(f"x_mb{j}")
        sent = graph.call_function(torch.neg, (piece,))
        sent._rename(f"fc_mb{j}_to_stage1")
        outs.append(sent)
    graph.output(tuple(outs))
    return fx.GraphModule(nn.Module(), graph)


def test_find_piece_names_maps_each_piece_to_its_copy():
    """Piece j of M micro-batches per copy is micro-batch j % M of copy j // M."""
    found = find_piece_names(_pieces(4), micro_batches=2)
    assert sorted((name, copy) for name, copy in found.values()) == [
        ("fc_dp0_mb0_to_stage1", 0), ("fc_dp0_mb1_to_stage1", 0), ("fc_dp1_mb0_to_stage1", 1),
        ("fc_dp1_mb1_to_stage1", 1), ("x_dp0_mb0", 0), ("x_dp0_mb1", 0), ("x_dp1_mb0", 1), ("x_dp1_mb1", 1),
    ]  # fmt: skip


def test_name_dp_copies_one_micro_batch_per_copy_names_the_copy_alone():
    """With one micro-batch per copy the names carry the copy only, and the code still runs."""
    gm = _pieces(2)
    result = name_dp_copies(gm, micro_batches=1)
    gm.recompile()
    assert result.modified and result.info["renamed"] == 4
    assert [n.name for n in gm.graph.nodes if n.op == "call_function"] == [
        "x_dp0", "fc_dp0_to_stage1", "x_dp1", "fc_dp1_to_stage1"
    ]  # fmt: skip
    x = torch.randn(3)
    torch.testing.assert_close(gm(x), (-torch.relu(x), -torch.relu(x)))


def test_name_dp_copies_twice_changes_nothing_more():
    """A second run finds nothing to name (the copy is stamped), and a graph without pieces is left alone."""
    gm = _pieces(4)
    name_dp_copies(gm, micro_batches=2)
    names = [n.name for n in gm.graph.nodes]
    again = name_dp_copies(gm, micro_batches=2)
    assert not again.modified and [n.name for n in gm.graph.nodes] == names
    plain = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))
    assert not name_dp_copies(plain, micro_batches=1).modified
    assert [n.name for n in plain.graph.nodes if n.op == "placeholder"] == ["input_1"]


def test_number_copies_of_pieces_counts_dp_copies_of_the_sequence_pieces():
    """{"dp": 2, "cp": 2, "tp": ...}: ``x_dp<d>_mb<c>`` named ``x_dp<d>_cp<c>`` (copy c), then numbered
    copy ``d * 2 + c``; a node of no dp copy keeps its piece's number."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    names = ["x_dp0_mb0", "x_dp0_mb1", "x_dp1_mb0", "x_dp1_mb1", "pos_mb1"]
    for name in names:
        graph.call_function(torch.relu, (x,))._rename(name)
    graph.output(x)
    gm = fx.GraphModule(nn.Module(), graph)
    name_dp_copies(gm, micro_batches=1, prefix="cp")
    result = number_copies_of_pieces(gm, pieces=2)
    copies = {n.name: n.meta[COPY] for n in gm.graph.nodes if COPY in n.meta}
    assert copies == {"x_dp0_cp0": 0, "x_dp0_cp1": 1, "x_dp1_cp0": 2, "x_dp1_cp1": 3, "pos_cp1": 1}
    assert result.modified and result.info["numbered"] == 4
