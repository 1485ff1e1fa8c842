"""``torch.save(pm, path)`` writes the whole file or leaves ``path`` as it was (dpcompile.modules.torch_save)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

import dpcompile


def _hook(module, args, output):  # importable: pickle saves it by name
    return output


def _program(hook=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    if hook is not None:
        model[0].register_forward_hook(hook)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dpcompile.transform(model, ["cpu"] * 2, example_inputs=(torch.randn(3, 4),))


def test_a_refused_torch_save_leaves_no_file_and_keeps_the_previous_one(tmp_path):
    """Before, the refusal (raised while pickling, after torch opened the file) left a ~600-byte zip at path,
    over the previous file."""
    pm, path = _program(hook=lambda module, args, output: output), tmp_path / "pm.pt"
    with pytest.raises(dpcompile.DpCompileError, match="lambda"):
        torch.save(pm, path)
    assert os.listdir(tmp_path) == []
    path.write_bytes(b"the previous save")
    with pytest.raises(dpcompile.DpCompileError, match="lambda"):
        torch.save({"model": pm, "step": 3}, str(path))
    assert path.read_bytes() == b"the previous save" and os.listdir(tmp_path) == ["pm.pt"]


def test_torch_save_of_a_program_to_a_path_round_trips_with_a_plain_file_mode(tmp_path):
    pm, path, x = _program(hook=_hook), tmp_path / "pm.pt", torch.randn(5, 4)
    torch.save(pm, path)
    umask = os.umask(0)
    os.umask(umask)
    assert os.listdir(tmp_path) == ["pm.pt"] and (path.stat().st_mode & 0o777) == 0o666 & ~umask
    torch.testing.assert_close(torch.load(path, weights_only=False)(x), pm(x))
    path.chmod(0o640)
    torch.save(pm, path)  # over a file: its mode kept, as torch's own open("wb") keeps it
    assert (path.stat().st_mode & 0o777) == 0o640
    torch.testing.assert_close(torch.load(path, weights_only=False)(x), pm(x))
