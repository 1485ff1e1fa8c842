"""Memory plans estimate the program they would build: its own plan, leaf modules and dtypes; the
optimizer's state in the parameters' dtype; a no-fit error whose suggestions fit when followed;
meta models."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.analysis.memory import optimizer_bytes, parse_budget
from dpcompile.errors import DpCompileError


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    """Half its Linear weights sit in a Block: whole under tensor parallelism when Block is a leaf."""

    def __init__(self):
        super().__init__()
        self.blk, self.fc, self.out = Block(), nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return self.out(torch.relu(self.fc(self.blk(x))))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def _peak(pm, x) -> int:
    return max(sum(kinds.values()) for kinds in dpcompile.explain(pm, x).memory_estimate.values())


X = torch.randn(8, 64)
pytestmark = pytest.mark.filterwarnings("ignore:.*would run whole")


def test_memory_plan_counts_leaf_module_linears_whole():
    """Block's Linears stay whole under leaf_modules=[Block]: 600 KiB fits no program (the old rule
    of thumb split them and chose a tensor-parallel program whose own estimate is 794 KiB)."""
    with pytest.raises(DpCompileError, match="no program fits"):
        dpcompile.transform(_net(), ["cpu", "cpu"], example_inputs=(X,), memory_per_device="600KiB",
                            optimizer="adamw", leaf_modules=[Block])  # fmt: skip


def test_memory_plan_counts_a_partial_plan_as_given():
    """An explicit plan that shards one layer of two is estimated as that program, not as every Linear split."""
    # the rule of thumb (both split): 266.50 KiB per device; the program ('2' whole): 395.00 KiB
    with pytest.raises(DpCompileError, match="no program fits"):
        dpcompile.transform(_mlp(), ["cpu", "cpu"], example_inputs=(X,), memory_per_device="300KiB",
                            optimizer="adamw", tensor_parallel={"0": "column"})  # fmt: skip
    pm = dpcompile.transform(_mlp(), ["cpu", "cpu"], example_inputs=(X,), memory_per_device="400KiB",
                             optimizer="adamw", tensor_parallel={"0": "column"})  # fmt: skip
    assert pm.plan["2"] == "replicate" and 300 * 1024 < _peak(pm, X) <= 400 * 1024


@pytest.mark.parametrize("budget_kib", [560, 800, 1300])
def test_memory_plan_fits_by_the_programs_own_estimate(budget_kib):
    """Whenever the planner says a program fits, that program's explain estimate is within the
    budget, and the plan's estimate is the program's own."""
    try:
        pm = dpcompile.transform(_net(), ["cpu", "cpu"], example_inputs=(X,), memory_per_device=f"{budget_kib}KiB",
                                 optimizer="adamw", leaf_modules=[Block])  # fmt: skip
    except DpCompileError:
        assert budget_kib < 800  # 794.04 KiB is the least that fits
        return
    estimate = dpcompile.explain(pm, X).memory_estimate
    assert _peak(pm, X) <= budget_kib * 1024
    if pm.strategy == "tensor_parallel":
        assert pm.memory_plan.per_device == estimate
    else:  # the plan counts the larger share of an uneven batch split: never less than explain
        assert all(sum(pm.memory_plan.per_device[d].values()) >= sum(k.values()) for d, k in estimate.items())


def test_memory_plan_optimizer_state_in_the_parameter_dtype():
    """AdamW keeps exp_avg and exp_avg_sq in a bf16 model's bf16 (plus a float32 step each):
    the estimate equals the bytes of the real state after a step."""
    model = _mlp().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    model(X.to(torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    real = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert optimizer_bytes(list(model.parameters()), "adamw") == real
    pm = dpcompile.transform(_mlp().to(torch.bfloat16), ["cpu", "cpu"], example_inputs=(X.to(torch.bfloat16),),
                             memory_per_device="1MiB", optimizer="adamw")  # fmt: skip
    assert pm.memory_plan.per_device["cpu#0"]["optimizer"] == real


def _mlp_norm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.LayerNorm(64))


@pytest.mark.parametrize(
    ("make", "x", "budget", "leaves"),
    [(_mlp_norm, torch.randn(20, 64), 200_000, ()), (_net, X, "600KiB", (Block,))],
    ids=["budget-rounded-up", "leaf-modules"],
)
def test_memory_plan_no_fit_suggestions_fit_when_followed(make, x, budget, leaves):
    """The no-fit error's budget (rounded up, never down) and device count each give a program that fits."""
    options = {"example_inputs": (x,), "optimizer": "adamw", "leaf_modules": leaves}
    with pytest.raises(DpCompileError) as caught:
        dpcompile.transform(make(), ["cpu", "cpu"], memory_per_device=budget, **options)
    message = str(caught.value)
    least = re.search(r"a budget of at least ([0-9.]+ [KMG]iB)", message)
    count = re.search(r"over (\d+) devices would fit", message)
    assert least and count, message
    for devices, limit in ((["cpu", "cpu"], least.group(1)), (["cpu"] * int(count.group(1)), budget)):
        pm = dpcompile.transform(make(), devices, memory_per_device=limit, **options)
        assert _peak(pm, x) <= parse_budget(limit)


@pytest.mark.parametrize(("budget", "strategy"), [("1MiB", "data_parallel"), ("400KiB", "tensor_parallel")])
def test_memory_plan_of_a_meta_model(budget, strategy):
    """A model built on meta plans with example inputs (no device mismatch) exactly as the same
    model built for real, and waits for its weights."""
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    pm = dpcompile.transform(meta, ["cpu", "cpu"], example_inputs=(X,), memory_per_device=budget, optimizer="adamw")
    real = dpcompile.transform(_mlp(), ["cpu", "cpu"], example_inputs=(X,), memory_per_device=budget, optimizer="adamw")
    assert pm.strategy == real.strategy == strategy and pm.needs_weights
    assert pm.memory_plan.per_device == real.memory_plan.per_device


class Residual(nn.Module):
    """Four residual MLP blocks and a classification loss: a model a pipeline cuts between blocks."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4))
        self.head = nn.Linear(64, 10)

    def forward(self, x, labels):
        for layer in self.layers:
            x = x + layer(x)
        return nn.functional.cross_entropy(self.head(x), labels)


NAMED_LAYOUTS = [
    (2, {"pipeline": 2}),
    (2, {"pipeline": 2, "micro_batches": 4, "schedule": "1f1b"}),
    (4, {"mesh": {"pp": 2, "dp": 2}}),
    (4, {"mesh": {"dp": 2, "tp": 2}}),
]


@pytest.mark.parametrize(("n", "layout"), NAMED_LAYOUTS, ids=["pp", "pp_1f1b", "pp_dp", "dp_tp"])
def test_memory_plan_of_a_named_layout_is_within_30_percent_of_measure(n, layout):
    """memory_per_device= with a pipeline or dp copies builds that layout and predicts every device's
    bytes; on each device measure reports (every dp copy's devices) the prediction is within 30% of
    one measured training step."""
    torch.manual_seed(0)
    x, labels = torch.randn(32, 64), torch.randint(0, 10, (32,))
    pm = dpcompile.transform(Residual(), ["cpu"] * n, memory_per_device="1GiB", example_inputs=(x, labels), **layout)
    predicted = {d: sum(kinds.values()) for d, kinds in pm.memory_plan.per_device.items()}
    assert sorted(predicted) == [f"cpu#{i}" for i in range(n)]
    measured = dpcompile.measure(pm, x, labels).peak_bytes
    for device, peak in measured.items():
        assert abs(predicted[device] - peak) <= 0.3 * peak, (device, predicted, measured)


def test_memory_plan_of_a_named_layout_that_does_not_fit_says_the_budget_and_builds_nothing():
    """A pp x dp layout over a budget it exceeds: the error names the layout, the device and the
    budget that fits (which then builds); the model is left as it was."""
    torch.manual_seed(0)
    model, x, labels = Residual(), torch.randn(32, 64), torch.randint(0, 10, (32,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DpCompileError, match=r"layout pp2xdp2 gpipe mb1 does not fit: .* predicted on cpu#\d > "
                                             r"100.00 KiB; the way out: a budget of at least ([\d.]+ KiB)") as caught:
        dpcompile.transform(model, ["cpu"] * 4, mesh={"pp": 2, "dp": 2}, memory_per_device="100KiB",
                            example_inputs=(x, labels))  # fmt: skip
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    budget = re.search(r"at least ([\d.]+ KiB)", str(caught.value)).group(1).replace(" ", "")
    pm = dpcompile.transform(model, ["cpu"] * 4, mesh={"pp": 2, "dp": 2}, memory_per_device=budget,
                             example_inputs=(x, labels))  # fmt: skip
    assert pm.layout == {"pp": 2, "dp": 2}


def test_memory_plan_without_a_layout_lists_what_it_weighed_in_explain():
    """API.md: explain(pm, x).candidates lists what memory_per_device= considered; without plan= it was
    empty. Data parallel where it fits (tensor parallel not weighed), else the tensor-parallel program."""
    fits = dpcompile.transform(_mlp(), ["cpu", "cpu"], example_inputs=(X,), memory_per_device="1GiB")
    rows = dpcompile.explain(fits, X).candidates
    assert [(r["name"], r["rejected"] is None, r["fits"]) for r in rows] == [("dp2", True, True), ("tp2", False, False)]
    assert rows[0]["predicted_peak_bytes"] == max(sum(k.values()) for k in fits.memory_plan.per_device.values())
    assert rows[1]["rejected"].startswith("not weighed: data parallel fits")
    replica = rows[0]["predicted_peak_bytes"]
    sharded = dpcompile.transform(_mlp(), ["cpu", "cpu"], example_inputs=(X,), memory_per_device=replica - 1)
    assert sharded.strategy == "tensor_parallel"
    rows = dpcompile.explain(sharded, X).candidates
    assert rows[0]["rejected"] == f"does not fit: {rows[0]['predicted_peak_bytes'] / 1024:.2f} KiB predicted on cpu#0 > {(replica - 1) / 1024:.2f} KiB"
    assert rows[1]["rejected"] is None and rows[1]["fits"] and rows[1]["predicted_peak_bytes"] < replica


def test_memory_budgets_by_device_take_explains_labels_and_refuse_unknown_keys():
    """{device: budget}: virtual devices' labels ("cpu#0", as explain keys them) were refused by parse_device,
    and a key naming no device of the list was silently ignored."""
    pm = dpcompile.transform(_mlp(), ["cpu", "cpu"], example_inputs=(X,), memory_per_device={"cpu#0": "1GiB", "cpu#1": "1GiB"})
    assert pm.strategy == "data_parallel" and set(pm.memory_plan.per_device) == {"cpu#0", "cpu#1"}
    with pytest.raises(dpcompile.ArgumentError, match=r"names \['cpu:0', 'cpu:1'\], not among the devices; has no budget "
                       r"for \['cpu#0', 'cpu#1'\]; key it by device \(\['cpu'\]\) or by explain's device label"):  # fmt: skip
        dpcompile.transform(_mlp(), ["cpu", "cpu"], example_inputs=(X,), memory_per_device={"cpu:0": 1 << 30, "cpu:1": 1 << 30})
