"""The planner on the layouts that split the sequence: context parallel (``mesh={"cp": N}``) and tensor
parallel with ``sequence_parallel=True``, predicted per device against ``dpcompile.measure``, and
chosen by ``plan="auto"`` where a long sequence makes context parallel the fastest that fits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile.analysis.layout_costs import LayoutSpec
from dpcompile.planner import plan_layouts

pytestmark = pytest.mark.filterwarnings("ignore:.*would run whole")


@pytest.fixture(autouse=True)
def _reference_constants(monkeypatch):
    monkeypatch.setenv("DPCOMPILE_CALIBRATION", "off")


class Block(nn.Module):
    """Pre-norm causal attention (q, k, v apart: Megatron's pairs) and an MLP."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4, layers: int = 2, max_seq: int = 256, dropout: float = 0.0) -> None:
        super().__init__()
        self.pos = nn.Embedding(max_seq, d)
        self.layers = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))

    def forward(self, x):
        x = x + self.pos(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _decoder(**options) -> nn.Module:
    torch.manual_seed(0)
    return Decoder(**options)


def _predicted(model: nn.Module, x: torch.Tensor, labels: list[str], spec: LayoutSpec | None = None, budget: int = 1 << 40):
    return plan_layouts(model, labels, dict.fromkeys(labels, budget), optimizer="sgd", training=True, example_inputs=(x,),
                        example_kwargs=None, device=torch.device("cpu"), specs=None if spec is None else [spec])  # fmt: skip


def _within(predicted: dict[str, dict[str, int]], measured: dict[str, int], devices: list[str]) -> None:
    for d in devices:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.10 * measured[d], (d, total, measured[d])


CP2_REPLICA_GRADIENTS = pytest.mark.xfail(strict=True, reason=(
    "measure now counts each device's backward nodes on their own device (the pipeline fix): device 1's real "
    "replicas hold their gradients until the replicate's backward sums them, which the cp prediction leaves out "
    "(16% under on cpu#1)"))  # fmt: skip


@pytest.mark.parametrize(("mesh", "batch"), [pytest.param({"cp": 2}, 1, marks=CP2_REPLICA_GRADIENTS),
                                             ({"dp": 2, "cp": 2}, 2)], ids=["cp2", "dp2xcp2"])  # fmt: skip
def test_context_parallel_prediction_against_measure(mesh, batch):
    """64 tokens, every device within 10%: cp over 2 devices with real replicas (as distinct devices hold
    them), and 2 dp copies of it (built on virtual devices only: the copies share one set of gradients).
    (cp on 4 devices: the first also sums the replicas' gradients, which is not predicted: measured 34%
    over there, the others 2-6%.)"""
    x = torch.randn(batch, 64, 32)
    n = 4 if "dp" in mesh else 2
    labels = [f"cpu#{i}" for i in range(n)]
    (candidate,) = _predicted(_decoder(), x, labels, LayoutSpec(tuple(mesh.items()))).candidates
    pm = dpcompile.transform(_decoder(), ["cpu"] * n, mesh=mesh, example_inputs=(x,), copy_replicas="dp" not in mesh)
    _within(candidate.per_device, dpcompile.measure(pm, x).peak_bytes, labels)


def test_sequence_parallel_prediction_against_measure():
    """tp with sequence parallel over 4 devices, 64 tokens: every device within 10%."""
    x = torch.randn(1, 64, 32)
    labels = [f"cpu#{i}" for i in range(4)]
    spec = LayoutSpec((("tp", 4),), sequence_parallel=True)
    (candidate,) = _predicted(_decoder(), x, labels, spec).candidates
    pm = dpcompile.transform(_decoder(), ["cpu"] * 4, tensor_parallel=True, sequence_parallel=True, example_inputs=(x,))
    _within(candidate.per_device, dpcompile.measure(pm, x).peak_bytes, labels)


def _long_sequence() -> torch.Tensor:
    return torch.randn(1, 192, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def test_plan_auto_chooses_context_parallel_for_a_long_sequence():
    """Batch 1, 192 tokens, a budget data parallel and tensor parallel do not fit: context parallel is
    the fastest of those that fit (it splits every layer's tokens; tp with sequence parallel fits too,
    slower), and its step equals eager's (loss, every gradient)."""
    x = _long_sequence()
    planned = _predicted(_decoder().double(), x, ["cpu#0", "cpu#1"])
    by_name = {c.spec.name: c for c in planned.candidates}
    budget = by_name["cp2"].peak
    assert by_name["tp2"].peak > budget and by_name["dp2"].peak > budget >= by_name["tp2+sp"].peak
    model = _decoder().double()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), memory_per_device=budget, optimizer="sgd",
                             plan="auto")  # fmt: skip
    assert pm.layout == {"cp": 2} and pm.memory_plan.peak == budget
    assert pm.recipe.context_memory_headroom == 0  # the budget's room beyond the prediction, for the exchange
    rows = {c["name"]: c for c in dpcompile.explain(pm, x).candidates}
    assert rows["cp2"]["rejected"] is None and rows["tp2"]["rejected"].startswith("does not fit")
    assert rows["tp2+sp"]["rejected"].startswith("fits, but predicted slower than cp2")
    loss = pm(x)
    loss.backward()
    expected = eager(x)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class ReversedPositions(Decoder):
    """Positions read backwards: a value attention reads that no rule splits (context parallel refuses it)."""

    def forward(self, x):
        x = x + self.pos(torch.arange(x.shape[1], device=x.device)).flip(0)
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_a_context_parallel_layout_that_cannot_be_built_is_passed_over():
    """Where the context-parallel pass refuses the model, cp2 is marked with its reason and the next
    fastest that fits is built."""
    x = _long_sequence().float()
    torch.manual_seed(0)
    model = ReversedPositions()
    budget = {c.spec.name: c for c in _predicted(model, x, ["cpu#0", "cpu#1"]).candidates}["cp2"].peak
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), memory_per_device=budget, optimizer="sgd",
                             plan="auto")  # fmt: skip
    rows = {c.spec.name: c for c in pm.candidates}
    assert rows["cp2"].rejected.startswith("predicted to fit, but could not be built: context parallel: attention")
    (chosen,) = [c for c in pm.candidates if c.rejected is None]
    assert pm.layout == chosen.layout != {"cp": 2} and chosen.peak <= budget


def test_a_sequence_layout_the_planner_does_not_predict_is_refused_beside_a_budget():
    """cp x tp is built, but not predicted: memory_per_device= beside it is refused by name, not guessed."""
    x = torch.randn(1, 16, 32)
    with pytest.raises(dpcompile.DpCompileError, match=r"does not predict cp2xtp2 yet.*leave memory_per_device= out"):
        dpcompile.transform(_decoder(), ["cpu"] * 4, mesh={"cp": 2, "tp": 2}, example_inputs=(x,),
                            memory_per_device="1GiB")  # fmt: skip
