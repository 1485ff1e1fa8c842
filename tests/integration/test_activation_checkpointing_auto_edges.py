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
