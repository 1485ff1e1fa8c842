"""Whole-batch BatchNorm statistics of a bf16 or fp16 batch split across devices accumulate in
float32, as cuDNN's and ATen's kernels do: the error against float64 is no larger than eager's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dpcompile


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_batchnorm_error_against_float64_is_no_larger_than_eager(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    x = torch.randn(8, 3, 16, 16) * 3 + 5  # a mean far from 0: summing in low precision loses it
    reference = copy.deepcopy(model).double()
    expected = reference(x.double())
    eager = copy.deepcopy(model).to(dtype)
    pm = dpcompile.transform(copy.deepcopy(eager), ["cpu"] * 4)
    out = pm(x.to(dtype))
    assert out.dtype == dtype
    eager_error = (eager(x.to(dtype)).double() - expected).abs().mean()
    pm_error = (out.double() - expected).abs().mean()
    assert pm_error <= eager_error, (pm_error, eager_error)
    stats_error = (pm.get_submodule("1").running_mean.double() - reference[1].running_mean).abs().max()
    eager_stats_error = (eager[1].running_mean.double() - reference[1].running_mean).abs().max()
    assert stats_error <= eager_stats_error + torch.finfo(dtype).eps * 8, (stats_error, eager_stats_error)
