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
