"""Meta models over a mesh: 2 gloo processes, data parallel, tensor parallel and save/load, equal eager."""

from __future__ import annotations

import copy
import os
import queue
import socket
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from tests.gloo_groups import rank_context

TIMEOUT_S = 90.0


class MLP(nn.Module):
    def __init__(self, d: int = 8, h: int = 12):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _checks(rank: int, world: int, folder: Path) -> None:
    """Every check, run on every rank; raises on the first failure."""
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    torch.manual_seed(0)
    eager = MLP()
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in eager.state_dict().items()}, str(folder / "model.safetensors"))
    torch.distributed.barrier()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for dim in ("dp", "tp"):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(dim,))
        with torch.device("meta"):
            model = MLP()
        plan = {"fc1": "column", "fc2": "row"} if dim == "tp" else False
        pm = dpcompile.transform(model, mesh, tensor_parallel=plan)
        assert pm.needs_weights and not any(p.is_meta for p in pm.parameters())
        if dim == "tp":  # this rank's shards only
            assert tuple(pm.fc1.weight.shape) == (12 // world, 8), pm.fc1.weight.shape
        dpcompile.load_checkpoint(pm, folder)
        reference = copy.deepcopy(eager)
        opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
        for _ in range(2):  # every rank the same batch: data parallel averages equal gradients
            out, want = pm(x), reference(x)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
            for o, loss in ((opt, out.pow(2).mean()), (ref_opt, want.pow(2).mean())):
                o.zero_grad()
                loss.backward()
                o.step()
        dpcompile.save_checkpoint(pm, folder / f"{dim}.safetensors")  # a collective over tp
        torch.distributed.barrier()
        from safetensors.torch import load_file

        saved = load_file(str(folder / f"{dim}.safetensors"))
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(saved[key], value, atol=1e-5, rtol=1e-5)


def _entry(rank: int, world: int, port: int, folder: str, results: mp.Queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    error = None
    try:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=30)
        )
        _checks(rank, world, Path(folder))
    except Exception:  # noqa: BLE001 - reported to the test
        error = traceback.format_exc()
    results.put((rank, error))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.distributed
def test_meta_model_over_a_mesh_loads_trains_and_saves_as_eager(tmp_path):
    """Data and tensor parallel over 2 gloo ranks from a meta model: load, 2 SGD steps equal eager, save gathers full tensors."""
    ctx = rank_context()
    results: mp.Queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_entry, args=(r, 2, port, str(tmp_path), results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    outcomes = {}
    try:
        while len(outcomes) < 2:
            rank, error = results.get(timeout=TIMEOUT_S)
            outcomes[rank] = error
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    assert sorted(outcomes) == [0, 1], f"ranks reported: {sorted(outcomes)} (a hang or a crash)"
    for rank, error in outcomes.items():
        assert error is None, f"rank {rank}:\n{error}"
