"""Pipeline parallelism through the torch.export frontend: a transformers decoder (GPT-2, tiny,
random weights) with ``labels=``: logits, the mean loss over the non-ignored tokens of the whole
batch and every gradient equal eager's, on 2 and 4 stages with 1, 2 and 4 micro-batches and an
uneven last micro-batch. The model is exported once; each configuration lowers that program.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import dpcompile
from dpcompile.capture import capture_model
from tests.thirdparty import import_or_skip

V = 64
pytestmark = pytest.mark.slow  # one torch.export of GPT-2: ~10 s


@pytest.fixture(scope="module")
def gpt2():
    T = import_or_skip("transformers")
    torch.manual_seed(0)
    config = T.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=V, n_positions=16, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)  # fmt: skip
    reference = T.GPT2LMHeadModel(config).double()
    model = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(0)
    kwargs = {"input_ids": torch.randint(1, V, (5, 8), generator=g), "labels": torch.randint(0, V, (5, 8), generator=g)}
    kwargs["labels"][0, :5] = -100  # ignored tokens: the mean is over the others, of the whole batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported, info = capture_model(model, frontend="export", example_kwargs=kwargs)
    assert info.frontend == "export"
    return reference, model, exported, kwargs


@pytest.mark.parametrize("stages,micro", [(2, 1), (2, 2), (4, 4)])
@pytest.mark.xdist_group("pipeline_transformers_gpt2")  # its tests share the module's GPT-2 export: one worker builds it
def test_pipeline_gpt2_with_labels_equals_eager(gpt2, stages, micro):
    """GPT-2 with labels= (export frontend): logits, loss and every gradient as eager."""
    reference, model, exported, kwargs = gpt2
    model.zero_grad()
    reference.zero_grad()
    pm = dpcompile.transform(exported, ["cpu"] * stages, pipeline=stages, micro_batches=micro, example_kwargs=kwargs)
    assert len(pm.stages) == stages and "dpcompile_runtime_send" in pm.code
    out = pm(**kwargs)
    out.loss.backward()
    expected = reference(**kwargs)
    expected.loss.backward()
    torch.testing.assert_close(out.logits, expected.logits)
    torch.testing.assert_close(out.loss, expected.loss)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


@pytest.mark.xdist_group("pipeline_transformers_gpt2")
def test_pipeline_tensor_parallel_gpt2_with_labels_equals_eager(gpt2):
    """pipeline=2 with tensor_parallel= on 4 distinct devices (2 stages x 2 shards), 1, 2 and 4
    micro-batches: logits, loss and every gradient as eager (vocab-parallel embedding and loss; the
    tied LM head's shards are the embedding's, sent from stage 0's devices to stage 1's; the shards'
    gradients gathered); then 2 more AdamW steps and the state dict equal eager's."""
    from tests.helpers import full_gradients

    reference, _, exported, kwargs = gpt2
    reference.zero_grad()
    expected = reference(**kwargs)
    expected.loss.backward()
    plan = True  # the automatic plan once, then as the user's plan (planning is most of the compile time)
    devices = [f"cpu:{i}" for i in range(4)]
    for micro in (1, 2, 4):
        pm = dpcompile.transform(exported, devices, pipeline=2, tensor_parallel=plan, micro_batches=micro,
                                 example_kwargs=kwargs)  # fmt: skip
        assert pm.plan["transformer.h.1.attn.c_attn"] == "column" and pm.plan["lm_head"] == "column"
        assert "dpcompile_runtime_send(lm_head_weight_shard1, 'cpu:3')" in pm.code
        out = pm(**kwargs)
        out.loss.backward()
        torch.testing.assert_close(out.logits, expected.logits)
        torch.testing.assert_close(out.loss, expected.loss)
        got = full_gradients(pm)
        for name, q in reference.named_parameters():
            torch.testing.assert_close(got[name], q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")
        plan = dict(pm.plan)
    eager = copy.deepcopy(reference)  # the module's reference stays as it is for the other tests
    for p, q in zip(eager.parameters(), reference.parameters()):
        p.grad = q.grad.clone()  # deepcopy leaves a Parameter's grad behind
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for step in range(3):  # the gradients above are the first step's
        if step:
            loss, want = pm(**kwargs).loss, eager(**kwargs).loss
            loss.backward()
            want.backward()
            torch.testing.assert_close(loss, want, msg=lambda m, step=step: f"step {step}: {m}")
        opt.step()
        eager_opt.step()
        opt.zero_grad()
        eager_opt.zero_grad()
    state = pm.state_dict()
    assert list(state) == list(eager.state_dict())
    for key, value in eager.state_dict().items():  # the loss is float32 (transformers upcasts the logits)
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, key=key: f"state_dict[{key!r}]: {m}")  # fmt: skip


@pytest.mark.xdist_group("pipeline_transformers_gpt2")
def test_pipeline_tensor_parallel_exported_runs_a_batch_smaller_than_micro_batches(gpt2):
    """An exported program under pipeline=2 x tensor_parallel (2 micro-batches) called with a batch of
    one row: compiled again from a fake copy of the exported program (it has no forward to trace),
    for one micro-batch; logits, loss and every gradient as eager's on that row."""
    from tests.helpers import full_gradients

    reference, _, exported, kwargs = gpt2
    reference.zero_grad()
    small = {k: v[1:2] for k, v in kwargs.items()}
    pm = dpcompile.transform(exported, ["cpu"] * 4, pipeline=2, tensor_parallel=True, micro_batches=2,
                             example_kwargs=kwargs)  # fmt: skip
    out = pm(**small)
    out.loss.backward()
    expected = reference(**small)
    expected.loss.backward()
    torch.testing.assert_close(out.logits, expected.logits)
    torch.testing.assert_close(out.loss, expected.loss)
    got = full_gradients(pm)
    for name, q in reference.named_parameters():
        torch.testing.assert_close(got[name], q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")
    reference.zero_grad()
