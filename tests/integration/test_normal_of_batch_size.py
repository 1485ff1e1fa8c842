"""``torch.normal(mean, std, size)`` sized by the batch (``(x.size(0), h)``, ``x.shape``) splits with
the batch, like ``torch.zeros`` of that size, and draws the single-device values: before, it had no
batch rule, ran whole under data parallel and was refused by 1F1B."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile


class NoisyRegression(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.a(x) + torch.normal(0.0, 1.0, (x.size(0), 8)) + torch.normal(0.0, 2.0, size=x.shape)
        return F.mse_loss(self.b(h), y)


def _step(model, x, y):
    torch.manual_seed(0)
    loss = model(x, y)
    state = torch.get_rng_state()
    loss.backward()  # 1F1B ran it inside the call already: this adds nothing there
    return loss.detach(), state, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("options", [{}, {"pipeline": 2}, {"pipeline": 2, "schedule": "1f1b"}],
                         ids=["dp", "gpipe", "1f1b"])
def test_normal_sized_by_the_batch_splits_and_draws_the_single_device_values(options):
    model, x, y = NoisyRegression(), torch.randn(8, 8), torch.randn(8, 8)
    expected = _step(model, x, y)
    pm = dpcompile.transform(model, ["cpu"] * 2, **options)
    if not options:
        assert dpcompile.explain(pm, x, y).whole == []  # split, not run on the gathered batch
    loss, state, grads = _step(pm, x, y)
    torch.testing.assert_close(loss, expected[0], rtol=0, atol=1e-6)
    assert torch.equal(state, expected[1])  # the generator ends where eager leaves it
    assert grads.keys() == expected[2].keys()
    for name, want in expected[2].items():
        torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-6)
