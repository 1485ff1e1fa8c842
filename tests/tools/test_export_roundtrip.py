"""Ordinary use under the closed vocabulary: transformers models through the torch.export frontend
export as data (no pickle) and load in a fresh process with eager's outputs; tensor parallel with
every style (column, row, replicate, vocab, a tied LM head) exports and loads."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.modules.base import ParallelModule
from tests.thirdparty import import_or_skip

REPO = Path(dpcompile.__file__).resolve().parents[1]


def _fresh_process(script: str, *args: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=cwd, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


_LOAD_AND_COMPARE = textwrap.dedent(
    """
    import sys, torch, dpcompile
    cases = torch.load(sys.argv[1])
    for name, folder, kwargs, logits, loss in cases:
        pm = dpcompile.load(folder).eval()
        out = pm(**kwargs)
        torch.testing.assert_close(out.logits, logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.loss, loss, rtol=1e-5, atol=1e-5)
        print("OK", name, type(pm).__name__)
    """
)


@pytest.mark.slow
def test_transformers_export_frontend_programs_are_data_and_load_in_a_fresh_process(tmp_path):
    """GPT-2 (Conv1D), BERT, Llama (GQA, rotary) and T5 through frontend='export': no program.pkl,
    and loaded where neither the model classes nor transformers' output classes are built, each gives
    eager's logits and loss; loaded onto three devices (the program lowered again), eager's logits."""
    from tests.integration.test_real_models import _hf, _hf_inputs

    import_or_skip("transformers")
    cases = []
    for name in ("gpt2", "bert", "llama", "t5"):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = _hf(name).eval()
            kwargs = _hf_inputs(name, 4)
            pm = dpcompile.transform(model, ["cpu", "cpu"], example_kwargs=kwargs, frontend="export")
        folder = dpcompile.export(pm, tmp_path / name)
        program = json.loads((folder / "program.json").read_text())
        assert not (folder / "program.pkl").exists() and program["trust_code"] is False, program["pickled_because"]
        want = model(**kwargs)
        moved = dpcompile.load(folder, devices=["cpu"] * 3).eval()  # lowered again, from the shapes export recorded
        torch.testing.assert_close(moved(**kwargs).logits, want.logits, rtol=1e-5, atol=1e-5)
        cases.append((name, str(folder), kwargs, want.logits.detach(), want.loss.detach()))
    torch.save(cases, tmp_path / "cases.pt")
    out = _fresh_process(_LOAD_AND_COMPARE, str(tmp_path / "cases.pt"), cwd=tmp_path)
    assert [line.split()[1] for line in out.splitlines()] == ["gpt2", "bert", "llama", "t5"], out


class EveryStyle(nn.Module):
    """A small LM: vocab-parallel embedding, a tied LM head, column and row layers, a replicated one."""

    def __init__(self, vocab: int = 32, d: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, 16)
        self.down = nn.Linear(16, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(self.mix(h))


def test_tensor_parallel_with_every_style_exports_and_loads(tmp_path):
    """Plan {emb: vocab, up: column, down: row, mix: replicate, head: column (tied)}: exported as data,
    loaded with the same plan, outputs and state_dict; training on the loaded module keeps the tie."""
    torch.manual_seed(0)
    model = EveryStyle()
    ids = torch.randint(0, 32, (3, 5))
    plan = {"emb": "vocab", "up": "column", "down": "row", "mix": "replicate", "head": "column"}
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu", "cpu"], tensor_parallel=plan, example_inputs=(ids,))
    assert pm.plan == plan
    folder = dpcompile.export(pm, tmp_path / "out")
    assert not (folder / "program.pkl").exists()
    loaded = dpcompile.load(folder)
    assert isinstance(loaded, ParallelModule) and loaded.plan == plan and loaded.param_shards == pm.param_shards
    torch.testing.assert_close(loaded(ids), model(ids))
    assert loaded.emb.weight_shard0 is loaded.head.weight_shard0  # the tie survives
    assert sorted(loaded.state_dict()) == sorted(model.state_dict())
    torch.testing.assert_close(loaded.state_dict()["emb.weight"], model.emb.weight)
    loss = loaded(ids).square().mean()
    loss.backward()
    grads = [p.grad for p in loaded.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    out = _fresh_process(
        "import sys, torch, dpcompile\npm = dpcompile.load(sys.argv[1])\nids, want = torch.load(sys.argv[2])\n"
        "torch.testing.assert_close(pm(ids), want)\nprint('OK', pm.plan)",
        str(folder),
        str(_save(tmp_path / "io.pt", (ids, model(ids).detach()))),
        cwd=tmp_path,
    )
    assert out.startswith("OK") and "'emb': 'vocab'" in out


def _save(path: Path, value) -> Path:
    torch.save(value, path)
    return path


def test_a_loaded_module_keeps_the_order_of_its_parameters_and_buffers(tmp_path):
    """``named_parameters()`` comes back in the model's order (``weight`` before ``bias``, not
    sorted), so an optimizer's state saved by position lines up after load."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    opt = torch.optim.Adam(pm.parameters(), lr=0.1)
    pm(torch.randn(6, 4)).sum().backward()
    opt.step()
    loaded = dpcompile.load(dpcompile.export(pm, tmp_path / "out"))
    assert [n for n, _ in loaded.named_parameters()] == [n for n, _ in pm.named_parameters()]
    assert [n for n, _ in loaded.named_buffers()] == [n for n, _ in pm.named_buffers()]
    again = torch.optim.Adam(loaded.parameters(), lr=0.1)
    again.load_state_dict(opt.state_dict())
    for (_, p), (_, q) in zip(pm.named_parameters(), loaded.named_parameters(), strict=True):
        torch.testing.assert_close(again.state[q]["exp_avg"], opt.state[p]["exp_avg"])


def test_torchvision_stochastic_depth_exports_as_data_and_draws_as_torchvision(tmp_path):
    """torchvision's stochastic_depth (a call fx keeps: ConvNeXt, EfficientNet) is written as
    dpcompile.runtime.stochastic_depth: no pickle, and the loaded program, on the exported devices
    and on three, gives eager's values in both modes (training: the same draws from the same seed)."""
    ops = import_or_skip("torchvision.ops")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.depth, self.out = nn.Linear(6, 6), ops.StochasticDepth(0.5, "row"), nn.Linear(6, 2)

        def forward(self, x):
            return self.out(x + self.depth(self.fc(x)))

    torch.manual_seed(0)
    model, x = Block(), torch.randn(5, 6)
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, example_inputs=(x,))
    folder = dpcompile.export(pm, tmp_path / "sd")
    assert not (Path(folder) / "program.pkl").exists()
    for devices in (["cpu"] * 2, ["cpu"] * 3):
        _assert_modes_like_eager(dpcompile.load(folder, devices=devices), model, x, 7, f"{len(devices)} devices")


class ModeDropoutAttention(nn.Module):
    """Attention whose ``dropout_p`` depends on the mode (``self.p if self.training else 0.0``), as
    transformers' BERT-like attentions (Electra, RoBERTa) write it: the export frontend captures both
    modes as one program with ``mode_value(attention, 0.5, 0.0)``, which reads the module's flag only."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.p = 0.5

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        p = self.p if self.training else 0.0
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p)
        return y.transpose(1, 2).reshape(b, s, 8)


def test_a_module_read_only_for_its_mode_exports_as_data(tmp_path):
    """The attention module behind ``mode_value`` is stored as a plain container, not refused as a
    leaf module whose class must run (Electra's export went to program.pkl); loaded, both modes give
    eager's values (training: the same dropout draws from the same seed)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(ModeDropoutAttention(), nn.Linear(8, 2)), torch.randn(4, 3, 8)
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, example_inputs=(x,), frontend="export")
    pm.eval()(x)  # the other mode is captured at its first call: one program serves both
    folder = dpcompile.export(pm.train(), tmp_path / "mode")
    assert not (Path(folder) / "program.pkl").exists()
    assert "mode_value" in "".join(p.read_text() for p in Path(folder).glob("*.py"))
    _assert_modes_like_eager(dpcompile.load(folder), model, x, 3, "one device")


class FourierMixing(nn.Module):
    """FNet's token mixing: ``torch.fft.fftn`` over the sequence and hidden dims, real part; then
    SigLIP's normalisation by ``torch.linalg.vector_norm``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = torch.fft.fftn(self.fc(x), dim=(1, 2)).real
        return y / torch.linalg.vector_norm(y, dim=-1, keepdim=True)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_torch_fft_and_linalg_export_as_data(tmp_path, frontend):
    """``torch.fft`` and ``torch.linalg`` calls (FNet, SigLIP) are on the vocabulary: no program.pkl,
    and the loaded program gives eager's values (it went to a pickle, loaded only with trust_code=True)."""
    torch.manual_seed(0)
    model, x = FourierMixing(), torch.randn(4, 3, 8)
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, example_inputs=(x,), frontend=frontend)
    folder = dpcompile.export(pm, tmp_path / frontend)
    assert not (Path(folder) / "program.pkl").exists()
    torch.testing.assert_close(dpcompile.load(folder)(x), model(x))


class _SlicedByInputLength(nn.Module):
    """``self.pos[: x.shape[1]]``: fx keeps the bound as a node inside the slice."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("pos", torch.arange(24.0).reshape(6, 4), persistent=False)

    def forward(self, x):
        return self.fc(x) + self.pos[: x.shape[1]]


@pytest.mark.parametrize("mesh", [{"dp": 2}, {"tp": 2}], ids=["dp2", "tp2"])
def test_a_slice_bounded_by_a_node_exports_and_loads(tmp_path, mesh):
    """Before, a slice's bounds were written without their node names' context and read back without the
    nodes: load refused every fx program slicing by an input's length ("holds a value it cannot read")."""
    torch.manual_seed(0)
    pm = dpcompile.transform(_SlicedByInputLength(), ["cpu"] * 2, mesh=mesh, example_inputs=(torch.randn(3, 5, 4),))
    dpcompile.export(pm, tmp_path / "e")
    loaded = dpcompile.load(tmp_path / "e")
    for length in (5, 2):
        x = torch.randn(3, length, 4)
        torch.testing.assert_close(loaded(x), pm(x))


class _ReadsItsEmbeddingWeight(nn.Module):
    """Reads ``embed.weight`` beside calling ``embed`` (its dtype): the tensor-parallel stage's program lists it."""

    def __init__(self):
        super().__init__()
        self.embed, self.fc, self.out = nn.Embedding(16, 8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, ids):
        return self.out(torch.relu(self.fc(self.embed(ids).to(self.embed.weight.dtype))))


def test_a_whole_weight_read_in_a_dp_x_tp_program_loads_with_its_values(tmp_path):
    """Before, the loaded stage's stand-in for ``embed.weight`` (a meta tensor) was set on the embedding the
    program calls: the loaded module failed, 'Cannot copy out of meta tensor; no data!'."""
    torch.manual_seed(0)
    model, ids = _ReadsItsEmbeddingWeight(), torch.randint(0, 16, (4, 3))
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 4, mesh={"dp": 2, "tp": 2}, example_inputs=(ids,))
    dpcompile.export(pm, tmp_path / "e")
    loaded = dpcompile.load(tmp_path / "e")
    assert not any(t.is_meta for t in loaded.state_dict().values())
    torch.testing.assert_close(loaded(ids), model(ids))


def _assert_modes_like_eager(loaded, model, x, seed: int, label: str) -> None:
    """``loaded`` in train, eval, then train again gives eager's output, each call from ``seed``
    (training: the same dropout draws)."""
    for mode in ("train", "eval", "train"):
        getattr(loaded, mode)()
        getattr(model, mode)()
        torch.manual_seed(seed)
        got = loaded(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(got, model(x), msg=lambda m, o=mode: f"{label}, {o}: {m}")


def test_falcon_linear_exports_as_data_in_every_mode(tmp_path):
    """Falcon's ``FalconLinear`` (``x @ W.T + b``), which the export frontend calls as the module, is held
    as dpcompile's ``MatmulLinear``: the folder loads without ``trust_code`` (before, every Falcon export was
    a pickle that ``load`` refused) and the loaded program equals eager, data and tensor parallel."""
    import_or_skip("transformers")
    from transformers.models.falcon.modeling_falcon import FalconLinear

    torch.manual_seed(0)
    model = nn.Sequential(FalconLinear(8, 16), nn.ReLU(), FalconLinear(16, 8, bias=False)).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    for i, tp in enumerate((False, True)):
        pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, tensor_parallel=tp, frontend="export", example_inputs=(x,))
        dpcompile.export(pm, tmp_path / str(i))
        loaded = dpcompile.load(tmp_path / str(i))
        if not tp:
            assert [type(m).__name__ for m in loaded.modules() if isinstance(m, nn.Linear)] == ["MatmulLinear"] * 2
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-12, atol=1e-12)


def test_a_module_named_with_a_hyphen_exports_as_data(tmp_path):
    """torchvision's RegNet names its blocks ``block1-0`` (``add_module`` allows it): the program calls
    ``replica.trunk.block1-0`` and exports as data, loading without ``trust_code``; before, the name failed
    the attribute check, so every RegNet export was a pickle that ``load`` refused."""
    from collections import OrderedDict

    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(trunk=nn.Sequential(OrderedDict({"block1-0": nn.Linear(4, 4), "act": nn.ReLU()}))))
    x = torch.randn(3, 4)
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2)
    dpcompile.export(pm, tmp_path / "e")
    loaded = dpcompile.load(tmp_path / "e")
    torch.testing.assert_close(loaded(x), model(x))
    assert [name for name, _ in loaded.named_modules()] == [name for name, _ in model.named_modules()]
