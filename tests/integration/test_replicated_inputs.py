"""Inputs the examples give without a batch dim (a mask of shape (1, 1, L, S)) are replicated; a
later call that gives them the batch must not broadcast each device's half-batch against every
sample's mask. And ``dynamic_dims=`` naming a dim an input lacks is an error, not ignored."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dpcompile
from tests.helpers import assert_weighted_gradients_equal

L = 5


class MaskedScores(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x, mask):
        q = self.q(x)  # (B, L, 8)
        scores = (q @ q.transpose(-1, -2)).unsqueeze(1) + mask  # (B, 1, L, L)
        return scores.softmax(-1).mean((1, 2, 3)) * q.sum((1, 2))  # one value per sample


@pytest.mark.parametrize("batch", [2, 4])
def test_replicated_input_given_the_batch_later_runs_a_program_that_splits_it(batch):
    """fx: the program for a mask with the batch is lowered with the mask split (batch 2 on two
    devices broadcast each one-sample chunk against both masks: a doubled batch)."""
    torch.manual_seed(0)
    model = MaskedScores()
    eager = copy.deepcopy(model)
    x = torch.randn(batch, L, 8)
    pm = dpcompile.transform(model, ["cpu", "cpu"], example_inputs=(x, torch.randn(1, 1, L, L)))
    assert pm.input_dims["mask"] is None
    shared = torch.randn(1, 1, L, L)
    torch.testing.assert_close(pm(x, shared), eager(x, shared))
    per_sample = torch.randn(batch, 1, L, L)
    out, expected = pm(x, per_sample), eager(x, per_sample)
    assert out.shape == expected.shape == (batch,)
    torch.testing.assert_close(out, expected)
    assert_weighted_gradients_equal(model, eager, out, expected)
    torch.testing.assert_close(pm(x, shared), eager(x, shared))  # the first program still serves the first form


class PairMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x, mask):
        q = self.q(x)
        return ((q @ q.transpose(-1, -2)) + mask).softmax(-1).mean((1, 2)) * q.sum((1, 2))


def test_replicated_input_given_more_dims_later_is_split():
    """An ``(L, L)`` mask in the examples, ``(B, L, L)`` in a call whose batch happens to equal L:
    the size on dim 0 is the example's, the rank is not."""
    torch.manual_seed(0)
    model = PairMask()
    pm = dpcompile.transform(model, ["cpu", "cpu"], example_inputs=(torch.randn(4, L, 8), torch.randn(L, L)))
    x, mask = torch.randn(L, L, 8), torch.randn(L, L, L)
    torch.testing.assert_close(pm(x, mask), model(x, mask))


def test_replicated_input_of_another_size_is_refused_by_name():
    model = MaskedScores()
    x = torch.randn(4, L, 8)
    pm = dpcompile.transform(model, ["cpu", "cpu"], example_inputs=(x, torch.randn(1, 1, L, L)))
    with pytest.raises(dpcompile.DpCompileError, match=r"argument 'mask' has shape \(2, 1, 5, 5\).*example_inputs="):
        pm(x, torch.randn(2, 1, L, L))


def test_export_refuses_a_replicated_input_given_the_batch_with_the_way_out():
    model = MaskedScores()
    x = torch.randn(4, L, 8)
    pm = dpcompile.transform(model, ["cpu", "cpu"], example_inputs=(x, torch.randn(1, 1, L, L)), frontend="export")
    with pytest.raises(dpcompile.DpCompileError, match=r"'mask' has shape \(4, 1, 5, 5\).*dim 0: 4 vs 1.*example_inputs= whose 'mask' has the size"):
        pm(x, torch.randn(4, 1, L, L))


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_dynamic_dims_naming_a_dim_the_input_lacks_raises(frontend):
    model = MaskedScores()
    examples = (torch.randn(4, L, 8), torch.randn(1, 1, L, L))
    with pytest.raises(ValueError, match=r"dynamic_dims= names dim 3 of 'x', but the example of 'x' has 3 dims"):
        dpcompile.transform(model, ["cpu", "cpu"], example_inputs=examples, dynamic_dims={"x": [1, 3]}, frontend=frontend)
    with pytest.raises(ValueError, match=r"dynamic_dims= names \['y'\]"):
        dpcompile.transform(model, ["cpu", "cpu"], example_inputs=examples, dynamic_dims={"y": [1]}, frontend=frontend)

