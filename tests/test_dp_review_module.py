"""Review findings on ParallelModule: modes, small batches, checkpoints and round trips."""

from __future__ import annotations

import io

import torch
from torch import nn

import dpcompile


def _dropout_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))


def test_parallel_module_small_batch_keeps_the_models_eval_mode():
    """model.eval() holds for a batch smaller than the device count (no silent switch back to training)."""
    model = _dropout_model()
    pm = dpcompile.transform(model, ["cpu"] * 3)
    model.eval()
    x = torch.randn(2, 8)
    torch.testing.assert_close(pm(x), model(x))
    assert not model[1].training


def test_parallel_module_torch_save_keeps_mixed_modes():
    """A module frozen in eval inside a training model stays in eval after torch.save/torch.load."""
    model = _dropout_model()
    model[1].eval()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.training and not loaded.get_submodule("1").training
    x = torch.randn(4, 8)
    torch.testing.assert_close(loaded(x), model(x))
