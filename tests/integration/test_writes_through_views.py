"""In-place writes through views of split values, and into inputs, under data parallelism (both frontends).

Each write must land in every device's slice as eager writes it (the program makes it functional:
``written(h, [view steps], op)``), views read after the write read the written value, and an input
written by forward is written back into the caller's tensor. A write that would land on a gathered
copy is refused by name, never silently lost.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dpcompile
from tests.helpers import assert_weighted_gradients_equal

B = 6  # two devices: chunks of 3; torch.diagonal(h) of a (6, 8) h crosses both


class WriteThroughView(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.form = form

    def forward(self, x):
        h = self.fc(x)
        b = h.shape[0]
        if self.form == "column":
            h[:, 0].mul_(2)
        elif self.form == "view_select":
            h.view(b, 2, 4)[:, 0].zero_()
        elif self.form == "diagonal":
            torch.diagonal(h).zero_()
        elif self.form == "strided":
            h.view(-1)[::5].zero_()
        elif self.form == "diagonal_read_after":  # the view itself read after the write
            d = torch.diagonal(h)
            d.mul_(3)
            return h + d.sum()
        elif self.form == "view_read_after":
            v = h.view(b, 2, 4)
            v[:, 0].zero_()
            return v.flatten(1) * 2
        return h * 1.5


FORMS = ["column", "view_select", "diagonal", "strided", "diagonal_read_after", "view_read_after"]
SPLIT_FORMS = {"column", "view_select", "view_read_after"}  # the others cross samples: run on the gathered batch


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("form", FORMS)
def test_write_through_a_view_lands_in_every_slice(form, frontend):
    torch.manual_seed(0)
    model = WriteThroughView(form)
    eager = copy.deepcopy(model)
    x = torch.randn(B, 8)
    pm = dpcompile.transform(model, ["cpu", "cpu"], example_inputs=(x,), frontend=frontend)
    out, expected = pm(x), eager(x)
    torch.testing.assert_close(out, expected)
    assert_weighted_gradients_equal(model, eager, out, expected)
    if form in SPLIT_FORMS:  # each device writes its own slice: nothing is gathered for the write
        assert dpcompile.explain(pm, x).whole == []


class WritesInput(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.form = form

    def forward(self, x):
        if self.form == "mul_":
            x.mul_(2)
        elif self.form == "setitem":
            x[:, 0] = 0
        elif self.form == "column_mul_":
            x[:, 0].mul_(3)
        elif self.form == "view_read_after":
            v = x.view(x.shape[0], 2, 4)
            v[:, 1].add_(1)
            return self.fc(x) + v.flatten(1)
        return self.fc(x) + x


@pytest.mark.parametrize("copy_replicas", [False, True])
@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("form", ["mul_", "setitem", "column_mul_", "view_read_after"])
def test_input_written_in_place_is_written_back(form, frontend, copy_replicas):
    """The caller's tensor holds what eager leaves in it; ``copy_replicas`` runs the code path of
    distinct GPUs, where a device's slice is a copy (writing it would not reach the caller)."""
    torch.manual_seed(0)
    model = WritesInput(form)
    eager = copy.deepcopy(model)
    x = torch.randn(B, 8)
    pm = dpcompile.transform(model, ["cpu", "cpu"], example_inputs=(x.clone(),), frontend=frontend, copy_replicas=copy_replicas)
    x_pm, x_eager = x.clone(), x.clone()
    out, expected = pm(x_pm), eager(x_eager)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x_pm, x_eager)
    assert_weighted_gradients_equal(model, eager, out, expected)


class LostWrite(nn.Module):
    """``v[::5]`` of ``h.view(-1)`` without examples: fx cannot tell a strided slice from a list
    index, so the write stays in place, on the gathered copy the slice runs on."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        v = h.view(-1)
        v[::5].zero_()
        return v.sum() + h


def test_write_that_would_land_on_a_gathered_copy_is_refused_by_name():
    with pytest.raises(dpcompile.DpCompileError, match=r"in-place write 'zero_'.*test_writes_through_views.py:\d+ in forward"):
        pm = dpcompile.transform(LostWrite(), ["cpu", "cpu"])
        pm(torch.randn(B, 8))
    model = LostWrite()  # one device: nothing is split, nothing refused
    pm = dpcompile.transform(model, ["cpu"])
    x = torch.randn(B, 8)
    torch.testing.assert_close(pm(x), model(x))


class WritesInputTwoLayers(WritesInput):
    def __init__(self, form: str):
        super().__init__(form)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return self.out(torch.tanh(super().forward(x)))


@pytest.mark.parametrize(
    ("form", "layout"), [("mul_", {"pipeline": 2}), ("setitem", {"mesh": {"pp": 2, "dp": 2}})], ids=["pp", "pp_dp"]
)
def test_input_written_in_place_in_a_pipeline_is_written_back(form, layout):
    """Each micro-batch wrote into its slice of the input in place, a view sharing the input's version
    counter: the next one's write invalidated what the first had saved for backward (a RuntimeError
    in backward). Made functional and written back as data parallelism does."""
    torch.manual_seed(0)
    model = WritesInputTwoLayers(form)
    eager = copy.deepcopy(model)
    x = torch.randn(B, 8)
    devices = ["cpu"] * (4 if "mesh" in layout else 2)
    pm = dpcompile.transform(model, devices, example_inputs=(x.clone(),), micro_batches=2, **layout)
    x_pm, x_eager = x.clone(), x.clone()
    out, expected = pm(x_pm), eager(x_eager)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x_pm, x_eager)
    assert_weighted_gradients_equal(model, eager, out, expected)
