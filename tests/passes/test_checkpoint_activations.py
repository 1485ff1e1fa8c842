"""``checkpoint_activations``: the finder (regions, their inputs and outputs) and the rewriter."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from torch import nn

from dpcompile.errors import DpCompileError
from dpcompile.infra import run_passes
from passes import checkpoint_activations, find_checkpoint_regions


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def _traced() -> tuple[nn.Module, fx.GraphModule]:
    model = Net().double()
    return model, fx.symbolic_trace(copy.deepcopy(model))


def test_find_checkpoint_regions_one_block():
    """A block is one region: its nodes, the value it reads and the one read after it."""
    _, gm = _traced()
    (region,) = find_checkpoint_regions(gm, ["layers.1"])
    assert region.path == "layers.1" and region.name == "layers_1"
    assert [n.name for n in region.nodes] == ["layers_1_fc1", "tanh_1", "layers_1_fc2", "add_1"]
    assert [n.name for n in region.inputs] == ["add"] and [n.name for n in region.outputs] == ["add_1"]


def test_find_checkpoint_regions_inner_path_is_part_of_outer():
    """A path inside another given one adds no region of its own."""
    _, gm = _traced()
    assert [r.path for r in find_checkpoint_regions(gm, ["layers.0.fc2", "layers.0"])] == ["layers.0"]


def test_find_checkpoint_regions_module_never_run_is_refused():
    """A module forward does not call is an error that says so."""
    _, gm = _traced()
    with pytest.raises(DpCompileError, match="no operation of the program runs in it"):
        find_checkpoint_regions(gm, ["layers.7"])


def test_checkpoint_activations_rewrites_into_checkpoint_calls():
    """Each block becomes one readable checkpoint call; values and gradients are unchanged."""
    model, gm = _traced()
    gm, _ = run_passes(gm, [lambda g: checkpoint_activations(g, paths=["layers.0", "layers.1", "layers.2"])])
    # Linear and relu write nothing outside the region: its recompute runs without the undo (passes.checkpoint_writes)
    assert "layers_1 = dpcompile_runtime_checkpoint(layers_1_region, layers_0, layers_1_module, undo_writes = False)" in gm.code
    assert "layers_1_fc1 = layers_1_module.fc1(layers_0)" in gm.layers_1_region.code
    assert not list(gm.layers_1_region.parameters())  # weights are arguments, not the region's own
    x = torch.randn(5, 4, dtype=torch.float64)
    gm(x).backward()
    model(x).backward()
    for (name, p), q in zip(gm.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_checkpoint_activations_twice_changes_nothing_more():
    """Running the pass again over the same paths is a no-op; no paths: a no-op too."""
    _, gm = _traced()
    first = checkpoint_activations(gm, paths=["layers.0"])
    gm.recompile()
    code = gm.code
    again = checkpoint_activations(gm, paths=["layers.0"])
    assert first.modified and not again.modified and gm.code == code
    assert not checkpoint_activations(gm, paths=[]).modified


class Twice(nn.Module):
    """``shared`` called before and after ``a`` and ``b``."""

    def __init__(self):
        super().__init__()
        self.shared, self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.shared(self.b(torch.relu(self.a(self.shared(x))))).sum()


def test_find_checkpoint_regions_a_module_called_twice_is_a_region_per_call():
    """Each call of a module used twice is its own region (as eager checkpoints each call); none takes
    in the modules called between them, which are regions of their own (they overlapped: a KeyError)."""
    gm = fx.symbolic_trace(Twice())
    regions = find_checkpoint_regions(gm, ["shared", "a", "b"])
    assert [[n.name for n in r.nodes] for r in regions] == [["shared"], ["shared_1"], ["a"], ["b"]]
    assert [r.name for r in regions] == ["shared", "shared_1", "a", "b"]
