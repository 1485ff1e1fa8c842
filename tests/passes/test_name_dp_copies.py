"""name_dp_copies: a piece ``_mb<j>`` of a batch split over dp copies is named ``_dp<r>[_mb<m>]``."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from passes import find_piece_names, name_dp_copies


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
