"""``torch.autograd.grad`` inside forward (a gradient penalty, an energy model's ``-grad(e, x)``): the fx
frontend runs it in every layout, as eager computes it; a call under ``no_grad`` and the export frontend
are refused by name."""

import copy

import pytest
import torch
from torch import nn

import dpcompile


class Energy(nn.Module):
    """The force of an energy model: minus the gradient of the energy with respect to a copy of the input."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(self.net(x).sum(), x, create_graph=True)
        return -g


class Penalty(Energy):
    """A critic's output and its gradient penalty with respect to the input."""

    def forward(self, x):
        out = self.net(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return out, (g.norm(dim=1) - 1).pow(2).mean()


def _assert_as_eager(model, x, **options):
    """Outputs, every parameter's gradient and the input's as eager's."""
    eager = copy.deepcopy(model)
    ours = x.detach().clone().requires_grad_(True)
    theirs = x.detach().clone().requires_grad_(True)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(ours,), **options)
    got, want = pm(ours), eager(theirs)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    sum(a.sum() for a in got).backward()
    sum(b.sum() for b in want).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")
    assert (ours.grad is None) == (theirs.grad is None)
    if theirs.grad is not None:
        torch.testing.assert_close(ours.grad, theirs.grad)
    return pm


def test_gradient_with_respect_to_a_value_forward_computes_is_eager_s_under_data_parallel():
    """The gradient with respect to ``x.detach().requires_grad_()`` was taken with respect to its gathered copy,
    which no output was computed from ("appears to not have been used in the graph" at call time); it is taken
    with respect to each device's part and gathered: the force and every gradient are eager's."""
    torch.manual_seed(0)
    _assert_as_eager(Energy().double(), torch.randn(6, 4, dtype=torch.float64))


def test_gradient_penalty_through_a_checkpointed_region_is_eager_s():
    """``activation_checkpointing=["net"]``: the penalty's gradient recomputes the region, and the backward through
    it recomputes it again; the second entry of the recompute's context failed (``'_GeneratorContextManager'
    object has no attribute 'args'``)."""
    torch.manual_seed(0)
    _assert_as_eager(Penalty().double(), torch.randn(6, 4, dtype=torch.float64), activation_checkpointing=["net"])


def test_gradient_in_forward_refuses_a_call_under_no_grad_by_name():
    """``torch.enable_grad()`` inside forward ran while capture had gradients on, so the program has no switch:
    under ``no_grad`` the gradient failed inside torch ("element 0 of tensors does not require grad"). The
    call is refused naming the line; with gradients on it runs."""
    torch.manual_seed(0)
    model, x = Energy().double(), torch.randn(6, 4, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,))
    with torch.no_grad(), pytest.raises(dpcompile.DpCompileError, match=r"torch.autograd.grad \(test_gradients_in_forward.py:\d+"):
        pm(x)
    torch.testing.assert_close(pm(x), model(x))


def test_gradient_in_forward_is_refused_by_the_export_frontend_naming_the_line():
    """torch.export cannot capture the gradient (a bare "fake tensor in the exported program constant's list"
    before): refused at transform by line, pointing at the fx frontend."""
    x = torch.randn(6, 4, requires_grad=True)
    with pytest.raises(dpcompile.TraceError, match=r"test_gradients_in_forward.py:\d+.*torch.autograd.grad.*frontend='fx'"):
        dpcompile.transform(Penalty(), ["cpu"] * 2, frontend="export", example_inputs=(x,))
