"""insert_scatter_gather: structure of the generated code and numerics against eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from torch import nn

import dpcompile
from dpcompile import runtime
from dpcompile.analysis.batch_dims import infer_input_dims
from dpcompile.capture import capture
from dpcompile.devices import parse_devices
from passes import insert_scatter_gather
from tests.helpers import check_against_eager
from tests.models import CNN, MLP, DataclassOut, NestedIO, ResNetish


def _targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op != "placeholder" and n.op != "output"]


def test_insert_scatter_gather_emits_scatter_per_device_calls_and_gather():
    """An MLP on two devices: one scatter, each layer once per device, one gather, in order."""
    pm = dpcompile.transform(MLP(), ["cpu", "cpu"])
    names = [n.name for n in pm.graph.nodes]
    assert names == [
        "x", "fc1_src", "fc2_src", "replicas", "replica_dev0", "replica_dev1", "x_scatter", "x_dev0", "x_dev1",
        "fc1_dev0", "fc1_dev1", "relu_dev0", "relu_dev1", "fc2_dev0", "fc2_dev1",
        "fc2", "output",
    ]
    targets = _targets(pm)
    assert targets.count(runtime.scatter) == 1 and targets.count(runtime.gather) == 1
    calls = [n.target for n in pm.graph.nodes if n.op in ("call_module", "call_method")]
    assert calls == ["fc1", "fc1", "fc2", "fc2"]  # replica_dev0.fc1(x_dev0), replica_dev1.fc1(x_dev1), ...
    assert targets.count(runtime.replicate) == 1


def test_insert_scatter_gather_code_reads_like_handwritten():
    """Generated code names the inserted calls and the device of every value."""
    code = dpcompile.transform(MLP(), ["cpu"] * 3).code
    assert "x_scatter = dpcompile_runtime_scatter(x, ['cpu', 'cpu', 'cpu'], 0)" in code
    assert (
        "replicas = dpcompile_runtime_replicate({'fc1': fc1_src, 'fc2': fc2_src}, ['cpu', 'cpu', 'cpu'], include_source = True)"
        in code
    )
    # device 0's root holds the user's own modules: every device reads its modules alike, in one lookup
    assert "fc1_dev0 = replica_dev0.fc1(x_dev0)" in code and "fc1_dev2 = replica_dev2.fc1(x_dev2)" in code
    assert "fc2 = dpcompile_runtime_gather([fc2_dev0, fc2_dev1, fc2_dev2], 0, 'cpu')" in code


def test_insert_scatter_gather_replicates_modules_for_distinct_devices():
    """With real replicas the head of forward replicates once and device k calls its replica."""
    pm = dpcompile.transform(MLP(), ["cpu"] * 3, copy_replicas=True)
    code = pm.code
    assert code.count("dpcompile_runtime_replicate(") == 1 and "copy = True" in code
    assert "fc1_dev1 = replica_dev1.fc1(x_dev1)" in code
    assert "fc1_dev0 = replica_dev0.fc1(x_dev0)" in code
    first_compute = next(n for n in pm.graph.nodes if n.op == "call_method")
    replicate_node = next(n for n in pm.graph.nodes if n.target is runtime.replicate)
    order = list(pm.graph.nodes)
    assert order.index(replicate_node) < order.index(first_compute)


def test_insert_scatter_gather_keeps_placeholders():
    """Every placeholder of the captured graph is a placeholder of the result, in order."""
    model = NestedIO()
    gm = capture(model)
    before = [(n.name, n.target) for n in gm.graph.nodes if n.op == "placeholder"]
    insert_scatter_gather(gm, devices=parse_devices(["cpu"] * 2), input_dims=infer_input_dims(gm))
    after = [(n.name, n.target) for n in gm.graph.nodes if n.op == "placeholder"]
    assert before == after


def test_insert_scatter_gather_stamps_provenance():
    """Every node it creates says which pass made it and which user node it came from."""
    pm = dpcompile.transform(MLP(), ["cpu"] * 2)
    made = [n for n in pm.graph.nodes if n.op not in ("placeholder", "output")]
    assert all(n.meta.get("dpcompile_pass") == "insert_scatter_gather" for n in made)
    fc1 = next(n for n in made if n.name == "fc1_dev1")
    assert fc1.op == "call_method" and fc1.args[0].name == "replica_dev1"
    assert fc1.meta["dpcompile_source"] == "fc1"
    assert "test_data_parallel" not in fc1.meta.get("stack_trace", "") and "forward" in fc1.meta.get("stack_trace", "")


@pytest.mark.parametrize("n_devices", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [9, 4, 13])
def test_data_parallel_mlp_matches_eager(n_devices, batch):
    """Forward and backward equal the single-device run, even splits or not."""
    check_against_eager(MLP, ["cpu"] * n_devices, torch.randn(batch, 8))


@pytest.mark.parametrize("n_devices", [2, 4])
def test_data_parallel_cnn_matches_eager(n_devices):
    """Convolutions, pooling, flatten (no batch norm) match eager."""
    check_against_eager(lambda: CNN(batch_norm=False), ["cpu"] * n_devices, torch.randn(7, 3, 8, 8))


def test_data_parallel_residual_blocks_match_eager():
    """LayerNorm, GELU, residual adds and a mean over a non-batch dim match eager."""
    check_against_eager(ResNetish, ["cpu"] * 3, torch.randn(10, 5, 12))


def test_data_parallel_real_replicas_match_eager():
    """The multi-GPU path (replicate + broadcast, grads reduce-added) matches eager."""
    check_against_eager(ResNetish, ["cpu"] * 3, torch.randn(10, 5, 12), transform_kwargs={"copy_replicas": True})


def test_data_parallel_nested_inputs_outputs_and_kwargs_match_eager():
    """Dict/tuple inputs, kwargs, namedtuple/dict/None/int/str outputs come back as eager's."""
    batch = {"x": torch.randn(7, 6)}
    pair = (torch.randn(7, 3), torch.randn(7, 4))
    pm = check_against_eager(NestedIO, ["cpu"] * 3, batch, pair, scale=2.0, mask=torch.rand(7, 5))
    out = pm({"x": torch.randn(5, 6)}, (torch.randn(5, 3), torch.randn(5, 4)), mask=torch.rand(5, 5))
    assert out["count"] == 3 and out["name"] == "nested" and out["out"].features[1] is None
    assert type(out["out"]).__name__ == "Pair"


def test_data_parallel_dataclass_output_matches_eager():
    """A dataclass built in forward comes back as that dataclass, gathered."""
    pm = check_against_eager(DataclassOut, ["cpu"] * 2, torch.randn(5, 4))
    out = pm(torch.randn(3, 4))
    assert type(out).__name__ == "Output" and out.logits.shape == (3, 2) and out.note == "ok"


class NamedResults(nn.Module):
    """``torch.return_types`` values (``topk``, ``sort``, ``max(dim)``) read by field name, and returned."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        picked = y.topk(3, dim=1).values + y.max(dim=1).values[:, None] + y.sort(1).values[:, :3]
        return picked, y.min(dim=1)


def test_data_parallel_named_results_of_torch_ops_keep_their_fields():
    """A gathered ``topk``/``sort``/``max(dim)`` result is the ``torch.return_types`` value eager
    returns (``.values``, ``.indices``), not a plain tuple."""
    pm = check_against_eager(NamedResults, ["cpu"] * 2, torch.randn(6, 8))
    _, smallest = pm(torch.randn(5, 8))
    assert type(smallest) is torch.return_types.min and smallest.indices.shape == (5,)


def test_data_parallel_small_batch_uses_fewer_devices():
    """A batch of 2 on 4 devices runs on 2, with the same values as eager."""
    model = MLP()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 4)
    x = torch.randn(2, 8)
    torch.testing.assert_close(pm(x), reference(x))
    program = pm.program_for_call(x)
    assert program is not pm and pm.call_key(x).devices == 2
    assert program.code.count(".fc1(x_dev") == 2  # two devices run fc1


def test_data_parallel_model_without_batch_inputs_runs_once():
    """A forward whose only input is a Python number runs its computation once."""

    class Constant(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, n: int):
            return self.w * n

    pm = dpcompile.transform(Constant(), ["cpu"] * 2)
    torch.testing.assert_close(pm(2), torch.full((3,), 2.0))


def test_generated_graph_runs_under_fx_interpreter():
    """Standard fx tooling (ShapeProp, Interpreter) runs the program, nested modules included."""
    from torch.fx.passes.shape_prop import ShapeProp

    model = ResNetish()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    x = torch.randn(6, 5, 12)
    ShapeProp(pm).propagate(x)
    node = next(n for n in pm.graph.nodes if n.name == "blocks_0_fc1_dev1")
    assert node.meta["tensor_meta"].shape == (3, 5, 24)
    torch.testing.assert_close(fx.Interpreter(pm).run(x), reference(x))


class _SortsFirst(torch.nn.Module):
    """Sorting over the batch comes first, so everything runs once, after a gather."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x.sort(0).values) / x.shape[0]


def test_insert_scatter_gather_replicates_nothing_no_device_runs():
    """No replicate (a broadcast of every weight on distinct GPUs) and no unused shape reads
    where nothing runs per device."""
    pm = dpcompile.transform(_SortsFirst(), ["cpu"] * 2, copy_replicas=True)
    assert "replicate" not in pm.code and "_dev1" not in pm.code
    x = torch.randn(5, 8)
    torch.testing.assert_close(pm(x), pm.fc(x.sort(0).values) / 5)


class _HeadAfterSort(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.fc(x).sort(0).values)


def test_insert_scatter_gather_replicates_only_modules_devices_run():
    """A module that runs once, on the gathered batch, is not replicated."""
    pm = dpcompile.transform(_HeadAfterSort(), ["cpu"] * 2, copy_replicas=True)
    replicate = next(n for n in pm.graph.nodes if n.target is runtime.replicate)
    assert list(replicate.args[0]) == ["fc"]
    assert "head_src" not in pm.code


def lib_apply_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    assert isinstance(block, nn.Sequential), type(block)  # the module itself, never a view of it
    return block(x)


torch.fx.wrap("lib_apply_block")


class _HandsOnABlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(self, x):
        return lib_apply_block(self.block, x)


def test_insert_scatter_gather_hands_a_submodule_whole_to_a_function():
    """A submodule passed to a function reaches it as the module on every device (not a lookup view)."""
    from dpcompile.analysis.batch_rules import BATCH_RULES

    dpcompile.register_batch_rule(lib_apply_block, "elementwise")
    try:
        model, x = _HandsOnABlock(), torch.randn(6, 4)
        pm = dpcompile.transform(model, ["cpu"] * 2)
        assert "dpcompile_runtime_module_of(block_dev1)" in pm.code
        torch.testing.assert_close(pm(x), model(x))
    finally:
        BATCH_RULES.functions.pop(lib_apply_block, None)
