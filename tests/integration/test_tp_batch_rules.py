"""Ops no sharding rule names, carried sharded by their batch rule (one rule table,
dpcompile/analysis/sharding_batch.py): between a column and a row layer they keep the shards
(no all-gather), the automatic plan pairs the layers across them, and the program equals eager."""

from __future__ import annotations

import copy

import torch
from torch import nn

import dpcompile
from tests.helpers import full_gradients


class CosBetween(nn.Module):
    """``torch.cos`` and ``x.clamp(min=...)`` (pointwise, batch rules only) between two layers."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.cos(self.up(x)).clamp(min=-0.5))


def test_an_op_only_the_batch_rules_know_stays_sharded_between_column_and_row():
    torch.manual_seed(0)
    reference = CosBetween().double()
    x = torch.randn(5, 8, dtype=torch.float64)
    pm = dpcompile.transform(copy.deepcopy(reference), ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    assert pm.plan == {"up": "column", "down": "row"}
    assert "gather" not in pm.code  # cos and clamp run on each shard's 8 columns
    out = pm(x)
    want = reference(x)
    torch.testing.assert_close(out, want)
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    got = full_gradients(pm)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")
