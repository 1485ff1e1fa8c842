"""``load_checkpoint`` of a ``format="dcp"`` folder that was tampered with: ``.metadata`` is
unpickled from DCP's own classes only (a crafted pickle runs nothing) and checked before the load
plans a read (data files inside the folder, byte ranges inside them, chunks covering each tensor),
so each fault is a ``CheckpointError`` naming ``.metadata`` or the data file, and the program and
the optimizer are as they were. Before, the pickle ran, ``../`` read outside the folder, and a
missing or short data file raised torch's ``CheckpointException`` (a ``BaseException``) midway."""

from __future__ import annotations

import copy
import io
import os
import pickle
import shutil
import struct
import zipfile

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import _StorageInfo

import dpcompile
from dpcompile import CheckpointError


def _program():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(torch.randn(4, 6),))
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-2)


def _step(pm, opt):
    pm(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dcp") / "ckpt"
    pm, opt = _program()
    _step(pm, opt)
    dpcompile.save_checkpoint(pm, folder, optimizer=opt, format="dcp")
    return folder


class _Runs:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # would create the marker file


def _metadata_edit(change):
    def edit(folder):
        metadata = pickle.loads((folder / ".metadata").read_bytes())
        change(metadata, folder)
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))

    return edit


def _outside(metadata, folder):
    (folder.parent / "elsewhere.distcp").write_bytes((folder / "__0_0.distcp").read_bytes())
    metadata.storage_data = {
        k: _StorageInfo("../elsewhere.distcp", v.offset, v.length, v.transform_descriptors)
        for k, v in metadata.storage_data.items()
    }


def _shared(depth):
    """A list holding the same list twice, ``depth`` levels deep: 2**depth elements, pickled in a few bytes a level."""
    value = [0]
    for _ in range(depth):
        value = [value, value]
    return value


def _named(name):
    def rename(metadata, folder):
        metadata.storage_data = {k: _StorageInfo(name, v.offset, v.length, v.transform_descriptors) for k, v in metadata.storage_data.items()}

    return rename


def _partial_chunk(metadata, folder):
    metadata.state_dict_metadata["model.2.weight"].chunks[0].sizes = torch.Size([1, 8])


FAULTS = {
    "pickle_that_runs_code": (lambda f: (f / ".metadata").write_bytes(pickle.dumps(_Runs(f.parent / "RAN"))), ".metadata", "names io.open"),
    "metadata_a_list": (lambda f: (f / ".metadata").write_bytes(pickle.dumps([1])), ".metadata", "not a checkpoint's Metadata"),
    "data_file_missing": (lambda f: (f / "__0_0.distcp").unlink(), "__0_0.distcp", "not in"),
    "data_file_short": (lambda f: os.truncate(f / "__0_0.distcp", 100), "__0_0.distcp", "truncated"),
    "data_outside_the_folder": (_metadata_edit(_outside), ".metadata", "plain file names"),
    # a name no path can hold (os.lstat raised a bare ValueError or UnicodeEncodeError)
    "data_file_named_with_nul": (_metadata_edit(_named("__0_0.distcp\x00")), ".metadata", "plain file names"),
    "data_file_named_with_a_surrogate": (_metadata_edit(_named("\ud800.distcp")), ".metadata", "plain file names"),
    "chunks_not_covering": (_metadata_edit(_partial_chunk), ".metadata", "chunks of 8 elements"),
    # a size sharing one list 22 levels deep (2**22 elements; 40 levels hung the load printing or hashing it)
    "a_shared_structure": (_metadata_edit(lambda m, f: setattr(m.state_dict_metadata["model.2.weight"], "size", _shared(22))),
                           ".metadata", "expands to more than"),
    "bytes_past_the_end": (lambda f: (f / ".metadata").write_bytes(b"\x80\x04\x8e" + (1 << 40).to_bytes(8, "little")), ".metadata",
                           "cannot be read"),
}  # fmt: skip


@pytest.mark.parametrize("fault", FAULTS)
def test_a_tampered_dcp_folder_is_refused_before_anything_is_read(fault, saved, tmp_path):
    pm, opt = _program()
    _step(pm, opt)
    _step(pm, opt)
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    edit, named, match = FAULTS[fault]
    edit(folder)
    weights, state = copy.deepcopy(pm.state_dict()), copy.deepcopy(opt.state_dict())
    for optimizer in (None, opt):
        with pytest.raises(CheckpointError, match=match) as error:
            dpcompile.load_checkpoint(pm, folder, optimizer=optimizer)
        assert named in str(error.value) and error.value.file.name == named
    assert not (tmp_path / "RAN").exists()
    assert not pm.needs_weights
    assert all(torch.equal(v, weights[k]) for k, v in pm.state_dict().items())
    assert str(opt.state_dict()) == str(state)


def test_metadata_larger_than_the_bound_is_refused_before_it_is_read(saved, tmp_path, monkeypatch):
    from dpcompile.checkpoint import dcp_reader

    pm, _ = _program()
    weights = copy.deepcopy(pm.state_dict())
    monkeypatch.setattr(dcp_reader, "METADATA_MAX_BYTES", (saved / ".metadata").stat().st_size - 1)
    with pytest.raises(CheckpointError, match="larger than .*METADATA_MAX_BYTES") as error:
        dpcompile.load_checkpoint(pm, saved)
    assert error.value.file.name == ".metadata"
    assert all(torch.equal(v, weights[k]) for k, v in pm.state_dict().items()) and not pm.needs_weights


def _item_range(folder, fqn):
    """``(offset, length)`` in ``__0_0.distcp`` of the item holding the tensor ``fqn``."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == fqn]
    return info.offset, info.length


def _flip_a_data_byte(folder):
    """One bit of ``model.2.weight``'s values flipped (its zip record intact but for its CRC-32)."""
    offset, length = _item_range(folder, "model.2.weight")
    raw = bytearray((folder / "__0_0.distcp").read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(raw[offset : offset + length]))) as archive:
        (record,) = [r for r in archive.infolist() if "/data/" in r.filename]
    local = offset + record.header_offset
    name_length, extra_length = struct.unpack("<HH", raw[local + 26 : local + 30])
    raw[local + 30 + name_length + extra_length + 5] ^= 0x01
    (folder / "__0_0.distcp").write_bytes(bytes(raw))


def _swap_two_items(metadata, folder):
    """``model.0.bias``'s storage entry points at ``model.2.bias``'s bytes: a sound item of another shape."""
    entries = {k.fqn: k for k in metadata.storage_data}
    metadata.storage_data[entries["model.0.bias"]] = metadata.storage_data[entries["model.2.bias"]]


DATA_FAULTS = {
    "data_zeroed": (lambda f: (f / "__0_0.distcp").write_bytes(bytes((f / "__0_0.distcp").stat().st_size)), "not the zip"),
    "a_data_bit_flipped": (_flip_a_data_byte, "CRC-32"),
    "an_item_of_another_shape": (_metadata_edit(_swap_two_items), "holds a tensor of shape \\[3\\]"),
}  # fmt: skip


@pytest.mark.parametrize("fault", DATA_FAULTS)
def test_damaged_data_is_found_before_anything_is_written(fault, saved, tmp_path):
    """Each tensor item the load reads is read and checked whole first (its zip records' CRC-32, torch.load of
    it, the box it must hold): damaged data raises ``CheckpointError`` naming the data file and the program is
    unchanged, still callable. Before, it was found only as read (the program half-written, waiting for a load),
    and a flipped bit of tensor data loaded silently."""
    pm, opt = _program()
    _step(pm, opt)
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    edit, match = DATA_FAULTS[fault]
    edit(folder)
    x = torch.randn(4, 6)
    weights, out = copy.deepcopy(pm.state_dict()), pm(x)
    with pytest.raises(CheckpointError, match=match) as error:
        dpcompile.load_checkpoint(pm, folder)
    assert error.value.file.name == "__0_0.distcp" and "nothing was loaded" in str(error.value)
    assert not pm.needs_weights and torch.equal(pm(x), out)
    assert all(torch.equal(v, weights[k]) for k, v in pm.state_dict().items())
    dpcompile.load_checkpoint(pm, saved)  # the checkpoint it was copied from still loads


def test_random_bit_flips_in_a_data_file_load_exactly_or_change_nothing(saved, tmp_path):
    """12 seeded single-bit flips anywhere in ``__0_0.distcp`` (weights, optimizer state, byte items), loaded with
    the optimizer: each is a CheckpointError with the program and optimizer unchanged and the program callable,
    or a load equal to the unflipped one (a flip in a zip field nothing reads: the padding torch.save puts before
    each record). Before, of 150 random flips (the optimizer's too), 48 left the program half-written."""
    import random

    reference, ref_opt = _program()
    dpcompile.load_checkpoint(reference, saved, optimizer=ref_opt)
    want, want_state = reference.state_dict(), str(ref_opt.state_dict())
    pm, opt = _program()
    _step(pm, opt)
    x = torch.randn(4, 6)
    weights, kept, out = copy.deepcopy(pm.state_dict()), copy.deepcopy(opt.state_dict()), pm(x)
    state = str(opt.state_dict())
    clean = bytearray((saved / "__0_0.distcp").read_bytes())
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    rng = random.Random(0)
    refused = 0
    for _ in range(12):
        raw = bytearray(clean)
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        (folder / "__0_0.distcp").write_bytes(bytes(raw))
        try:
            dpcompile.load_checkpoint(pm, folder, optimizer=opt)
        except CheckpointError:
            refused += 1
            assert not pm.needs_weights and torch.equal(pm(x), out)
            assert all(torch.equal(v, weights[k]) for k, v in pm.state_dict().items())
            assert str(opt.state_dict()) == state
        else:
            assert all(torch.equal(v, want[k]) for k, v in pm.state_dict().items())
            assert str(opt.state_dict()) == want_state
            pm.load_state_dict(weights)
            opt.load_state_dict(copy.deepcopy(kept))
    assert 2 <= refused < 12, refused  # both outcomes drawn with this seed


def test_a_pickle_checked_once_is_not_walked_again_and_a_smaller_limit_still_refuses(monkeypatch):
    """The same ``.metadata`` bytes are checked three times a load: they are walked once, and a pass
    under one limit is no pass under a smaller one (nor for other bytes)."""
    from dpcompile.checkpoint import pickle_bounds

    walked = []
    walk = pickle_bounds._walk
    monkeypatch.setattr(pickle_bounds, "_walk", lambda raw, limit: (walked.append(limit), walk(raw, limit)))
    raw = pickle.dumps([(i, str(i)) for i in range(50)])  # expands to about 100 values
    for _ in range(3):
        pickle_bounds.check_expansion(raw, 1000)
    assert walked == [1000]
    with pytest.raises(ValueError, match="expands to more than 20 values"):
        pickle_bounds.check_expansion(raw, 20)
    pickle_bounds.check_expansion(pickle.dumps([(i, str(i)) for i in range(1, 51)]), 1000)  # other bytes: walked
    assert walked == [1000, 20, 1000]
