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


class ReadsItsEma(nn.Module):
    """An EMA of the batch's mean, read after the write: every sample sees the whole batch's update."""

    def __init__(self, width=4):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, 3)
        self.register_buffer("avg", torch.zeros(width))

    def forward(self, x, y):
        h = self.fc1(x)
        self.avg.mul_(0.9).add_(h.detach().mean(0) * 0.1)
        return F.cross_entropy(self.fc2(h - self.avg), y)


def test_a_read_of_state_written_from_the_whole_batch_waits_for_the_write():
    """GPipe ran micro-batch 0's ``h - self.avg`` before the write of the whole batch's mean (no data
    edge orders them): a silently different loss. 1F1B cannot wait, so it refuses by name."""
    model = ReadsItsEma()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    for _ in range(2):
        got, want = pm(x, y), eager(x, y)
        torch.testing.assert_close(got, want)
        got.backward()
        want.backward()
    torch.testing.assert_close(model.avg, eager.avg)
    torch.testing.assert_close(model.fc1.weight.grad, eager.fc1.weight.grad)
    one_f_one_b = dpcompile.transform(copy.deepcopy(eager), ["cpu"] * 2, pipeline=2, micro_batches=2, schedule="1f1b")
    with pytest.raises(dpcompile.DpCompileError, match="writes the model's state in place from the whole batch"):
        one_f_one_b(x, y)


def test_dp_copies_read_state_written_from_the_whole_batch_after_the_write():
    """``mesh={"dp": 2, "tp": 2}`` in one process orders its dp copies as micro-batches are: copy 0
    read ``self.avg`` before the write of the whole batch's mean."""
    model = ReadsItsEma(width=16)
    eager = copy.deepcopy(model)
    x, y = torch.randn(6, 16), torch.randint(0, 3, (6,))
    pm = dpcompile.transform(model, ["cpu"] * 4, mesh={"dp": 2, "tp": 2}, example_inputs=(x, y))
    torch.testing.assert_close(pm(x, y), eager(x, y))
    torch.testing.assert_close(pm.state_dict()["avg"], eager.avg)


class Stepped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("count", torch.tensor(0))

    def forward(self, x):
        self.count += 1
        return self.fc2(self.fc1(x))


def test_pipeline_built_on_meta_writes_the_counter_it_reads(tmp_path):
    """A pipeline over a model built on meta runs a fake copy's modules given real tensors: the
    counter forward rebinds on the model itself lands on the tensor the program reads and saves (it
    landed on the fake copy's: state_dict and the next call read the loaded value)."""
    eager = Stepped()
    dpcompile.save_checkpoint(dpcompile.transform(copy.deepcopy(eager), ["cpu"] * 2), tmp_path / "ckpt")
    with torch.device("meta"):
        model = Stepped()
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, example_inputs=(torch.randn(4, 4),))
    dpcompile.load_checkpoint(pm, tmp_path / "ckpt")
    x = torch.randn(4, 4)
    for _ in range(2):
        torch.testing.assert_close(pm(x), eager(x))
    assert pm.state_dict()["count"].item() == eager.count.item() == 2
