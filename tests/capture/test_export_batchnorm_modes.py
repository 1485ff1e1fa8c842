"""Batch norm in a program captured with torch.export follows ``pm.train()`` / ``pm.eval()``.

A batch norm subclass with its own forward (``relu(super().forward(x))``) is not raised back to a
module call: its ``aten.batch_norm`` op stays in the graph, and export bakes in the mode it ran
in. Each program here is checked against the eager model in both modes, across a training step
(running statistics updated, then read in eval) and a switch back to training.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.errors import TraceError


class ScaledBatchNorm1d(nn.BatchNorm1d):  # defined in an importable module: its source is readable
    def forward(self, x):
        return torch.relu(super().forward(x)) * 3


class ScaledBatchNorm2d(nn.BatchNorm2d):
    def forward(self, x):
        return torch.relu(super().forward(x)) * 3


class Net(nn.Module):
    def __init__(self, momentum=0.1):
        super().__init__()
        self.fc, self.norm, self.head = nn.Linear(8, 8), ScaledBatchNorm1d(8, momentum=momentum), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.norm(self.fc(x)))


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.n1, self.fc2, self.n2, self.head = (
            nn.Linear(8, 8), ScaledBatchNorm1d(8), nn.Linear(8, 8), ScaledBatchNorm1d(8), nn.Linear(8, 2),
        )  # fmt: skip

    def forward(self, x):
        return self.head(self.n2(self.fc2(self.n1(self.fc1(x)))))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(3, 4, 3), ScaledBatchNorm2d(4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.norm(self.conv(x)).mean((2, 3)))


class InstanceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 1)
        self.norm = nn.InstanceNorm1d(4, affine=True, track_running_stats=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.norm(self.conv(x)).mean(2))


def _transform(model, x, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # batch norm in training runs whole: warned, not tested here
        return dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), **options)


def _assert_state_equal(pm, reference):
    state = pm.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, msg=name)


@pytest.mark.parametrize(
    "make, shape, options",
    [
        (Net, (8, 8), {}),
        (ConvNet, (4, 3, 6, 6), {}),
        (Net, (8, 8), {"data_parallel": "fsdp"}),
        (Deep, (8, 8), {"tensor_parallel": True}),
        (Deep, (8, 8), {"pipeline": 2}),
    ],
    ids=["dp", "dp-conv2d", "fsdp", "tensor-parallel", "pipeline"],
)
def test_batchnorm_subclass_follows_the_mode_after_a_step(make, shape, options):
    torch.manual_seed(0)
    model, x = make(), torch.randn(*shape)
    reference = copy.deepcopy(model)
    pm = _transform(model, x, **options)
    for program in (pm, reference):  # a step: the running statistics eval reads were updated by training
        out = program(x)
        out.pow(2).mean().backward()
        with torch.no_grad():
            for p in program.parameters():
                p -= 0.01 * p.grad
    _assert_state_equal(pm, reference)
    pm.eval(), reference.eval()
    torch.testing.assert_close(pm(x), reference(x))
    with torch.no_grad():
        torch.testing.assert_close(pm(x), reference(x))
    _assert_state_equal(pm, reference)  # eval counts no batch and keeps the running statistics
    pm.train(), reference.train()
    torch.testing.assert_close(pm(x), reference(x))
    _assert_state_equal(pm, reference)


def test_batchnorm_subclass_exported_in_eval_counts_batches_in_training():
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(8, 8)
    reference = copy.deepcopy(model)
    pm = _transform(model, x)
    ops = [n.target for n in pm.captured.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.batch_norm.default in ops  # the op, not a module call: what this file is about
    torch.testing.assert_close(pm(x), reference(x))
    pm.train(), reference.train()
    torch.testing.assert_close(pm(x), reference(x))
    _assert_state_equal(pm, reference)
    assert int(model.norm.num_batches_tracked) == 1


def test_batchnorm_subclass_with_cumulative_average_is_refused():
    model, x = Net(momentum=None), torch.randn(8, 8)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TraceError, match=r"'norm' \(ScaledBatchNorm1d\).*momentum=None.*float momentum"):
        _transform(model, x)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], msg=name)


@pytest.mark.filterwarnings("ignore:dpcompile.*run whole")  # it runs whole where it updates its statistics
def test_instance_norm_with_running_stats_uses_them_in_eval():
    """Its running statistics are updated once from the whole batch in training (not once per
    device's chunk), and read in eval."""
    torch.manual_seed(0)
    model, x = InstanceNet(), torch.randn(4, 3, 5)
    with torch.no_grad():
        model.norm.running_mean.normal_()
        model.norm.running_var.uniform_(0.5, 2.0)
    reference = copy.deepcopy(model)
    pm = _transform(model, x, frontend="export")
    pm.eval(), reference.eval()
    torch.testing.assert_close(pm(x), reference(x))
    pm.train(), reference.train()
    torch.testing.assert_close(pm(x), reference(x))
    _assert_state_equal(pm, reference)
    pm.eval(), reference.eval()
    torch.testing.assert_close(pm(x), reference(x))


def test_batchnorm_subclass_program_exports_as_plain_data(tmp_path):
    """The program reads the subclass's mode (``getattr(norm, "training")``), never calls it: the folder
    stays plain data, and the loaded program follows ``eval()`` too."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 8)
    reference = copy.deepcopy(model)
    pm = _transform(model, x)
    torch.testing.assert_close(pm(x), reference(x))
    dpcompile.export(pm, tmp_path / "program")
    loaded = dpcompile.load(tmp_path / "program", ["cpu"] * 2)  # no trust_code=: plain data
    loaded.eval(), reference.eval()
    torch.testing.assert_close(loaded(x), reference(x))


class CumulativeNorms(nn.Module):
    """Plain BatchNorm1d with momentum=None (a cumulative average): export reads the count with
    ``item()`` and specialises the factor on the example's count (``Eq(u0, 1)``)."""

    def __init__(self):
        super().__init__()
        self.n0, self.fc, self.n1, self.head = nn.BatchNorm1d(4, momentum=None), nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.n1(self.fc(self.n0(x))))


def test_batchnorm_with_cumulative_average_runs_every_call_and_loads_into_a_meta_model(tmp_path):
    """The module call counts its batches itself, so the assertions export put on the count are
    dropped with its count update: 3 training calls give eager's outputs and statistics (the first
    was refused as a branch not captured). A model built on meta transforms too (the examples'
    check cannot read a count there) and, filled by load_checkpoint, gives eager's eval outputs."""
    reference, layout = CumulativeNorms().double(), {"tp": 2}  # data parallel was refused alike
    x = torch.randn(6, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(copy.deepcopy(reference), ["cpu"] * 2, mesh=layout, frontend="export", example_inputs=(x,))
        for step in range(3):
            torch.testing.assert_close(pm(x * (step + 1)), reference(x * (step + 1)))
        state = pm.state_dict()
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"{key}: {m}")
        dpcompile.save_checkpoint(pm, tmp_path / "ckpt")
        with torch.device("meta"):
            meta = CumulativeNorms().double()
        loaded = dpcompile.transform(meta, ["cpu"] * 2, mesh=layout, frontend="export", example_inputs=(x,))
        dpcompile.load_checkpoint(loaded, tmp_path / "ckpt")
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x), reference.eval()(x))


class TiedCumulativeNorm(nn.Module):
    """A BatchNorm with momentum=None (export decides on the example's count, then runs the examples
    through the program) in a model whose LM head shares the embedding's weight."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(8, 4), nn.BatchNorm1d(3, momentum=None), nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)))


def test_tied_weights_with_cumulative_average_capture_with_export():
    """The examples' run passes one tensor under both tied keys. Before, functional_call raised a bare
    ValueError ("multiple values for keys ['embed.weight', 'head.weight'], which are tied")."""
    torch.manual_seed(0)
    reference, ids = TiedCumulativeNorm().double(), torch.randint(0, 8, (5, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(copy.deepcopy(reference), ["cpu"] * 2, frontend="export", example_inputs=(ids,))
    for step in range(2):
        torch.testing.assert_close(pm((ids + step) % 8), reference((ids + step) % 8))
    _assert_state_equal(pm, reference)
