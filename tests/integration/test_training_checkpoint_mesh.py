"""Training checkpoints over a gloo mesh of 4 processes, each rank writing its own slices: the small
LM of test_training_checkpoint (fused qkv, tied vocab-parallel embedding; float64, AdamW) under
data parallel (DDP), FSDP, tensor parallel (1-D), data x tensor (DDP x TP on ("dp", "tp")), FSDP x
tensor, a 2-stage pipeline over ("pp", "dp") with DDP and with FSDP (each rank one stage; the LM
head tied to the embedding across the stages), saved after one step and loaded under each of the
others (DDP x TP is saved only) and under one-process layouts (and back): parameters and AdamW state
bit-identical to what was saved, the next 2 steps equal the uninterrupted eager run. Pipeline x
tensor on ("pp", "tp") (the head tied to the embedding across the stages: one key) is saved and
loaded into its layout and into tensor parallel in one process.
Every byte of the files is written once, by the rank the writers' plan names, nothing gathered; a
save that fails on one rank leaves the previous checkpoint as it was, on every rank."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.gloo_groups import assert_group_passed, run_checks, run_spawned
from tests.integration.test_fsdp_checkpoint import GROUP_TIMEOUT_S

PIPELINE = {"pipeline": 2, "micro_batches": 1}
MESH_LAYOUTS = {  # name: (mesh shape, dim names, transform keywords)
    "dp4": ((4,), ("dp",), {}),
    "fsdp4": ((4,), ("dp",), {"data_parallel": "fsdp"}),
    "pp2xdp2": ((2, 2), ("pp", "dp"), PIPELINE),
    "pp2xfsdp2": ((2, 2), ("pp", "dp"), {**PIPELINE, "data_parallel": "fsdp"}),
    "tp4": ((4,), ("tp",), {"tensor_parallel": True}),
    "dp2xtp2": ((2, 2), ("dp", "tp"), {"tensor_parallel": True}),
    "fsdp2xtp2": ((2, 2), ("dp", "tp"), {"tensor_parallel": True, "data_parallel": "fsdp"}),
}
SOURCES_ONLY = {"dp2xtp2"}  # saved and loaded elsewhere, not loaded into (the suite's time)
ONE_PROCESS = ["pp2", "dp3", "tp2", "pp2xtp2"]  # rank r loads into ONE_PROCESS[r] on its own


def _mesh_program(name: str):
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from tests.integration.test_training_checkpoint import batches, make_model

    shape, names, keywords = MESH_LAYOUTS[name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    example = {"example_inputs": _own_rows(batches()[0], mesh)} if "pipeline" in keywords else {}
    return dpcompile.transform(make_model(), mesh, **keywords, **example), mesh


def _own_rows(batch, mesh):
    """This rank's part of the batch: its dp coordinate's rows (all of it without a dp dimension)."""
    names = mesh.mesh_dim_names or ()
    if "dp" not in names or mesh.size(names.index("dp")) == 1:
        return batch
    dp = mesh.size(names.index("dp"))
    return tuple(t.chunk(dp)[mesh.get_local_rank("dp")] for t in batch)


def _optimizer(pm, lr=1e-2, weight_decay=0.1):
    opt = torch.optim.AdamW(pm.parameters(), lr=lr, weight_decay=weight_decay)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _mesh_step(pm, mesh, opt, sched, batch) -> float:
    """One step with this rank's part of the batch (its dp coordinate's rows); the whole batch's loss.
    A pipeline's call runs forward and backward; its last stage returns the loss, the others None."""
    import torch.distributed as dist

    names = mesh.mesh_dim_names or ()
    dp = mesh.size(names.index("dp")) if "dp" in names else 1
    loss = pm(*_own_rows(batch, mesh))
    pipeline = "pp" in names
    if not pipeline:
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    total = loss.detach().clone() if loss is not None else torch.zeros((), dtype=torch.float64)
    if pipeline:  # the last stage's ranks hold the loss: every rank gets their mean
        held = torch.tensor([total.item(), float(loss is not None)], dtype=torch.float64)
        dist.all_reduce(held)
        return (held[0] / held[1]).item()
    if dp > 1:
        dist.all_reduce(total, group=mesh.get_group("dp"))
    return total.item() / dp


def _full(value):
    from dpcompile.checkpoint.dtensors import is_dtensor

    return value.full_tensor() if is_dtensor(value) else value


def _state(pm, opt, name):
    """The optimizer's ``name`` state as the model's full tensors (written into the parameters for a
    moment and read back through the program's own state_dict, a collective over the mesh)."""
    params = list(pm.parameters())
    kept = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.copy_(opt.state[p][name])
        out = {k: _full(v).clone() for k, v in pm.state_dict().items()}
        for p, k in zip(params, kept):
            p.copy_(k)
    return out


def _snapshot(pm, opt, sched) -> dict:
    return {
        "params": {k: _full(v).clone() for k, v in pm.state_dict().items()},
        "exp_avg": _state(pm, opt, "exp_avg"),
        "exp_avg_sq": _state(pm, opt, "exp_avg_sq"),
        "lr": opt.param_groups[0]["lr"],
    }


def _assert_resumed(pm, opt, want: dict, what: str) -> None:
    got = _snapshot(pm, opt, None)
    for part in ("params", "exp_avg", "exp_avg_sq"):
        assert got[part].keys() == want[part].keys(), (what, part)
        for key, value in want[part].items():
            assert torch.equal(got[part][key], value), (what, part, key)
    assert got["lr"] == want["lr"] and opt.param_groups[0]["weight_decay"] == 0.1, what
    assert all(float(s["step"]) == 1.0 for s in opt.state.values()), what


def _no_gathers(monkeypatch_targets: list) -> None:
    """Make every gather a save could fall back on fail loudly (restored by the caller)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a save over the mesh gathered a tensor")

    for owner, name in monkeypatch_targets:
        setattr(owner, name, refuse)


def check_mesh_resume(folder: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import dpcompile
    from dpcompile.checkpoint import dtensors, rank_save
    from dpcompile.checkpoint.headers import read_header
    from tests.integration.test_training_checkpoint import batches, build, eager_run, train_step

    rank = dist.get_rank()
    root = Path(folder)
    xs = batches()
    losses, final = eager_run()
    written: list[int] = []
    real_write = rank_save.write_blocks

    def counted(*args, **kwargs):
        n = real_write(*args, **kwargs)
        written.append(n)
        return n

    saved: dict[str, dict] = {}
    programs = {}
    gathers = [(dtensors, "_gather_tensor_parallel"), (DTensor, "full_tensor")]
    for name in MESH_LAYOUTS:
        pm, mesh = _mesh_program(name)
        opt, sched = _optimizer(pm)
        _mesh_step(pm, mesh, opt, sched, xs[0])
        saved[name] = _snapshot(pm, opt, sched)
        kept = {(o, n): getattr(o, n) for o, n in gathers}
        rank_save.write_blocks, written[:] = counted, []
        _no_gathers(gathers)
        try:
            dpcompile.save_checkpoint(pm, root / name, optimizer=opt, lr_scheduler=sched, extra={"from": name},
                                      max_shard_size=20_000)  # fmt: skip
        finally:
            for (o, n), value in kept.items():
                setattr(o, n, value)
            rank_save.write_blocks = real_write
        # every byte of every file's data written once, by the ranks together
        per_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, sum(written))
        data = sum(e.end - e.start for f in (root / name).glob("*.safetensors") for e in read_header(f).values())
        assert sum(per_rank) == data and all(n > 0 for n in per_rank), (name, per_rank, data)
        assert len(list((root / name).glob("model-*.safetensors"))) > 1, "the weights in several files"
        assert not list((root / name).glob(".*.tmp"))
        programs[name] = (pm, mesh)

    pm, mesh = programs["fsdp2xtp2"]  # the same state as a torch.distributed.checkpoint, each rank its blocks
    opt, sched = _optimizer(pm)
    dpcompile.load_checkpoint(pm, root / "fsdp2xtp2", optimizer=opt, lr_scheduler=sched)
    dpcompile.save_checkpoint(pm, root / "dcp", optimizer=opt, lr_scheduler=sched, extra={"from": "dcp"}, format="dcp")
    saved["dcp"] = saved["fsdp2xtp2"]
    assert (root / "dcp" / ".metadata").is_file() and len(list((root / "dcp").glob("*.distcp"))) == 4

    one = ONE_PROCESS[rank]  # one-process layouts: each rank its own, in turn
    onep, one_opt, one_sched = build(
        {"pp2": {"pp": 2}, "dp3": {"dp": 3}, "tp2": {"tp": 2}, "pp2xtp2": {"pp": 2, "tp": 2}}[one]
    )
    if rank == 0:
        train_step(onep, one_opt, one_sched, xs[0])
        dpcompile.save_checkpoint(onep, root / "one_process", optimizer=one_opt, lr_scheduler=one_sched)
        saved["one_process"] = _snapshot(onep, one_opt, one_sched)
    dist.barrier()
    shared: list = [saved.get("one_process")]
    dist.broadcast_object_list(shared, src=0)
    saved["one_process"] = shared[0]

    for dest, (pm, mesh) in programs.items():
        if dest in SOURCES_ONLY:
            continue
        for source in [s for s in [*MESH_LAYOUTS, "one_process", "dcp"] if s != dest]:
            what = f"{source} -> {dest}"
            opt, sched = _optimizer(pm, lr=1.0, weight_decay=0.0)  # hyper-parameters come from the checkpoint
            dpcompile.load_checkpoint(pm, root / source, optimizer=opt, lr_scheduler=sched)
            _assert_resumed(pm, opt, saved[source], what)
            resumed = [_mesh_step(pm, mesh, opt, sched, b) for b in xs[1:]]
            torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[1:]), rtol=1e-12, atol=0, msg=what)
            for key, value in pm.state_dict().items():
                torch.testing.assert_close(_full(value), final[key], rtol=1e-10, atol=1e-12, msg=f"{what}: {key}")

    for source in MESH_LAYOUTS:  # every mesh checkpoint into this rank's one-process layout
        opt, sched = _optimizer(onep, lr=1.0, weight_decay=0.0)
        dpcompile.load_checkpoint(onep, root / source, optimizer=opt, lr_scheduler=sched)
        assert onep.checkpoint_extra == {"from": source}
        _assert_resumed(onep, opt, saved[source], f"{source} -> {one}")
        resumed = [train_step(onep, opt, sched, b) for b in xs[1:]]
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[1:]), rtol=1e-12, atol=0,
                                   msg=f"{source} -> {one}")  # fmt: skip


def check_pipeline_tensor_parallel(folder: str) -> None:
    """Pipeline x tensor over a ("pp", "tp") mesh (each rank a tp shard of one stage; the LM head tied
    to the embedding across the stages, each stage's copy of it summed): saved after one step, the
    tied weight under one key, loaded back into a fresh program of its layout and into tensor parallel
    in one process; bit-identical, and the next 2 steps equal the eager run's."""
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from tests.integration.test_training_checkpoint import batches, make_model, state_in_model_layout, train_step

    xs, path = batches(), Path(folder) / "pp2xtp2"
    eager = make_model()
    eager_opt, eager_sched = _optimizer(eager)
    losses = [train_step(eager, eager_opt, eager_sched, b) for b in xs]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))

    def build():
        pm = dpcompile.transform(make_model(), mesh, tensor_parallel=True, example_inputs=xs[0], **PIPELINE)
        return pm, *_optimizer(pm)

    pm, opt, sched = build()
    assert pm.shards and len(pm.shared) == 1, (pm.plan_reasons, pm.shared)
    _mesh_step(pm, mesh, opt, sched, xs[0])
    saved = _snapshot(pm, opt, sched)
    dpcompile.save_checkpoint(pm, path, optimizer=opt, lr_scheduler=sched, extra={"from": "pp2xtp2"})
    keys = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            keys |= set(f.keys())
    assert "embed.weight" in keys and not [k for k in keys if k.startswith(("head.", "optimizer.state.head."))], keys
    fresh, _, _ = build()
    opt, sched = _optimizer(fresh, lr=1.0, weight_decay=0.0)
    dpcompile.load_checkpoint(fresh, path, optimizer=opt, lr_scheduler=sched)
    _assert_resumed(fresh, opt, saved, "pp2xtp2 -> pp2xtp2")
    resumed = [_mesh_step(fresh, mesh, opt, sched, b) for b in xs[1:]]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[1:]), rtol=1e-12, atol=0)
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, eager.state_dict()[key], rtol=1e-10, atol=1e-12, msg=key)
    if dist.get_rank() == 0:  # into tensor parallel in one process
        one = dpcompile.transform(make_model(), ["cpu"] * 2, mesh={"tp": 2}, example_inputs=xs[0])
        one_opt, one_sched = _optimizer(one, lr=1.0, weight_decay=0.0)
        dpcompile.load_checkpoint(one, path, optimizer=one_opt, lr_scheduler=one_sched)
        for key, value in one.state_dict().items():
            assert torch.equal(value, saved["params"][key]), key
        for name in ("exp_avg", "exp_avg_sq"):
            for key, value in state_in_model_layout(one, one_opt, name).items():
                assert torch.equal(value, saved[name][key]), (name, key)
        resumed = [train_step(one, one_opt, one_sched, b) for b in xs[1:]]
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[1:]), rtol=1e-12, atol=0)
    dist.barrier()


def check_failed_save_changes_nothing(folder: str) -> None:
    """Rank 1 fails while writing its slices: every rank raises, the staged files are gone, and
    the previous checkpoint (saved by the same ranks) loads as it was."""
    import torch.distributed as dist

    import dpcompile
    from dpcompile.checkpoint import rank_save
    from tests.integration.test_training_checkpoint import batches

    rank = dist.get_rank()
    path = Path(folder) / "failing"
    pm, mesh = _mesh_program("dp2xtp2")
    opt, sched = _optimizer(pm)
    _mesh_step(pm, mesh, opt, sched, batches()[0])
    dpcompile.save_checkpoint(pm, path, optimizer=opt, lr_scheduler=sched, extra={"step": 1})
    before = _snapshot(pm, opt, sched)
    files = {p.name: p.read_bytes() for p in path.iterdir()}
    dist.barrier()
    _mesh_step(pm, mesh, opt, sched, batches()[1])
    real = rank_save.write_blocks

    def fail_on_rank_1(*args, **kwargs):
        if rank == 1:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    rank_save.write_blocks = fail_on_rank_1
    try:
        with pytest.raises(Exception, match="No space left on device|failed on another rank"):
            dpcompile.save_checkpoint(pm, path, optimizer=opt, lr_scheduler=sched, extra={"step": 2})
    finally:
        rank_save.write_blocks = real
    dist.barrier()
    assert {p.name: p.read_bytes() for p in path.iterdir()} == files  # no staged file left, nothing renamed
    fresh, _ = _mesh_program("dp2xtp2")
    fresh_opt, fresh_sched = _optimizer(fresh, lr=1.0, weight_decay=0.0)
    dpcompile.load_checkpoint(fresh, path, optimizer=fresh_opt, lr_scheduler=fresh_sched)
    assert fresh.checkpoint_extra == {"step": 1}
    _assert_resumed(fresh, fresh_opt, before, "after a failed save")


def check_bad_arguments_on_one_rank_fail_every_rank(folder: str) -> None:
    """Rank 2 passes an ``extra=`` that is not JSON-able: it raises its own ValueError and every
    other rank a CheckpointError naming it, at once (they waited in the RNG state's exchange until
    gloo's timeout); nothing is written."""
    import torch.distributed as dist

    import dpcompile
    from tests.integration.test_training_checkpoint import batches

    rank = dist.get_rank()
    path = Path(folder) / "bad_arguments"
    pm, mesh = _mesh_program("dp2xtp2")
    opt, sched = _optimizer(pm)
    _mesh_step(pm, mesh, opt, sched, batches()[0])
    extra = {"step": torch.tensor(1)} if rank == 2 else {"step": 1}
    expected = "JSON" if rank == 2 else "failed on another rank.*rank 2: ArgumentError"  # a ValueError too
    with pytest.raises(Exception, match=expected):
        dpcompile.save_checkpoint(pm, path, optimizer=opt, lr_scheduler=sched, extra=extra)
    dist.barrier()
    assert not path.exists() or not any(path.iterdir())


@pytest.mark.slow  # 4 processes, 7 mesh programs each, 48 loads over the mesh: 2 to 3 minutes on 2 busy cores
@pytest.mark.distributed
def test_training_checkpoints_over_a_mesh_resume_under_any_layout(tmp_path):
    checks = [
        ("resume", functools.partial(check_mesh_resume, str(tmp_path))),
        ("failed_save", functools.partial(check_failed_save_changes_nothing, str(tmp_path))),
        ("bad_arguments", functools.partial(check_bad_arguments_on_one_rank_fail_every_rank, str(tmp_path))),
        ("pipeline_tensor_parallel", functools.partial(check_pipeline_tensor_parallel, str(tmp_path))),
    ]
    outcomes = run_spawned(run_checks, 4, checks, timeout=2 * GROUP_TIMEOUT_S)
    assert_group_passed(outcomes, 4, *(name for name, _ in checks), timeout=2 * GROUP_TIMEOUT_S)
