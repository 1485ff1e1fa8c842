"""Training checkpoints that change the number of ranks over gloo: the small LM of
test_training_checkpoint (fused qkv, an LM head tied to a vocab-parallel embedding; float64, AdamW)
saved after one step by a group of 2 ranks and loaded by a group of 4, and the other way round.

Three groups run in turn, sharing a folder: 2 ranks save under data parallel, FSDP, tensor parallel
and a 2-stage pipeline (``("pp",)``, also as ``format="dcp"``); 4 ranks save under DDP, FSDP, tensor
parallel, FSDP x tensor, the pipelines ``("pp", "dp")`` with DDP and with FSDP and pipeline x tensor
``("pp", "tp")`` (the head tied to the embedding across the stages; the three pipelines also as
DCP), and load each 2-rank checkpoint into each of those (35 loads); pipeline x tensor and FSDP x
tensor load each other on the same 4 ranks (each rank's RNG its own there); 2 ranks load each 4-rank
checkpoint into each 2-rank layout (40), and a few pipeline checkpoints into one process. Every
load: parameters and AdamW state bit-identical to what was saved, the next 2 steps' losses and
parameters equal the uninterrupted eager run; every rank's RNG is the saving rank 0's. No save
gathers a tensor; a pipeline's DCP files hold only their stage's blocks (the tied head's state under
the embedding's key only), and a stage reads only its own."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import pytest
import torch

from tests.gloo_groups import assert_group_passed, run_checks, run_spawned
from tests.integration.test_fsdp_checkpoint import GROUP_TIMEOUT_S
from tests.integration.test_training_checkpoint_mesh import (
    MESH_LAYOUTS,
    PIPELINE,
    _assert_resumed,
    _full,
    _mesh_step,
    _no_gathers,
    _optimizer,
    _own_rows,
    _snapshot,
)

LAYOUTS = {  # name: (mesh shape, dim names, transform keywords)
    "dp2": ((2,), ("dp",), {}),
    "fsdp2": ((2,), ("dp",), {"data_parallel": "fsdp"}),
    "tp2": ((2,), ("tp",), {"tensor_parallel": True}),
    "pp2": ((2,), ("pp",), PIPELINE),
    **{name: MESH_LAYOUTS[name] for name in ("dp4", "fsdp4", "tp4", "fsdp2xtp2", "pp2xdp2", "pp2xfsdp2")},
    "pp2xtp2": ((2, 2), ("pp", "tp"), {**PIPELINE, "tensor_parallel": True}),  # the head tied across the stages
}
AS_DCP = {"pp2", "pp2xdp2", "pp2xfsdp2", "pp2xtp2"}  # saved as format="dcp" too (folder "<name>.dcp")
SAME_RANKS = ("pp2xtp2", "fsdp2xtp2")  # also load each other on the same 4 ranks (each rank's RNG its own)
ON = {world: [n for n, (shape, *_) in LAYOUTS.items() if torch.Size(shape).numel() == world] for world in (2, 4)}


def _program(name: str):
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from tests.integration.test_training_checkpoint import batches, make_model

    shape, names, keywords = LAYOUTS[name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    example = {"example_inputs": _own_rows(batches()[0], mesh)} if "pipeline" in keywords else {}
    return dpcompile.transform(make_model(), mesh, **keywords, **example), mesh


def _sources(world: int) -> list[str]:
    """The checkpoints the group of ``world`` ranks saved: one per layout, and the DCP ones."""
    return [path for name in ON[world] for path in [name, f"{name}.dcp"][: 2 if name in AS_DCP else 1]]


def check_save_and_load(folder: str, world: int, save: bool, load_from: int | None) -> None:
    """This group's layouts: each trained one step and saved (``save``), and each loading every
    checkpoint of the group of ``load_from`` ranks."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import dpcompile
    from dpcompile.checkpoint import dtensors
    from tests.integration.test_training_checkpoint import batches, eager_run

    root, xs = Path(folder), batches()
    eager = eager_run()
    programs, saved = {}, {}
    gathers = [(dtensors, "_gather_tensor_parallel"), (DTensor, "full_tensor")]
    for name in ON[world]:
        pm, mesh = _program(name)
        programs[name] = (pm, mesh)
        if not save:
            continue
        opt, sched = _optimizer(pm)
        _mesh_step(pm, mesh, opt, sched, xs[0])
        saved[name] = _snapshot(pm, opt, sched)
        torch.manual_seed(1000 + dist.get_rank())  # each rank's generator its own: a load on another number of
        saved[name]["rng"] = _rank_0(torch.get_rng_state())  # ranks gets rank 0's
        saved[name]["own_rng"] = torch.get_rng_state()  # on as many ranks, each rank its own
        kept = {(o, n): getattr(o, n) for o, n in gathers}
        _no_gathers(gathers)
        try:
            for path, form in [(name, "safetensors"), (f"{name}.dcp", "dcp")][: 2 if name in AS_DCP else 1]:
                dpcompile.save_checkpoint(pm, root / path, optimizer=opt, lr_scheduler=sched,
                                          extra={"from": path, "world": world}, format=form)  # fmt: skip
                saved[path] = saved[name]
        finally:
            for (o, n), value in kept.items():
                setattr(o, n, value)
    if save and dist.get_rank() == 0:
        torch.save(saved, root / f"saved_by_{world}.pt")
        for name in (n for n in ON[world] if n in AS_DCP):
            _assert_written_by_stage(root / f"{name}.dcp", world)
    dist.barrier()
    if load_from is None:
        return
    want = torch.load(root / f"saved_by_{load_from}.pt", weights_only=False)
    for dest, (pm, mesh) in programs.items():
        for source in _sources(load_from):
            _load_and_resume(pm, mesh, root, source, load_from, want[source], eager, f"{source} ({load_from} ranks) -> {dest} ({world} ranks)")
    if save and world == 4:  # pipeline x tensor and FSDP x tensor on the same 4 ranks, both ways
        for dest in SAME_RANKS:
            pm, mesh = programs[dest]
            for source in [s for s in _sources(4) if s.removesuffix(".dcp") in SAME_RANKS and s.removesuffix(".dcp") != dest]:
                want_here = {**saved[source], "rng": saved[source]["own_rng"]}
                _load_and_resume(pm, mesh, root, source, 4, want_here, eager, f"{source} -> {dest} (4 ranks)")


def _load_and_resume(pm, mesh, root: Path, source: str, world: int, want: dict, eager_run, what: str) -> None:
    """``source`` loaded into ``pm``: what was saved comes back bit for bit, and the next 2 steps equal
    the uninterrupted eager run."""
    import dpcompile
    from tests.integration.test_training_checkpoint import batches

    xs, (losses, final) = batches(), eager_run
    opt, sched = _optimizer(pm, lr=1.0, weight_decay=0.0)  # hyper-parameters come from the checkpoint
    with _reads_recorded() as read:
        dpcompile.load_checkpoint(pm, root / source, optimizer=opt, lr_scheduler=sched)
    if source.endswith(".dcp") and "pp" in mesh.mesh_dim_names:  # a stage reads its own blocks only
        other = f"blocks.{1 - mesh.get_local_rank('pp')}."
        assert read and not [fqn for fqn in read if other in fqn], (what, other, read)
    assert pm.checkpoint_extra == {"from": source, "world": world}, what
    assert torch.equal(torch.get_rng_state(), want["rng"]), what
    _assert_resumed(pm, opt, want, what)
    resumed = [_mesh_step(pm, mesh, opt, sched, b) for b in xs[1:]]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[1:]), rtol=1e-12, atol=0, msg=what)
    for key, value in pm.state_dict().items():
        torch.testing.assert_close(_full(value), final[key], rtol=1e-10, atol=1e-12, msg=f"{what}: {key}")


def check_one_process(folder: str) -> None:
    """Pipeline checkpoints of both groups (DCP and FSDP's safetensors) into a one-process layout of
    this rank's own (pipeline x tensor on 4 virtual devices, data parallel on 3)."""
    import torch.distributed as dist

    import dpcompile
    from tests.integration.test_training_checkpoint import batches, build, eager_run, state_in_model_layout, train_step

    root, xs = Path(folder), batches()
    losses, final = eager_run()
    layout = [{"pp": 2, "tp": 2}, {"dp": 3}][dist.get_rank()]
    pm = build(layout)[0]
    for source, world in [("pp2.dcp", 2), ("pp2xdp2.dcp", 4), ("pp2xfsdp2", 4)]:
        want, what = torch.load(root / f"saved_by_{world}.pt", weights_only=False)[source], f"{source} -> {layout}"
        opt, sched = _optimizer(pm, lr=1.0, weight_decay=0.0)
        dpcompile.load_checkpoint(pm, root / source, optimizer=opt, lr_scheduler=sched)
        assert torch.equal(torch.get_rng_state(), want["rng"]) and opt.param_groups[0]["weight_decay"] == 0.1, what
        for key, value in pm.state_dict().items():
            assert torch.equal(value, want["params"][key]), (what, key)
        for name in ("exp_avg", "exp_avg_sq"):
            for key, value in state_in_model_layout(pm, opt, name).items():
                assert torch.equal(value, want[name][key]), (what, name, key)
        resumed = [train_step(pm, opt, sched, b) for b in xs[1:]]
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[1:]), rtol=1e-12, atol=0, msg=what)
        for key, value in pm.state_dict().items():
            torch.testing.assert_close(value, final[key], rtol=1e-10, atol=1e-12, msg=f"{what}: {key}")


def _rank_0(value):
    """Rank 0's ``value``, on every rank."""
    import torch.distributed as dist

    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _assert_written_by_stage(folder: Path, world: int) -> None:
    """In a pipeline's DCP folder each block's chunks are in the files of its stage's ranks (rank r
    writes ``__r_0.distcp``; the first half of the ranks is stage 0), a tied LM head's state is
    under the embedding's key only (one key), and every rank wrote a file."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    files = {}
    for index, item in metadata.storage_data.items():
        files.setdefault(index.fqn, set()).add(int(item.relative_path.split("_")[2]) // (world // 2))
    for stage in (0, 1):
        blocks = [fqn for fqn in files if f"blocks.{stage}." in fqn]
        assert blocks and all(files[fqn] == {stage} for fqn in blocks), (folder, stage, blocks)
    heads = [fqn for fqn in files if fqn.startswith("optimizer.state.head.")]
    assert not heads, (folder, heads)
    assert len(list(folder.glob("*.distcp"))) == world, folder


@contextlib.contextmanager
def _reads_recorded():
    """The fqns of the tensors each load of a DCP folder reads on this rank (its read plan)."""
    from dpcompile.checkpoint import dcp_planners

    real, read = dcp_planners.PiecesLoadPlanner.create_local_plan, []

    def recorded(planner):
        plan = real(planner)
        read.extend(item.dest_index.fqn for item in plan.items if item.type.name == "TENSOR")
        return plan

    dcp_planners.PiecesLoadPlanner.create_local_plan = recorded
    try:
        yield read
    finally:
        dcp_planners.PiecesLoadPlanner.create_local_plan = real


@pytest.mark.slow  # three groups in turn (2, 4, then 2 ranks), 65 loads over the mesh: 1 to 1.5 minutes on 2 busy cores
@pytest.mark.distributed
def test_training_checkpoints_resume_on_another_number_of_ranks(tmp_path):
    for world, save, load_from in [(2, True, None), (4, True, 2), (2, False, 4)]:
        checks = [("resize", functools.partial(check_save_and_load, str(tmp_path), world, save, load_from))]
        if not save:  # the last group: both groups' pipeline checkpoints into one process too
            checks.append(("one_process", functools.partial(check_one_process, str(tmp_path))))
        outcomes = run_spawned(run_checks, world, checks, timeout=2 * GROUP_TIMEOUT_S)
        assert_group_passed(outcomes, world, *(name for name, _ in checks), timeout=2 * GROUP_TIMEOUT_S)
