"""``load_checkpoint`` / ``save_checkpoint`` at their edges: 0-dim tensors, broken files and
indexes, buffers of the wrong shape, failed and linked saves, ``load_state_dict`` on a meta
program, and the legacy key names transformers' ``save_pretrained`` writes.

Every failure is a ``dpcompile.CheckpointError`` naming the file (and the key where one is to
blame), and leaves the program's parameters and buffers exactly as they were.
"""

from __future__ import annotations

import json
import os
import re
import struct
import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import dpcompile
from dpcompile import CheckpointError
from tests.models import Masked


class Scaled(nn.Module):
    """BatchNorm (its ``num_batches_tracked`` is 0-dim) and a 0-dim temperature parameter."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 6)
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3))) / self.temperature


class Buffered(nn.Module):
    """A non-persistent buffer of shape [4], which a checkpoint may hold."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)

    def forward(self, x):
        return self.fc(x) * self.scale


def _trained() -> Scaled:
    torch.manual_seed(0)
    model = Scaled()
    model(torch.randn(4, 3, 6, 6))  # running stats and num_batches_tracked move
    return model.eval()


def _meta_program(make=Scaled, tensor_parallel=False) -> dpcompile.ParallelModule:
    with torch.device("meta"):
        model = make()
    model.eval()
    x = torch.randn(2, 3, 6, 6) if make is Scaled else torch.randn(2, 4)
    return dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=tensor_parallel, example_inputs=(x,))


def _snapshot(pm: nn.Module) -> dict[str, torch.Tensor]:
    return {k: t.detach().clone() for k, t in [*pm.named_parameters(), *pm.named_buffers()]}


def _unchanged(pm: nn.Module, before: dict[str, torch.Tensor]) -> None:
    now = dict([*pm.named_parameters(), *pm.named_buffers()])
    assert now.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(now[key], value), key


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["data_parallel", "tensor_parallel"])
def test_zero_dim_tensors_round_trip_through_save_and_a_meta_program(tensor_parallel, tmp_path):
    """BatchNorm's num_batches_tracked and a scalar parameter: save → meta program → load equals eager."""
    eager = _trained()
    pm = dpcompile.transform(_trained(), ["cpu"] * 2, tensor_parallel=tensor_parallel)
    dpcompile.save_checkpoint(pm, tmp_path)
    other = _meta_program(tensor_parallel=tensor_parallel)
    dpcompile.load_checkpoint(other, tmp_path)
    assert not other.needs_weights
    assert other.get_buffer("bn.num_batches_tracked").item() == 1
    x = torch.randn(3, 3, 6, 6)
    torch.testing.assert_close(other(x), eager(x))


def _header(file) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_header(file, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize(
    "fault",
    ["truncated", "random_header", "length_lies", "wrong_dtype", "wrong_shape", "unknown_dtype", "overlap"],
)
def test_a_broken_file_is_a_checkpoint_error_naming_file_and_key(fault, tmp_path):
    """Each fault of a file is caught from the header, before any read: the file (and key) named, pm unchanged."""
    real = dpcompile.transform(_trained(), ["cpu"] * 2)
    dpcompile.save_checkpoint(real, tmp_path)
    file = tmp_path / "model.safetensors"
    header, data = _header(file)
    if fault == "truncated":
        file.write_bytes(file.read_bytes()[:-7])
    elif fault == "random_header":
        file.write_bytes(file.read_bytes()[:8] + os.urandom(40) + file.read_bytes()[48:])
    elif fault == "length_lies":
        file.write_bytes(struct.pack("<Q", 10**6) + file.read_bytes()[8:])
    elif fault == "wrong_dtype":  # float where the model holds an integer
        header["bn.num_batches_tracked"]["dtype"] = "F64"
        _write_header(file, header, data)
    elif fault == "wrong_shape":  # the same bytes, another shape
        header["fc.weight"]["shape"] = [4, 6]
        _write_header(file, header, data)
    elif fault == "unknown_dtype":
        header["fc.bias"]["dtype"] = "Q9"
        _write_header(file, header, data)
    elif fault == "overlap":
        header["fc.bias"]["data_offsets"] = header["fc.weight"]["data_offsets"][:1] + [
            header["fc.weight"]["data_offsets"][0] + 24
        ]
        _write_header(file, header, data)
    pm = _meta_program()
    pm.load_state_dict(_trained().state_dict())  # real weights: any write would show
    before = _snapshot(pm)
    with pytest.raises(CheckpointError) as error:
        dpcompile.load_checkpoint(pm, tmp_path)
    assert error.value.file is not None and error.value.file.name in str(error.value)
    if fault in ("wrong_dtype", "wrong_shape", "unknown_dtype", "overlap"):
        assert error.value.key is not None and error.value.key in str(error.value)
    _unchanged(pm, before)


def test_a_bool_tensor_whose_bytes_are_not_0_or_1_is_refused_before_any_write(tmp_path):
    """A byte 2 in a BOOL tensor loaded as a bool torch disagrees on (it prints True, yet ``.all()`` is False):
    now a CheckpointError naming file and key, the program unchanged; the same file with 0/1 bytes loads."""
    torch.manual_seed(0)
    pm = dpcompile.transform(Masked(), ["cpu"] * 2, example_inputs=(torch.randn(2, 4),))
    dpcompile.save_checkpoint(pm, tmp_path)
    file = tmp_path / "model.safetensors"
    header, data = _header(file)
    begin = header["mask"]["data_offsets"][0]
    with torch.no_grad():
        pm.fc.weight.add_(1.0)  # differs from the file: a write would show
        pm.get_buffer("mask").fill_(True)
    x = torch.randn(3, 4)
    before, out = _snapshot(pm), pm(x)
    _write_header(file, header, data[:begin] + b"\x02" + data[begin + 1 :])
    with pytest.raises(CheckpointError, match="'mask' is BOOL but 1 of its bytes are neither 0 nor 1") as error:
        dpcompile.load_checkpoint(pm, tmp_path)
    assert error.value.file == file and error.value.key == "mask"
    _unchanged(pm, before)
    assert torch.equal(pm(x), out)
    _write_header(file, header, data[:begin] + b"\x01" + data[begin + 1 :])
    dpcompile.load_checkpoint(pm, tmp_path)
    assert pm.get_buffer("mask").view(torch.uint8).tolist() == [1, 0, 1, 1]


class Indexed(nn.Module):
    """An int8 buffer beside a linear."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("offset", torch.tensor([1, -2, 3], dtype=torch.int8))

    def forward(self, x):
        return self.fc(x) + self.offset.sum()


def test_integers_the_models_dtype_cannot_hold_are_refused_before_any_write(tmp_path):
    """An int64 checkpoint tensor into an int8 buffer: values in int8's range load (cast), one outside it is a
    CheckpointError naming file and key, the program unchanged, from safetensors and from DCP. Before, 300 was
    wrapped to 44 silently."""
    pm = dpcompile.transform(Indexed(), ["cpu"] * 2, example_inputs=(torch.randn(2, 4),))
    state = {k: v.detach().clone() for k, v in pm.state_dict().items()}
    file = tmp_path / "model.safetensors"
    save_file({**state, "offset": torch.tensor([100, -128, 7])}, file)
    dpcompile.load_checkpoint(pm, file)
    assert pm.get_buffer("offset").tolist() == [100, -128, 7]
    before = _snapshot(pm)
    save_file({**state, "offset": torch.tensor([300, 0, 0])}, file)
    with pytest.raises(CheckpointError, match=r"'offset' is torch.int64 with 1 value\(s\) outside the model's torch.int8") as error:
        dpcompile.load_checkpoint(pm, file)
    assert error.value.file == file and error.value.key == "offset"
    _unchanged(pm, before)
    import torch.distributed.checkpoint as dcp  # the same tensor in a torch.distributed.checkpoint folder

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": {**state, "offset": torch.tensor([300, 0, 0])}}, checkpoint_id=tmp_path / "dcp", no_dist=True)
        with pytest.raises(CheckpointError, match=r"'model.offset' is torch.int64 with 1 value\(s\) outside") as error:
            dpcompile.load_checkpoint(pm, tmp_path / "dcp")
    assert error.value.file.name == "__0_0.distcp"
    _unchanged(pm, before)


UNCLOSED = {  # JSON whose strings never close, a lone backslash last
    "quote_backslash_pairs": lambda n: "{" + '"\\' * n,
    "escaped_quotes": lambda n: '{"x": "' + 'y\\"' * n + "\\",
    "backslash_run": lambda n: '{"a": "' + "\\" * (2 * n + 1),
}


@pytest.mark.parametrize("make", UNCLOSED.values(), ids=UNCLOSED)
def test_a_header_of_unclosed_escapes_is_refused_in_one_pass(make, tmp_path):
    """The nesting bound scans strings with a pattern whose every attempt succeeds: a 40 KB header of
    escapes is refused at once (a backtracking pattern retried from each quote: ~20 s here, 30 minutes
    at 400 KB), and every quote of such a text starts a match."""
    from dpcompile.checkpoint import headers

    small = make(500)
    assert all(headers._STRING.match(small, i) for i, c in enumerate(small) if c == '"')
    text = make(20000)
    file = tmp_path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", len(text)) + text.encode())
    with pytest.raises(CheckpointError, match="not valid JSON") as error:
        dpcompile.load_checkpoint(_meta_program(), file)
    assert error.value.file == file


def test_a_header_or_index_of_packed_empty_lists_is_refused_in_a_few_times_its_size(tmp_path):
    """``[],[],...`` (a list or object every 3 bytes; each ~64 bytes parsed) within the 100 MB a header
    may hold: refused before parsing, and the nesting scan itself holds a few times the text (it kept
    a piece per bracket: 20 MB took 548 MB and a parse would have taken 550 more). A deep bracket run
    across the scan's chunks is counted whole."""
    import tracemalloc

    from dpcompile.checkpoint import headers

    assert headers.json_brackets("[" * 1_500_000 + "]" * 1_500_000) == (1_500_000, 1_500_000)
    text = '{"a": [' + ",".join(["[]"] * 700_000) + "]}"
    file = tmp_path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", len(text)) + text.encode())
    pm = _meta_program()
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="lists and objects in .* bytes, more than one per 8") as error:
            dpcompile.load_checkpoint(pm, file)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert error.value.file == file and peak < 6 * len(text), peak / len(text)
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    index.parent.mkdir()
    index.write_text('{"metadata": [' + ",".join(["{}"] * 5000) + '], "weight_map": {}}')
    with pytest.raises(CheckpointError, match="lists and objects") as error:
        dpcompile.load_checkpoint(pm, index.parent)
    assert error.value.file == index and pm.needs_weights


def _sharded(tmp_path) -> None:
    real = dpcompile.transform(_trained(), ["cpu"] * 2)
    dpcompile.save_checkpoint(real, tmp_path, max_shard_size=200)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2


@pytest.mark.parametrize(
    "index",
    [
        "{not json", "[1, 2]", "7", '{"weight_map": [1]}', '{"weight_map": {"fc.weight": 3}}',
        '{"weight_map": {"fc.weight": {"file": "x"}}}', "[" * 5000 + "]" * 5000,
        '{"metadata": ' + "[" * 200 + "]" * 200 + ', "weight_map": {}}',
        '{"weight_map": {"fc.weight": "../outside.safetensors"}}',
        '{"weight_map": {"fc.weight": "/etc/passwd"}}',
        '{"weight_map": {"fc.weight": "link.safetensors"}}',
        '{"weight_map": {"fc.weight": "model-00001-of-00009.safetensors", "fc.weight": "model-00002-of-00009.safetensors"}}',
        '{"weight_map": {"fc.weight": "model\\u0000.safetensors"}}', '{"weight_map": {"fc.weight": "\\ud800.safetensors"}}',
    ],
    ids=["malformed", "list", "int", "map_list", "map_int", "map_dict", "deep", "deep_metadata", "parent", "absolute",
         "symlink", "duplicate_key", "nul_in_name", "surrogate_name"],  # the last two: a bare ValueError before
)  # fmt: skip
def test_a_bad_index_is_a_checkpoint_error_naming_it(index, tmp_path):
    """Malformed, the wrong type, nested too deep, naming files outside the folder or through a link: refused, named."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    _sharded(folder)
    first = sorted(folder.glob("model-*.safetensors"))[0]
    (tmp_path / "outside.safetensors").write_bytes(first.read_bytes())
    os.symlink(tmp_path / "outside.safetensors", folder / "link.safetensors")
    (folder / "model.safetensors.index.json").write_text(index)
    pm = dpcompile.transform(_trained(), ["cpu"] * 2)
    before = _snapshot(pm)
    with pytest.raises(CheckpointError) as error:
        dpcompile.load_checkpoint(pm, folder, strict=False)
    assert error.value.file is not None and error.value.file.name in str(error.value)
    _unchanged(pm, before)


@pytest.mark.parametrize("fault", ["missing_file", "key_not_in_its_file", "key_in_two_files", "file_not_in_index"])
def test_a_shard_set_that_disagrees_with_its_index_is_named(fault, tmp_path):
    """The index and the shards' headers must agree: each key in the file the index names, in one file only."""
    from safetensors.torch import save_file

    _sharded(tmp_path)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    files = sorted(tmp_path.glob("model-*.safetensors"))
    if fault == "missing_file":
        files[1].unlink()
    elif fault == "key_not_in_its_file":
        index["weight_map"]["fc.weight"] = files[0].name if index["weight_map"]["fc.weight"] != files[0].name else files[1].name
    elif fault == "key_in_two_files":
        save_file({"fc.bias": torch.zeros(6), "other": torch.zeros(1)}, str(tmp_path / "extra.safetensors"))
        index["weight_map"]["other"] = "extra.safetensors"
    elif fault == "file_not_in_index":  # a file the index names holds a key the index does not
        save_file({"fc.bias": torch.zeros(6), "stray": torch.zeros(1)}, str(tmp_path / "extra.safetensors"))
        index["weight_map"]["fc.bias"] = "extra.safetensors"
    index_file.write_text(json.dumps(index))
    pm = dpcompile.transform(_trained(), ["cpu"] * 2)
    with pytest.raises(CheckpointError) as error:
        dpcompile.load_checkpoint(pm, tmp_path)
    assert error.value.file is not None and error.value.file.name in str(error.value)
    if fault != "missing_file":
        assert error.value.key in str(error.value)


@pytest.mark.parametrize("shape", [[1], [3]], ids=["broadcastable", "wrong_size"])
def test_a_non_persistent_buffer_of_another_shape_is_refused_before_any_write(shape, tmp_path):
    """A [1] or [3] buffer for the model's [4]: neither broadcast nor half-loaded; nothing of pm changes."""
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.ones(4, 4), "fc.bias": torch.ones(4), "scale": torch.full(shape, 5.0)},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    pm = _meta_program(Buffered)
    with torch.no_grad():
        for t in [*pm.parameters(), *pm.buffers()]:
            t.fill_(0.25)
    before = _snapshot(pm)
    with pytest.raises(CheckpointError, match=re.escape(f"'scale': checkpoint {shape}, model [4]")) as error:
        dpcompile.load_checkpoint(pm, tmp_path)
    assert error.value.key == "scale" and error.value.file.name == "model.safetensors"
    _unchanged(pm, before)
    assert pm.needs_weights


def test_a_failed_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    """A save that fails on its second shard: the previous index and shards untouched, no temporary file left."""
    import dpcompile.checkpoint.save as save

    old = _trained()
    dpcompile.save_checkpoint(dpcompile.transform(old, ["cpu"] * 2), tmp_path, max_shard_size=200)
    files_before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    new = Scaled()
    real_write, calls = save.write_safetensors, []

    def failing(path, entries, make, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_write(path, entries, make, metadata)

    monkeypatch.setattr(save, "write_safetensors", failing)
    with pytest.raises(OSError, match="disk full"):
        dpcompile.save_checkpoint(dpcompile.transform(new, ["cpu"] * 2), tmp_path, max_shard_size=200)
    assert calls[0].parent == tmp_path and calls[0].name.startswith(".")  # written beside, under another name
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files_before
    pm = _meta_program()
    dpcompile.load_checkpoint(pm, tmp_path)
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(pm(x), old(x))


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_a_save_whose_switch_fails_midway_leaves_the_previous_checkpoint(fmt, tmp_path, monkeypatch):
    """The second rename into place fails (an I/O error): the files renamed before it are put back,
    the staged ones removed, so the folder is byte for byte the previous save and loads as it (was: a
    mix of the two saves' shards that loaded; a DCP checkpoint left aside under ``.<name>.<token>.old``)."""
    old = _trained()
    folder = tmp_path / "ckpt"
    dpcompile.save_checkpoint(dpcompile.transform(old, ["cpu"] * 2), folder, max_shard_size=200, format=fmt)
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    real_replace, calls = os.replace, []

    def failing(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="Input/output error"):
        dpcompile.save_checkpoint(dpcompile.transform(Scaled(), ["cpu"] * 2), folder, max_shard_size=200, format=fmt)
    monkeypatch.undo()
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    pm = _meta_program()
    dpcompile.load_checkpoint(pm, folder)
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(pm(x), old(x))


def test_a_save_replaces_links_and_stale_files_instead_of_following_them(tmp_path):
    """A link at a final name is replaced, its target untouched; a one-file save over a sharded one drops the old index."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    model = _trained()
    dpcompile.save_checkpoint(dpcompile.transform(model, ["cpu"] * 2), folder, max_shard_size=200)
    outside = tmp_path / "precious.safetensors"
    outside.write_bytes(b"keep me")
    os.symlink(outside, folder / "model.safetensors")
    dpcompile.save_checkpoint(dpcompile.transform(model, ["cpu"] * 2), folder)
    assert outside.read_bytes() == b"keep me"
    assert not (folder / "model.safetensors").is_symlink()
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors"]
    pm = _meta_program()
    dpcompile.load_checkpoint(pm, folder)
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(pm(x), model(x))


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["data_parallel", "tensor_parallel"])
def test_load_state_dict_of_every_key_fills_a_meta_program(tensor_parallel):
    """pm.load_state_dict(full) clears needs_weights (outputs equal eager); a partial one leaves it set."""
    eager = _trained()
    pm = _meta_program(tensor_parallel=tensor_parallel)
    partial = dict(eager.state_dict())
    partial.pop("fc.bias")
    pm.load_state_dict(partial, strict=False)
    assert pm.needs_weights
    pm.load_state_dict(eager.state_dict())
    assert not pm.needs_weights
    x = torch.randn(3, 3, 6, 6)
    torch.testing.assert_close(pm(x), eager(x))


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["data_parallel", "tensor_parallel"])
def test_a_meta_program_is_not_pickled_before_its_weights_are_loaded(tensor_parallel):
    """torch.save / deepcopy of a program still waiting for its weights is refused naming load_checkpoint
    (unpickled, needs_weights was False and calls ran on uninitialised memory); loaded, it round-trips."""
    import copy
    import io

    from dpcompile.modules.weights import WeightsNotLoadedError

    pm = _meta_program(tensor_parallel=tensor_parallel)
    for save in (lambda: torch.save(pm, io.BytesIO()), lambda: copy.deepcopy(pm)):
        with pytest.raises(WeightsNotLoadedError, match="load_checkpoint"):
            save()
    assert pm.needs_weights
    eager = _trained()
    pm.load_state_dict(eager.state_dict())
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    x = torch.randn(3, 3, 6, 6)
    assert not restored.needs_weights
    torch.testing.assert_close(restored(x), eager(x))


def test_load_checkpoint_refuses_a_linked_file_unless_allowed(tmp_path):
    """model.safetensors as a link (the Hugging Face cache's layout): refused by default, read with allow_symlinks=True."""
    model = _trained()
    dpcompile.save_checkpoint(dpcompile.transform(model, ["cpu"] * 2), tmp_path / "blob.safetensors")
    (tmp_path / "snapshot").mkdir()
    os.symlink(tmp_path / "blob.safetensors", tmp_path / "snapshot" / "model.safetensors")
    pm = _meta_program()
    with pytest.raises(CheckpointError, match="allow_symlinks=True"):
        dpcompile.load_checkpoint(pm, tmp_path / "snapshot")
    dpcompile.load_checkpoint(pm, tmp_path / "snapshot", allow_symlinks=True)
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(pm(x), model(x))


def _transformers():
    from tests.thirdparty import import_or_skip

    return import_or_skip("transformers")


def test_legacy_layernorm_gamma_beta_names_load_and_an_unplaceable_key_is_named(tmp_path):
    """LayerNorm.gamma/beta (transformers' legacy names) fill LayerNorm.weight/bias, as from_pretrained
    maps them, in a PreTrainedModel; a key nothing maps is named."""
    from safetensors.torch import save_file

    T = _transformers()

    class TinyConfig(T.PretrainedConfig):
        model_type = "dpcompile_tiny"

    class Tiny(T.PreTrainedModel):
        config_class = TinyConfig

        def __init__(self, config):
            super().__init__(config)
            self.fc = nn.Linear(4, 4)
            self.LayerNorm = nn.LayerNorm(4)
            self.post_init()

        def forward(self, x):
            return self.LayerNorm(self.fc(x))

    torch.manual_seed(0)
    eager = Tiny(TinyConfig())
    with torch.no_grad():
        eager.LayerNorm.weight.uniform_(), eager.LayerNorm.bias.uniform_()
    legacy = {"fc.weight": eager.fc.weight, "fc.bias": eager.fc.bias,
              "LayerNorm.gamma": eager.LayerNorm.weight, "LayerNorm.beta": eager.LayerNorm.bias}  # fmt: skip
    save_file({k: v.detach().clone() for k, v in legacy.items()}, str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = Tiny(TinyConfig())
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(torch.randn(2, 4),))
    dpcompile.load_checkpoint(pm, tmp_path)
    x = torch.randn(3, 4)
    torch.testing.assert_close(pm(x), eager(x))
    save_file({**{k: v.detach().clone() for k, v in legacy.items()}, "mystery.weight": torch.zeros(2)},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    with pytest.raises(CheckpointError, match=r"does not have: 'mystery.weight'.*from_pretrained maps") as error:
        dpcompile.load_checkpoint(pm, tmp_path)
    assert error.value.key == "mystery.weight"


@pytest.mark.slow  # two transformers models through torch.export: ~20 s on 2 cores
@pytest.mark.parametrize("name", ["vit", "mixtral"])
def test_save_pretrained_folders_with_legacy_keys_load_into_a_meta_program(name, tmp_path):
    """ViT (attention.attention.query → q_proj) and Mixtral (per-expert w1/w3 stacked into gate_up_proj),
    as save_pretrained writes them, load into a meta program (tensor parallel for Mixtral) with outputs equal eager."""
    T = _transformers()
    if name == "vit":
        config = T.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                             image_size=8, patch_size=4)  # fmt: skip
        make, kwargs, out = (lambda: T.ViTModel(config)), {"pixel_values": torch.randn(2, 3, 8, 8)}, "last_hidden_state"
    else:
        config = T.MixtralConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=32, vocab_size=50, num_local_experts=3)  # fmt: skip
        make, kwargs, out = (lambda: T.MixtralForCausalLM(config)), {"input_ids": torch.randint(0, 50, (2, 5))}, "logits"
    torch.manual_seed(0)
    eager = make().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager.save_pretrained(tmp_path)
        from safetensors import safe_open

        with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
            assert set(f.keys()) - set(eager.state_dict())  # legacy names: not the model's own keys
        with torch.device("meta"):
            model = make().eval()
        pm = dpcompile.transform(model, ["cpu"] * 2, example_kwargs=kwargs)
    dpcompile.load_checkpoint(pm, tmp_path)
    torch.testing.assert_close(pm(**kwargs)[out], eager(**kwargs)[out])


def test_key_mapping_renames_checkpoint_keys_as_from_pretrained_takes_it(tmp_path):
    """key_mapping={regex: replacement} places keys saved under other names; without it they are named."""
    from safetensors.torch import save_file

    eager = _trained()
    save_file({k.replace("fc.", "head.proj."): v.clone() for k, v in eager.state_dict().items()},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    pm = _meta_program()
    with pytest.raises(CheckpointError, match=r"does not have: 'head.proj.bias', 'head.proj.weight'"):
        dpcompile.load_checkpoint(pm, tmp_path)
    dpcompile.load_checkpoint(pm, tmp_path, key_mapping={r"^head\.proj\.": "fc."})
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(pm(x), eager(x))


class _LinearNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.bn = nn.Linear(8, 16), nn.Linear(16, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc2(torch.relu(self.fc1(x))))


@pytest.mark.parametrize("mesh", [{"dp": 2}, {"tp": 2}], ids=["dp2", "tp2"])
def test_a_partial_load_into_a_meta_program_waits_for_the_rest(tmp_path, mesh):
    """``strict=False`` from a file lacking a parameter and a buffer: on a program built on meta they have no
    values, so it still needs weights and a call is refused naming them, until a second load fills them. Before,
    the program ran on uninitialised memory (under tp an output of 1e10)."""
    torch.manual_seed(0)
    reference, x = _LinearNorm().eval(), torch.randn(4, 8)
    with torch.no_grad():
        reference.bn.running_var.uniform_(0.5, 2.0)
    state = reference.state_dict()
    rest = ("fc2.bias", "bn.running_var")
    save_file({k: v for k, v in state.items() if k not in rest}, tmp_path / "base.safetensors")
    save_file({k: state[k].contiguous() for k in rest}, tmp_path / "rest.safetensors")
    with torch.device("meta"):
        model = _LinearNorm()
    pm = dpcompile.transform(model, ["cpu"] * 2, mesh=mesh, example_inputs=(x,)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dpcompile.load_checkpoint(pm, tmp_path / "base.safetensors", strict=False)
    assert pm.needs_weights
    with pytest.raises(dpcompile.DpCompileError, match=r"did not hold 'fc2\.bias', 'bn\.running_var'"):
        pm(x)
    dpcompile.load_checkpoint(pm, tmp_path / "rest.safetensors", strict=False)
    assert not pm.needs_weights
    torch.testing.assert_close(pm(x), reference(x))
    for key, value in pm.state_dict().items():
        torch.testing.assert_close(value, state[key], msg=key)


def test_two_partial_load_state_dicts_fill_a_meta_program():
    """``pm.load_state_dict(strict=False)`` twice, each with part of the keys: the second completes it. Before, a
    load with any key missing left the program waiting for weights for good."""
    torch.manual_seed(0)
    reference, x = _LinearNorm().eval(), torch.randn(4, 8)
    state = reference.state_dict()
    with torch.device("meta"):
        model = _LinearNorm()
    pm = dpcompile.transform(model, ["cpu"] * 2, mesh={"tp": 2}, example_inputs=(x,)).eval()
    pm.load_state_dict({k: v for k, v in state.items() if not k.startswith("bn.")}, strict=False)
    with pytest.raises(dpcompile.DpCompileError, match=r"did not hold 'bn\.weight'"):
        pm(x)
    pm.load_state_dict({k: v for k, v in state.items() if k.startswith("bn.")}, strict=False)
    assert not pm.needs_weights
    torch.testing.assert_close(pm(x), reference(x))


class TiedHead(nn.Module):
    """An LM head tied to the embedding: ``state_dict`` holds both keys, one tensor."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["dp", "tp"])
def test_tied_weight_held_twice_with_different_values_is_refused(tmp_path, tensor_parallel):
    torch.manual_seed(0)
    eager, ids = TiedHead(), torch.randint(0, 10, (4, 3))
    pm = dpcompile.transform(TiedHead(), ["cpu", "cpu"], tensor_parallel=tensor_parallel, example_inputs=(ids,))
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    weight = eager.emb.weight.detach()
    save_file({"emb.weight": weight.clone(), "head.weight": weight + 1}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'emb\.weight'.*'head\.weight'.*ties.*different values") as e:
        dpcompile.load_checkpoint(pm, tmp_path)
    assert e.value.file.name == "model.safetensors" and e.value.key == "head.weight"
    assert all(torch.equal(pm.state_dict()[k], v) for k, v in before.items())  # nothing was loaded
    # both keys with equal values (what torch.save(model.state_dict()) holds) load, and the tie holds
    save_file({"emb.weight": weight.clone(), "head.weight": weight.clone()}, tmp_path / "model.safetensors")
    dpcompile.load_checkpoint(pm, tmp_path)
    torch.testing.assert_close(pm(ids), eager(ids))
    assert torch.equal(pm.state_dict()["head.weight"], weight)


@pytest.mark.parametrize("name", ["model.safetensors.index.json", "model.safetensors", "training_state.json"])
def test_a_save_onto_a_folder_at_a_file_name_is_refused_changing_nothing(tmp_path, name):
    """A folder where the save renames a file (or removes the previous save's index) raised
    IsADirectoryError; for the index, after the new files were renamed in beside it."""
    torch.manual_seed(0)
    pm = dpcompile.transform(nn.Linear(4, 4), ["cpu", "cpu"])
    folder = tmp_path / "ckpt"
    dpcompile.save_checkpoint(pm, folder, max_shard_size=40 if "index" in name else "5GB")  # the index: shards
    if (folder / name).exists():
        (folder / name).unlink()
    (folder / name).mkdir()
    before = sorted((p.name, p.is_dir(), p.stat().st_mtime_ns) for p in folder.iterdir())
    optimizer = torch.optim.SGD(pm.parameters(), lr=0.1)
    with pytest.raises(dpcompile.ArgumentError, match=rf"{re.escape(name)} is a folder where the checkpoint has a file"):
        dpcompile.save_checkpoint(pm, folder, optimizer=optimizer)
    assert sorted((p.name, p.is_dir(), p.stat().st_mtime_ns) for p in folder.iterdir()) == before


def test_a_megabyte_key_makes_an_error_of_a_few_kilobytes_naming_the_file(tmp_path):
    """A key read from the file went into the message whole: a 1 MB key, a 1 MB error (in every log)."""
    pm = dpcompile.transform(nn.Linear(4, 4), ["cpu", "cpu"])
    key = "weight" + "." * 1_000_000
    save_file({"weight": torch.zeros(4, 4), "bias": torch.zeros(4)}, tmp_path / "a.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"weight": "a.safetensors", "bias": "a.safetensors", key: "a.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"characters cut") as error:
        dpcompile.load_checkpoint(pm, tmp_path)
    message = str(error.value)
    assert len(message) < 4100 and str(index) in message and message.endswith("to a.safetensors, which does not hold it")


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["dp", "tp"])
def test_tied_weight_held_twice_with_different_values_in_a_dcp_folder_is_refused(tmp_path, tensor_parallel):
    """torch's dcp.save of a state_dict writes both tied keys; the second's values were dropped."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    eager, ids = TiedHead(), torch.randint(0, 10, (4, 3))
    pm = dpcompile.transform(TiedHead(), ["cpu", "cpu"], tensor_parallel=tensor_parallel, example_inputs=(ids,))
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    weight = eager.emb.weight.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": {"emb.weight": weight.clone(), "head.weight": weight + 1}}, checkpoint_id=tmp_path / "bad", no_dist=True)
        dcp.save({"model": {"emb.weight": weight.clone(), "head.weight": weight.clone()}}, checkpoint_id=tmp_path / "ok", no_dist=True)
        with pytest.raises(CheckpointError, match=r"'model\.emb\.weight' and 'model\.head\.weight' fill keys the model ties") as e:
            dpcompile.load_checkpoint(pm, tmp_path / "bad")
        assert e.value.file == tmp_path / "bad" and e.value.key == "model.head.weight"
        assert all(torch.equal(pm.state_dict()[k], v) for k, v in before.items())
        dpcompile.load_checkpoint(pm, tmp_path / "ok")
    torch.testing.assert_close(pm(ids), eager(ids))
