"""functionalize_mutations on exported graphs: which in-place writes become values."""

from __future__ import annotations

import operator

import torch
from torch import nn

from dpcompile.capture import capture
from passes.functionalize import find_mutations, functionalize_mutations


class TopkThenDivideInPlace(nn.Module):
    """A mixture-of-experts router: ``top /= top.sum(-1, keepdim=True)`` on topk's values."""

    def forward(self, x):
        top, index = torch.topk(x.softmax(-1), 2, dim=-1)
        top /= top.sum(-1, keepdim=True)
        return top, index


class ChunkThenWriteInPlace(nn.Module):
    """``a.mul_(2)`` on a chunk writes into ``x`` itself: a chunk is a view, not a value of its own."""

    def forward(self, x):
        y = x * 1.0
        a, b = y.chunk(2, dim=-1)
        a.mul_(2)
        return y + b.sum()


def _graph(model: nn.Module) -> torch.fx.GraphModule:
    return torch.export.export(model, (torch.randn(3, 4),)).module()


def test_a_write_into_one_result_of_topk_becomes_its_out_of_place_twin():
    gm = _graph(TopkThenDivideInPlace())
    x = torch.randn(3, 4)
    expected = TopkThenDivideInPlace()(x)
    assert [m.node.target for m in find_mutations(gm)] == [torch.ops.aten.div_.Tensor]
    functionalize_mutations(gm)
    gm.recompile()
    assert torch.ops.aten.div.Tensor in {n.target for n in gm.graph.nodes}
    assert torch.ops.aten.div_.Tensor not in {n.target for n in gm.graph.nodes}
    torch.testing.assert_close(gm(x), expected)


def test_a_write_into_a_chunk_is_left_alone():
    gm = _graph(ChunkThenWriteInPlace())
    assert torch.ops.aten.mul_.Tensor in {n.target for n in gm.graph.nodes}
    assert find_mutations(gm) == []


class WritesItsInputThenReadsAView(nn.Module):
    """``x[:, 0] = 0`` into an input, then ``v[:, 1].zero_()`` through a view read after the write."""

    def forward(self, x):
        x[:, 0] = 0
        h = x * 2.0
        v = h.view(h.shape[0], 2, 2)
        v[:, 1].zero_()
        return v.sum(-1), h


def test_writes_into_inputs_are_written_back_and_views_read_after_are_made_again():
    gm = capture(WritesItsInputThenReadsAView())
    result = functionalize_mutations(gm, inputs=True)
    gm.recompile()
    assert result.info["written_back"] == ["x"]
    assert not any(str(n.target).endswith("_") or n.target is operator.setitem for n in gm.graph.nodes)
    x = torch.randn(3, 4)
    x_eager, x_graph = x.clone(), x.clone()
    expected = WritesItsInputThenReadsAView()(x_eager)
    got = gm(x_graph)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(x_graph, x_eager)


def test_writes_into_inputs_are_left_alone_by_default():
    gm = capture(WritesItsInputThenReadsAView())
    assert [m.node.target for m in find_mutations(gm)] == ["zero_"]  # the write into h alone
