"""Data-parallel edge cases users hit: a float16 loss keeps its dtype, a batch_dim the input does
not have is a clear error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dpcompile


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.fc(x), y)


def test_float16_cross_entropy_loss_stays_float16():
    """A float16 model's mean loss comes back float16 with the single-device value."""
    model = Classifier().half()
    x, y = torch.randn(6, 4).half(), torch.randint(0, 3, (6,))
    pm = dpcompile.transform(model, ["cpu"] * 2)
    got, expected = pm(x, y), model(x, y)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


def test_batch_dim_beyond_the_input_rank_is_a_value_error():
    """batch_dim=3 on a 2-D input names the argument and its shape, not an IndexError in gather."""
    pm = dpcompile.transform(torch.nn.Linear(4, 3), ["cpu"] * 2, batch_dim=3)
    with pytest.raises(ValueError, match=r"batch_dim=3, but argument 'input' has 2 dims \(shape \(6, 4\)\)"):
        pm(torch.randn(6, 4))


def test_unbatched_1d_input_runs_as_one_sample():
    """A 1-D input to a Linear is one sample without a batch dim: it runs on one device, as the
    model runs it, while a 2-D batch still splits."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    pm = dpcompile.transform(model, ["cpu"] * 2)
    x = torch.randn(4)
    torch.testing.assert_close(pm(x), model(x))
    batch = torch.randn(6, 4)
    torch.testing.assert_close(pm(batch), model(batch))
    assert "x_dev1" in pm.program_for_call(batch).code or "input_1_dev1" in pm.program_for_call(batch).code
