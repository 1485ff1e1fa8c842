"""Activation checkpointing over a gloo ``DeviceMesh``: each rank's program (data parallel with DDP
and FSDP2, tensor parallel with and without sequence parallel, a pipeline stage, sharded or not)
has its regions recomputed in backward, as in one process.

A 2-layer pre-norm stack (width 32, attention and an MLP, dropout in each, float64) trains 3 SGD
steps from the same seed against eager on the global batch: the loss (averaged over dp), every
gradient (this rank's shard, this stage's parameters) and the parameters after the steps equal
eager's, so dropout draws the same masks in the recompute as in the first run and no collective
recomputed in backward (a tensor-parallel block's all-reduce) runs out of order. ``pm.code`` calls
``dpcompile_runtime_checkpoint`` for each block. ``plan="auto"`` builds ``dp2 +ckpt`` where only it
fits, and ``measure`` agrees with its prediction; what is not built is refused, changing nothing.
Spawning is the slow part: one group of 2 and one of 4 run every check.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.gloo_groups import assert_group_passed, run_checks, run_spawned

pytestmark = [pytest.mark.distributed]
GROUP_TIMEOUT_S = 300.0
D, HEADS, ROWS, SEQ = 32, 2, 2, 4


class DropoutBlock(nn.Module):
    """Pre-norm attention (q, k, v column, out row) and MLP (up column, down row), dropout in each."""

    def __init__(self, d: int = D, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        h = self.norm1(x)
        q, k, v = (layer(h).unflatten(-1, (self.heads, -1)).transpose(1, 2) for layer in (self.q, self.k, self.v))
        att = torch.softmax(q @ k.transpose(-2, -1) / (D // HEADS) ** 0.5, dim=-1)
        x = x + self.out((att @ v).transpose(1, 2).flatten(-2))
        return x + self.drop(self.down(F.gelu(self.up(self.norm2(x)))))


class DropoutStack(nn.Module):
    def __init__(self, d: int = D, layers: int = 2):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(DropoutBlock(d) for _ in range(layers))
        self.head = nn.Linear(d, 4)

    def forward(self, x, labels):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _batch(rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(rows, SEQ, D, generator=g, dtype=torch.float64),
            "labels": torch.randint(0, 4, (rows, SEQ), generator=g)}  # fmt: skip


def _mesh(layout: dict[str, int]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(layout.values()), mesh_dim_names=tuple(layout))


def _local(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def check_trains_like_eager(layout: dict[str, int], checkpointing, **options) -> None:
    """3 SGD steps over the mesh against eager on the global batch: loss, gradients, parameters."""
    import torch.distributed as dist

    import dpcompile
    from dpcompile.runtime.tensor_parallel import shard_of

    mesh = _mesh(layout)
    dp = layout.get("dp", 1)
    dp_rank = mesh.get_local_rank("dp") if "dp" in layout else 0
    tp_rank = mesh.get_local_rank("tp") if "tp" in layout else 0
    batch = _batch(ROWS * dp)
    local = {k: v[dp_rank * ROWS : (dp_rank + 1) * ROWS] for k, v in batch.items()}
    torch.manual_seed(0)
    model = DropoutStack().double().train()
    reference = copy.deepcopy(model)
    if "tp" in layout:
        options["tensor_parallel"] = True
    pm = dpcompile.transform(model, mesh, example_kwargs=local, activation_checkpointing=checkpointing, **options)
    assert pm.code.count("dpcompile_runtime_checkpoint(") == (2 if checkpointing else 0), pm.code
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    shards = getattr(pm, "shards", {}) or {}
    for step in range(3):
        torch.manual_seed(100 + step)
        loss = pm(**local)
        loss.backward()
        torch.manual_seed(100 + step)
        expected = reference(**batch)
        expected.backward()
        mean_loss = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(mean_loss, group=mesh.get_group("dp"))
            mean_loss /= dp
        torch.testing.assert_close(mean_loss, expected.detach(), msg=lambda m, step=step: f"loss of step {step}: {m}")
        grads = {n.removeprefix("module."): p.grad for n, p in pm.named_parameters()}
        for key, p in reference.named_parameters():
            want = shard_of(p.grad, shards[key], tp_rank) if key in shards else p.grad
            torch.testing.assert_close(_local(grads[key]), want, msg=lambda m, key=key, step=step: f"grad {key}, step {step}: {m}")
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    params = {n.removeprefix("module."): p for n, p in pm.named_parameters()}
    for key, p in reference.named_parameters():
        want = shard_of(p.detach(), shards[key], tp_rank) if key in shards else p.detach()
        torch.testing.assert_close(_local(params[key].detach()), want, msg=lambda m, key=key: f"param {key}: {m}")


def check_pipeline_trains_like_eager(layout: dict[str, int], checkpointing, **options) -> None:
    """A pipeline over the mesh (2 micro-batches a rank; each call runs backward): 3 SGD steps against
    eager: the last stage's loss, this stage's gradients and parameters (this tp rank's shards)."""
    import dpcompile
    from dpcompile.fx_utils import unalias
    from dpcompile.runtime.tensor_parallel import shard_of

    mesh = _mesh(layout)
    dp = layout.get("dp", 1)
    dp_rank = mesh.get_local_rank("dp") if "dp" in layout else 0
    tp_rank = mesh.get_local_rank("tp") if "tp" in layout else 0
    batch = _batch(ROWS * dp)
    local = {k: v[dp_rank * ROWS : (dp_rank + 1) * ROWS] for k, v in batch.items()}
    torch.manual_seed(0)
    model = DropoutStack().double().train()
    reference = copy.deepcopy(model)
    if "tp" in layout:
        options["tensor_parallel"] = True
    pm = dpcompile.transform(model, mesh, pipeline=["layers.1"], micro_batches=2, example_kwargs=local,
                             activation_checkpointing=checkpointing, **options)  # fmt: skip
    assert pm.code.count("dpcompile_runtime_checkpoint(") == (1 if checkpointing else 0), pm.code  # a block a stage
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    last = mesh.get_local_rank("pp") == layout["pp"] - 1
    wanted = dict(reference.named_parameters())
    shards = getattr(pm, "shards", {}) or {}
    for step in range(3):
        torch.manual_seed(100 + step)
        out = pm(**local)
        torch.manual_seed(100 + step)
        expected = reference(**batch)
        expected.backward()
        if last:
            torch.testing.assert_close(out, expected.detach(), msg=lambda m, step=step: f"loss of step {step}: {m}")
        for path, p in pm.program.named_parameters():
            key = unalias(path)
            want = shard_of(wanted[key].grad, shards[key], tp_rank) if key in shards else wanted[key].grad
            torch.testing.assert_close(_local(p.grad), want, msg=lambda m, key=key, step=step: f"grad {key}, step {step}: {m}")
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    for path, p in pm.program.named_parameters():
        key = unalias(path)
        want = shard_of(wanted[key].detach(), shards[key], tp_rank) if key in shards else wanted[key].detach()
        torch.testing.assert_close(_local(p.detach()), want, msg=lambda m, key=key: f"param {key}: {m}")


def check_planned_checkpointing_measured(layout: dict[str, int], checkpointing, **options) -> None:
    """``plan="auto"`` over the mesh with a budget that replication fits only recomputing every block:
    ``dp2 +ckpt`` is built (the benchmark's 2-block stack, d=32, 8 x 32 tokens, no optimizer); a step's
    gradients equal eager's, and the measured peak is within 10% of the planner's prediction and below
    the same step's without checkpointing."""
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from benchmarks.bench_activation_checkpointing import Stack
    from dpcompile.mesh import local_batch

    torch.manual_seed(0)
    eager = Stack(32, 4, 2).double()
    batch = (torch.randn(8, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64),)
    pm = dpcompile.transform(copy.deepcopy(eager), init_device_mesh("cpu", (2,)), plan="auto",
                             memory_per_device=1_000_000, example_inputs=batch)  # fmt: skip
    peak = {c.spec.name: c.peak for c in pm.candidates}  # dp2 995,328, tp2 +ckpt 949,248 (slower); dp2, tp2 > 1.3 MB
    assert pm.layout == {"dp": 2} and pm.memory_plan.peak == peak["dp2 +ckpt"], [c.row() for c in pm.candidates]
    assert all(peak[name] > 1_000_000 for name in ("dp2", "tp2")), peak
    assert pm.strategies["activation_checkpointing"] == "recompute in backward: layers.0, layers.1"
    assert pm.code.count("dpcompile_runtime_checkpoint(") == 2, pm.code
    local = local_batch(batch, pm.mesh)
    measured = dpcompile.measure(pm, *local).peak_bytes["cpu"]
    assert 0.9 <= measured / peak["dp2 +ckpt"] <= 1.1, (measured, peak)
    plain = dpcompile.transform(copy.deepcopy(eager), pm.mesh, example_inputs=local)
    assert dpcompile.measure(plain, *local).peak_bytes["cpu"] > measured
    pm(*local).sum().backward()
    eager(*batch).sum().backward()
    mine = dict(pm.named_parameters())
    for key, p in eager.named_parameters():
        torch.testing.assert_close(mine[key].grad, p.grad / 2, msg=lambda m, key=key: f"{key}: {m}")  # DDP's mean


def check_refusals(layout: dict[str, int], checkpointing, **options) -> None:
    """What is not built over a mesh is refused by name, and nothing is changed: a 'cp' mesh, "auto"
    without plan="auto", a module no stage runs."""
    import dpcompile
    from dpcompile.errors import DpCompileError

    torch.manual_seed(0)
    model = DropoutStack().double()
    model.spare = nn.Linear(2, 2).double()  # forward never calls it
    before = {k: v.clone() for k, v in model.state_dict().items()}
    local = _batch(ROWS)
    refusals = [
        (_mesh({"cp": 2}), {"activation_checkpointing": True}, "with a 'cp' dimension"),
        (_mesh({"dp": 2}), {"activation_checkpointing": "auto", "memory_per_device": "1GiB"}, 'pass plan="auto"'),
        (_mesh({"pp": 2}), {"activation_checkpointing": ["inp", "spare"], "pipeline": ["layers.1"]},
         "names 'spare', but no operation of the program runs in it"),
    ]
    for mesh, keywords, match in refusals:
        with pytest.raises(DpCompileError, match=match):
            dpcompile.transform(model, mesh, example_kwargs=local, **keywords)
        after = model.state_dict()
        assert all(torch.equal(v, after[k]) for k, v in before.items())


#: by group size: name -> (check, mesh, activation_checkpointing=, other keywords)
CHECKS = {
    2: {
        "dp": (check_trains_like_eager, {"dp": 2}, True, {}),
        "fsdp": (check_trains_like_eager, {"dp": 2}, True, {"data_parallel": "fsdp"}),
        "tp_sequence": (check_trains_like_eager, {"tp": 2}, ["layers.0", "layers.1"], {"sequence_parallel": True}),
        "pp_1f1b": (check_pipeline_trains_like_eager, {"pp": 2}, {"regions": True, "save": "matmuls"},
                    {"schedule": "1f1b"}),
        "planned": (check_planned_checkpointing_measured, {}, None, {}),
        "refusals": (check_refusals, {}, None, {}),
    },
    4: {
        "dp_tp": (check_trains_like_eager, {"dp": 2, "tp": 2}, True, {}),
        "pp_tp": (check_pipeline_trains_like_eager, {"pp": 2, "tp": 2}, True, {}),
        "pp_dp": (check_pipeline_trains_like_eager, {"pp": 2, "dp": 2}, True, {}),
    },
}


def _checks(world: int) -> list[tuple[str, object]]:
    return [(name, functools.partial(check, layout, ac, **options))
            for name, (check, layout, ac, options) in CHECKS[world].items()]  # fmt: skip


def _entry(rank: int, world: int, port: int, results) -> None:
    run_checks(rank, world, port, _checks(world), results)


_OUTCOMES: dict[int, dict] = {}


def _assert_passed(world: int, check: str) -> None:
    if world not in _OUTCOMES:
        _OUTCOMES[world] = run_spawned(_entry, world, timeout=GROUP_TIMEOUT_S)
    assert_group_passed(_OUTCOMES[world], world, check, timeout=GROUP_TIMEOUT_S)


@pytest.mark.parametrize("check", list(CHECKS[2]))
@pytest.mark.xdist_group("activation_checkpointing_mesh_2")  # one spawned group, on one worker
def test_checkpointed_mesh_trains_like_eager_2(check):
    _assert_passed(2, check)


@pytest.mark.parametrize("check", list(CHECKS[4]))
@pytest.mark.xdist_group("activation_checkpointing_mesh_4")  # one spawned group, on one worker
def test_checkpointed_mesh_trains_like_eager_4(check):
    _assert_passed(4, check)
