"""export / load: the program as data, safetensors weights, integrity, fresh-process round trips,
variants (eval/train, optional arguments None) after load, and tampering that never runs code."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib.util
import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import dpcompile
from dpcompile.export import ExportError, register_module_class, register_output_type
from dpcompile.modules.base import ParallelModule
from tests.models import Masked

REPO = Path(dpcompile.__file__).resolve().parents[1]


class Encoder(nn.Module):
    """A user container the generated code never calls (its children are called)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.lstm = nn.LSTM(16, 12, batch_first=True)

    def forward(self, x):
        h = torch.relu(self.bn(self.fc(x)))
        out, _ = self.lstm(h.unsqueeze(1))
        return out.squeeze(1)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        return self.head(self.encoder(x)), x.sum()


class Dropping(nn.Module):
    """Functional dropout reads self.training (baked into the trace) and an optional mask."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, x, mask=None):
        h = F.dropout(torch.relu(self.fc(x)), 0.5, self.training)
        if mask is not None:
            h = h * mask
        return self.out(h)


class Tagger(nn.Module):
    """An RNN program: embedding, an LSTM over (time, batch) that flattens its weights in forward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.lstm = nn.LSTM(8, 10, num_layers=2, bidirectional=True)
        self.norm = nn.LayerNorm(20)
        self.out = nn.Linear(20, 5)

    def forward(self, tokens):
        self.lstm.flatten_parameters()
        h, _ = self.lstm(self.embed(tokens))
        return self.out(self.norm(h))


class Twice(nn.Module):
    """A user class the program calls as a leaf: its forward is Python code."""

    def forward(self, x):
        return 2 * x


class WithLeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.twice = Twice()

    def forward(self, x):
        return self.twice(self.fc(x))


def _trained_dp(devices=("cpu", "cpu")) -> tuple[Model, dpcompile.ParallelModule]:
    model = Model()
    pm = dpcompile.transform(model, list(devices))
    pm(torch.randn(10, 8))  # move the running statistics away from their defaults
    pm.eval()
    return model, pm


def _tp() -> tuple[nn.Module, ParallelModule, torch.Tensor]:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.LayerNorm(8))
    x = torch.randn(5, 16)
    return model, dpcompile.transform(model, ["cpu", "cpu"], tensor_parallel=True, example_inputs=(x,)), x


# ----------------------------------------------------------------------- fresh process
_RUN = textwrap.dedent(
    """
    import sys, traceback, torch, dpcompile

    def check(folder, data):
        pm = dpcompile.load(folder, devices=data["devices"])
        assert isinstance(pm, dpcompile.ParallelModule)
        for mode, args, kwargs, want in data["calls"]:
            pm.train(mode == "train")
            out = pm(*args, **kwargs)
            out = out if isinstance(out, tuple) else (out,)
            if want == "random":  # dropout on: two calls differ
                again = pm(*args, **kwargs)
                again = again if isinstance(again, tuple) else (again,)
                assert not torch.equal(out[0], again[0]), "dropout is off in training mode"
                continue
            want = want if isinstance(want, tuple) else (want,)
            for a, b in zip(out, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        if data["keys"] is not None:
            assert sorted(pm.state_dict()) == data["keys"], sorted(pm.state_dict())
        return f"OK {type(pm).__mro__[1].__name__} {len(pm.devices)} {pm.mode} {sorted(getattr(pm, 'param_shards', {}))}"

    for name, folder, data in torch.load(sys.argv[1]):
        try:
            print(name, check(folder, data))
        except Exception:
            print(name, "FAILED", repr(traceback.format_exc()))
    """
)


#: each builder exports a program under ``root`` and says how to check it loaded: ``(folder, calls,
#: state_dict keys or None, the output line expected or None for any "OK ...")``


def _dp_program(root: Path) -> tuple:
    """A DP module (BatchNorm, LSTM, a user container class): eval calls, a batch of 7 and of 1."""
    model, pm = _trained_dp()
    folder = dpcompile.export(pm, root / "dp")
    x = torch.randn(7, 8)
    calls = [("eval", (x,), {}, pm(x)), ("eval", (x[:1],), {}, pm(x[:1]))]
    return folder, calls, model.state_dict().keys(), "OK ParallelModule 2 data_parallel []"


def _tp_program(root: Path) -> tuple:
    model, pm, x = _tp()
    folder = dpcompile.export(pm, root / "tp")
    expected = f"OK ParallelModule 2 tensor_parallel {sorted(pm.param_shards)}"
    return folder, [("train", (x,), {}, pm(x))], model.state_dict().keys(), expected


def _rnn_program(root: Path) -> tuple:
    """A bidirectional 2-layer LSTM over (time, batch), flattened in forward."""
    model = Tagger().eval()
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    assert "flatten_parameters" in pm.code
    folder = dpcompile.export(pm, root / "rnn")
    tokens = torch.randint(0, 20, (6, 4))  # (time, batch): split on dim 1
    return folder, [("eval", (tokens,), {}, model(tokens))], model.state_dict().keys(), None


def _modes_program(root: Path) -> tuple:
    """Functional dropout: off in eval(), on in train()."""
    model = Dropping()
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    folder = dpcompile.export(pm, root / "modes")
    model.eval()
    x, mask = torch.randn(4, 6), torch.rand(4, 6)
    calls = [("eval", (x, mask), {}, model(x, mask)), ("train", (x, mask), {}, "random"), ("eval", (x, mask), {}, model(x, mask))]
    return folder, calls, None, None


def _optional_none_program(root: Path) -> tuple:
    """Optional arguments left None (positionally, by keyword, omitted)."""
    model = Dropping().eval()
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    folder = dpcompile.export(pm, root / "optional")
    x, mask = torch.randn(5, 6), torch.rand(5, 6)
    calls = [("eval", (x,), {}, model(x)), ("eval", (x, None), {}, model(x)), ("eval", (x,), {"mask": mask}, model(x, mask)),
             ("train", (x,), {}, "random")]  # fmt: skip
    return folder, calls, None, None


FRESH = {"dp": _dp_program, "tp": _tp_program, "rnn": _rnn_program, "modes": _modes_program,
         "optional_none": _optional_none_program}  # fmt: skip


@pytest.fixture(scope="module")
def loaded_in_a_fresh_process(tmp_path_factory) -> dict[str, tuple | BaseException]:
    """Each program of ``FRESH`` exported here, then loaded and called in one new interpreter (the
    test's classes are not importable there; one interpreter's start for all of them): each name's
    line of output (``OK <class> <devices> <mode> <shards>`` or ``FAILED <traceback>``) and the line
    expected, or the error that building it here raised."""
    root = tmp_path_factory.mktemp("fresh_loads")
    jobs, results, expected = [], {}, {}
    for name, build in FRESH.items():
        torch.manual_seed(0)
        try:
            folder, calls, keys, expected[name] = build(root)
        except Exception as e:  # noqa: BLE001 - that test reports it
            results[name] = e
            continue
        jobs.append((name, str(folder), {"calls": calls, "keys": None if keys is None else sorted(keys), "devices": None}))
    torch.save(jobs, root / "jobs.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _RUN, str(root / "jobs.pt")], capture_output=True, text=True, cwd=root, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for line in done.stdout.splitlines():
        name, _, rest = line.partition(" ")
        results[name] = (rest, expected[name])
    return results


def _assert_loaded(outcomes: dict, name: str) -> None:
    """``name``'s program loaded and called as expected in the fresh process."""
    outcome = outcomes.get(name, (f"{name}: no output from the fresh process", None))
    if isinstance(outcome, BaseException):
        raise outcome
    line, expected = outcome
    assert line.startswith("OK") and (expected is None or line == expected), (line, expected)


@pytest.mark.xdist_group("export_fresh_process")  # one fresh process for these tests, on one worker
def test_export_data_parallel_loads_in_a_fresh_process(loaded_in_a_fresh_process):
    """A DP module (BatchNorm, LSTM, a user container class) loads elsewhere with identical outputs and keys."""
    _assert_loaded(loaded_in_a_fresh_process, "dp")


@pytest.mark.xdist_group("export_fresh_process")
def test_export_tensor_parallel_loads_in_a_fresh_process(loaded_in_a_fresh_process):
    """A TP module loads elsewhere with identical outputs and the original state_dict keys."""
    _assert_loaded(loaded_in_a_fresh_process, "tp")


@pytest.mark.xdist_group("export_fresh_process")
def test_export_rnn_program_loads_in_a_fresh_process(loaded_in_a_fresh_process):
    """A bidirectional 2-layer LSTM over (time, batch), flattened in forward, loads with identical outputs."""
    _assert_loaded(loaded_in_a_fresh_process, "rnn")


@pytest.mark.xdist_group("export_fresh_process")
def test_load_honours_eval_and_train_without_the_model_class(loaded_in_a_fresh_process):
    """In a process without the class, eval() turns functional dropout off and train() on."""
    _assert_loaded(loaded_in_a_fresh_process, "modes")


@pytest.mark.xdist_group("export_fresh_process")
def test_load_runs_an_optional_argument_left_none_without_the_model_class(loaded_in_a_fresh_process):
    """Optional arguments left None (positionally, by keyword, omitted) run the program traced for None."""
    _assert_loaded(loaded_in_a_fresh_process, "optional_none")


def test_load_refuses_a_call_it_carries_no_program_for(tmp_path):
    """A traced-through module in another mode than the root: a clear DpCompileError, not the wrong program."""
    model, pm = _trained_dp()
    loaded = dpcompile.load(dpcompile.export(pm, tmp_path / "out"))
    loaded.eval()
    loaded.encoder.train()
    with pytest.raises(dpcompile.DpCompileError, match="mixed-mode.*not available to trace again"):
        loaded(torch.randn(4, 8))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.pool(F.relu(self.bn(self.conv(x)))).flatten(1))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(30, 16, padding_idx=0)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        h = self.layer(self.embed(tokens))
        h, _ = self.mha(h, h, h)
        return self.head(h.mean(1))


class Flagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, double: bool = False, times: int = 1):
        h = self.fc(x)
        if times > 1:
            h = h * times
        return h * 2 if double else h


@pytest.mark.parametrize(
    "make, example",
    [(ConvNet, lambda: torch.randn(4, 3, 8, 8)), (Attention, lambda: torch.randint(0, 30, (4, 5))),
     (lambda: nn.LSTM(4, 6), lambda: torch.randn(5, 4, 4))],
    ids=["conv-batchnorm", "transformer-mha-embedding", "lstm-as-the-model"],
)  # fmt: skip
def test_export_rebuilds_torch_nn_modules_as_data(tmp_path, make, example):
    """Conv/BatchNorm, TransformerEncoderLayer/MultiheadAttention/Embedding and a bare LSTM load as data."""
    model = make().eval()
    folder = dpcompile.export(dpcompile.transform(model, ["cpu", "cpu"]), tmp_path / "out")
    assert not (folder / "program.pkl").exists()
    x = example()
    got, want = dpcompile.load(folder).eval()(x), model(x)
    torch.testing.assert_close(got[0] if isinstance(got, tuple) else got, want[0] if isinstance(want, tuple) else want)


def test_load_runs_both_values_of_a_bool_flag_and_refuses_other_flag_values(tmp_path):
    """A bool flag's both values are carried; an int flag other than the traced value raises DpCompileError."""
    model = Flagged()
    loaded = dpcompile.load(dpcompile.export(dpcompile.transform(model, ["cpu", "cpu"]), tmp_path / "out"))
    x = torch.randn(4, 4)
    torch.testing.assert_close(loaded(x), model(x))
    torch.testing.assert_close(loaded(x, True), model(x, True))
    torch.testing.assert_close(loaded(x, double=True), model(x, double=True))
    with pytest.raises(dpcompile.DpCompileError, match="times=3.*not available to trace again"):
        loaded(x, True, 3)


def test_load_tensor_parallel_honours_eval_and_none_arguments(tmp_path):
    """A TP program carries its eval and mask=None programs: after load, eval() matches the model."""
    model = Dropping()
    x, mask = torch.randn(4, 6), torch.rand(4, 6)
    pm = dpcompile.transform(model, ["cpu", "cpu"], tensor_parallel={"fc": "column", "out": "row"}, example_inputs=(x, mask))
    loaded = dpcompile.load(dpcompile.export(pm, tmp_path / "out")).eval()
    model.eval()
    torch.testing.assert_close(loaded(x, mask), model(x, mask))
    torch.testing.assert_close(loaded(x), model(x))
    loaded.train()
    assert not torch.equal(loaded(x), loaded(x))


class Constants(nn.Module):
    """Tensors made in forward become the tracer's constants, in the main program and the variants."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask=None):
        h = self.fc(x) * torch.tensor([1.0, 2.0, 3.0, 4.0])
        if mask is not None:
            h = h + mask * torch.tensor([0.5, 0.5, 0.5, 0.5])
        return F.dropout(h, 0.5, self.training)


def test_export_carries_tensor_constants_of_every_variant(tmp_path):
    """Constants a variant program holds are stored once each and read by the loaded variants."""
    model = Constants()
    folder = dpcompile.export(dpcompile.transform(model, ["cpu", "cpu"]), tmp_path / "out")
    assert any(k.startswith("_dpcompile_variant") for k in load_file(folder / "weights.safetensors"))
    loaded = dpcompile.load(folder).eval()
    model.eval()
    x, mask = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(loaded(x), model(x))
    torch.testing.assert_close(loaded(x, mask), model(x, mask))
    torch.testing.assert_close(loaded(x[:1], mask[:1]), model(x[:1], mask[:1]))
    assert "_tensor_constant" not in set(model.state_dict()) and set(loaded.state_dict()) == set(model.state_dict())


def test_allowlist_resolves_torch_ops_and_refuses_the_rest():
    """Qualified names resolve to torch ops (ATen overloads included); file and global-state functions do not."""
    from dpcompile.export.allowlist import NotAllowed, qualified_name, resolve_target

    for op in (torch.relu, F.dropout, torch._C._nn.linear, torch.ops.aten.add.Tensor, torch.Tensor.add):
        assert resolve_target(qualified_name(op)) is op
    for name in ("torch.load", "torch.save", "torch.from_file", "torch.ops.aten.from_file.default", "torch.manual_seed",
                 "os.system", "builtins.eval", "builtins.open", "operator.attrgetter", "torch.hub.load",
                 "torch.Tensor.numpy", "dpcompile.runtime.distributed.all_reduce", "math.__loader__"):  # fmt: skip
        with pytest.raises(NotAllowed):
            resolve_target(name)


# ---------------------------------------------------------------------------- the folder
def test_export_writes_program_weights_module_and_manifest(tmp_path):
    """The folder holds module.py, program.json, weights.safetensors (state_dict keys, readable by
    safetensors alone) and a manifest listing each file's size and sha256."""
    model, pm = _trained_dp()
    folder = dpcompile.export(pm, tmp_path / "out")
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "module.py", "program.json", "weights.safetensors"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and manifest["program"]["kind"] == "data_parallel"
    assert manifest["program"]["devices"] == ["cpu", "cpu"] and manifest["program"]["trust_code"] is False
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    weights = load_file(folder / "weights.safetensors")
    assert set(weights) == set(model.state_dict())
    assert torch.equal(weights["encoder.bn.running_mean"], pm.state_dict()["encoder.bn.running_mean"])
    program = json.loads((folder / "program.json").read_text())
    assert program["config"]["plan"] == {} and program["config"]["input_dims"] == dict(pm.input_dims)


def test_export_names_tensor_parallel_shards_after_the_state_dict_key(tmp_path):
    """Shard k of 'fc.weight' is stored as 'fc.weight.shard<k>'; replicated tensors keep their key."""
    model, pm, _ = _tp()
    folder = dpcompile.export(pm, tmp_path / "out")
    weights = load_file(folder / "weights.safetensors")
    assert {"0.weight.shard0", "0.weight.shard1", "2.weight.shard1", "2.bias", "3.weight"} <= set(weights)
    full = model.state_dict()["0.weight"]
    torch.testing.assert_close(torch.cat([weights["0.weight.shard0"], weights["0.weight.shard1"]]), full)


def test_export_module_py_is_the_importable_generated_forward(tmp_path):
    """module.py imports with torch + dpcompile, and its forward run on the loaded module gives pm's output."""
    _, pm = _trained_dp()
    folder = dpcompile.export(pm, tmp_path / "out")
    text = (folder / "module.py").read_text()
    assert "dpcompile_runtime_scatter(x, ['cpu', 'cpu'], 0)" in text and "never runs this file" in text
    spec = importlib.util.spec_from_file_location("exported_module", folder / "module.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loaded = dpcompile.load(folder)
    x = torch.randn(6, 8)
    generated = module.Model.forward(loaded, x)
    assert all(torch.equal(a, b) for a, b in zip(generated, pm(x)))


def test_export_module_py_imports_with_string_annotations(tmp_path):
    """A forward annotated under `from __future__ import annotations` still gives an importable module.py."""
    from dpcompile.demo import build

    model, example = build()
    pm = dpcompile.transform(model, ["cpu", "cpu"], example_inputs=example)
    folder = dpcompile.export(pm, tmp_path / "out")
    spec = importlib.util.spec_from_file_location("exported_demo", folder / "module.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.testing.assert_close(module.DemoModel.forward(dpcompile.load(folder), *example), pm(*example))


def test_load_returns_only_the_recorded_kind(tmp_path):
    """A DP folder loads as a ParallelModule without a sharded state, a TP folder as one holding its shards."""
    _, dp = _trained_dp()
    _, tp, _ = _tp()
    loaded_dp = dpcompile.load(dpcompile.export(dp, tmp_path / "dp"))
    loaded_tp = dpcompile.load(dpcompile.export(tp, tmp_path / "tp"))
    assert isinstance(loaded_dp, ParallelModule) and loaded_dp.mode == "data_parallel" and "param_shards" not in loaded_dp.__dict__
    assert isinstance(loaded_tp, ParallelModule) and loaded_tp.mode == "tensor_parallel"
    assert loaded_tp.param_shards == tp.param_shards and loaded_tp.executor == loaded_dp.executor == "plain"


def test_load_regenerates_a_data_parallel_program_for_other_devices(tmp_path):
    """Exported for 4 virtual devices, loaded on 3: same outputs, code for 3 devices."""
    _, pm = _trained_dp(["cpu"] * 4)
    folder = dpcompile.export(pm, tmp_path / "out")
    loaded = dpcompile.load(folder, devices=["cpu"] * 3)
    x = torch.randn(9, 8)
    assert len(loaded.devices) == 3 and "'cpu', 'cpu', 'cpu']" in loaded.code and "x_dev3" not in loaded.code
    torch.testing.assert_close(loaded(x), pm(x))


def test_load_puts_a_cuda_export_on_cpu_devices(tmp_path, monkeypatch):
    """A program exported for cuda:0..3 refuses to load here without devices= and loads on ['cpu'] * 4."""
    import dpcompile.recipes.data_parallel as data_parallel
    from dpcompile.devices import parse_devices

    model = Model().eval()
    monkeypatch.setattr(data_parallel, "move_to", lambda module, device: None)  # no CUDA here: keep the weights on the CPU
    devices = parse_devices([f"cuda:{k}" for k in range(4)], check_available=False)
    pm = data_parallel.DataParallelRecipe(devices=devices, output_device=devices.primary).compile(model, None)
    assert "'cuda:3'" in pm.code
    folder = dpcompile.export(pm, tmp_path / "out")
    if not torch.cuda.is_available():
        with pytest.raises(ExportError, match="devices="):
            dpcompile.load(folder)
    loaded = dpcompile.load(folder, devices=["cpu"] * 4)
    assert "cuda" not in loaded.code
    x = torch.randn(8, 8)
    want, got = model(x), loaded(x)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_loaded_module_pickles_with_its_variants(tmp_path):
    """torch.save / torch.load of a loaded program keeps its eval and None-argument programs."""
    model = Dropping().eval()
    loaded = dpcompile.load(dpcompile.export(dpcompile.transform(model, ["cpu", "cpu"]), tmp_path / "out"))
    torch.save(loaded, tmp_path / "pm.pt")
    again = torch.load(tmp_path / "pm.pt", weights_only=False).eval()
    x = torch.randn(4, 6)
    torch.testing.assert_close(again(x), model(x))


# ---------------------------------------------------------------------------- refusals
def test_load_refuses_an_incompatible_format_version(tmp_path):
    """A manifest of another export format version raises DpCompileError naming both versions."""
    _, pm = _trained_dp()
    folder = dpcompile.export(pm, tmp_path / "out")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["format_version"] = 99
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(dpcompile.DpCompileError, match="version 99.*reads version 2"):
        dpcompile.load(folder)


def test_load_refuses_a_folder_with_a_missing_file(tmp_path):
    """Without weights.safetensors the load stops with a DpCompileError before building anything."""
    _, pm = _trained_dp()
    folder = dpcompile.export(pm, tmp_path / "out")
    (folder / "weights.safetensors").unlink()
    with pytest.raises(dpcompile.DpCompileError, match="missing weights.safetensors"):
        dpcompile.load(folder)


def test_load_refuses_a_changed_file(tmp_path):
    """A program.json that no longer matches its checksum is refused."""
    _, pm = _trained_dp()
    folder = dpcompile.export(pm, tmp_path / "out")
    with open(folder / "program.json", "ab") as f:
        f.write(b" ")
    with pytest.raises(dpcompile.DpCompileError, match="checksum"):
        dpcompile.load(folder)


def test_load_refuses_something_that_is_not_an_export(tmp_path):
    """A folder without a manifest, or no folder at all, says so."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(dpcompile.DpCompileError, match="no manifest.json"):
        dpcompile.load(tmp_path / "empty")
    with pytest.raises(dpcompile.DpCompileError, match="not a folder"):
        dpcompile.load(tmp_path / "nowhere")


def test_load_refuses_a_malformed_manifest_with_a_dpcompile_error(tmp_path):
    """A manifest that is not an object, lacks or mangles a field, or adds one, raises DpCompileError."""
    _, pm = _trained_dp()
    folder = dpcompile.export(pm, tmp_path / "out")
    good = json.loads((folder / "manifest.json").read_text())
    broken = [[1], {k: v for k, v in good.items() if k != "program"}, {**good, "files": "all"},
              {**good, "program": {**good["program"], "devices": "cpu"}}, {**good, "tensors": {}},
              {**good, "program": {**good["program"], "kind": "tensor_parallel"}}]  # fmt: skip
    for manifest in broken:
        (folder / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(dpcompile.DpCompileError, match="manifest|re-export|disagree"):
            dpcompile.load(folder)


def test_a_file_of_the_export_that_is_a_link_or_a_folder_is_named_as_such(tmp_path):
    """Each file of an export replaced by a link out of the folder, or by a folder: refused naming the file and
    what it is (it said "is missing module.py" of a module.py that was a link)."""
    folder = dpcompile.export(dpcompile.transform(Masked(), ["cpu"] * 2), tmp_path / "out")
    for name in ["manifest.json", "module.py", "program.json", "weights.safetensors"]:
        kept = (folder / name).read_bytes()
        (tmp_path / name).write_bytes(kept)
        (folder / name).unlink()
        (folder / name).symlink_to(tmp_path / name)
        with pytest.raises(ExportError, match=f"{name} is a symbolic link: refused"):
            dpcompile.load(folder)
        (folder / name).unlink()
        (folder / name).mkdir()
        with pytest.raises(ExportError, match=f"{name} is not a regular file"):
            dpcompile.load(folder)
        (folder / name).rmdir()
        (folder / name).write_bytes(kept)


def test_a_bool_weight_whose_bytes_are_not_0_or_1_is_refused(tmp_path):
    """weights.safetensors edited (the manifest rehashed) so that a bool holds a byte 2, which torch's ops
    disagree on (it prints True, yet ``.all()`` is False): refused; before, it loaded."""
    from tests.tools.export_attacks import rehash

    folder = dpcompile.export(dpcompile.transform(Masked(), ["cpu"] * 2), tmp_path / "out")
    raw = bytearray((folder / "weights.safetensors").read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 + n + json.loads(raw[8 : 8 + n])["mask"]["data_offsets"][0] + 1] = 2  # the False
    (folder / "weights.safetensors").write_bytes(bytes(raw))
    rehash(folder)
    with pytest.raises(ExportError, match="bool tensor 'mask' holds bytes other than 0 and 1"):
        dpcompile.load(folder)


def test_export_refuses_a_layout_over_a_mesh_it_does_not_write(tmp_path):
    """A program over a mesh of a mode export does not write (every mode transform makes today is written:
    tests/integration/test_export_mesh.py) is refused by name, with the way out, before anything is written."""
    _, pm = _trained_dp()
    pm.mode = "spmd_other"
    with pytest.raises(ExportError, match="a spmd_other program is not exported yet.*in one process"):
        dpcompile.export(pm, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_folder_holding_other_files(tmp_path):
    """Exporting into a folder with files of its own would leave unlisted files: refused."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="empty folder"):
        dpcompile.export(_trained_dp()[1], tmp_path / "out")


# ----------------------------------------------------------------- trust_code (leaves)
def test_export_of_a_user_leaf_class_needs_trust_code_to_load(tmp_path):
    """A program calling a user class (a leaf) is written with program.pkl, marked in the manifest;
    load refuses it and says why and how; load(trust_code=True) runs it."""
    model = WithLeaf()
    pm = dpcompile.transform(model, ["cpu", "cpu"], leaf_modules=[Twice])
    folder = dpcompile.export(pm, tmp_path / "out")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["program"]["trust_code"] is True and "program.pkl" in manifest["files"]
    with pytest.raises(ExportError, match=r"Twice.*trust_code=True.*register_module_class"):
        dpcompile.load(folder)
    x = torch.randn(4, 4)
    torch.testing.assert_close(dpcompile.load(folder, trust_code=True)(x), model(x))


def test_trusted_pickle_that_is_not_a_parallel_module_is_refused(tmp_path):
    """Even with trust_code=True, a program.pkl that unpickles to something else (an int) is refused."""
    folder = dpcompile.export(dpcompile.transform(WithLeaf(), ["cpu", "cpu"], leaf_modules=[Twice]), tmp_path / "out")
    (folder / "program.pkl").write_bytes(pickle.dumps(42))
    _rehash(folder)
    with pytest.raises(ExportError, match="not a ParallelModule"):
        dpcompile.load(folder, trust_code=True)


def test_export_of_a_model_with_root_hooks_needs_trust_code(tmp_path):
    """A forward hook on the model runs around the program (Python code): the folder needs trust_code."""
    model = MLP()
    model.register_forward_hook(lambda module, args, out: out * 2)
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    folder = dpcompile.export(pm, tmp_path / "out")
    with pytest.raises(ExportError, match="forward hooks"):
        dpcompile.load(folder)


def test_export_of_a_registered_leaf_class_is_data(tmp_path):
    """A leaf class registered with register_module_class is rebuilt as data: no pickle, no trust_code."""

    class Halve(nn.Module):
        def forward(self, x):
            return x / 2

    class UsesHalve(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.halve = Halve()

        def forward(self, x):
            return self.halve(self.fc(x))

    register_module_class(Halve)
    model = UsesHalve()
    folder = dpcompile.export(dpcompile.transform(model, ["cpu", "cpu"], leaf_modules=[Halve]), tmp_path / "out")
    assert not (folder / "program.pkl").exists()
    x = torch.randn(4, 4)
    torch.testing.assert_close(dpcompile.load(folder)(x), model(x))


Halves = collections.namedtuple("Halves", "low high")


@dataclasses.dataclass
class Scores:
    logits: torch.Tensor
    total: torch.Tensor


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return Halves(h[:, :2], h[:, 2:]), Scores(h, h.sum())


def test_export_of_registered_output_types_is_data(tmp_path):
    """A namedtuple and a dataclass the model returns need trust_code, unless registered: then data."""
    model = Structured()
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    folder = dpcompile.export(pm, tmp_path / "pickled")
    with pytest.raises(ExportError, match="register_output_type"):
        dpcompile.load(folder)
    register_output_type(Halves)
    register_output_type(Scores)
    folder = dpcompile.export(pm, tmp_path / "data")
    assert not (folder / "program.pkl").exists()
    x = torch.randn(4, 4)
    (low, high), scores = dpcompile.load(folder)(x)
    (want_low, want_high), want = model(x)
    torch.testing.assert_close(low, want_low)
    torch.testing.assert_close(scores.total, want.total)


# --------------------------------------------------------------------------- tampering
def _rehash(folder: Path) -> None:
    """What a tamperer does after editing: recompute every size and checksum in the manifest."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for name in list(manifest["files"]):
        if (folder / name).exists():
            data = (folder / name).read_bytes()
            manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _edit_program(folder: Path, edit) -> None:
    program = json.loads((folder / "program.json").read_text())
    edit(program)
    (folder / "program.json").write_text(json.dumps(program))
    _rehash(folder)


class _Payload:
    """Unpickling this creates ``path``: proof that code from the folder ran."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def exported(tmp_path):
    _, pm = _trained_dp()
    folder = dpcompile.export(pm, tmp_path / "out")
    marker = tmp_path / "PWNED"
    return folder, marker


def _node(program, op):
    return next(n for n in program["data"]["graph"]["nodes"] if n["op"] == op)


@pytest.mark.parametrize("target", ["os.system", "builtins.eval", "builtins.exec", "torch.load", "subprocess.call",
                                    "posix.system", "torch.hub.load", "builtins.__import__", "torch.from_file"])  # fmt: skip
def test_tampered_program_json_call_target_never_runs(exported, target):
    """A call of os.system / eval / torch.load ... planted in program.json (rehashed) is refused; the payload never runs."""
    folder, marker = exported

    def plant(program):
        node = _node(program, "call_function")
        node["target"] = target
        node["args"] = [f"touch {marker}"] if target.endswith(("system", "call")) else [f"open({str(marker)!r}, 'w')"]
        node["args"] = {"tuple": node["args"]}

    _edit_program(folder, plant)
    with pytest.raises(ExportError, match="not an op a loaded program may call"):
        dpcompile.load(folder)
    assert not marker.exists()


def test_tampered_program_json_module_class_and_attribute_never_run(exported):
    """A module class or an attribute function outside the allowlist is refused; the payload never runs."""
    folder, marker = exported

    def plant_class(program):
        program["modules"][1]["class"] = "os._wrap_close"

    _edit_program(folder, plant_class)
    with pytest.raises(ExportError, match="neither a torch.nn class"):
        dpcompile.load(folder)

    def plant_attribute(program):
        program["modules"][1]["class"] = "plain"
        linear = next(m for m in program["modules"] if (m.get("class") or "").endswith("Linear"))
        linear["attrs"]["activation"] = {"fn": "os.system"}

    _edit_program(folder, plant_attribute)
    with pytest.raises(ExportError, match="os.system"):
        dpcompile.load(folder)

    def shadow_forward(program):
        linear = next(m for m in program["modules"] if (m.get("class") or "").endswith("Linear"))
        linear["attrs"] = {"forward": {"fn": "torch.relu"}}

    _edit_program(folder, shadow_forward)
    with pytest.raises(ExportError, match="would shadow Linear.forward"):
        dpcompile.load(folder)
    assert not marker.exists()


def test_tampered_program_json_dunder_access_is_refused(exported):
    """getattr chains to __class__/__globals__ (the way out of a sandbox) are refused."""
    folder, _ = exported

    def plant(program):
        node = _node(program, "get_attr")
        node["target"] = "encoder.forward.__globals__"

    _edit_program(folder, plant)
    with pytest.raises(ExportError, match="reads"):
        dpcompile.load(folder)


@pytest.mark.parametrize("name", ["self", "torch", "getattr", "dpcompile_runtime_gather"])
def test_tampered_program_json_node_shadowing_a_global_is_refused(exported, name):
    """A node renamed to a name the generated code calls through (self, torch, a runtime function) is refused."""
    folder, _ = exported

    def rename(program):
        node = _node(program, "call_function")
        old = node["name"]
        node["name"] = name
        text = json.dumps(program["data"]["graph"]).replace(json.dumps({"node": old}), json.dumps({"node": name}))
        program["data"]["graph"] = json.loads(text)

    _edit_program(folder, rename)
    with pytest.raises(ExportError, match="shadow|taken|module.py is not the program"):
        dpcompile.load(folder)


def test_tampered_program_json_nested_too_deep_is_refused(exported):
    """A value nested beyond the recursion limit is an ExportError, not a crash."""
    folder, _ = exported

    program = json.loads((folder / "program.json").read_text())
    _node(program, "call_function")["args"] = "NESTED"
    deep = '{"tuple": [' * 100_000 + "0" + "]}" * 100_000
    (folder / "program.json").write_text(json.dumps(program).replace('"NESTED"', deep))
    _rehash(folder)
    with pytest.raises(ExportError):
        dpcompile.load(folder)


def test_tampered_weights_payload_never_runs(exported):
    """weights.safetensors replaced by a pickle payload (rehashed): refused; the payload never runs."""
    folder, marker = exported
    (folder / "weights.safetensors").write_bytes(pickle.dumps(_Payload(marker)))
    _rehash(folder)
    with pytest.raises(ExportError, match="weights.safetensors"):
        dpcompile.load(folder)
    assert not marker.exists()


def test_tampered_module_py_is_refused_and_never_runs(exported):
    """A module.py edited to hold a payload (rehashed) differs from the program it must equal: refused, never run."""
    folder, marker = exported
    text = (folder / "module.py").read_text()
    (folder / "module.py").write_text(f"open({str(marker)!r}, 'w')\n" + text.replace("x_dev0.sum()", "x_dev0.sum() * 0"))
    _rehash(folder)
    with pytest.raises(ExportError, match="module.py is not the program"):
        dpcompile.load(folder)
    assert not marker.exists()


def test_tampered_manifest_smuggling_a_pickle_is_refused(exported):
    """A program.pkl payload with manifest and program.json rewritten to ask for it: refused without
    trust_code, and the payload never runs."""
    folder, marker = exported
    (folder / "program.pkl").write_bytes(pickle.dumps(_Payload(marker)))

    def ask_for_pickle(program):
        program.update(trust_code=True, pickled_because="x", modules=None, data=None)

    program = json.loads((folder / "program.json").read_text())
    ask_for_pickle(program)
    (folder / "program.json").write_text(json.dumps(program))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["program"]["trust_code"] = True
    manifest["files"]["program.pkl"] = {}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    _rehash(folder)
    with pytest.raises(ExportError, match="trust_code=True"):
        dpcompile.load(folder)
    assert not marker.exists()


def test_tampered_manifest_with_a_removed_entry_is_refused(exported):
    """Removing a file's entry from the manifest is an error, not a skipped check."""
    folder, _ = exported
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["files"]["module.py"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match="never skipped"):
        dpcompile.load(folder)


def test_tampered_folder_with_an_unlisted_file_is_refused(exported):
    """A file in the folder that the manifest does not list is an error."""
    folder, _ = exported
    (folder / "extra.py").write_text("print('hello')\n")
    with pytest.raises(ExportError, match="does not list"):
        dpcompile.load(folder)


def test_tampered_tensor_table_cannot_freeze_parameters(exported):
    """requires_grad lives in program.json, under its checksum: editing it (or adding a tensors field
    to the manifest, as the old format had) is refused, so no parameter is frozen silently."""
    folder, _ = exported
    program = json.loads((folder / "program.json").read_text())
    for info in program["tensors"].values():
        info["requires_grad"] = False
    (folder / "program.json").write_text(json.dumps(program))
    with pytest.raises(ExportError, match="checksum"):
        dpcompile.load(folder)
    _rehash(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "tensors": program["tensors"]}))
    with pytest.raises(ExportError, match="fields"):
        dpcompile.load(folder)


def test_tampered_wrong_shaped_tensor_is_refused_before_building(exported):
    """A tensor of another shape or dtype (rehashed) is refused before anything is built."""
    folder, _ = exported
    weights = load_file(folder / "weights.safetensors")
    weights["head.weight"] = torch.zeros(5, 12)
    save_file(weights, folder / "weights.safetensors")
    _rehash(folder)
    with pytest.raises(ExportError, match=r"'head.weight' is float32\[5, 12\], the program needs float32\[3, 12\]"):
        dpcompile.load(folder)
    weights["head.weight"] = torch.zeros(3, 12, dtype=torch.float64)
    save_file(weights, folder / "weights.safetensors")
    _rehash(folder)
    with pytest.raises(ExportError, match="float64"):
        dpcompile.load(folder)


def test_tampered_kind_cannot_turn_data_parallel_into_tensor_parallel(exported):
    """A DP folder relabelled tensor_parallel (program.json and manifest, rehashed) is refused."""
    folder, _ = exported
    _edit_program(folder, lambda p: p.update(kind="tensor_parallel"))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["program"]["kind"] = "tensor_parallel"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(dpcompile.DpCompileError):
        dpcompile.load(folder)


class ShiftRight(nn.Module):
    """BART's ``shift_tokens_right``: writes into slices of a tensor forward makes. Under the export
    frontend the program calls ``written(base, [(aten.slice.Tensor, args), ...], aten.copy_.default, value)``:
    it holds ATen ops as values."""

    def __init__(self):
        super().__init__()
        self.embed, self.fc = nn.Embedding(10, 8), nn.Linear(8, 8)

    def forward(self, ids):
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 1
        return self.fc(self.embed(shifted))


def test_export_writes_ops_held_as_values_by_name_and_loads_them_as_data(tmp_path):
    """The ops a program hands ``written`` are written as ``{"op": "aten::slice.Tensor"}`` (no pickle)
    and resolved on load in the vocabulary; the loaded module computes what the model does."""
    torch.manual_seed(0)
    model, ids = ShiftRight(), torch.randint(0, 10, (4, 5))
    pm = dpcompile.transform(model, ["cpu", "cpu"], frontend="export", example_inputs=(ids,))
    folder = dpcompile.export(pm, tmp_path / "out")
    assert not (folder / "program.pkl").exists()
    text = json.dumps(json.loads((folder / "program.json").read_text()))
    assert '{"op": "aten::slice.Tensor"}' in text and '{"op": "aten::copy_.default"}' in text
    loaded = dpcompile.load(folder)
    steps = [n.args[1] for n in loaded.graph.nodes if n.target is dpcompile.runtime.written]
    assert steps and steps[0][0][0] is torch.ops.aten.slice.Tensor
    torch.testing.assert_close(loaded(ids), model(ids))


class TransposedWeight(nn.Module):
    """``x @ w.T``: the export frontend calls ``aten.numpy_T.default`` for ``.T``."""

    def __init__(self):
        super().__init__()
        self.fc, self.w = nn.Linear(8, 8), nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return self.fc(x) @ self.w.T


def test_export_of_a_transpose_attribute_under_the_export_frontend_is_data(tmp_path):
    """``aten.numpy_T`` (``.T``) is on the vocabulary: written as data, loaded, equal to the model."""
    torch.manual_seed(0)
    model, x = TransposedWeight(), torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu", "cpu"], frontend="export", example_inputs=(x,))
    assert any(n.target is torch.ops.aten.numpy_T.default for n in pm.graph.nodes)
    folder = dpcompile.export(pm, tmp_path / "out")
    assert not (folder / "program.pkl").exists()
    torch.testing.assert_close(dpcompile.load(folder)(x), model(x))


class BidirectionalTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.LSTM(4, 6, num_layers=2, bidirectional=True, batch_first=True), nn.Linear(12, 3)

    def forward(self, x):
        return torch.einsum("bsh,ch->bsc", self.rnn(x)[0], self.head.weight)


def test_export_of_an_exported_bidirectional_rnn_and_einsum_is_data(tmp_path):
    """``aten.lstm.input`` (its ``bidirectional`` argument is no path) and ``aten.einsum`` (its
    contraction ``path`` is no file) are on the vocabulary: written as data, not a pickle that needs
    ``trust_code=True``; the loaded program flattens each replica's RNN and equals the model."""
    torch.manual_seed(0)
    model, x = BidirectionalTagger(), torch.randn(4, 5, 4)
    pm = dpcompile.transform(model, ["cpu", "cpu"], frontend="export", example_inputs=(x,))
    folder = dpcompile.export(pm, tmp_path / "out")
    assert not (folder / "program.pkl").exists()
    loaded = dpcompile.load(folder)
    assert loaded.code.count("dpcompile_runtime_flatten_parameters(") == 2
    torch.testing.assert_close(loaded(x), model(x))


class ComplexPhase(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("phase", torch.polar(torch.ones(4), torch.linspace(0, 1, 4)))

    def forward(self, x):
        return (self.fc(x) * self.phase).real


def test_export_of_a_dtype_safetensors_cannot_hold_is_refused_before_the_folder_changes(tmp_path):
    """A complex buffer: export raised safetensors' KeyError after dropping the manifest of the export
    already in the folder (which then no longer loaded). Now an ExportError naming the tensor, and
    the earlier export still loads; save_checkpoint's refusal names format='dcp'."""
    folder = tmp_path / "out"
    x = torch.randn(3, 4)
    dpcompile.export(dpcompile.transform(nn.Linear(4, 4), ["cpu"] * 2), folder)
    pm = dpcompile.transform(ComplexPhase(), ["cpu"] * 2)
    with pytest.raises(ExportError, match=r"'phase' \(torch.complex64\).*view_as_real"):
        dpcompile.export(pm, folder)
    assert dpcompile.load(folder)(x).shape == (3, 4)
    with pytest.raises(dpcompile.CheckpointError, match="format='dcp'"):
        dpcompile.save_checkpoint(pm, tmp_path / "ckpt")


@pytest.mark.parametrize("tensor_parallel", [False, True])
def test_explain_of_a_loaded_program_counts_the_collectives_the_original_does(tmp_path, tensor_parallel):
    """program.json carries each node's labels (the data it moves, the pass that made it): explain of
    the loaded program lists the same collectives and totals and names the same passes (before, a loaded
    program reported no communication at all)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu", "cpu"], tensor_parallel=tensor_parallel)
    loaded = dpcompile.load(dpcompile.export(pm, tmp_path / "out"))
    want, got = dpcompile.explain(pm, x).to_dict(), dpcompile.explain(loaded, x).to_dict()
    assert want["comm_elements"] > 0
    for key in ("comm_elements", "comm_elements_forward", "comm_elements_backward", "io_elements"):
        assert got[key] == want[key], key
    drop = ("source",)  # the user's line of the transform call: not part of the program
    assert [{k: v for k, v in c.items() if k not in drop} for c in got["collectives"]] == [
        {k: v for k, v in c.items() if k not in drop} for c in want["collectives"]
    ]
    assert [n["pass_name"] for n in got["nodes"]] == [n["pass_name"] for n in want["nodes"]]


@pytest.mark.parametrize("labels", [{"comm": ["all_reduce", "yes", None]}, {"comm": ["os.system", False, None]},
                                    {"pass": "__import__('os')"}, {"run": "x"}, ["comm"], {"slot": -1},
                                    {"slot": 1 << 40}, {"copy": "0"}, {"slot": 1.0}, {"copy": True}])  # fmt: skip
def test_tampered_node_labels_are_refused(exported, labels):
    """A node's labels in program.json are checked like the rest (rehashed edits included)."""
    folder, _ = exported

    def plant(program):
        _node(program, "call_function")["meta"] = labels

    _edit_program(folder, plant)
    with pytest.raises(ExportError, match="malformed labels"):
        dpcompile.load(folder)
