"""place_dp_copies: copy ``r`` of a program built on copy 0's devices moved onto ``copies[r]``."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch import nn

from dpcompile import runtime
from dpcompile.errors import PassError
from passes import copy_device_maps, find_copy_nodes, name_dp_copies, place_dp_copies

COPIES = (("cpu:0", "cpu:2"), ("cpu:1", "cpu:3"))  # two stages, two dp copies


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(2.0))


def _program() -> fx.GraphModule:
    """Two pieces of a two-stage program as the lowerings write it, on copy 0's devices: the batch
    scattered, stage 0 a module call, a send to stage 1, stage 1 a parameter read, the pieces gathered."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    scatter = graph.call_function(runtime.scatter, (x, ["cpu:0", "cpu:0"], 0))
    scale = graph.get_attr("scale")
    scale.meta["dpcompile_slot"] = 1
    outs = []
    for j in range(2):
        piece = graph.call_function(operator.getitem, (scatter, j))
        piece._rename(f"x_mb{j}")
        fc = graph.call_module("fc", (piece,))
        fc._rename(f"fc_mb{j}")
        sent = graph.call_function(runtime.send, (fc, "cpu:2"))
        sent._rename(f"fc_mb{j}_to_stage1")
        scaled = graph.call_function(torch.mul, (sent, scale))
        scaled._rename(f"mul_mb{j}")
        for node, (stage, slot) in zip((piece, fc, sent, scaled), ((0, 0), (0, 0), (1, 1), (1, 1))):
            node.meta.update({"dpcompile_stage": stage, "dpcompile_slot": slot})
        outs.append(scaled)
    graph.output(graph.call_function(runtime.gather, (outs, 0, "cpu:0")))
    gm = fx.GraphModule(_Two(), graph)
    name_dp_copies(gm, micro_batches=1)
    return gm


def test_copy_device_maps_follow_copy_zero_place_by_place():
    """Copy r's map takes copy 0's device k to copy r's device k; copy 0's is the identity."""
    assert copy_device_maps(COPIES) == [{"cpu:0": "cpu:0", "cpu:2": "cpu:2"}, {"cpu:0": "cpu:1", "cpu:2": "cpu:3"}]
    with pytest.raises(PassError, match="dp copy 0 names 'cpu' where copy 1 has 'cpu:2' and 'cpu:3'"):
        copy_device_maps((("cpu", "cpu"), ("cpu:2", "cpu:3")))


def test_find_copy_nodes_places_each_node_of_copy_one_by_its_slot():
    """Copy 1's nodes, each on copy 1's device of its slot; copy 0's and shared nodes are not found."""
    found = find_copy_nodes(_program(), COPIES)
    assert {n.name: where for n, where in found.items()} == {
        "x_dp1": (1, "cpu:1"), "fc_dp1": (1, "cpu:1"), "fc_dp1_to_stage1": (1, "cpu:3"), "mul_dp1": (1, "cpu:3"),
    }  # fmt: skip


def test_place_dp_copies_moves_copy_one_and_computes_the_same():
    """Copy 1's piece scattered to cpu:1, its module replicated there, its send renamed to cpu:3 and
    the parameter sent there once; copy 0 untouched; the values and gradients are the same."""
    gm = _program()
    x = torch.randn(6, 4)
    expected = gm(x)
    result = place_dp_copies(gm, copies=COPIES, micro_batches=1)
    gm.recompile()
    assert result.modified and result.info["sends"] == ["scale_dp1"] and result.info["replicas"] == 1
    code = gm.code
    assert "dpcompile_runtime_scatter(x, ['cpu:0', 'cpu:1'], 0)" in code
    assert "replicas_stage0 = dpcompile_runtime_replicate({'fc': fc_src}, ['cpu:1'])" in code
    assert "fc_dp1 = replica_dp1_stage0.fc(x_dp1)" in code and "fc_dp0 = self.fc(x_dp0)" in code
    assert "dpcompile_runtime_send(fc_dp1, 'cpu:3')" in code and "dpcompile_runtime_send(fc_dp0, 'cpu:2')" in code
    assert "scale_dp1 = dpcompile_runtime_send(scale, 'cpu:3')" in code and "torch.mul(fc_dp0_to_stage1, scale)" in code
    out = gm(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    grads = {k: p.grad.clone() for k, p in gm.named_parameters()}
    gm.zero_grad()
    reference = gm.fc(x) * gm.scale
    reference.sum().backward()
    for k, p in gm.named_parameters():  # each piece's contribution summed into the one parameter once
        torch.testing.assert_close(grads[k], p.grad, msg=lambda m, k=k: f"gradient of {k}: {m}")


def test_place_dp_copies_without_copies_changes_nothing():
    """A program no dp dimension copied (no node of copy 1) is left as it is."""
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))
    code = gm.code
    assert not place_dp_copies(gm, copies=COPIES, micro_batches=1).modified
    assert gm.code == code


def test_place_dp_copies_on_virtual_devices_sends_and_replicates_nothing():
    """Copy 1 named on copy 0's devices (virtual devices): nothing to move, the code is unchanged."""
    gm = _program()
    gm.recompile()
    code = gm.code
    result = place_dp_copies(gm, copies=(("cpu:0", "cpu:2"), ("cpu:0", "cpu:2")), micro_batches=1)
    gm.recompile()
    assert result.info["sends"] == [] and result.info["replicas"] == 0
    assert gm.code == code


class _TiedAcrossStages(nn.Module):
    """An LM head tied to the embedding: stage 1 calls a replica of the head (``replicate_borrowed_modules``)."""

    def __init__(self):
        super().__init__()
        self.embed, self.fc, self.head = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.fc(self.embed(ids))))


def test_a_module_tied_across_stages_is_replicated_onto_each_copy_s_device():
    """Copy 1 of stage 1 calls a replica of the borrowed head made on its own device. Before, copy 0's replica
    was "sent" (send moves tensors only: a no-op on a module), so copy 1 ran on copy 0's device: a device
    mismatch on GPUs (verify(fake_devices=4) failed at head_dp1, cuda:3 and cuda:2)."""
    import copy
    import warnings

    import dpcompile
    from tests.helpers import assert_steps_equal_eager

    torch.manual_seed(0)
    model, ids = _TiedAcrossStages().double(), torch.randint(0, 16, (4, 3))
    eager = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(model, [f"cpu:{i}" for i in range(4)], mesh={"pp": 2, "dp": 2}, example_inputs=(ids,))
    assert "dpcompile_runtime_replicate({'head': head_src}, ['cpu:2', 'cpu:3'])" in pm.code, pm.code
    result = dpcompile.verify(pm, eager, ids, fake_devices=4)
    assert result, str(result)
    assert_steps_equal_eager(pm, eager, lambda step: ((ids + step) % 16,), lambda ps: torch.optim.AdamW(ps, lr=1e-2))
