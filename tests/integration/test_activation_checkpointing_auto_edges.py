"""``activation_checkpointing="auto"`` and the byte budget at their edges: what a hostile user gives
is built as documented or refused with a message that says what to give."""

from __future__ import annotations

import copy

import pytest
import torch

import dpcompile
from benchmarks.bench_activation_checkpointing import Stack
from dpcompile.errors import DpCompileError

MiB = 2**20


@pytest.fixture(scope="module")
def stack():
    torch.manual_seed(0)
    return Stack(16, 2, 2).double(), torch.randn(2, 8, 16, dtype=torch.float64)


def test_auto_under_1f1b_without_a_loss_says_so_once(stack):
    """1F1B needs the model's own loss: each choice fails to build for the same reason, which the
    refusal states once, not once per choice, with no repeated prefix."""
    model, x = stack
    with pytest.raises(DpCompileError, match="mean loss") as e:
        dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, memory_per_device=MiB, activation_checkpointing="auto",
                            example_inputs=(x,), pipeline=2, micro_batches=2, schedule="1f1b")  # fmt: skip
    message = str(e.value)
    assert message.count("1F1B runs each micro-batch's backward") == 1, message
    assert "cannot be built: cannot be built" not in message and "could not be built" not in message, message


def test_regions_of_a_top_level_sequential_build_and_equal_eager():
    """Module paths ``"0"``, ``"2"`` (the items of a top-level ``Sequential``, an MLP without repeated
    blocks) under the byte budget: the generated code names them ``module_0``...; before, a
    SyntaxError from the code (``0_module``). Output and gradients equal eager's (float64)."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    model = copy.deepcopy(mlp)
    spec = {"regions": ["0", "2"], "save": "auto", "budget_bytes": 0}
    pm = dpcompile.transform(model, ["cpu"], activation_checkpointing=spec, example_inputs=(x,))
    assert pm.strategies["activation_checkpointing"].endswith(": 0, 2")
    assert "module_0_module" in pm.code
    out = pm(x)
    torch.testing.assert_close(out, mlp(x))
    out.pow(2).sum().backward()
    mlp(x).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), mlp.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"grad {name}: {m}")


def test_a_malformed_byte_budget_dict_is_refused_as_given(stack):
    """A byte-budget dict without ``regions`` (or with ``budget`` beside it) is refused before the
    examples size it: the message shows the dict as given, not with a ``row_bytes`` the user never
    wrote."""
    model, x = stack
    for spec, words in (({"save": "auto", "budget_bytes": "64KiB"}, "a dict takes 'regions'"),
                        ({"regions": True, "save": "auto", "budget_bytes": "64KiB", "budget": 0.5}, "not both")):  # fmt: skip
        with pytest.raises(ValueError, match=words) as e:
            dpcompile.transform(copy.deepcopy(model), ["cpu"], activation_checkpointing=spec, example_inputs=(x,))
        assert "row_bytes" not in str(e.value), str(e.value)


def test_auto_on_a_model_without_repeated_blocks_says_to_name_the_modules():
    """An MLP ``Sequential`` of mixed layers has no repeated blocks: ``"auto"`` can only recompute
    nothing, and a budget that does not fit says so and how to name the modules."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(DpCompileError, match=r"of the 1 predicted.*no repeated blocks.*'regions': \['encoder'\]"):
        dpcompile.transform(copy.deepcopy(mlp), ["cpu"], memory_per_device=1024, activation_checkpointing="auto",
                            example_inputs=(x,))  # fmt: skip


def _kept(region) -> list[str]:
    return [line.split(" = ")[0].strip() for part in region.code.split("keep_outputs(True)")[1:]
            for line in part.split("keep_outputs(False)")[0].splitlines() if " = " in line and "keep_outputs" not in line]  # fmt: skip


def test_byte_budget_under_tensor_parallelism_prices_the_shards(stack):
    """Tensor parallelism runs its matmuls as ``linear(x, weight_shard)``: priced by the shard's width
    (before, each counted one value a row, so a 2 KiB budget kept all 14 outputs of a block). d=16
    over 2 x 8 tokens, float64: a row costs 128 bytes, so 2 KiB holds 16 values a row on each device:
    that device's attention (8, its value shard) and one 8-wide q/k/v shard. Output and gradients equal eager's."""
    from tests.helpers import full_gradients

    model, x = stack
    spec = {"regions": True, "save": "auto", "budget_bytes": "2KiB"}
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, tensor_parallel=True, activation_checkpointing=spec,
                             example_inputs=(x,))  # fmt: skip
    kept = _kept(pm.layers_0_region)
    assert len(kept) == 4 and sum("scaled_dot_product_attention" in n for n in kept) == 2, kept
    assert all("attention" in n or "_attn_q_" in n or "_attn_k_" in n or "_attn_v_" in n for n in kept), kept
    eager = copy.deepcopy(model)
    out = pm(x)
    torch.testing.assert_close(out, eager(x))
    out.sum().backward()
    eager(x).sum().backward()
    grads = full_gradients(pm)
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda m, name=name: f"grad {name}: {m}")
