"""The shared test helpers (``tests/helpers.py``) report what eager reports."""

from __future__ import annotations

import torch
from torch import nn

import dpcompile
from tests.helpers import full_gradients


class FrozenAndDetached(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) + self.c(x).detach()


def test_full_gradients_is_none_for_a_sharded_parameter_without_gradient_as_eager():
    """A frozen (``a``) and a detached (``c``) column-sharded layer: None, as eager's ``.grad``; ``b``'s gathered."""
    torch.manual_seed(0)
    model = FrozenAndDetached()
    model.a.requires_grad_(False)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True)
    assert {"a.weight", "c.weight"} <= set(pm.param_shards)
    x = torch.randn(3, 8)
    pm(x).sum().backward()
    model(x).sum().backward()
    got = full_gradients(pm)
    assert set(got) == {name for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        if p.grad is None:
            assert got[name] is None, name
        else:
            torch.testing.assert_close(got[name], p.grad, msg=name)
