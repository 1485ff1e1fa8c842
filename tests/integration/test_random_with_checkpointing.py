"""Exact random ops inside regions recomputed in backward: the region reads the draws its call
made (the per-call record stays outside every region, shared by replicas and micro-batches), so
dropout and ``randn_like`` in a checkpointed block give eager's values, gradients and generator
state, in every one-process layout and both pipeline schedules."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dpcompile


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return x + self.drop(torch.relu(self.fc(x)) + 0.1 * torch.randn_like(x))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


LAYOUTS = {
    "dp": {},
    "tp": {"tensor_parallel": True},
    "gpipe": {"pipeline": 2, "micro_batches": 3},
    "1f1b": {"pipeline": 2, "micro_batches": 3, "schedule": "1f1b"},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dropout_in_checkpointed_blocks_draws_eagers_values(layout):
    torch.manual_seed(0)
    model = Stack().double()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, activation_checkpointing=True, **LAYOUTS[layout])
    assert "dpcompile_runtime_checkpoint" in pm.code
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(6, 16, dtype=torch.float64)
        torch.manual_seed(100 + step)
        loss = pm(x)
        loss.backward()
        state = torch.get_rng_state()
        torch.manual_seed(100 + step)
        expected = eager(x)
        expected.backward()
        torch.testing.assert_close(loss.detach(), expected.detach())
        assert torch.equal(state, torch.get_rng_state()), f"step {step}: the generator ends elsewhere than eager's"
        opt.step(), eager_opt.step()
        opt.zero_grad(), eager_opt.zero_grad()
        torch.testing.assert_close(pm.state_dict(), eager.state_dict())  # every gradient, through the step
