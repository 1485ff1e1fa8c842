"""Data-parallel edge cases users hit: a float16 loss keeps its dtype, a batch_dim the input does
not have is a clear error."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import dpcompile


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.fc(x), y)


def test_float16_cross_entropy_loss_stays_float16():
    """A float16 model's mean loss comes back float16 with the single-device value."""
    model = Classifier().half()
    x, y = torch.randn(6, 4).half(), torch.randint(0, 3, (6,))
    pm = dpcompile.transform(model, ["cpu"] * 2)
    got, expected = pm(x, y), model(x, y)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


def test_batch_dim_beyond_the_input_rank_is_a_value_error():
    """batch_dim=3 on a 2-D input names the argument and its shape, not an IndexError in gather."""
    pm = dpcompile.transform(torch.nn.Linear(4, 3), ["cpu"] * 2, batch_dim=3)
    with pytest.raises(ValueError, match=r"batch_dim=3, but argument 'input' has 2 dims \(shape \(6, 4\)\)"):
        pm(torch.randn(6, 4))


def test_unbatched_1d_input_runs_as_one_sample():
    """A 1-D input to a Linear is one sample without a batch dim: it runs on one device, as the
    model runs it, while a 2-D batch still splits."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    pm = dpcompile.transform(model, ["cpu"] * 2)
    x = torch.randn(4)
    torch.testing.assert_close(pm(x), model(x))
    batch = torch.randn(6, 4)
    torch.testing.assert_close(pm(batch), model(batch))
    assert "x_dev1" in pm.program_for_call(batch).code or "input_1_dev1" in pm.program_for_call(batch).code


class Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        import torch.utils.checkpoint as cp
        from torch.utils.checkpoint import checkpoint

        h = cp.checkpoint(self.block, x, use_reentrant=False)
        h = checkpoint(self.norm, h, use_reentrant=False)  # BatchNorm in training: the whole batch
        return self.head(h)


def test_activation_checkpointing_kept_per_device():
    """``checkpoint(self.block, x)`` stays a checkpoint call, one per device; a checkpointed
    BatchNorm in training runs once on the whole batch; outputs and gradients are exact."""
    model = Checkpointed()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    code = pm.code
    assert code.count("torch.utils.checkpoint.checkpoint(") == 3  # block on 2 devices, the norm once
    assert "checkpoint_dev1 = torch.utils.checkpoint.checkpoint(block_dev1" in code
    x = torch.randn(6, 4)
    out = pm(x)
    expected = Checkpointed()
    expected.load_state_dict(model.state_dict())
    ref = expected(x)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for (name, p), q in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class CheckpointsAClosure(Checkpointed):
    """torchvision's DenseNet with ``memory_efficient=True``: ``checkpoint`` of a local function."""

    def forward(self, x):
        import torch.utils.checkpoint as cp

        def closure(t):
            return self.block(t) * 2

        return self.head(cp.checkpoint(closure, x, use_reentrant=False))


def test_checkpoint_of_a_function_that_is_not_a_submodule_is_traced_through_with_a_warning():
    """The program cannot call a closure: its body runs inline (no recompute, as the warning says),
    and outputs and gradients equal eager's."""
    model = CheckpointsAClosure()
    expected = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"checkpoint\(.*closure.*not a submodule"):
        pm = dpcompile.transform(model, ["cpu"] * 2)
    assert "torch.utils.checkpoint" not in pm.code
    x = torch.randn(6, 4)
    out, ref = pm(x), expected(x)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for (name, p), q in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class ScaledByScalar(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))

    def forward(self, t):
        return self.w * t


def test_scalar_input_runs_on_one_device():
    """A 0-d tensor carries no batch: it runs once, as eager (replicas would each return the
    whole output and the gather would concatenate them into twice the rows)."""
    model = ScaledByScalar()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    t = torch.tensor(3.0)
    out = pm(t)
    assert out.shape == (4,)
    torch.testing.assert_close(out, model(t))


@pytest.mark.parametrize(
    ("layer", "sample"),
    [(torch.nn.Conv1d(3, 4, 3), (3, 10)), (torch.nn.Conv2d(3, 4, 3), (3, 8, 8)), (torch.nn.MaxPool2d(2), (3, 8, 8))],
    ids=["conv1d", "conv2d", "maxpool2d"],
)
def test_unbatched_convolution_input_runs_as_one_sample(layer, sample):
    """Conv2d on a (C, H, W) input is one sample: it runs on one device instead of splitting the
    channels ("expected 3 channels, but got 2"), while a batch still splits."""
    model = torch.nn.Sequential(layer, torch.nn.ReLU())
    pm = dpcompile.transform(model, ["cpu"] * 2)
    x = torch.randn(*sample)
    torch.testing.assert_close(pm(x), model(x))
    batch = torch.randn(6, *sample)
    torch.testing.assert_close(pm(batch), model(batch))
    assert "dev1" in pm.program_for_call(batch).code


class AddBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, bias=None):
        y = self.fc(x)
        return y if bias is None else y + bias


def test_broadcast_argument_error_names_the_route_that_works():
    """A bias of shape (4,) next to a batch of 6: the error names 'bias' and says to give it an
    example; doing so runs as eager, with and without the bias."""
    model, x, bias = AddBias(), torch.randn(6, 4), torch.randn(4)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    with pytest.raises(ValueError, match=r"argument 'bias' has batch size 4.*example_inputs= that give 'bias' an example"):
        pm(x, bias)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x, bias))
    torch.testing.assert_close(pm(x, bias), model(x, bias))
    torch.testing.assert_close(pm(x), model(x))


class NoGradTeacher(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.student = torch.nn.Linear(4, 4)
        self.teacher = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            t = torch.relu(self.teacher(x))
        with torch.set_grad_enabled(False):
            scale = self.teacher(x).sigmoid()
        return self.student(x) * t + scale


@pytest.mark.parametrize("tensor_parallel", [False, True])
def test_no_grad_block_inside_forward_stops_gradients(tensor_parallel):
    """``with torch.no_grad():`` inside forward: the block's values carry no gradient, so the
    teacher gets none (tracing used to drop the block and train it); the student's are exact."""
    model = NoGradTeacher()
    reference = NoGradTeacher()
    reference.load_state_dict(model.state_dict())
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=tensor_parallel)
    assert "without_grad" in pm.code
    x = torch.randn(6, 4)
    out, expected = pm(x), reference(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    grads = dict(pm.named_parameters())
    assert all(p.grad is None for name, p in grads.items() if name.startswith("teacher"))
    if not tensor_parallel:
        torch.testing.assert_close(model.student.weight.grad, reference.student.weight.grad)


class SinusoidUnderNoGrad(torch.nn.Module):
    """SpeechT5's sinusoidal position embedding, reduced: a forward under ``@torch.no_grad()`` on the input."""

    @torch.no_grad()
    def forward(self, x):
        return torch.sin(torch.cumsum(torch.ones_like(x[..., 0]), dim=-1)).unsqueeze(-1).expand_as(x)


class NoGradBlocks(NoGradTeacher):
    def __init__(self):
        super().__init__()
        self.positions = SinusoidUnderNoGrad()

    def forward(self, x):
        return super().forward(x + self.positions(x)).pow(2).mean()


def test_no_grad_blocks_run_split_under_the_export_frontend():
    """torch.export keeps a no-grad block as one higher-order op, which ran whole on the gathered batch
    with everything after it (split fraction 0): its ops now run split, its values detached; the loss
    and every gradient equal eager's, the teacher gets none."""
    torch.manual_seed(0)
    model = NoGradBlocks().double()
    eager = copy.deepcopy(model)
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    assert "without_grad" in pm.code and "wrap_with_set_grad_enabled" not in pm.code
    report = dpcompile.explain(pm, x)
    assert report.whole == [] and report.split_flop_fraction == 1.0, report.whole
    got, want = pm(x), eager(x)
    torch.testing.assert_close(got, want)
    got.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None) == name.startswith("teacher"), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_transform_under_no_grad_keeps_gradients():
    """transform called inside ``torch.no_grad()`` (as an eval script may): the program still
    trains when called with gradients on."""
    model = NoGradTeacher()
    with torch.no_grad():
        pm = dpcompile.transform(model, ["cpu"] * 2)
    pm(torch.randn(6, 4)).sum().backward()
    assert model.student.weight.grad is not None and model.teacher.weight.grad is None


class InferenceModeTeacher(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.student = torch.nn.Linear(4, 4)
        self.teacher = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.inference_mode():
            t = self.teacher(x).relu()
        return self.student(x) * t.clone()


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_inference_mode_block_inside_forward_stops_gradients(frontend):
    """``with torch.inference_mode():`` inside forward is a no-grad block: the teacher gets no gradient,
    as in eager (neither frontend recorded it, so the program trained the teacher); the rest is exact."""
    torch.manual_seed(0)
    model = InferenceModeTeacher().double()
    eager = copy.deepcopy(model)
    x = torch.randn(5, 4, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend=frontend, example_inputs=(x,))
    got, want = pm(x), eager(x)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    want.sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None) == name.startswith("teacher"), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


class BranchesOnGradMode(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        if torch.is_grad_enabled():
            return self.fc(x)
        return self.fc(x) * 2


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_branch_on_the_grad_mode_is_checked_at_each_call(frontend):
    """Capture runs with gradients on and takes that branch: a call under ``torch.no_grad()`` ran it too (half
    eager's output, silently). The program checks the grad mode where forward reads it: under no_grad it is
    refused by name; with gradients on it is eager's."""
    torch.manual_seed(0)
    model = BranchesOnGradMode().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend=frontend, example_inputs=(x,))
    torch.testing.assert_close(pm(x), model(x))
    with torch.no_grad(), pytest.raises(dpcompile.DpCompileError, match=r"reads torch.is_grad_enabled\(\) \(test_batch_edge_cases.py"):
        pm(x)


class LogsGradMode(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        enabled = torch.is_grad_enabled()
        logging.getLogger(__name__).debug("grad mode %s", enabled)
        return self.fc(x)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_grad_mode_read_that_decides_nothing_runs_in_either_mode(frontend):
    """A read of ``torch.is_grad_enabled()`` that is only logged was refused under ``no_grad`` like a branch.
    Captured again with the read returning False, the program is the same: no check; the branch above keeps its."""
    torch.manual_seed(0)
    model = LogsGradMode().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend=frontend, example_inputs=(x,))
    assert "expect_grad_mode" not in pm.code
    with torch.no_grad():
        torch.testing.assert_close(pm(x), model(x))
    torch.testing.assert_close(pm(x), model(x))


class LogsGradModeOverVarargs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    reads_grad_mode = True

    def forward(self, *inputs):
        if self.reads_grad_mode:
            logging.getLogger(__name__).debug("grad mode %s", torch.is_grad_enabled())
        return self.fc(inputs[0]) + inputs[1] * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)


class BranchesOnGradModeByConstant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        scale = torch.tensor(1.0, dtype=torch.float64) if torch.is_grad_enabled() else torch.tensor(2.0, dtype=torch.float64)
        return self.fc(x) * scale


def test_a_logged_grad_mode_read_runs_over_varargs_and_tensor_constants():
    """fx frontend: the capture again with the read returning False lacked ``forward(*inputs)``'s count and
    numbered its tensor constants on, so a read that decides nothing looked like a branch (a call under
    no_grad refused) and left its constants on the model. Now the program runs in both modes as eager, and
    the model keeps only what a capture without the read leaves on it."""
    torch.manual_seed(0)
    model = LogsGradModeOverVarargs().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="fx", example_inputs=(x, y))
    assert "expect_grad_mode" not in pm.code
    with torch.no_grad():
        torch.testing.assert_close(pm(x, y), model(x, y))
    torch.testing.assert_close(pm(x, y), model(x, y))
    stowed = sorted(k for k in vars(model) if k.startswith("_tensor_constant"))
    unread = LogsGradModeOverVarargs().double()
    unread.reads_grad_mode = False
    dpcompile.transform(unread, ["cpu"] * 2, frontend="fx", example_inputs=(x, y))
    assert len(stowed) == len([k for k in vars(unread) if k.startswith("_tensor_constant")])


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_grad_mode_branch_between_constants_is_checked(frontend):
    """``torch.tensor(1.0) if torch.is_grad_enabled() else torch.tensor(2.0)``: the two captures differ only in
    a constant's value. The export frontend compared code alone and ran the captured branch under no_grad
    (twice eager's output, silently); both frontends now refuse that call by name, and run eager's with grad."""
    torch.manual_seed(0)
    x = torch.randn(5, 4, dtype=torch.float64)
    decides = BranchesOnGradModeByConstant().double()
    pm = dpcompile.transform(decides, ["cpu"] * 2, frontend=frontend, example_inputs=(x,))
    torch.testing.assert_close(pm(x), decides(x))
    with torch.no_grad(), pytest.raises(dpcompile.DpCompileError, match=r"reads torch.is_grad_enabled\(\)"):
        pm(x)


class AutocastInside(torch.nn.Module):
    def __init__(self, enabled: bool = True):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 2)
        self.enabled = enabled

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.enabled):
            h = self.fc(x)
        return self.head(h.float())


def test_autocast_inside_forward_is_refused_with_the_way_out():
    """``torch.autocast`` entered inside forward: fx cannot record it (the program ran the block in
    float32, silently); a TraceError says so, and the route it names (examples, for the export
    frontend) runs as eager. ``autocast(enabled=False)`` inside forward changes nothing: kept."""
    model, x = AutocastInside(), torch.randn(6, 4)
    with pytest.raises(dpcompile.TraceError, match=r"enters torch.autocast.*pm\(x\).*example_inputs="):
        dpcompile.transform(model, ["cpu"] * 2)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,))
    torch.testing.assert_close(pm(x), model(x))
    plain = AutocastInside(enabled=False)
    torch.testing.assert_close(dpcompile.transform(plain, ["cpu"] * 2)(x), plain(x))


@pytest.mark.parametrize("tensor_parallel", [False, True])
def test_autocast_and_inference_mode_around_the_call(tensor_parallel):
    """``torch.autocast`` and ``torch.inference_mode`` around ``pm(x)`` give what they give eager (a
    row-parallel bias added after the reduction used to promote the output back to float32)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=tensor_parallel)
    x = torch.randn(6, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = pm(x), model(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    with torch.inference_mode():
        torch.testing.assert_close(pm(x), model(x), atol=1e-5, rtol=1e-5)
    pm(x).sum().backward()  # and trains again afterwards


class Recurrent(torch.nn.Module):
    def __init__(self, batch_first: bool):
        super().__init__()
        self.rnn = torch.nn.LSTM(4, 5, batch_first=batch_first)

    def forward(self, x):
        return self.rnn(x)[0]


@pytest.mark.parametrize("batch_first", [False, True])
def test_unbatched_sequence_to_an_rnn_runs_as_one_sample(batch_first):
    """A 2-D (length, features) sequence is one unbatched sample to an LSTM: it runs on one device
    instead of splitting the features ("input.size(-1) must be equal to input_size")."""
    model = Recurrent(batch_first)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    sequence = torch.randn(7, 4)
    torch.testing.assert_close(pm(sequence), model(sequence))
    batch = torch.randn(6, 7, 4) if batch_first else torch.randn(7, 6, 4)
    torch.testing.assert_close(pm(batch), model(batch), atol=1e-5, rtol=1e-5)


class TwoRecurrent(torch.nn.Module):
    """A batch-first 2-layer LSTM, then a time-major GRU started from a given state."""

    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(4, 6, num_layers=2, batch_first=True)
        self.gru = torch.nn.GRU(6, 6)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x, h0):
        h, _ = self.lstm(x)
        g, last = self.gru(h.transpose(0, 1), h0)
        return self.head(g[-1] + last[0])


def test_export_frontend_rnn_ops_split_by_sample():
    """Under the export frontend an RNN call is ``aten.lstm.input`` / ``aten.gru.input`` on its weights:
    each sample's sequence runs on its device (the output split as the input, the states on dim 1),
    where before the whole batch was gathered for it (93% of the FLOPs whole)."""
    model = TwoRecurrent()
    x, h0 = torch.randn(6, 5, 4), torch.randn(1, 6, 6)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x, h0))
    report = dpcompile.explain(pm, x, h0)
    assert report.whole == [] and report.split_flop_fraction == 1.0, report.whole
    assert "lstm_lstm_dev1 = torch.ops.aten.lstm.input(" in pm.code, pm.code
    result = dpcompile.verify(pm, copy.deepcopy(model), x, h0)
    assert result and result.checked["parameter gradients"] == 14, str(result)


class SelfAttention(torch.nn.Module):
    def __init__(self, batch_first: bool):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first)

    def forward(self, x):
        return self.attn(x, x, x)[0]


class Encoder(torch.nn.Module):
    def __init__(self, batch_first: bool):
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)

    def forward(self, x):
        return self.layer(x)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("kind", ["attention", "encoder_layer"])
def test_unbatched_sequence_to_attention_runs_as_one_sample(kind, batch_first):
    """A (length, embedding) sequence is one unbatched sample to attention: it runs on one device,
    not split on the embedding ("expecting embedding dimension of 8, but got 4") or, worse, on the
    sequence (attention within each half: a silently wrong result)."""
    model = SelfAttention(batch_first) if kind == "attention" else Encoder(batch_first)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    sequence = torch.randn(5, 8)
    torch.testing.assert_close(pm(sequence), model(sequence), atol=1e-5, rtol=1e-5)
    batch = torch.randn(6, 5, 8) if batch_first else torch.randn(5, 6, 8)
    torch.testing.assert_close(pm(batch), model(batch), atol=1e-5, rtol=1e-5)
