"""Review findings on ParallelModule: modes, small batches, checkpoints and round trips."""

from __future__ import annotations

import io

import torch
from torch import nn

import dpcompile


def _dropout_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))


def test_parallel_module_small_batch_keeps_the_models_eval_mode():
    """model.eval() holds for a batch smaller than the device count (no silent switch back to training)."""
    model = _dropout_model()
    pm = dpcompile.transform(model, ["cpu"] * 3)
    model.eval()
    x = torch.randn(2, 8)
    torch.testing.assert_close(pm(x), model(x))
    assert not model[1].training


def test_parallel_module_torch_save_keeps_mixed_modes():
    """A module frozen in eval inside a training model stays in eval after torch.save/torch.load."""
    model = _dropout_model()
    model[1].eval()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.training and not loaded.get_submodule("1").training
    x = torch.randn(4, 8)
    torch.testing.assert_close(loaded(x), model(x))


class ConstantInForward(nn.Module):
    """A tensor made in forward: the tracer keeps it as ``_tensor_constant0`` on the program."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * torch.tensor([1.0, 2.0, 3.0, 4.0])


def test_parallel_module_state_dict_leaves_out_traced_constants():
    """pm.state_dict() has exactly the model's keys, and the model's state dict loads into pm."""
    model = ConstantInForward()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    assert list(pm.state_dict()) == list(model.state_dict())
    pm.load_state_dict(model.state_dict())


class ScaledByBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("log_scale", torch.zeros(4))

    def forward(self, x):
        return self.fc(x) * self.log_scale.exp()


def test_capture_computes_from_buffers_at_run_time():
    """What forward computes from a buffer follows the buffer after load_state_dict (no frozen constant)."""
    model = ScaledByBuffer()
    pm = dpcompile.transform(model, ["cpu"] * 2, copy_replicas=True)
    state = model.state_dict()
    state["log_scale"] = torch.ones(4)
    pm.load_state_dict(state)
    x = torch.randn(3, 4)
    torch.testing.assert_close(pm(x), model(x))


class FunctionalDropout(nn.Module):
    """Reads ``self.training`` in forward: fx would bake the mode of the trace into the code."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.dropout(self.fc(x), 0.5, self.training)


def test_parallel_module_eval_follows_self_training_read_in_forward():
    """pm.eval() (and model.eval()) turn off F.dropout(training=self.training); pm.train() turns it on."""
    model = FunctionalDropout()
    pm = dpcompile.transform(model, ["cpu"] * 3)
    x = torch.randn(7, 8)
    pm.eval()
    assert not model.training
    torch.testing.assert_close(pm(x), model(x))
    torch.testing.assert_close(pm(x[:2]), model(x[:2]))
    pm.train()
    assert (pm(x) == 0).any()
    model.eval()
    torch.testing.assert_close(pm(x), model(x))


def test_parallel_module_torch_save_keeps_following_the_mode():
    """After torch.save/torch.load, eval() still reaches a self.training read in forward."""
    model = FunctionalDropout()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    loaded.eval()
    x = torch.randn(4, 8)
    torch.testing.assert_close(loaded(x), model.eval()(x))


def test_parallel_module_deepcopy_is_an_independent_working_copy():
    """copy.deepcopy(pm) (an EMA, a snapshot) runs, matches, and shares no tensors with pm."""
    import copy

    pm = dpcompile.transform(_dropout_model().eval(), ["cpu"] * 3)
    twin = copy.deepcopy(pm)
    x = torch.randn(5, 8)
    torch.testing.assert_close(twin(x), pm(x))
    torch.testing.assert_close(twin(x[:2]), pm(x[:2]))
    assert all(a is not b for a, b in zip(twin.parameters(), pm.parameters()))


class CountsCalls(nn.Module):
    """Rebinds a buffer in forward and caches a value on itself, as some models do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        self.last = self.fc(x)
        return self.last * self.count


def test_capture_leaves_the_model_intact_and_keeps_buffer_updates():
    """Tracing stores no traced value in the model, and `self.count += 1` counts each call, as eager."""
    import copy

    model = CountsCalls()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, copy_replicas=True)
    assert isinstance(model.count, torch.Tensor) and "last" not in model.__dict__
    x = torch.randn(3, 4)
    for _ in range(2):
        torch.testing.assert_close(pm(x), reference(x))
    assert model.count.item() == reference.count.item() == 2
