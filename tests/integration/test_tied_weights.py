"""Tied weights under tensor parallelism, without example inputs: an embedding tied to its LM head
(``lm_head.weight = emb.weight``) and a Linear used twice train as eager for 3 SGD steps, and the
state dict keeps the tie."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 16, d: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        return self.lm_head(h + self.fc2(F.gelu(self.fc(h))))


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.fc(torch.relu(self.fc(x))))


def _train_both(pm: nn.Module, reference: nn.Module, x: torch.Tensor) -> None:
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        for module, optimizer in ((pm, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            module(x).pow(2).mean().backward()
            optimizer.step()
    torch.testing.assert_close(pm(x), reference(x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("plan", [True, {"lm_head": "column"}, {"fc": "column", "fc2": "row", "lm_head": "column"}])
@pytest.mark.parametrize("n", [2, 4])
def test_tied_lm_head_trains_as_eager_without_example_inputs(plan, n):
    """3 SGD steps equal eager; pm.state_dict() has the model's keys with the tie kept; loading it back round-trips."""
    torch.manual_seed(0)
    model, ids = TiedLM(), torch.randint(0, 16, (5, 7))
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * n, tensor_parallel=plan)
    _train_both(pm, reference, ids)
    state = pm.state_dict()
    assert state.keys() == reference.state_dict().keys()
    assert torch.equal(state["lm_head.weight"], state["emb.weight"])
    torch.testing.assert_close(state["emb.weight"], reference.emb.weight.detach(), atol=1e-5, rtol=1e-4)
    pm.load_state_dict(reference.state_dict())
    torch.testing.assert_close(pm(ids), reference(ids), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("plan", [True, {"fc": "column"}, {"fc": "row"}])
def test_linear_used_twice_trains_as_eager(plan):
    """A Linear called twice in forward: one parameter whose gradient sums both uses, as eager."""
    torch.manual_seed(0)
    model, x = Twice(), torch.randn(5, 8)
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=plan)
    _train_both(pm, reference, x)


class TiedAcrossStages(nn.Module):
    """An embedding in stage 0 tied to the head in stage 1, with a mean loss."""

    def __init__(self, vocab: int = 16, d: int = 8):
        super().__init__()
        self.emb, self.mid = nn.Embedding(vocab, d), nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.mid(self.emb(ids))))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tied_across_stages_on_distinct_devices_sums_the_gradient(schedule):
    """pipeline=2 on cpu:0, cpu:1 with the head (stage 1) tied to the embedding (stage 0): the head is
    replicated onto stage 1's device each call, its gradient summed into the one weight; 3 AdamW steps
    equal eager and the tie is kept."""
    torch.manual_seed(0)
    reference = TiedAcrossStages().double()
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, ["cpu:0", "cpu:1"], pipeline=["mid"], micro_batches=2, schedule=schedule)
    assert "head_replicas_stage1 = dpcompile_runtime_replicate({'head': head_src}, ['cpu:1'])" in pm.code
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 16, (4, 5), generator=g), torch.randint(0, 16, (4, 5), generator=g)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(3):
        loss = pm(ids, labels)
        loss.backward()
        expected = reference(ids, labels)
        expected.backward()
        torch.testing.assert_close(loss, expected)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    assert model.head.weight is model.emb.weight
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(pm.state_dict()[key], value)


def _adamw_steps_equal_eager(pm: nn.Module, model: nn.Module, reference: nn.Module, batches, steps: int = 3) -> None:
    """``steps`` AdamW steps of ``pm`` (on ``pm.parameters()``) beside eager: each loss, every gradient
    (shards gathered) and, after them, ``pm.state_dict()`` (the model's keys) equal eager's."""
    from tests.helpers import full_gradients

    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for step, batch in zip(range(steps), batches):
        loss = pm(*batch)
        loss = loss[-1] if isinstance(loss, tuple) else loss
        loss.backward()
        expected = reference(*batch)
        expected = expected[-1] if isinstance(expected, tuple) else expected
        expected.backward()
        torch.testing.assert_close(loss, expected, msg=lambda m, step=step: f"step {step} loss: {m}")
        got = full_gradients(pm)
        for name, q in reference.named_parameters():
            torch.testing.assert_close(got[name], q.grad, msg=lambda m, name=name, step=step: f"step {step}, {name}: {m}")
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    state = pm.state_dict()
    assert list(state) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"state_dict[{key!r}]: {m}")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tied_lm_across_pipeline_tensor_parallel_stages_trains_as_eager(schedule):
    """pipeline=2 x tensor_parallel on cpu:0..cpu:3, the checkpoint tests' LM (fused qkv, a vocab-parallel
    embedding in stage 0 tied to the LM head in stage 1): one parameter per shard, on stage 0's devices,
    sent to stage 1's shard devices each call; 3 AdamW steps equal eager (float64)."""
    from tests.integration.test_training_checkpoint import batches, make_model

    reference = make_model()
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, [f"cpu:{i}" for i in range(4)], pipeline=2, tensor_parallel=True,
                             micro_batches=2, schedule=schedule, example_inputs=batches()[0])  # fmt: skip
    assert pm.plan["embed"] == "vocab" and pm.plan["head"] == "column"
    assert "head_weight_shard0_to_stage1 = dpcompile_runtime_send(head_weight_shard0, 'cpu:2')" in pm.code
    assert "head_weight_shard1_to_stage1 = dpcompile_runtime_send(head_weight_shard1, 'cpu:3')" in pm.code
    for k in range(2):
        assert pm.get_parameter(f"head.weight_shard{k}") is pm.get_parameter(f"embed.weight_shard{k}")
    assert [n for n, _ in pm.named_parameters() if "embed" in n or "head" in n] == [
        "embed.weight_shard0", "embed.weight_shard1"
    ]  # fmt: skip
    _adamw_steps_equal_eager(pm, model, reference, batches())


def _tied_stack(dtype: torch.dtype = torch.float64) -> nn.Module:
    from tests.integration.test_pipeline_tensor_parallel import Stack

    torch.manual_seed(0)
    model = Stack().to(dtype)
    model.layers[2].weight = model.layers[0].weight  # layers.0 in stage 0, layers.2 in stage 1
    return model


def test_tied_linear_across_pipeline_tensor_parallel_stages_is_replicated():
    """A Linear of stage 1 tied to one of stage 0 (the plan keeps tied Linears whole) on cpu:0..cpu:3: it
    lives on stage 0's first device and stage 1 calls a replica, as a pipeline alone does; 3 AdamW
    steps equal eager. On 4 fake GPUs (a mixed-device op raises) forward runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dpcompile.devices import parse_devices
    from dpcompile.recipes import PipelineRecipe
    from tests.integration.test_pipeline_tensor_parallel import _inputs

    reference = _tied_stack()
    stack = _tied_stack(torch.float32)  # built outside the fake mode
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, [f"cpu:{i}" for i in range(4)], pipeline=2, tensor_parallel=True,
                             micro_batches=2, example_inputs=_inputs())  # fmt: skip
    assert pm.plan["layers.0"] == pm.plan["layers.2"] == "replicate"
    assert "dpcompile_runtime_replicate({'layers_2': layers_2_src}, ['cpu:2'])" in pm.code
    _adamw_steps_equal_eager(pm, model, reference, [_inputs()] * 3)

    with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        devices = parse_devices([f"cuda:{i}" for i in range(4)], check_available=False)
        recipe = PipelineRecipe(devices=devices, output_device=devices.primary, stages=2, micro_batches=2,
                                plan=True, check_available=False)  # fmt: skip
        fake = recipe.compile(stack, None)
        with torch.no_grad():
            logits, _ = fake(torch.randn(7, 8, device="cuda:0"), torch.randint(0, 3, (7,), device="cuda:0"))
    assert str(logits.device) == "cuda:0"
    assert fake.get_parameter("layers.2.weight") is fake.get_parameter("layers.0.weight")
    assert str(fake.get_parameter("layers.0.weight").device) == "cuda:0"
    assert str(fake.get_parameter("layers.3.weight_shard1").device) == "cuda:3"
