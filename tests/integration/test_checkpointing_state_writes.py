"""A region recomputed in backward runs its forward twice; what that forward writes outside the
region (BatchNorm's running statistics and counter, a buffer bumped in place) must change once per
call, as in eager, or the model's state drifts from the single-device run's every step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile.runtime import checkpoint


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return x + torch.relu(self.bn(self.fc(x)))


class Counting(Block):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(8))

    def forward(self, x):
        h = self.bn(self.fc(x))
        self.seen.add_(h.detach().abs().sum(0))  # an in-place running total
        return x + torch.relu(h)


class FunctionalNorm(nn.BatchNorm1d):
    """timm's ``BatchNormAct2d``: its own counter, then ``F.batch_norm`` given the statistics."""

    def forward(self, x):
        self.num_batches_tracked.add_(1)
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.1, self.eps)


class FunctionalBlock(Block):
    def __init__(self):
        super().__init__()
        self.bn = FunctionalNorm(8)


class Stack(nn.Module):
    def __init__(self, block=Block):
        super().__init__()
        self.layers = nn.Sequential(block(), block())
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.layers(x)).pow(2).mean()


def test_recomputing_a_batchnorm_updates_its_statistics_once():
    bn = nn.BatchNorm1d(4).double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    out = checkpoint(bn, x)
    after_forward = {k: v.clone() for k, v in bn.state_dict().items()}
    out.sum().backward()  # recomputes bn's forward
    torch.testing.assert_close(bn.state_dict(), after_forward, rtol=0, atol=0)
    assert int(bn.num_batches_tracked) == 1


@pytest.mark.parametrize("layout", [{"devices": 1}, {"devices": 2}, {"devices": 2, "pipeline": 2, "micro_batches": 2}])
def test_checkpointed_blocks_write_the_models_state_as_eager_does(layout):
    layout = dict(layout)
    torch.manual_seed(0)
    model = Stack().double()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * layout.pop("devices"), activation_checkpointing=True, **layout)
    assert "dpcompile_runtime_checkpoint" in pm.code
    for _ in range(3):
        x = torch.randn(6, 8, dtype=torch.float64)
        pm(x).backward()
        eager(x).backward()
        torch.testing.assert_close(pm.state_dict(), eager.state_dict())
        for (name, p), q in zip(pm.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_checkpointed_pipeline_given_the_statistics_by_value_updates_them_once():
    # a region reading the running statistics as inputs (as timm's BatchNormAct2d passes them) saves
    # them for its recompute: their update must not look like a write into a saved tensor
    torch.manual_seed(0)
    model = Stack(FunctionalBlock).double()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2, activation_checkpointing=True)
    x = torch.randn(6, 8, dtype=torch.float64)
    pm(x).backward()
    eager(x).backward()
    torch.testing.assert_close(pm.state_dict(), eager.state_dict())
    for (name, p), q in zip(pm.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_region_writing_into_a_tensor_it_reads_is_refused_by_name():
    with pytest.raises(dpcompile.DpCompileError, match=r"'layers\.0' writes in place into .*seen.*self\.seen\.add_"):
        dpcompile.transform(Stack(Counting), ["cpu"] * 2, activation_checkpointing=True)
    pm = dpcompile.transform(Stack(Counting), ["cpu"] * 2, activation_checkpointing=["layers.0.fc", "layers.1.fc"])
    assert "dpcompile_runtime_checkpoint" in pm.code  # the submodules that do not write are checkpointed
