"""What a data-parallel program was specialised on is checked at call time, as torch.compile's
guards are: hooks, the model's submodules and parameters, the attributes forward reads. A call
after any of them changed runs a program traced for the model as it is now."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpcompile


class Residual(nn.Module):
    """A container forward enters (``block``), a leaf (``fc2``), a root parameter, a flag attribute."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.fc2 = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.ones(8))
        self.use_residual = True
        self.epoch = 0  # an attribute forward never reads

    def forward(self, x):
        h = self.block(x)
        if self.use_residual:
            h = h + x
        return self.fc2(h) * self.gain


def _pair() -> tuple[Residual, dpcompile.ParallelModule, torch.Tensor]:
    torch.manual_seed(0)
    model = Residual()
    return model, dpcompile.transform(model, ["cpu"] * 2), torch.randn(6, 8)


def _same(pm: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    torch.testing.assert_close(pm(x), model(x), atol=1e-6, rtol=1e-6)


def test_guard_container_hook_registered_after_transform_applies():
    """A forward hook on a submodule forward enters, added after transform, changes pm's output as the model's."""
    model, pm, x = _pair()
    handle = model.block.register_forward_hook(lambda module, args, out: out * 3)
    _same(pm, model, x)
    handle.remove()
    _same(pm, model, x)


def test_guard_container_hook_removed_after_transform_stops_applying():
    """A hook registered before transform and removed after no longer applies (it was traced in)."""
    torch.manual_seed(0)
    model = Residual()
    handle = model.block.register_forward_pre_hook(lambda module, args: (args[0] * 0,))
    pm = dpcompile.transform(model, ["cpu"] * 2)
    x = torch.randn(6, 8)
    _same(pm, model, x)
    handle.remove()
    _same(pm, model, x)


def test_guard_root_hooks_run_around_the_program():
    """Forward hooks and pre-hooks on the model itself run as model(x) runs them, before or after transform."""
    torch.manual_seed(0)
    model = Residual()
    before = model.register_forward_hook(lambda module, args, out: out + 1)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    x = torch.randn(6, 8)
    _same(pm, model, x)
    after = model.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    _same(pm, model, x)
    before.remove(), after.remove()
    _same(pm, model, x)


def test_guard_swapped_submodule_is_used_and_saved():
    """model.fc2 = nn.Linear(...) after transform: pm runs and saves the new layer."""
    model, pm, x = _pair()
    model.fc2 = nn.Linear(8, 8)
    _same(pm, model, x)
    assert torch.equal(pm.state_dict()["fc2.weight"], model.fc2.weight)
    assert any(p is model.fc2.weight for p in pm.parameters())


def test_guard_reassigned_root_parameter_is_used():
    """model.gain = nn.Parameter(...) after transform: pm multiplies by the new one."""
    model, pm, x = _pair()
    model.gain = nn.Parameter(torch.full((8,), 0.5))
    _same(pm, model, x)


def test_guard_attribute_forward_reads_is_followed():
    """model.use_residual = False after transform: pm takes the branch without the residual."""
    model, pm, x = _pair()
    model.use_residual = False
    _same(pm, model, x)
    model.use_residual = True
    _same(pm, model, x)


def test_guard_attribute_forward_never_reads_traces_nothing():
    """An attribute the model's code never mentions (a training loop's epoch) costs no program."""
    model, pm, x = _pair()
    for epoch in range(3):
        model.epoch = epoch
        assert pm.program_for_call(x) is pm
    assert len(pm.program_cache) == 0


@pytest.mark.parametrize("copy_replicas", [False, True])
def test_guard_leaf_module_hooks_run_per_replica_on_a_chunk(copy_replicas):
    """Hooks on leaf nn layers and RNNs run once per replica on its chunk of the batch, registered
    before or after transform; a leaf_modules= class runs (and hooks) once on the whole batch
    (docs/data_parallel.md, Hooks)."""

    class Leaf(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) * 2

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.rnn = nn.GRU(4, 4, batch_first=True)
            self.leaf = Leaf()

        def forward(self, x):
            h, _ = self.rnn(self.fc(x))
            return self.leaf(h)

    model = Model()
    seen: dict[str, list[int]] = {"fc": [], "rnn": [], "leaf": [], "fc_pre": []}
    model.fc.register_forward_hook(lambda m, args, out: seen["fc"].append(out.shape[0]))
    model.rnn.register_forward_hook(lambda m, args, out: seen["rnn"].append(out[0].shape[0]))
    pm = dpcompile.transform(model, ["cpu", "cpu"], leaf_modules=[Leaf], copy_replicas=copy_replicas)
    model.leaf.register_forward_hook(lambda m, args, out: seen["leaf"].append(out.shape[0]))  # after transform
    model.fc.register_forward_pre_hook(lambda m, args: seen["fc_pre"].append(args[0].shape[0]))
    x = torch.randn(6, 5, 4)
    torch.testing.assert_close(pm(x), model.leaf(model.rnn(model.fc(x))[0]))
    # the eager check above added one whole-batch call to each hook: the program's are the chunks before it
    assert seen == {"fc": [3, 3, 6], "rnn": [3, 3, 6], "leaf": [6, 6], "fc_pre": [3, 3, 6]}, seen
