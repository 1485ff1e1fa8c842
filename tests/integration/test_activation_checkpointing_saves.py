"""``activation_checkpointing={"regions": ..., "save": rule}``: a recomputed region keeps the outputs of
the ops its rule names (selective checkpointing): which ones, that gradients equal eager's, and that
kept ops are not run again while the measured peak lands between no checkpointing and full recompute."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import dpcompile
from passes.checkpoint_budget import kept_for_rule


class Attention(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d), nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Stack(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _example(dtype=torch.float64) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Stack().to(dtype), torch.randn(4, 8, 16, dtype=dtype)


def _kept_names(rule: str) -> set[str]:
    gm = fx.symbolic_trace(Block())
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    return {n.name for n in kept_for_rule(gm, nodes, rule)}


def test_matmuls_keeps_the_matmuls_and_attention_backward_reads():
    # fc2's output only feeds the residual add, which backward does not read: it keeps nothing;
    # o's feeds the add that ln2 reads, so it is kept
    assert _kept_names("matmuls") == {"attn_q", "attn_k", "attn_v", "scaled_dot_product_attention", "attn_o", "fc1"}


@pytest.mark.parametrize(
    ("budget", "kept"),
    [(0.0, set()),
     (1 / 9, {"scaled_dot_product_attention"}),  # 1 of 9 widths: attention first
     (7 / 9, {"attn_q", "attn_k", "scaled_dot_product_attention", "fc1"}),  # torchtitan's bytes, its FLOPs spared
     (1.0, {"attn_q", "attn_k", "attn_v", "scaled_dot_product_attention", "attn_o", "fc1"})],
)  # fmt: skip
def test_auto_keeps_what_spares_the_most_flops_within_the_budget(budget, kept):
    # candidates q, k, v, attention, o (width 16) and fc1 (64): 9 units of 16
    assert _kept_names(f"auto:{budget}") == kept


def test_auto_knapsack_prefers_flops_over_count():
    from passes.checkpoint_budget import SaveCandidate, choose_saves

    graph = fx.Graph()
    nodes = [graph.placeholder(f"n{i}") for i in range(3)]
    wide, small, cheap = (
        SaveCandidate(nodes[0], 4, 40, False),
        SaveCandidate(nodes[1], 3, 24, False),
        SaveCandidate(nodes[2], 1, 1, False),
    )
    # 4 of 8 units: the wide one (40 FLOPs), not the small and the cheap one (25) a greedy count would take
    assert choose_saves([small, cheap, wide], 0.5) == [wide]
    assert choose_saves([small, cheap, wide], 1.0) == [small, cheap, wide]


def test_auto_prices_an_aten_graph_by_its_recorded_tensors():
    # x @ w1 (8 values a row from 4) -> tanh -> @ w2 (32 from 8) -> tanh: no modules, only meta["val"];
    # per value kept, the second spares twice the FLOPs of the first (inner 8 against 4)
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x, w1, w2: torch.tanh(torch.tanh(x @ w1) @ w2))(torch.randn(5, 4), torch.randn(4, 8),
                                                                         torch.randn(8, 32))  # fmt: skip
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    first, second = (n.name for n in nodes if n.target is torch.ops.aten.mm.default)
    assert {n.name for n in kept_for_rule(gm, nodes, "auto:0.2")} == {first}  # 8 of 40 values: only the first fits
    assert {n.name for n in kept_for_rule(gm, nodes, "auto:0.8")} == {second}  # 32: the one sparing more


def test_every_second_matmul_is_torchtitans_rule():
    assert _kept_names("every_second_matmul") == {"attn_q", "attn_v", "fc1", "scaled_dot_product_attention"}
    assert _kept_names("nothing") == set()


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("rule", ["matmuls", "every_second_matmul", "auto"])
def test_gradients_equal_eager(rule, devices):
    model, x = _example()
    eager = copy.deepcopy(model)
    eager(x).sum().backward()
    spec = {"regions": True, "save": rule} | ({"budget": 0.4} if rule == "auto" else {})
    pm = dpcompile.transform(model, ["cpu"] * devices, activation_checkpointing=spec)
    out = pm(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager(x), rtol=0, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    assert "saving = True" in pm.code
    region = next(m for n, m in pm.named_children() if n.endswith("_region"))
    assert "dpcompile_runtime_keep_outputs(True)" in region.code
    assert "keeping" in pm.strategies["activation_checkpointing"]


@pytest.mark.parametrize("layout", [{"pipeline": 2, "micro_batches": 2}, {"tensor_parallel": True}], ids=["pp", "tp"])
def test_composes_with_pipeline_and_tensor_parallel(layout):
    model, x = _example()
    eager = copy.deepcopy(model)
    eager(x).sum().backward()
    spec = {"regions": True, "save": "matmuls"}
    pm = dpcompile.transform(model, ["cpu"] * 2, activation_checkpointing=spec, example_inputs=(x,), **layout)
    out = pm(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager(x), rtol=0, atol=1e-12)
    reference = dict(eager.named_parameters())
    whole = [(n, p) for n, p in pm.named_parameters() if n in reference]  # tp: the unsharded ones (norms, biases)
    assert whole
    for name, p in whole:
        torch.testing.assert_close(p.grad, reference[name].grad, rtol=1e-10, atol=1e-12, msg=name)
    regions = [m for n, m in pm.named_children() if n.endswith("_region")]
    assert any("dpcompile_runtime_keep_outputs(True)" in m.code for m in regions)


def _step(pm, x) -> tuple[int, int, int]:
    """FLOPs of one training step, the peak bytes dpcompile.measure reports, and the activation
    bytes explain predicts."""
    with FlopCounterMode(display=False) as flops:
        pm(x).sum().backward()
    for p in pm.parameters():
        p.grad = None
    m = dpcompile.measure(pm, x)
    return flops.get_total_flops(), max(m.peak_bytes.values()), max(k["activations"] for k in m.memory_estimate.values())


def test_kept_ops_are_not_recomputed_and_the_peak_is_between():
    model, x = _example(torch.float32)
    figures = {
        rule: _step(dpcompile.transform(copy.deepcopy(model), ["cpu"], activation_checkpointing=spec), x)
        for rule, spec in [("none", False), ("nothing", True),
                           ("matmuls", {"regions": True, "save": "matmuls"}),
                           ("every_second_matmul", {"regions": True, "save": "every_second_matmul"}),
                           ("auto", {"regions": True, "save": "auto", "budget": 7 / 9})]
    }  # fmt: skip
    flops = {rule: f for rule, (f, _, _) in figures.items()}
    peak = {rule: p for rule, (_, p, _) in figures.items()}
    predicted = {rule: a for rule, (_, _, a) in figures.items()}
    assert flops["matmuls"] == flops["none"]  # every matmul kept: only free ops run again
    assert flops["none"] < flops["every_second_matmul"] < flops["nothing"]
    assert peak["nothing"] < peak["every_second_matmul"] < peak["matmuls"] < peak["none"]
    # explain counts what a save rule keeps (the checkpoint's own store, not autograd's saved tensors): the
    # planner's prediction at the peak for no checkpointing and for keeping nothing, the program count for
    # the rules the planner does not predict (docs/memory.md)
    assert predicted["nothing"] < predicted["none"]
    assert predicted["every_second_matmul"] < predicted["matmuls"]
    # at torchtitan's bytes (7 of 9 widths kept) the knapsack spares as many FLOPs: every matmul costs as
    # much per value kept (2 x its inner width, 16 here), so no other choice of the same bytes does better
    assert flops["auto"] == flops["every_second_matmul"]
    assert peak["auto"] == peak["every_second_matmul"]


@pytest.mark.parametrize(
    ("spec", "words"),
    [({"regions": True, "save": "everything"}, "is not a rule"),
     ({"save": "matmuls"}, "'regions'"),
     ({"regions": True, "keep": "matmuls"}, "'regions'"),
     ({"regions": False, "save": "matmuls"}, "give True"),
     ({"regions": True, "save": "auto", "budget": 1.5}, "a fraction from 0"),
     ({"regions": True, "save": "matmuls", "budget": 0.5}, "goes with 'save': 'auto'"),
     ({"regions": True, "save": "matmuls", "budget_bytes": "1MiB"}, "'budget_bytes' goes with 'save': 'auto'"),
     ({"regions": "layers.0", "save": "matmuls"}, r"a list of module paths \(a list: \['layers.0'\]\)")],
)  # fmt: skip
def test_bad_spec_says_what_to_give_and_builds_nothing(spec, words):
    model, x = _example()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=words):
        dpcompile.transform(model, ["cpu"], activation_checkpointing=spec)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
