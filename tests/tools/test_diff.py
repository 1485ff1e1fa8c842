"""diff: the code before and after the passes."""

from __future__ import annotations

import dpcompile
from tests.models import MLP


def test_diff_shows_the_inserted_communication():
    """The unified diff removes the single-device call and adds scatter, per-device calls and gather."""
    model = MLP()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    text = dpcompile.diff(model, pm)
    assert text.startswith("--- MLP (traced)\n+++ ")
    assert "-    fc1 = self.fc1(x)" in text
    assert "+    x_scatter = dpcompile_runtime_scatter(x, ['cpu', 'cpu'], 0)" in text
    assert "+    fc2 = dpcompile_runtime_gather(" in text


def test_diff_of_a_model_fx_cannot_trace_shows_the_program_pm_was_built_from():
    """A model transform captured with torch.export (a shape branch fx cannot trace): diff compared
    against an fx trace and raised TraceError; the 'before' is the program pm was lowered from."""
    import torch

    from tests.capture.test_export_frontend import Block

    model, x = Block(), torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,))
    text = dpcompile.diff(model, pm)
    assert "-    q_proj = self.q_proj(x)" in text and "+    x_scatter = dpcompile_runtime_scatter(" in text, text
