"""Pipeline parallelism over a gloo mesh: ``torch.distributed.pipelining`` runs dpcompile's stage
programs (``PipelineStage`` with ``ScheduleGPipe`` / ``Schedule1F1B``). The loss is the whole
batch's mean, every gradient the single-device one, on a ``("pp",)`` mesh of 2 and 4 processes
and a ``("pp", "dp")`` mesh of 4. (``torch.distributed.pipelining`` sizes its buffers from the
first micro-batch: over a mesh micro-batches are equal, an uneven batch is refused.)

Spawning is the expensive part: each process group runs a whole scenario and reports each
check's outcome (the pattern of ``test_spmd.py``).
"""

from __future__ import annotations

import copy
import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from tests.gloo_groups import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # 6 processes spawned in all
GROUP_TIMEOUT_S = 90.0


def _stack():
    from tests.integration.test_pipeline import Stack

    torch.manual_seed(0)
    return Stack(depth=4)


def _inputs(batch: int):
    g = torch.Generator().manual_seed(1)
    x, labels = torch.randn(batch, 8, generator=g), torch.randint(0, 3, (batch,), generator=g)
    labels[0] = -100  # ignored: the mean is over the others, of the whole batch
    return x, labels


class SquareMean(torch.nn.Module):
    """A loss whose count is the number of elements of an activation: found by the last stage."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x, labels):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x, (x * x).mean()


def check_pipeline(
    rank: int, world: int, shape: tuple[int, ...], names: tuple[str, ...], schedule: str, micro: int
) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.mesh import local_batch

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    reference = SquareMean() if schedule.startswith("square:") else _stack()
    schedule = schedule.removeprefix("square:")
    model = copy.deepcopy(reference)
    x, labels = _inputs(8 if "dp" not in names else 16)  # equal micro-batches: pipelining's buffers
    pm = dpcompile.transform(model, mesh, pipeline=mesh.size(0), micro_batches=micro, schedule=schedule)
    out = pm(*local_batch((x, labels), mesh))
    expected_logits, expected_loss = reference(x, labels)
    expected_loss.backward()
    pp_rank = mesh.get_local_rank("pp")
    if pp_rank == mesh.size(0) - 1:
        logits, loss = out
        torch.testing.assert_close(loss, expected_loss)
        torch.testing.assert_close(logits, local_batch(expected_logits.detach(), mesh))
    else:
        assert out is None
    mine = set(pm.module_paths)
    checked = 0
    for name, p in model.named_parameters():
        module = name.rpartition(".")[0]
        if module in mine:
            torch.testing.assert_close(
                p.grad, reference.get_parameter(name).grad, msg=lambda m, name=name: f"{name}: {m}"
            )
            checked += 1
        else:
            assert p.grad is None, f"{name} is another stage's, yet has a gradient here"
    assert checked > 0
    dist.barrier()


SCENARIOS = {
    "pp2": (2, [("gpipe_m1", ((2,), ("pp",), "gpipe", 1)), ("gpipe_m4", ((2,), ("pp",), "gpipe", 4)),
                ("1f1b_m4", ((2,), ("pp",), "1f1b", 4)), ("square_mean", ((2,), ("pp",), "square:gpipe", 2))]),
    "pp4": (4, [("gpipe_m2", ((4,), ("pp",), "gpipe", 2)), ("1f1b_m4", ((4,), ("pp",), "1f1b", 4)),
                ("pp_dp", ((2, 2), ("pp", "dp"), "1f1b", 2))]),
}  # fmt: skip


def _entry(rank: int, world: int, port: int, scenario: str, results: mp.Queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    import torch.distributed as dist

    outcome: dict[str, str | None] = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))  # fmt: skip
        for name, config in SCENARIOS[scenario][1]:
            try:
                check_pipeline(rank, world, *config)
                outcome[name] = None
            except Exception:  # noqa: BLE001 - report every check
                outcome[name] = traceback.format_exc()
    except Exception:  # noqa: BLE001
        outcome["<setup>"] = traceback.format_exc()
    results.put((rank, outcome))
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def run_group(scenario: str) -> dict[int, dict[str, str | None]]:
    return run_spawned(_entry, SCENARIOS[scenario][0], scenario, timeout=GROUP_TIMEOUT_S)


@pytest.fixture(scope="module")
def outcomes():
    return {}


def _check(outcomes: dict, scenario: str, name: str) -> None:
    if scenario not in outcomes:
        outcomes[scenario] = run_group(scenario)
    found = outcomes[scenario]
    world = SCENARIOS[scenario][0]
    missing = [r for r in range(world) if r not in found]
    assert not missing, f"ranks {missing} reported nothing within {GROUP_TIMEOUT_S} s (hang or crash)"
    errors = [
        f"rank {rank}, {check}:\n{found[rank][check]}"
        for rank in range(world)
        for check in ("<setup>", name)
        if found[rank].get(check) is not None
    ]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", ["gpipe_m1", "gpipe_m4", "1f1b_m4", "square_mean"])
def test_pipeline_mesh_two_processes_equal_eager(outcomes, name):
    """A 2-process ("pp",) mesh: loss, outputs and each stage's gradients as eager (GPipe, 1F1B;
    a loss over labels, and one whose count only the last stage finds)."""
    _check(outcomes, "pp2", name)


@pytest.mark.parametrize("name", ["gpipe_m2", "1f1b_m4", "pp_dp"])
def test_pipeline_mesh_four_processes_equal_eager(outcomes, name):
    """4 processes: a ("pp",) mesh of 4 stages, and a ("pp", "dp") mesh of 2 x 2, as eager."""
    _check(outcomes, "pp4", name)
