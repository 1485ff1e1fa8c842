"""Pipelines at their edges (issue 29): what a forward does besides computing, in one process.

- A parameter the root module holds, read by a later stage (timm ViT's ``cls_token`` and
  ``pos_embed`` after a cut, a root-level scale in the last stage): outputs, loss and every
  gradient as eager's, under GPipe and 1F1B.
- What forward writes besides its outputs (a step counter ``self.calls.add_(1)``, an EMA of a
  parameter or of an activation, BatchNorm's running statistics): under 1F1B once per call, as
  eager and GPipe do; the buffers equal eager's after every call.
- A backward 1F1B cannot make exact (a loss combined from the returned logits, whose gradient
  would be dropped) raises, naming the ways out (which work); a plain ``loss.backward()`` still works.
- A model built on ``meta`` with ``pipeline=`` over a device list: it waits for its weights
  (``pm.needs_weights``), loads a checkpoint the real model wrote, then runs as eager; captured
  with torch.export, a non-persistent buffer the load computes (rotary ``inv_freq``) and a tied
  head too (no ``ModelChanged`` at the first call); a buffer no config rebuilds is refused, named.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from tests.helpers import full_gradients
from tests.integration.test_pipeline import Stack, _stack_inputs


class TinyViT(nn.Module):
    """A ViT's shape in miniature: the root holds ``cls_token``, ``pos_embed`` and ``scale`` and
    reads them through tensor methods (``expand``, ``unsqueeze``) after the stem and the head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.embed = nn.Linear(4, 8)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 8))
        self.pos_embed = nn.Parameter(torch.randn(1, 4, 8))
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 3)
        self.scale = nn.Parameter(torch.rand(3) + 0.5)

    def forward(self, x, labels):
        h = self.embed(torch.tanh(self.stem(x)))
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], 1) + self.pos_embed
        for block in self.blocks:
            h = torch.tanh(block(h))
        logits = self.head(h[:, 0]) * self.scale.unsqueeze(0)
        return logits, F.cross_entropy(logits, labels)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_later_stage_reads_root_parameters_as_eager(schedule):
    """cls_token and pos_embed read in stage 1, scale in stage 2: outputs, loss and gradients equal eager's."""
    torch.manual_seed(0)
    reference = TinyViT().double()
    model = copy.deepcopy(reference)
    x, labels = torch.randn(5, 3, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    pm = dpcompile.transform(model, ["cpu"] * 3, pipeline=["embed", "blocks.1"], micro_batches=2, schedule=schedule)
    assert pm.stages[1].module_paths[0] == "embed" and "head" in pm.stages[2].module_paths
    logits, loss = pm(x, labels)
    expected_logits, expected = reference(x, labels)
    torch.testing.assert_close(logits, expected_logits.detach())
    torch.testing.assert_close(loss, expected.detach())
    expected.backward()
    loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_pipeline_timm_vit_reads_cls_token_and_pos_embed_after_the_cut():
    """timm's ViT cut before patch_embed.norm: cls_token and pos_embed are read in stage 1; logits
    and every gradient equal eager's (GPipe)."""
    from tests.thirdparty import import_timm

    timm = import_timm()
    torch.manual_seed(0)
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8, num_classes=3,
                                  depth=1, embed_dim=16, num_heads=2).double()  # fmt: skip
    model = copy.deepcopy(reference)
    x = torch.randn(5, 3, 16, 16, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=["patch_embed.norm"], micro_batches=2)
    assert "cls_token" in pm.stages[1].code and "cls_token" not in pm.stages[0].code
    out = pm(x)
    expected = reference(x)
    torch.testing.assert_close(out, expected)
    expected.square().mean().backward()
    out.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class MetaStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x, labels):
        logits = self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return logits, F.cross_entropy(logits, labels)


@pytest.mark.parametrize("schedule,example", [("gpipe", False), ("1f1b", True)])
def test_pipeline_meta_model_loads_a_checkpoint_and_runs_as_eager(tmp_path, schedule, example):
    """A meta model with pipeline=2 over ["cpu"] * 2 needs weights, refuses a call, then loads what
    save_checkpoint wrote from the real model: outputs, loss and gradients equal eager's."""
    torch.manual_seed(0)
    reference = MetaStack().double()
    x, labels = torch.randn(5, 8, dtype=torch.float64), torch.randint(0, 3, (5,))
    path = os.fspath(tmp_path / "model.safetensors")
    dpcompile.save_checkpoint(dpcompile.transform(copy.deepcopy(reference), ["cpu"]), path)
    with torch.device("meta"):
        model = MetaStack().double()
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2, schedule=schedule,
                             example_inputs=(x, labels) if example else None)  # fmt: skip
    assert pm.needs_weights and len(pm.stages) == 2
    with pytest.raises(dpcompile.DpCompileError, match="load_checkpoint"):
        pm(x, labels)
    dpcompile.load_checkpoint(pm, path)
    assert not pm.needs_weights
    logits, loss = pm(x, labels)
    expected_logits, expected = reference(x, labels)
    torch.testing.assert_close(logits, expected_logits.detach())
    torch.testing.assert_close(loss, expected.detach())
    expected.backward()
    loss.backward()
    for (name, p), q in zip(pm.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class RotaryConfig:
    width, vocab = 8, 11


ROTARY_CONFIG = RotaryConfig()


class Rotary(nn.Module):
    """A rotary embedding's shape: ``inv_freq`` computed in ``__init__`` from the config,
    ``persistent=False`` (no checkpoint holds it: loading builds ``Rotary(config)`` to get it)."""

    def __init__(self, config):
        super().__init__()
        steps = torch.arange(config.width, dtype=torch.float64) / config.width
        self.register_buffer("inv_freq", 1.0 / 10000**steps, persistent=False)

    def forward(self, h):
        return torch.cos(self.inv_freq * h.shape[1])


class TiedRotaryLM(nn.Module):
    """An embedding tied to the head, a rotary submodule, two blocks; a constant from Python data
    (torch.export lifts it into the program: a real tensor beside the fake ones of a meta model)."""

    def __init__(self, config=ROTARY_CONFIG):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.width)
        self.rotary = Rotary(config)
        self.blocks = nn.ModuleList(nn.Linear(config.width, config.width) for _ in range(2))
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids, labels):
        h = self.embed(ids)
        cos = self.rotary(h)
        for block in self.blocks:
            h = h + torch.tanh(block(h)) * cos
        logits = self.head(h) * torch.tensor(0.5, dtype=h.dtype)
        return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("layout", [{"schedule": "gpipe"}, {"schedule": "1f1b"}, {"mesh": {"pp": 2, "tp": 2}}], ids=str)
def test_pipeline_meta_model_exported_computes_buffers_and_keeps_ties(tmp_path, layout):
    """A meta model captured with torch.export, under pipeline=2 (and pp x tp, which copies the
    fake model with its real lifted constant): load_checkpoint computes the rotary inv_freq and
    fills the tied head; the first call runs (the stages hold the guarded model's modules, given
    memory by dpcompile itself: not a ModelChanged) with eager's loss and gradients."""
    torch.manual_seed(0)
    reference = TiedRotaryLM().double()
    ids, labels = torch.randint(0, 11, (4, 3)), torch.randint(0, 11, (4, 3))
    path = os.fspath(tmp_path / "model.safetensors")
    dpcompile.save_checkpoint(dpcompile.transform(copy.deepcopy(reference), ["cpu"]), path)
    with torch.device("meta"):
        model = TiedRotaryLM().double()
    options = layout if "mesh" in layout else {"pipeline": 2, **layout}
    pm = dpcompile.transform(model, ["cpu"] * (4 if "mesh" in layout else 2), micro_batches=2,
                             example_inputs=(ids, labels), frontend="export", **options)  # fmt: skip
    dpcompile.load_checkpoint(pm, path)
    logits, loss = pm(ids, labels)
    expected_logits, expected = reference(ids, labels)
    torch.testing.assert_close(logits, expected_logits.detach())
    torch.testing.assert_close(loss, expected.detach())
    expected.backward()
    loss.backward()
    grads = full_gradients(pm) if "mesh" in layout else {name: p.grad for name, p in pm.named_parameters()}
    assert dict(reference.named_parameters()).keys() <= grads.keys()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_pipeline_meta_model_refuses_a_buffer_it_cannot_compute_and_keeps_waiting(tmp_path):
    """A non-persistent buffer that no config rebuilds (nor a module above it): the load
    raises a DpCompileError naming the buffer and the ways out; the program still waits."""
    reference = TiedRotaryLM().double()
    path = os.fspath(tmp_path / "model.safetensors")
    dpcompile.save_checkpoint(dpcompile.transform(copy.deepcopy(reference), ["cpu"]), path)
    with torch.device("meta"):
        model = TiedRotaryLM().double()
    del model.config  # nothing to build Rotary(config) from
    ids = torch.randint(0, 11, (4, 3))
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, example_inputs=(ids, ids), frontend="export")
    with pytest.raises(
        dpcompile.DpCompileError, match=r"'rotary.inv_freq' \(Rotary\).*include_buffers=False.*persistent=True"
    ):
        dpcompile.load_checkpoint(pm, path)
    assert pm.needs_weights


class Counted(nn.Module):
    """A forward with writes: a step counter (read again after the write), an EMA of a parameter,
    an EMA of an activation's batch mean; with ``bn``, BatchNorm's running statistics."""

    def __init__(self, bn: bool = False):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8) if bn else nn.Identity()
        self.b = nn.Linear(8, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("weight_ema", torch.zeros(3, 8))
        self.register_buffer("feature_ema", torch.zeros(8))

    def forward(self, x, labels):
        self.calls.add_(1)
        self.weight_ema.mul_(0.5).add_(self.b.weight.detach(), alpha=0.5)
        h = torch.tanh(self.norm(self.a(x)))
        self.feature_ema.mul_(0.9).add_(0.1 * h.detach().mean(0))
        logits = self.b(h) * (1 + self.calls / 10)
        return logits, F.cross_entropy(logits, labels)


@pytest.mark.parametrize("bn,micro", [(False, 3), (True, 1)])
def test_1f1b_runs_every_write_once_per_call_as_eager(bn, micro):
    """Three training steps under 1F1B: the loss, and every buffer (counter, EMAs, BatchNorm's
    running statistics) equal eager's after each call."""
    torch.manual_seed(0)
    reference = Counted(bn).double()
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=micro, schedule="1f1b")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, labels = torch.randn(7, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (7,), generator=g)
        _, loss = pm(x, labels)
        loss.backward()
        optimizer.step()
        _, expected = reference(x, labels)
        expected.backward()
        reference_optimizer.step()
        torch.testing.assert_close(loss, expected.detach())
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(model.state_dict()[name], value, msg=name)
    assert int(model.calls) == 3


def test_1f1b_refuses_a_backward_through_returned_outputs_and_gpipe_makes_it_exact():
    """(loss + 0.1 * logits.square().mean()).backward() under 1F1B raises and adds nothing, as does
    logits.sum().backward(); a plain loss.backward() then works; GPipe gives eager's gradients for it."""
    torch.manual_seed(0)
    reference = Stack().double()
    model = copy.deepcopy(reference)
    x, labels = _stack_inputs()
    x = x.double()
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2, schedule="1f1b")
    logits, loss = pm(x, labels)
    after_call = [p.grad.clone() for p in model.parameters()]
    for combined in (lambda: loss + 0.1 * logits.square().mean(), lambda: logits.sum()):
        with pytest.raises(dpcompile.DpCompileError, match=r"output 'head' .* no gradient path.*schedule='gpipe'"):
            combined().backward()
        for before, p in zip(after_call, model.parameters()):
            torch.testing.assert_close(p.grad, before)
    loss.backward()  # the usual loop: adds nothing
    reference(x, labels)[1].backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)

    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2, schedule="gpipe")
    logits, loss = pm(x, labels)
    (loss + 0.1 * logits.square().mean()).backward()
    expected_logits, expected = reference(x, labels)
    (expected + 0.1 * expected_logits.square().mean()).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class FlagBeforeOptional(nn.Module):
    """A Python flag the program is specialised on (no node reads it), then an optional tensor."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, double: bool = False, extra=None):
        h = self.fc2(torch.relu(self.fc1(x)))
        if double:
            h = h * 2
        return h if extra is None else h + extra


def test_pipeline_keeps_forward_signature_order_for_a_flag_no_node_reads():
    """GPipe's order put a placeholder without readers (the flag) after the others: the program's
    signature became ``forward(self, x, extra=None, double=False)``, so ``pm(x, True)`` bound True to
    ``extra`` and ran the program for ``double=False``: silently not doubled."""
    model = FlagBeforeOptional()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2, example_inputs=(x, True))
    for flag in (True, False, True):
        torch.testing.assert_close(pm(x, flag), eager(x, flag))


class RootBuffers(nn.Module):
    """Buffers of the root (a 0-dim shift, a vector) that forward reads after the cut, in stage 1."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.register_buffer("shift", torch.tensor(0.25))
        self.register_buffer("offset", torch.linspace(0, 1, 8))

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x))) + self.shift + self.offset


@pytest.mark.parametrize("mesh", [{"pp": 2}, {"pp": 2, "dp": 2}], ids=str)
def test_a_root_buffer_read_in_a_later_stage_lives_on_that_stages_device(mesh):
    """Placement moved the root's buffers into the program's own copy, and the program then read
    the model's (adopted) buffers, still on stage 0's device: on distinct GPUs stage 1 mixed
    devices (FakeTensorDeviceMismatchError on fake cuda:0, cuda:1)."""
    torch.manual_seed(0)
    model, x = RootBuffers(), torch.randn(4, 8)
    n = 2 * len(mesh)
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * n, mesh=mesh, pipeline=["l2"], example_inputs=(x,))
    result = dpcompile.verify(pm, model, x, fake_devices=n)
    assert result.ok, str(result)
