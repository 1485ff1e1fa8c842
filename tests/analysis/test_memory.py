"""Memory-aware plans: the estimate against what a real training step allocates, and the choice
of program under ``memory_per_device=``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.analysis.memory import activation_bytes, parse_budget
from dpcompile.errors import DpCompileError


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.LayerNorm(64))


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _real_bytes(params, optimizer) -> dict[str, int]:
    """What the step really allocated for ``params``: unique storages of parameters, gradients and optimizer state."""
    state = [v for p in params for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": _storage_bytes(params),
        "gradients": _storage_bytes([p.grad for p in params]),
        "optimizer": _storage_bytes(state),
    }


def _step(pm, x):
    opt = torch.optim.AdamW(pm.parameters())
    pm(x).pow(2).mean().backward()
    opt.step()
    return opt


def _close(estimate: dict[str, int], real: dict[str, int]) -> None:
    got = estimate["parameters"] + estimate["gradients"] + estimate["optimizer"]
    want = sum(real.values())
    assert abs(got - want) <= 0.15 * want, (estimate, real)


def test_memory_estimate_matches_a_real_adamw_step_data_parallel():
    """Data parallel on virtual devices: each device's parameters + gradients + AdamW state
    (estimated) against the storages a real step allocated (the replica every device holds)."""
    x = torch.randn(32, 64)
    pm = dpcompile.transform(_mlp(), ["cpu", "cpu"], example_inputs=(x,), memory_per_device="1MiB", optimizer="adamw")
    assert pm.strategy == "data_parallel"
    opt = _step(pm, x)
    estimate = dpcompile.explain(pm, x).memory_estimate
    real = _real_bytes(list(pm.parameters()), opt)
    for device in estimate:
        _close(estimate[device], real)


def test_memory_estimate_matches_a_real_adamw_step_tensor_parallel():
    """Tensor parallel on virtual devices: per device, its shards plus the replicated rest."""
    x = torch.randn(32, 64)
    pm = dpcompile.transform(_mlp(), ["cpu", "cpu"], example_inputs=(x,), memory_per_device="400KiB", optimizer="adamw")
    assert pm.strategy == "tensor_parallel" and pm.mode == "tensor_parallel"
    opt = _step(pm, x)
    estimate = dpcompile.explain(pm, x).memory_estimate
    named = dict(pm.named_parameters())
    for k, device in enumerate(estimate):
        held = [p for name, p in named.items() if pm.shard_param_slots.get(name) in (None, k)]
        _close(estimate[device], _real_bytes(held, opt))


def test_activation_estimate_against_a_real_run():
    """The fake run counts what a real forward saves for backward (unique storages, no
    parameters or inputs), and a budget below the replica picks tensor parallel."""
    model, x = _mlp(), torch.randn(32, 64)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    assert activation_bytes(model, (x,)) == sum(saved.values()) > 0


def test_no_program_fits_names_the_device_count():
    """Where neither a replica nor the shards fit: the smallest device count, with the arithmetic."""
    with pytest.raises(DpCompileError, match=r"tensor parallel over \d+ devices would fit") as caught:
        dpcompile.transform(_mlp(), ["cpu", "cpu"], example_inputs=(torch.randn(32, 64),), memory_per_device=200_000,
                            optimizer="adamw")  # fmt: skip
    assert "parameters +" in str(caught.value) and "= " in str(caught.value)
    assert parse_budget("24GiB") == 24 * 2**30 and parse_budget("1.5 GB") == 1_500_000_000


@pytest.mark.parametrize("options", [{}, {"plan": "auto"}], ids=["named", "planned"])
def test_a_model_reading_a_counter_as_a_number_is_planned_and_left_unchanged(options):
    """BatchNorm with ``momentum=None`` reads ``1 / num_batches_tracked`` as a number: the fake run
    reads a copy of the count (was a DataDependentOutputException), and the model's count and
    statistics stay as they were."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pm = dpcompile.transform(model, ["cpu"] * 2, memory_per_device="1GiB", example_inputs=(torch.randn(6, 8),), **options)
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)
    pm(torch.randn(6, 8))
    assert int(pm.state_dict()["1.num_batches_tracked"]) == 1  # counted once, by the program


def test_a_budget_given_as_a_float_or_a_numpy_int_is_bytes():
    """``memory_per_device=2.5e9`` (or a numpy count) is a number of bytes, as an int is (a float was
    refused as "expected bytes (an int)"); zero, negative, NaN and infinite budgets are refused."""
    import numpy as np

    assert parse_budget(2.5e9) == 2_500_000_000 and parse_budget(np.int64(4096)) == 4096
    for bad in (0, -1, 0.5, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="memory_per_device="):
            parse_budget(bad)
