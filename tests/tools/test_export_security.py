"""The attacks of issue 21, written as an attacker with write access to an export folder would:
edit program.json, regenerate module.py with dpcompile's own code, recompute every checksum.
Each is refused by ``dpcompile.load`` with an ``ExportError`` before anything is built, and the
marker file its payload would write never appears."""

from __future__ import annotations

import json
import types

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.export import ExportError, manifest_hash
from dpcompile.export.vocabulary import DENIED, TENSOR_METHODS, vocabulary
from dpcompile.runtime.exported import aten_op
from tests.tools.export_attacks import call, first, insert_before_output, regenerate_module_py, write_program


@pytest.fixture
def folder(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    out = dpcompile.export(dpcompile.transform(model, ["cpu", "cpu"]), tmp_path / "out")
    return out, tmp_path / "PWNED", json.loads((out / "program.json").read_text())


def _tensor(program):
    """A node whose value is a tensor: the first device's chunk of the input."""
    return next(n["name"] for n in program["data"]["graph"]["nodes"] if n["name"] == "input_1_dev0")


def _refused(folder, marker, match):
    with pytest.raises(ExportError, match=match):
        dpcompile.load(folder)
    assert not marker.exists()


def test_aten_op_never_walks_attributes():
    """aten_op resolves only a registered operator's own names: no walk to __globals__, no from_file."""
    assert aten_op("aten", "add", "Tensor") is torch.ops.aten.add.Tensor
    for names in [("__class__", "__init__", "__globals__"), ("aten", "__class__", "default"), ("aten", "add", "__call__"),
                  ("aten", "from_file", "default"), ("aten", "save", "default"), ("aten", "name", "upper")]:  # fmt: skip
        with pytest.raises(dpcompile.DpCompileError):
            aten_op(*names)


def test_attack_aten_op_to_globals_and_system_is_refused(folder):
    """aten_op("__class__", "__init__", "__globals__") then max([cmd], key=system): aten_op is no op of the vocabulary."""
    out, marker, program = folder
    x = _tensor(program)
    insert_before_output(
        program,
        call("g", "call_function", "dpcompile.runtime.exported.aten_op", "__class__", "__init__", "__globals__"),
        call("payload", "call_function", "builtins.max", [f"touch {marker}"], key={"node": "g"}),
        call("keep", "call_function", "operator.getitem", {"node": x}, 0),
    )
    write_program(out, program)
    _refused(out, marker, "aten_op.*not an op a loaded program may call")


def test_attack_aten_op_from_file_is_refused(folder):
    """aten_op("aten", "from_file", "default") cannot hand a program the op the vocabulary leaves out."""
    out, marker, program = folder
    insert_before_output(
        program,
        call("op", "call_function", "dpcompile.runtime.exported.aten_op", "aten", "from_file", "default"),
        call("read", "call_function", "builtins.max", [str(marker)], key={"node": "op"}),
    )
    write_program(out, program)
    _refused(out, marker, "aten_op.*not an op")


@pytest.mark.parametrize("target", ["torch.ops.aten.from_file.default", "torch.from_file", "torch.save", "torch.load",
                                    "torch.ops.aten.save.default", "torch.Tensor.numpy", "torch.Tensor.untyped_storage",
                                    "torch.Tensor.data_ptr", "torch.Tensor.set_", "torch.ops.aten.set_.source_Tensor",
                                    "os.system", "builtins.__import__", "torch.ops.aten.__class__.default"])  # fmt: skip
def test_attack_call_of_a_name_off_the_vocabulary_is_refused(folder, target):
    """Files, memory by address, dunders: refused by name, whatever namespace they are written in."""
    out, marker, program = folder
    x = _tensor(program)
    insert_before_output(program, call("payload", "call_function", target, {"node": x}, str(marker)))
    write_program(out, program)
    _refused(out, marker, "not an op a loaded program may call")


def test_attack_numpy_tofile_through_modules_named_like_methods_is_refused(folder):
    """A tree with modules named `numpy` and `tofile` does not make x.numpy().tofile(path) callable:
    method names are Tensor methods of the vocabulary, checked on a value, never module paths."""
    out, marker, program = folder
    root = program["modules"][0]
    root["children"] += ["numpy", "tofile"]
    for name in ("numpy", "tofile"):
        program["modules"].append({"path": name, "class": "torch.nn.modules.linear.Identity", "attrs": {}, "training": True,
                                   "parameters": {}, "buffers": {}, "non_persistent": [], "children": []})  # fmt: skip
    x = _tensor(program)
    insert_before_output(
        program,
        call("as_array", "call_method", "numpy", {"node": x}),
        call("written", "call_method", "tofile", {"node": "as_array"}, str(marker)),
    )
    write_program(out, program)
    assert regenerate_module_py(out, program)  # dpcompile's own code writes module.py for it
    _refused(out, marker, "calls method 'numpy' on a value, which is not a Tensor method")


def test_attack_module_call_on_a_tensor_is_refused(folder):
    """A module path called as a method of a tensor (the old check looked the name up in the tree)."""
    out, marker, program = folder
    x = _tensor(program)
    insert_before_output(program, call("odd", "call_method", "0", {"node": x}))
    write_program(out, program)
    _refused(out, marker, "calls method '0' on a value")


def test_attack_getattr_of_a_method_and_max_key_is_refused(folder):
    """getattr(x, "tofile") would hand the program a bound method, max(..., key=f) would call it."""
    out, marker, program = folder
    x = _tensor(program)
    insert_before_output(program, call("method", "call_function", "builtins.getattr", {"node": x}, "numpy"))
    write_program(out, program)
    _refused(out, marker, "reads attribute 'numpy' of a value")
    program = json.loads((out / "program.json").read_text())
    nodes = program["data"]["graph"]["nodes"]
    nodes[-2]["args"]["tuple"][1] = "shape"  # a data attribute: allowed; max with a key: not
    insert_before_output(
        program, call("payload", "call_function", "builtins.max", [str(marker)], key={"node": "method"})
    )
    write_program(out, program)
    _refused(out, marker, "passes keywords .*key.* to a builtin")


@pytest.mark.parametrize("fn", ["torch.save", "torch.relu", "dpcompile.runtime.exported.aten_op"])
def test_attack_function_passed_as_an_argument_is_refused(folder, fn):
    """A program calls functions, never passes them: {"fn": ...} among a node's arguments is refused."""
    out, marker, program = folder
    node = first(program, "call_function", "dpcompile.runtime.gather")
    node["args"]["tuple"][0] = [{"fn": fn}, str(marker)]
    write_program(out, program)
    _refused(out, marker, "cannot read")


def test_attack_module_handed_to_a_torch_function_is_refused(folder):
    """A module (or replica) goes only to dpcompile's runtime functions, never to torch or Python functions."""
    out, marker, program = folder
    insert_before_output(
        program, call("poke", "call_function", "operator.setitem", {"node": "_0_src"}, "x", str(marker))
    )
    write_program(out, program)
    _refused(out, marker, "hands the module '_0_src'")
    program = json.loads((out / "program.json").read_text())
    nodes = program["data"]["graph"]["nodes"]
    nodes[-2].update(target="operator.getitem", args={"tuple": [{"node": "replica_dev0"}, "0"]})
    write_program(out, program)
    _refused(out, marker, "indexes a replica")


def _written(x, view_op, write_op="fill_"):
    """``written(x, [(view_op, (0, 0, 1))], write_op, 7.0)``: ``x`` with its first row filled."""
    steps = [{"tuple": [view_op, {"tuple": [0, 0, 1]}]}]
    return call("w", "call_function", "dpcompile.runtime.written", {"node": x}, steps, write_op, 7.0)


@pytest.mark.parametrize("op", [{"op": "aten::from_file.default"}, {"op": "aten::save.default"}, {"op": "os::system.x"},
                                {"op": "aten::__class__.__init__"}, {"op": "torch.ops.aten.slice.Tensor"}])  # fmt: skip
def test_attack_op_value_named_off_the_vocabulary_is_refused(folder, op):
    """An op held as a value ({"op": "aten::slice.Tensor"}, handed to written) resolves only to an ATen op
    of the vocabulary: an edited name reaching a file op, another namespace or an attribute is refused;
    the same node naming aten::slice.Tensor loads and runs."""
    out, marker, program = folder
    x = _tensor(program)
    insert_before_output(program, _written(x, {"op": "aten::slice.Tensor"}))
    write_program(out, program)
    loaded = dpcompile.load(out)
    torch.testing.assert_close(loaded(torch.ones(4, 4))[1], torch.tensor([[7.0] * 4, [1.0] * 4]))  # device 0's chunk
    program = json.loads((out / "program.json").read_text())
    nodes = program["data"]["graph"]["nodes"]
    nodes[-2]["args"]["tuple"][1][0]["tuple"][0] = op
    write_program(out, program)
    _refused(out, marker, "is no ATen op of the vocabulary")


def test_attack_op_or_method_written_applies_outside_its_places_is_refused(folder):
    """written applies Tensor methods by name and vocabulary ops, nothing else (x.numpy().tofile(path) is
    two steps it would apply); an op handed to any other function is refused."""
    out, marker, program = folder
    x = _tensor(program)
    insert_before_output(program, _written(x, "numpy", "tofile"))
    program["data"]["graph"]["nodes"][-2]["args"]["tuple"][3] = str(marker)
    write_program(out, program)
    _refused(out, marker, "has written apply 'numpy'")
    program = json.loads((out / "program.json").read_text())
    nodes = program["data"]["graph"]["nodes"]
    nodes[-2].update(target="torch.relu", args={"tuple": [{"node": x}, {"op": "aten::relu.default"}]})
    write_program(out, program)
    _refused(out, marker, "hands an op to")


@pytest.mark.parametrize("cls", ["transformers.pytorch_utils.Conv1D", "subprocess.Popen", "torch.nn.modules.module.Module",
                                 "builtins.object", "dpcompile.runtime.replicate.ReplicaRoot"])  # fmt: skip
def test_attack_module_class_off_the_fixed_set_is_refused(folder, cls):
    """Module classes: torch.nn's and dpcompile's stand-ins by exact name; a library class named by the folder is not one."""
    out, marker, program = folder
    program["modules"][1]["class"] = cls
    write_program(out, program)
    _refused(out, marker, "neither a torch.nn class nor registered")


def test_attack_rehashed_folder_fails_the_trusted_hash(folder):
    """A folder edited and rehashed loads without a trusted hash but not with the exporter's."""
    out, marker, program = folder
    trusted = manifest_hash(out)
    assert isinstance(dpcompile.load(out, expected_hash=trusted), dpcompile.ParallelModule)
    first(program, "call_function", "dpcompile.runtime.gather")["args"]["tuple"][1] = 1  # another (allowed) program
    write_program(out, program)
    with pytest.raises(ExportError, match="not the expected"):
        dpcompile.load(out, expected_hash=trusted)
    dpcompile.load(out)  # the vocabulary alone allows it: it computes, and runs nothing else
    with pytest.raises(ValueError, match="sha256 in hex"):
        dpcompile.load(out, expected_hash="abc")


def test_vocabulary_is_frozen_and_lists_nothing_denied():
    """The vocabulary is read-only, holds exact names only, and no name on the denied list in any namespace."""
    table = vocabulary()
    assert isinstance(table, types.MappingProxyType)
    with pytest.raises(TypeError):
        table["os.system"] = print  # type: ignore[index]
    for name in table:
        parts = name.split(".")
        leaf = parts[-2] if name.startswith("torch.ops.aten.") else parts[-1]
        assert leaf not in DENIED and not (leaf.startswith("__") and not name.startswith("torch.ops.aten.__")), name
    assert not TENSOR_METHODS & DENIED and {"view", "size", "masked_fill"} <= TENSOR_METHODS
    for name in ["torch.ops.aten.__and__.Tensor", "torch.ops.aten.add.Tensor", "torch.ops.aten.scaled_dot_product_attention.default",
                 "torch.ops.aten._assert_tensor_metadata.default", "torch.relu", "torch.nn.functional.cross_entropy",
                 "operator.getitem", "dpcompile.runtime.scatter", "dpcompile.runtime.exported.model_output"]:  # fmt: skip
        assert name in table, name
    assert not {n for n in table if "file" in n or ".save" in n or ".load" in n}
