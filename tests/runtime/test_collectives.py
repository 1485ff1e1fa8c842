"""The collectives of one shard's program (:mod:`dpcompile.runtime.collectives`) without a process group."""

from __future__ import annotations

import pytest
import torch

from dpcompile.runtime import collectives


def test_collectives_without_a_process_group_are_a_world_of_one():
    """Every collective is the identity for one rank, forward and backward."""
    x = torch.randn(3, 4, requires_grad=True)
    y = collectives.reduce_from_shards(collectives.copy_to_shards(x))
    y = collectives.gather_from_shards(collectives.split_to_shards(y, -1, [4]), -1, [4])
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3, 4))
    assert collectives.local_size([7]) == 7
    with pytest.raises(ValueError, match=r"sizes \[2, 2\] name 2 shards, but the process group has 1 rank"):
        collectives.local_size([2, 2])
