"""verify: outputs, gradients and buffers against eager; the fake multi-GPU layout check."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.verify import compare_tensors, default_tolerance


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x))))), x.mean()


class DefaultDeviceTensor(nn.Module):
    """Works on virtual CPU devices, but makes a tensor on the default (CPU) device: wrong on GPUs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * torch.arange(x.size(1))


class _DoubleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


class WrongBackward(nn.Module):
    """Same forward as a Linear, twice the gradient for its input side."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.mode = "data_parallel"

    def forward(self, x):
        return nn.functional.linear(x, _DoubleGrad.apply(self.weight), self.bias)


def _tp(model, devices, example):
    try:
        return dpcompile.transform(model, devices, tensor_parallel=True, example_inputs=example)
    except (ImportError, ModuleNotFoundError) as e:
        pytest.skip(f"tensor parallelism not available yet: {e}")


def test_verify_data_parallel_matches_with_batchnorm_and_dropout():
    """A DP program with BatchNorm and dropout verifies: truthy, and says what it compared."""
    model = Net()
    pm = dpcompile.transform(model, ["cpu"] * 3)
    result = dpcompile.verify(pm, model, torch.randn(12, 8))
    assert result, str(result)
    assert result.checked["outputs"] == 2 and result.checked["parameter gradients"] == 6
    assert result.checked["buffers"] == 3 and result.checked["input gradients"] == 1
    assert str(result).startswith("verify: OK")
    assert any("dropout" in note for note in result.notes)


def test_verify_leaves_no_side_effects():
    """Gradients, running statistics, dropout modes and the RNG stream are as before."""
    model = Net()
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    sentinel = torch.full_like(model.fc1.weight, 7.0)
    model.fc1.weight.grad = sentinel
    state = copy.deepcopy(model.state_dict())
    x = torch.randn(10, 8)
    torch.manual_seed(3)
    expected_random = torch.rand(3)
    torch.manual_seed(3)
    assert dpcompile.verify(pm, model, x)
    assert torch.equal(torch.rand(3), expected_random)
    assert model.fc1.weight.grad is sentinel and model.fc2.weight.grad is None
    assert model.drop.training
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_verify_reports_a_corrupted_parameter():
    """A model whose weights differ from pm's: falsy, naming the output and a gradient with numbers."""
    model = Net()
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.fc2.weight[1, 3] += 0.5
    result = dpcompile.verify(pm, other, torch.randn(10, 8))
    assert not result
    text = str(result)
    assert "MISMATCH" in text and "output output[0]" in text and "max |diff|" in text
    assert {m.kind for m in result.mismatches} >= {"output", "gradient"}


def test_verify_reports_a_gradient_only_difference():
    """Equal outputs but wrong gradients: the gradient of 'weight' is named, outputs pass."""
    linear = nn.Linear(4, 3)
    result = dpcompile.verify(WrongBackward(linear), linear, torch.randn(5, 4))
    assert not result
    assert [(m.kind, m.name) for m in result.mismatches] == [("gradient", "weight")]
    assert result.mismatches[0].max_abs > 0


def test_verify_catches_a_corrupted_shard():
    """Tensor parallel: one element of one shard changed is caught in outputs and gradients."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    pm = _tp(model, ["cpu", "cpu"], (x,))
    assert dpcompile.verify(pm, model, x)
    shard = next(p for name, p in pm.named_parameters() if "shard1" in name)
    with torch.no_grad():
        shard.view(-1)[0] += 1.0
    result = dpcompile.verify(pm, model, x)
    assert not result
    assert any(m.kind == "output" for m in result.mismatches)


def test_verify_fake_devices_checks_an_eight_gpu_layout():
    """fake_devices=8 builds the cuda:0..7 program on fake tensors and finds it well placed."""
    model = Net()
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    result = dpcompile.verify(pm, model, torch.randn(16, 8), fake_devices=8)
    assert result, str(result)
    assert result.checked["fake devices"] == 8 and result.checked["placed nodes"] > 8 * 4


def test_verify_fake_devices_catches_a_tensor_made_on_the_cpu():
    """torch.arange without device= passes on virtual devices but fails the fake 4-GPU layout."""
    model = DefaultDeviceTensor()
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    assert dpcompile.verify(pm, model, torch.randn(8, 4))
    result = dpcompile.verify(pm, model, torch.randn(8, 4), fake_devices=4)
    assert not result
    (problem,) = result.mismatches
    assert problem.kind == "layout" and "cuda:0 and cpu" in problem.detail
    assert "test_verify.py" in problem.detail  # the user's line


def test_verify_fake_devices_checks_tensor_parallel_layout():
    """A tensor-parallel plan rebuilt for fake cuda:0..3 runs with every shard on its device."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    pm = _tp(model, ["cpu", "cpu"], (x,))
    result = dpcompile.verify(pm, model, x, fake_devices=4)
    assert result, str(result)
    assert result.checked["fake devices"] == 4


def test_compare_tensors_uses_dtype_aware_tolerances():
    """A 1e-3 relative error passes in float16 and fails in float32; explicit rtol overrides."""
    expected = torch.linspace(1, 2, 10)
    actual = expected * (1 + 1e-3)
    assert compare_tensors("output", "y", expected.half(), actual.half()) is None
    mismatch = compare_tensors("output", "y", expected, actual)
    assert mismatch is not None and "rtol=0.0001" in mismatch.detail
    assert compare_tensors("output", "y", expected, actual, rtol=1e-2) is None
    assert default_tolerance(torch.int64) == (0.0, 0.0)


def test_compare_tensors_reports_shape_and_integer_differences():
    """Shapes must agree; integer tensors compare exactly and name the first difference."""
    assert "shape (3,)" in compare_tensors("output", "y", torch.zeros(2), torch.zeros(3)).detail
    mismatch = compare_tensors("output", "y", torch.tensor([1, 2, 3]), torch.tensor([1, 5, 3]))
    assert "first at (1,)" in mismatch.detail and "got 5" in mismatch.detail


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, scale=1.0):
        y = self.fc(x) * scale
        return {"logits": y, "loss": y.pow(2).mean(), "classes": 3, "nothing": None}


def test_verify_compares_structured_outputs_and_keyword_arguments():
    """Dict outputs with scalars and None, inputs passed by keyword: all compared, all match."""
    model = Structured()
    pm = dpcompile.transform(model, ["cpu"] * 3)
    result = dpcompile.verify(pm, model, x=torch.randn(7, 4), scale=2.0)
    assert result, str(result)
    assert result.checked["outputs"] == 2 and result.checked["input gradients"] == 1


class LastTokenAttention(nn.Module):
    """q/k/v heads, ``.contiguous()`` and indexing: ops a CPU-only torch refuses on fake CUDA tensors."""

    def __init__(self, d: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (f(x).view(b, t, self.heads, c // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = (q @ k.transpose(-2, -1)).softmax(dim=-1) @ v
        y = self.out(y.transpose(1, 2).contiguous().view(b, t, c))
        return y[:, -1]


def test_verify_fake_devices_runs_contiguous_and_indexing():
    """fake_devices= checks a model calling .contiguous() and indexing x[:, -1] (DP and TP) instead of failing."""
    model, x = LastTokenAttention(), torch.randn(4, 3, 16)
    for pm in (dpcompile.transform(model, ["cpu", "cpu"]), _tp(model, ["cpu", "cpu"], (x,))):
        result = dpcompile.verify(pm, model, x, fake_devices=4)
        assert result, str(result)


def test_verify_fake_devices_builds_the_tensor_parallel_plan_pm_applied(monkeypatch):
    """The fake TP program shards the attention heads as pm does (shapes from the call's inputs)."""
    import importlib

    verify_module = importlib.import_module("dpcompile.verify.layout")
    model, x = LastTokenAttention(), torch.randn(4, 3, 16)
    pm = _tp(model, ["cpu", "cpu"], (x,))
    assert pm.plan == {"q": "column", "k": "column", "v": "column", "out": "row"}
    built = []
    original = verify_module._build_fake_program
    monkeypatch.setattr(verify_module, "_build_fake_program", lambda *a, **k: built.append(original(*a, **k)) or built[-1])
    assert dpcompile.verify(pm, model, x, fake_devices=4)
    assert built and built[0].plan == pm.plan, built[0].plan_reasons


def _batchnorm_cnn(channels: int = 16) -> nn.Sequential:
    """A small CNN with five BatchNorms whose last ones see a handful of values per channel."""
    layers: list[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
    for _ in range(3):
        layers += [nn.Conv2d(channels, channels, 3, padding=1, stride=2), nn.BatchNorm2d(channels), nn.ReLU()]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(channels, 10), nn.BatchNorm1d(10))


def test_verify_judges_batchnorm_rounding_against_float64():
    """BatchNorm training on small batches: differences beyond float32's tolerance that a float64
    run shows to be rounding (pm no farther from it than eager float32) are not a mismatch."""
    for seed in range(4):
        torch.manual_seed(seed)
        model = _batchnorm_cnn()
        pm = dpcompile.transform(model, ["cpu", "cpu"])
        result = dpcompile.verify(pm, model, torch.randn(4, 3, 8, 8))
        assert result, str(result)
        if result.rounding:
            break
    else:
        pytest.skip("no rounding beyond float32's tolerance on this machine's kernels")
    assert all(m.judgement == "rounding" and m.error64 is not None for m in result.rounding)
    assert "judged rounding" in str(result) and "RMS error against float64" in str(result)
    import json

    assert json.loads(json.dumps(result.to_dict()))["rounding"]


def test_verify_still_reports_a_wrong_program_against_float64():
    """A program off by 0.1% (a real bug, small as rounding would be) stays a mismatch, judged real."""
    torch.manual_seed(0)
    model = _batchnorm_cnn()
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    output = next(n for n in pm.graph.nodes if n.op == "output")
    with pm.graph.inserting_before(output):
        scaled = pm.graph.call_function(torch.mul, (output.args[0], 1.001))
    output.args = (scaled,)
    pm.recompile()
    result = dpcompile.verify(pm, model, torch.randn(4, 3, 8, 8))
    assert not result
    judged = [m for m in result.mismatches if m.judgement is not None]
    assert judged and all(m.judgement == "real" for m in judged)
    assert any(m.kind == "output" for m in judged)
    assert "[real: RMS error against float64" in str(result)


def test_verify_judges_running_statistics_after_the_step():
    """Data parallel shares the model's buffers: the running statistics judged against float64 are
    pm's after the step (a copy), not the values restored for the float64 run, so a rounding
    difference in running_var (timm mnasnet_small reported MISMATCH) is judged rounding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.BatchNorm1d(32))
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    result = dpcompile.verify(pm, model, torch.randn(6, 8) * 10, rtol=0.0, atol=0.0)  # every last bit counts
    buffers = [m for m in result.rounding + result.mismatches if m.kind == "buffer" and m.name.endswith(("running_mean", "running_var"))]
    assert buffers, "no running statistic differed in the last bit: nothing judged"
    assert all(m.judgement == "rounding" for m in buffers), str(result)


def test_verify_catches_a_wrong_batch_rule():
    """A whole-batch function registered as "elementwise" (a wrong rule) is a real mismatch, not rounding."""
    model = _RowNormalised()
    dpcompile.register_batch_rule(_divide_by_batch_sum, "elementwise", replace=True)
    try:
        pm = dpcompile.transform(model, ["cpu", "cpu"])
        result = dpcompile.verify(pm, model, torch.randn(6, 4))
    finally:
        dpcompile.register_batch_rule(_divide_by_batch_sum, "whole", replace=True)
    assert not result and any(m.kind == "output" for m in result.mismatches), str(result)
    assert dpcompile.verify(dpcompile.transform(model, ["cpu", "cpu"]), model, torch.randn(6, 4))


def test_verify_names_its_arguments_when_they_are_not_modules():
    """verify(pm, x): a TypeError saying the modules come first, not an AttributeError inside."""
    model = nn.Linear(4, 4)
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    with pytest.raises(TypeError, match=r"model must be a module, got Tensor"):
        dpcompile.verify(pm, torch.randn(6, 4))


def _divide_by_batch_sum(x):
    return x / x.sum()


torch.fx.wrap("_divide_by_batch_sum")


class _RowNormalised(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return _divide_by_batch_sum(self.fc(x))


class _Layers(nn.Module):
    def __init__(self, make_on_cpu: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.make_on_cpu = make_on_cpu

    def forward(self, x):
        for k, layer in enumerate(self.layers):
            x = torch.relu(layer(x))
            if k == 3 and self.make_on_cpu:
                x = x * torch.arange(x.size(1))  # made on the default device: wrong on the last stage's GPU
        return x.mean()


@pytest.mark.parametrize(("kwargs", "n"), [({"pipeline": 2, "micro_batches": 2}, 2),
                                           ({"pipeline": 2, "tensor_parallel": True}, 4)])
def test_verify_fake_devices_checks_pipeline_layouts(kwargs, n):
    """Pipelines (and pipeline x tensor parallel) rebuilt for fake CUDA devices: every stage's values
    on its devices; a tensor made on the CPU in the last stage is caught with the user's line."""
    model = _Layers()
    pm = dpcompile.transform(model, ["cpu"] * n, **kwargs)
    result = dpcompile.verify(pm, model, torch.randn(4, 8), fake_devices=n)
    assert result, str(result)
    assert result.checked["fake devices"] == n and result.checked["placed nodes"] > n * 4
    model = _Layers(make_on_cpu=True)
    pm = dpcompile.transform(model, ["cpu"] * n, **kwargs)
    assert dpcompile.verify(pm, model, torch.randn(4, 8))
    result = dpcompile.verify(pm, model, torch.randn(4, 8), fake_devices=n)
    assert not result and "test_verify.py" in str(result), str(result)


def test_verify_fake_devices_of_another_count_than_a_pipelines_says_which():
    """A pipeline's layout fixes its device count: fake_devices of another count is refused with the
    count to ask for (it was reported as a mismatch of the program, which nothing in it was)."""
    model = _Layers()
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2)
    with pytest.raises(dpcompile.DpCompileError, match=r"runs on 2 devices, not 4; pass fake_devices=2"):
        dpcompile.verify(pm, model, torch.randn(4, 8), fake_devices=4)
    assert dpcompile.verify(pm, model, torch.randn(4, 8), fake_devices=2)


def test_verify_a_1f1b_pipeline_that_runs_its_loss_backward_in_the_call():
    """A 1F1B pipeline runs its loss's backward inside a training call (only a plain loss.backward()
    may follow): verify compares the loss's gradients (weight 1) instead of raising, and still
    reports a wrong parameter."""
    model = _Layers()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2, schedule="1f1b")
    x = torch.randn(4, 8)
    result = dpcompile.verify(pm, eager, x)
    assert result and result.checked["parameter gradients"] == 8, str(result)
    with torch.no_grad():
        model.layers[0].weight[0, 0] += 1.0
    result = dpcompile.verify(pm, eager, x)
    assert not result and "layers.0.weight" in str(result), str(result)


class _LossAndLogits(nn.Module):
    """A language-model head in miniature: returns ``{"loss", "logits"}`` as a ModelOutput does."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 5))

    def forward(self, x, labels):
        logits = self.layers(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_verify_a_1f1b_pipeline_returning_a_loss_and_logits():
    """The logits of a 1F1B training call carry no gradient path (the step ran the loss's backward):
    verify compares the loss, the parameters' gradients and the logits' values, and reports a
    wrong parameter."""
    torch.manual_seed(0)
    model = _LossAndLogits()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2, schedule="1f1b")
    x, labels = torch.randn(4, 8), torch.randint(0, 5, (4,))
    result = dpcompile.verify(pm, eager, x, labels=labels)
    assert result and result.checked["outputs"] == 2 and result.checked["parameter gradients"] == 4, str(result)
    with torch.no_grad():
        model.layers[2].bias[0] += 1.0  # changes the logits and the loss, not the other layer's gradient alone
    result = dpcompile.verify(pm, eager, x, labels=labels)
    assert not result, str(result)
    wrong = {(m.kind, m.name) for m in result.mismatches}
    assert {("output", "output['loss']"), ("output", "output['logits']"), ("gradient", "layers.0.weight")} <= wrong


@pytest.mark.parametrize("mesh", [{"dp": 2}, {"tp": 2}, {"pp": 2}], ids=["dp2", "tp2", "pp2"])
def test_verify_fake_devices_checks_a_batch_norm_with_a_cumulative_average(mesh):
    """momentum=None divides by the count, a value fake tensors lack: the fake copy takes a fixed momentum.
    Before, every layout was reported a MISMATCH (DataDependentOutputException: aten._local_scalar_dense)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=None), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, mesh=mesh, example_inputs=(x,))
    result = dpcompile.verify(pm, model, x, fake_devices=2)
    assert result, str(result)
    assert model[1].momentum is None and pm.get_submodule("1").momentum is None
    assert int(model[1].num_batches_tracked) == int(pm.state_dict()["1.num_batches_tracked"]) == 0  # verify restores both


class _OptionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, *, mask=None):
        h = torch.relu(self.fc(x))
        if mask is not None:
            h = h * mask
        return self.fc2(h)


@pytest.mark.parametrize(
    "mesh", [{"dp": 2}, {"tp": 2}, {"pp": 2}, {"dp": 2, "tp": 2}, {"pp": 2, "dp": 2}], ids=["dp2", "tp2", "pp2", "dp2xtp2", "pp2xdp2"]
)
def test_verify_fake_devices_builds_the_program_of_a_call_passing_an_optional_argument(mesh):
    """The fake program is built as the call departs from the main trace (``mask=`` given, traced as None at
    transform). Before, it was built from the main trace and every layout reported a MISMATCH
    ("this program was traced with 'mask_1' None") for a program that runs the call right."""
    torch.manual_seed(0)
    model, x, mask = _OptionalMask(), torch.randn(4, 8), torch.rand(4, 8)
    n = 1
    for size in mesh.values():
        n *= size
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * n, mesh=mesh, example_inputs=(x,), example_kwargs={"mask": mask})
    for kwargs in ({"mask": mask}, {}):
        result = dpcompile.verify(pm, model, x, fake_devices=n, **kwargs)
        assert result, str(result)
        assert result.checked["fake devices"] == n


class SparseLookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(10, 8, sparse=True), nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.emb(ids))


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["dp", "tp"])
def test_verify_compares_sparse_gradients(tensor_parallel):
    """``nn.Embedding(sparse=True)``'s gradient is a sparse tensor: verify crashed on it (NotImplementedError on the
    sparse backend; tensor parallel's gather, set_data of a sparse tensor). It compares it dense: a match."""
    torch.manual_seed(0)
    model = SparseLookup().double()
    eager = copy.deepcopy(model)
    ids = torch.randint(0, 10, (6, 5))
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=tensor_parallel)
    result = dpcompile.verify(pm, eager, ids)
    assert result, str(result)
