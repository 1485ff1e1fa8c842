"""Capture: the tracer, leaf modules, recorded flatten_parameters, and TraceError."""

import pytest
import torch
import torch.fx as fx
from torch import nn

import dpcompile
from dpcompile import runtime
from dpcompile.capture import capture
from tests.models import MLP


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
