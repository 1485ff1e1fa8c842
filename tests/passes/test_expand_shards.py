"""expand_shards: one node per device, parameters cut into shards, placement under fake GPUs."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dpcompile.devices import Devices, parse_devices
from dpcompile.fake import fake_devices
from dpcompile.infra import run_passes
from dpcompile.recipes import TensorParallelRecipe
from passes.expand_shards import expand_shards
from passes.shard_linear import shard_linear
from tests.helpers import captured
from tests.models import MLP


def expanded(model: nn.Module, plan: dict[str, str], devices: Devices, *inputs: torch.Tensor) -> tuple[fx.GraphModule, list]:
    gm = captured(model, *inputs)
    return run_passes(
        gm,
        [
            functools.partial(shard_linear, plan=plan, devices=devices),
            functools.partial(expand_shards, devices=devices, output_device=devices.primary),
        ],
    )


def test_expand_shards_names_one_node_per_device():
    """Sharded values become fc1_dev0/fc1_dev1 reading weight_shard0/weight_shard1."""
    gm, _ = expanded(MLP(), {"fc1": "column", "fc2": "row"}, parse_devices(["cpu"] * 2), torch.randn(4, 8))
    code = gm.code
    for text in ("fc1_dev0 = ", "fc1_dev1 = ", "self.fc1.weight_shard1", "relu_dev1 = torch.relu(fc1_dev1)", "reduce_to_device([fc2_partial_dev0, fc2_partial_dev1], 'cpu')"):
        assert text in code


def test_expand_shards_replaces_sharded_linears_by_their_shards():
    """The sharded Linear becomes a LinearShards holding one slice per device plus the whole row bias."""
    gm, records = expanded(MLP(8, 10), {"fc1": "column", "fc2": "row"}, parse_devices(["cpu"] * 3), torch.randn(4, 8))
    names = dict(gm.named_parameters())
    assert names["fc1.weight_shard0"].shape == (4, 8) and names["fc1.weight_shard2"].shape == (3, 8)
    assert names["fc2.weight_shard1"].shape == (8, 3) and names["fc2.bias"].shape == (8,)
    assert records[-1].info["param_shards"]["fc1.bias"][1] == ["fc1.bias_shard0", "fc1.bias_shard1", "fc1.bias_shard2"]


def test_expand_shards_on_a_graph_without_shards_is_a_noop():
    """Running expand_shards on a graph with no shards or collectives changes nothing."""
    gm = captured(MLP())
    assert not expand_shards(gm, devices=parse_devices(["cpu"] * 2)).modified


@pytest.mark.parametrize("n", [4, 8])
def test_expand_shards_places_every_op_on_one_fake_gpu(n):
    """Under FakeTensorMode, an n-GPU program runs with no mixed-device op and puts shard k on cuda:k."""
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(4, 32, device="cuda:0")
        devices = fake_devices(n)
        pm = TensorParallelRecipe(devices=devices, output_device=devices.primary, check_available=False).compile(model, None)
        with torch.no_grad():
            out = pm(x)
    assert pm.plan == {"0": "column", "2": "row"}
    assert out.device == torch.device("cuda:0") and out.shape == (4, 32)
    devices = {name: str(p.device) for name, p in pm.named_parameters()}
    assert devices["0.weight_shard3"] == "cuda:3" and devices[f"2.weight_shard{n - 1}"] == f"cuda:{n - 1}"
    assert devices["2.bias"] == "cuda:0"


def test_fake_tensor_mode_catches_mixed_devices():
    """The placement check has teeth: a fake op across cuda:0 and cuda:1 raises."""
    with FakeTensorMode(), pytest.raises(RuntimeError, match="cuda:0 and cuda:1"):
        torch.randn(2, 2, device="cuda:0") @ torch.randn(2, 2, device="cuda:1")
