"""verify compares the buffers state_dict holds: a non-persistent buffer (rotary ``inv_freq``,
``position_ids``) is in neither state dict, so it is no "missing" buffer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpcompile


class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x):
        angles = torch.cat([self.inv_freq, self.inv_freq]) * 2
        return self.fc(x) * angles.cos() * self.scale


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["data_parallel", "tensor_parallel"])
def test_verify_skips_non_persistent_buffers_and_checks_persistent_ones(tensor_parallel):
    torch.manual_seed(0)
    model = Rotary()
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=tensor_parallel)
    result = dpcompile.verify(pm, model, torch.randn(4, 8))
    assert result.ok, result
    assert result.checked["buffers"] == 1  # scale; inv_freq is not state
