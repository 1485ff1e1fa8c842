"""Issue 29, export review: module.py shows every program a folder can run (the traced
variants and the captured program included), ops taking explicit strides stay within their
input, every JSON reader bounds its nesting, and export never follows a link planted at its
temporary files. Crafted folders are written as an attacker would (rehashed manifest)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile.export import ExportError, read_manifest
from dpcompile.export.integrity import BYTES_PER_CONTAINER, MAX_NESTING, brackets, nesting, read_json
from tests.tools.export_attacks import call, insert_before_output, rehash, write_program


class Dropping(nn.Module):
    """Dropout reading self.training and an optional mask: variants (eval, mask None) and their traces."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, x, mask=None):
        h = F.dropout(torch.relu(self.fc(x)), 0.5, self.training)
        if mask is not None:
            h = h * mask
        return self.out(h)


class Strided(nn.Module):
    """as_strided on a parameter and on the (gathered) input, within each."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        w = self.w.as_strided((2, 4), (1, 4))
        y = torch.as_strided(x, (4, 2), (8, 1), 2)
        return y @ w + 1


def _program(folder):
    return json.loads((folder / "program.json").read_text())


def _methods(text):
    return re.findall(r"^    def (\w+)\(", text, flags=re.M)


@pytest.fixture(scope="module")
def dropping(tmp_path_factory):
    torch.manual_seed(0)
    model = Dropping()
    folder = dpcompile.export(dpcompile.transform(model, ["cpu", "cpu"]), tmp_path_factory.mktemp("dropping") / "out")
    return model.eval(), folder


def _copy(folder, tmp_path):
    import shutil

    return shutil.copytree(folder, tmp_path / "copy")


# ------------------------------------------------------------------ 1. module.py shows every program
def test_module_py_shows_every_program_the_folder_can_run(dropping):
    """Each graph of program.json (main, variants, captured, traces) is a method of module.py."""
    _, folder = dropping
    data = _program(folder)["data"]
    graphs = 1 + sum(v["graph"] is not None for v in data["variants"]) + (data["captured"] is not None)
    graphs += sum(t["graph"] is not None for t in data["traces"])
    methods = _methods((folder / "module.py").read_text())
    assert len(methods) == graphs and len(set(methods)) == graphs, methods
    assert {"forward", "forward_eval_mask_none", "captured", "traced_eval_mask_none"} <= set(methods)


def _edit_trace(program, target="torch.sigmoid"):
    """Swap relu for another op in the trace a small eval batch without mask lowers (never in the main program)."""
    trace = next(t for t in program["data"]["traces"] if t["key"]["none_args"] == ["mask"] and t["graph"] is not None)
    node = next(n for n in trace["graph"]["nodes"] if n["target"] == "torch.relu")
    node["target"] = target


def test_a_trace_edited_in_program_json_alone_is_refused(dropping, tmp_path):
    """Before: a batch smaller than the devices ran an edited trace module.py never showed."""
    _, folder = dropping
    folder = _copy(folder, tmp_path)
    program = _program(folder)
    _edit_trace(program)
    (folder / "program.json").write_text(json.dumps(program))
    rehash(folder)  # module.py kept as it was
    with pytest.raises(ExportError, match="module.py is not the program in program.json"):
        dpcompile.load(folder)


def test_a_trace_edited_and_shown_in_module_py_runs_as_shown(dropping, tmp_path):
    """Regenerated, module.py shows the edit (torch.sigmoid in traced_eval_mask_none), and that is what runs."""
    model, folder = dropping
    folder = _copy(folder, tmp_path)
    program = _program(folder)
    _edit_trace(program)
    write_program(folder, program)
    text = (folder / "module.py").read_text()
    traced = text[text.index("def traced_eval_mask_none(") :]
    assert "torch.sigmoid(" in traced.split("\n\n")[0]
    loaded = dpcompile.load(folder).eval()
    x = torch.randn(1, 6)  # one row on two devices: the trace is lowered for one
    want = model.out(torch.sigmoid(model.fc(x)))
    torch.testing.assert_close(loaded(x), want)


def test_a_trace_method_edited_in_module_py_is_refused(dropping, tmp_path):
    _, folder = dropping
    folder = _copy(folder, tmp_path)
    text = (folder / "module.py").read_text()
    start = text.index("def traced_eval_mask_none(")
    edited = text[:start] + text[start:].replace("torch.relu(", "torch.sigmoid(", 1)
    assert edited != text
    (folder / "module.py").write_text(edited)
    rehash(folder)
    with pytest.raises(ExportError, match="module.py is not the program"):
        dpcompile.load(folder)


@pytest.mark.parametrize("label", ["forward", "captured", "traced_eval"])
def test_a_variant_named_like_another_method_is_refused(dropping, tmp_path, label):
    """A variant labelled as another method (two `def forward`: the last would win) is refused."""
    _, folder = dropping
    folder = _copy(folder, tmp_path)
    program = _program(folder)
    next(v for v in program["data"]["variants"] if v["graph"] is not None)["label"] = label
    write_program(folder, program)  # module.py regenerated where dpcompile still would
    with pytest.raises(ExportError, match="variant labelled|share a method name"):
        dpcompile.load(folder)


# ------------------------------------------------------------ 2. explicit strides within the input
def test_as_strided_within_its_input_loads_and_matches_eager(tmp_path):
    """A legitimate program with as_strided (a parameter, the input) is data, loads on 2 and 4
    devices with eager's outputs, and module.py shows the bounded call that runs."""
    torch.manual_seed(0)
    model = Strided()
    x = torch.randn(4, 8)
    folder = dpcompile.export(dpcompile.transform(model, ["cpu", "cpu"]), tmp_path / "out")
    assert not (folder / "program.pkl").exists()
    assert "dpcompile_export_strided_as_strided(" in (folder / "module.py").read_text()
    for devices in (None, ["cpu"] * 4):
        torch.testing.assert_close(dpcompile.load(folder, devices=devices)(x), model(x))
    again = dpcompile.export(dpcompile.load(folder), tmp_path / "again")  # stored as the op, loads again
    assert "as_strided.default" in (again / "program.json").read_text()
    torch.testing.assert_close(dpcompile.load(again)(x), model(x))


class ChildNamedAsStrided(nn.Module):
    def __init__(self):
        super().__init__()
        self.as_strided = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.as_strided(x))


def test_a_child_module_named_as_strided_is_called_as_a_module(tmp_path):
    """Only a Tensor's as_strided is bounded: replicas calling a child of that name run it."""
    torch.manual_seed(0)
    model = ChildNamedAsStrided()
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    assert ".as_strided(" in pm.code or 'getattr(replica_dev0, "as_strided")' in pm.code
    folder = dpcompile.export(pm, tmp_path / "out")
    x = torch.randn(6, 4)
    torch.testing.assert_close(dpcompile.load(folder)(x), model(x))


@pytest.fixture
def linear_folder(tmp_path):
    torch.manual_seed(0)
    return dpcompile.export(dpcompile.transform(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), ["cpu", "cpu"]), tmp_path / "out")


_READS = [
    ("call_function", "torch.as_strided", (), {}),
    ("call_function", "torch.Tensor.as_strided", (), {}),
    ("call_function", "torch.ops.aten.as_strided.default", (), {}),
    ("call_method", "as_strided", (), {}),
    ("call_function", "torch.as_strided_copy", (), {}),
    ("call_function", "torch.ops.aten.as_strided_.default", (), {}),
    ("call_function", "torch.as_strided", (), {"keywords": True}),
]


@pytest.mark.parametrize("op,target,extra,how", _READS, ids=[f"{t}{'-kw' if h else ''}" for _, t, _, h in _READS])
def test_crafted_as_strided_reading_beyond_its_input_raises_at_run_time(linear_folder, op, target, extra, how):
    """A rehashed folder viewing the caller's memory around its chunk (rows 2..7 of a tensor whose
    first 4 rows it was given) raises when called; the caller's other rows never come back."""
    folder = linear_folder
    program = _program(folder)
    args = [{"node": "input_1_dev0"}, {"tuple": [8, 4]}, {"tuple": [4, 1]}, 0]
    node = call("peek", op, target, *args)
    if how.get("keywords"):
        node = call("peek", op, target, args[0], size=args[1], stride=args[2], storage_offset=0)
    insert_before_output(program, node)
    write_program(folder, program)
    loaded = dpcompile.load(folder)  # it is data: the check is at run time, on the input it is given
    big = torch.arange(64.0).reshape(16, 4)
    with pytest.raises(dpcompile.DpCompileError, match="reaches elements outside its input"):
        loaded(big[:4])


def test_crafted_as_strided_scatter_beyond_its_input_raises_and_within_it_computes(linear_folder):
    folder = linear_folder
    program = _program(folder)
    insert_before_output(
        program,
        call("src", "call_function", "torch.zeros", {"tuple": [2, 4]}),
        call("put", "call_function", "torch.as_strided_scatter", {"node": "input_1_dev0"}, {"node": "src"},
             {"tuple": [2, 4]}, {"tuple": [4, 1]}, 8),  # fmt: skip
    )
    write_program(folder, program)
    big = torch.arange(64.0).reshape(16, 4)
    with pytest.raises(dpcompile.DpCompileError, match="as_strided_scatter: the view"):
        dpcompile.load(folder)(big[:4])  # offset 8: rows 2..3, the other device's chunk
    program["data"]["graph"]["nodes"][-2]["args"]["tuple"][-1] = 0  # rows 0..1: the chunk itself
    write_program(folder, program)
    _, put = dpcompile.load(folder)(big[:4])
    torch.testing.assert_close(put, torch.zeros(2, 4))


def test_every_strided_view_of_the_vocabulary_is_bounded():
    """Each vocabulary name of an op viewing memory by explicit strides is swapped on load."""
    from dpcompile.export.strided import strided_ops
    from dpcompile.export.vocabulary import vocabulary

    bounded = [fn for fn, _ in strided_ops()]
    views = [n for n in vocabulary() if "strided" in n and "empty_strided" not in n]
    assert len(views) == 11 and all(any(vocabulary()[n] is fn for fn in bounded) for n in views), views


def test_strided_check_counts_elements_not_the_span():
    """A column of a matrix spans the other columns too: a view onto them is refused; its own
    elements, an empty view and an expanded (stride 0) input's own element are fine."""
    from dpcompile.export.strided import as_strided, check_view

    m = torch.arange(12.0).reshape(3, 4)
    column = m[:, 1]
    torch.testing.assert_close(as_strided(column, (3,), (4,)), column)
    with pytest.raises(dpcompile.DpCompileError, match="outside its input"):
        as_strided(column, (2,), (1,))  # m[0, 1], m[0, 2]: inside the span, not the column
    check_view("as_strided", column, (0, 5), (1, 1), 100)  # empty: reaches nothing
    expanded = m[0, :1].expand(5, 3)
    torch.testing.assert_close(as_strided(expanded, (2,), (0,)), torch.zeros(2))
    with pytest.raises(dpcompile.DpCompileError, match="outside its input"):
        as_strided(expanded, (2,), (1,))


# --------------------------------------------------------------------------- 3. bounded nesting
@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 100_000])
def test_deeply_nested_manifest_is_refused_naming_the_file(linear_folder, depth):
    """A manifest nested past the bound is an ExportError naming manifest.json (before: RecursionError)."""
    folder = linear_folder
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["program"]["class_name"] = "NESTED"
    text = json.dumps(manifest).replace('"NESTED"', "[" * depth + "]" * depth)
    (folder / "manifest.json").write_text(text)
    with pytest.raises(ExportError, match=rf"manifest.json nests lists and objects {depth + 2} deep"):
        dpcompile.load(folder)
    with pytest.raises(ExportError, match="manifest.json nests"):
        read_manifest(folder)


def test_deeply_nested_program_is_refused_naming_the_file(linear_folder):
    folder = linear_folder
    program = _program(folder)
    program["data"]["graph"]["nodes"][3]["args"] = "NESTED"
    deep = '{"tuple": [' * 400 + "0" + "]}" * 400  # Python's parser reads it; the bound refuses it
    (folder / "program.json").write_text(json.dumps(program).replace('"NESTED"', deep))
    rehash(folder)
    with pytest.raises(ExportError, match="program.json nests lists and objects"):
        dpcompile.load(folder)


@pytest.mark.parametrize("file", ["manifest.json", "program.json"])
def test_a_key_named_twice_or_a_bare_nan_is_refused_naming_the_file(linear_folder, file):
    """JSON that export never writes: an object naming a key twice (Python's parser took the last:
    ``"class_name"`` twice, or ``"format_version"`` again, loaded) and a bare NaN."""
    folder = linear_folder
    text = (folder / file).read_text().rstrip()
    (folder / file).write_text(text[:-1] + ', "format_version": 2}')  # the last key of the top object again
    if file == "program.json":
        rehash(folder)
    with pytest.raises(ExportError, match=rf"{file} names the key 'format_version' twice"):
        dpcompile.load(folder)
    (folder / file).write_text(text[:-1] + ', "x": NaN}')
    if file == "program.json":
        rehash(folder)
    with pytest.raises(ExportError, match=rf"{file} cannot be read as JSON \(NaN is not JSON"):
        dpcompile.load(folder)


def test_a_weights_header_naming_a_key_twice_is_refused(linear_folder):
    """safetensors itself takes a header naming a tensor twice (its last entry); load checks the header
    as load_checkpoint does first: a key twice, offsets that overlap or leave a gap."""
    import struct

    folder = linear_folder
    data = (folder / "weights.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + n].decode().rstrip()
    entry = json.loads(header)["0.bias"]
    doubled = (header[:-1] + f', "0.bias": {json.dumps(entry)}}}').encode()
    (folder / "weights.safetensors").write_bytes(struct.pack("<Q", len(doubled)) + doubled + data[8 + n :])
    rehash(folder)
    with pytest.raises(ExportError, match=r"weights.safetensors: the safetensors header names '0.bias' twice"):
        dpcompile.load(folder)


def test_a_manifest_or_program_past_its_size_bound_is_refused_before_it_is_read(linear_folder, monkeypatch):
    """manifest.json made huge (sparse: 8 GiB read whole raised MemoryError) and a manifest listing a
    program.json past the bound: an ExportError naming the file, nothing read."""
    from dpcompile.export import integrity

    folder = linear_folder
    program_size = (folder / "program.json").stat().st_size
    monkeypatch.setattr(integrity, "MAX_PROGRAM_BYTES", program_size - 1)
    with pytest.raises(ExportError, match=rf"manifest.json lists a program.json of more than {program_size - 1} bytes"):
        dpcompile.load(folder)
    os.truncate(folder / "manifest.json", 8 << 30)
    with pytest.raises(ExportError, match=r"manifest.json is 8589934592 bytes, more than the 1048576"):
        dpcompile.load(folder)
    with pytest.raises(ValueError, match="path=5: expected a str or os.PathLike"):
        dpcompile.load(5)


UNCLOSED = {  # JSON whose strings never close, a lone backslash last
    "quote_backslash_pairs": lambda n: b"{" + b'"\\' * n,
    "escaped_quotes": lambda n: b'{"x": "' + b'y\\"' * n + b"\\",
}


@pytest.mark.parametrize("make", UNCLOSED.values(), ids=UNCLOSED)
def test_nesting_of_unclosed_escapes_is_one_pass(make, linear_folder):
    """Every quote of a text whose strings never close starts a match of the string pattern (one that
    backtracked was retried from each quote: quadratic, an hour on a 1 MiB manifest); such a manifest
    is refused naming it."""
    from dpcompile.checkpoint import headers  # the scanner export reads its JSON with

    small = make(500)
    assert all(headers._STRING_BYTES.match(small, i) for i, c in enumerate(small) if c == ord('"'))
    (linear_folder / "manifest.json").write_bytes(make(20000))
    with pytest.raises(ExportError, match="manifest.json cannot be read as JSON"):
        dpcompile.load(linear_folder)


def test_nesting_is_counted_outside_strings(tmp_path):
    assert nesting(b'{"a": ["[[[[", {"b": "\\"[{"}]}') == 3
    assert nesting(b'"[[[') == 0 and nesting(b"7") == 0
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"name": "[" * 1000}))
    assert read_json(path) == {"name": "[" * 1000}


def test_real_programs_nest_well_below_the_bound(dropping):
    _, folder = dropping
    text = (folder / "program.json").read_bytes()
    depth, containers = brackets(text)
    assert depth < MAX_NESTING // 4 and containers * BYTES_PER_CONTAINER * 3 < len(text)


def test_packed_empty_lists_are_refused_before_parsing_in_a_few_times_their_size(tmp_path):
    """``[],[],...`` (a list every 3 bytes, each ~64 bytes parsed) in a program.json: refused before
    json.loads, and the bracket scan holds a few times the text (it kept a piece per bracket, ~25
    times; 256 MB would have taken 6 GB to scan and as much to parse). A run of brackets longer
    than the scan's chunks is counted whole."""
    import tracemalloc

    assert brackets(b"[" * 100_000 + b"]" * 100_000) == (100_000, 100_000)
    path = tmp_path / "program.json"
    path.write_bytes(b'{"a": [' + b",".join([b"[]"] * 700_000) + b"]}")
    tracemalloc.start()
    try:
        with pytest.raises(ExportError, match="lists and objects in .* bytes, more than one per 8"):
            read_json(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 6 * path.stat().st_size, peak / path.stat().st_size


# ----------------------------------------------------------------- 4. no link followed on export
def test_export_never_follows_a_link_planted_at_a_temporary_name(tmp_path):
    """Links at every temporary name export uses point at files outside: export writes its own new
    files, the files outside keep their bytes, and the folder loads."""
    folder = tmp_path / "out"
    folder.mkdir()
    victims = {}
    for name in ["module.py", "program.json", "weights.safetensors", "manifest.json", "program.pkl"]:
        victim = tmp_path / f"victim-{name}"
        victim.write_text("precious")
        (folder / f".dpcompile-{name}.tmp").symlink_to(victim)
        victims[name] = victim
    pm = dpcompile.transform(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), ["cpu", "cpu"])
    dpcompile.export(pm, folder)
    assert all(v.read_text() == "precious" for v in victims.values())
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "module.py", "program.json", "weights.safetensors"]
    assert not any(p.is_symlink() for p in folder.iterdir())
    x = torch.randn(4, 4)
    torch.testing.assert_close(dpcompile.load(folder)(x), pm(x))
    umask = os.umask(0)
    os.umask(umask)
    assert (folder / "module.py").stat().st_mode & 0o777 == 0o666 & ~umask  # as a plain write makes it


def test_a_temporary_name_taken_while_export_writes_is_refused(tmp_path):
    """A link appearing at a temporary name after export cleared them (a race): refused, not followed."""
    from dpcompile.export.folder import _write_new

    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / ".dpcompile-module.py.tmp").symlink_to(victim)
    with pytest.raises(ExportError, match="appeared while export was writing"):
        _write_new(tmp_path, ".dpcompile-module.py.tmp", b"payload")
    assert victim.read_text() == "precious"
