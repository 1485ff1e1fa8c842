"""``progress=`` of save_checkpoint and load_checkpoint: a bar on stderr where stderr is a terminal
(or ``progress=True``), nothing otherwise (or ``progress=False``); a bad value is refused first."""

from __future__ import annotations

import io
import sys

import pytest
import torch
from torch import nn

import dpcompile


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def trained():
    """A tensor-parallel MLP after one AdamW step: 2 weights, 6 state tensors (exp_avg, exp_avg_sq, step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 4, bias=False))
    x = torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm(x).sum().backward()
    opt.step()
    return pm, opt


def _save_and_load(pm, opt, folder, stream, monkeypatch, **progress):
    monkeypatch.setattr(sys, "stderr", stream)
    dpcompile.save_checkpoint(pm, folder, optimizer=opt, **progress)
    dpcompile.load_checkpoint(pm, folder, optimizer=opt, **progress)
    monkeypatch.undo()
    return stream.getvalue()


def test_quiet_where_stderr_is_not_a_terminal(trained, tmp_path, monkeypatch):
    assert _save_and_load(*trained, tmp_path, io.StringIO(), monkeypatch) == ""


def test_a_bar_on_a_terminal_and_with_progress_true(trained, tmp_path, monkeypatch):
    for stream, progress in ((Terminal(), {}), (io.StringIO(), {"progress": True})):
        written = _save_and_load(*trained, tmp_path, stream, monkeypatch, **progress)
        lines = written.strip("\n").split("\n")
        assert len(lines) == 2, written  # one line each, redrawn with \r
        assert lines[0].split("\r")[-1].startswith("Saving checkpoint: 100%|") and " 8/8 " in lines[0], lines[0]
        assert lines[1].split("\r")[-1].startswith("Loading checkpoint: 100%|") and " 2/2 " in lines[1], lines[1]


def test_progress_false_silences_a_terminal(trained, tmp_path, monkeypatch):
    assert _save_and_load(*trained, tmp_path, Terminal(), monkeypatch, progress=False) == ""


def test_a_bad_progress_is_refused_before_anything_is_written(trained, tmp_path):
    pm, opt = trained
    with pytest.raises(ValueError, match="progress='yes'"):
        dpcompile.save_checkpoint(pm, tmp_path / "new", optimizer=opt, progress="yes")
    assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match="progress=1"):
        dpcompile.load_checkpoint(pm, tmp_path / "new", progress=1)
