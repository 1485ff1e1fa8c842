"""Models built on ``meta``: transform allocates per device, load_checkpoint fills, outputs and training equal eager."""

from __future__ import annotations

import copy
import functools
import importlib
import json
import warnings

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.checkpoint import BuffersNotComputedError, CheckpointError
from dpcompile.fake import fake_devices, is_fake, materialize
from dpcompile.recipes import TensorParallelRecipe
from dpcompile.recipes.meta import compile_meta_model
from tests.integration.test_tp_hf_megatron import _inputs, _model, _three_sgd_steps_equal_eager
from tests.models import Attention


class MLP(nn.Module):
    def __init__(self, d: int = 8, h: int = 32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)
        self.register_buffer("scale", torch.full((d,), 2.0), persistent=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


def _on_meta(make):
    with torch.device("meta"):
        return make()


def _save(model: nn.Module, path) -> None:
    """The model's weights as transformers writes them: tied duplicates left out."""
    from safetensors.torch import save_file

    seen, out = set(), {}
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[key] = t.detach().clone().contiguous()
    save_file(out, str(path))


def _unique_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["data_parallel", "tensor_parallel"])
def test_meta_model_transform_allocates_what_each_device_holds(tensor_parallel):
    """No tensor of pm is meta or fake; tensor parallel holds exactly the model's bytes (shards, no full copy)."""
    model = _on_meta(MLP)
    x = torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=tensor_parallel, example_inputs=(x,))
    tensors = [*pm.parameters(), *pm.buffers()]
    assert tensors and not any(is_fake(t) for t in tensors)
    assert _unique_bytes(pm.parameters()) == _unique_bytes(model.parameters())
    if tensor_parallel:
        assert pm.get_parameter("fc1.weight_shard1").shape == (16, 8)
        assert all(p.is_meta for p in model.parameters())  # the user's meta model is left as it was
    assert pm.needs_weights
    with pytest.raises(dpcompile.DpCompileError, match="load_checkpoint"):
        pm(x)


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["data_parallel", "tensor_parallel"])
def test_load_checkpoint_reads_each_shard_as_a_slice_and_equals_eager(tensor_parallel, tmp_path, monkeypatch):
    """Every tensor is read once, sharded ones as shard-sized slices; the non-persistent buffer stays real."""
    load = importlib.import_module("dpcompile.checkpoint.load")

    torch.manual_seed(0)
    eager = MLP()
    eager.scale.fill_(3.0)  # a real buffer of a model whose parameters alone are on meta
    _save(eager, tmp_path / "model.safetensors")
    model = MLP()
    model.scale.fill_(3.0)
    model.fc1.to_empty(device="meta"), model.fc2.to_empty(device="meta")  # init_empty_weights(include_buffers=False)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=tensor_parallel)
    reads: list[tuple[str, tuple[int, ...]]] = []
    real_read = load.read_blocks

    def recording(entry, blocks):  # each piece's boxes, read from the file into it
        reads.extend((entry.key, tuple(b.view.shape)) for b in blocks)
        return real_read(entry, blocks)

    monkeypatch.setattr(load, "read_blocks", recording)
    assert dpcompile.load_checkpoint(pm, tmp_path) is pm and not pm.needs_weights
    if tensor_parallel:
        assert sorted(reads) == sorted([("fc1.bias", (16,)), ("fc1.bias", (16,)), ("fc1.weight", (16, 8)),
                                        ("fc1.weight", (16, 8)), ("fc2.bias", (8,)), ("fc2.weight", (8, 16)),
                                        ("fc2.weight", (8, 16))])  # fmt: skip
    else:
        assert sorted(k for k, _ in reads) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    x = torch.randn(5, 8)
    torch.testing.assert_close(pm(x), eager(x))


def test_load_checkpoint_strict_lists_keys_and_loads_nothing(tmp_path):
    """A missing and an unexpected key are both named; the real program keeps its weights."""
    from safetensors.torch import save_file

    model = MLP()
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True)
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    weights = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    weights["fc3.weight"] = weights.pop("fc2.weight")
    save_file(weights, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing: 'fc2.weight'.*does not have: 'fc3.weight'"):
        dpcompile.load_checkpoint(pm, tmp_path / "bad.safetensors")
    weights["fc2.weight"] = torch.zeros(8, 31)
    save_file(weights, str(tmp_path / "shape.safetensors"))
    with pytest.raises(CheckpointError, match=r"'fc2.weight': checkpoint \[8, 31\], model \[8, 32\]"):
        dpcompile.load_checkpoint(pm, tmp_path / "shape.safetensors", strict=False)
    for key, value in pm.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_non_persistent_buffer_without_a_config_is_named(tmp_path):
    """A meta buffer no checkpoint holds and no config rebuilds: the error names it and the ways out."""
    model = _on_meta(MLP)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    _save(MLP(), tmp_path / "model.safetensors")
    with pytest.raises(BuffersNotComputedError, match=r"'scale' \(MLP\).*include_buffers=False"):
        dpcompile.load_checkpoint(pm, tmp_path)
    assert pm.needs_weights


class ScaledEmbedding(nn.Embedding):
    """Gemma 2's scaled embedding: a non-persistent buffer its constructor takes as a number, no config."""

    def __init__(self, vocab: int, dim: int, scale: float):
        super().__init__(vocab, dim)
        self.register_buffer("scale", torch.tensor(scale), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.scale


class Window(nn.Module):
    """GPT-Neo's attention mask: causal, or local (a band) on odd layers; no config."""

    def __init__(self, size: int, local: bool):
        super().__init__()
        mask = torch.ones(size, size).tril()
        self.register_buffer("mask", mask - mask.tril(-2) if local else mask, persistent=False)

    def forward(self, h):
        return h @ self.mask


class Layer(nn.Module):
    """Built from the config alone it is layer 0 (GPT-Neo's ``GPTNeoAttention(config, layer_id=0)``)."""

    def __init__(self, config, index: int = 0):
        super().__init__()
        self.fc, self.window = nn.Linear(config.dim, config.dim), Window(config.dim, local=index % 2 == 1)

    def forward(self, h):
        return self.window(torch.tanh(self.fc(h)))


class ScaledEmbeddingLM(nn.Module):
    """The model a config builds, which computes the embedding's scale (``dim ** 0.5``) and each layer's window."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = ScaledEmbedding(config.vocab, config.dim, config.dim**0.5)
        self.layers = nn.ModuleList([Layer(config, i) for i in range(2)])
        self.head = nn.Linear(config.dim, config.vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_non_persistent_buffers_are_computed_by_the_model_that_a_config_builds(tmp_path):
    """Meta buffers whose modules take no config (Gemma 2's ``embed_scale``, GPT-Neo's local mask) are
    those a fresh build of the whole model from its config computes, not of a layer built from the
    config alone (layer 0's mask on layer 1): loaded, every buffer and the output equal eager's."""
    import types

    config = types.SimpleNamespace(vocab=11, dim=9)
    torch.manual_seed(0)
    eager = ScaledEmbeddingLM(config)
    _save(eager, tmp_path / "model.safetensors")
    pm = dpcompile.transform(_on_meta(lambda: ScaledEmbeddingLM(config)), ["cpu"] * 2)
    dpcompile.load_checkpoint(pm, tmp_path)
    for name, buffer in eager.named_buffers():
        torch.testing.assert_close(pm.get_buffer(name), buffer, msg=name)
    ids = torch.randint(0, 11, (3, 4))
    torch.testing.assert_close(pm(ids), eager(ids))


def _save_sharded(model: nn.Module, folder, files: int = 3) -> None:
    """The model's weights in transformers' sharded layout: ``model-0000k-of-0000n`` files and the index json."""
    from safetensors.torch import save_file

    seen, keys = set(), []
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:  # tied duplicates left out, as transformers does
            seen.add(id(t))
            keys.append(key)
    state = model.state_dict()
    weight_map = {}
    for k in range(files):
        name = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        part = keys[k::files]
        save_file({key: state[key].clone().contiguous() for key in part}, str(folder / name))
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize(
    "name, tensor_parallel",
    [("llama", True), ("bert", False), pytest.param("gpt2", True, marks=pytest.mark.slow)],
    ids=["llama-tensor_parallel", "bert-data_parallel", "gpt2-tensor_parallel"],
)
def test_transformers_model_on_meta_loads_a_sharded_checkpoint_and_trains_as_eager(name, tensor_parallel, tmp_path):
    """meta → transform → load (sharded folder, index json) → outputs and 3 SGD steps equal eager.

    Llama and GPT-2 tie their LM head (left out of the files, tied back); Llama's rotary
    ``inv_freq`` and BERT's ``position_ids`` are computed as their constructors compute them.
    """
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = _model(name).eval()
        _save_sharded(eager, tmp_path)
        with torch.device("meta"):
            model = _model(name).eval()
        pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=tensor_parallel, example_kwargs=_inputs(name))
    dpcompile.load_checkpoint(pm, tmp_path)
    out, want = pm(**_inputs(name, 1)), eager(**_inputs(name, 1))
    key = "last_hidden_state" if name == "bert" else "logits"
    torch.testing.assert_close(out[key], want[key], atol=2e-5, rtol=1e-5)

    def loss_of(out):
        return out.loss if name != "bert" else (out.last_hidden_state * torch.linspace(0.5, 1.5, 32)).pow(2).mean()

    _three_sgd_steps_equal_eager(pm, copy.deepcopy(eager), lambda step: _inputs(name, step), loss_of)


def test_save_checkpoint_writes_shards_with_an_index_and_loads_back(tmp_path):
    """Past max_shard_size: model-0000k-of-0000n files and the index json, the tied key once; load_checkpoint reads it back."""
    torch.manual_seed(0)
    model = Tied()
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel={"embed": "vocab", "head": "column"})
    dpcompile.save_checkpoint(pm, tmp_path / "ckpt", max_shard_size=600)
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == ["embed.weight", "fc.bias", "fc.weight"]
    assert index["weight_map"] == {"embed.weight": "model-00001-of-00002.safetensors", "fc.weight": "model-00002-of-00002.safetensors",
                                   "fc.bias": "model-00002-of-00002.safetensors"}  # 640 bytes, then 256 + 32  # fmt: skip
    other = dpcompile.transform(_on_meta(Tied), ["cpu"] * 2, tensor_parallel={"embed": "vocab", "head": "column"})
    dpcompile.load_checkpoint(other, tmp_path / "ckpt")
    assert other.get_parameter("head.weight_shard1") is other.get_parameter("embed.weight_shard1")
    ids = torch.randint(0, 20, (3, 5))
    torch.testing.assert_close(other(ids), model(ids))


class Tied(nn.Module):
    """An embedding tied to its LM head, a Linear between."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.fc(self.embed(ids))))


def test_save_checkpoint_round_trips_a_single_file(tmp_path):
    """save_checkpoint(pm, 'x.safetensors') writes the model's keys in full; loading it back restores them."""
    from safetensors.torch import load_file

    model = MLP()
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True)
    dpcompile.save_checkpoint(pm, tmp_path / "x.safetensors")
    saved = load_file(str(tmp_path / "x.safetensors"))
    assert list(saved) == list(model.state_dict())
    for key, value in model.state_dict().items():
        torch.testing.assert_close(saved[key], value, rtol=0, atol=0)
    other = dpcompile.transform(_on_meta(MLP), ["cpu"] * 2, tensor_parallel=True)
    other.get_buffer("scale").fill_(2.0)
    other.__dict__["_unset_buffers"] = []  # filled by hand (the model's own value)
    dpcompile.load_checkpoint(other, tmp_path / "x.safetensors")
    x = torch.randn(3, 8)
    torch.testing.assert_close(other(x), model(x))
    real = dpcompile.transform(MLP(), ["cpu"] * 2)  # a program of a real model: its weights are overwritten
    dpcompile.load_checkpoint(real, tmp_path / "x.safetensors")
    torch.testing.assert_close(real(x), model(x))


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attention = Attention(d, heads=8)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    """A GPT-style decoder: embedding, blocks, final norm, LM head tied to the embedding."""

    def __init__(self, vocab: int = 256, d: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*(Block(d) for _ in range(layers)))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.norm(self.blocks(self.embed(ids))))


def test_meta_transformer_on_eight_fake_gpus_splits_parameter_bytes_evenly():
    """A meta transformer, tensor parallel on fake cuda:0..7: every device holds total/8 of the sharded bytes plus the replicated rest (±5%)."""
    model = _on_meta(Transformer)
    recipe = TensorParallelRecipe(devices=fake_devices(8), output_device=torch.device("cuda:0"), check_available=False)
    # transform's own compile, for devices this machine lacks
    compile_one = functools.partial(dpcompile.api._compile, recipe, frontend="fx", batch_dim=None)
    pm = compile_meta_model(recipe, model, (torch.randint(0, 256, (2, 8)),), None, compile_one)
    assert {p.device for p in pm.parameters()} == {torch.device(f"cuda:{k}") for k in range(8)}
    params = dict(model.named_parameters())
    sharded = sum(p.numel() * 4 for key, p in params.items() if key in pm.param_shards)
    rest = sum(p.numel() * 4 for key, p in params.items() if key not in pm.param_shards)
    assert sharded > 0.9 * (sharded + rest), (sharded, rest)
    expected = sharded / 8 + rest
    for slot, got in pm.param_bytes_per_slot().items():
        assert abs(got - expected) <= 0.05 * expected, (slot, got, expected)


def test_materialize_gives_memory_to_the_named_tensors_only_and_keeps_ties():
    """materialize(names=...) allocates only those (a pipeline stage's), in place; ties stay ties."""
    model = _on_meta(Tied)
    weight = model.fc.weight
    assert materialize(model, "cpu", names=["fc.weight", "fc.bias"]) == ["fc.weight", "fc.bias"]
    assert model.fc.weight is weight and not weight.is_meta and model.embed.weight.is_meta
    assert materialize(model, "cpu") == ["embed.weight", "head.weight"]
    assert model.head.weight is model.embed.weight and not model.embed.weight.is_meta
