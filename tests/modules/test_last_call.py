"""A call like the last one skips building its key (modules/last_call.py), and a virtual device's
replica root is kept between calls (runtime/replicate.py): every guard still fires, after the
shortcut is armed by a first call, and the outputs stay the model's."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile import runtime
from dpcompile.errors import DpCompileError


class Stack(nn.Module):
    """A list forward enters, a flag and a list attribute it reads, dropout (modes matter)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.drop = nn.Dropout(0.5)
        self.use_residual = True
        self.scales = [1.0, 2.0]

    def forward(self, x):
        h = x
        for layer in self.layers:
            h = torch.relu(layer(h))
        if self.use_residual:
            h = h + x
        return self.drop(h) * self.scales[1]


def _armed() -> tuple[Stack, dpcompile.ParallelModule, torch.Tensor]:
    """A model in eval mode, its program, and an input; one call made, so the shortcut is armed."""
    torch.manual_seed(0)
    model = Stack().eval()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    x = torch.randn(6, 8)
    torch.testing.assert_close(pm(x), model(x))
    assert pm.program_cache.last is not None
    return model, pm, x


def _same(pm: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    torch.testing.assert_close(pm(x), model(x), atol=1e-6, rtol=1e-6)


def test_last_call_serves_only_a_call_with_the_same_key():
    """The shortcut answers a call of the same rank, device count and arguments, and no other."""
    _, pm, x = _armed()
    last = pm.program_cache.last
    assert last.serves((torch.randn(9, 8),), {})  # another batch, still both devices
    assert not last.serves((x[:1],), {})  # one sample: one device
    assert not last.serves((x.unsqueeze(0),), {})  # another rank
    assert not last.serves((), {"x": x})  # a keyword argument
    assert not last.serves((x, None), {})  # another argument count


_CHANGES = {
    "eval_to_train": lambda m: m.train(),
    "flag_attribute": lambda m: setattr(m, "use_residual", False),
    "list_attribute_in_place": lambda m: m.scales.__setitem__(1, 5.0),
    "submodule_in_a_list_replaced": lambda m: m.layers.__setitem__(1, nn.Linear(8, 8)),
    "submodule_appended_to_a_list": lambda m: m.layers.append(nn.Linear(8, 8)),
    "hook_on_the_list": lambda m: m.layers.register_forward_hook(lambda mod, args, out: out),
    "hook_on_a_leaf": lambda m: m.layers[0].register_forward_hook(lambda mod, args, out: out * 2),
    "root_hook": lambda m: m.register_forward_hook(lambda mod, args, out: out + 1),
    "parameter_rebound": lambda m: setattr(m.layers[2], "weight", nn.Parameter(torch.ones(8, 8))),
}


@pytest.mark.parametrize("change", sorted(_CHANGES))
def test_last_call_change_after_the_first_call_is_followed(change):
    """A change to the model after the shortcut was armed runs the program for the changed model."""
    model, pm, x = _armed()
    _CHANGES[change](model)
    if change == "eval_to_train":  # dropout draws: compare under one seed
        torch.manual_seed(1)
        out = pm(x)
        torch.manual_seed(1)
        torch.testing.assert_close(out, model(x))
        return
    _same(pm, model, x)
    _same(pm, model, x)  # and again, through the shortcut armed for the changed model


def test_last_call_smaller_batch_then_full_batch():
    """A batch of one runs on one device, and the next full batch on both, each equal to eager."""
    model, pm, x = _armed()
    _same(pm, model, x[:1])
    _same(pm, model, x)


def test_last_call_backward_hook_added_later_is_refused():
    """A backward hook on a module forward enters, added after the first call, is still refused."""
    model, pm, x = _armed()
    model.layers.register_full_backward_hook(lambda *a: None)
    with pytest.raises(DpCompileError, match="backward hooks"):
        pm(x)


def test_last_call_hook_on_the_program_runs():
    """A hook registered on pm itself after the first call runs."""
    model, pm, x = _armed()
    pm.register_forward_hook(lambda mod, args, out: out * 0)
    assert torch.count_nonzero(pm(x)) == 0


def test_kept_root_holds_no_model_alive():
    """The kept replica root of virtual devices lets the model be freed."""
    model, pm, x = _armed()
    pm(x)
    ref = weakref.ref(model)
    del model, pm
    gc.collect()
    assert ref() is None


def test_kept_root_is_reused_and_reads_dotted_names():
    """The same root serves calls while the modules stay; a dotted name reads through its views."""
    seq = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    first = runtime.replicate({"enc": seq}, ["cpu", "cpu"], include_source=True)
    again = runtime.replicate({"enc": seq}, ["cpu", "cpu"], include_source=True)
    assert first[0] is again[0] is again[1]
    assert getattr(first[0], "enc.1.0") is seq[1][0]
    seq[1][0] = nn.Linear(2, 2)  # a module replaced under it: a new root
    changed = runtime.replicate({"enc": seq}, ["cpu", "cpu"], include_source=True)
    assert getattr(changed[0], "enc.1.0") is seq[1][0]


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(0.5)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def test_last_call_tensor_parallel_follows_the_mode():
    """Tensor parallel (nothing split): the shortcut is armed, and pm.eval() after it runs the eval program."""
    torch.manual_seed(0)
    model = DropoutMLP()
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True)
    x = torch.randn(4, 8)
    pm(x)
    assert pm.program_cache.last is not None
    pm.eval()
    model.eval()
    torch.testing.assert_close(pm(x), model(x), atol=1e-5, rtol=1e-5)
    pm.train()
    assert not torch.equal(pm(x), pm(x))  # dropout draws again in training
