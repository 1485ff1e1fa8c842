"""SPMD mode over torch.distributed: gloo process groups on CPU, spawned, bounded by timeouts.

Spawning is the expensive part, so each process group runs a whole scenario of checks and
reports each check's outcome; the tests below read those outcomes (one behaviour each).
"""

from __future__ import annotations

import copy
import os
import pickle
import queue
import socket
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from dpcompile.mesh import local_batch
from tests.gloo_groups import rank_context
from tests.helpers import FakeMesh
from tests.models import OptionalScale

GROUP_TIMEOUT_S = 60.0  # a whole scenario (spawn + checks); a hang fails the test after this
FOUR_TIMEOUT_S = 240.0  # the 4-process scenario builds GPT-2 with sequence parallel on a loaded machine


# ---------------------------------------------------------------------------- models
class BNNet(nn.Module):
    """An MLP with BatchNorm: data parallel must give whole-batch statistics."""

    def __init__(self, d: int = 6, h: int = 10, out: int = 3):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.bn = nn.BatchNorm1d(h)
        self.fc2 = nn.Linear(h, out)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class RNNNet(nn.Module):
    """Calls flatten_parameters inside forward: the hoist must apply on every rank."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        self.lstm.flatten_parameters()
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class MLP(nn.Module):
    def __init__(self, d: int = 8, h: int = 12):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """A transformer-ish block of Linears: q/k/v column, out row, MLP column -> row, LayerNorm."""

    def __init__(self, d: int = 8, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.up = nn.Linear(d, 3 * d)
        self.down = nn.Linear(3 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm(x)
        q = self.q(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = self.k(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = self.v(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
        att = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.out(y)
        return x + self.down(torch.relu(self.up(x)))


# ---------------------------------------------------------------------------- harness
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, scenario: str, results: mp.Queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    import torch.distributed as dist

    outcome: dict[str, str | None] = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=20),
        )
        for name, check in SCENARIOS[scenario]:
            if name in LAST_CHECKS:  # it ends the group: report what is known first
                results.put((rank, dict(outcome)))
            try:
                check(rank, world)
                outcome[name] = None
            except Exception:  # noqa: BLE001 - report every check
                outcome[name] = traceback.format_exc()
    except Exception:  # noqa: BLE001
        outcome["<setup>"] = traceback.format_exc()
    results.put((rank, outcome))
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def run_group(scenario: str, world: int, timeout: float = GROUP_TIMEOUT_S) -> dict[int, dict[str, str | None]]:
    """Spawn ``world`` gloo processes running ``scenario``; each rank's ``{check: traceback or None}``."""
    ctx = rank_context()  # forks of a server that imported torch and dpcompile once
    results: mp.Queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, scenario, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outcomes: dict[int, dict[str, str | None]] = {}
    names = {name for name, _ in SCENARIOS[scenario]}
    expected = {r: names if r == 0 else names - LAST_CHECKS for r in range(world)}
    try:
        while not all(set(outcomes.get(r, {})) >= expected[r] or "<setup>" in outcomes.get(r, {}) for r in range(world)):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, outcome = results.get(timeout=min(left, 1.0))
                outcomes.setdefault(rank, {}).update(outcome)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        for r, p in enumerate(procs):
            if not expected[r]:  # it reports nothing (it stalls on purpose): not waited for, once the others reported
                p.kill()
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return outcomes


def _lookup(outcomes: dict[int, dict[str, str | None]], world: int, check: str) -> None:
    missing = [r for r in range(world) if r not in outcomes]
    assert not missing, f"ranks {missing} reported nothing within the timeout (hang or crash)"
    for rank in range(world):
        if "<setup>" in outcomes[rank]:
            pytest.fail(f"rank {rank} setup failed:\n{outcomes[rank]['<setup>']}")
        assert check in outcomes[rank], f"rank {rank} did not run {check}"
        error = outcomes[rank][check]
        if error is not None:
            pytest.fail(f"rank {rank}, {check}:\n{error}")


# ---------------------------------------------------------------------------- checks (run in the workers)
def _batches(world: int, d: int, per_rank: int = 3, steps: int = 3, extra: tuple[int, ...] = ()):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(per_rank * world, *extra, d, generator=g) for _ in range(steps)]


def _dp_mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))


def check_dp_training_matches_eager(rank: int, world: int) -> None:
    """DP (DDP + sync BN) over the mesh: outputs, 3 SGD steps and BN stats equal eager on the whole batch."""
    import dpcompile

    torch.manual_seed(0)
    model = BNNet()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, _dp_mesh(world))
    assert pm.mode == "spmd_data_parallel"
    data = _batches(world, 6)
    per = data[0].size(0) // world
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x in data:
        local = x[rank * per : (rank + 1) * per]
        opt.zero_grad()
        out = pm(local)
        (out**2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        want = reference(x)
        (want**2).mean().backward()
        ref_opt.step()
        torch.testing.assert_close(out, want[rank * per : (rank + 1) * per], atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.bn.running_var, reference.bn.running_var, atol=1e-5, rtol=1e-5)
    pm.eval()
    reference.eval()
    torch.testing.assert_close(pm(data[0][:2]), reference(data[0][:2]), atol=1e-5, rtol=1e-5)


def check_dp_state_dict_and_code(rank: int, world: int) -> None:
    """DP: state_dict keys are the model's; the code names sync_batch_norm over dp_group; no_sync works."""
    import dpcompile

    torch.manual_seed(0)
    model = BNNet()
    pm = dpcompile.transform(model, _dp_mesh(world))
    assert type(pm).__mro__[1] is dpcompile.ParallelModule and pm.executor == "plain"  # one module kind, over a mesh too
    assert list(pm.state_dict().keys()) == list(model.state_dict().keys())
    assert "sync_batch_norm" in pm.code and "dp_group" in pm.code, pm.code
    assert pm.ddp is not None
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(pm)
    pm.load_state_dict(model.state_dict())
    x = torch.randn(4, 6) * (rank + 1)
    with pm.no_sync():
        pm(x).sum().backward()
    local = model.fc2.weight.grad.clone()
    gathered = [torch.empty_like(local) for _ in range(world)]
    torch.distributed.all_gather(gathered, local)
    assert not all(torch.allclose(gathered[0], g) for g in gathered[1:]), "no_sync still averaged gradients"


def check_dp_rnn_flatten_hoisted(rank: int, world: int) -> None:
    """DP: flatten_parameters called in forward is hoisted to the head of forward on every rank."""
    import dpcompile

    torch.manual_seed(0)
    model = RNNNet()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, _dp_mesh(world))
    body = [line.strip() for line in pm.code.splitlines() if "=" in line]
    assert "flatten_parameters" in body[1], pm.code
    assert pm.code.count("flatten_parameters(") == 1, pm.code
    x = torch.randn(4, 3, 4)
    torch.testing.assert_close(pm(x), reference(x), atol=1e-5, rtol=1e-5)


class WithUnusedHead(nn.Module):
    """``spare`` is never called: DDP must not wait for its gradients."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


def check_dp_unused_parameters_ignored(rank: int, world: int) -> None:
    """DP: parameters forward never reads are known from the graph; three steps train without DDP errors."""
    import dpcompile
    from dpcompile.modules.spmd import unused_parameters

    torch.manual_seed(0)
    model = WithUnusedHead()
    pm = dpcompile.transform(model, _dp_mesh(world))
    assert unused_parameters(pm) == ["spare.weight", "spare.bias"]
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        pm(torch.randn(2, 4)).sum().backward()
        opt.step()
    assert model.spare.weight.grad is None and model.fc.weight.grad is not None


def check_dp_explain_counts_ddp_and_sync_bn(rank: int, world: int) -> None:
    """DP explain: sync BN moves its 2C+1 statistics, and DDP's gradient all-reduce is counted in backward."""
    import dpcompile

    torch.manual_seed(0)
    pm = dpcompile.transform(BNNet(), _dp_mesh(world))
    report = dpcompile.explain(pm, torch.randn(4, 6))
    sizes = {c.name: (c.elements, c.forward, c.backward) for c in report.collectives}
    ring = 2 * (world - 1) / world
    assert sizes["bn_sync"] == (21, ring * 21, ring * 21), sizes  # 10 channels: sums + count, then variances
    params = sum(p.numel() for p in pm.parameters())
    assert sizes["ddp_gradients"] == (params, 0.0, ring * params), sizes
    assert report.comm_elements_forward == ring * 21
    assert report.comm_elements_backward == ring * (21 + params)


def check_dp_ranks_calling_differently_named(rank: int, world: int) -> None:
    """DP over a mesh: uneven batches run; ranks passing different dtypes, or an argument on one
    rank only, get a ValueError on every rank naming the input (not a crash on one rank and a
    hang in DDP's all-reduce on the others); the group works on afterwards."""
    import dpcompile

    torch.manual_seed(0)
    model = OptionalScale()
    pm = dpcompile.transform(model, _dp_mesh(world))
    x = torch.randn(5, 8)
    mine = x[:3] if rank == 0 else x[3:]  # uneven: 3 rows and 2
    torch.testing.assert_close(pm(mine), model(mine))
    with pytest.raises(ValueError, match=r"input 'x' differs \(global rank 0: 2-d float32; global rank 1: 2-d float64\)"):
        pm(mine if rank == 0 else mine.double())
    scale = torch.full((len(mine), 8), 2.0)
    with pytest.raises(ValueError, match=r"input 'scale' differs \(global rank 0: 2-d float32; global rank 1: None\)"):
        pm(mine, scale if rank == 0 else None)
    torch.testing.assert_close(pm(mine, scale), model(mine, scale))


def check_dp_verify_of_batch_norm(rank: int, world: int) -> None:
    """verify of BatchNorm in training over a dp mesh, the same batch on every rank: the synchronised
    statistics count it once per rank, so the running variance expected is the unbiased variance of
    world x rows (before, a correct program was reported as a mismatch); a wrong buffer is still found."""
    import dpcompile

    for momentum in (0.1, None):
        torch.manual_seed(0)
        model = BNNet()
        model.bn.momentum = momentum
        reference = copy.deepcopy(model)
        pm = dpcompile.transform(model, _dp_mesh(world))
        x = torch.randn(6, 6)
        result = dpcompile.verify(pm, reference, x)
        assert result and result.checked["buffers"] == 3, str(result)
        assert "once per dp rank" in " ".join(result.notes), result.notes
        if momentum is not None:  # (a cumulative average's first step forgets the value before)
            with torch.no_grad():
                pm.bn.running_mean += 1.0
            result = dpcompile.verify(pm, reference, x)
            assert not result and [m.name for m in result.mismatches] == ["bn.running_mean"], str(result)


DP_CHECKS = [
    ("dp_verify_of_batch_norm", check_dp_verify_of_batch_norm),
    ("dp_ranks_calling_differently_named", check_dp_ranks_calling_differently_named),
    ("dp_training_matches_eager", check_dp_training_matches_eager),
    ("dp_state_dict_and_code", check_dp_state_dict_and_code),
    ("dp_rnn_flatten_hoisted", check_dp_rnn_flatten_hoisted),
    ("dp_unused_parameters_ignored", check_dp_unused_parameters_ignored),
    ("dp_explain_counts_ddp_and_sync_bn", check_dp_explain_counts_ddp_and_sync_bn),
]


def _tp_mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))


def _train_both(pm, reference, inputs, local=lambda x: x, lr: float = 0.1):
    """Three SGD steps of ``pm`` (on ``local(x)``) and of ``reference`` (on ``x``); the outputs."""
    opt = torch.optim.SGD(pm.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    for x in inputs:
        opt.zero_grad()
        ref_opt.zero_grad()
        out = pm(local(x))
        want = reference(x)
        (out**2).mean().backward()
        (want**2).mean().backward()
        opt.step()
        ref_opt.step()
        torch.testing.assert_close(out, local(want), atol=1e-5, rtol=1e-5)


def _assert_state_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want), f"keys differ: {sorted(set(got) ^ set(want))}"
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


def check_tp_mlp_training_matches_eager(rank: int, world: int) -> None:
    """TP column->row MLP: each rank holds shards, the code names all_reduce, 3 steps equal eager."""
    import dpcompile

    torch.manual_seed(0)
    model = MLP(8, 12)
    reference = copy.deepcopy(model)
    before = copy.deepcopy(model.state_dict())
    pm = dpcompile.transform(model, _tp_mesh(world), tensor_parallel={"fc1": "column", "fc2": "row"})
    assert pm.mode == "spmd_tensor_parallel"
    assert pm.plan == {"fc1": "column", "fc2": "row"}
    assert tuple(pm.fc1.weight.shape) == (12 // world, 8) and tuple(pm.fc2.weight.shape) == (8, 12 // world)
    assert "all_reduce(" in pm.code and "tp_group" in pm.code, pm.code
    assert "all_gather" not in pm.code, pm.code
    _train_both(pm, reference, _batches(1, 8, per_rank=4))
    _assert_state_equal(pm.state_dict(), reference.state_dict())
    _assert_state_equal(model.state_dict(), before)  # the user's model is left unchanged


def check_tp_progress_on_rank_0_only(rank: int, world: int) -> None:
    """transform(progress=None) over a mesh with stderr a terminal: rank 0 draws the stage bars, the
    others nothing; the program equals eager."""
    import io
    import sys

    import dpcompile

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    torch.manual_seed(0)
    model = MLP(8, 12)
    old, sys.stderr = sys.stderr, Terminal()
    try:
        pm = dpcompile.transform(model, _tp_mesh(world), tensor_parallel={"fc1": "column", "fc2": "row"})
        written = sys.stderr.getvalue()
    finally:
        sys.stderr = old
    assert ("Running passes: 100%" in written) == (rank == 0), written
    x = torch.randn(4, 8)
    torch.testing.assert_close(pm(x), model(x))


def check_tp_uneven_gather(rank: int, world: int) -> None:
    """TP with uneven shards (7 features over 2) and an all_gather of a column output."""
    import dpcompile

    torch.manual_seed(0)
    model = MLP(8, 7)
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, _tp_mesh(world), tensor_parallel={"fc1": "column"})
    assert "all_gather(" in pm.code, pm.code
    _train_both(pm, reference, _batches(1, 8, per_rank=4))
    _assert_state_equal(pm.state_dict(), reference.state_dict())


def check_tp_block_attention(rank: int, world: int) -> None:
    """TP transformer block (q/k/v column, out row, MLP column->row, LayerNorm): 3 steps equal eager."""
    import dpcompile

    torch.manual_seed(0)
    model = Block()
    reference = copy.deepcopy(model)
    plan = {"q": "column", "k": "column", "v": "column", "out": "row", "up": "column", "down": "row"}
    x0 = torch.randn(2, 3, 8)
    pm = dpcompile.transform(model, _tp_mesh(world), tensor_parallel=plan, example_inputs=(x0,))
    assert pm.plan == plan, pm.plan_reasons
    assert "local_size(" in pm.code and "all_gather(" not in pm.code, pm.code  # heads sharded, Megatron pairs
    _train_both(pm, reference, _batches(1, 8, per_rank=2, extra=(3,)))
    _assert_state_equal(pm.state_dict(), reference.state_dict())


def check_tp_state_dict_round_trip(rank: int, world: int) -> None:
    """TP: state_dict() has the model's keys and full tensors; load_state_dict() re-shards."""
    import dpcompile

    torch.manual_seed(0)
    model = MLP(8, 12)
    pm = dpcompile.transform(model, _tp_mesh(world), tensor_parallel={"fc1": "column", "fc2": "row"})
    _assert_state_equal(pm.state_dict(), model.state_dict())
    other = MLP(8, 12)  # different weights (the seed has moved on)
    pm.load_state_dict(other.state_dict())
    assert tuple(pm.fc1.weight.shape) == (12 // world, 8)
    _assert_state_equal(pm.state_dict(), other.state_dict())
    x = torch.randn(3, 8)
    torch.testing.assert_close(pm(x), other(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="shards"):
        pm.load_state_dict(MLP(8, 10).state_dict())
    torch.manual_seed(rank)  # ranks that initialise differently still shard tp rank 0's model
    mine = MLP(8, 12)
    pm = dpcompile.transform(mine, _tp_mesh(world), tensor_parallel={"fc1": "column", "fc2": "row"})
    torch.manual_seed(0)
    _assert_state_equal(pm.state_dict(), MLP(8, 12).state_dict())


def check_tp_automatic_plan(rank: int, world: int) -> None:
    """tensor_parallel=True over a mesh: the automatic plan pairs column -> row, outputs equal eager."""
    import dpcompile

    torch.manual_seed(0)
    model = MLP(8, 12)
    pm = dpcompile.transform(model, _tp_mesh(world), tensor_parallel=True, example_inputs=(torch.randn(4, 8),))
    assert pm.plan == {"fc1": "column", "fc2": "row"}, pm.plan
    x = torch.randn(4, 8)
    torch.testing.assert_close(pm(x), model(x), atol=1e-5, rtol=1e-5)


def check_tp_parent_load_state_dict(rank: int, world: int) -> None:
    """TP: a module holding pm loads a full state_dict through nn.Module's recursion; each rank keeps its shard."""
    import dpcompile

    torch.manual_seed(0)
    pm = dpcompile.transform(MLP(8, 12), _tp_mesh(world), tensor_parallel={"fc1": "column", "fc2": "row"})
    parent = nn.Sequential(pm, nn.Linear(8, 2))
    reference = nn.Sequential(MLP(8, 12), nn.Linear(8, 2))  # other weights (the seed has moved on)
    result = parent.load_state_dict(reference.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert tuple(pm.fc1.weight.shape) == (12 // world, 8)
    x = torch.randn(3, 8)
    torch.testing.assert_close(parent(x), reference(x), atol=1e-5, rtol=1e-5)


def check_optional_argument_left_none(rank: int, world: int) -> None:
    """DP and TP over a mesh: pm(x) and pm(x, scale=s) both equal eager, and the None path trains."""
    import dpcompile

    torch.manual_seed(0)
    x, scale = torch.randn(4, 8), torch.full((8,), 2.0)
    for mesh, plan in ((_tp_mesh(world), {"fc1": "column", "fc2": "row"}), (_dp_mesh(world), False)):
        model = OptionalScale()
        reference = copy.deepcopy(model)
        pm = dpcompile.transform(model, mesh, tensor_parallel=plan)
        torch.testing.assert_close(pm(x, scale=scale), reference(x, scale=scale), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pm(x), reference(x), atol=1e-5, rtol=1e-5)
        _train_both(pm, reference, [x, x])
        _assert_state_equal(pm.state_dict(), reference.state_dict())


def check_departures_over_a_mesh(rank: int, world: int) -> None:
    """DP and TP over a mesh, as in one process (tests/modules/test_program_cache.py): pm.eval() turns
    F.dropout(x, p, self.training) off, an argument left None and a flag value run their own programs."""
    import dpcompile
    from tests.models import Departures

    torch.manual_seed(0)
    x, scale = torch.randn(4, 8), torch.tensor(3.0)
    for mesh, plan in ((_tp_mesh(world), {"fc1": "column", "fc2": "row"}), (_dp_mesh(world), False)):
        model = Departures()
        reference = copy.deepcopy(model).eval()
        pm = dpcompile.transform(model, mesh, tensor_parallel=plan)
        local = x if plan else local_batch(x, mesh)
        want = reference(x) if plan else local_batch(reference(x), mesh)
        assert not torch.allclose(pm(local), want)  # training mode: dropout on
        pm.eval()
        torch.testing.assert_close(pm(local), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pm(local, scale), want * scale, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pm(local, None, True), want * 2, atol=1e-5, rtol=1e-5)


class HalfLoss(nn.Module):
    """Returns a loss (cross entropy, MSE or NLL), an int64 argmax and a bool mask."""

    def __init__(self, kind: str):
        super().__init__()
        self.fc1, self.fc2, self.kind = nn.Linear(8, 16), nn.Linear(16, 4), kind

    def forward(self, x, y):
        out = self.fc2(torch.relu(self.fc1(x)))
        if self.kind == "cross_entropy":
            loss = F.cross_entropy(out, y)
        elif self.kind == "mse":
            loss = F.mse_loss(out, F.one_hot(y, 4).to(out.dtype))
        else:
            loss = F.nll_loss(F.log_softmax(out, -1), y)
        return loss, out.argmax(-1), out > 0


def check_half_precision_losses_over_a_mesh(rank: int, world: int) -> None:
    """DP and TP over a mesh, float16 and bfloat16 models: each loss, the argmax and the mask keep
    eager's dtype and shape (TP: eager's values too; DP: each rank's own batch)."""
    import dpcompile

    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    for dtype in (torch.float16, torch.bfloat16):
        for kind in ("cross_entropy", "mse", "nll"):
            for mesh, plan in ((_tp_mesh(world), {"fc1": "column", "fc2": "row"}), (_dp_mesh(world), False)):
                torch.manual_seed(0)
                model = HalfLoss(kind).to(dtype)
                reference = copy.deepcopy(model)
                pm = dpcompile.transform(model, mesh, tensor_parallel=plan)
                args = (x.to(dtype), y) if plan else (local_batch(x.to(dtype), mesh), local_batch(y, mesh))
                got, want = pm(*args), reference(*args)
                for g, w in zip(got, want):
                    assert (g.dtype, g.shape) == (w.dtype, w.shape), (kind, dtype, g.dtype, w.dtype, g.shape, w.shape)
                if plan:
                    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)


def check_tp_plan_checked_against_the_model(rank: int, world: int) -> None:
    """TP over a mesh: a plan naming an unused Linear keeps it whole with the reason; bad plans raise ValueError."""
    import dpcompile

    torch.manual_seed(0)
    model = WithUnusedHead()
    pm = dpcompile.transform(model, _tp_mesh(world), tensor_parallel={"fc": "column", "spare": "row"})
    assert pm.plan["fc"] == "column" and pm.plan.get("spare", "replicate") == "replicate", pm.plan
    assert "not called in forward" in pm.plan_reasons["spare"]
    assert list(pm.state_dict()) == list(model.state_dict())
    for plan, message in (({"nope": "row"}, "'fc', 'spare'"), ({"fc": "diagonal"}, "valid styles")):
        with pytest.raises(ValueError, match=message):
            dpcompile.transform(model, _tp_mesh(world), tensor_parallel=plan)


def check_tp_different_batch_sizes_named(rank: int, world: int) -> None:
    """TP over a mesh, ranks feeding different batch sizes: ValueError on every rank naming the
    input and each rank's shape (not an abort inside gloo); the group works on afterwards."""
    import dpcompile

    torch.manual_seed(0)
    model = MLP(8, 12)
    pm = dpcompile.transform(model, _tp_mesh(world), tensor_parallel={"fc1": "column", "fc2": "row"})
    x = torch.randn(4, 8)
    torch.testing.assert_close(pm(x), model(x), atol=1e-5, rtol=1e-5)
    mine = x[: 4 - rank]  # rank 0: 4 rows, rank 1: 3
    with pytest.raises(ValueError, match=r"input 'x' differs") as raised:
        pm(mine)
    text = str(raised.value)
    assert "global rank 0: shape (4, 8)" in text and "global rank 1: shape (3, 8)" in text, text
    with pytest.raises(ValueError, match="input 'x' differs"):  # the same again (not a cached pass)
        pm(mine)
    with pytest.raises(ValueError, match=r"input 'x' differs \(global rank 0: shape \(4, 8\) float32; global rank 1: shape \(4, 8\) float64\)"):
        pm(x if rank == 0 else x.double())
    torch.testing.assert_close(pm(x[:3]), model(x[:3]), atol=1e-5, rtol=1e-5)  # same shapes again: runs


def check_tp_rank_failing_before_a_collective_named(rank: int, world: int) -> None:
    """TP over a mesh: rank 1 feeds an input its first layer cannot take (it fails before any
    collective, while the input check runs beside it): every rank raises the check's ValueError
    naming the input, none hangs; the group works on afterwards."""
    import dpcompile

    torch.manual_seed(0)
    model = MLP(8, 12)
    pm = dpcompile.transform(model, _tp_mesh(world), tensor_parallel={"fc1": "column", "fc2": "row"})
    x = torch.randn(4, 8)
    torch.testing.assert_close(pm(x), model(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"input 'x' differs \(global rank 0: shape \(4, 8\) float32; global rank 1: shape \(4, 7\)"):
        pm(x if rank == 0 else x[:, :7])
    torch.testing.assert_close(pm(x), model(x), atol=1e-5, rtol=1e-5)


class ReservedNames(nn.Module):
    """Submodules and a parameter named like the module's own attributes."""

    def __init__(self):
        super().__init__()
        self.devices, self.plan = nn.Linear(8, 12), nn.Linear(12, 8)
        self.mode = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.plan(F.gelu(self.devices(x))) * self.mode


def check_reserved_names_over_a_mesh(rank: int, world: int) -> None:
    """A model with submodules named devices/plan and a parameter named mode: TP and DP over a
    mesh equal eager, keep the model's state keys, and pm.devices/pm.plan/pm.mode stay pm's."""
    import dpcompile

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    for mesh, plan in ((_tp_mesh(world), {"devices": "column", "plan": "row"}), (_dp_mesh(world), False)):
        model = ReservedNames()
        reference = copy.deepcopy(model)
        pm = dpcompile.transform(model, mesh, tensor_parallel=plan)
        assert isinstance(pm.mode, str) and isinstance(pm.plan, dict), (pm.mode, pm.plan)
        if plan:
            assert pm.plan == plan and set(pm.shards) == {"devices.weight", "devices.bias", "plan.weight"}, pm.shards
        torch.testing.assert_close(pm(x), reference(x), atol=1e-5, rtol=1e-5)
        _train_both(pm, reference, [x, x])
        _assert_state_equal(pm.state_dict(), reference.state_dict())


def check_tp_transformer_layouts(rank: int, world: int) -> None:
    """GPT-2-style LM over a mesh: Conv1D, fused qkv per section, vocab-parallel embedding with its
    tied head (one parameter), 2 all-reduces per block; 3 steps and the state dict equal eager."""
    import dpcompile
    from tests.thirdparty_tp import TinyGPT2

    torch.manual_seed(0)
    model = TinyGPT2(vocab=64, d=16, heads=4, layers=2, positions=8)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 8))
    pm = dpcompile.transform(model, _tp_mesh(world), tensor_parallel=True, example_inputs=(ids,))
    assert pm.plan["h.0.attn.c_attn"] == "column" and pm.plan["wte"] == "vocab" and pm.plan["lm_head"] == "column", pm.plan
    assert pm.wte.weight is pm.lm_head.weight and tuple(pm.wte.weight.shape) == (64 // world, 16)
    assert "local_offset" in pm.code and "masked_embedding" in pm.code, pm.code
    assert pm.code.count("all_reduce(") == 2 * 2 + 2, pm.code  # two per block, one per embedding
    _train_both(pm, reference, [ids] * 3)
    _assert_state_equal(pm.state_dict(), reference.state_dict())

    from tests.thirdparty_tp import TinyGPT2WithLoss

    torch.manual_seed(0)
    lm = TinyGPT2WithLoss(vocab=64, d=16, heads=4, layers=1, positions=8)
    reference = copy.deepcopy(lm)
    pm = dpcompile.transform(lm, _tp_mesh(world), tensor_parallel=True, example_inputs=(ids, ids))
    assert "all_gather(" in pm.code and "shard_target_logit" in pm.code, pm.code  # logsumexp gathered, logits never
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        loss, want = pm(ids, ids), reference(ids, ids)
        torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
        for o, value in ((opt, loss), (ref_opt, want)):
            o.zero_grad()
            value.backward()
            o.step()
    _assert_state_equal(pm.state_dict(), reference.state_dict())


def check_tp_multihead_attention(rank: int, world: int) -> None:
    """nn.MultiheadAttention over a mesh: written out, in_proj per section and out_proj row; 3 steps equal eager."""
    import dpcompile

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(16)
            self.attn = nn.MultiheadAttention(16, 4, batch_first=True)

        def forward(self, x):
            h = self.ln(x)
            return x + self.attn(h, h, h, need_weights=False)[0]

    torch.manual_seed(0)
    model = Block()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 5, 16)
    pm = dpcompile.transform(model, _tp_mesh(world), tensor_parallel=True, example_inputs=(x,))
    assert pm.plan == {"attn": "column", "attn.out_proj": "row"}, pm.plan
    assert pm.code.count("all_reduce(") == 1 and "all_gather" not in pm.code, pm.code
    _train_both(pm, reference, [x] * 3)
    _assert_state_equal(pm.state_dict(), reference.state_dict())


def check_tp_swin_window_attention(rank: int, world: int) -> None:
    """torchvision Swin over a mesh: window attention by heads, MLPs column->row; 2 steps and the state dict equal eager."""
    import dpcompile
    from tests.thirdparty_tp import import_vision

    import_vision()
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2], num_heads=[2], window_size=[4, 4],
                                               num_classes=4, stochastic_depth_prob=0.0)  # fmt: skip
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 16, 16)
    pm = dpcompile.transform(model, _tp_mesh(world), tensor_parallel=True, example_inputs=(x,))
    assert pm.plan["features.1.0.attn"] == "column", pm.plan  # by heads: this rank's q, k, v rows and proj columns
    assert tuple(pm.features[1][0].attn.qkv.weight.shape) == (3 * 16 // world, 16), (pm.plan, list(pm.shards), [(n, tuple(p.shape)) for n, p in pm.named_parameters()][:12])
    assert "window_attention_shard" in pm.code and "local_offset" in pm.code, pm.code
    _train_both(pm, reference, [x] * 2)
    _assert_state_equal(pm.state_dict(), reference.state_dict())


def check_tp_llama_over_a_mesh(rank: int, world: int) -> None:
    """transformers' Llama (rotary embeddings, grouped-query attention, tied LM head, loss in the
    model) through the export frontend over a mesh, Megatron's plan: two all-reduces per block, one
    for the embedding, the loss's target logit all-reduced and its logsumexp gathered (never the
    logits); 3 SGD steps and the state dict equal eager."""
    from tests.thirdparty import define_torchvision_ops

    define_torchvision_ops()
    import transformers as T

    import dpcompile

    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                                             max_position_embeddings=16, use_cache=False, tie_word_embeddings=True))  # fmt: skip
    reference = copy.deepcopy(model)
    plan = {"model.embed_tokens": "vocab", "lm_head": "column"}
    for i in range(2):
        layer = f"model.layers.{i}"
        plan.update({f"{layer}.self_attn.{p}": "column" for p in ("q_proj", "k_proj", "v_proj")})
        plan.update({f"{layer}.mlp.{p}": "column" for p in ("gate_proj", "up_proj")})
        plan.update({f"{layer}.self_attn.o_proj": "row", f"{layer}.mlp.down_proj": "row"})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(model, _tp_mesh(world), tensor_parallel=plan, example_kwargs={"input_ids": ids, "labels": ids})
    assert {pm.plan[p] for p in plan} <= {"column", "row", "vocab"}, pm.plan
    assert pm.code.count("all_reduce(") == 2 * 2 + 1 + 1, pm.code
    assert pm.code.count("all_gather(") == 2, pm.code  # the loss's logsumexp, the returned logits
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        loss, want = pm(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
        for o, value in ((opt, loss), (ref_opt, want)):
            o.zero_grad()
            value.backward()
            o.step()
    _assert_state_equal(pm.state_dict(), reference.state_dict())


def check_mesh_dimension_names_turn_strategies_on(rank: int, world: int) -> None:
    """A DeviceMesh's dimension names turn their strategies on, as mesh= over a device list does: a
    ("tp",) mesh shards without tensor_parallel=, a ("pp",) mesh cuts stages without pipeline= (both
    ran data parallel before: a BatchNorm's running variance then counted the batch once per rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    torch.manual_seed(0)
    model = MLP(8, 12)
    pm = dpcompile.transform(copy.deepcopy(model), _tp_mesh(world))
    assert pm.mode == "spmd_tensor_parallel" and tuple(pm.fc1.weight.shape) == (12 // world, 8), pm.mode
    x = torch.randn(4, 8)
    torch.testing.assert_close(pm(x), model(x))
    torch.manual_seed(0)
    model = BNNet()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, init_device_mesh("cpu", (world,), mesh_dim_names=("pp",)))
    assert pm.mode == "spmd_pipeline", pm.mode
    x = torch.randn(6, 6)
    pm(x)
    reference(x)
    _assert_state_equal(pm.state_dict(), reference.state_dict())


TP_CHECKS = [
    ("mesh_dimension_names_turn_strategies_on", check_mesh_dimension_names_turn_strategies_on),
    ("tp_different_batch_sizes_named", check_tp_different_batch_sizes_named),
    ("tp_rank_failing_before_a_collective_named", check_tp_rank_failing_before_a_collective_named),
    ("reserved_names_over_a_mesh", check_reserved_names_over_a_mesh),
    ("tp_transformer_layouts", check_tp_transformer_layouts),
    ("tp_swin_window_attention", check_tp_swin_window_attention),
    ("tp_multihead_attention", check_tp_multihead_attention),
    ("tp_mlp_training_matches_eager", check_tp_mlp_training_matches_eager),
    ("tp_progress_on_rank_0_only", check_tp_progress_on_rank_0_only),
    ("tp_uneven_gather", check_tp_uneven_gather),
    ("tp_block_attention", check_tp_block_attention),
    ("tp_state_dict_round_trip", check_tp_state_dict_round_trip),
    ("tp_automatic_plan", check_tp_automatic_plan),
    ("tp_parent_load_state_dict", check_tp_parent_load_state_dict),
    ("optional_argument_left_none", check_optional_argument_left_none),
    ("half_precision_losses_over_a_mesh", check_half_precision_losses_over_a_mesh),
    ("departures_over_a_mesh", check_departures_over_a_mesh),
    ("tp_plan_checked_against_the_model", check_tp_plan_checked_against_the_model),
]


def check_2d_training_matches_eager(rank: int, world: int) -> None:
    """2x2 ("dp", "tp") mesh: TP inside each dp group, DDP across; 3 steps equal eager on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = MLP(8, 12)
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, mesh, tensor_parallel={"fc1": "column", "fc2": "row"})
    assert pm.mode == "spmd_2d" and pm.ddp is not None

    dp, dp_size = mesh.get_local_rank("dp"), mesh.size(0)
    inputs = _batches(dp_size, 8, per_rank=2)
    per = inputs[0].size(0) // dp_size
    torch.testing.assert_close(local_batch(inputs[0], mesh), inputs[0][dp * per : (dp + 1) * per])
    _train_both(pm, reference, inputs, local=lambda t: local_batch(t, mesh))
    _assert_state_equal(pm.state_dict(), reference.state_dict())


def _two_adamw_steps(pm, eager, mesh, loss_of, *, tolerance: dict) -> None:
    """Two AdamW steps of ``pm`` on this dp rank's rows and of ``eager`` on the whole batch: outputs
    (this rank's rows) and the loss (averaged over dp) at each step, the parameters after both."""
    import torch.distributed as dist

    opts = torch.optim.AdamW(pm.parameters(), lr=0.01), torch.optim.AdamW(eager.parameters(), lr=0.01)
    for step in range(2):
        torch.manual_seed(step)  # dropout draws the single-device values on every rank
        got, got_loss = loss_of(pm, step, lambda t: local_batch(t, mesh))
        torch.manual_seed(step)
        want, want_loss = loss_of(eager, step, lambda t: t)
        torch.testing.assert_close(got, local_batch(want, mesh), **(tolerance if step else {}))
        mean = got_loss.detach().clone()
        dist.all_reduce(mean, group=mesh.get_group("dp"))
        torch.testing.assert_close(mean / mesh.size(0), want_loss.detach(), **tolerance)
        got_loss.backward()
        want_loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    got_state, want_state = pm.state_dict(), eager.state_dict()  # a collective: the tp shards gathered
    for key, value in want_state.items():
        torch.testing.assert_close(got_state[key], value, **tolerance, msg=lambda m, key=key: f"{key}: {m}")


def check_2d_sequence_parallel_stack(rank: int, world: int) -> None:
    """sequence_parallel=True over a 2x2 ("dp", "tp") mesh: the sequence-parallel test file's Stack
    (float64, dropout drawn exactly) on 13 tokens (7 and 6 per tp rank), cross-entropy against labels,
    under DDP and under FSDP: outputs, the loss and the parameters after 2 AdamW steps equal eager's."""
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from tests.integration.test_sequence_parallel import Stack, V, _ids

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    labels = _ids(13, seed=7) % V

    def loss_of(m, step, local):
        logits = m(local(_ids(13, seed=step + 1)))
        return logits, F.cross_entropy(logits.flatten(0, 1), local(labels).flatten())

    for data_parallel in ("ddp", "fsdp"):
        torch.manual_seed(0)
        model = Stack().double().train()
        eager = copy.deepcopy(model)
        pm = dpcompile.transform(model, mesh, tensor_parallel=True, sequence_parallel=True,
                                 example_inputs=(local_batch(_ids(13), mesh),), data_parallel=data_parallel)  # fmt: skip
        assert pm.mode == "spmd_2d" and (pm.ddp if data_parallel == "ddp" else pm.fsdp) is not None
        assert pm.strategies["tp"] == "tensor parallel with sequence parallel", pm.strategies
        assert pm.code.count("reduce_scatter_by_all_reduce(") == 5 and pm.code.count("all_gather_sequence(") == 5
        _two_adamw_steps(pm, eager, mesh, loss_of=loss_of, tolerance={})


def check_2d_sequence_parallel_gpt2(rank: int, world: int) -> None:
    """A 1-layer GPT-2 with labels= (dropout drawn exactly), 4 rows of 13 tokens, sequence parallel over
    a 2x2 ("dp", "tp") mesh: as check_2d_sequence_parallel_stack. transformers computes the loss in
    float32, so each dp rank's mean rounds apart from the whole batch's, and AdamW carries that into
    the parameters (2e-6 seen): the loss, the second step's logits and the parameters to 1e-5."""
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from tests.integration.test_sequence_parallel import V, _transformers_model

    def inputs(seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        return {"input_ids": torch.randint(1, V, (4, 13), generator=g), "labels": torch.randint(0, V, (4, 13), generator=g)}

    def loss_of(m, step, local):
        out = m(**local(inputs(step + 1)))
        return out.logits, out.loss

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = _transformers_model("gpt2", layers=1).double().train()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, mesh, tensor_parallel=True, sequence_parallel=True,
                             example_kwargs=local_batch(inputs(0), mesh))  # fmt: skip
    assert pm.code.count("reduce_scatter_by_all_reduce(") == 4 and pm.code.count("all_gather_sequence(") == 3
    _two_adamw_steps(pm, eager, mesh, loss_of=loss_of, tolerance={"atol": 1e-5, "rtol": 1e-5})


FOUR_CHECKS = [
    ("dp4_training_matches_eager", check_dp_training_matches_eager),
    ("2d_training_matches_eager", check_2d_training_matches_eager),
    ("2d_sequence_parallel_stack", check_2d_sequence_parallel_stack),
    ("2d_sequence_parallel_gpt2", check_2d_sequence_parallel_gpt2),
]


def check_rank_failure_is_reported(rank: int, world: int) -> None:
    """Rank 1 exits (as a torchrun worker that raised); rank 0 fails fast with a clear CollectiveError."""
    import dpcompile
    from dpcompile.runtime.distributed import CollectiveError

    torch.manual_seed(0)
    tp = dpcompile.transform(MLP(8, 12), _tp_mesh(world), tensor_parallel={"fc1": "column", "fc2": "row"})
    dp = dpcompile.transform(BNNet(), _dp_mesh(world))
    if rank != 0:
        os._exit(3)
    for name, run in (("tensor parallel", lambda: tp(torch.randn(4, 8))), ("data parallel", lambda: dp(torch.randn(4, 6)).sum().backward())):
        start = time.monotonic()
        with pytest.raises(CollectiveError, match="another rank most likely raised, exited or timed out"):
            run()
        assert time.monotonic() - start < 25, f"{name}: took {time.monotonic() - start:.1f}s to fail"
    for name, mesh, plan in (("tensor parallel", _tp_mesh, {"fc1": "column"}), ("data parallel", _dp_mesh, False)):
        start = time.monotonic()  # transform itself is collective (parameters broadcast from rank 0)
        with pytest.raises(CollectiveError, match="another rank most likely raised, exited or timed out"):
            dpcompile.transform(MLP(8, 12), mesh(world), tensor_parallel=plan)
        assert time.monotonic() - start < 25, f"transform, {name}: took {time.monotonic() - start:.1f}s to fail"


def check_rank_that_never_calls_forward(rank: int, world: int) -> None:
    """TP and DP over a mesh: rank 1 never calls forward; rank 0 fails within pm.check_inputs_timeout
    with an error that says how to bound the wait, not after gloo's 30 minutes."""
    import dpcompile
    from dpcompile.runtime.distributed import CollectiveError

    torch.manual_seed(0)
    tp = dpcompile.transform(MLP(8, 12), _tp_mesh(world), tensor_parallel={"fc1": "column", "fc2": "row"})
    dp = dpcompile.transform(BNNet(), _dp_mesh(world))  # transform is collective: built on every rank first
    assert tp.check_inputs_timeout == dp.check_inputs_timeout == 300.0  # the bounded default
    if rank != 0:
        time.sleep(12)  # alive, but never calls forward
        os._exit(0)
    for pm, x, kind in ((tp, torch.randn(4, 8), "tensor-parallel"), (dp, torch.randn(4, 6), "data-parallel")):
        pm.check_inputs_timeout = 2
        start = time.monotonic()
        with pytest.raises(CollectiveError, match=rf"waited 2s for the other ranks of its {kind} group.*pm.check_inputs_timeout.*init_process_group"):
            pm(x)
        assert time.monotonic() - start < 6, f"{kind}: took {time.monotonic() - start:.1f}s to fail"


SCENARIOS: dict[str, list[tuple[str, Callable[[int, int], None]]]] = {
    "two": DP_CHECKS + TP_CHECKS + [("rank_failure_is_reported", check_rank_failure_is_reported)],
    "four": FOUR_CHECKS,
    "stall": [("rank_that_never_calls_forward", check_rank_that_never_calls_forward)],
    "llama": [("tp_llama_over_a_mesh", check_tp_llama_over_a_mesh)],
}
LAST_CHECKS = {"rank_failure_is_reported", "rank_that_never_calls_forward"}  # ranks other than 0 exit in it


# ---------------------------------------------------------------------------- tests
def test_transform_spmd_needs_a_process_group():
    """Without init_process_group the error says what to call."""
    import torch.distributed as dist

    from dpcompile.recipes import SpmdRecipe

    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(ValueError, match="init_process_group"):
        SpmdRecipe(mesh=FakeMesh()).compile(MLP(), None)


# ---------------------------------------------------------------------------- the spawned groups
@pytest.fixture(scope="module")
def two():
    return run_group("two", 2)


@pytest.fixture(scope="module")
def four():
    return run_group("four", 4, timeout=FOUR_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.parametrize("check", [name for name, _ in DP_CHECKS])
@pytest.mark.xdist_group("spmd_2")  # one spawned group, on one worker
def test_spmd_data_parallel_2(two, check):
    """Data parallel over a 2-process mesh (each check named by its parameter)."""
    _lookup(two, 2, check)


@pytest.mark.distributed
@pytest.mark.parametrize("check", [name for name, _ in TP_CHECKS])
@pytest.mark.xdist_group("spmd_2")  # one spawned group, on one worker
def test_spmd_tensor_parallel_2(two, check):
    """Tensor parallel over a 2-process mesh (each check named by its parameter)."""
    _lookup(two, 2, check)


@pytest.mark.distributed
@pytest.mark.parametrize("check", [name for name, _ in FOUR_CHECKS])
@pytest.mark.xdist_group("spmd_4")  # one spawned group, on one worker
def test_spmd_4_processes(four, check):
    """Data parallel over 4 processes, and the 2x2 ("dp", "tp") mesh (with sequence parallel too)."""
    if check.endswith("gpt2"):
        pytest.importorskip("transformers")
    _lookup(four, 4, check)


@pytest.mark.distributed
@pytest.mark.xdist_group("spmd_2")  # one spawned group, on one worker
def test_spmd_rank_failure_fails_fast(two):
    """A rank that exits makes the others fail with a clear error within the timeout, not hang."""
    assert 0 in two, "rank 0 reported nothing: it hung or crashed"
    error = two[0].get("rank_failure_is_reported", "rank 0 hung: no report within the timeout")
    assert error is None, error


@pytest.mark.distributed
def test_spmd_rank_that_never_calls_forward_fails_within_the_bound():
    """A rank that never calls forward fails the others within check_inputs_timeout, saying how to set it."""
    outcomes = run_group("stall", 2, timeout=40.0)
    assert 0 in outcomes, "rank 0 reported nothing: it hung or crashed"
    error = outcomes[0].get("rank_that_never_calls_forward", "rank 0 hung: no report within the timeout")
    assert error is None, error


@pytest.mark.distributed
def test_spmd_tensor_parallel_llama_2():
    """transformers' Llama over a 2-process mesh: Megatron's layout, 3 steps equal eager."""
    pytest.importorskip("transformers")
    outcomes = run_group("llama", 2, timeout=180.0)
    _lookup(outcomes, 2, "tp_llama_over_a_mesh")
