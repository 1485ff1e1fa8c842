"""Context parallelism with tensor parallelism in one process (``mesh={"cp": 2, "tp": 2}`` over four
virtual devices): the sequence split over two pieces, each piece's layers sharded over its two
devices, each shard gathering its own heads' keys and values along the sequence. Outputs, the loss
and every gradient equal eager (float64), at a length that divides the pieces and one that does not.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dpcompile
from tests.helpers import assert_lm_step_equals_eager, full_gradients
from tests.integration.test_context_parallel import CausalSelfAttention, _inputs, _transformers_model


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_cp_tp_transformers_equal_eager(name):
    """GPT-2 and Llama with labels=: outputs, loss and every gradient at lengths 12 and 13. Llama's
    lm_head is vocab-parallel and transformers computes the loss in float32 (``logits.float()``), so
    its gradients are equal to float32 rounding, as under tensor parallelism alone. GPT-2 recomputes
    its first block (``activation_checkpointing``): one region, across the pieces and their shards (the
    pieces exchange keys and values inside the block)."""
    torch.manual_seed(0)
    model = _transformers_model(name).double()
    eager = copy.deepcopy(model)
    checkpointed = ["transformer.h.0"] if name == "gpt2" else None
    pm = dpcompile.transform(model, ["cpu"] * 4, mesh={"cp": 2, "tp": 2}, example_kwargs=_inputs(name, 12),
                             frontend="export", activation_checkpointing=checkpointed)  # fmt: skip
    assert pm.layout == {"cp": 2, "tp": 2} and {"cp", "tp"} <= set(pm.strategies)
    regions = [m for n, m in pm.named_children() if n.endswith("_region")]
    assert len(regions) == (1 if checkpointed else 0)
    # each tensor-parallel shard gathers its own heads' keys along the sequence, for each piece's queries
    code = pm.code + "".join(region.code for region in regions)
    assert "_keys_dev1 = dpcompile_runtime_gather_sequence(" in code and "_cp1_dev1 = " in code
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if name == "llama" else {}
    for seq in (12, 13):
        assert_lm_step_equals_eager(pm, eager, _inputs(name, seq, seed=seq), lambda: full_gradients(pm), **tolerance)
        pm.zero_grad()
        eager.zero_grad()


def test_cp_tp_causal_block_equals_eager():
    """A causal attention block, length 7 over 2 pieces (4 and 3), heads over 2 shards: outputs and
    every gradient equal eager."""
    torch.manual_seed(0)
    model = CausalSelfAttention().double()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 4, mesh={"cp": 2, "tp": 2}, example_inputs=(x,))
    got, want = pm(x), eager(x)
    torch.testing.assert_close(got, want)
    got.square().sum().backward()
    want.square().sum().backward()
    grads = full_gradients(pm)
    for path, p in eager.named_parameters():
        torch.testing.assert_close(grads[path], p.grad, msg=lambda m, path=path: f"grad {path}: {m}")
    assert pm.plan == {"qkv": "column", "out": "row", "pos": "vocab"}  # Megatron's pair across the heads
    placed = {n.name: n.device for n in dpcompile.explain(pm, x).nodes}  # piece r on devices[r*2:(r+1)*2]
    partials = [placed[f"out_partial_cp{r}_dev{k}"] for r in (0, 1) for k in (0, 1)]
    assert partials == ["cpu#0", "cpu#1", "cpu#2", "cpu#3"]


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("mesh", [{"cp": 2, "tp": 2}, {"pp": 2, "cp": 2, "tp": 2}], ids=str)
def test_an_input_without_a_sequence_dim_is_refused_by_name(mesh):
    """An MLP's ``(batch, features)`` input: its dim 1 was split as the sequence, and the first call
    failed inside the program (mat1 and mat2 shapes cannot be multiplied). Now transform refuses,
    naming the input, the Linear and the layout to use; the model and the RNG are as before."""
    torch.manual_seed(0)
    model, x = Mlp(), torch.randn(5, 8)
    state, rng = copy.deepcopy(model.state_dict()), torch.get_rng_state()
    n = 2 * len(mesh) if len(mesh) < 3 else 8
    with pytest.raises(dpcompile.ArgumentError, match=r"'x' \(5, 8\) has no sequence there: it is the features Linear 'fc1'"):
        dpcompile.transform(model, ["cpu"] * n, mesh=mesh, example_inputs=(x,))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
