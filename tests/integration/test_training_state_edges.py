"""A ``training_state.json`` edited or corrupted (the RNG states, the scheduler's entry, the JSON
itself) is refused by ``load_checkpoint`` before anything is set: a ``CheckpointError`` naming
the file, the program's weights, the optimizer's and scheduler's state and the RNG as they were.
Before, a bad RNG state raised from torch after the weights were written, and a scheduler entry
of the wrong form raised ``KeyError`` or ``TypeError``."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile import CheckpointError


def _program():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(torch.randn(4, 6),))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    return pm, opt, sched


def _step(pm, opt, sched):
    pm(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("training_state")
    pm, opt, sched = _program()
    _step(pm, opt, sched)
    dpcompile.save_checkpoint(pm, folder, optimizer=opt, lr_scheduler=sched)
    return folder


def _edit_rng(doc):
    doc["rng"]["cpu"] = doc["rng"]["cpu"][:40]  # valid base64, too few bytes for torch


EDITS = {
    "rng_too_short": (_edit_rng, "rng entry's cpu state"),
    "rng_not_base64": (lambda doc: doc["rng"].update(cpu="!not base64!"), "rng entry's cpu state"),
    "rng_a_list": (lambda doc: doc.update(rng=[1, 2]), "rng entry"),
    "scheduler_without_kind": (lambda doc: doc["lr_scheduler"].pop("kind"), "lr_scheduler entry"),
    "scheduler_state_a_list": (lambda doc: doc["lr_scheduler"].update(state=[1]), "lr_scheduler entry"),
    # a float past any int where the scheduler counts (1e30 loaded, and StepLR's lr became 0.0)
    "scheduler_last_epoch_1e30": (lambda doc: doc["lr_scheduler"]["state"].update(last_epoch=1e30), r"values of another kind \['last_epoch'\]"),
    "scheduler_tensor_of_unknown_dtype": (
        lambda doc: doc["lr_scheduler"]["state"].update(x={"__tensor__": [1], "dtype": "nonsense"}),
        "lr_scheduler state is malformed",
    ),
    # the error named the folder only ("was saved without optimizer="), not the file and its entry
    "no_optimizer_entry": (lambda doc: doc.pop("optimizer"), "training_state.json has no 'optimizer' entry"),
    "no_scheduler_entry": (lambda doc: doc.pop("lr_scheduler"), "training_state.json has no 'lr_scheduler' entry"),
}


@pytest.mark.parametrize("edit", [*EDITS, "nested_deep", "not_utf8", "a_folder"])
def test_a_bad_training_state_is_refused_before_anything_is_set(edit, saved, tmp_path):
    pm, opt, sched = _program()
    _step(pm, opt, sched)
    _step(pm, opt, sched)  # another state than the saved one: a load would show
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    file = folder / "training_state.json"
    if edit == "nested_deep":
        file.write_text('{"a": ' + "[" * 20000 + "]" * 20000 + "}")
        match = "nests"
    elif edit == "not_utf8":
        file.write_bytes(b"\xff\xfe{}")
        match = "UTF-8"
    elif edit == "a_folder":
        file.unlink()
        file.mkdir()
        match = "not a regular file"
    else:
        change, match = EDITS[edit]
        doc = json.loads(file.read_text())
        change(doc)
        file.write_text(json.dumps(doc))
    weights = copy.deepcopy(pm.state_dict())
    opt_state, sched_state, rng = copy.deepcopy(opt.state_dict()), dict(sched.state_dict()), torch.get_rng_state()
    with pytest.raises(CheckpointError, match=match) as error:
        dpcompile.load_checkpoint(pm, folder, optimizer=opt, lr_scheduler=sched)
    assert error.value.file == file and "training_state.json" in str(error.value)
    if not edit.startswith(("scheduler", "no_")):  # a weights-only load reads the RNG states too
        with pytest.raises(CheckpointError, match=match):
            dpcompile.load_checkpoint(pm, folder)
    assert all(torch.equal(v, weights[k]) for k, v in pm.state_dict().items())
    assert str(opt.state_dict()) == str(opt_state) and sched.state_dict() == sched_state
    assert torch.equal(torch.get_rng_state(), rng)


def test_an_optimizer_step_of_another_shape_is_refused(saved, tmp_path):
    """AdamW's ``step`` is one number; a step of shape [2] loaded, and the next optimizer.step() raised
    "a Tensor with 2 elements cannot be converted to Scalar"."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    pm, opt, sched = _program()
    _step(pm, opt, sched)
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    file = folder / "optimizer.safetensors"
    with safe_open(str(file), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(file)
    key = "optimizer.state.0.weight.step"
    tensors[key] = torch.tensor([2.0, 2.0])
    save_file(tensors, file, metadata=metadata)
    weights, opt_state = copy.deepcopy(pm.state_dict()), copy.deepcopy(opt.state_dict())
    with pytest.raises(CheckpointError, match=r"'optimizer\.state\.0\.weight\.step' is torch.float32 \[2\].*0-dim") as error:
        dpcompile.load_checkpoint(pm, folder, optimizer=opt, lr_scheduler=sched)
    assert error.value.file == file and error.value.key == key
    assert all(torch.equal(v, weights[k]) for k, v in pm.state_dict().items())
    assert str(opt.state_dict()) == str(opt_state)
