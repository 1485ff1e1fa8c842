"""``lower_sequence_to_rank``: context parallel's program over virtual devices cut to one rank of a
``cp`` group, without a process group (the group is looked up when the program runs); the
collectives themselves run in tests/integration/test_context_parallel_mesh.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx

import dpcompile
from dpcompile import DpCompileError, runtime
from dpcompile.runtime import distributed as dist_rt
from passes.sequence_rank import find_rank_sites, lower_sequence_to_rank
from tests.helpers import FakeMesh
from tests.integration.test_context_parallel import CausalSelfAttention
from tests.integration.test_context_parallel_mesh import SequenceBatchNorm


class CpMesh(FakeMesh):
    mesh_dim_names = ("cp",)


def _calls(gm: fx.GraphModule, target: object) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def _one_process(model: torch.nn.Module, devices: int) -> fx.GraphModule:
    x = torch.randn(2, 7, 16)
    return copy.deepcopy(dpcompile.transform(model, ["cpu"] * devices, mesh={"cp": devices}, example_inputs=(x,)))


def test_rank_program_keeps_its_own_shard_and_exchanges_over_the_group():
    """Rank 1 of 3: no virtual-device exchange is left; its attention gathers over the group, its
    positions are rank 1's, and it returns its own part of the output, its gradient scaled by 3 (the
    input's by 1/3) so that DDP's average over the group is the sum of the ranks' shares."""
    gm = _one_process(CausalSelfAttention(), 3)
    assert len(_calls(gm, runtime.attention_regathered)) == 3
    assert set(find_rank_sites(gm).devices.values()) == {0, 1, 2}
    lower_sequence_to_rank(gm, mesh=CpMesh(), cp_dim="cp", rank=1, input_dims={"x": 1})
    for gone in (runtime.attention_regathered, runtime.gather, runtime.scatter, runtime.gather_sequence):
        assert not _calls(gm, gone), gm.code
    (attention,) = _calls(gm, dist_rt.attention_over_group)
    assert attention.args[3].target == "cp_group"
    assert [n.args[1] for n in _calls(gm, runtime.batch_arange)] == [1, 1]  # the embedding's and the queries' positions
    checks = [n for n in _calls(gm, dist_rt.sequence_sizes) if n.kwargs.get("balanced")]
    assert len(checks) == 1  # the head's check of the shards
    (returned,) = gm.graph.output_node().args
    assert returned.target is dist_rt.scale_gradient and returned.args[1] == 3.0, gm.code  # DDP averages: x3
    assert returned.args[0].name.endswith("_dev1"), gm.code  # rank 1's own tokens, not a gather
    (scaled_in,) = [n for n in _calls(gm, dist_rt.scale_gradient) if n.args[0].op == "placeholder"]
    assert scaled_in.args[1] == 1 / 3


def test_whole_value_reading_a_parameter_is_refused_by_name():
    """A BatchNorm that runs on the gathered sequence reads parameters every rank would add a whole gradient to."""
    gm = _one_process(SequenceBatchNorm(), 2)
    with pytest.raises(DpCompileError, match="'bn' runs on the whole gathered sequence .* 'bn.weight'"):
        lower_sequence_to_rank(gm, mesh=CpMesh(), cp_dim="cp", rank=0, input_dims={"x": 1})
