"""Pipeline parallelism in one process: stages on virtual devices, micro-batches, exact semantics.

Outputs, the mean loss, every gradient and BatchNorm's running statistics equal the eager
model's, for 2 and 4 stages and 1, 2 and 4 micro-batches with an uneven last micro-batch (a
batch of 7). BatchNorm models run in float64 so that the order of the sums is no excuse.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile

CONFIGS = [(2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4)]  # (stages, micro-batches)


class Stack(nn.Module):
    """Linear layers with a classification loss computed in forward (``labels=``)."""

    def __init__(self, depth: int = 6, width: int = 8):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.head = nn.Linear(width, 3)

    def forward(self, x, labels):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        logits = self.head(x)
        return logits, F.cross_entropy(logits, labels)


class BNCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


def _grads_equal(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


def _stack_inputs(batch: int = 7):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 8, generator=g), torch.randint(0, 3, (batch,), generator=g)


@pytest.mark.parametrize("stages,micro", CONFIGS)
def test_pipeline_mlp_stack_outputs_loss_and_gradients_equal_eager(stages, micro):
    """An MLP stack with its loss in forward: logits, mean loss and every gradient as eager."""
    torch.manual_seed(0)
    reference = Stack()
    model = copy.deepcopy(reference)
    x, labels = _stack_inputs()
    pm = dpcompile.transform(model, ["cpu"] * stages, pipeline=stages, micro_batches=micro, example_inputs=(x, labels))
    logits, loss = pm(x, labels)
    loss.backward()
    expected_logits, expected_loss = reference(x, labels)
    expected_loss.backward()
    torch.testing.assert_close(logits, expected_logits)
    torch.testing.assert_close(loss, expected_loss)
    _grads_equal(model, reference)


@pytest.mark.parametrize("stages,micro", CONFIGS)
def test_pipeline_batchnorm_cnn_uses_whole_batch_statistics(stages, micro):
    """A CNN with BatchNorm: outputs, gradients and running statistics as eager (whole-batch statistics)."""
    torch.manual_seed(0)
    reference = BNCNN().double()
    model = copy.deepcopy(reference)
    x = torch.randn(7, 3, 6, 6, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * stages, pipeline=stages, micro_batches=micro, example_inputs=(x,))
    weights = torch.linspace(0.5, 1.5, 28, dtype=torch.float64).view(7, 4)
    out = pm(x)
    (out * weights).sum().backward()
    expected = reference(x)
    (expected * weights).sum().backward()
    torch.testing.assert_close(out, expected)
    _grads_equal(model, reference)
    for (name, b), (_, c) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(b, c, msg=lambda m, name=name: f"buffer {name}: {m}")
    pm.eval()
    reference.eval()
    torch.testing.assert_close(pm(x), reference(x))


def test_pipeline_optimizer_over_model_parameters_trains_it():
    """Three SGD steps over ``model.parameters()`` through pm follow the eager steps."""
    torch.manual_seed(0)
    reference = Stack()
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        x, labels = _stack_inputs(6 + step)
        for module, optimizer in ((pm, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            module(x, labels)[1].backward()
            optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


def test_pipeline_batch_smaller_than_micro_batches_runs_one_sample_each():
    """A batch of 3 with 4 micro-batches runs 3 micro-batches, and gives the eager values."""
    torch.manual_seed(0)
    reference = Stack()
    pm = dpcompile.transform(copy.deepcopy(reference), ["cpu"] * 2, pipeline=2, micro_batches=4)
    x, labels = _stack_inputs(3)
    torch.testing.assert_close(pm(x, labels), reference(x, labels))
    assert "labels_mb2" in pm.program_for_call(x, labels).code and "_mb3" not in pm.program_for_call(x, labels).code


def test_pipeline_code_shows_sends_and_stage_programs():
    """Values crossing a boundary are explicit sends, in pm.code and in each stage's program."""
    pm = dpcompile.transform(Stack(depth=4), ["cpu"] * 2, pipeline=["layers.2"], micro_batches=2)
    assert pm.stages[0].module_paths == ("layers.0", "layers.1")
    assert pm.stages[1].module_paths == ("layers.2", "layers.3", "head")
    assert "tanh_1_mb0_to_stage1 = dpcompile_runtime_send(tanh_1_mb0, 'cpu')" in pm.code
    assert "labels_scatter" in pm.code
    assert "tanh_1_to_stage1 = dpcompile_runtime_send(tanh_1, 'cpu')" in pm.stages[0].code
    assert pm.stages[1].code.lstrip().startswith("def forward(self, tanh_1, labels):")


def test_pipeline_named_boundary_unknown_module_says_which_exist():
    """A stage boundary naming no module of forward is a ValueError listing real ones."""
    with pytest.raises(ValueError, match="no op of the captured graph runs in module 'layers.9'"):
        dpcompile.transform(Stack(depth=4), ["cpu"] * 2, pipeline=["layers.9"])


def test_pipeline_stage_count_must_match_devices():
    """pipeline=3 on 2 devices is refused with the arithmetic."""
    with pytest.raises(ValueError, match="makes 3 stages, but 2 devices were given"):
        dpcompile.transform(Stack(depth=4), ["cpu"] * 2, pipeline=3)


def test_pipeline_planner_balances_a_uniform_stack():
    """On 8 equal layers over 4 stages the planner's stage FLOPs are within 10% of the mean."""
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(16, 16), nn.ReLU())])
    x = torch.randn(8, 16)
    pm = dpcompile.transform(model, ["cpu"] * 4, pipeline=4, micro_batches=4, example_inputs=(x,))
    report = dpcompile.explain(pm, x).pipeline
    assert report["imbalance"] <= 1.1
    assert report["bubble_fraction"] == pytest.approx(3 / 7)
    assert [s["module_paths"] for s in report["stages"]] == [[str(i) for i in range(k, k + 4)] for k in (0, 4, 8, 12)]
    assert all(s["sends_elements"] == 8 * 16 for s in report["stages"][:3])


@pytest.mark.parametrize("make, inputs", [
    (Stack, lambda: (torch.randn(7, 8), torch.randint(0, 3, (7,)))),
    (BNCNN, lambda: (torch.randn(7, 3, 6, 6),)),
], ids=["stack-loss", "cnn-batchnorm"])  # fmt: skip
def test_pipeline_program_places_every_value_on_its_gpu(make, inputs):
    """On 4 fake GPUs (FakeTensorMode raises on any op that mixes devices) forward runs: each
    stage's modules sit on its GPU and every crossing value is sent there (a CPU build cannot
    run autograd on fake CUDA tensors; backward mirrors the forward's sends)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dpcompile.devices import parse_devices
    from dpcompile.recipes import PipelineRecipe
    from tests.helpers import to_fake_cuda

    mode = FakeTensorMode()
    model = to_fake_cuda(make(), mode)
    devices = parse_devices([f"cuda:{i}" for i in range(4)], check_available=False)
    pm = PipelineRecipe(devices=devices, output_device=devices.primary, stages=4, micro_batches=2).compile(model, None)
    assert [str(p.device) for p in pm.stages[3].program.parameters()] and all(
        str(p.device) == f"cuda:{s.index}" for s in pm.stages for p in s.program.parameters()
    )
    with mode, torch.no_grad():
        out = pm(*[x.to("cuda:0") for x in inputs()])
    leaves = out if isinstance(out, tuple) else (out,)
    assert all(str(t.device) == "cuda:0" for t in leaves)
    assert "_to_stage3 = dpcompile_runtime_send(" in pm.code and "'cuda:3'" in pm.code
