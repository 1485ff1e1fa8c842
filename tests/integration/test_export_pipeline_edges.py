"""Edge cases of exporting and loading one-process pipelines, found by probing as a user would:
a loaded module exported again keeps every program it carries (eval mode, optional arguments
left None), so the module loaded from the second folder runs the calls the first one ran; and a
pipeline's description in program.json (stage plan, stages' devices and sizes) edited is refused."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.export import ExportError


class MaskedStack(nn.Module):
    """Two stages' worth of layers and an optional keyword-only mask: three call variants."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, 4)

    def forward(self, x, labels, *, mask=None):
        h = torch.relu(self.layers[0](x))
        if mask is not None:
            h = h * mask
        h = self.norm(torch.relu(self.layers[1](h)))
        return nn.functional.cross_entropy(self.head(h), labels)


def _inputs(n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(n, 8, generator=g, dtype=torch.float64), "labels": torch.randint(0, 4, (n,), generator=g),
            "mask": torch.rand(n, 8, generator=g, dtype=torch.float64)}  # fmt: skip


def test_a_loaded_pipeline_exported_again_keeps_its_eval_and_optional_argument_programs(tmp_path):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(MaskedStack().double(), ["cpu"] * 2, pipeline=2, micro_batches=2, example_kwargs=_inputs())
    loaded = dpcompile.load(dpcompile.export(pm, tmp_path / "first"))
    again = dpcompile.load(dpcompile.export(loaded, tmp_path / "second"))
    kwargs = _inputs()
    no_mask = {k: v for k, v in kwargs.items() if k != "mask"}
    for call in (kwargs, no_mask):  # training: the main program and the one without the mask
        torch.testing.assert_close(again(**call), pm(**call), rtol=0, atol=0)
    for key, value in pm.state_dict().items():  # BatchNorm's running statistics moved alike
        torch.testing.assert_close(again.state_dict()[key], value, rtol=0, atol=0)
    with torch.no_grad():
        for call in (kwargs, no_mask):  # eval mode: before the fix the second load carried no such program
            torch.testing.assert_close(again.eval()(**call), pm.eval()(**call), rtol=0, atol=0)


def _rehash(folder) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (folder / name).read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (folder / "manifest.json").write_text(json.dumps(manifest))


EDITS = {  # a field of config.pipeline, edited (and rehashed): each once loaded as it was
    "plan weights": (("stage_plan", "weights"), "x"),
    "plan starts": (("stage_plan", "starts"), []),
    "plan module paths": (("stage_plan", "module_paths"), [[0, 1], [1, 0]]),
    "stage device": (("stages", 0, "device"), "x"),
    "stage flops": (("stages", 1, "flops"), -1),
    "stage module paths": (("stages", 0, "module_paths"), "layers.0"),
}


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {k: v for k, v in _inputs().items() if k != "mask"}
        pm = dpcompile.transform(MaskedStack().double(), ["cpu"] * 2, pipeline=2, micro_batches=2, example_kwargs=kwargs)
    return dpcompile.export(pm, tmp_path_factory.mktemp("edges") / "pp")


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_pipeline_description_edited_in_program_json_is_refused(pipeline_folder, tmp_path, edit):
    """The stage plan and the stages' descriptions, not only their programs, are checked: a loaded
    module never reports stages on devices or with sizes the export did not record."""
    folder = shutil.copytree(pipeline_folder, tmp_path / "pp")
    path, value = EDITS[edit]
    program = json.loads((folder / "program.json").read_text())
    field = program["config"]["pipeline"]
    for step in path[:-1]:
        field = field[step]
    field[path[-1]] = value
    (folder / "program.json").write_text(json.dumps(program))
    _rehash(folder)
    with pytest.raises(ExportError, match="stage plan whose|stage 0 is described|stage 1 is described|not on the program's devices"):
        dpcompile.load(folder)


class Recurrent(nn.Module):
    """A sequence-first LSTM (the program reads the module itself, for flatten_parameters) and a head."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 8)
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


def test_dp_tp_copies_of_an_rnn_export_and_load(tmp_path):
    """A tensor-parallel stage's tensors are described by get_attr; the RNN module read for its
    flatten_parameters was taken for a tensor (AttributeError: 'LSTM' object has no attribute 'shape')."""
    x = torch.randn(3, 4, 4)
    pm = dpcompile.transform(Recurrent(), ["cpu"] * 4, mesh={"dp": 2, "tp": 2}, example_inputs=(x,))
    dpcompile.export(pm, tmp_path / "rnn")
    loaded = dpcompile.load(tmp_path / "rnn")
    torch.testing.assert_close(loaded(x), pm(x))


class HeadsAttention(nn.Module):
    """Attention viewed by heads (sharded by heads only where shapes show them)."""

    def __init__(self, width: int = 8, heads: int = 2):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.heads = heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (f(x).view(b, s, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        return self.o(a).sum()


def test_dp_tp_copies_given_examples_export_their_eval_program(tmp_path):
    """transform given example_inputs shards attention by heads (shapes show them); export built the
    eval program without shapes, which shards otherwise, so it was left out and the loaded module
    refused pm.eval() calls ("not available to trace again")."""
    x = torch.randn(2, 4, 8)
    model = HeadsAttention()
    pm = dpcompile.transform(model, ["cpu"] * 4, mesh={"dp": 2, "tp": 2}, example_inputs=(x,))
    dpcompile.export(pm, tmp_path / "heads")
    loaded = dpcompile.load(tmp_path / "heads").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model.eval()(x))


def test_dp_tp_copies_of_a_program_torch_export_captured_export_their_eval_program(tmp_path):
    """A model fx cannot trace (a shape branch: captured with torch.export): export built the eval
    program with no call's inputs, which the check of the exported inputs refused ('input_ids' is
    missing), so the loaded module refused pm.eval() calls."""
    from tests.capture.test_export_frontend import Block

    x = torch.randn(4, 8)
    model = Block()
    pm = dpcompile.transform(model, ["cpu"] * 4, mesh={"dp": 2, "tp": 2}, example_inputs=(x,))
    dpcompile.export(pm, tmp_path / "exported")
    loaded = dpcompile.load(tmp_path / "exported").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model.eval()(x))
