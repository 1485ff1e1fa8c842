"""Composed layouts (pp x tp, dp x tp, pp x dp, pp x dp x tp, in one process) at their input edges
(issue 28): an automatic cut that no stage boundary can keep off a column → row pair, a model that
writes into its input, an optional argument export left out of the examples, and the inputs a
hostile user passes. Each trains as eager does: loss, every gradient, the parameters after SGD steps
and the caller's tensors."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.capture.inputs import InputMismatch
from tests.helpers import full_gradients

COMPOSED = [{"pp": 2, "tp": 2}, {"dp": 2, "tp": 2}, {"pp": 2, "dp": 2}, {"pp": 2, "dp": 2, "tp": 2}]


def _devices(mesh: dict[str, int]) -> list[str]:
    n = 1
    for size in mesh.values():
        n *= size
    return ["cpu"] * n


def _grads(pm: nn.Module) -> dict[str, torch.Tensor | None]:
    if getattr(pm, "param_shards", None):
        return full_gradients(pm)
    return {name: p.grad for name, p in pm.named_parameters()}


def assert_trains_as_eager(pm: nn.Module, reference: nn.Module, *calls: tuple[tuple, dict], steps: int = 2) -> None:
    """Each call (args, kwargs) ``steps`` times: the loss, every gradient and, after an SGD step on
    both, every parameter as eager's; the caller's tensors left (or written) as eager leaves them."""
    ours, theirs = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(steps):
        for args, kwargs in calls:
            mine, eager = copy.deepcopy((args, kwargs)), copy.deepcopy((args, kwargs))
            loss, want = pm(*mine[0], **mine[1]), reference(*eager[0], **eager[1])
            if loss.dim():  # a model's output: a loss of it, outside the program
                loss, want = loss.square().mean(), want.square().mean()
            torch.testing.assert_close(loss, want)
            torch.testing.assert_close(mine, eager)  # the caller's tensors: written (or not) as eager's
            loss.backward()
            want.backward()
            got = _grads(pm)
            for name, q in reference.named_parameters():
                torch.testing.assert_close(got[name], q.grad, msg=lambda m, n=name: f"grad {n}: {m}")
            ours.step()
            theirs.step()
            ours.zero_grad()
            theirs.zero_grad()
    state = pm.state_dict()
    for name, q in reference.state_dict().items():
        torch.testing.assert_close(state[name], q, msg=lambda m, n=name: f"{n} after the steps: {m}")


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x):
        return self.layers(x)


@pytest.mark.parametrize("mesh", [{"pp": 2, "tp": 2}, {"pp": 2, "dp": 2, "tp": 2}], ids=str)
def test_an_automatic_cut_through_a_pair_plans_the_pair_unpaired(mesh):
    """No cut of Linear, ReLU, Linear into 2 stages keeps the column → row pair in one stage: the layer
    past the cut stays whole (the column layer's output is gathered in its own stage), with the reason."""
    torch.manual_seed(0)
    model, x = Mlp(), torch.randn(4, 8)
    pm = dpcompile.transform(copy.deepcopy(model), _devices(mesh), mesh=mesh, example_inputs=(x,))
    assert pm.plan == {"layers.0": "column", "layers.2": "replicate"}
    assert "boundary before stage 1 falls between column 'layers.0'" in pm.plan_reasons["layers.2"]
    assert_trains_as_eager(pm, model, ((x,), {}))


class ThreeLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


def test_an_automatic_cut_between_two_column_layers_keeps_the_first_whole():
    """Linear, ReLU | Linear, ReLU, Linear: the automatic plan makes l1 and l2 column layers (l1's
    output gathered before l2) and the cut falls after l1, so l1's shards would cross it: refused
    before, now l1 stays whole, with the reason."""
    torch.manual_seed(0)
    model, x = ThreeLayers(), torch.randn(5, 8)
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 4, mesh={"pp": 2, "tp": 2}, example_inputs=(x,))
    assert pm.plan == {"l1": "replicate", "l2": "column", "l3": "row"}
    assert "falls between column 'l1' (stage 0) and column 'l2'" in pm.plan_reasons["l1"]
    assert_trains_as_eager(pm, model, ((x,), {}))


@pytest.mark.parametrize(("cut", "plan"), [("layers.1", {"layers.0": "replicate", "layers.2": "row"}),
                                           ("layers.2", {"layers.0": "column", "layers.2": "replicate"})])
def test_a_named_cut_through_an_automatic_pair_keeps_the_layer_on_its_side_sharded(cut, plan):
    """Cut right after the column layer: it stays whole and the row layer splits what it receives;
    cut right before the row layer: it stays whole and the column layer's output is gathered. Two
    micro-batches of an uneven batch."""
    torch.manual_seed(0)
    model, x = Mlp(), torch.randn(5, 8)
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 4, pipeline=[cut], tensor_parallel=True,
                             micro_batches=2, example_inputs=(x,))  # fmt: skip
    assert pm.plan == plan
    assert_trains_as_eager(pm, model, ((x,), {}))


def test_an_explicit_plan_cut_through_its_pair_is_still_refused():
    """A plan the user wrote is theirs: a boundary through its pair is refused with the way out."""
    with pytest.raises(dpcompile.DpCompileError, match="cuts through a tensor-parallel region"):
        dpcompile.transform(Mlp(), ["cpu"] * 4, mesh={"pp": 2, "tp": 2},
                            tensor_parallel={"layers.0": "column", "layers.2": "row"})  # fmt: skip


class WritesInput(nn.Module):
    """Writes into its input (``x[:, 0] = 0``, ``x.add_(1)``), as eager leaves the caller's tensor."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        if self.how == "setitem":
            x[:, 0] = 0
        else:
            x.add_(1)
        return self.down(torch.relu(self.up(x))).square().mean()


@pytest.mark.parametrize("how", ["setitem", "add_"])
@pytest.mark.parametrize("mesh", COMPOSED, ids=str)
def test_a_write_into_the_input_lands_as_eager(mesh, how):
    torch.manual_seed(0)
    model, x = WritesInput(how), torch.randn(4, 8)
    pm = dpcompile.transform(copy.deepcopy(model), _devices(mesh), mesh=mesh, example_inputs=(x.clone(),))
    assert_trains_as_eager(pm, model, ((x,), {}), steps=1)


class OptionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x, mask=None):
        h = self.up(x)
        if mask is not None:
            h = h * mask
        return self.down(torch.relu(h)).square().mean()


@pytest.mark.parametrize("given", ["left_out", "passed"])
@pytest.mark.parametrize("mesh", [{"pp": 2, "tp": 2}, {"dp": 2, "tp": 2}, {"pp": 2, "dp": 2, "tp": 2}], ids=str)
def test_an_optional_argument_export_fixed_is_checked_as_one_strategy_does(mesh, given):
    """Export fixes which arguments are tensors: a call that departs from the examples is refused
    with the way out (InputMismatch), as on one-strategy layouts, never a TypeError from inside."""
    torch.manual_seed(0)
    model, x, mask = OptionalMask(), torch.randn(4, 8), (torch.rand(4, 16) > 0.5).float()
    examples = {"mask": mask} if given == "passed" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(copy.deepcopy(model), _devices(mesh), mesh=mesh, example_inputs=(x,),
                                 example_kwargs=examples, frontend="export")  # fmt: skip
    kept, departs = ({"mask": mask}, {}) if given == "passed" else ({}, {"mask": mask})
    torch.testing.assert_close(pm(x, **kept), model(x, **kept))
    with pytest.raises(InputMismatch, match="export"):
        pm(x, **departs)


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x, y):
        return (self.down(torch.relu(self.up(x))) - y).square().mean()


@pytest.mark.parametrize("mesh", [{"dp": 2}, *COMPOSED], ids=str)
def test_one_tensor_given_as_two_examples_stays_two_arguments(mesh):
    """torch.export makes aliased example inputs one input: the example (x, x) gave a program that
    read x for y at every call, silently. Each argument is now its own input, on every layout."""
    torch.manual_seed(0)
    model, x, y = TwoInputs(), torch.randn(4, 8), torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(copy.deepcopy(model), _devices(mesh), mesh=mesh, example_kwargs={"x": x, "y": x},
                                 frontend="export")  # fmt: skip
    assert_trains_as_eager(pm, model, ((x, y), {}), ((x, x), {}), steps=1)


@pytest.mark.parametrize("mesh", COMPOSED, ids=str)
def test_one_tensor_passed_twice_that_needs_grad_gets_both_gradients(mesh):
    """pm(x, x) with x requiring grad: x's gradient sums what both arguments give it, as eager's."""
    torch.manual_seed(0)
    model, x = TwoInputs(), torch.randn(4, 8)
    pm = dpcompile.transform(copy.deepcopy(model), _devices(mesh), mesh=mesh, example_inputs=(x, x))
    mine, eager = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss, want = pm(mine, mine), model(eager, eager)
    torch.testing.assert_close(loss, want)
    loss.backward()
    want.backward()
    torch.testing.assert_close(mine.grad, eager.grad)
