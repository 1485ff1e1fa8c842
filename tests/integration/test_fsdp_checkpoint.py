"""Checkpoints of FSDP programs (``data_parallel="fsdp"``, DTensor parameters) over 2 gloo processes:
saved and loaded shard by shard, loaded into FSDP, meta-built FSDP and data-parallel programs with
equal outputs and state_dict, every rank agreeing on a failure."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.gloo_groups import assert_group_passed, run_checks, run_spawned

GROUP_TIMEOUT_S = 300.0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 7), nn.Linear(7, 8)  # 7 rows: uneven FSDP shards (4 + 3)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _fsdp(model: nn.Module):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    return dpcompile.transform(model, mesh, data_parallel="fsdp")


def _same(pm, want_state, x, want_out) -> None:
    state = pm.state_dict()
    assert list(state) == list(want_state)
    for key, value in want_state.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
    torch.testing.assert_close(pm(x), want_out, rtol=1e-6, atol=1e-6)


def check_save_and_load(folder: str) -> None:
    """Save from an FSDP program (several files), load into a fresh FSDP program (each rank
    reading only its rows), a meta-built one, and data parallel on virtual devices: equal."""
    import torch.distributed as dist

    import dpcompile
    from dpcompile.checkpoint import slices

    rank, world = dist.get_rank(), dist.get_world_size()
    path = Path(folder) / "fsdp"
    torch.manual_seed(0)
    pm = _fsdp(Net())
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(1))
    pm(x[rank::world]).pow(2).mean().backward()
    torch.optim.SGD(pm.parameters(), lr=0.5).step()  # weights no initialisation reproduces
    want_state, want_out = pm.state_dict(), pm(x)
    dpcompile.save_checkpoint(pm, path, max_shard_size=600)  # several files and an index
    dist.barrier()
    assert len(list(path.glob("model-*.safetensors"))) > 1
    torch.manual_seed(1)
    fresh = _fsdp(Net())
    counts: list[int] = []  # the bytes each read takes from the files
    real = slices.pread_runs
    slices.pread_runs = lambda fd, data, at, runs: counts.append(sum(n for _, n in runs)) or real(fd, data, at, runs)
    try:
        dpcompile.load_checkpoint(fresh, path)
    finally:
        slices.pread_runs = real
    total = sum(v.numel() * v.element_size() for v in want_state.values())
    own = sum(-(-v.size(0) // world) * (v.numel() // v.size(0)) * v.element_size() for v in want_state.values())
    assert 0 < sum(counts) <= own < total, (sum(counts), own, total)  # this rank's rows only
    _same(fresh, want_state, x, want_out)
    with torch.device("meta"):
        meta = Net()
    built = _fsdp(meta)
    assert built.needs_weights
    dpcompile.load_checkpoint(built, path)
    _same(built, want_state, x, want_out)
    torch.manual_seed(2)
    replicas = dpcompile.transform(Net(), ["cpu", "cpu"])
    dpcompile.load_checkpoint(replicas, path)
    _same(replicas, want_state, x, want_out)


def check_ranks_agree_on_failure(folder: str) -> None:
    """A save rank 0 cannot write (its path runs through a file) and a load one rank cannot
    read: every rank raises, none is left waiting, and the next save and load succeed."""
    import torch.distributed as dist

    import dpcompile

    rank = dist.get_rank()
    root = Path(folder)
    blocker = root / "blocker"
    if rank == 0:
        blocker.write_text("a file, not a folder")
    dist.barrier()
    torch.manual_seed(0)
    pm = _fsdp(Net())
    with pytest.raises(Exception) as caught:
        dpcompile.save_checkpoint(pm, blocker / "ckpt")
    # every rank sees the file in the way (one file system) and refuses before writing; a rank that
    # could not see it would hear of rank 0's failure instead
    refused_here = isinstance(caught.value, ValueError) and "is a file" in str(caught.value)
    if rank != 0:
        told = isinstance(caught.value, dpcompile.DpCompileError) and "rank 0" in str(caught.value)
        assert refused_here or told, caught.value
    good = root / "good.safetensors"
    dpcompile.save_checkpoint(pm, good)  # the ranks are still in step
    dist.barrier()
    fresh = _fsdp(Net())
    with pytest.raises(dpcompile.DpCompileError) as caught:
        dpcompile.load_checkpoint(fresh, good if rank == 0 else root / "missing.safetensors")
    if rank == 0:
        assert "rank 1" in str(caught.value), caught.value
    assert fresh.needs_weights  # no rank runs on weights the others lack
    with pytest.raises(dpcompile.DpCompileError, match="load_checkpoint"):
        fresh(torch.randn(2, 3, 8))
    dpcompile.load_checkpoint(fresh, good)
    _same(fresh, pm.state_dict(), torch.ones(2, 3, 8), pm(torch.ones(2, 3, 8)))


def check_two_d(folder: str) -> None:
    """A ("dp", "tp") mesh: saved (FSDP's rows gathered, then the tp shards) and loaded back into a
    fresh 2-D program (row-parallel weights: the tp slice read, this rank's rows kept): equal."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    pm = dpcompile.transform(Net(), mesh, tensor_parallel=True, data_parallel="fsdp")
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    want_state, want_out = pm.state_dict(), pm(x)
    path = Path(folder) / "two_d"
    dpcompile.save_checkpoint(pm, path)
    dist.barrier()
    torch.manual_seed(3)
    fresh = dpcompile.transform(Net(), mesh, tensor_parallel=True, data_parallel="fsdp")
    dpcompile.load_checkpoint(fresh, path)
    _same(fresh, want_state, x, want_out)
    replicas = dpcompile.transform(Net(), ["cpu", "cpu"])
    dpcompile.load_checkpoint(replicas, path)
    _same(replicas, want_state, x, want_out)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_checkpoint_4_processes_two_d(tmp_path):
    """FSDP over dp with tensor parallel over tp (2 x 2 gloo ranks): save and load equal; see check_two_d."""
    outcomes = run_spawned(run_checks, 4, [("two_d", functools.partial(check_two_d, str(tmp_path)))],
                           timeout=GROUP_TIMEOUT_S)  # fmt: skip
    assert_group_passed(outcomes, 4, "two_d", timeout=GROUP_TIMEOUT_S)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("fsdp_checkpoint"))
    checks = [
        ("save_and_load", functools.partial(check_save_and_load, folder)),
        ("agreement", functools.partial(check_ranks_agree_on_failure, folder)),
    ]
    return run_spawned(run_checks, 2, checks, timeout=GROUP_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["save_and_load", "agreement"])
@pytest.mark.xdist_group("fsdp_checkpoint_2")  # one spawned group, on one worker
def test_fsdp_checkpoint_2_processes(outcomes, name):
    """FSDP checkpoints over 2 gloo ranks: see check_save_and_load and check_ranks_agree_on_failure."""
    assert_group_passed(outcomes, 2, name, timeout=GROUP_TIMEOUT_S)
