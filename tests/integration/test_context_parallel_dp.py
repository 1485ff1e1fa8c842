"""dp copies of a context-parallel program in one process (``mesh={"dp": 2, "cp": 2}`` over four
virtual devices): the batch split over the copies, each copy's sequence over its two devices.
Outputs, the loss (the mean over every token of every copy, with ignored labels spread unevenly
over the copies), every gradient and the parameters after two AdamW steps equal eager (float64),
for a sequence that divides the devices and one that does not.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dpcompile
from dpcompile import DpCompileError
from tests.helpers import assert_lm_step_equals_eager, model_gradients
from tests.integration.test_context_parallel import CausalSelfAttention, _inputs, _transformers_model


class DroppedOut(CausalSelfAttention):
    """The causal block with dropout on its output."""

    def forward(self, x):
        return torch.nn.functional.dropout(super().forward(x), 0.5, self.training)


def _batch_of_four(name: str, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """Four rows, two per copy; copy 0's first row has labels ignored (-100), so the copies count
    different tokens and a mean of the copies' means would differ from eager's loss."""
    inputs = {k: torch.cat([v, v.flip(0)]) for k, v in _inputs(name, seq, seed).items()}
    inputs["labels"][0, : seq // 2] = -100
    return inputs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_dp_cp_transformers_train_like_eager(name):
    """GPT-2 and Llama (rotary, grouped-query heads) with labels=, two AdamW steps at lengths 12
    and 13: outputs, loss and every gradient of each step, then every parameter, equal eager."""
    torch.manual_seed(0)
    model = _transformers_model(name).double()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 4, mesh={"dp": 2, "cp": 2}, example_kwargs=_batch_of_four(name, 12, 0),
                             frontend="export")  # fmt: skip
    assert pm.layout == {"dp": 2, "cp": 2}
    assert set(pm.strategies) == {"dp", "cp"}
    # each copy's attention on each of its devices, keys and values gathered over the copy's devices
    assert pm.code.count("dpcompile_runtime_attention_regathered(") == 4
    assert "_dp1_dev1 = " in pm.code
    ours, theirs = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for seq in (12, 13):
        assert_lm_step_equals_eager(pm, eager, _batch_of_four(name, seq, seed=seq), model_gradients(model))
        ours.step()
        theirs.step()
        ours.zero_grad()
        theirs.zero_grad()
    for (path, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p, q, msg=lambda m, path=path: f"{path} after two steps: {m}")


@pytest.mark.parametrize("data_parallel", ["replicate", "fsdp"])
def test_dp_cp_causal_block_trains_like_eager_with_a_batch_that_does_not_divide(data_parallel):
    """A causal attention block, batch 3 over 2 copies (rows 2 and 1), length 7 over 2 devices
    (4 and 3), replicated or FSDP over dp: outputs of two AdamW steps, then the state, equal eager."""
    torch.manual_seed(0)
    model = CausalSelfAttention().double()
    eager = copy.deepcopy(model)
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 4, mesh={"dp": 2, "cp": 2}, example_inputs=(x,), data_parallel=data_parallel)
    ours, theirs = torch.optim.AdamW(pm.parameters(), lr=1e-2), torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for _ in range(2):
        got, want = pm(x), eager(x)
        torch.testing.assert_close(got, want)
        got.square().sum().backward()
        want.square().sum().backward()
        ours.step()
        theirs.step()
        ours.zero_grad()
        theirs.zero_grad()
    state = pm.state_dict()
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"{key} after two steps: {m}")
    placed = {n.name: n.device for n in dpcompile.explain(pm, x).nodes}
    assert [placed[f"qkv_dp{r}_dev{k}"] for r in (0, 1) for k in (0, 1)] == ["cpu#0", "cpu#1", "cpu#2", "cpu#3"]


@pytest.mark.parametrize("mesh", [{"dp": 2, "cp": 2}, {"cp": 2, "tp": 2}])
def test_cp_composed_on_devices_of_their_own_is_refused_by_name(mesh):
    """dp copies of a context-parallel program (and cp's pieces of a tensor-parallel one) run on copy
    0's devices (virtual devices): copies on devices of their own are refused before anything is
    built, naming the way out."""
    x = torch.randn(2, 6, 16)
    model = CausalSelfAttention()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DpCompileError, match=r"same devices for now .* mesh=\{'cp': N\} alone"):
        dpcompile.transform(model, ["cpu", "cpu", "cpu:1", "cpu:1"], mesh=mesh, example_inputs=(x,))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_dp_cp_random_ops_are_refused_unless_exact_random_is_off():
    """A dropout under dp x cp: the single-device draws are not built, so the default exact_random
    refuses by name; exact_random=False builds (each device draws its own) and eval equals eager."""
    torch.manual_seed(0)
    model = DroppedOut().double()
    x = torch.randn(4, 7, 16, dtype=torch.float64)
    with pytest.raises(DpCompileError, match="does not draw random ops' single-device values yet.*exact_random=False"):
        dpcompile.transform(model, ["cpu"] * 4, mesh={"dp": 2, "cp": 2}, example_inputs=(x,))
    pm = dpcompile.transform(model, ["cpu"] * 4, mesh={"dp": 2, "cp": 2}, example_inputs=(x,), exact_random=False)
    assert pm(x).shape == x.shape
    pm.eval()
    model.eval()
    torch.testing.assert_close(pm(x), model(x))
