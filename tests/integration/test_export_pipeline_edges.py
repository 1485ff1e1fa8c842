"""Edge cases of exporting and loading one-process pipelines, found by probing as a user would:
a loaded module exported again keeps every program it carries (eval mode, optional arguments
left None), so the module loaded from the second folder runs the calls the first one ran."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import dpcompile


class MaskedStack(nn.Module):
    """Two stages' worth of layers and an optional keyword-only mask: three call variants."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, 4)

    def forward(self, x, labels, *, mask=None):
        h = torch.relu(self.layers[0](x))
        if mask is not None:
            h = h * mask
        h = self.norm(torch.relu(self.layers[1](h)))
        return nn.functional.cross_entropy(self.head(h), labels)


def _inputs(n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(n, 8, generator=g, dtype=torch.float64), "labels": torch.randint(0, 4, (n,), generator=g),
            "mask": torch.rand(n, 8, generator=g, dtype=torch.float64)}  # fmt: skip


def test_a_loaded_pipeline_exported_again_keeps_its_eval_and_optional_argument_programs(tmp_path):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(MaskedStack().double(), ["cpu"] * 2, pipeline=2, micro_batches=2, example_kwargs=_inputs())
    loaded = dpcompile.load(dpcompile.export(pm, tmp_path / "first"))
    again = dpcompile.load(dpcompile.export(loaded, tmp_path / "second"))
    kwargs = _inputs()
    no_mask = {k: v for k, v in kwargs.items() if k != "mask"}
    for call in (kwargs, no_mask):  # training: the main program and the one without the mask
        torch.testing.assert_close(again(**call), pm(**call), rtol=0, atol=0)
    for key, value in pm.state_dict().items():  # BatchNorm's running statistics moved alike
        torch.testing.assert_close(again.state_dict()[key], value, rtol=0, atol=0)
    with torch.no_grad():
        for call in (kwargs, no_mask):  # eval mode: before the fix the second load carried no such program
            torch.testing.assert_close(again.eval()(**call), pm.eval()(**call), rtol=0, atol=0)
