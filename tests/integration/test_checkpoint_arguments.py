"""``load_checkpoint`` / ``save_checkpoint`` given arguments of the wrong kind, a checkpoint whose keys
carry a wrapper's prefix, or a destination that cannot hold a checkpoint: a ``ValueError`` naming
the keyword (``dpcompile.ArgumentError``: a ``DpCompileError`` too) (or a ``CheckpointError`` naming the prefix and the ``key_mapping=`` that strips it),
raised before anything is read or written; the program and the files on disk as they were.
Before, ``strict="no"``, ``key_mapping=["a"]`` and a prefixed checkpoint under ``strict=False``
loaded nothing silently, and a save onto a file raised ``FileExistsError`` from pathlib (a save
into a folder named ``x.safetensors`` left its staging file behind)."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import dpcompile
from dpcompile import CheckpointError


def _program():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    return dpcompile.transform(model, ["cpu"] * 2, example_inputs=(torch.randn(4, 6),))


def _state(pm):
    return {k: v.clone() for k, v in pm.state_dict().items()}


def _same(pm, before):
    return all(torch.equal(v, before[k]) for k, v in pm.state_dict().items())


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod."])
def test_a_wrappers_prefix_is_named_with_the_key_mapping_that_strips_it(prefix, tmp_path):
    pm = _program()
    saved = {k: torch.randn_like(v.float()).to(v.dtype) for k, v in pm.state_dict().items()}
    save_file({prefix + k: v for k, v in saved.items()}, tmp_path / "model.safetensors")
    before = _state(pm)
    escaped = prefix.replace(".", r"\.")
    for strict in (True, False):  # strict=False too: a load that would fill nothing is refused
        with pytest.raises(CheckpointError, match=re.escape(f"prefix '{prefix}'") + ".*" + re.escape(f"key_mapping={{r'^{escaped}': ''}}")):
            dpcompile.load_checkpoint(pm, tmp_path, strict=strict)
        assert _same(pm, before)
    dpcompile.load_checkpoint(pm, tmp_path, key_mapping={"^" + escaped: ""})
    assert all(torch.equal(v, saved[k]) for k, v in pm.state_dict().items())


def test_the_prefix_search_reads_each_unexpected_key_a_few_times_not_once_per_dot():
    """A checkpoint key of a million dots took 234 s to refuse: the search for a wrapper's prefix sliced
    the key at every dot. Counted here (no timing): a slice per missing key length, at most."""
    from dpcompile.checkpoint.load import _wrapper_prefix

    class Counted(str):
        slices = 0

        def __getitem__(self, index):
            Counted.slices += 1
            return str.__getitem__(self, index)

    dotted = Counted("0.weight" + "." * 10_000 + "x")
    assert _wrapper_prefix(["0.weight", "2.bias"], [dotted]) is None
    assert Counted.slices <= 4  # two missing lengths: one look at the dot, one at the suffix, each
    assert _wrapper_prefix(["0.weight", "2.bias"], ["module.0.weight", "module.2.bias", "other"]) == "module."
    assert _wrapper_prefix(["a.b"], ["x.y.a.b"]) == "x.y."  # the longest suffix that is a missing key
    assert _wrapper_prefix(["0.weight", "2.bias"], ["m.0.weight", "n.2.bias"]) is None  # two prefixes: none


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"path": 5}, "path=5"),
        ({"strict": "no"}, "strict='no'"),
        ({"key_mapping": ["a"]}, r"key_mapping=\['a'\]"),
        ({"key_mapping": {"(": ""}}, "pattern '\\(' is not a regular expression"),
        ({"optimizer": "adamw"}, "optimizer='adamw'"),
        ({"lr_scheduler": object()}, "lr_scheduler=<object"),
    ],
)
def test_load_arguments_of_the_wrong_kind_are_named(kwargs, match, tmp_path):
    pm = _program()
    dpcompile.save_checkpoint(pm, tmp_path)
    with torch.no_grad():
        for p in pm.parameters():
            p.add_(1.0)
    before = _state(pm)
    with pytest.raises(dpcompile.ArgumentError, match=match):  # a DpCompileError and a ValueError (it was a plain one)
        dpcompile.load_checkpoint(pm, **{"path": tmp_path, **kwargs})
    assert _same(pm, before)


@pytest.mark.parametrize("where", ["a_file", "under_a_file", "safetensors_folder", "optimizer_a_string"])
def test_a_save_that_cannot_land_writes_nothing(where, tmp_path):
    pm = _program()
    previous = tmp_path / "ckpt"
    dpcompile.save_checkpoint(pm, previous)
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "folder.safetensors").mkdir()
    path, kwargs, match = {
        "a_file": (tmp_path / "a_file", {}, "is a file: a checkpoint folder goes there"),
        "under_a_file": (tmp_path / "a_file" / "ckpt", {}, "is a file, so .* cannot be created"),
        "safetensors_folder": (tmp_path / "folder.safetensors", {}, "is a folder: a path ending in .safetensors"),
        "optimizer_a_string": (previous, {"optimizer": "adamw"}, "optimizer='adamw'"),
    }[where]
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(dpcompile.ArgumentError, match=match):  # a DpCompileError and a ValueError (it was a plain one)
        dpcompile.save_checkpoint(pm, path, **kwargs)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files  # nothing staged, nothing changed
    dpcompile.load_checkpoint(pm, previous)


@pytest.mark.parametrize("extra", [{1: "a"}, {"nested": {"ok": 1, None: 2}}, {"rows": [{True: 0}]}], ids=["int", "none", "bool"])
def test_extra_with_a_key_json_would_rename_is_refused_before_anything_is_written(extra, tmp_path):
    """JSON writes a dict's int, None or bool key as a string: load_checkpoint gave back another dict
    ({"1": "a"} for {1: "a"}). Refused as extra= that is not JSON-able is, naming the key."""
    pm = _program()
    with pytest.raises(dpcompile.ArgumentError, match=r"extra= must be JSON-able.*the key .* use string keys"):
        dpcompile.save_checkpoint(pm, tmp_path / "ckpt", extra=extra)
    assert not (tmp_path / "ckpt").exists()
    dpcompile.save_checkpoint(pm, tmp_path / "ckpt", extra={"step": 3, "betas": [0.9, 0.99], "by_name": {"a": 1}})
    dpcompile.load_checkpoint(pm, tmp_path / "ckpt")
    assert pm.checkpoint_extra == {"step": 3, "betas": [0.9, 0.99], "by_name": {"a": 1}}
