"""``schedule="1f1b"`` in one process: a training call runs forward and backward per stage and
micro-batch in 1F1B order, with the single-device loss and gradients.

The loss each call returns and every gradient equal eager's (float64) for an MLP stack and a
transformers decoder (GPT-2, export frontend, ``labels=``), on 2 and 4 stages with 1, 2 and 4
micro-batches and an uneven last micro-batch. The order is recorded by the model itself (an
autograd function at the start of each stage notes its forwards and backwards and the
micro-batch it saw) and compared with the textbook 1F1B order; a stage never holds more than
``S - s`` micro-batches. BatchNorm in training couples micro-batches: refused, with the ways out.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile.capture import capture_model
from dpcompile.errors import DpCompileError
from dpcompile.modules.pipeline_1f1b import one_f_one_b_order
from tests.helpers import full_gradients
from tests.integration.test_pipeline import BNCNN, Stack, _grads_equal, _stack_inputs
from tests.thirdparty import import_or_skip

CONFIGS = [(2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4)]  # (stages, micro-batches)
EVENTS: list[tuple[str, int, float]] = []  # (F | B, stage, first sample's id) as the model runs


class _Note(torch.autograd.Function):
    """The identity, noting its forward and backward with the micro-batch's first sample id."""

    @staticmethod
    def forward(ctx, h, ids, stage):
        ctx.first, ctx.stage = float(ids[0]) if type(ids) is torch.Tensor else None, stage
        if ctx.first is not None:  # not while dpcompile works out shapes on fake tensors
            EVENTS.append(("F", stage, ctx.first))
        return h.clone()

    @staticmethod
    def backward(ctx, grad):
        EVENTS.append(("B", ctx.stage, ctx.first))
        return grad, None, None


class Note(nn.Module):
    def __init__(self, stage: int):
        super().__init__()
        self.stage = stage

    def forward(self, h, ids):
        return _Note.apply(h, ids, self.stage)


dpcompile.register_batch_rule(Note, "elementwise", replace=True)  # per sample: micro-batches run it apart


class NotedStack(nn.Module):
    """One linear layer per stage; each stage notes what it runs (``ids``: each sample's index)."""

    def __init__(self, stages: int, width: int = 8):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(stages)])
        self.notes = nn.ModuleList([Note(s) for s in range(stages)])
        self.head = nn.Linear(width, 3)

    def forward(self, x, ids, labels):
        for layer, note in zip(self.layers, self.notes):
            x = torch.tanh(note(layer(x), ids))
        return F.cross_entropy(self.head(x), labels)


def textbook_1f1b(stages: int, micro: int, s: int) -> list[tuple[str, int]]:
    """Stage ``s``'s 1F1B order (PipeDream-flush): ``S - s - 1`` warm-up forwards, then one
    forward and one backward at a time, then the cool-down backwards."""
    warmup = min(micro, stages - s - 1)
    order = [("F", m) for m in range(warmup)]
    for b in range(micro):
        if warmup + b < micro:
            order.append(("F", warmup + b))
        order.append(("B", b))
    return order


@pytest.mark.parametrize("stages,micro", CONFIGS)
def test_1f1b_mlp_stack_loss_and_gradients_equal_eager(stages, micro):
    """The call runs the backward: the returned loss, logits and every gradient (the input's
    too) as eager's."""
    torch.manual_seed(0)
    reference = Stack().double()
    model = copy.deepcopy(reference)
    x, labels = _stack_inputs()  # a batch of 7: an uneven last micro-batch
    x = x.double()
    schedule = "1f1b" if stages == 2 else "1F1B"  # as torch spells its class: the same schedule
    pm = dpcompile.transform(model, ["cpu"] * stages, pipeline=stages, micro_batches=micro, schedule=schedule,
                             example_inputs=(x, labels))  # fmt: skip
    assert pm.executor == "1f1b"
    x_in, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()  # the input's gradient too
    logits, loss = pm(x_in, labels)
    expected_logits, expected_loss = reference(x_ref, labels)
    expected_loss.backward()
    torch.testing.assert_close(logits, expected_logits)
    torch.testing.assert_close(loss, expected_loss)
    assert type(logits.grad_fn).__name__ == "_NoGradientPathBackward"  # a backward through it refuses
    _grads_equal(model, reference)
    torch.testing.assert_close(x_in.grad, x_ref.grad)


@pytest.mark.parametrize("stages,micro", CONFIGS)
def test_1f1b_runs_the_textbook_order_and_holds_at_most_s_minus_stage_micro_batches(stages, micro):
    """Each stage's forwards and backwards, as the model saw them, are 1F1B's; stage ``s`` never
    holds more than ``S - s`` micro-batches whose backward has not run."""
    torch.manual_seed(0)
    batch = 7
    x, ids, labels = torch.randn(batch, 8), torch.arange(batch, dtype=torch.float32), torch.randint(0, 3, (batch,))
    pm = dpcompile.transform(NotedStack(stages), ["cpu"] * stages, pipeline=[f"layers.{s}" for s in range(1, stages)],
                             micro_batches=micro, schedule="1f1b", leaf_modules=[Note])  # fmt: skip
    pm(x, ids, labels)  # the first call builds the programs
    EVENTS.clear()
    pm(x, ids, labels)
    firsts = [float(chunk[0]) for chunk in torch.tensor_split(ids, micro)]
    for s in range(stages):
        seen = [(kind, firsts.index(first)) for kind, stage, first in EVENTS if stage == s]
        assert seen == textbook_1f1b(stages, micro, s), f"stage {s}"
        live = peak = 0
        for kind, _ in seen:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        assert peak == min(micro, stages - s)


def test_1f1b_order_has_the_bubble_explain_reports():
    """Run as soon as its inputs are ready, one clock per forward or backward, the merged 1F1B
    order takes ``2 (M + S - 1)`` clocks: each stage waits ``(S-1)/(M+S-1)`` of the step, the
    bubble ``pm.bubble_fraction`` and ``explain`` report."""
    for stages in (2, 4):
        for micro in (1, 2, 4, 8):
            clock: dict[tuple[str, int, int], int] = {}
            free = [0] * stages
            for kind, s, m in one_f_one_b_order(stages, micro):
                waits = [free[s], clock.get(("F", s - 1, m), 0) if kind == "F" else clock[("F", s, m)]]
                if kind == "B":
                    waits.append(clock.get(("B", s + 1, m), 0))
                clock[(kind, s, m)] = free[s] = max(waits) + 1
            steps = max(clock.values())
            assert steps == 2 * (micro + stages - 1)
            assert 1 - 2 * micro / steps == pytest.approx((stages - 1) / (micro + stages - 1))
    x, labels = _stack_inputs(8)
    pm = dpcompile.transform(Stack(), ["cpu"] * 4, pipeline=4, micro_batches=4, schedule="1f1b")
    report = dpcompile.explain(pm, x, labels).to_dict()["pipeline"]
    assert report["schedule"] == "1f1b"
    assert report["bubble_fraction"] == pm.bubble_fraction == pytest.approx(3 / 7)


def test_1f1b_gradients_accumulate_and_a_loss_from_activations_divides_after():
    """Two calls add their gradients; a mean over activations (count known only after the
    forward) gives the eager gradients too, on top of what was accumulated before."""

    class ActivationLoss(Stack):
        def forward(self, x, labels):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return (self.head(x) ** 2).mean()

    torch.manual_seed(0)
    reference = ActivationLoss().double()
    model = copy.deepcopy(reference)
    x, labels = _stack_inputs()
    x = x.double()
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=4, schedule="1f1b")
    x_in, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    pm(x_in, labels)
    loss = pm(x_in, labels)
    expected = reference(x_ref, labels)
    (2 * expected).backward()
    torch.testing.assert_close(loss, expected)
    _grads_equal(model, reference)
    torch.testing.assert_close(x_in.grad, x_ref.grad)


def test_1f1b_a_shape_read_in_stage_0_serves_later_stages_and_micro_batches():
    """The checkpoint tests' LM reads ``x.shape`` of micro-batch 0 in stage 0 and the blocks of stage 1
    (and micro-batch 1) use it: the value is kept when micro-batch 0's forward runs (it was run again
    where ``x_mb0`` is not held: a KeyError). Loss and every gradient equal eager's."""
    from tests.integration.test_training_checkpoint import batches, make_model

    reference = make_model()
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2, schedule="1f1b",
                             example_inputs=batches()[0])  # fmt: skip
    assert "getattr_1_mb0 = embed_mb0.shape" in pm.code
    loss = pm(*batches()[0])
    expected = reference(*batches()[0])
    expected.backward()
    torch.testing.assert_close(loss, expected)
    _grads_equal(model, reference)


def test_1f1b_loss_backward_once_adds_nothing_else_refused_and_forward_only_without_grad():
    """The loss comes back with its backward done: one plain loss.backward() (the usual loop) leaves
    eager's gradients; a scaled loss or a second backward says why not; under no_grad and in eval
    mode a call runs forward only (no gradient appears)."""
    torch.manual_seed(0)
    reference = Stack()
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2, schedule="1f1b")
    x, labels = _stack_inputs()
    _, loss = pm(x, labels)
    _, expected = reference(x, labels)
    expected.backward()
    loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    with pytest.raises(DpCompileError, match="already in .grad, so a second backward"):
        loss.backward()
    _, loss = pm(x, labels)
    with pytest.raises(DpCompileError, match=r"already in .grad, so a backward with gradient \[2.0\]"):
        (loss * 2).backward()
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    with torch.no_grad():
        torch.testing.assert_close(pm(x, labels), reference(x, labels))
    pm.eval()
    reference.eval()
    torch.testing.assert_close(pm(x, labels)[1].detach(), reference(x, labels)[1].detach())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("options", [{}, {"tensor_parallel": True}], ids=["pp", "pp_tp"])
def test_1f1b_loss_sent_to_an_output_device_off_the_last_stage_backwards_once(options):
    """On distinct device names the loss is sent from the last stage (cpu:1, or cpu:2-3) to the output
    device (cpu:0): loss.backward() on it adds nothing, as on the last stage's device; eager's gradients."""
    torch.manual_seed(0)
    reference = Stack().double()
    model = copy.deepcopy(reference)
    devices = [f"cpu:{i}" for i in range(4 if options else 2)]
    pm = dpcompile.transform(model, devices, pipeline=2, micro_batches=2, schedule="1f1b", **options)
    x, labels = _stack_inputs()
    _, loss = pm(x.double(), labels)
    assert "_out = dpcompile_runtime_send(" in pm.code  # the loss leaves the last stage's device
    loss.backward()
    _, expected = reference(x.double(), labels)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    grads = full_gradients(pm) if options else {name: p.grad for name, p in model.named_parameters()}
    for name, q in reference.named_parameters():
        torch.testing.assert_close(grads[name], q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_1f1b_refuses_batchnorm_in_training_and_outputs_without_a_loss():
    """BatchNorm in training needs every micro-batch before any backward: refused with the ways
    out, which work (micro_batches=1 gives eager's gradients); so is a model without a loss."""
    torch.manual_seed(0)
    x = torch.randn(7, 3, 6, 6, dtype=torch.float64)
    pm = dpcompile.transform(BNCNN().double(), ["cpu"] * 2, pipeline=2, micro_batches=2, schedule="1f1b")
    with pytest.raises(DpCompileError, match=r"BatchNorm 'bn\d' in training .* schedule='gpipe'.*micro_batches=1"):
        pm(x)

    class BNWithLoss(BNCNN):
        def forward(self, x, labels):
            return F.cross_entropy(super().forward(x), labels)

    reference = BNWithLoss().double()
    model = copy.deepcopy(reference)
    labels = torch.randint(0, 4, (7,))
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=1, schedule="1f1b")
    torch.testing.assert_close(pm(x, labels), reference(x, labels))
    reference(x, labels).backward()
    _grads_equal(model, reference)

    class NoLoss(Stack):
        def forward(self, x, labels):
            return super().forward(x, labels)[0]

    pm = dpcompile.transform(NoLoss(), ["cpu"] * 2, pipeline=2, micro_batches=2, schedule="1f1b")
    with pytest.raises(DpCompileError, match="returns none"):
        pm(*_stack_inputs())


@pytest.fixture(scope="module")
def gpt2():
    """GPT-2 (tiny, random weights) exported once with labels=; a batch of 5 with ignored tokens."""
    T = import_or_skip("transformers")
    torch.manual_seed(0)
    config = T.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)  # fmt: skip
    reference = T.GPT2LMHeadModel(config).double()
    model = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(0)
    kwargs = {
        "input_ids": torch.randint(1, 64, (5, 8), generator=g),
        "labels": torch.randint(0, 64, (5, 8), generator=g),
    }
    kwargs["labels"][0, :5] = -100
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported, _ = capture_model(model, frontend="export", example_kwargs=kwargs)
    expected = reference(**kwargs)
    expected.loss.backward()
    return reference, model, exported, kwargs, expected


@pytest.mark.slow  # one torch.export of GPT-2: ~10 s
@pytest.mark.parametrize("stages,micro", [(2, 2), (4, 4)])
@pytest.mark.xdist_group("pipeline_1f1b_gpt2")  # its tests share the module's GPT-2 export: one worker builds it
def test_1f1b_gpt2_with_labels_equals_eager(gpt2, stages, micro):
    """GPT-2 (export frontend) with labels=: the loss over the non-ignored tokens of the whole
    batch, the logits and every gradient as eager's (a batch of 5: 3 + 2, or 2 + 1 + 1 + 1)."""
    reference, model, exported, kwargs, expected = gpt2
    model.zero_grad()
    pm = dpcompile.transform(exported, ["cpu"] * stages, pipeline=stages, micro_batches=micro, schedule="1f1b",
                             example_kwargs=kwargs)  # fmt: skip
    out = pm(**kwargs)
    torch.testing.assert_close(out.logits, expected.logits.detach())
    torch.testing.assert_close(out.loss.detach(), expected.loss.detach())
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


@pytest.mark.slow  # shares the module's GPT-2 export
@pytest.mark.xdist_group("pipeline_1f1b_gpt2")
def test_1f1b_gpt2_output_sent_off_the_last_stage_backwards_its_loss_once(gpt2):
    """On distinct device names the ModelOutput holding the loss is built on the last stage (cpu:1)
    and sent to the output device (cpu:0): out.loss.backward(), the usual loop, adds nothing to eager's
    gradients (it raised, naming the output); a backward from the logits still says why not."""
    reference, model, exported, kwargs, expected = gpt2
    model.zero_grad()
    pm = dpcompile.transform(exported, ["cpu:0", "cpu:1"], pipeline=2, micro_batches=2, schedule="1f1b",
                             example_kwargs=kwargs)  # fmt: skip
    out = pm(**kwargs)
    assert "CausalLMOutputWithCrossAttentions, 'cpu:0')" in pm.code  # the output leaves the last stage
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), expected.loss.detach())
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")
    with pytest.raises(DpCompileError, match="a backward reached the output"):
        out.logits.sum().backward()


class NestedOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x, y):
        out = self.fc2(torch.relu(self.fc1(x)))
        return [F.mse_loss(out, y), [out[:, :2], {"out": out}]]


def test_1f1b_returns_the_lists_and_dicts_forward_returns():
    """The outputs come back as forward built them, plain lists and dicts (they were fx's
    immutable_list and immutable_dict); the loss's gradients are eager's."""
    model = NestedOutputs().double()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2, schedule="1f1b")
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    got, want = pm(x, y), eager(x, y)
    assert type(got) is list and type(got[1]) is list and type(got[1][1]) is dict
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1][0], want[1][0])
    torch.testing.assert_close(got[1][1]["out"], want[1][1]["out"])
    want[0].backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


class MSE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def test_1f1b_runs_an_exported_mse_loss_split():
    """torch.export spells F.mse_loss with aten.broadcast_tensors, which had no batch rule: it ran on
    the gathered batch, so 1F1B refused the model and data parallelism computed the loss whole. Now
    split (its element counts summed as numbers): 1F1B's loss and gradients are eager's, and data
    parallel runs nothing whole."""
    model = MSE().double()
    eager = copy.deepcopy(model)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2, schedule="1f1b", frontend="export", example_inputs=(x, y))
    loss, expected = pm(x, y), eager(x, y)
    torch.testing.assert_close(loss, expected)
    expected.backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")
    dp = dpcompile.transform(copy.deepcopy(eager), ["cpu"] * 2, frontend="export", example_inputs=(x, y))
    torch.testing.assert_close(dp(x, y), expected)
    assert [w["node"] for w in dpcompile.explain(dp, x, y).whole] == ["truediv"]  # the sum over the count
