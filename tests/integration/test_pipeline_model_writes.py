"""What forward writes to the model itself (a step counter buffer, a rebound buffer, plain
attributes) lands once per call under both pipeline schedules, as in eager. A 1F1B training call
runs its own executor; it dropped these writes (the counter stayed 0)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("count", torch.tensor(0))
        self.register_buffer("last", torch.zeros(4))
        self.calls = 0

    def forward(self, x, y):
        self.count += 1
        self.calls = self.calls + 1
        self.last = self.fc1.weight.detach().sum(0)
        self.fc2.seen = True
        return F.mse_loss(self.fc2(self.fc1(x)), y)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_training_calls_write_to_the_model_as_eager(schedule):
    model = Counting()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, schedule=schedule)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    for _ in range(2):
        pm(x, y).backward()
        eager(x, y).backward()
    assert pm.state_dict()["count"].item() == eager.count.item() == 2
    torch.testing.assert_close(pm.state_dict()["last"], eager.last)
    assert model.calls == eager.calls == 2 and model.fc2.seen is True
