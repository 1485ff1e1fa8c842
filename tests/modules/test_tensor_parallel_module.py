"""Tests of ``transform(..., tensor_parallel=...)`` and the ``ParallelModule`` it returns, holding its shards."""

from __future__ import annotations

import copy
import io
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dpcompile
from dpcompile.modules.base import ParallelModule
from dpcompile.runtime.tensor_parallel import unshard
from tests.models import MLP, OptionalScale


class Block(nn.Module):
    """A transformer block from nn.Linear: attention (q/k/v, out), MLP, residuals, LayerNorm."""

    def __init__(self, d: int = 16, heads: int = 4, sdpa: bool = False):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        h = self.ln1(x)
        q = self.q(h).view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = self.k(h).view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = self.v(h).view(b, t, self.heads, c // self.heads).transpose(1, 2)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = ((q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5).softmax(dim=-1) @ v
        x = x + self.out(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


BLOCK_PLAN = {"q": "column", "k": "column", "v": "column", "out": "row", "fc1": "column", "fc2": "row"}


def full_grads(pm: ParallelModule) -> dict[str, torch.Tensor]:
    """The gradients of pm's parameters under the original names, shards put back together."""
    own = dict(pm.named_parameters())
    grads = {}
    for key, (spec, names) in pm.param_shards.items():
        grads[key] = unshard([own[n].grad for n in names], spec, "cpu")
    for name, p in own.items():
        if pm.shard_param_slots[name] is None:
            grads[name] = p.grad
    return grads


def check_matches_eager(model: nn.Module, pm: ParallelModule, x: torch.Tensor) -> None:
    """Forward output, input gradient and every parameter gradient equal the eager model's."""
    xe, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, out = model(xe), pm(xp)
    torch.testing.assert_close(out, ref)
    ref.square().sum().backward()
    out.square().sum().backward()
    torch.testing.assert_close(xp.grad, xe.grad)
    grads = full_grads(pm)
    assert set(grads) == {k for k, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=f"gradient of {name}")


# ---------------------------------------------------------------------- numerics
@pytest.mark.parametrize("styles", list(itertools.product(["column", "row", "replicate"], repeat=2)))
def test_transform_matches_eager_for_every_style_pair(styles):
    """All nine style combinations of a two-layer MLP give eager's outputs and gradients."""
    model = MLP(8, 16)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=dict(zip(["fc1", "fc2"], styles)), example_inputs=(torch.randn(4, 8),))
    check_matches_eager(model, pm, torch.randn(4, 8))


@pytest.mark.parametrize("styles", [("column", "row"), ("row", "column"), ("column", "column")])
def test_transform_matches_eager_with_uneven_shards(styles):
    """10 hidden features over 3 devices (4 + 3 + 3) give eager's outputs and gradients."""
    model = MLP(7, 10, 5)
    pm = dpcompile.transform(model, ["cpu"] * 3, tensor_parallel=dict(zip(["fc1", "fc2"], styles)))
    assert pm.param_shards["fc1.weight"][0].sizes == (4, 3, 3) or pm.param_shards["fc1.weight"][0].sizes == (3, 2, 2)
    check_matches_eager(model, pm, torch.randn(6, 7))


@pytest.mark.parametrize("d, heads, n, sdpa", [(16, 4, 2, False), (12, 3, 2, False), (16, 4, 4, True), (12, 3, 3, True)])
def test_transform_matches_eager_on_a_transformer_block(d, heads, n, sdpa):
    """q/k/v column, out row, MLP column→row, residuals and LayerNorm match eager, even heads uneven."""
    model = Block(d, heads, sdpa)
    x = torch.randn(2, 5, d)
    pm = dpcompile.transform(model, ["cpu"] * n, tensor_parallel=BLOCK_PLAN, example_inputs=(x,))
    assert pm.plan == BLOCK_PLAN
    check_matches_eager(model, pm, x)


def test_transform_block_needs_only_two_all_reduces_each_way():
    """The Megatron block moves one all-reduce per sublayer forward and one per sublayer backward."""
    pm = dpcompile.transform(Block(), ["cpu"] * 2, tensor_parallel=BLOCK_PLAN, example_inputs=(torch.randn(2, 5, 16),))
    kinds = [(n.meta["dpcompile_comm"].kind, n.meta["dpcompile_comm"].backward) for n in pm.graph.nodes
             if "dpcompile_comm" in n.meta and not n.meta["dpcompile_comm"].io]  # fmt: skip
    assert kinds == [("identity", "all_reduce"), ("all_reduce", None)] * 2
    assert "gather_to_device" not in pm.code


def test_transform_block_keeps_heads_whole_when_they_cannot_split():
    """3 heads over 4 devices: q, k, v stay replicated and pm.plan_reasons says why; outputs still match."""
    model = Block(12, 3)
    x = torch.randn(2, 5, 12)
    pm = dpcompile.transform(model, ["cpu"] * 4, tensor_parallel=BLOCK_PLAN, example_inputs=(x,))
    assert [pm.plan[p] for p in ("q", "k", "v", "out")] == ["replicate", "replicate", "replicate", "row"]
    assert "do not split into 3 x 4" in pm.plan_reasons["q"]
    check_matches_eager(model, pm, x)


def test_transform_leaves_the_user_model_untouched():
    """The model's parameters keep their identity and values; pm owns new tensors."""
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True)
    assert list(model.parameters()) == params
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not {id(p) for p in pm.parameters()} & {id(p) for p in params}


# ---------------------------------------------------------------------- automatic plan
def test_auto_plan_pairs_an_mlp_column_then_row():
    """tensor_parallel=True shards an MLP column then row, with reasons."""
    pm = dpcompile.transform(MLP(32, 128), ["cpu"] * 2, tensor_parallel=True, example_inputs=(torch.randn(64, 32),))
    assert pm.plan == {"fc1": "column", "fc2": "row"}
    assert "stays sharded into row layer(s) 'fc2'" in pm.plan_reasons["fc1"]


def test_auto_plan_picks_row_for_a_lone_1000_to_500_layer():
    """X[128x1000] @ W[1000x500]: row (128,000 elements) beats column (160,000)."""
    pm = dpcompile.transform(nn.Sequential(nn.Linear(1000, 500)), ["cpu"] * 2, tensor_parallel=True, example_inputs=(torch.randn(128, 1000),))
    assert pm.plan == {"0": "row"}
    assert pm.comm_cost.total == 128_000


def test_auto_plan_picks_column_for_a_widening_lone_layer():
    """A lone 500→1000 layer is cheaper column-wise (its input is the smaller tensor)."""
    pm = dpcompile.transform(nn.Sequential(nn.Linear(500, 1000)), ["cpu"] * 2, tensor_parallel=True, example_inputs=(torch.randn(128, 500),))
    assert pm.plan == {"0": "column"}


def test_auto_plan_shards_a_transformer_block_megatron_style():
    """The automatic plan of a block is q/k/v column, out row, fc1 column, fc2 row."""
    pm = dpcompile.transform(Block(), ["cpu"] * 2, tensor_parallel=True, example_inputs=(torch.randn(2, 5, 16),))
    assert pm.plan == BLOCK_PLAN


def test_auto_plan_keeps_a_too_narrow_layer_whole_with_the_arithmetic():
    """A 3→2 layer over 4 devices cannot be split; the reason shows the numbers."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2), nn.ReLU(), nn.Linear(2, 3))
    pm = dpcompile.transform(model, ["cpu"] * 4, tensor_parallel=True)
    assert pm.plan["4"] == "replicate"
    assert "out_features(3) of '4' cannot be split over 4 devices" in pm.plan_reasons["4"]
    torch.testing.assert_close(pm(torch.ones(2, 8)), model(torch.ones(2, 8)))


# ---------------------------------------------------------------------- plan validation
@pytest.mark.parametrize(
    "plan, message",
    [
        ({"fc9": "row"}, r"'fc9', which is not a module of MLP; its nn.Linear layers are: 'fc1', 'fc2'"),
        ({"ln": "row"}, r"'ln', a LayerNorm, not an nn.Linear; its nn.Linear layers are: 'fc1', 'fc2'"),
        ({"fc1": "rows"}, r"unknown split style 'rows' for 'fc1'; valid styles: 'column', 'row', 'replicate'"),
    ],
)
def test_transform_rejects_bad_plans_listing_valid_choices(plan, message):
    """Unknown path, non-Linear and unknown style are ValueErrors naming what is valid."""
    model = MLP()
    model.ln = nn.LayerNorm(8)
    with pytest.raises(ValueError, match=message):
        dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=plan)


def test_transform_rejects_a_plan_that_is_not_a_dict():
    """tensor_parallel='column' is neither True nor a dict."""
    with pytest.raises(ValueError, match="expected False, True"):
        dpcompile.transform(MLP(), ["cpu"] * 2, tensor_parallel="column")


# ---------------------------------------------------------------------- state
def test_state_dict_has_the_model_keys_with_full_tensors():
    """pm.state_dict() has exactly the model's keys holding the same full tensors."""
    model = Block()
    pm = dpcompile.transform(model, ["cpu"] * 3, tensor_parallel=BLOCK_PLAN, example_inputs=(torch.randn(2, 5, 16),))
    sd, ref = pm.state_dict(), model.state_dict()
    assert list(sd) == list(ref)
    for key in ref:
        torch.testing.assert_close(sd[key], ref[key])


def test_state_dict_keeps_keys_of_layers_forward_never_calls():
    """An unused Linear still appears in the state dict, whole."""
    model = MLP()
    model.unused = nn.Linear(3, 3)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel={"fc1": "column", "unused": "row"})
    assert list(pm.state_dict()) == list(model.state_dict())
    assert "not called in forward" in pm.plan_reasons["unused"]


def test_load_state_dict_reshards_full_tensors():
    """Loading another model's state dict makes pm compute that model."""
    model, other = MLP(8, 10), MLP(8, 10)
    pm = dpcompile.transform(model, ["cpu"] * 3, tensor_parallel={"fc1": "column", "fc2": "row"})
    result = pm.load_state_dict(other.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    x = torch.randn(4, 8)
    torch.testing.assert_close(pm(x), other(x))
    torch.testing.assert_close(pm.state_dict()["fc1.weight"], other.fc1.weight)


def test_load_state_dict_strict_reports_missing_and_unexpected_keys():
    """A state dict with a wrong key is refused, naming it."""
    pm = dpcompile.transform(MLP(), ["cpu"] * 2, tensor_parallel=True)
    sd = pm.state_dict()
    sd["fc3.weight"] = sd.pop("fc2.weight")
    with pytest.raises(RuntimeError, match=r"missing keys \['fc2.weight'\], unexpected keys \['fc3.weight'\]"):
        pm.load_state_dict(sd)


def test_load_state_dict_rejects_a_wrong_size_with_the_arithmetic():
    """A full weight of the wrong width is refused, showing the expected size."""
    pm = dpcompile.transform(MLP(), ["cpu"] * 2, tensor_parallel={"fc1": "column"})
    sd = pm.state_dict()
    sd["fc1.weight"] = torch.zeros(15, 8)
    with pytest.raises(RuntimeError, match=r"size mismatch for fc1.weight: got \(15, 8\), the sharded parameter has 16 along dim 0"):
        pm.load_state_dict(sd)


def test_load_state_dict_of_a_parent_module_reshards_pm():
    """A module holding pm (and a root-Linear pm) loads its own state_dict: full tensors re-sharded."""
    model, other = MLP(8, 10), MLP(8, 10)
    pm = dpcompile.transform(model, ["cpu"] * 3, tensor_parallel={"fc1": "column", "fc2": "row"})
    lone = dpcompile.transform(nn.Linear(8, 6), ["cpu"] * 2, tensor_parallel={"": "column"})
    parent = nn.Sequential(pm, nn.ReLU(), lone)
    reference = nn.Sequential(other, nn.ReLU(), nn.Linear(8, 6))
    assert list(parent.state_dict()) == list(reference.state_dict())
    result = parent.load_state_dict(reference.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    x = torch.randn(4, 8)
    torch.testing.assert_close(parent(x), reference(x))
    bad = reference.state_dict()
    bad["0.fc1.weight"] = torch.zeros(9, 8)
    with pytest.raises(RuntimeError, match=r"size mismatch for 0.fc1.weight: got \(9, 8\)"):
        parent.load_state_dict(bad)


def test_torch_save_round_trips_a_tensor_parallel_module():
    """torch.save / torch.load(weights_only=False) give a module with the same plan, state and outputs."""
    model = Block(12, 3)
    x = torch.randn(2, 5, 12)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, ParallelModule) and loaded.mode == "tensor_parallel" and loaded.executor == "plain"
    assert loaded.param_shards == pm.param_shards and loaded.state_keys == pm.state_keys
    assert loaded.plan == pm.plan and loaded.plan_reasons == pm.plan_reasons
    assert loaded.shard_param_slots == pm.shard_param_slots
    torch.testing.assert_close(loaded(x), model(x))
    assert list(loaded.state_dict()) == list(model.state_dict())


def test_a_model_in_eval_mode_is_keyed_in_eval_and_its_torch_save_copy_runs():
    """transform of a model in eval mode keys its main program for eval (not mixed: the modules the
    passes make start in training mode), so a torch.save copy, which carries the main program's
    modes and their flip, runs the eval call it was made for."""
    model = MLP(8, 16).eval()
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel={"fc1": "column", "fc2": "row"})
    assert all(not training for _, training in pm.program_cache.main_key.modes)
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(3, 8)
    torch.testing.assert_close(loaded(x), model(x))


# ---------------------------------------------------------------------- memory and training
def test_parameters_are_the_shards_with_slots_recorded():
    """pm.parameters() are the shards plus the replicated rest; shard_param_slots says whose each is."""
    pm = dpcompile.transform(MLP(8, 16), ["cpu"] * 2, tensor_parallel={"fc1": "column", "fc2": "row"})
    assert pm.shard_param_slots == {
        "fc1.weight_shard0": 0, "fc1.weight_shard1": 1, "fc1.bias_shard0": 0, "fc1.bias_shard1": 1,
        "fc2.weight_shard0": 0, "fc2.weight_shard1": 1, "fc2.bias": None,
    }  # fmt: skip
    assert sum(p.numel() for p in pm.parameters()) == sum(p.numel() for p in MLP(8, 16).parameters())


def test_param_bytes_per_slot_is_sharded_over_n_plus_replicated():
    """Each slot holds 1/N of the sharded bytes plus all replicated bytes."""
    model = MLP(64, 256)
    pm = dpcompile.transform(model, ["cpu"] * 4, tensor_parallel={"fc1": "column", "fc2": "row"})
    sharded = 4 * (64 * 256 + 256 + 256 * 64)
    replicated = 4 * 64
    assert pm.param_bytes_per_slot() == dict.fromkeys(range(4), sharded // 4 + replicated)


def test_three_sgd_steps_match_eager_training():
    """SGD over pm.parameters() for three steps tracks SGD on the eager model."""
    model = Block(12, 3)
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(torch.randn(2, 5, 12),))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        x = torch.randn(2, 5, 12)
        for module, optimizer in ((pm, opt), (reference, opt_ref)):
            optimizer.zero_grad()
            module(x).square().mean().backward()
            optimizer.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(pm.state_dict()[key], value, msg=key)


def test_eval_and_train_switch_dropout_like_the_model():
    """pm.eval() turns sharded dropout off (outputs match eager); pm.train() turns it back on."""
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 8))
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True)
    x = torch.randn(4, 8)
    pm.eval()
    model.eval()
    torch.testing.assert_close(pm(x), model(x))
    pm.train()
    assert not torch.allclose(pm(x), model(x))


class TwoUses(nn.Module):
    """The hidden activations feed a row layer and are also returned (they must be gathered)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 10, bias=False)
        self.fc2 = nn.Linear(10, 6, bias=False)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        return self.fc2(h), h


def test_transform_gathers_a_sharded_value_that_is_also_returned():
    """A column output both paired with a row layer and returned: one all-gather, eager's numbers."""
    model = TwoUses()
    x = torch.randn(3, 6, requires_grad=True)
    pm = dpcompile.transform(model, ["cpu"] * 3, tensor_parallel={"fc1": "column", "fc2": "row"})
    assert pm.code.count("gather_to_device") == 1 and "split_to_devices" not in pm.code
    out, h = pm(x)
    ref_out, ref_h = model(x)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(h, ref_h)
    (out.sum() + h.square().sum()).backward()
    grad = x.grad.clone()
    x.grad = None
    (ref_out.sum() + ref_h.square().sum()).backward()
    torch.testing.assert_close(grad, x.grad)


def test_transform_returns_the_output_on_output_device():
    """Under FakeTensorMode with fake GPUs, output_device='cuda:1' gets the whole output there."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dpcompile.fake import fake_devices
    from dpcompile.recipes import TensorParallelRecipe

    model = MLP(8, 16)
    recipe = TensorParallelRecipe(devices=fake_devices(["cuda:0", "cuda:2"]), output_device=torch.device("cuda:1"), check_available=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        pm = recipe.compile(model, None)
        with torch.no_grad():
            out = pm(torch.randn(2, 8, device="cuda:0"))
    assert out.device == torch.device("cuda:1")
    assert "output_moved" in pm.code


class MaskedAttention(nn.Module):
    """GPT-2 style: a causal-mask buffer, masked_fill, dropout, k.size(-1) for the scale."""

    def __init__(self, d: int = 16, heads: int = 4, t: int = 6):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.proj = (nn.Linear(d, d) for _ in range(4))
        self.drop = nn.Dropout(0.0)
        self.register_buffer("mask", torch.tril(torch.ones(t, t)).view(1, 1, t, t))

    def forward(self, x):
        b, t, c = x.size()
        q = self.q(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = self.v(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / k.size(-1) ** 0.5)
        att = self.drop(F.softmax(att.masked_fill(self.mask == 0, float("-inf")), dim=-1))
        return self.proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))


def test_transform_matches_eager_on_masked_attention_without_gathers():
    """A replicated mask broadcast over the sharded heads is copied to the shards, not gathered; numbers match."""
    model = MaskedAttention()
    x = torch.randn(2, 6, 16)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    assert pm.plan == {"q": "column", "k": "column", "v": "column", "proj": "row"}
    assert "gather_to_device" not in pm.code
    mask_copy = next(n for n in pm.graph.nodes if n.name.endswith("_copy") and n.name != "x_copy")
    assert mask_copy.meta["dpcompile_comm"].backward is None  # a bool mask carries no gradient
    check_matches_eager(model, pm, x)


@settings(max_examples=15, deadline=None)
@given(
    widths=st.lists(st.integers(3, 12), min_size=2, max_size=5),
    styles=st.lists(st.sampled_from(["column", "row", "replicate"]), min_size=4, max_size=4),
    n=st.integers(2, 3),
    activation=st.sampled_from([nn.ReLU, nn.Tanh, nn.Identity]),
)
def test_transform_matches_eager_on_random_mlps(widths, styles, n, activation):
    """Random widths, depths, styles and device counts: outputs and gradients match eager."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [nn.Linear(a, b, bias=i % 2 == 0), activation()]
    model = nn.Sequential(*layers)
    plan = {str(2 * i): style for i, style in zip(range(len(widths) - 1), styles)}
    pm = dpcompile.transform(model, ["cpu"] * n, tensor_parallel=plan, example_inputs=(torch.randn(2, widths[0]),))
    check_matches_eager(model, pm, torch.randn(3, widths[0]))


class Stack(nn.Module):
    def __init__(self, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList([Block(16, 4) for _ in range(depth)])
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_auto_plan_searches_a_large_group_by_coordinate_descent():
    """Two blocks and a head (13 layers linked by the residual stream): Megatron per block, nested paths."""
    model = Stack(2)
    x = torch.randn(2, 5, 16)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    for i in range(2):
        assert {p.split(".")[-1]: s for p, s in pm.plan.items() if p.startswith(f"blocks.{i}.")} == BLOCK_PLAN
    assert "coordinate descent over its group of 13" in pm.plan_reasons["blocks.1.q"]
    check_matches_eager(model, pm, x)


def test_transform_runs_calls_that_leave_an_optional_argument_none():
    """pm(x) and pm(x, scale=s) both equal the model, in training and eval mode, on the same shards."""
    model, x, scale = OptionalScale(), torch.randn(4, 8), torch.full((8,), 2.0)
    pm = dpcompile.transform(model, ["cpu"] * 3, tensor_parallel=True)
    params = [p for p in pm.parameters()]
    for mode in (True, False):
        pm.train(mode)
        model.train(mode)
        torch.testing.assert_close(pm(x, scale=scale), model(x, scale=scale))
        torch.testing.assert_close(pm(x), model(x))
        torch.testing.assert_close(pm(x, None), model(x))
    pm(x).sum().backward()
    assert all(p.grad is not None for p in params)


@pytest.mark.parametrize("built", ["before_transform", "after_transform"])
def test_tensor_parallel_optimizer_over_the_models_parameters_is_refused(built):
    """An optimizer over model.parameters() (built before or after transform) would step nothing:
    its step raises, naming pm.parameters(); the model trained eagerly still steps."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if built == "before_transform" else None
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True)
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
    pm(torch.randn(6, 8)).sum().backward()
    with pytest.raises(dpcompile.DpCompileError, match=r"optimizer holds parameters of the MLP.*pm.parameters\(\)"):
        opt.step()
    model(torch.randn(6, 8)).sum().backward()
    opt.step()


def test_tensor_parallel_model_zero_grad_instead_of_pm_warns():
    """model.zero_grad() clears the model's gradients, not pm's: the next call (with gradients on)
    after a step that finds pm's gradients still there warns once, naming the fix;
    optimizer.zero_grad() and an evaluation under no_grad do not."""
    model = MLP()
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    x = torch.randn(6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            opt.zero_grad()
            pm(x).sum().backward()
            opt.step()
        with torch.no_grad():
            pm(x)  # an evaluation between steps
    model.zero_grad()  # the wrong module
    with pytest.warns(UserWarning, match=r"not cleared since the last optimizer step.*model.zero_grad\(\).*pm.zero_grad\(\)"):
        pm(x).sum().backward()
    opt.step()
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        pm(x)
