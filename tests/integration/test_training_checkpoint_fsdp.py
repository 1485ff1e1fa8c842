"""Training checkpoints of FSDP programs over 2 gloo ranks: AdamW's state saved from FSDP (DTensor
state, gathered one tensor at a time) loads into a fresh FSDP program (each rank its rows, as
DTensors) and into tensor parallel in one process, bit-identical; the resumed FSDP run's next 2
steps equal the uninterrupted run's; it loads into FSDP in one process (dp x tp) too; what one
process saved (data parallel, and FSDP in one process) loads into FSDP."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.gloo_groups import assert_group_passed, run_checks, run_spawned
from tests.integration.test_fsdp_checkpoint import GROUP_TIMEOUT_S, Net
from tests.integration.test_training_checkpoint import state_in_model_layout


def _fsdp(model):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    return dpcompile.transform(model, mesh, data_parallel="fsdp")


def _full(value):
    from dpcompile.checkpoint.dtensors import is_dtensor

    return value.full_tensor() if is_dtensor(value) else value


def _state(pm, opt, name):
    """``{model key: the full state tensor}`` (DTensor state gathered; keys from pm.state_dict)."""
    params = dict(pm.named_parameters())
    return {key: _full(opt.state[params[key]][name]).detach().clone() for key in pm.state_dict() if key in params}


def _step(pm, opt, x, rank, world):
    loss = pm(x[rank::world]).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def check_fsdp_resume(folder: str) -> None:
    import torch.distributed as dist

    import dpcompile

    rank, world = dist.get_rank(), dist.get_world_size()
    path = Path(folder) / "fsdp_training"
    xs = [torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    torch.manual_seed(0)
    pm = _fsdp(Net())
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    _step(pm, opt, xs[0], rank, world)
    saved = {n: _state(pm, opt, n) for n in ("exp_avg", "exp_avg_sq")}
    dpcompile.save_checkpoint(pm, path, optimizer=opt, extra={"step": 1}, max_shard_size=600)
    dist.barrier()

    torch.manual_seed(5)
    fresh = _fsdp(Net())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    dpcompile.load_checkpoint(fresh, path, optimizer=fresh_opt)
    assert fresh.checkpoint_extra == {"step": 1}
    for name, want in saved.items():
        got = _state(fresh, fresh_opt, name)
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), (name, key)
    assert fresh_opt.param_groups[0]["lr"] == 1e-2
    uninterrupted = [_step(pm, opt, x, rank, world) for x in xs[1:]]
    resumed = [_step(fresh, fresh_opt, x, rank, world) for x in xs[1:]]
    assert torch.equal(torch.stack(resumed), torch.stack(uninterrupted))
    for key, value in pm.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key

    # the same checkpoint into tensor parallel in one process (each rank on its own)
    tp = dpcompile.transform(Net(), ["cpu", "cpu"], tensor_parallel=True)
    tp_opt = torch.optim.AdamW(tp.parameters(), lr=1.0)
    dpcompile.load_checkpoint(tp, path, optimizer=tp_opt)
    kept = [p.detach().clone() for p in tp.parameters()]
    with torch.no_grad():
        for name, want in saved.items():
            for p in tp.parameters():
                p.copy_(tp_opt.state[p][name])
            for key, value in tp.state_dict().items():
                assert torch.equal(value, want[key]), (name, key)
        for p, k in zip(tp.parameters(), kept):
            p.copy_(k)


    # and into FSDP in one process, over dp x tp on virtual devices (each rank on its own)
    local = dpcompile.transform(Net(), ["cpu"] * 4, mesh={"dp": 2, "tp": 2}, data_parallel="fsdp")
    local_opt = torch.optim.AdamW(local.parameters(), lr=1.0)
    dpcompile.load_checkpoint(local, path, optimizer=local_opt)
    for name, want in saved.items():
        for key, value in state_in_model_layout(local, local_opt, name).items():
            assert torch.equal(value, want[key]), (name, key)

    # what one process saved (rank 0: data parallel, then FSDP in one process) into FSDP
    for one, sharded in ((Path(folder) / "one_process", False), (Path(folder) / "one_process_fsdp", True)):
        _one_process_into_fsdp(folder, one, sharded, xs[0], rank)


def _one_process_into_fsdp(folder, one, sharded, x, rank):
    import torch.distributed as dist

    import dpcompile

    if rank == 0:
        torch.manual_seed(0)
        dp = dpcompile.transform(Net(), ["cpu", "cpu"], data_parallel="fsdp" if sharded else "ddp")
        dp_opt = torch.optim.AdamW(dp.parameters(), lr=1e-2)
        _step(dp, dp_opt, x, 0, 1)
        dpcompile.save_checkpoint(dp, one, optimizer=dp_opt)
        torch.save({k: v.clone() for k, v in dp.state_dict().items()}, Path(folder) / f"{one.name}_params.pt")
        torch.save(state_in_model_layout(dp, dp_opt, "exp_avg"), Path(folder) / f"{one.name}_exp_avg.pt")
    dist.barrier()
    target = _fsdp(Net())
    target_opt = torch.optim.AdamW(target.parameters(), lr=1.0)
    dpcompile.load_checkpoint(target, one, optimizer=target_opt)
    want = torch.load(Path(folder) / f"{one.name}_exp_avg.pt")
    got = _state(target, target_opt, "exp_avg")
    for key in want:
        assert torch.equal(got[key], want[key]), key
    params = torch.load(Path(folder) / f"{one.name}_params.pt")
    for key, value in target.state_dict().items():
        assert torch.equal(value, params[key]), key


@pytest.mark.distributed
def test_fsdp_training_checkpoint_2_processes(tmp_path):
    outcomes = run_spawned(run_checks, 2, [("resume", functools.partial(check_fsdp_resume, str(tmp_path)))],
                           timeout=GROUP_TIMEOUT_S)  # fmt: skip
    assert_group_passed(outcomes, 2, "resume", timeout=GROUP_TIMEOUT_S)
