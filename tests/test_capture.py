"""Capture: the tracer, leaf modules, recorded flatten_parameters, and TraceError."""


import pytest
import torch
import torch.fx as fx
from torch import nn

import dpcompile
from dpcompile import runtime
from dpcompile.capture import capture
from tests.helpers import check_against_eager
from tests.models import MLP, CellLoop


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: fx cannot trace this
            return self.fc(x)
        return x


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Branchy()
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.inner(x))


def test_trace_error_names_file_line_source_and_way_out():
    """An untraceable model raises TraceError with file:line, the source line and leaf_modules=."""
    with pytest.raises(dpcompile.TraceError) as info:
        dpcompile.transform(Wrapper(), ["cpu"] * 2)
    message = str(info.value)
    assert "test_capture.py:" in message
    assert "if x.sum() > 0" in message
    assert "in Branchy.forward" in message and "branches on a tensor value" in message
    assert "leaf_modules=[Branchy]" in message and "example_inputs=" in message
    assert isinstance(info.value, dpcompile.DpCompileError)


def test_leaf_modules_keep_untraceable_module_whole():
    """leaf_modules=[Branchy] makes the same model traceable; it runs once, after a gather."""
    model = Wrapper()
    reference = Wrapper()
    reference.load_state_dict(model.state_dict())
    pm = dpcompile.transform(model, ["cpu"] * 2, leaf_modules=[Branchy])
    x = torch.randn(5, 4)
    torch.testing.assert_close(pm(x), reference(x))
    assert any(n.op == "call_module" and n.target == "inner" for n in pm.graph.nodes)


def test_leaf_modules_rejects_non_module_types():
    """leaf_modules must hold module classes."""
    with pytest.raises(ValueError, match="leaf_modules"):
        dpcompile.transform(MLP(), ["cpu"] * 2, leaf_modules=[len])


def test_capture_accepts_graph_module_without_touching_it():
    """A GraphModule is copied: passes never change the user's graph."""
    gm = fx.symbolic_trace(MLP())
    before = gm.code
    pm = dpcompile.transform(gm, ["cpu"] * 2)
    assert gm.code == before
    x = torch.randn(4, 8)
    torch.testing.assert_close(pm(x), gm(x))


def test_capture_records_flatten_parameters_instead_of_running_it():
    """rnn.flatten_parameters() in forward becomes a graph node naming the module."""

    class Flattening(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(3, 4)

        def forward(self, x):
            self.rnn.flatten_parameters()
            return self.rnn(x)[0]

    gm = capture(Flattening())
    calls = [n for n in gm.graph.nodes if n.target is runtime.flatten_parameters]
    assert len(calls) == 1
    assert calls[0].args[0].op == "get_attr" and calls[0].args[0].target == "rnn"
    assert nn.RNNBase.flatten_parameters.__name__ == "flatten_parameters"  # patch undone


def test_capture_rejects_non_modules():
    """transform() of something that is not a module raises ValueError."""
    with pytest.raises(ValueError, match="torch.nn.Module"):
        dpcompile.transform(lambda x: x, ["cpu"])


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


class CausalSelfAttention(nn.Module):
    """nanoGPT's causal mask: a buffer sliced by the sequence length read from the input."""

    def __init__(self, d: int = 8, block: int = 6):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, block, block))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        att = (q @ k.transpose(-2, -1)) * C**-0.5
        att = att.masked_fill(self.bias[:, :T, :T] == 0, float("-inf"))
        return torch.softmax(att, dim=-1) @ v


def test_capture_traces_buffer_sliced_by_input_size():
    """A causal-mask buffer sliced with x.size() traces and matches eager on uneven splits."""
    check_against_eager(CausalSelfAttention, ["cpu"] * 4, torch.randn(9, 5, 8), transform_kwargs={"copy_replicas": True})


def test_capture_traces_size_factory_with_batch_size_first():
    """torch.zeros(x.size(0), 6) traces (fx alone refuses it) and the model matches eager."""
    check_against_eager(CellLoop, ["cpu"] * 3, torch.randn(7, 3, 4), transform_kwargs={"copy_replicas": True})
