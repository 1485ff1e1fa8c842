"""``transform(progress=)``: a bar per stage of the work (capture, passes, weights) on stderr where
stderr is a terminal (or ``progress=True``), nothing otherwise (or ``progress=False``); a bad value
is refused first; the program is the one a quiet transform builds."""

from __future__ import annotations

import io
import sys
import warnings

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.progress import StepBars


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _transform(model, stream, monkeypatch, **options):
    """``(program, what it wrote on stderr)``."""
    monkeypatch.setattr(sys, "stderr", stream)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(model, ["cpu"] * 4, mesh={"pp": 2, "tp": 2}, example_inputs=(X,), **options)
    monkeypatch.undo()
    return pm, stream.getvalue()


def _last_states(written):
    """``{stage: (done, total)}`` of each stage's last line, as a terminal shows it (the last redraw)."""
    states = {}
    for line in written.strip("\n").split("\n"):
        shown = line.split("\r")[-1]
        what, _, rest = shown.partition(": ")
        done, total = rest.split("| ")[1].split(" ")[0].split("/")
        states[what] = (int(done), int(total))
    return states


def test_progress_true_draws_each_stage_to_its_total_and_builds_the_same_program(monkeypatch):
    model = _mlp()
    quiet, _ = _transform(model, io.StringIO(), monkeypatch, progress=False)
    shown, written = _transform(model, io.StringIO(), monkeypatch, progress=True)
    states = _last_states(written)
    assert list(states) == ["Capturing the model", "Running passes", "Placing weights"], written
    assert all(done == total > 0 for done, total in states.values()), states
    expected = model(X)
    for pm in (quiet, shown):
        torch.testing.assert_close(pm(X), expected)
    assert shown.code == quiet.code
    assert [p.device for p in shown.parameters()] == [p.device for p in quiet.parameters()]


def test_a_meta_model_shows_its_weights_allocated(monkeypatch):
    with torch.device("meta"):
        model = _mlp()
    pm, written = _transform(model, Terminal(), monkeypatch)  # progress=None on a terminal: shown
    states = _last_states(written)
    tensors = len(list(pm.parameters()))
    assert states["Allocating weights"] == (tensors, tensors), written


@pytest.mark.parametrize(("stream", "progress"), [(io.StringIO(), None), (Terminal(), False), (io.StringIO(), False)],
                         ids=["not_a_terminal", "silenced_terminal", "silenced"])  # fmt: skip
def test_quiet_where_stderr_is_not_a_terminal_or_progress_is_false(monkeypatch, stream, progress):
    _, written = _transform(_mlp(), stream, monkeypatch, progress=progress)
    assert written == ""


def test_a_bad_progress_is_refused_naming_the_choices():
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"progress='yes': expected True, False or None"):
        dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(X,), progress="yes")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_stage_resumed_after_another_goes_on_from_its_counts():
    """Weights placed inside a pass end the passes' line; the next pass starts a line that goes on
    from the passes' count so far, so each stage's last line shows all its steps."""
    stream = io.StringIO()
    bars = StepBars(stream)
    passes = bars.bar_for("Running passes", 3)
    passes.update()
    weights = bars.bar_for("Placing weights", 2)
    weights.update(2)
    passes.update(2)
    bars.close()
    lines = [line.split("\r")[-1] for line in stream.getvalue().strip("\n").split("\n")]
    assert [line.split("|")[0] for line in lines] == ["Running passes:  33%", "Placing weights: 100%", "Running passes: 100%"]
    assert [line.split("| ")[1].split(" ")[0] for line in lines] == ["1/3", "2/2", "3/3"]


def _tied_lstm():
    model = nn.Sequential(nn.Embedding(5, 4), nn.LSTM(4, 4), nn.BatchNorm1d(4))
    model.tied = nn.Linear(4, 5, bias=False)
    model.tied.weight = model[0].weight
    return model


def _sharing(model):
    """Which named tensors are one tensor: ``{name: first name holding the same tensor}``."""
    first = {}
    named = (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
    return {name: first.setdefault(id(t), name) for name, t in named}


@pytest.mark.parametrize("progress", [False, True])
def test_weights_moved_under_a_bar_land_as_model_to_puts_them(progress):
    """``move_to`` (data parallel's and SPMD's placement) moves a module at a time under a bar, one
    step a tensor; quiet, in one ``model.to``. Either way the tensors land as ``model.to`` puts them
    (which tensors are one, an LSTM's flat weights)."""
    from dpcompile.progress import reporting_steps
    from dpcompile.recipes.base import move_to

    expected = _tied_lstm().to("meta")
    model = _tied_lstm()
    tensors = len(list(model.parameters())) + len(list(model.buffers()))
    stream = io.StringIO()
    old, sys.stderr = sys.stderr, stream
    try:
        with reporting_steps(progress):
            move_to(model, torch.device("meta"))
    finally:
        sys.stderr = old
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert all(w.is_meta for w in model[1]._flat_weights)
    assert _sharing(model) == _sharing(expected)
    assert (_last_states(stream.getvalue()) if progress else stream.getvalue()) == (
        {"Placing weights": (tensors, tensors)} if progress else ""
    )
