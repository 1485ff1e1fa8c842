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


class Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        import torch.utils.checkpoint as cp
        from torch.utils.checkpoint import checkpoint

        h = cp.checkpoint(self.block, x, use_reentrant=False)
        h = checkpoint(self.norm, h, use_reentrant=False)  # BatchNorm in training: the whole batch
        return self.head(h)


def test_activation_checkpointing_kept_per_device():
    """``checkpoint(self.block, x)`` stays a checkpoint call, one per device; a checkpointed
    BatchNorm in training runs once on the whole batch; outputs and gradients are exact."""
    model = Checkpointed()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    code = pm.code
    assert code.count("torch.utils.checkpoint.checkpoint(") == 3  # block on 2 devices, the norm once
    assert "checkpoint_dev1 = torch.utils.checkpoint.checkpoint(block_dev1" in code
    x = torch.randn(6, 4)
    out = pm(x)
    expected = Checkpointed()
    expected.load_state_dict(model.state_dict())
    ref = expected(x)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for (name, p), q in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
