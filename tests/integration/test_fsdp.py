"""``transform(model, mesh, data_parallel="fsdp")``: FSDP2 over gloo processes on CPU.

Each scenario spawns one group (a few seconds each), so checks share groups: losses, gradients,
three SGD steps and ``pm.state_dict()`` against the eager model on the whole batch; per-rank
parameter bytes against total / world size; a 2-D ``("dp", "tp")`` mesh.
"""

from __future__ import annotations

import copy
import os
import traceback
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from tests.gloo_groups import assert_group_passed, run_spawned
from tests.integration.test_spmd import Block

GROUP_TIMEOUT_S = 300.0  # spawning, importing and the first gloo connections are slow on a loaded machine


class Stack(nn.Module):
    """Repeated blocks between an input projection and a head (the layout FSDP wraps per block)."""

    def __init__(self, d: int = 8, layers: int = 3):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _batches(world: int, steps: int = 3):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2 * world, 5, 8, generator=g) for _ in range(steps)]


def _local_bytes(pm) -> int:
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in pm.parameters())


def _train_and_compare(pm, reference, world: int, dp_rank: int, dp_size: int) -> None:
    """Three SGD steps on this rank's part of each batch against eager on the whole batch: the
    losses, then ``pm.state_dict()`` (full tensors, the model's keys) against the eager model's."""
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    names = [n for n, _ in reference.named_parameters()]
    for x in _batches(world):
        per = x.size(0) // dp_size
        local = x[dp_rank * per : (dp_rank + 1) * per]
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = (pm(local) ** 2).mean()
        want = reference(x)
        want_local = (want[dp_rank * per : (dp_rank + 1) * per] ** 2).mean()
        (want**2).mean().backward()
        loss.backward()
        torch.testing.assert_close(loss, want_local, atol=1e-5, rtol=1e-5)
        opt.step()
        ref_opt.step()
    state = pm.state_dict()
    want_state = reference.state_dict()
    assert list(state) == list(want_state) and [n for n in state if n in names] == names
    for key, value in want_state.items():
        torch.testing.assert_close(state[key], value, atol=1e-5, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


def check_fsdp_1d(rank: int, world: int) -> None:
    """FSDP over a ("dp",) mesh: fully_shard per block then the root; gradients, 3 steps and
    state_dict equal eager; each rank holds about total / world of the parameter bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import dpcompile

    torch.manual_seed(0)
    model = Stack()
    reference = copy.deepcopy(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    pm = dpcompile.transform(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), data_parallel="fsdp")
    assert pm.fsdp is not None and pm.ddp is None
    assert pm.fsdp_blocks == ["layers.0", "layers.1", "layers.2"], pm.fsdp_blocks
    assert all(isinstance(p, DTensor) for p in pm.parameters())
    local = _local_bytes(pm)
    # dim-0 shards are padded to equal rows: at most one row per parameter more than total / world
    slack = sum(p.numel() // p.size(0) * p.element_size() for p in reference.parameters())
    assert total / world <= local <= total / world + slack, (local, total, world)
    _train_and_compare(pm, reference, world, rank, world)


def check_fsdp_grads_exact(rank: int, world: int) -> None:
    """The first step's gradients (all-gathered) equal eager's on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    torch.manual_seed(0)
    model = Stack(layers=2)
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), data_parallel="fsdp")
    x = _batches(world, 1)[0]
    per = x.size(0) // world
    (pm(x[rank * per : (rank + 1) * per]) ** 2).mean().backward()
    (reference(x) ** 2).mean().backward()
    got = dict(pm.named_parameters())
    for name, q in reference.named_parameters():
        torch.testing.assert_close(
            got[name].grad.full_tensor(), q.grad, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


def check_fsdp_mixed_precision(rank: int, world: int) -> None:
    """mixed_precision= reaches fully_shard: bfloat16 compute, float32 shards and gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import dpcompile

    torch.manual_seed(0)
    model = Stack(layers=2)
    reference = copy.deepcopy(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    pm = dpcompile.transform(model, mesh, data_parallel="fsdp", mixed_precision=policy)
    x = _batches(world, 1)[0]
    per = x.size(0) // world
    out = pm(x[rank * per : (rank + 1) * per])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(x)[rank * per : (rank + 1) * per], atol=5e-2, rtol=5e-2)
    out.float().pow(2).mean().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in pm.parameters())


def check_fsdp_2d(rank: int, world: int) -> None:
    """A ("dp", "tp") mesh: tensor parallel over tp, FSDP over dp; 3 steps and state_dict equal eager."""
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    torch.manual_seed(0)
    model = Stack(layers=2)
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    pm = dpcompile.transform(model, mesh, tensor_parallel=True, data_parallel="fsdp")
    assert pm.mode == "spmd_2d" and pm.fsdp is not None and pm.ddp is None
    total = sum(p.numel() * p.element_size() for p in reference.parameters())
    assert _local_bytes(pm) < total / 2, (_local_bytes(pm), total)
    _train_and_compare(pm, reference, world, mesh.get_local_rank("dp"), 2)


def check_fsdp_load_state_dict(rank: int, world: int) -> None:
    """pm.load_state_dict takes the whole tensors pm.state_dict() gives (the model's keys) and cuts each
    rank's rows of FSDP's DTensors (it raised from copying a tensor into a DTensor); a wrong shape is
    refused by name."""
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    torch.manual_seed(0)
    pm = dpcompile.transform(Stack(layers=1), init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), data_parallel="fsdp")
    other = Stack(layers=1)
    pm.load_state_dict(other.state_dict())
    for key, value in pm.state_dict().items():
        torch.testing.assert_close(value, other.state_dict()[key], rtol=0, atol=0)
    x = _batches(world, 1)[0][:2]
    torch.testing.assert_close(pm(x), other(x))
    wrong = {**other.state_dict(), "inp.weight": torch.zeros(3, 3)}
    with pytest.raises(dpcompile.DpCompileError, match="inp.weight"):
        pm.load_state_dict(wrong)


def check_fsdp_measure_and_verify(rank: int, world: int) -> None:
    """measure runs the step through pm (fully_shard's hooks gather the root's shards: run node by node
    it met them as DTensors) and leaves no gradient behind; verify gathers FSDP's gradients and is OK
    with the same inputs on every rank, reports a corrupted shard on every rank, and refuses each
    rank's own part of the batch by name on every rank; on a ("dp", "tp") mesh it gathers the tp shards too."""
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.modules.executors import executor_of

    torch.manual_seed(0)
    model = Stack(layers=1)
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), data_parallel="fsdp")
    x = _batches(world, 1)[0][:4]
    asked = executor_of(pm)  # what measure and verify ask instead of the executor's name
    assert asked.call_runs_under_fsdp(pm) and asked.call_runs_under_dp(pm) and not asked.runs_one_stage_per_rank
    measured = dpcompile.measure(pm, x)
    assert measured.training and list(measured.peak_bytes) == ["cpu"] and measured.step_allocated_peak["cpu"] > 0
    assert all(p.grad is None for p in pm.parameters())
    result = dpcompile.verify(pm, reference, x)
    assert result and result.checked["parameter gradients"] == len(list(reference.parameters())), str(result)
    with pytest.raises(dpcompile.DpCompileError, match="same inputs on every rank"):
        dpcompile.verify(pm, reference, x[rank * 2 : rank * 2 + 2])
    if rank == 0:  # rank 0's shard of the head: every rank all-gathers it
        with torch.no_grad():
            pm.get_parameter("head.weight").to_local()[0, 0] += 1.0
    result = dpcompile.verify(pm, reference, x)
    assert not result and any(m.kind == "output" for m in result.mismatches), str(result)
    # a ("dp", "tp") mesh of (1, 2): the gradients gathered over dp, then their tp shards
    torch.manual_seed(0)
    model = Stack(layers=1)
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    pm = dpcompile.transform(model, mesh, data_parallel="fsdp", tensor_parallel=True)
    result = dpcompile.verify(pm, reference, x)
    assert result and result.checked["parameter gradients"] == len(list(reference.parameters())), str(result)


class Tempered(Stack):
    """A Stack with a 0-dim temperature parameter, which FSDP2's fully_shard cannot shard."""

    def __init__(self):
        super().__init__(layers=2)
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return super().forward(x) / self.temperature


def check_fsdp_refuses_a_0_dim_parameter_before_sharding(rank: int, world: int) -> None:
    """A 0-dim parameter under FSDP over a mesh is refused up front, the model untouched: before, fully_shard
    sharded the blocks, then raised its own ValueError at the root, leaving the model's blocks as DTensors."""
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    torch.manual_seed(0)
    model = Tempered()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(dpcompile.ArgumentError, match=r"cannot shard 0-dim parameters .* \['temperature'\]"):
        dpcompile.transform(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), data_parallel="fsdp")
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class NormedBlock(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        return x + torch.relu(self.bn(self.fc(x).transpose(1, 2)).transpose(1, 2))


class NormedStack(Stack):
    """Repeated blocks holding a BatchNorm."""

    def __init__(self):
        super().__init__(layers=1)
        self.layers = nn.ModuleList(NormedBlock() for _ in range(2))


def check_fsdp_batch_norm_in_a_block_sees_the_whole_batch(rank: int, world: int) -> None:
    """A BatchNorm inside a repeated block under FSDP normalises with the whole, cross-rank batch, as eager:
    the block is traced into (its BatchNorm synchronised over dp), not wrapped as a call of its own. Before,
    the block ran whole per rank and its BatchNorm used this rank's rows only: another loss, other statistics."""
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    torch.manual_seed(0)
    model = NormedStack()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), data_parallel="fsdp")
    assert pm.fsdp_blocks == [], pm.fsdp_blocks
    x = _batches(world, 1)[0]
    per = x.size(0) // world
    torch.testing.assert_close(pm(x[rank * per : (rank + 1) * per]), reference(x)[rank * per : (rank + 1) * per])
    state = pm.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=lambda m, k=key: f"{k}: {m}")


SCENARIOS: dict[str, list[tuple[str, Callable[[int, int], None]]]] = {
    "one_d": [
        ("check_fsdp_1d", check_fsdp_1d),
        ("check_fsdp_grads_exact", check_fsdp_grads_exact),
        ("check_fsdp_mixed_precision", check_fsdp_mixed_precision),
        ("check_fsdp_load_state_dict", check_fsdp_load_state_dict),
        ("check_fsdp_measure_and_verify", check_fsdp_measure_and_verify),
        ("check_fsdp_refuses_a_0_dim_parameter_before_sharding", check_fsdp_refuses_a_0_dim_parameter_before_sharding),
        ("check_fsdp_batch_norm_in_a_block_sees_the_whole_batch", check_fsdp_batch_norm_in_a_block_sees_the_whole_batch),
    ],
    "two_d": [("check_fsdp_1d", check_fsdp_1d), ("check_fsdp_2d", check_fsdp_2d)],
}


# ---------------------------------------------------------------------------- harness
def _entry(rank: int, world: int, port: int, scenario: str, results: mp.Queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    import torch.distributed as dist

    outcome: dict[str, str | None] = {}
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=30)
        )
        for name, check in SCENARIOS[scenario]:
            try:
                check(rank, world)
                outcome[name] = None
            except Exception:  # noqa: BLE001 - report every check
                outcome[name] = traceback.format_exc()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        outcome["<setup>"] = traceback.format_exc()
    results.put((rank, outcome))


def _run(scenario: str, world: int) -> dict[int, dict[str, str | None]]:
    return run_spawned(_entry, world, scenario, timeout=GROUP_TIMEOUT_S)


@pytest.fixture(scope="module")
def two():
    return _run("one_d", 2)


@pytest.fixture(scope="module")
def four():
    return _run("two_d", 4)


@pytest.mark.parametrize("name", [name for name, _ in SCENARIOS["one_d"]])
@pytest.mark.xdist_group("fsdp_2")  # one spawned group, on one worker
def test_fsdp_2_processes(two, name):
    assert_group_passed(two, 2, name, timeout=GROUP_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, _ in SCENARIOS["two_d"]])
@pytest.mark.xdist_group("fsdp_4")  # one spawned group, on one worker
def test_fsdp_4_processes(four, name):
    assert_group_passed(four, 4, name, timeout=GROUP_TIMEOUT_S)


def test_fsdp_needs_a_dp_dimension():
    """Over a device list FSDP shards over dp in one process (test_fsdp_one_process.py); a layout
    without dp has nothing to shard over: an error naming the way out. An unknown kind: a ValueError."""
    import dpcompile

    with pytest.raises(dpcompile.DpCompileError, match="has none: add one"):
        dpcompile.transform(Stack(), ["cpu", "cpu"], tensor_parallel=True, data_parallel="fsdp")
    with pytest.raises(ValueError, match='"ddp"'):
        dpcompile.transform(Stack(), ["cpu", "cpu"], data_parallel="zero3")
