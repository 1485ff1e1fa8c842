"""lower_to_collectives: one rank's program with its collectives lowered to torch.distributed
(in process: the pass only records the mesh; the spawned groups in tests/integration/test_spmd.py run it)."""

from __future__ import annotations

import torch

from dpcompile.capture import capture as _captured
from tests.helpers import FakeMesh
from tests.models import MLP, BNNet


def test_lower_to_collectives_batch_norm_becomes_sync_batch_norm():
    """With dp_dim, a BatchNorm call becomes sync_batch_norm over dp_group, keeping the node's name."""
    from dpcompile.runtime import distributed
    from passes.collectives import lower_to_collectives

    gm = _captured(BNNet())
    result = lower_to_collectives(gm, mesh=FakeMesh(), dp_dim="dp")
    gm.recompile()
    assert result.modified and result.info["batch_norms"] == ["bn"]
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert distributed.sync_batch_norm in targets
    assert "bn_sync = dpcompile_runtime_distributed_sync_batch_norm(bn, fc, dp_group)" in gm.code, gm.code
    assert all(n.meta.get("dpcompile_pass") == "lower_to_collectives" for n in gm.graph.nodes if n.name in ("bn_sync", "dp_group"))


def test_lower_to_collectives_swaps_shard_collectives():
    """shard_linear's one-shard collectives become process-group collectives named in the code."""
    from dpcompile.devices import Devices
    from dpcompile.runtime import collectives, distributed
    from passes.collectives import lower_to_collectives
    from passes.shard_linear import shard_linear

    gm = _captured(MLP(8, 7))
    shard_linear(gm, plan={"fc1": "column"}, devices=Devices((torch.device("cpu"),) * 2))
    before = [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target in collectives.COLLECTIVES]
    result = lower_to_collectives(gm, mesh=FakeMesh(), tp_dim="tp")
    gm.recompile()
    assert result.modified
    calls = {n.name: n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert not any(t in collectives.COLLECTIVES for t in calls.values())
    assert [calls[name] for name in before] == [distributed.all_reduce_grad, distributed.all_gather]
    assert "dpcompile_runtime_distributed_all_gather(relu, tp_group, dim = -1, sizes = [4, 3])" in gm.code, gm.code


def test_lower_to_collectives_noop_and_idempotent():
    """Nothing to lower: modified=False; lowering twice changes nothing more."""
    from passes.collectives import lower_to_collectives

    gm = _captured(MLP())
    assert not lower_to_collectives(gm, mesh=FakeMesh(), dp_dim="dp").modified
    gm = _captured(BNNet())
    lower_to_collectives(gm, mesh=FakeMesh(), dp_dim="dp")
    gm.recompile()
    code = gm.code
    assert not lower_to_collectives(gm, mesh=FakeMesh(), dp_dim="dp").modified
    gm.recompile()
    assert gm.code == code


