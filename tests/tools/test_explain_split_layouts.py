"""explain's split fraction is the ``dp`` dimension's, whatever it composes with: dp, FSDP, dp x tp,
pp x dp and pp x dp x tp in one process report the share of forward FLOPs that runs split, the same
on each; layouts that split no batch over devices (tp, pp) report none."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import dpcompile

BATCH, D_IN, HIDDEN = 8, 8, 32


class CumsumBetween(nn.Module):
    """``fc2`` reads a cumulative sum over the batch, which runs whole: so does ``fc2``."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.fc2(torch.cumsum(self.fc1(x), 0))


def _explained(n: int, **options):
    torch.manual_seed(0)
    model, x = CumsumBetween(), torch.randn(BATCH, D_IN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "runs whole": what this file measures
        pm = dpcompile.transform(model, ["cpu"] * n, example_inputs=(x,), **options)
    torch.testing.assert_close(pm(x), model(x))
    return dpcompile.explain(pm, x)


SPLIT_LAYOUTS = {
    "dp": (2, {"mesh": {"dp": 2}}),
    "fsdp": (2, {"data_parallel": "fsdp"}),
    "dp_tp": (4, {"mesh": {"dp": 2, "tp": 2}}),
    "pp_dp": (4, {"mesh": {"pp": 2, "dp": 2}}),
    "pp_dp_tp": (8, {"mesh": {"pp": 2, "dp": 2, "tp": 2}}),
}


@pytest.mark.parametrize("layout", SPLIT_LAYOUTS)
def test_explain_split_fraction_is_the_dp_dimensions_on_every_layout(layout):
    """fc1 runs split, the cumsum and fc2 run whole: fc1's share of the forward FLOPs,
    2*B*8*32 / (2*B*8*32 + 2*B*32*32) = 0.2, on each layout with a dp dimension (dp x tp and
    pp x dp x tp reported none before: fc2's shards lost their 'whole' stamp, and only a data-parallel
    program's kind showed the fraction), each op that runs whole named, and printed."""
    n, options = SPLIT_LAYOUTS[layout]
    report = _explained(n, **options)
    fc1, fc2 = 2 * BATCH * D_IN * HIDDEN, 2 * BATCH * HIDDEN * HIDDEN
    assert report.splits_batch
    assert report.split_flop_fraction == pytest.approx(fc1 / (fc1 + fc2), abs=1e-12)
    cumsum = [w for w in report.whole if w["target"] == "torch.cumsum"]
    assert report.whole[0] == cumsum[0] and cumsum[0]["reason"].startswith("the batch rule for torch")
    assert all(w["reason"].startswith("its input '") for w in report.whole if w not in cumsum)
    assert sum(w["flops"] for w in report.whole) == fc2
    assert "Split across devices: 20.0% of forward FLOPs" in str(report)


@pytest.mark.parametrize("n, mesh", [(2, {"tp": 2}), (2, {"pp": 2})], ids=["tp", "pp"])
def test_explain_reports_no_split_fraction_where_no_batch_is_split(n, mesh):
    """Tensor parallel and a pipeline alone split no batch over devices: no fraction, no section."""
    report = _explained(n, mesh=mesh)
    assert not report.splits_batch and report.split_flop_fraction is None and report.whole == []
    assert "Split across devices" not in str(report)
