"""Persistent replicas: made once, refreshed only where a parameter changed, gradients exact."""

import copy

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile import runtime
from dpcompile.runtime.replicate import _SETS


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam])
def test_copy_replicas_trains_like_eager(optimizer):
    """Several optimizer steps with copy_replicas=True: gradients and parameters equal eager's."""
    model = _model()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 3, copy_replicas=True)
    opt, eager_opt = optimizer(model.parameters(), lr=0.05), optimizer(eager.parameters(), lr=0.05)
    for _ in range(4):
        x = torch.randn(10, 6)
        opt.zero_grad()
        eager_opt.zero_grad()
        pm(x).square().mean().backward()
        eager(x).square().mean().backward()
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        opt.step()
        eager_opt.step()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q)


def test_replicas_persist_between_forwards():
    """The same copy tensors serve every forward while the parameters do not change."""
    lin = nn.Linear(3, 2)
    (r1,) = runtime.replicate({"lin": lin}, ["cpu"], copy=True)
    (r2,) = runtime.replicate({"lin": lin}, ["cpu"], copy=True)
    assert r1.lin.weight.data_ptr() == r2.lin.weight.data_ptr() != lin.weight.data_ptr()
    (replica_set,) = _SETS[lin].values()
    assert replica_set.refresh() == 0


def test_replica_refreshes_after_in_place_change():
    """Mutating a parameter in place (as an optimizer does) refreshes its copy, and only it."""
    lin = nn.Linear(3, 2)
    runtime.replicate({"lin": lin}, ["cpu", "cpu"], copy=True)
    with torch.no_grad():
        lin.weight.add_(1.0)
    r1, r2 = runtime.replicate({"lin": lin}, ["cpu", "cpu"], copy=True)
    torch.testing.assert_close(r1.lin.weight, lin.weight)
    torch.testing.assert_close(r2.lin.weight, lin.weight)
    (replica_set,) = _SETS[lin].values()
    with torch.no_grad():
        lin.bias.mul_(2.0)
    assert replica_set.refresh() == 2  # the bias, on each of two devices; not the weight


def test_replica_refreshes_after_data_swap_and_on_request():
    """``p.data = ...`` is seen (new storage); writes through ``p.data`` after refresh_replicas()."""
    lin = nn.Linear(3, 2)
    runtime.replicate({"lin": lin}, ["cpu"], copy=True)
    lin.weight.data = torch.ones(2, 3)
    (r,) = runtime.replicate({"lin": lin}, ["cpu"], copy=True)
    torch.testing.assert_close(r.lin.weight, lin.weight)
    lin.weight.data.fill_(3.0)  # invisible to version counters
    runtime.refresh_replicas(lin)
    (r,) = runtime.replicate({"lin": lin}, ["cpu"], copy=True)
    torch.testing.assert_close(r.lin.weight, lin.weight)


def test_replica_rebuilt_when_a_parameter_is_replaced():
    """A new Parameter object (another shape) gets new copies."""
    lin = nn.Linear(3, 2)
    runtime.replicate({"lin": lin}, ["cpu"], copy=True)
    lin.weight = nn.Parameter(torch.randn(4, 3))
    lin.bias = nn.Parameter(torch.randn(4))
    (r,) = runtime.replicate({"lin": lin}, ["cpu"], copy=True)
    assert r.lin.weight.shape == (4, 3)
    torch.testing.assert_close(r.lin.weight, lin.weight)


def test_replica_mode_follows_the_original():
    """Replica modules are made per forward: train()/eval() of the model reaches them."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    pm = dpcompile.transform(model, ["cpu"] * 2, copy_replicas=True)
    x = torch.randn(8, 4)
    pm(x)
    pm.eval()
    torch.testing.assert_close(pm(x), model(x))


def test_replica_written_by_forward_is_refreshed():
    """A copy the replica's own forward wrote into is copied afresh from the source."""
    lin = nn.Linear(3, 2)
    (r,) = runtime.replicate({"lin": lin}, ["cpu"], copy=True)
    with torch.no_grad():
        r.lin.weight.zero_()
    (r,) = runtime.replicate({"lin": lin}, ["cpu"], copy=True)
    torch.testing.assert_close(r.lin.weight, lin.weight)
