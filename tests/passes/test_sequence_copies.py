"""split_batch_into_copies (dp copies of a context-parallel program): the batch split into pieces
named ``_mb<j>`` on the model's own modules, a mean loss over every piece's elements; the copies'
scatter and gather keep a split along another dim (the sequence); ``runtime.running_sum`` is a
shard's part of a cumsum."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
from torch import nn

from dpcompile import runtime
from dpcompile.analysis.batch_dims import propagate
from dpcompile.analysis.placement import Split
from dpcompile.fx_utils import propagate_shapes
from passes import split_batch_into_copies


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h, h.square().mean()


def _copies(model: nn.Module, x: torch.Tensor) -> fx.GraphModule:
    gm = fx.symbolic_trace(model)
    propagate_shapes(gm, [x])
    split_batch_into_copies(gm, copies=2, batch_dims={"x": 0}, device=torch.device("cpu"))
    return gm


def test_pieces_run_on_the_models_own_modules_and_keep_the_values():
    """Two pieces ``_mb0``/``_mb1`` call ``self.fc`` (no replicas); outputs and the mean over every
    element of both pieces (3 rows split 2/1) equal the model's."""
    model = Tagger()
    x = torch.randn(3, 5, 4)
    gm = _copies(copy.deepcopy(model), x)
    names = {n.name for n in gm.graph.nodes}
    assert {"fc_mb0", "fc_mb1"} <= names
    assert not any(n.target is runtime.replicate for n in gm.graph.nodes)
    got, want = gm(x), model(x)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_the_copies_scatter_and_gather_keep_the_sequence_split():
    """Split on the sequence (dim 1), the batch's scatter over the copies and their gather stay split there."""
    gm = _copies(Tagger(), torch.randn(3, 5, 4))
    placements = propagate(gm, {"x": 1})
    by_name = {n.name: p for n, p in placements.items()}
    assert by_name["fc_mb1"] == Split(1)
    gathered = next(n for n in gm.graph.nodes if n.target is runtime.gather)
    assert placements[gathered] == Split(1)


def test_running_sum_is_a_shards_part_of_the_cumsum():
    """Each shard's running sum plus the earlier shards' totals is the cumsum, shard by shard (ints, a dtype)."""
    x = torch.randint(0, 3, (2, 7), dtype=torch.int32)
    shards = torch.tensor_split(x, 3, 1)
    parts = [runtime.running_sum(s, shards[:k], 1) for k, s in enumerate(shards)]
    assert torch.equal(torch.cat(parts, 1), torch.cumsum(x, 1))
    as_float = [runtime.running_sum(s, shards[:k], 1, dtype=torch.float64) for k, s in enumerate(shards)]
    assert torch.equal(torch.cat(as_float, 1), torch.cumsum(x, 1, dtype=torch.float64))
