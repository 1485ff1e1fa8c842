"""``lower_sequence_to_rank``: context parallel's program over virtual devices cut to one rank of a
``cp`` group, without a process group (the group is looked up when the program runs); the
collectives themselves run in tests/integration/test_context_parallel_mesh.py."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx

import dpcompile
from dpcompile import DpCompileError, runtime
from dpcompile.runtime import distributed as dist_rt
from passes.sequence_rank import find_rank_sites, lower_sequence_to_rank
from tests.helpers import FakeMesh
from tests.integration.test_context_parallel import CausalSelfAttention, LeftPaddedPositions
from tests.integration.test_context_parallel_mesh import SequenceBatchNorm, SummaryBias


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


def test_module_on_the_whole_sequence_gets_its_parameters_gradients_scaled():
    """A BatchNorm run on the gathered sequence: every rank runs it alike and gets its parameters'
    whole gradient, so that call scales them by 1/N (DDP's average then keeps one whole gradient)."""
    gm = _one_process(SequenceBatchNorm(), 2)
    lower_sequence_to_rank(gm, mesh=CpMesh(), cp_dim="cp", rank=0, input_dims={"x": 1})
    (scaled,) = _calls(gm, dist_rt.scaling_parameter_gradients)
    assert scaled.args[0].op == "get_attr" and scaled.args[0].target == "bn" and scaled.args[1] == 0.5, gm.code
    assert not [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "bn"], gm.code


def _positions_and_keep(devices: int) -> fx.GraphModule:
    x, keep = torch.randn(2, 7, 16), torch.ones(2, 7, dtype=torch.bool)
    model = LeftPaddedPositions()
    return copy.deepcopy(dpcompile.transform(model, ["cpu"] * devices, mesh={"cp": devices}, example_inputs=(x, keep)))


def test_running_sum_adds_the_earlier_ranks_totals_over_the_group():
    """A cumsum of a padding mask along the sequence, each device's running sum plus the earlier
    devices' totals in one process, is one all-gather of the ranks' totals on rank 2 of 3."""
    gm = _positions_and_keep(3)
    assert len(_calls(gm, runtime.running_sum)) == 3
    lower_sequence_to_rank(gm, mesh=CpMesh(), cp_dim="cp", rank=2, input_dims={"x": 1, "keep": 1})
    assert not _calls(gm, runtime.running_sum), gm.code
    (summed,) = _calls(gm, dist_rt.running_sum_over_group)
    assert summed.args[0].name.endswith("_dev2") and summed.args[2] == 1, gm.code


@pytest.mark.filterwarnings("ignore:dpcompile. 12% of forward FLOPs")  # the summary runs whole: meant
def test_whole_value_a_device_reads_as_it_is_keeps_its_parameter_refused():
    """A module run on a whole value that a device's own node then reads as it is (no scatter of its
    rows): each rank's gradient of its parameters is that rank's part, not the whole one, so scaling
    by 1/N would be wrong; refused by name."""
    gm = _one_process(SummaryBias(), 2)
    nodes = {n.name: n for n in gm.graph.nodes}
    with gm.graph.inserting_after(nodes["getitem"]):
        read = gm.graph.call_function(operator.add, (nodes["lin_dev1"], nodes["getitem"]))
    read.name = "biased_dev1"  # as insert_scatter_gather names device 1's nodes
    read.meta["dpcompile_pass"] = "insert_scatter_gather"
    with pytest.raises(DpCompileError, match="'summary' runs on the whole gathered sequence .* 'summary.weight', and a device's own"):
        lower_sequence_to_rank(gm, mesh=CpMesh(), cp_dim="cp", rank=0, input_dims={"x": 1})


class DpCpMesh(FakeMesh):
    ndim = 2
    mesh_dim_names = ("dp", "cp")

    def size(self, dim: int | None = None) -> int:
        return 4 if dim is None else 2


class FlatMesh(FakeMesh):
    mesh_dim_names = ("dp_cp",)

    def size(self, dim: int | None = None) -> int:
        return 4


class MeanSquare(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = CausalSelfAttention()

    def forward(self, x):
        return self.block(x).square().mean()


def test_mean_over_every_token_is_reduced_over_every_dp_and_cp_rank():
    """Over a ("dp", "cp") mesh (its flattened mesh given), a mean over every element becomes
    ``mean_over_batch`` over the dp x cp group, its gradient scaled by the dp size; over ("cp",) alone
    it stays ``mean_over_group`` over cp."""
    from dpcompile.runtime.context_parallel_mesh import mean_over_batch

    gm = _one_process(MeanSquare(), 2)
    cp_only = copy.deepcopy(gm)
    lower_sequence_to_rank(gm, mesh=DpCpMesh(), cp_dim="cp", rank=1, input_dims={"x": 1}, batch_mesh=FlatMesh(),
                           dp_dim="dp")  # fmt: skip
    (mean,) = _calls(gm, mean_over_batch)
    assert mean.args[2].target == "dp_cp_group" and mean.args[3] == 2, gm.code
    assert not _calls(gm, dist_rt.mean_over_group), gm.code
    lower_sequence_to_rank(cp_only, mesh=CpMesh(), cp_dim="cp", rank=1, input_dims={"x": 1})
    assert len(_calls(cp_only, dist_rt.mean_over_group)) == 1 and not _calls(cp_only, mean_over_batch)


def test_device_of_reads_the_suffix_fx_adds_to_a_repeated_name():
    """Two nodes that asked for one name (a replica's module read ``qkv_dev1`` and device 1's linear) are
    both device 1's, and pair with device 0's nodes only where they run the same op."""
    from passes.sequence_rank import _op_of, device_of

    graph = fx.Graph()
    x = graph.placeholder("x")
    read = graph.call_function(getattr, (x, "qkv"), name="qkv_dev1")
    linear = graph.call_function(torch.nn.functional.linear, (x, x), name="qkv_dev1")
    for node in (read, linear):
        node.meta["dpcompile_pass"] = "insert_scatter_gather"
    assert linear.name == "qkv_dev1_1" and device_of(read) == device_of(linear) == 1
    assert _op_of(read) != _op_of(linear)
