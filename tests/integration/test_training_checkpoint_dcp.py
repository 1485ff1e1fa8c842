"""``format="dcp"``: training checkpoints as ``torch.distributed.checkpoint`` folders, in one process.
What dpcompile saves loads into the plain eager model the way torch documents it (``get_state_dict``,
``dcp.load``, ``set_state_dict``), and what plain torch saves of the eager model loads into every
layout: parameters and AdamW state bit-identical, the next 2 steps equal the uninterrupted eager run.
Then dpcompile to dpcompile (scheduler, RNG, ``extra``), and what a DCP save or load refuses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import dpcompile
from dpcompile import CheckpointError
from tests.integration.test_training_checkpoint import (
    LAYOUTS,
    batches,
    eager_run,
    make_model,
    program,
    state_in_model_layout,
    train_step,
)


@pytest.fixture(scope="module")
def eager():
    return eager_run()


def _eager_state(model, opt, name):
    return {n: opt.state[p][name] for n, p in model.named_parameters()}


def _plain_trained():
    """The eager model and its AdamW after the first step, as a plain torch run holds them."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train_step(model, opt, sched, batches()[0])
    return model, opt


def _resume_equals_eager(pm, opt, eager):
    """The next 2 steps (a fresh StepLR from the loaded lr gives the same lrs) equal the eager run's."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    losses, params = eager
    resumed = [train_step(pm, opt, sched, b) for b in batches()[1:]]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[1:]), rtol=1e-12, atol=0)
    for key, value in pm.state_dict().items():
        torch.testing.assert_close(value, params[key], rtol=1e-10, atol=1e-12, msg=key)


@pytest.mark.parametrize("source", ["tp2", "pp2xtp2"])
def test_a_dcp_checkpoint_of_a_program_loads_into_plain_torch(source, tmp_path, eager):
    pm, opt, sched = program(source)
    train_step(pm, opt, sched, batches()[0])
    dpcompile.save_checkpoint(pm, tmp_path / "ckpt", optimizer=opt, lr_scheduler=sched, format="dcp")
    want = {k: v.clone() for k, v in pm.state_dict().items()}
    moments = {name: state_in_model_layout(pm, opt, name) for name in ("exp_avg", "exp_avg_sq")}

    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    plain_opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    model_sd, optim_sd = get_state_dict(model, plain_opt)
    dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp_path / "ckpt")
    set_state_dict(model, plain_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key
    for name, values in moments.items():
        for key, value in _eager_state(model, plain_opt, name).items():
            assert torch.equal(value, values[key]), (name, key)
    assert plain_opt.param_groups[0]["lr"] == 5e-3 and plain_opt.param_groups[0]["weight_decay"] == 0.1
    _resume_equals_eager(model, plain_opt, eager)


def test_a_dcp_checkpoint_of_plain_torch_loads_into_every_layout(tmp_path, eager):
    model, opt = _plain_trained()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp_path / "plain")
    moments = {name: _eager_state(model, opt, name) for name in ("exp_avg", "exp_avg_sq")}
    for layout in LAYOUTS:
        pm = program(layout)[0]
        pm_opt = torch.optim.AdamW(pm.parameters(), lr=1.0)
        dpcompile.load_checkpoint(pm, tmp_path / "plain", optimizer=pm_opt)
        for key, value in pm.state_dict().items():
            assert torch.equal(value, model.state_dict()[key]), (layout, key)
        for name, values in moments.items():
            for key, value in state_in_model_layout(pm, pm_opt, name).items():
                if key in values:  # the tied head's state is the embedding's
                    assert torch.equal(value, values[key]), (layout, name, key)
        assert all(float(s["step"]) == 1.0 for s in pm_opt.state.values())
        assert pm_opt.param_groups[0]["lr"] == 5e-3 and pm_opt.param_groups[0]["weight_decay"] == 0.1
        _resume_equals_eager(pm, pm_opt, eager)

    dcp.save(make_model().state_dict(), checkpoint_id=tmp_path / "weights")  # the model's keys at the top
    pm = program("tp2")[0]
    with torch.no_grad():
        for p in pm.parameters():
            p.zero_()
    dpcompile.load_checkpoint(pm, tmp_path / "weights")
    for key, value in pm.state_dict().items():
        assert torch.equal(value, make_model().state_dict()[key]), key
    with pytest.raises(CheckpointError, match="without lr_scheduler"):
        sched = torch.optim.lr_scheduler.StepLR(torch.optim.AdamW(pm.parameters()), step_size=1)
        dpcompile.load_checkpoint(pm, tmp_path / "plain", lr_scheduler=sched)


def test_a_dcp_checkpoint_resumes_under_another_layout_with_scheduler_rng_and_extra(tmp_path, eager):
    pm, opt, sched = program("pp2xtp2")
    train_step(pm, opt, sched, batches()[0])
    rng = torch.get_rng_state()
    dpcompile.save_checkpoint(pm, tmp_path / "ckpt", optimizer=opt, lr_scheduler=sched, extra={"step": 1},
                              format="dcp")  # fmt: skip
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert ".metadata" in names and all(n == ".metadata" or n.endswith(".distcp") for n in names), names
    want = {k: v.clone() for k, v in pm.state_dict().items()}
    moments = {name: state_in_model_layout(pm, opt, name) for name in ("exp_avg", "exp_avg_sq")}

    dest, dest_opt, _ = program("dp3")
    dest_opt = torch.optim.AdamW(dest.parameters(), lr=1.0)
    dest_sched = torch.optim.lr_scheduler.StepLR(dest_opt, step_size=1, gamma=0.5)
    torch.manual_seed(7)
    dpcompile.load_checkpoint(dest, tmp_path / "ckpt", optimizer=dest_opt, lr_scheduler=dest_sched)
    assert torch.equal(torch.get_rng_state(), rng) and dest.checkpoint_extra == {"step": 1}
    assert dest_sched.last_epoch == 1
    for key, value in dest.state_dict().items():
        assert torch.equal(value, want[key]), key
    for name, values in moments.items():
        for key, value in state_in_model_layout(dest, dest_opt, name).items():
            assert torch.equal(value, values[key]), (name, key)
    losses, params = eager
    resumed = [train_step(dest, dest_opt, dest_sched, b) for b in batches()[1:]]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[1:]), rtol=1e-12, atol=0)

    sgd = torch.optim.SGD(dest.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match=r"AdamW.*SGD"):
        dpcompile.load_checkpoint(dest, tmp_path / "ckpt", optimizer=sgd)

    dpcompile.save_checkpoint(dest, tmp_path / "ckpt", optimizer=dest_opt, format="dcp")  # replaces the folder whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing staged or set aside is left
    dpcompile.load_checkpoint(pm, tmp_path / "ckpt", optimizer=opt)
    for key, value in pm.state_dict().items():
        assert torch.equal(value, dest.state_dict()[key]), key


def test_what_a_dcp_save_or_load_refuses(tmp_path):
    pm, opt, _ = program("tp2")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="not a torch.distributed.checkpoint folder"):
        dpcompile.save_checkpoint(pm, tmp_path / "mine", optimizer=opt, format="dcp")
    with pytest.raises(ValueError, match="writes a folder"):
        dpcompile.save_checkpoint(pm, tmp_path / "one.safetensors", format="dcp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]

    wider = {k: v for k, v in make_model().state_dict().items()}
    wider["blocks.0.fc.weight"] = torch.zeros(2 * 12 + 1, 12, dtype=torch.float64)
    dcp.save(wider, checkpoint_id=tmp_path / "wider")
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"'blocks.0.fc.weight': checkpoint \[25, 12\], model \[24, 12\]"):
        dpcompile.load_checkpoint(pm, tmp_path / "wider")
    del wider["blocks.0.fc.weight"]
    dcp.save(wider, checkpoint_id=tmp_path / "lacking")
    with pytest.raises(CheckpointError, match=r"missing \['blocks.0.fc.weight'\]"):
        dpcompile.load_checkpoint(pm, tmp_path / "lacking")
    for key, value in pm.state_dict().items():
        assert torch.equal(value, before[key]), key
    dpcompile.load_checkpoint(pm, tmp_path / "lacking", strict=False)  # the keys both have


class _Tempered(torch.nn.Module):
    """A linear and a 0-dim temperature (its AdamW step state has its shape, not its dtype)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.temperature = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x):
        return self.fc(x).double() / self.temperature


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_optimizer_state_comes_back_in_its_own_dtype(fmt, tmp_path):
    """Every AdamW state tensor loads with the dtype and value it was saved with. Before, through DCP, the
    float32 ``step`` of a 0-dim float64 parameter (laid out as the parameter: the same shape) came back float64."""
    torch.manual_seed(0)
    x = torch.randn(4, 4)
    pm = dpcompile.transform(_Tempered(), ["cpu"] * 2, example_inputs=(x,))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm(x).square().mean().backward()
    opt.step()
    dpcompile.save_checkpoint(pm, tmp_path / "ckpt", optimizer=opt, format=fmt)
    other = dpcompile.transform(_Tempered(), ["cpu"] * 2, example_inputs=(x,))
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    dpcompile.load_checkpoint(other, tmp_path / "ckpt", optimizer=other_opt)
    saved, loaded = dict(pm.named_parameters()), dict(other.named_parameters())
    for name, p in saved.items():
        for key, value in opt.state[p].items():
            got = other_opt.state[loaded[name]][key]
            assert got.dtype == value.dtype and torch.equal(got, value), (name, key, got, value)
