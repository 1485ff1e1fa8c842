"""Negative dims without example inputs: a rule resolves one only where a lower bound on the rank
says it cannot name the batch dim; otherwise the op runs whole. Never a wrong number."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dpcompile

CASES = {
    "mean": lambda h: h.mean(-2),
    "sum": lambda h: h.sum(-2),
    "amax": lambda h: h.amax(-2),
    "softmax": lambda h: h.softmax(-2),
    "cumsum": lambda h: h.cumsum(-2),
    "logsumexp": lambda h: h.logsumexp(-2),
    "normalize": lambda h: F.normalize(h, dim=-2),
    "cat": lambda h: torch.cat([h, h], -2),
    "transpose": lambda h: h.transpose(-1, -2),
    "size": lambda h: h * h.size(-2),
    "unsqueeze": lambda h: h.unsqueeze(-2).sum(0),
    "squeeze": lambda h: h[:, :1].squeeze(-1),
    "pairs": lambda h: h.view(-1, 2, 4).sum(1),
    "log_softmax": lambda h: h.log_softmax(-2),
    "argmax": lambda h: h.argmax(-2),
    "var": lambda h: h.var(-2),
    "std": lambda h: h.std(-2),
    "norm": lambda h: h.norm(dim=-2),
    "flip": lambda h: h.flip(-2),
    "stack": lambda h: torch.stack([h, h], -2),
    "chunk": lambda h: torch.cat(h.chunk(2, -2)[::-1], -1),
    "split": lambda h: h.split(1, dim=-2)[0],
    "flatten": lambda h: h.unsqueeze(-1).flatten(-3),
    "unflatten": lambda h: h.unflatten(-2, (-1, 1)).sum(0),
    "pad_rows": lambda h: F.pad(h, (0, 0, 1, 1)),
    "pad_last": lambda h: F.pad(h, (1, 2), value=3.0),
}


class Head(torch.nn.Module):
    def __init__(self, f):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.f = f

    def forward(self, x):
        return self.f(self.fc(x))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("n", [2, 4])
def test_rank_agnostic_negative_dim_on_2d_batch_exact(name, n):
    """On a 2-D batch, without example_inputs, ``-2`` names the batch dim: values match eager
    (a 6-row batch on 4 devices gives chunks with odd rows)."""
    model, x = Head(CASES[name]), torch.randn(6, 4)
    pm = dpcompile.transform(model, ["cpu"] * n)
    torch.testing.assert_close(pm(x), model(x))


class Padded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.pad = torch.nn.ZeroPad2d((1, 1, 2, 0))

    def forward(self, x):
        return self.pad(self.fc(x))


@pytest.mark.parametrize("shape", [(6, 4), (5, 3, 4), (7, 2, 3, 4)])
@pytest.mark.parametrize("examples", [False, True])
def test_rank_agnostic_padding_layer_that_may_pad_the_batch_runs_whole(shape, examples):
    """``ZeroPad2d`` pads the last two dims: of a 2-D batch that is the batch itself (more rows),
    so it runs whole there; with example inputs of rank 3+ it runs split. Values match."""
    torch.manual_seed(0)
    model, x = Padded(), torch.randn(*shape)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,) if examples else None)
    out = pm(x)
    assert out.shape == model(x).shape
    torch.testing.assert_close(out, model(x))
    whole = dpcompile.explain(pm, x).whole
    if len(shape) == 2:
        assert whole
    elif examples:
        assert not whole


def test_rank_agnostic_known_rank_still_splits():
    """Where the rank is known (a view to 3 sizes), ``softmax(-2)`` runs split, without gathers."""

    class Net(torch.nn.Module):
        def forward(self, x):
            return x.view(x.size(0), 2, -1).softmax(-2).mean(-1)

    model, x = Net(), torch.randn(6, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    assert dpcompile.explain(pm, x).whole == []
    torch.testing.assert_close(pm(x), model(x))


def test_rank_agnostic_view_pairs_with_shapes_run_whole_with_reason():
    """``h.view(-1, 2, D)`` pairs rows of different samples: whole, with the reason."""
    model, x = Head(CASES["pairs"]), torch.randn(6, 4)
    pm = dpcompile.transform(model, ["cpu"] * 4, example_inputs=(x,))
    assert "groups rows of several samples" in dpcompile.explain(pm, x).whole[0]["reason"]
    torch.testing.assert_close(pm(x), model(x))


def test_rank_agnostic_view_of_sequence_first_rnn_output_splits_without_shapes():
    """``h.view(t, b, 2, -1)`` of an LSTM's (T, B, H) output, sizes read from ``h.shape``, keeps
    the batch on dim 1 without example inputs; merging T and B runs whole, with the reason."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(4, 8)
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            h, _ = self.rnn(x)
            t, b, d = h.shape
            halves = self.fc(h.view(t, b, 2, d // 2))
            return halves, h.reshape(t * b, d)

    model, x = Net(), torch.randn(5, 6, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    whole = dpcompile.explain(pm, x).whole
    assert [w["node"] for w in whole if "recomputed" not in w["reason"]] == ["reshape"]  # t * b is a size, T and B merge
    for got, expected in zip(pm(x), model(x)):
        torch.testing.assert_close(got, expected)
