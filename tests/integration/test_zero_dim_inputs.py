"""A 0-dim tensor input beside the batch (a temperature, a scale) is the same on every device, as
eager broadcasts it; an output made of it and the parameters alone is returned once. Traced
without examples every tensor input is assumed to carry the batch on dim 0, and such a call
failed in the gather ("cannot gather 0-dim tensors along a batch dimension")."""

import copy

import pytest
import torch
from torch import nn

import dpcompile


class Tempered(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(2.0))
        self.fc = nn.Linear(4, 4)

    def forward(self, x, t):
        return (self.fc(x) * self.w * t).sum(-1), self.w * t


@pytest.mark.parametrize("options", [{}, {"pipeline": 2}, {"pipeline": 2, "micro_batches": 2}],
                         ids=["dp", "gpipe", "gpipe-2"])
def test_a_zero_dim_input_beside_the_batch_is_replicated(options):
    model = Tempered()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, **options)
    x = torch.randn(6, 4)
    for t in (torch.tensor(3.0), torch.full((6, 1), 0.5)):  # then t with the batch: split again
        got, want = pm(x, t), eager(x, t)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        (got[0].sum() + got[1].sum()).backward()
        (want[0].sum() + want[1].sum()).backward()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(dict(pm.named_parameters())[name].grad, p.grad)
