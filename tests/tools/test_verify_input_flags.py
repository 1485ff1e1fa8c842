"""verify of a model whose forward sets ``requires_grad`` on a view of its input (Wav2Vec2, HuBERT
and WavLM's feature encoder, ``hidden_states = input_values[:, None]; hidden_states.requires_grad =
True``): torch allows it only where the input requires no grad, so verify runs both sides on inputs
that require none, compares outputs and parameter gradients, and says so in a note."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpcompile


class FeatureEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 3)
        self.head = nn.Linear(4, 2)

    def forward(self, x):  # (B, L): a waveform
        h = x[:, None]
        if self.training:
            h.requires_grad = True  # as transformers' Wav2Vec2FeatureEncoder does, for checkpointing
        return self.head(self.conv(h).mean(-1))


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_verify_runs_a_forward_that_flags_its_input_and_compares_parameter_gradients(frontend):
    torch.manual_seed(0)
    model = FeatureEncoder().train()
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend=frontend, example_inputs=(torch.randn(4, 16),))
    result = dpcompile.verify(pm, model, torch.randn(5, 16))
    assert result.ok, result
    assert result.checked["parameter gradients"] == 4 and result.checked["input gradients"] == 0
    assert any("requires_grad on a view of an input" in note for note in result.notes)
    assert all(p.grad is None for p in model.parameters())  # verify leaves no gradient behind


def test_verify_still_compares_input_gradients_where_forward_leaves_the_flags_alone():
    torch.manual_seed(0)
    model = FeatureEncoder().eval()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    result = dpcompile.verify(pm, model, torch.randn(5, 16))
    assert result.ok, result
    assert result.checked["input gradients"] == 1 and not result.notes
