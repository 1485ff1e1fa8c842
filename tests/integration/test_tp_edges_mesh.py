"""The models of ``test_tp_edges`` tensor parallel over a 2-process gloo mesh, on both frontends,
real and meta: outputs, this rank's gradients, ``state_dict`` keys and values (gathered) equal
eager's, before and after one SGD step; a meta model loads the eager model's own checkpoint."""

from __future__ import annotations

import copy
import functools
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.gloo_groups import assert_group_passed, run_checks, run_spawned
from tests.integration.test_tp_edges import MODELS

GROUP_TIMEOUT_S = 300.0  # spawning, importing and the first gloo connections are slow on a loaded machine
WORLD = 2
CASES = [(name, frontend, meta) for name in MODELS if name != "head_linear" for frontend in ("fx", "export") for meta in (False, True)]  # head_linear: as head_matmul


def _case_id(name: str, frontend: str, meta: bool) -> str:
    return f"{name}-{frontend}-{'meta' if meta else 'real'}"


def _assert_state_equal(pm, eager) -> None:
    got, want = pm.state_dict(), eager.state_dict()  # a collective: every rank gathers
    assert list(got) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, msg=lambda m, key=key: f"{key}: {m}")


def check_edge_model(name: str, frontend: str, meta: bool, folder: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_model
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.runtime.tensor_parallel import shard_of

    make, example = MODELS[name]
    torch.manual_seed(0)
    eager, x = make(), example()
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    if meta:
        with torch.device("meta"):
            model = make()
    else:
        model = copy.deepcopy(eager)
    pm = dpcompile.transform(model, mesh, tensor_parallel=True, example_inputs=(x,), frontend=frontend)
    if meta:
        path = Path(folder) / _case_id(name, frontend, meta)
        if dist.get_rank() == 0:
            path.mkdir()
            save_model(eager, str(path / "model.safetensors"))  # tied keys written once, as transformers does
        dist.barrier()
        dpcompile.load_checkpoint(pm, path)
    _assert_state_equal(pm, eager)
    out, want = pm(x), eager(x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    weights = torch.linspace(0.5, 1.5, want.numel()).view(want.shape)
    (out * weights).sum().backward()
    (want * weights).sum().backward()
    rank = mesh.get_local_rank("tp")
    mine = dict(pm.named_parameters())
    for key, p in eager.named_parameters():
        expected = p.grad if key not in pm.shards else shard_of(p.grad, pm.shards[key], rank)
        torch.testing.assert_close(mine[key].grad, expected, atol=1e-5, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    for optimizer in (torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)):
        optimizer.step()
    _assert_state_equal(pm, eager)  # ties stayed ties
    dist.barrier()


def _entry(rank: int, world: int, port: int, folder: str, results: mp.Queue) -> None:
    checks = [(_case_id(*case), functools.partial(check_edge_model, *case, folder)) for case in CASES]
    run_checks(rank, world, port, checks, results)


@pytest.fixture(scope="module")
def outcomes():
    with tempfile.TemporaryDirectory() as folder:
        yield run_spawned(_entry, WORLD, folder, timeout=GROUP_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.slow  # one spawned group of 2 processes for all cases
@pytest.mark.parametrize("case", [_case_id(*case) for case in CASES])
@pytest.mark.xdist_group("tp_edges_mesh")  # one spawned group, on one worker
def test_tp_edge_model_over_a_mesh_matches_eager(outcomes, case):
    """Over 2 gloo ranks: outputs, gradients, state_dict keys and values as eager (each case by its parameter)."""
    assert_group_passed(outcomes, WORLD, case, timeout=GROUP_TIMEOUT_S)
