"""A model's names never collide with the module's own: a submodule, parameter or buffer
named ``devices``, ``mode``, ``graph``, ``meta`` ... works in data and tensor parallel."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.fx_utils import RESERVED_NAMES, alias_of, unalias

NAMES = [
    "devices", "mode", "plan", "records", "output_device", "input_dims", "graph", "meta",
    "recipe", "captured", "program_cache", "traced_model", "code", "batch_size", "tp_group",
]  # fmt: skip
MODES = [pytest.param(False, id="data_parallel"), pytest.param(True, id="tensor_parallel")]


class Named(nn.Module):
    """``self.<name>``: a Linear; ``self.<name>_scale``-like parameter and buffer under the other names."""

    def __init__(self, name: str, param: str = "mode", buffer: str = "records"):
        super().__init__()
        self.name, self.param, self.buffer = name, param, buffer
        setattr(self, name, nn.Linear(4, 8))
        self.head = nn.Linear(8, 3)
        if param != name:
            setattr(self, param, nn.Parameter(torch.linspace(0.5, 1.5, 8)))
        if buffer not in (name, param):
            self.register_buffer(buffer, torch.full((3,), 0.25))

    def forward(self, x):
        h = torch.relu(getattr(self, self.name)(x))
        if self.param != self.name:
            h = h * getattr(self, self.param)
        y = self.head(h)
        if self.buffer not in (self.name, self.param):
            y = y + getattr(self, self.buffer)
        return y


@pytest.mark.parametrize("tensor_parallel", MODES)
@pytest.mark.parametrize("name", NAMES)
def test_names_submodule_named_like_an_attribute_of_the_module(name, tensor_parallel):
    """A submodule (and a parameter, a buffer) named like pm's own attributes runs, keeps the model's keys."""
    torch.manual_seed(0)
    model = Named(name, param="plan" if name != "plan" else "mode", buffer="meta" if name != "meta" else "graph")
    pm = dpcompile.transform(model, ["cpu", "cpu"], tensor_parallel=tensor_parallel)
    x = torch.randn(6, 4)
    torch.testing.assert_close(pm(x), model(x))
    assert list(pm.state_dict()) == list(model.state_dict())
    assert isinstance(pm.devices, dpcompile.devices.Devices) and pm.mode in ("data_parallel", "tensor_parallel")
    assert isinstance(pm.graph, torch.fx.Graph) and isinstance(pm.plan, dict) and isinstance(pm.code, str)
    torch.testing.assert_close(pm(x[:1]), model(x[:1]))  # the one-device program


@pytest.mark.parametrize("tensor_parallel", MODES)
def test_names_survive_eval_training_pickle_and_load_state_dict(tensor_parallel):
    """Collided names through eval, a backward, torch.save/load and load_state_dict."""
    torch.manual_seed(0)
    model = Named("devices", param="mode", buffer="graph")
    pm = dpcompile.transform(model, ["cpu", "cpu"], tensor_parallel=tensor_parallel)
    x = torch.randn(6, 4)
    pm(x).sum().backward()
    grads = [p.grad for p in pm.parameters()]
    assert grads and all(g is not None for g in grads)
    pm.eval()
    model.eval()
    torch.testing.assert_close(pm(x), model(x))
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(x), model(x))
    assert list(loaded.state_dict()) == list(model.state_dict())
    state = {k: v + 1 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    pm.load_state_dict(state)
    model.load_state_dict(state)
    torch.testing.assert_close(pm(x), model(x))


def test_names_swapped_submodule_of_a_reserved_name_is_followed():
    """Replacing the model's ``devices`` after transform runs the new one (data parallel shares it)."""
    model = Named("devices")
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    x = torch.randn(6, 4)
    model.devices = nn.Linear(4, 8)
    torch.testing.assert_close(pm(x), model(x))
    assert pm.get_submodule("devices") is model.devices


def test_names_plan_by_the_models_path():
    """An explicit tensor-parallel plan names the model's ``devices``; pm.plan reports it so."""
    model = Named("devices", param="mode")
    pm = dpcompile.transform(model, ["cpu", "cpu"], tensor_parallel={"devices": "column", "head": "row"})
    assert pm.plan == {"devices": "column", "head": "row"}
    x = torch.randn(5, 4)
    torch.testing.assert_close(pm(x), model(x))
    assert "devices.weight" in pm.param_shards


def test_names_generated_code_reads_the_alias():
    """Generated code reads the model's ``devices`` as ``getattr(self, "user:devices")``."""
    pm = dpcompile.transform(Named("devices"), ["cpu", "cpu"])
    assert 'getattr(self, "user:devices")' in pm.code
    assert "devices" in RESERVED_NAMES and "fc1" not in RESERVED_NAMES
    assert alias_of("devices.weight") == "user:devices.weight" and unalias("user:devices.weight") == "devices.weight"


@pytest.mark.parametrize("tensor_parallel", MODES)
def test_names_export_and_load_as_data(tensor_parallel, tmp_path):
    """A program reading the model's ``devices`` and ``mode`` exports as data and loads equal."""
    torch.manual_seed(0)
    model = Named("devices", param="mode", buffer="graph")
    pm = dpcompile.transform(model, ["cpu", "cpu"], tensor_parallel=tensor_parallel)
    pm.eval()
    dpcompile.export(pm, tmp_path / "out")
    assert not (tmp_path / "out" / "program.pkl").exists()
    loaded = dpcompile.load(tmp_path / "out")
    x = torch.randn(6, 4)
    torch.testing.assert_close(loaded(x), pm(x))
    assert sorted(loaded.state_dict()) == sorted(model.state_dict())


class PlainTensorAttributes(nn.Module):
    """Tensors held as plain attributes (not registered buffers) under reserved names."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.mode = torch.full((4,), 2.0)
        self.graph = torch.full((4,), 0.5)

    def forward(self, x):
        return self.fc(x) * self.mode + self.graph


@pytest.mark.parametrize("tensor_parallel", MODES)
def test_names_plain_tensor_attribute_named_like_an_attribute_of_the_module(tensor_parallel):
    """``self.mode = torch.ones(4)`` (a plain tensor, no buffer): read as the model's, not refused
    with "holds no submodule, parameter or buffer 'mode'"; pm.mode stays pm's."""
    model = PlainTensorAttributes()
    pm = dpcompile.transform(model, ["cpu", "cpu"], tensor_parallel=tensor_parallel)
    x = torch.randn(6, 4)
    torch.testing.assert_close(pm(x), model(x))
    assert pm.mode in ("data_parallel", "tensor_parallel") and isinstance(pm.graph, torch.fx.Graph)
