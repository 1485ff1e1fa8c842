"""The op catalogue: families, their checked subsets, and matching nodes by function, method or module."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpcompile.analysis import ops
from tests.helpers import captured


def test_op_family_only_refuses_an_op_outside_the_family():
    """A sub-family naming an op its family lacks is an error naming both."""
    with pytest.raises(ValueError, match="sharded: \\['log_softmax'\\] are not in the op family 'unary element-wise'"):
        ops.UNARY.only("sharded", methods={"log_softmax"})


def test_tensor_parallel_families_are_subsets_of_the_batch_families():
    """Every op a sharded value passes through is in the family the batch rules know it by."""
    assert ops.SHARD_UNARY.functions <= ops.UNARY.functions and set(ops.SHARD_UNARY.modules) <= set(ops.UNARY.modules)
    assert ops.SHARD_BINARY.methods <= ops.BINARY.methods
    assert ops.SHARD_SOFTMAX.functions <= ops.ALONG_DIM.functions
    assert ops.POINTWISE.functions == ops.UNARY.functions | ops.BINARY.functions


def test_element_wise_families_do_not_overlap():
    """No op is both unary and binary, so each has one rule."""
    assert not ops.UNARY.functions & ops.BINARY.functions
    assert not ops.UNARY.methods & ops.BINARY.methods


def test_op_family_matches_functions_methods_and_modules():
    """F.relu, x.relu() and nn.ReLU all match the unary family; a Linear does not."""

    class Three(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = nn.ReLU()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(self.act(F.relu(x).relu()))

    gm = captured(Three())
    modules = dict(gm.named_modules())
    matched = [n.name for n in gm.graph.nodes if ops.UNARY.matches(n, modules)]
    assert matched == ["relu", "relu_1", "act"]
    assert not ops.UNARY.matches(next(n for n in gm.graph.nodes if n.name == "fc"), modules)


def test_op_family_iterates_over_every_member():
    """Iterating a family yields its functions, method names and module types."""
    members = set(ops.MATMUL)
    assert members == {torch.matmul, torch.bmm, operator.matmul, "matmul", "bmm"}
