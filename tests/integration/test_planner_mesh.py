"""plan="auto" over a DeviceMesh of 2 gloo ranks: the planner's first fitting candidate is built
over a mesh of its own dimension names, a training step on ``local_batch(batch, pm.mesh)`` equals
eager's; a budget replication does not fit chooses tensor parallel; a budget nothing fits, or ranks
that plan differently, raise the same error on every rank. Reference calibration (no timing)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.gloo_groups import assert_group_passed, run_checks, run_spawned
from tests.integration.test_planner import Stack

GROUP_TIMEOUT_S = 300.0  # spawning, importing and the first gloo connections are slow on a loaded machine
WORLD = 2
LABELS = [f"rank{r}" for r in range(WORLD)]


def _eager_and_batch():
    torch.manual_seed(0)
    eager = Stack(layers=2).double()
    g = torch.Generator().manual_seed(1)
    return eager, (torch.randn(8, 16, 16, generator=g, dtype=torch.float64),
                   torch.randn(8, 16, 8, generator=g, dtype=torch.float64))  # fmt: skip


def _planned(eager, batch, checkpointing: bool = False):
    from dpcompile.planned_mesh import mesh_candidates
    from dpcompile.planner import plan_mesh_layouts

    return plan_mesh_layouts(eager, LABELS, dict.fromkeys(LABELS, 1 << 40), optimizer="adamw", training=True,
                             example_inputs=batch, example_kwargs=None,
                             specs=mesh_candidates(WORLD, checkpointing=checkpointing))  # fmt: skip


def _auto(model, budget, batch):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # unnamed: the planner names its own
    return dpcompile.transform(model, mesh, plan="auto", memory_per_device=budget, example_inputs=batch,
                               optimizer="adamw")  # fmt: skip


def _step_equals_eager(pm, eager, batch) -> None:
    """One step on this rank's ``local_batch``: the loss equals eager's on that part, every gradient
    (after DDP's averaging, or this rank's shard) equals eager's on the whole batch."""
    from dpcompile.mesh import local_batch
    from dpcompile.runtime.tensor_parallel import shard_of

    local = local_batch(batch, pm.mesh)
    loss = pm(*local)
    torch.testing.assert_close(loss, eager(*local))
    loss.backward()
    eager(*batch).backward()
    mine = dict(pm.named_parameters())
    tp_rank = pm.mesh.get_local_rank("tp") if "tp" in pm.mesh.mesh_dim_names else 0
    for key, p in eager.named_parameters():
        want = shard_of(p.grad, pm.shards[key], tp_rank) if key in pm.shards else p.grad
        torch.testing.assert_close(mine[key].grad, want, msg=lambda m, key=key: f"{key}: {m}")


def check_loose_budget_builds_the_fastest() -> None:
    import dpcompile

    eager, batch = _eager_and_batch()
    first = _planned(eager, batch).fitting[0]
    pm = _auto(copy.deepcopy(eager), "1GiB", batch)
    chosen = [c for c in pm.candidates if c.rejected is None]
    assert [c.spec.name for c in chosen] == [first.spec.name] == ["dp2"], [c.row() for c in pm.candidates]
    assert pm.layout == {"dp": 2} and pm.strategies == {"dp": "data parallel (replicate)"}
    assert pm.mesh.mesh_dim_names == ("dp",) and pm.memory_plan.peak == first.peak
    assert pm.calibration.source == "reference" and pm.calibration.ranks == WORLD
    _step_equals_eager(pm, eager, batch)
    table = dpcompile.explain(pm, *batch).candidates  # each layout also with every block recomputed
    assert [(row["layout"], row["checkpointing"], row["rejected"] is None) for row in table] == [
        ({"dp": 2}, False, True), ({"dp": 2}, True, False), ({"tp": 2}, False, False), ({"tp": 2}, True, False)]


def check_budget_only_tensor_parallel_fits() -> None:
    import dpcompile

    eager, batch = _eager_and_batch()
    peak = {c.spec.name: c.peak for c in _planned(eager, batch, checkpointing=True).candidates}
    replicated = min(peak["dp2"], peak["dp2 +ckpt"])
    assert peak["tp2"] < replicated, peak
    pm = _auto(copy.deepcopy(eager), (peak["tp2"] + replicated) // 2, batch)
    assert pm.layout == {"tp": 2} and pm.mesh.mesh_dim_names == ("tp",)
    dp2, dp2_ckpt, tp2, tp2_ckpt = pm.candidates  # dp2 recomputing every block does not fit either
    assert [c.spec.name for c in pm.candidates] == ["dp2", "dp2 +ckpt", "tp2", "tp2 +ckpt"]
    assert dp2.rejected.startswith("does not fit: ") and dp2_ckpt.rejected.startswith("does not fit: ")
    assert tp2.rejected is None and tp2_ckpt.fits, [c.row() for c in pm.candidates]
    _step_equals_eager(pm, eager, batch)
    table = dpcompile.explain(pm, *batch).candidates
    assert [(row["layout"], row["rejected"] is None) for row in table] == [
        ({"dp": 2}, False), ({"dp": 2}, False), ({"tp": 2}, True), ({"tp": 2}, False)]


def _same_error_on_every_rank(budget, batch) -> str:
    import torch.distributed as dist

    from dpcompile.errors import DpCompileError

    eager, _ = _eager_and_batch()
    model = copy.deepcopy(eager)
    with pytest.raises(DpCompileError) as caught:
        _auto(model, budget, batch)
    messages = [None] * WORLD
    dist.all_gather_object(messages, str(caught.value))
    assert messages == [messages[0]] * WORLD, messages
    for (key, p), q in zip(model.named_parameters(), eager.parameters()):  # nothing built or changed
        assert p.grad is None and torch.equal(p, q), key
    return messages[0]


def check_budget_nothing_fits() -> None:
    eager, batch = _eager_and_batch()
    least = min(c.peak for c in _planned(eager, batch).candidates)
    message = _same_error_on_every_rank(least // 2, batch)
    assert message.startswith("no layout fits memory_per_device=") and "of the 4 considered" in message, message


def check_ranks_that_plan_differently() -> None:
    import torch.distributed as dist

    eager, batch = _eager_and_batch()
    peak = {c.spec.name: c.peak for c in _planned(eager, batch).candidates}
    budget = "1GiB" if dist.get_rank() == 0 else (peak["tp2"] + peak["dp2"]) // 2  # rank 1: dp2 does not fit
    message = _same_error_on_every_rank(budget, batch)
    assert "ranked the layouts differently (rank 0: dp2, rank 1: tp2)" in message, message


def _plan_with(build):
    """``planned_mesh_transform`` with a loose budget and ``build`` in place of ``transform``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dpcompile.planned_mesh import planned_mesh_transform

    eager, batch = _eager_and_batch()
    arguments = {"data_parallel": "ddp", "memory_per_device": "1GiB", "optimizer": "adamw", "training": True,
                 "example_kwargs": None}  # fmt: skip
    return planned_mesh_transform(eager, init_device_mesh("cpu", (dist.get_world_size(),)), arguments, batch,
                                  build=build)  # fmt: skip


def check_refused_on_one_rank_is_refused_on_all() -> None:
    """A candidate one rank cannot build is skipped on every rank; the next is built on all."""
    import types

    import torch.distributed as dist

    def build(model, mesh, **options):
        if dist.get_rank() == 1 and mesh.mesh_dim_names == ("dp",):
            raise ValueError("refused here")
        return types.SimpleNamespace(mesh=mesh)

    pm = _plan_with(build)
    assert pm.mesh.mesh_dim_names == ("tp",)
    dp2, _, tp2, _ = pm.candidates  # each also with every block recomputed
    assert dp2.rejected == "predicted to fit, but could not be built: rank 1: refused here" and not dp2.fits
    assert tp2.rejected is None


def check_a_crash_on_one_rank_is_told_to_all() -> None:
    """A rank whose build crashes raises its error; the others name that rank, none waits."""
    import types

    import torch.distributed as dist

    from dpcompile.errors import DpCompileError

    def build(model, mesh, **options):
        if dist.get_rank() == 1:
            raise RuntimeError("crashed here")
        return types.SimpleNamespace(mesh=mesh)

    raised = (RuntimeError, "crashed here") if dist.get_rank() == 1 else (DpCompileError, "rank 1 failed building dp2")
    with pytest.raises(raised[0], match=raised[1]):
        _plan_with(build)


def check_refusals() -> None:
    """What plan="auto" over a mesh does not plan is refused before planning (no collective runs)."""
    from torch.distributed.device_mesh import DeviceMesh

    import dpcompile
    from dpcompile.errors import DpCompileError

    eager, batch = _eager_and_batch()
    with pytest.raises(ValueError, match="does not predict data_parallel='fsdp'"):
        _auto_with(eager, batch, data_parallel="fsdp")
    with pytest.raises(ValueError, match="one memory_per_device= for every rank"):
        _auto_with(eager, batch, memory_per_device={"cpu": "1GiB"})
    with pytest.raises(ValueError, match="leave pipeline=2 out"):
        _auto_with(eager, batch, pipeline=2)
    part = DeviceMesh("cpu", torch.tensor([0]), mesh_dim_names=("dp",))  # every rank creates it: a collective
    with pytest.raises(DpCompileError, match=r"holds ranks \[0\] of 2; pass a mesh of all of them"):
        dpcompile.transform(eager, part, plan="auto", memory_per_device="1GiB", example_inputs=batch)


def check_without_a_budget_plans_for_the_ranks_share_of_the_host() -> None:
    """No memory_per_device=: every rank plans for the least of the ranks' shares of the host's
    available memory (both ranks on this host), alike on every rank, and builds the fastest predicted."""
    import torch.distributed as dist

    from dpcompile.analysis.device_memory import host_available_bytes

    eager, batch = _eager_and_batch()
    pm = _auto_with(copy.deepcopy(eager), batch, memory_per_device=None)
    budgets = {c.budgets["rank0"] for c in pm.candidates} | {c.budgets["rank1"] for c in pm.candidates}
    assert len(budgets) == 1 and abs(budgets.pop() - host_available_bytes() // 2) < host_available_bytes() // 8
    every = [None] * WORLD
    dist.all_gather_object(every, pm.candidates[0].budgets)
    assert every == [pm.candidates[0].budgets] * WORLD  # the same budget on every rank
    assert "shared by 2 ranks" in pm.candidates[0].budget_source and "memory_per_device" in pm.strategies
    assert [c.spec.name for c in pm.candidates if c.rejected is None] == [_planned(eager, batch).fitting[0].spec.name]
    _step_equals_eager(pm, eager, batch)


def _auto_with(model, batch, **options):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    options = {"memory_per_device": "1GiB", **options}
    return dpcompile.transform(model, mesh, plan="auto", example_inputs=batch, **options)


CHECKS = [
    ("loose_budget_builds_the_fastest", check_loose_budget_builds_the_fastest),
    ("budget_only_tensor_parallel_fits", check_budget_only_tensor_parallel_fits),
    ("budget_nothing_fits", check_budget_nothing_fits),
    ("ranks_that_plan_differently", check_ranks_that_plan_differently),
    ("refused_on_one_rank_is_refused_on_all", check_refused_on_one_rank_is_refused_on_all),
    ("a_crash_on_one_rank_is_told_to_all", check_a_crash_on_one_rank_is_told_to_all),
    ("refusals", check_refusals),
    ("without_a_budget_plans_for_the_ranks_share_of_the_host", check_without_a_budget_plans_for_the_ranks_share_of_the_host),
]


def _entry(rank: int, world: int, port: int, results: mp.Queue) -> None:
    os.environ["DPCOMPILE_CALIBRATION"] = "off"  # the reference constants: every rank, every machine alike
    run_checks(rank, world, port, list(CHECKS), results)


@pytest.fixture(scope="module")
def outcomes():
    return run_spawned(_entry, WORLD, timeout=GROUP_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.parametrize("check", [name for name, _ in CHECKS])
@pytest.mark.xdist_group("planner_mesh_2")  # one spawned group, on one worker
def test_plan_auto_over_a_mesh(outcomes, check):
    """plan="auto" over 2 gloo ranks (each check named by its parameter)."""
    assert_group_passed(outcomes, WORLD, check, timeout=GROUP_TIMEOUT_S)


def test_mesh_candidates_are_the_plain_loop_layouts():
    """dp, tp and every dp x tp of the ranks; each built over a mesh of its own shape and names."""
    from dpcompile.planned_mesh import mesh_candidates, mesh_shape

    assert [s.name for s in mesh_candidates(4)] == ["dp4", "tp4", "dp2xtp2"]
    assert [s.name for s in mesh_candidates(6)] == ["dp6", "tp6", "dp2xtp3", "dp3xtp2"]
    assert [mesh_shape(s) for s in mesh_candidates(4)] == [((4,), ("dp",)), ((4,), ("tp",)), ((2, 2), ("dp", "tp"))]
    assert [s.name for s in mesh_candidates(1)] == ["dp1"]
