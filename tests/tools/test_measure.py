"""``dpcompile.measure``: one real step's peak bytes per device (virtual devices counted apart),
its time, and explain's prediction beside them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpcompile


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 4, bias=False))


def test_measure_forward_peak_is_the_hand_count():
    """Eval mode on two virtual devices: each device holds its 4 rows' fc1 output and ReLU output
    at once (2 x 4 x 32 x 4 bytes); the parameters held come on top, as explain counts them."""
    model = _mlp().eval()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    m = dpcompile.measure(pm, torch.randn(8, 16))
    assert not m.training
    assert m.step_allocated_peak == {"cpu#0": 1024, "cpu#1": 1024}
    params = (16 * 32 + 32 * 4) * 4
    assert m.peak_bytes == {"cpu#0": params + 1024, "cpu#1": params + 1024}
    assert set(m.predicted_peak_bytes) == {"cpu#0", "cpu#1"} and m.step_time > 0


def test_measure_counts_devices_apart():
    """A batch that only fills one device allocates on that device alone."""
    pm = dpcompile.transform(_mlp().eval(), ["cpu"] * 2)
    m = dpcompile.measure(pm, torch.randn(1, 16))  # one row: one device runs
    assert m.step_allocated_peak["cpu#0"] == 2 * 32 * 4 and m.step_allocated_peak["cpu#1"] == 0


def test_measure_counts_each_dp_copy_on_its_own_devices():
    """Data parallel over tensor-parallel (or pipeline) copies on four virtual devices: copy 1's nodes
    (``_dp1_dev0``) count on copy 1's devices, not on copy 0's. In eval mode each device holds its
    2 rows' output of the layer it runs: fc1's column shard (2 x 16 x 4 bytes) twice (Linear, then
    ReLU) with tensor parallel; its stage's outputs with the pipeline."""
    x = torch.randn(4, 16)
    pm = dpcompile.transform(_mlp().eval(), ["cpu"] * 4, mesh={"dp": 2, "tp": 2}, example_inputs=(x,))
    m = dpcompile.measure(pm, x)
    assert m.step_allocated_peak == dict.fromkeys(["cpu#0", "cpu#1", "cpu#2", "cpu#3"], 2 * 2 * 16 * 4)
    assert set(m.peak_bytes) == set(m.predicted_peak_bytes)
    pm = dpcompile.transform(_mlp().eval(), ["cpu"] * 4, mesh={"pp": 2, "dp": 2}, example_inputs=(x,))
    peaks = dpcompile.measure(pm, x).step_allocated_peak  # canonical order: stage 0 of copies 0, 1; then stage 1
    assert peaks["cpu#0"] == peaks["cpu#1"] == 2 * 32 * 4  # fc1's output of the copy's 2 rows
    assert peaks["cpu#2"] == peaks["cpu#3"] == 2 * 32 * 4 + 2 * 4 * 4  # ReLU's output, then fc2's


@pytest.mark.parametrize("layout", [{"pp": 2, "dp": 2}, {"dp": 2, "tp": 2}])
def test_a_loaded_program_counts_each_stage_and_copy_on_its_own_devices(tmp_path, layout):
    """A program read back with ``dpcompile.load`` keeps the device slot and dp copy of each node, so
    measure counts its devices as the original's: the export once lost them, and a pipeline's stage
    1 and every dp copy but the first were counted on the first device (cpu#0 held all but ~18K)."""
    x = torch.randn(4, 16)
    pm = dpcompile.transform(_mlp(), ["cpu"] * 4, mesh=layout, example_inputs=(x,))
    dpcompile.export(pm, tmp_path)
    loaded = dpcompile.load(tmp_path)
    want, got = dpcompile.measure(pm, x), dpcompile.measure(loaded, x)
    assert got.step_allocated_peak == want.step_allocated_peak
    assert got.peak_bytes == want.peak_bytes


def test_measure_training_step_leaves_state_as_it_was():
    """A training step is measured (forward and backward), and gradients stay as they were."""
    model = _mlp()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    m = dpcompile.measure(pm, torch.randn(8, 16))
    assert m.training and all(p.grad is None for p in model.parameters())
    grads = (16 * 32 + 32 * 4) * 4  # the gradients land on the shared parameters, on the first device
    assert m.step_allocated_peak["cpu#0"] >= grads + 1024


class Deep(nn.Module):
    def __init__(self, d: int = 16, n: int = 6):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_measure_activation_checkpointing_lowers_the_peak():
    """Recomputing every block lowers the measured peak of a training step on every device, and
    the prediction falls with it."""
    x = torch.randn(256, 16)
    plain = dpcompile.measure(dpcompile.transform(Deep(), ["cpu"] * 2), x)
    checkpointed = dpcompile.measure(dpcompile.transform(Deep(), ["cpu"] * 2, activation_checkpointing=True), x)
    for device in ("cpu#0", "cpu#1"):
        assert checkpointed.peak_bytes[device] < 0.75 * plain.peak_bytes[device]
        assert checkpointed.predicted_peak_bytes[device] < plain.predicted_peak_bytes[device]


def test_measure_counts_a_stage_gradients_on_its_own_device():
    """The gradients of stage 1's first Linear (a 3-D input: its ``AddmmBackward0`` sits under a
    view, next to the boundary with stage 0) are made on stage 1's device: stage 0's peak does not
    grow with stage 1's width (it did: they were counted on the device of the nearest stamped node,
    stage 0's, across the boundary)."""
    x = torch.randn(8, 4, 16)
    peaks = []
    for width in (8, 256):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 4))
        pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=["2"], micro_batches=2, example_inputs=(x,))
        peaks.append(dpcompile.measure(pm, x).step_allocated_peak)
    assert peaks[0]["cpu#0"] == peaks[1]["cpu#0"]
    stage1_weights = (32 * 256 + 256 * 4) * 4
    assert peaks[1]["cpu#1"] >= stage1_weights + peaks[0]["cpu#1"]


class _ConvTwice(nn.Module):
    """One 1x1 convolution read twice: autograd sums its weight's two gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.relu(self.conv(x)))


def _weight_sums(run, shape: list[int]) -> dict[str, int]:
    """How many times ``run`` adds two tensors of ``shape`` in place (``aten::add_``) and out of place."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    names = [e.name for e in prof.events() if e.name in ("aten::add", "aten::add_") and e.input_shapes[:2] == [shape] * 2]
    return {name: names.count(name) for name in ("aten::add", "aten::add_")}


def test_measure_lets_autograd_sum_gradients_in_place(monkeypatch):
    """Any ``TorchDispatchMode`` on the stack turns autograd's in-place sums of gradients off; measure's
    counting mode is off while autograd sums, so the step it counts sums a convolution's two weight
    gradients in place, as a step without measure does (with the mode on throughout: out of place, one
    gradient more). measure runs the step twice: counted, then timed. The prediction it reports beside
    them is left out here: the planner's profile runs a backward on fake tensors, under modes."""
    from dpcompile.inspect import explanation

    monkeypatch.setattr(explanation, "_estimate_kept", lambda *args, **kwargs: {})
    pm = dpcompile.transform(_ConvTwice(), ["cpu"], example_inputs=(torch.randn(4, 8, 2, 2),))
    x = torch.randn(4, 8, 2, 2)
    plain = _weight_sums(lambda: pm(x).sum().backward(), [8, 8, 1, 1])
    pm.zero_grad(set_to_none=True)
    measured = _weight_sums(lambda: dpcompile.measure(pm, x), [8, 8, 1, 1])
    assert plain == {"aten::add": 0, "aten::add_": 1}
    assert measured == {"aten::add": 0, "aten::add_": 2}


def test_a_whole_batch_norm_counts_each_copys_chunk_on_its_own_device():
    """Data parallel's BatchNorm runs as one node over every copy's chunk (the whole batch's
    statistics): each chunk's output, what it saves and its gradient are computed where the chunk is,
    so the two devices of a symmetric batch measure alike (17% over the prediction here). Counted on the
    node's first device, the first measured 30% over its prediction and the second 40% under."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(512, 4))
    x = torch.randn(8, 3, 8, 8)
    m = dpcompile.measure(dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,)), x)
    first, second = m.peak_bytes["cpu#0"], m.peak_bytes["cpu#1"]
    assert abs(first - second) <= 0.02 * second, m.peak_bytes
    for d, peak in m.peak_bytes.items():
        assert abs(peak - m.predicted_peak_bytes[d]) <= 0.2 * peak, (d, peak, m.predicted_peak_bytes[d])


class _LossAndLogits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x, y):
        logits = self.fc2(torch.relu(self.fc1(x)))
        return nn.functional.mse_loss(logits, y), logits


def test_measure_runs_a_1f1b_step_of_a_model_returning_its_loss_and_logits():
    """A 1F1B call runs its backward itself: the timed step no longer calls backward on the sum of the
    outputs (the logits have no gradient path: it was refused, "a backward reached the output"), and
    the gradients are left as they were."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    model = _LossAndLogits()
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x, y), pipeline=2, micro_batches=2, schedule="1f1b")
    m = dpcompile.measure(pm, x, y)
    assert m.training and m.step_time > 0 and all(p > 0 for p in m.step_allocated_peak.values())
    assert all(p.grad is None for p in model.parameters())
