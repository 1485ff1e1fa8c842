"""``F.batch_norm`` called directly (timm's BatchNormAct2d): split, with the whole batch's
statistics in training and running statistics updated once, as the module path."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import dpcompile
from dpcompile.modules.mesh_stage import batch_statistics_sites


class BatchNormAct(torch.nn.BatchNorm2d):
    """As timm's BatchNormAct2d: the module's state, ``F.batch_norm`` called in forward."""

    def forward(self, x):
        if self.training:
            self.num_batches_tracked.add_(1)
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, self.momentum, self.eps)
        return torch.relu(x)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = BatchNormAct(4)

    def forward(self, x):
        return self.bn(self.conv(x)).mean((2, 3))


def test_functional_batch_norm_training_whole_batch_statistics_exact():
    """Training on 3 devices (uneven chunks): outputs, gradients and running statistics match eager."""
    model = Net().double()
    reference = copy.deepcopy(model)
    x = torch.randn(7, 3, 6, 6, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 3)
    assert "functional_batch_norm" in pm.code
    assert dpcompile.explain(pm, x).whole == []
    out, expected = pm(x), reference(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, msg=name)


def test_functional_batch_norm_eval_runs_per_chunk():
    """In eval mode (running statistics) it is per sample: no synchronisation."""
    model = Net().eval()
    x = torch.randn(5, 3, 6, 6)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    assert "functional_batch_norm" not in pm.code
    torch.testing.assert_close(pm(x), model(x))


def test_functional_batch_norm_export_frontend_splits_with_whole_batch_statistics():
    """The export frontend records timm's BatchNormAct2d as ``aten.batch_norm`` reading the module's
    mode at run time: split, with the whole batch's statistics (it ran whole, and so did everything
    after it: 95% of timm RegNet's FLOPs); outputs, gradients and running statistics equal eager's."""
    model = Net().double()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 3, 6, 6, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), frontend="export")
    assert "functional_batch_norm" in pm.code
    assert dpcompile.explain(pm, x).whole == []
    for step in range(2):
        out, expected = pm(x + step), reference(x + step)
        torch.testing.assert_close(out, expected)
        (out * out).sum().backward()
        (expected * expected).sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, msg=name)
    # a pipeline over a mesh refuses BatchNorm with batch statistics on micro-batches: this site only in training
    assert batch_statistics_sites(pm) == ["bn_batch_norm_sync"] == batch_statistics_sites(pm, training=True)
    model.eval()
    assert batch_statistics_sites(pm) == [] == batch_statistics_sites(pm, training=False)


class _BatchNormActUncounted(torch.nn.BatchNorm2d):
    """``F.batch_norm`` in the module's mode, counting no batches (``num_batches_tracked`` stays 0)."""

    def forward(self, x):
        bn = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, self.momentum, self.eps)
        return torch.relu(bn)


def test_functional_batch_norm_export_frontend_counts_batches_only_where_forward_does():
    """Exported in training, a forward that does not count batches does not: the program added a count
    (one per call, for a forward that counts in training but was exported in eval mode) and
    ``num_batches_tracked`` (and state_dict) left eager's."""
    model = Net().double()
    model.bn = _BatchNormActUncounted(4).double()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 3, 6, 6, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), frontend="export")
    torch.testing.assert_close(pm(x), reference(x))
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(pm.state_dict()[key], value, msg=key)
    assert int(model.bn.num_batches_tracked) == 0
