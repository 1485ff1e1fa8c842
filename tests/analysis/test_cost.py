"""Tests of the ring-algorithm cost formulas and the tensor-parallel cost model."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import dpcompile
from dpcompile.analysis.cost import (
    CommEstimate,
    comm_elements,
    linear_comms,
    linear_cost,
    plan_cost,
    ring_elements,
)


def program_elements(pm) -> tuple[float, float]:
    """(forward, backward) elements per device summed over pm's collectives, as explain counts them."""
    forward = backward = 0.0
    for node in pm.graph.nodes:
        comm = node.meta.get("dpcompile_comm")
        if comm is not None and not comm.io:
            f, b = comm_elements(node, len(pm.devices))
            forward, backward = forward + f, backward + b
    return forward, backward


def test_ring_elements_follow_the_ring_formulas():
    """all-reduce 2(N-1)/N*S, all-gather and reduce-scatter (N-1)/N*S."""
    assert ring_elements("all_reduce", 1000, 4) == 1500
    assert ring_elements("all_gather", 1000, 4) == 750
    assert ring_elements("reduce_scatter", 1000, 4) == 750


def test_ring_elements_are_zero_for_moves_that_move_nothing():
    """identity (f forward), split, no collective and one device cost nothing."""
    assert ring_elements("identity", 10**6, 8) == 0
    assert ring_elements("split", 10**6, 8) == 0
    assert ring_elements(None, 10**6, 8) == 0
    assert ring_elements("all_reduce", 10**6, 1) == 0


def test_ring_elements_reject_an_unknown_kind():
    """An unknown collective is a ValueError listing the known ones."""
    with pytest.raises(ValueError, match="unknown collective 'all_to_some'"):
        ring_elements("all_to_some", 10, 2)


def test_linear_cost_gives_the_classic_row_figure():
    """X[128x1000] @ W[1000x500] split by rows on 2 devices: 64,000 forward + 64,000 backward."""
    cost = linear_cost("row", 128 * 1000, 128 * 500, 2)
    assert (cost.forward, cost.backward, cost.total) == (64_000, 64_000, 128_000)


def test_linear_cost_gives_the_classic_column_figure():
    """Split by columns: 32,000 forward (all-gather) + 128,000 backward (all-reduce of dX)."""
    cost = linear_cost("column", 128 * 1000, 128 * 500, 2)
    assert (cost.forward, cost.backward, cost.total) == (32_000, 128_000, 160_000)


def test_linear_cost_of_replicate_is_zero_and_unknown_style_raises():
    """A whole layer communicates nothing; a bad style names the valid ones."""
    assert linear_cost("replicate", 10, 10, 4).total == 0
    with pytest.raises(ValueError, match="valid: 'column', 'row', 'replicate'"):
        linear_comms("diagonal", 10, 10)


def test_plan_cost_sums_forward_and_backward_separately():
    """Two collectives add up per direction."""
    cost = plan_cost([CommEstimate("all_reduce", None, 100), CommEstimate("identity", "all_reduce", 50)], 2)
    assert (cost.forward, cost.backward) == (100, 50)


@pytest.mark.parametrize("style, figures", [("row", (64_000, 64_000)), ("column", (32_000, 128_000))])
def test_generated_program_reproduces_the_classic_figures(style, figures):
    """The comm nodes of the real program for X[128x1000] @ W[1000x500] give the classic figures."""
    x = torch.randn(128, 1000)
    pm = dpcompile.transform(nn.Linear(1000, 500), ["cpu"] * 2, tensor_parallel={"": style}, example_inputs=(x,))
    assert program_elements(pm) == figures
    assert (pm.comm_cost.forward, pm.comm_cost.backward) == figures


def test_comm_elements_reads_shapes_when_no_size_was_recorded():
    """Without the pass's recorded size, comm_elements uses node.meta['val'] from fake propagation."""
    x = torch.randn(128, 1000)
    pm = dpcompile.transform(nn.Linear(1000, 500), ["cpu"] * 2, tensor_parallel={"": "column"})
    assert all("dpcompile_comm_numel" not in n.meta for n in pm.graph.nodes)
    comm_nodes = [n for n in pm.graph.nodes if "dpcompile_comm" in n.meta and not n.meta["dpcompile_comm"].io]
    assert [comm_elements(n, 2) for n in comm_nodes] == [None, None]  # sizes unknown until shapes are propagated
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(pm, mode).propagate(mode.from_tensor(x))
    assert program_elements(pm) == (32_000, 128_000)


def test_comm_elements_is_none_for_a_plain_node():
    """A node that is not a communication node has no figure."""
    pm = dpcompile.transform(nn.Linear(4, 4), ["cpu"] * 2, tensor_parallel={"": "row"})
    plain = next(n for n in pm.graph.nodes if n.op == "get_attr")
    assert comm_elements(plain, 2) is None


def test_megatron_mlp_moves_under_a_third_of_gather_after_every_linear():
    """MLP 1024→4096→1024, batch 64, 2 devices: column→row vs column-and-gather for both layers."""
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
    x = torch.randn(64, 1024)
    megatron = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    gather_every = plan_cost(linear_comms("column", 64 * 1024, 64 * 4096) + linear_comms("column", 64 * 4096, 64 * 1024), 2)
    assert megatron.plan == {"0": "column", "2": "row"}
    assert megatron.comm_cost.total == 2 * 64 * 1024
    assert gather_every.total == 491_520
    assert megatron.comm_cost.total / gather_every.total <= 1 / 3
