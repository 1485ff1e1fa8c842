"""transform's arguments: what no frontend can capture, and examples that do not fit, are refused
up front with the way out (never a NameError from generated code, never silently ignored)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpcompile
from tests.models import MLP


class TensorDefault(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, bias=torch.ones(4)):  # noqa: B008 - the case under test
        return self.fc(x) + bias


class Varargs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, *xs):
        return sum(self.fc(x) for x in xs)


class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, **kw):
        return self.fc(x) * kw.get("scale", 1.0)


def test_transform_refuses_a_tensor_default_saying_how():
    """forward(self, x, bias=torch.ones(4)): a TraceError naming the argument and the way out."""
    with pytest.raises(dpcompile.TraceError, match=r"argument 'bias' has a tensor as its default.*default it to None"):
        dpcompile.transform(TensorDefault(), ["cpu"] * 2)


def test_transform_refuses_varargs_with_a_route_that_works():
    """forward(self, *xs): the error's route (a module naming the arguments) transforms and matches."""
    model = Varargs()
    with pytest.raises(dpcompile.TraceError, match=r"forward\(self, \*xs\).*wrap the model in a module"):
        dpcompile.transform(model, ["cpu"] * 2, example_inputs=(torch.randn(6, 4), torch.randn(6, 4)))

    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, a, b):
            return self.model(a, b)

    a, b = torch.randn(6, 4), torch.randn(6, 4)
    pm = dpcompile.transform(Named(), ["cpu"] * 2)
    torch.testing.assert_close(pm(a, b), model(a, b))


def test_transform_runs_a_forward_with_keyword_arguments():
    """forward(self, x, **kw): calls with and without keywords equal eager."""
    model, x = Keywords(), torch.randn(6, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    torch.testing.assert_close(pm(x), model(x))
    torch.testing.assert_close(pm(x, scale=2.0), model(x, scale=2.0))


@pytest.mark.parametrize("tensor_parallel", [False, True])
def test_transform_refuses_examples_that_do_not_fit(tensor_parallel):
    """example_inputs= shaped (6, 5) for a Linear(8, ...): ValueError naming the op, not ignored."""
    with pytest.raises(ValueError, match=r"example_inputs= do not fit the model: fc1"):
        dpcompile.transform(MLP(), ["cpu"] * 2, tensor_parallel=tensor_parallel, example_inputs=(torch.randn(6, 5),))
