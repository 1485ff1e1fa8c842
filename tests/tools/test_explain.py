"""explain and its Report; the one communication-size rule, as explain applies it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import dpcompile
from dpcompile.analysis.cost import comm_elements
from dpcompile.infra import stamp_comm
from dpcompile.inspect import Report
from tests.models import MLP, BNNet, OptionalScale


class WholeTail(nn.Module):
    """After the batch-parallel part, a cumulative sum over the batch runs whole on devices[0]."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 64)

    def forward(self, x):
        return torch.cumsum(self.fc(x), 0) * 2 + 1


def _dp(model: nn.Module, n: int = 2) -> dpcompile.ParallelModule:
    return dpcompile.transform(model, ["cpu"] * n)


def _tensor_parallel(model: nn.Module, plan, devices, example):
    try:
        return dpcompile.transform(model, devices, tensor_parallel=plan, example_inputs=example)
    except (ImportError, ModuleNotFoundError) as e:
        pytest.skip(f"tensor parallelism not available yet: {e}")


def test_explain_places_nodes_on_their_devices():
    """Per-device nodes carry their slot's label, shape, dtype, pass and the user's source line."""
    report = dpcompile.explain(_dp(MLP()), torch.randn(16, 8))
    nodes = {n.name: n for n in report.nodes}
    assert report.devices == ["cpu#0", "cpu#1"]
    assert nodes["fc1_dev0"].device == "cpu#0" and nodes["fc1_dev1"].device == "cpu#1"
    assert nodes["fc1_dev1"].shape == [[8, 16]]
    assert nodes["fc1_dev1"].dtype == ["float32"]
    assert nodes["fc1_dev1"].pass_name == "insert_scatter_gather"
    assert nodes["x_scatter"].device == "*" and nodes["x_scatter"].comm == "scatter"
    assert nodes["fc1_dev1"].source.startswith("models.py:")  # the user line of tests/models.py


def test_explain_counts_io_apart_from_collectives():
    """DP Linear: replication is a collective (broadcast/reduce of 36 parameters); scatter and gather are io."""
    pm = dpcompile.transform(nn.Linear(8, 4), ["cpu", "cpu"], copy_replicas=True)
    report = dpcompile.explain(pm, torch.randn(16, 8))
    (replicas,) = [c for c in report.collectives if not c.io]
    assert (replicas.kind, replicas.backward_kind, replicas.elements) == ("broadcast", "reduce", 36)
    assert report.comm_elements_forward == 36 / 2 and report.comm_elements_backward == 36 / 2
    assert report.io_elements_forward == 16 * 8 / 2 + 16 * 4 / 2
    assert report.io_elements == report.io_elements_forward + report.io_elements_backward
    assert report.param_bytes == {"cpu#0": (32 + 4) * 4, "cpu#1": (32 + 4) * 4}


def test_explain_counts_batchnorm_sync_as_collective():
    """The BatchNorm statistics all-reduce moves 2*C elements: 2(N-1)/N*2C per device each way."""
    report = dpcompile.explain(_dp(BNNet()), torch.randn(10, 8))
    (sync,) = [c for c in report.collectives if c.name == "bn_sync"]
    assert sync.kind == "all_reduce" and sync.elements == 12
    assert sync.forward == 12 and sync.backward == 12
    others = [c for c in report.collectives if not c.io and c.name != "bn_sync"]
    assert report.comm_elements_forward == 12 + sum(c.forward for c in others)


def test_explain_leaves_batchnorm_statistics_untouched():
    """Explaining runs on fake tensors: running statistics and the batch counter do not move."""
    model = BNNet()
    pm = _dp(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = dpcompile.explain(pm, torch.randn(10, 8))
    assert report.shapes == "fake"
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_explain_falls_back_to_real_run_without_side_effects(monkeypatch):
    """Where fake tensors fail, a real no-grad run gives shapes and buffers are restored."""
    import torch._subclasses.fake_tensor as fake_tensor

    class Broken:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("no fake tensors today")

    monkeypatch.setattr(fake_tensor, "FakeTensorMode", Broken)
    model = BNNet()
    pm = _dp(model)
    before = model.bn.running_mean.clone()
    report = dpcompile.explain(pm, torch.randn(10, 8))
    assert report.shapes == "real"
    assert {n.name: n.shape for n in report.nodes}["fc_dev0"] == [[5, 6]]
    assert torch.equal(model.bn.running_mean, before)
    assert int(model.bn.num_batches_tracked) == 0


def test_explain_small_batch_explains_the_smaller_program():
    """A batch of 1 on 2 devices runs (and is explained) on one device."""
    report = dpcompile.explain(_dp(MLP()), torch.randn(1, 8))
    assert report.batch == 1
    assert not any(n.name.endswith("_dev1") for n in report.nodes)


def test_explain_without_inputs_reports_structure_only():
    """No arguments: placement and parameter bytes, no shapes."""
    report = dpcompile.explain(_dp(MLP()))
    assert report.shapes == "none"
    assert all(n.shape is None for n in report.nodes)
    assert report.param_bytes["cpu#1"] == sum(p.numel() * 4 for p in MLP().parameters())


def test_explain_shows_imbalance_of_whole_tail_on_primary():
    """Work done whole after a gather lands on devices[0]: activation imbalance above 1."""
    report = dpcompile.explain(_dp(WholeTail()), torch.randn(32, 8))
    assert report.activation_bytes["cpu#0"] > report.activation_bytes["cpu#1"]
    assert report.imbalance["activation_bytes"] > 1.2
    assert report.imbalance["param_bytes"] == 1.0


def test_explain_counts_matmul_flops_per_device():
    """FLOPs of a Linear split over 2 devices: 2*b/2*in*out each."""
    report = dpcompile.explain(_dp(nn.Linear(8, 4, bias=False)), torch.randn(16, 8))
    assert report.flops == {"cpu#0": 2 * 8 * 8 * 4, "cpu#1": 2 * 8 * 8 * 4}


def test_explain_report_round_trips_through_json():
    """to_dict() survives json and Report.from_dict gives the same table."""
    report = dpcompile.explain(_dp(BNNet()), torch.randn(10, 8))
    data = report.to_dict()
    again = json.loads(json.dumps(data))
    assert again == data
    for key in ("param_bytes", "comm_elements_forward", "comm_elements_backward", "io_elements", "plan", "nodes",
                "collectives"):
        assert key in again
    assert str(Report.from_dict(again)) == str(report)


def test_explain_table_fits_in_120_columns():
    """Every line of str(report) is at most 120 characters."""
    report = dpcompile.explain(_dp(BNNet(), 3), torch.randn(10, 8))
    text = str(report)
    assert "Per device" in text and "Communication" in text and "bn_sync" in text
    assert max(len(line) for line in text.splitlines()) <= 120


def test_explain_tensor_parallel_reproduces_classic_figures():
    """X[128x1000] @ W[1000x500] on 2 devices: row moves 128,000, column 160,000 elements per device."""
    x = torch.randn(128, 1000)
    totals = {}
    for style in ("row", "column"):
        model = nn.Sequential(nn.Linear(1000, 500, bias=False))
        pm = _tensor_parallel(model, {"0": style}, ["cpu", "cpu"], (x,))
        report = dpcompile.explain(pm, x)
        totals[style] = report.comm_elements_forward + report.comm_elements_backward
        assert report.plan == {"0": style}
        assert report.param_bytes == {"cpu#0": 1000 * 500 * 2, "cpu#1": 1000 * 500 * 2}
    assert totals == {"row": 128_000, "column": 160_000}


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, scale=None):
        y = self.fc(x)
        return y if scale is None else y * scale


def test_explain_binds_keyword_arguments():
    """Keyword arguments reach their placeholders: the scaled branch has shapes."""
    report = dpcompile.explain(_dp(Scaled()), x=torch.randn(6, 8), scale=torch.randn(6, 4))
    shapes = {n.name: n.shape for n in report.nodes}
    assert shapes["scale"] == [[6, 4]] and shapes["mul_dev1"] == [[3, 4]]


def test_explain_counts_convolution_flops():
    """A Conv2d's FLOPs are counted on each device's share of the batch."""
    conv = nn.Conv2d(3, 8, 3, bias=False)
    report = dpcompile.explain(_dp(conv), torch.randn(4, 3, 10, 10))
    per_image = 2 * 8 * 8 * 8 * 3 * 3 * 3  # 2 * out_positions * out_channels * kernel volume
    assert report.flops == {"cpu#0": 2 * per_image, "cpu#1": 2 * per_image}


def test_explain_table_fits_in_120_columns_on_sixteen_devices():
    """The title naming every device wraps: 16 virtual devices still fit in 120 columns."""
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    pm = dpcompile.transform(model, ["cpu"] * 16)
    text = str(dpcompile.explain(pm, torch.randn(3, 16)))
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "cpu#15" in text and "batch 3" in text


def test_explain_tensor_parallel_explains_the_program_the_call_runs():
    """explain(pm, x) without the optional scale explains the program without the multiply, with shapes."""
    pm = dpcompile.transform(OptionalScale(), ["cpu"] * 2, tensor_parallel=True)
    without = dpcompile.explain(pm, torch.randn(4, 8))
    with_scale = dpcompile.explain(pm, torch.randn(4, 8), scale=torch.ones(8))
    assert without.shapes == with_scale.shapes == "fake"
    assert "mul" not in {n.name for n in without.nodes} and "mul" in {n.name for n in with_scale.nodes}


def test_explain_without_inputs_shows_unknown_totals_not_zero():
    """Without inputs the communication totals print as '?', as the rows do, not as 0."""
    text = str(dpcompile.explain(_dp(MLP())))
    assert "collectives: forward ?, backward ?, total ? elements per device" in text
    assert "collectives: forward 0" not in text


def _collectives_program(n: int) -> fx.GraphModule:
    """x[8x4] → all-reduce (own value, S=32) → all-gather (own value, S=128) → reduce-scatter (its input, S=128)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    reduced = stamp_comm(graph.call_function(torch.mul, (x, 1)), "all_reduce")
    gathered = stamp_comm(graph.call_function(torch.cat, ([reduced] * n,)), "all_gather", backward="reduce_scatter")
    scattered = stamp_comm(graph.call_function(torch.narrow, (gathered, 0, 0, 8)), "reduce_scatter", backward="all_gather")
    graph.output(scattered)
    gm = fx.GraphModule(nn.Module(), graph)
    gm.devices = ["cpu"] * n
    return gm


def _static_elements(gm: fx.GraphModule, x: torch.Tensor, n: int) -> dict[str, tuple[float, float] | None]:
    """cost.comm_elements per communication node, from the shapes FakeTensorProp records."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(x))
    return {node.name: comm_elements(node, n) for node in gm.graph.nodes if "dpcompile_comm" in node.meta}


def test_explain_and_cost_share_one_comm_size_rule_on_ring_formulas():
    """all-reduce 2(N-1)/N*S, all-gather and reduce-scatter (N-1)/N*S: explain, cost and hand arithmetic agree."""
    n, x = 4, torch.randn(8, 4)
    gm = _collectives_program(n)
    report = dpcompile.explain(gm, x)
    by_hand = {
        "mul": (2 * (n - 1) / n * 32, 0.0),
        "cat": ((n - 1) / n * 128, (n - 1) / n * 128),
        "narrow": ((n - 1) / n * 128, (n - 1) / n * 128),
    }
    assert {c.name: (c.forward, c.backward) for c in report.collectives} == by_hand
    assert {c.name: c.elements for c in report.collectives} == {"mul": 32, "cat": 128, "narrow": 128}
    assert _static_elements(gm, x, n) == by_hand
    assert report.comm_elements_forward == 48 + 96 + 96 and report.comm_elements_backward == 96 + 96


@pytest.mark.parametrize("model", [BNNet, MLP], ids=["bnnet", "mlp"])
def test_explain_and_cost_agree_on_every_data_parallel_collective(model):
    """Replication, scatter, the BatchNorm sync and gather: explain's figures are cost's rule on recorded shapes."""
    n, x = 3, torch.randn(10, 8)
    pm = _dp(model(), n)
    report = dpcompile.explain(pm, x)
    assert {c.name: (c.forward, c.backward) for c in report.collectives} == _static_elements(pm, x, n)
