"""Deep copies of fake tensors: the copy of a ``StorageWeakRef`` is the reference itself, and
``deepcopy_on_fake`` keeps a stage's fake tensors in their own mode.

torch copies a fake tensor's mode with it, and the mode's map of constants is keyed by
``StorageWeakRef``: two objects holding one raw weak pointer, each releasing it when freed, so a
storage's memory was freed under a live weak count and the last release wrote into whatever reused
it. A meta-built pipeline sharded over a ("pp", "tp") mesh copies its stage so, and a later step of
another pipeline in the same process crashed ("corrupted double-linked list", or a segfault).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import dpcompile  # noqa: F401 - what makes weak references copy as themselves
from dpcompile.recipes.constants import deepcopy_on_fake


def _mode_with_a_constant() -> tuple[FakeTensorMode, torch.Tensor]:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = mode.fake_tensor_converter.from_real_tensor(mode, torch.tensor([1.0, 2.0]), make_constant=True)
    return mode, fake


def test_a_copied_fake_tensor_does_not_duplicate_its_modes_weak_references():
    mode, fake = _mode_with_a_constant()
    copied = copy.deepcopy(fake)
    (original_ref,) = mode.fake_tensor_converter.constant_storage_mapping
    (copied_ref,) = copied.fake_mode.fake_tensor_converter.constant_storage_mapping
    assert copied_ref is original_ref  # one weak count, released once
    assert copy.copy(original_ref) is original_ref
    torch.testing.assert_close(copied.constant, fake.constant)


def test_deepcopy_on_fake_keeps_fake_tensors_in_their_mode():
    mode, constant = _mode_with_a_constant()
    with mode:
        layer = nn.Linear(2, 3)
    layer.register_buffer("table", constant)
    copied = deepcopy_on_fake(layer)
    assert copied.weight is not layer.weight and copied.weight.fake_mode is mode
    assert copied.table.fake_mode is mode and copied.table.shape == (2,)
    with mode:  # the copy and the original mix in one mode
        out = copied(torch.ones(4, 2)) + layer(torch.ones(4, 2))
    assert out.shape == (4, 3)
