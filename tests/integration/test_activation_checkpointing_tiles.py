"""``activation_checkpointing={..., "tiles": k}``: a region acting on each token alone (an MLP) runs as
``k`` checkpoint calls on token slices; a region that mixes tokens is left whole with the reason; and
``"budget_over": "device"``: one knapsack over a device's regions, ties to the later regions."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import dpcompile
from passes import checkpoint_activations
from passes.checkpoint_tiles import why_not_per_token
from tests.integration.test_activation_checkpointing_saves import Attention


class MLP(nn.Module):
    def __init__(self, d: int = 16, p: float = 0.0):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p) if p else None

    def forward(self, x):
        y = self.fc2(F.gelu(self.fc1(x)))
        return self.drop(y) if self.drop is not None else y


class Block(nn.Module):
    def __init__(self, d: int = 16, p: float = 0.0):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), Attention(d), nn.LayerNorm(d), MLP(d, p)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Stack(nn.Module):
    def __init__(self, layers: int = 2, p: float = 0.0):
        super().__init__()
        self.layers = nn.ModuleList([Block(p=p) for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Positions(nn.Module):
    """``x + pos``: a table of positions (2 dims) pairs each token with its row; a bias (1 dim) does not."""

    def __init__(self, dims: int = 2):
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(*([8] * (dims - 1)), 16))

    def forward(self, x):
        return x + self.pos


def _example() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Stack().double(), torch.randn(2, 8, 16, dtype=torch.float64)


def _assert_equals_eager(pm, model, reference, x):
    expected = reference(x)
    expected.sum().backward()
    out = pm(x)
    out.sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    got = dict(model.named_parameters())
    for name, q in reference.named_parameters():
        torch.testing.assert_close(got[name].grad, q.grad, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("devices", [1, 2])
def test_mlp_in_token_tiles_equals_eager_and_shows_the_tiles(devices):
    """The last block's MLP in 4 tiles (each keeping fc1's output), block 0 whole: the code cuts ln2's
    output into 4 slices, checkpoints each and joins them; loss and gradients equal eager's (float64)."""
    model, x = _example()
    reference = copy.deepcopy(model)
    spec = {"regions": ["layers.0", "layers.1.mlp"], "save": "matmuls", "tiles": 4}
    pm = dpcompile.transform(model, ["cpu"] * devices, activation_checkpointing=spec)
    assert "in 4 token tiles" in pm.strategies["activation_checkpointing"]
    first = "layers_0_dev0" if devices == 1 else "layers_0"  # two copies of block 0 share a shape value: one region
    assert f"(run whole, not in tiles: {first}: scaled_dot_product_attention" in pm.strategies["activation_checkpointing"]
    code = pm.code
    for d in range(devices):
        assert f"layers_1_mlp_dev{d}_tiles = dpcompile_runtime_token_tiles(layers_1_ln2_dev{d}, 4)" in code
        for i in range(4):  # each tile's call reads its slice (and the module or replica)
            call = re.search(rf"layers_1_mlp_dev{d}_tile{i} = dpcompile_runtime_checkpoint\((.*)\)", code)
            assert f"layers_1_mlp_dev{d}_region, " in call.group(1) and f"layers_1_mlp_dev{d}_tile{i}_in" in call.group(1)
        assert f"layers_1_mlp_dev{d}_tile4" not in code
        assert f"layers_1_mlp_dev{d} = dpcompile_runtime_join_tiles([layers_1_mlp_dev{d}_tile0, " in code
    assert code.count("dpcompile_runtime_token_tiles(") == devices  # block 0 (attention) runs whole
    region = pm.get_submodule("layers_1_mlp_dev0_region").code
    assert region.index("keep_outputs(True)") < region.index(".fc1(") < region.index("keep_outputs(False)")
    _assert_equals_eager(pm, model, reference, x)


@pytest.mark.parametrize(("layout", "tiled"), [({"pipeline": 2, "micro_batches": 2}, 2), ({"tensor_parallel": True}, 0)])
def test_tiles_compose_with_pipeline_and_tensor_parallel(layout, tiled):
    """A pipeline tiles each micro-batch's MLP; under tensor parallelism the MLP's collective makes it
    not per-token, so it runs whole. Loss and gradients equal eager's either way."""
    model, x = _example()
    reference = copy.deepcopy(model)
    spec = {"regions": ["layers.1.mlp"], "save": "matmuls", "tiles": 2}
    pm = dpcompile.transform(model, ["cpu"] * 2, activation_checkpointing=spec, **layout)
    assert pm.code.count("dpcompile_runtime_token_tiles(") == tiled
    if layout.get("tensor_parallel"):
        expected = reference(x)
        torch.testing.assert_close(pm(x), expected, rtol=1e-12, atol=1e-12)
    else:
        _assert_equals_eager(pm, model, reference, x)


def test_tiles_lower_the_measured_peak():
    """The last MLP's backward holds one tile's GELU output and gradients at a time: the step's
    measured peak is lower with 4 tiles than with the MLP checkpointed whole (both keeping fc1)."""
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(4, 32, 16)
    peaks = []
    for tiles in (1, 4):
        spec = {"regions": ["layers.0", "layers.1.mlp"], "save": "matmuls", "tiles": tiles}
        pm = dpcompile.transform(copy.deepcopy(model), ["cpu"], activation_checkpointing=spec)
        peaks.append(dpcompile.measure(pm, x).peak_bytes["cpu"])
    assert peaks[1] < peaks[0]


def test_regions_that_mix_tokens_or_draw_randomly_stay_whole_with_the_reason():
    """Attention, a view across tokens and dropout are refused for tiles by name, and those regions
    run whole; a per-token MLP is not refused."""
    gm = fx.symbolic_trace(Stack(p=0.1))
    result = checkpoint_activations(gm, paths=["layers.0", "layers.1.mlp", "layers.1.attn"], save="nothing;tiles=2")
    assert result.info["tiled"] == []
    untiled = result.info["untiled"]
    assert untiled["layers_0"] == "scaled_dot_product_attention (attention) mixes the tokens"
    assert untiled["layers_1_mlp"] == "layers_1_mlp_drop (Dropout, p=0.1) draws random numbers: a tile would draw others"
    assert untiled["layers_1_attn"] == "scaled_dot_product_attention_1 (attention) mixes the tokens"

    assert "token_tiles" not in gm.code
    traced = fx.symbolic_trace(Stack())
    named = {n.name: n for n in traced.graph.nodes}
    mlp = [named[n] for n in ("layers_0_mlp_fc1", "gelu", "layers_0_mlp_fc2")]
    assert why_not_per_token(traced, mlp, [named["layers_0_ln2"]]) is None
    attention = named["scaled_dot_product_attention"]
    assert why_not_per_token(traced, [attention], [attention.args[0]]) == (
        "scaled_dot_product_attention (attention) mixes the tokens"
    )
    residual = named["add"]  # x + attention's output: two values of tokens
    assert why_not_per_token(traced, [residual], list(residual.all_input_nodes)).startswith("it reads 2 values")
    table = fx.symbolic_trace(Positions())
    added = next(n for n in table.graph.nodes if n.op == "call_function")
    assert why_not_per_token(table, [added], [added.args[0]]) == "add reads pos, not a vector over the features, with the tokens"
    vector = fx.symbolic_trace(Positions(1))
    bias = next(n for n in vector.graph.nodes if n.op == "call_function")
    assert why_not_per_token(vector, [bias], [bias.args[0]]) is None
    view = named["view"]
    assert why_not_per_token(traced, [view], [view.args[0]]) == "view (view) is not known to act on each token alone"


def test_one_knapsack_over_a_devices_regions_prefers_the_later_ones():
    """Budget 10 of the 13 units per row (block 0: attention, q, k, v, o at 1, fc1 at 4; the last MLP:
    fc1 at 4; every matmul spares as many FLOPs per value): attention, the later region's fc1, block 0's
    fc1, and of q, k, v, o (ties within a region: graph order) q. Loss and gradients equal eager's."""
    model, x = _example()
    reference = copy.deepcopy(model)
    spec = {"regions": ["layers.0", "layers.1.mlp"], "save": "auto", "budget": 10 / 13, "budget_over": "device"}
    pm = dpcompile.transform(model, ["cpu"], activation_checkpointing=spec)
    assert "of each device's regions" in pm.strategies["activation_checkpointing"]
    for d in range(1):
        for region, expected in ((f"layers_0_dev{d}", ["layers_0_attn_q", "scaled_dot_product_attention", "layers_0_mlp_fc1"]),
                                 (f"layers_1_mlp_dev{d}", ["layers_1_mlp_fc1"])):  # fmt: skip
            lines = pm.get_submodule(f"{region}_region").code.splitlines()
            kept = [lines[i + 1].split(" = ")[0].strip() for i, line in enumerate(lines[:-1]) if "keep_outputs(True)" in line]
            assert kept == [f"{name}_dev{d}" for name in expected]
    _assert_equals_eager(pm, model, reference, x)


@pytest.mark.parametrize(
    ("spec", "words"),
    [({"regions": True, "tiles": 0}, "whole number of token slices"),
     ({"regions": True, "tiles": 2.5}, "whole number of token slices"),
     ({"regions": True, "save": "matmuls", "budget_over": "device"}, "with 'save': 'auto'"),
     ({"regions": True, "save": "auto", "budget_over": "model"}, "'region'")],
)  # fmt: skip
def test_bad_tiles_or_scope_says_what_to_give(spec, words):
    model, _ = _example()
    with pytest.raises(ValueError, match=words):
        dpcompile.transform(model, ["cpu"], activation_checkpointing=spec)
