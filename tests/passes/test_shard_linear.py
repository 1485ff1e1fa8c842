"""shard_linear: one shard's program with explicit collectives, its plans, and its numerics."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile.devices import Devices, parse_devices
from dpcompile.infra import run_passes
from dpcompile.runtime import collectives
from dpcompile.runtime import tensor_parallel as tp_runtime
from passes.shard_linear import shard_linear
from tests.helpers import captured, targets
from tests.models import MLP, Attention


def spmd(model: nn.Module, plan: dict[str, str], n: int, *inputs: torch.Tensor) -> fx.GraphModule:
    gm = captured(model, *inputs)
    gm, _ = run_passes(gm, [functools.partial(shard_linear, plan=plan, devices=Devices((torch.device("cpu"),) * n))])
    return gm


# ---------------------------------------------------------------------- shard_linear
def test_shard_linear_writes_one_shards_program_with_explicit_collectives():
    """Column→row becomes f, linear, relu, linear, g, bias add, in that order."""
    gm = spmd(MLP(), {"fc1": "column", "fc2": "row"}, 2, torch.randn(4, 8))
    assert targets(gm) == ["copy_to_shards", "linear", "relu", "linear", "reduce_from_shards", "add_bias"]


def test_shard_linear_records_param_shards_and_stamps_nodes():
    """Sharded get_attrs carry their ShardSpec; created nodes carry the pass stamp and comm kinds."""
    gm = captured(MLP(8, 10), torch.randn(4, 8))
    result = shard_linear(gm, plan={"fc1": "column", "fc2": "row"}, devices=parse_devices(["cpu"] * 3))
    assert result.modified
    shards = result.info["param_shards"]
    assert shards["fc1.weight"] == tp_runtime.ShardSpec(0, (4, 3, 3))
    assert shards["fc2.weight"] == tp_runtime.ShardSpec(1, (4, 3, 3))
    assert "fc2.bias" not in shards
    comms = {n.name: n.meta["dpcompile_comm"] for n in gm.graph.nodes if "dpcompile_comm" in n.meta}
    assert (comms["x_copy"].kind, comms["x_copy"].backward) == ("identity", "all_reduce")
    assert comms["fc2_all_reduce"].kind == "all_reduce"
    assert all(n.meta["dpcompile_pass"] == "shard_linear" for n in gm.graph.nodes if n.name in comms)


def test_shard_linear_adds_row_bias_once_after_the_all_reduce():
    """The row layer's partial product has no bias; the bias is added to the reduced sum."""
    code = spmd(MLP(), {"fc2": "row"}, 2, torch.randn(4, 8)).code
    assert "fc2_partial = torch._C._nn.linear(split, fc2_weight)" in code.replace("relu_split", "split")
    assert "fc2 = dpcompile_runtime_tensor_parallel_add_bias(fc2_all_reduce, fc2_bias)" in code


def test_shard_linear_gathers_a_lone_column_output():
    """A column layer whose output is returned is all-gathered before the output."""
    gm = spmd(MLP(), {"fc2": "column"}, 2, torch.randn(4, 8))
    assert targets(gm)[-2:] == ["linear", "gather_from_shards"]


def test_shard_linear_rewrites_the_sharded_view_constant_as_local_size():
    """view(b, t, heads, d) of a column output reads local_size([2, 2]) for the heads."""
    gm = spmd(Attention(16, 4), {"q": "column", "k": "column", "v": "column", "out": "row"}, 2, torch.randn(2, 5, 16))
    code = gm.code
    assert "local_size([2, 2])" in code
    assert "local_size([8, 8])" in code  # the merge back to (b, t, c)
    assert "gather_from_shards" not in code


def test_shard_linear_aligns_uneven_heads_to_whole_heads():
    """3 heads of 4 over 2 devices split 8 + 4 features, never through a head."""
    gm = captured(Attention(12, 3), torch.randn(2, 5, 12))
    result = shard_linear(gm, plan={"q": "column", "k": "column", "v": "column", "out": "row"}, devices=parse_devices(["cpu"] * 2))
    assert result.info["param_shards"]["q.weight"].sizes == (8, 4)
    assert result.info["param_shards"]["out.weight"].sizes == (8, 4)
    assert result.info["reasons"] == {}


def test_shard_linear_keeps_attention_whole_when_heads_cannot_split():
    """3 heads over 4 devices cannot be proven safe: q, k, v stay replicated with the reason."""
    gm = captured(Attention(12, 3), torch.randn(2, 5, 12))
    plan = {"q": "column", "k": "column", "v": "column", "out": "row"}
    result = shard_linear(gm, plan=plan, devices=parse_devices(["cpu"] * 4))
    assert {p: result.info["plan"][p] for p in plan} == {"q": "replicate", "k": "replicate", "v": "replicate", "out": "row"}
    assert "do not split into 3 x 4" in result.info["reasons"]["q"]


def test_shard_linear_keeps_view_whole_without_shapes():
    """Without example inputs a view of a sharded value cannot be checked; the reason says how to fix it."""
    gm = captured(Attention(16, 4))
    result = shard_linear(gm, plan={"q": "column"}, devices=parse_devices(["cpu"] * 2))
    assert result.info["plan"]["q"] == "replicate"
    assert "example_inputs=" in result.info["reasons"]["q"]


def test_shard_linear_with_only_replicate_is_a_noop():
    """A plan that shards nothing leaves the graph alone and says modified=False."""
    gm = captured(MLP())
    before = gm.code
    result = shard_linear(gm, plan={"fc1": "replicate"}, devices=parse_devices(["cpu"] * 2))
    assert not result.modified and gm.code == before


def test_shard_linear_twice_changes_nothing_more():
    """A second run finds no unsharded Linear calls: modified=False and the same code."""
    gm = spmd(MLP(), {"fc1": "column", "fc2": "row"}, 2, torch.randn(4, 8))
    before = gm.code
    result = shard_linear(gm, plan={"fc1": "column", "fc2": "row"}, devices=parse_devices(["cpu"] * 2))
    assert not result.modified and gm.code == before


def test_shard_linear_rejects_a_layer_too_narrow_with_the_arithmetic():
    """10 output features over 16 devices is an error that shows both numbers."""
    gm = captured(MLP(8, 10))
    with pytest.raises(ValueError, match=r"out_features\(10\) of 'fc1' cannot be split over 16 devices"):
        shard_linear(gm, plan={"fc1": "column"}, devices=parse_devices(["cpu"] * 16))


@pytest.mark.parametrize(
    "plan, message",
    [
        ({"fc3": "column"}, "'fc3', which is not a module of .*'fc1', 'fc2'"),
        ({"fc1": "diagonal"}, "unknown split style 'diagonal' for 'fc1'; valid styles: 'column', 'row', 'replicate'"),
    ],
)
def test_shard_linear_rejects_bad_plans(plan, message):
    """Unknown paths and styles are ValueErrors listing the valid choices."""
    with pytest.raises(ValueError, match=message):
        shard_linear(captured(MLP()), plan=plan, devices=parse_devices(["cpu"] * 2))


def test_shard_linear_program_runs_as_a_world_of_one():
    """On one device the SPMD program (collectives as a world of one) computes the model."""
    model = Attention(16, 4)
    x = torch.randn(2, 5, 16)
    gm = spmd(model, {"q": "column", "k": "column", "v": "column", "out": "row"}, 1, x)
    torch.testing.assert_close(gm(x), model(x))


def test_sdpa_attention_stays_sharded_by_heads():
    """scaled_dot_product_attention over head-sharded q, k, v needs no gather."""

    class SDPA(Attention):
        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (m(x).view(b, t, self.heads, c // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(y.transpose(1, 2).reshape(b, t, c))

    gm = spmd(SDPA(), {"q": "column", "k": "column", "v": "column", "out": "row"}, 2, torch.randn(2, 5, 16))
    assert "gather_from_shards" not in gm.code and targets(gm).count("reduce_from_shards") == 1


# ---------------------------------------------------------------------- the SPMD program over gloo
SPMD_PLANS = {
    "column_row": {"fc1": "column", "fc2": "row"},
    "column_alone": {"fc1": "column"},
    "row_alone": {"fc2": "row"},
}


def _spmd_rank(rank: int, world: int, port: int, results) -> None:
    """One rank: run each plan's one-shard program with its own shards; report mismatches."""
    import os
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    from dpcompile.runtime.tensor_parallel import shard_of

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    outcome: dict[str, str | None] = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=20))
        for name, plan in SPMD_PLANS.items():
            try:
                torch.manual_seed(0)
                model = MLP(6, 5)  # 5 hidden features over 2 ranks: 3 + 2
                x = torch.randn(4, 6)
                gm = spmd(model, plan, world, x)
                for node in gm.graph.nodes:
                    if "dpcompile_shard" in node.meta:
                        path, _, attr = node.target.rpartition(".")
                        full = gm.get_parameter(node.target)
                        local = nn.Parameter(shard_of(full.detach(), node.meta["dpcompile_shard"], rank).clone())
                        setattr(gm.get_submodule(path), attr, local)
                xs, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
                out, ref = gm(xs), model(xe)
                torch.testing.assert_close(out, ref)
                out.square().sum().backward()
                ref.square().sum().backward()
                torch.testing.assert_close(xs.grad, xe.grad)
                outcome[name] = None
            except Exception:  # noqa: BLE001 - report each plan
                outcome[name] = traceback.format_exc()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        outcome["<setup>"] = traceback.format_exc()
    results.put((rank, outcome))


@pytest.fixture(scope="module")
def spmd_outcomes() -> dict[int, dict[str, str | None]]:
    import queue
    import socket

    from tests.gloo_groups import rank_context

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = rank_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_spmd_rank, args=(r, 2, port, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    outcomes: dict[int, dict[str, str | None]] = {}
    try:
        while len(outcomes) < 2:
            rank, outcome = results.get(timeout=60)
            outcomes[rank] = outcome
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return outcomes


@pytest.mark.distributed
@pytest.mark.parametrize("plan", list(SPMD_PLANS))
@pytest.mark.xdist_group("shard_linear_spmd_2")  # one spawned group (the module's fixture), on one worker
def test_shard_linear_program_matches_eager_on_two_gloo_ranks(spmd_outcomes, plan):
    """Each rank runs the one-shard program with torch.distributed collectives and gets eager's output and dX."""
    assert set(spmd_outcomes) == {0, 1}, "a rank reported nothing within 60 s (hang or crash)"
    for rank, outcome in spmd_outcomes.items():
        assert "<setup>" not in outcome, outcome.get("<setup>")
        assert outcome[plan] is None, f"rank {rank}: {outcome[plan]}"


class ShapeReads(nn.Module):
    """Attention scaled by ``k.shape[-1]`` (a head dim, not sharded) and by ``h.size()[-1]`` (sharded)."""

    def __init__(self, d: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 12), nn.Linear(12, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (f(x).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = ((q @ k.transpose(-2, -1)) / k.shape[-1] ** 0.5).softmax(dim=-1) @ v
        h = torch.relu(self.up(x))
        return self.out(y.transpose(1, 2).reshape(b, t, c)) + self.down(h) * h.size()[-1]


SHAPE_PLAN = {"q": "column", "k": "column", "v": "column", "out": "row", "up": "column", "down": "row"}


def test_shard_linear_reads_the_shape_of_an_unsharded_dim_without_a_gather():
    """k.shape[-1] of sharded heads is read locally; only h.size()[-1], the sharded dim, gathers h."""
    x = torch.randn(2, 3, 16)
    gm = spmd(ShapeReads(), SHAPE_PLAN, 2, x)
    gathered = [n.args[0].name for n in gm.graph.nodes if n.op == "call_function" and n.target is collectives.gather_from_shards]
    assert gathered == ["relu"], gm.code


def test_transform_matches_eager_when_forward_reads_shapes_of_shards():
    """Shape reads of sharded values (sharded dim or not) give eager's outputs over 2 and 3 devices."""
    model, x = ShapeReads(), torch.randn(2, 3, 16)
    for n in (2, 3):
        pm = dpcompile.transform(model, ["cpu"] * n, tensor_parallel=SHAPE_PLAN, example_inputs=(x,))
        assert pm.plan == SHAPE_PLAN
        torch.testing.assert_close(pm(x), model(x))
