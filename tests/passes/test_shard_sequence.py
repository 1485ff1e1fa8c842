"""``find_sequence_region`` and ``shard_sequence`` on ``shard_linear``'s one-shard program."""

from __future__ import annotations

import torch
from torch import nn

from dpcompile.analysis.sharding import Sharded
from dpcompile.devices import Devices
from dpcompile.runtime import collectives
from passes.sequence_parallel import balanced_sizes, find_sequence_region, shard_sequence
from passes.shard_linear import shard_linear
from tests.helpers import captured, targets
from tests.models import MLP

DEVICES = Devices((torch.device("cpu"),) * 2)


class PostNorm(nn.Module):
    """A column/row pair, a residual add and a norm after it."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(self.fc2(torch.relu(self.fc1(x))) + x)


def _one_shard(model: nn.Module, x: torch.Tensor):
    gm = captured(model, x)
    shard_linear(gm, plan={"fc1": "column", "fc2": "row"}, devices=DEVICES)
    gm.recompile()
    return gm


def test_balanced_sizes_are_tensor_split_sizes():
    """13 tokens over 4 shards: 4, 3, 3, 3 (as torch.tensor_split)."""
    assert balanced_sizes(13, 4) == (4, 3, 3, 3)
    assert balanced_sizes(13, 4) == tuple(len(t) for t in torch.arange(13).tensor_split(4))


def test_find_sequence_region_from_the_row_all_reduce_to_the_norm():
    """The row layer's all-reduce, its bias add, the residual add and the norm run on shards; the
    input is sliced where the add reads it."""
    gm = _one_shard(PostNorm(), torch.randn(2, 7, 8))
    region = find_sequence_region(gm, n=2)
    assert region is not None and (region.length, region.sizes) == (7, (4, 3))
    assert [n.name for n in region.seeds] == ["fc2_all_reduce"]
    assert [n.name for n in region.nodes] == ["fc2_all_reduce", "fc2", "add", "norm"]
    assert [a.name for a in region.sliced[next(n for n in region.nodes if n.name == "add")]] == ["x"]


def test_shard_sequence_rewrites_the_collectives_and_layouts():
    """all-reduce -> reduce-scatter; the residual operand split; the output gathered on the sequence."""
    gm = _one_shard(PostNorm(), torch.randn(2, 7, 8))
    result = shard_sequence(gm, devices=DEVICES)
    assert result.modified and result.info["reduce_scatters"] == ["fc2_reduce_scatter"]
    assert targets(gm) == ["split_to_shards", "copy_to_shards", "linear", "relu", "linear", "reduce_scatter_to_shards",
                           "copy_to_shards", "add_bias", "add", "gather_from_shards"]  # fmt: skip
    norm = next(n for n in gm.graph.nodes if n.name == "norm")
    assert norm.meta["dpcompile_layout"] == Sharded(-2, (4, 3))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert out.args[0].target is collectives.gather_from_shards


def test_shard_sequence_is_a_no_op_without_a_sequence_and_the_second_time():
    """An MLP on (batch, features) has no sequence: nothing changes; a rewritten program has no
    all-reduce left to turn, so a second run changes nothing."""
    gm = _one_shard(MLP(), torch.randn(4, 8))
    before = gm.code
    assert not shard_sequence(gm, devices=DEVICES).modified
    assert gm.code == before
    gm = _one_shard(PostNorm(), torch.randn(2, 7, 8))
    assert shard_sequence(gm, devices=DEVICES).modified
    gm.recompile()
    assert not shard_sequence(gm, devices=DEVICES).modified
