"""Context parallel over a ``("dp", "cp")`` DeviceMesh of 2 x 2 gloo processes, composed with data
parallelism: a 1-layer GPT-2 (float64, ``labels=``) whose labels are ``-100`` (ignored) unevenly over
the dp ranks' rows and the cp ranks' tokens, so each dp group's mean counts different tokens. Against
eager on the whole batch: the loss on every rank is the whole batch's mean (its sum and count reduced
over every dp x cp rank) and every gradient is eager's, under DDP; and under FSDP2
(``data_parallel="fsdp"``, ``fully_shard`` over the flattened dp x cp ranks), two AdamW steps give
eager's parameters. A ("cp", "tp") mesh of 2 x 2 (the tensor-parallel program on each cp rank's tokens):
a causal block and GPT-2 equal eager. One spawned group of 4 runs every check."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from tests.gloo_groups import assert_group_passed, run_checks, run_spawned

GROUP_TIMEOUT_S = 300.0  # spawning and the first gloo connections are slow on a loaded machine
WORLD = 4
V = 64


def _gpt2():
    import transformers as T

    config = T.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=V, n_positions=32, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return T.GPT2LMHeadModel(config).double()


def _inputs(rows: int, seq: int, seed: int) -> dict:
    """Tokens and labels, ``-100`` on most of the first row's labels and a few of the last row's: dp rank
    0 (the first rows) counts far fewer tokens than dp rank 1, and its cp ranks unequal numbers too."""
    import torch

    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (rows, seq), generator=g)
    labels[0, 1 : seq - 2] = -100
    labels[-1, -3:] = -100
    return {"input_ids": torch.randint(1, V, (rows, seq), generator=g), "labels": labels}


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))


def check_loss_exact_over_dp_and_cp() -> None:
    """DDP: 4 rows (2 per dp rank) at 12 tokens (6 per cp rank), then 3 rows (2 and 1) at 13 tokens (7
    and 6): this rank's logits, the loss on every rank (eager's whole-batch loss), the gradients of the
    loss plus the rank's weighted logits (the logits' term averaged over dp, as DDP does) and, after each
    of 2 AdamW steps, every parameter equal eager's; tensor_parallel= with this mesh is refused by name."""
    import copy

    import pytest
    import torch
    from torch import nn

    import dpcompile
    from dpcompile import DpCompileError
    from dpcompile.mesh import local_batch

    mesh = _mesh()
    with pytest.raises(DpCompileError, match=r"tensor_parallel= with a \('dp', 'cp'\) mesh is not built"):
        dpcompile.transform(nn.Linear(16, 16), mesh, example_inputs=(torch.randn(1, 3, 16),), tensor_parallel=True)
    torch.manual_seed(0)
    model = _gpt2()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, mesh, example_kwargs=local_batch(_inputs(4, 13, 0), mesh), frontend="export")
    assert pm.mode == "spmd_context_parallel" and pm.ddp is not None and "mean_over_batch" in pm.code, pm.code
    assert pm.layout == {"dp": 2, "cp": 2} and pm.strategies["dp"] == "data parallel (replicate)", pm.strategies
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for rows, seq in ((4, 12), (3, 13)):
        whole = _inputs(rows, seq, rows)
        ours = torch.tensor_split(torch.arange(rows), 2)[mesh.get_local_rank("dp")]
        mine = torch.tensor_split(torch.arange(seq), 2)[mesh.get_local_rank("cp")]
        got, want = pm(**local_batch(whole, mesh)), eager(**whole)
        torch.testing.assert_close(got.logits, want.logits[ours][:, mine])
        torch.testing.assert_close(got.loss, want.loss)  # the whole batch's, on every rank
        weights = torch.linspace(0.5, 1.5, want.logits.numel(), dtype=torch.float64).view(want.logits.shape)
        (got.loss + (got.logits * weights[ours][:, mine]).sum()).backward()
        (want.loss + (want.logits * weights).sum() / 2).backward()  # DDP: each dp rank's logits' term averaged
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert p.grad is not None, f"no gradient reached {name}"
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name, rows=rows: f"{rows} rows, grad {name}: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, msg=lambda m, name=name, rows=rows: f"{rows} rows, AdamW, {name}: {m}")


def check_mean_of_split_values_exact() -> None:
    """A causal block's mean square over every element, computed on each rank's tokens (partial sums
    and counts), over 3 rows (2 and 1 per dp rank) and 7 tokens: the mean on every rank is eager's
    and its gradients are eager's, where an average of the dp groups' means is not."""
    import copy

    import torch
    from torch import nn

    import dpcompile
    from dpcompile.mesh import local_batch
    from tests.integration.test_context_parallel import CausalSelfAttention

    class MeanSquare(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = CausalSelfAttention()

        def forward(self, x):
            return self.block(x).square().mean()

    mesh = _mesh()
    torch.manual_seed(0)
    model = MeanSquare().double()
    eager = copy.deepcopy(model)
    x = torch.randn(3, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pm = dpcompile.transform(model, mesh, example_inputs=(local_batch(x, mesh),))
    assert "mean_over_batch" in pm.code, pm.code
    got, want = pm(local_batch(x, mesh)), eager(x)
    torch.testing.assert_close(got, want)
    got.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"grad {name}: {m}")


def check_fsdp_over_dp_and_cp() -> None:
    """``data_parallel="fsdp"``: each rank holds its quarter of the parameters (FSDP2 over the flattened
    dp x cp ranks); two AdamW steps on batches whose ignored labels differ per dp rank, at 13 and 12
    tokens: the loss on every rank and every gradient (all-gathered) equal eager's on the whole batch,
    then every parameter (``pm.state_dict()``, full tensors) does."""
    import copy

    import torch
    from torch.distributed.tensor import DTensor

    import dpcompile
    from dpcompile.mesh import local_batch

    mesh = _mesh()
    torch.manual_seed(0)
    model = _gpt2()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, mesh, example_kwargs=local_batch(_inputs(4, 13, 0), mesh), frontend="export",
                             data_parallel="fsdp")  # fmt: skip
    assert pm.fsdp is not None and pm.ddp is None and pm.strategies["dp"] == "data parallel (fsdp)", pm.strategies
    wte = dict(pm.named_parameters())["transformer.wte.weight"]
    assert isinstance(wte, DTensor) and wte.to_local().shape == (V // 4, 32), wte.to_local().shape
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), lr=1e-2), torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for step, seq in enumerate((13, 12)):
        whole = _inputs(4, seq, 10 + step)
        got, want = pm(**local_batch(whole, mesh)), eager(**whole)
        torch.testing.assert_close(got.loss, want.loss)
        got.loss.backward()
        want.loss.backward()
        ours = dict(pm.named_parameters())
        for name, q in eager.named_parameters():
            grad = ours[name].grad
            torch.testing.assert_close(grad.full_tensor() if isinstance(grad, DTensor) else grad, q.grad,
                                       msg=lambda m, name=name, seq=seq: f"seq {seq}, grad {name}: {m}")  # fmt: skip
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        state, want_state = pm.state_dict(), eager.state_dict()
        for name, value in want_state.items():
            torch.testing.assert_close(state[name], value, msg=lambda m, name=name, seq=seq: f"seq {seq}, AdamW, {name}: {m}")


def check_fsdp_over_cp() -> None:
    """``data_parallel="fsdp"`` over a ``("cp",)`` mesh of 4: FSDP2 over the cp ranks; a causal block at
    7 tokens (2, 2, 2, 1): each rank's output and every gradient (summed over cp) equal eager's."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import dpcompile
    from dpcompile.mesh import local_batch
    from tests.integration.test_context_parallel import CausalSelfAttention

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    model = CausalSelfAttention().double()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pm = dpcompile.transform(model, mesh, example_inputs=(local_batch(x, mesh),), data_parallel="fsdp")
    assert pm.fsdp is not None and isinstance(dict(pm.named_parameters())["qkv.weight"], DTensor)
    mine = torch.tensor_split(torch.arange(7), 4)[dist.get_rank()]
    got, want = pm(local_batch(x, mesh)), eager(x)
    torch.testing.assert_close(got, want[:, mine])
    weights = torch.linspace(0.5, 1.5, want.numel(), dtype=torch.float64).view(want.shape)
    (got * weights[:, mine]).sum().backward()
    (want * weights).sum().backward()
    ours = dict(pm.named_parameters())
    for name, q in eager.named_parameters():
        torch.testing.assert_close(ours[name].grad.full_tensor(), q.grad, msg=lambda m, name=name: f"grad {name}: {m}")


def _assert_shard_grads_equal(pm, eager, what: str) -> None:
    """Every parameter's gradient on this rank equals eager's, cut to this tp rank's shard where it is one."""
    import torch

    from dpcompile.runtime.tensor_parallel import shard_of

    tp_rank = pm.mesh.get_local_rank("tp")
    ours = dict(pm.named_parameters())
    for name, q in eager.named_parameters():
        assert ours[name].grad is not None, f"{what}: no gradient reached {name}"
        want = shard_of(q.grad, pm.shards[name], tp_rank) if name in pm.shards else q.grad
        torch.testing.assert_close(ours[name].grad, want, msg=lambda m, name=name: f"{what}, grad {name}: {m}")


def check_block_over_cp_and_tp() -> None:
    """A ("cp", "tp") mesh of 2 x 2: a causal block's layers sharded over tp, each cp rank passing its part
    of 7 tokens (4 and 3); its output and every gradient (this rank's shard, summed over cp by DDP) equal
    eager's."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.mesh import local_batch
    from tests.integration.test_context_parallel import CausalSelfAttention

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    torch.manual_seed(0)
    model = CausalSelfAttention().double()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pm = dpcompile.transform(model, mesh, example_inputs=(local_batch(x, mesh),), tensor_parallel=True)
    assert pm.mode == "spmd_context_tensor_parallel" and pm.ddp is not None and pm.shards, pm.mode
    assert "attention_over_group" in pm.code and "tp_group" in pm.code, pm.code
    mine = torch.tensor_split(torch.arange(7), 2)[mesh.get_local_rank("cp")]
    got, want = pm(local_batch(x, mesh)), eager(x)
    torch.testing.assert_close(got, want[:, mine])
    weights = torch.linspace(0.5, 1.5, want.numel(), dtype=torch.float64).view(want.shape)
    (got * weights[:, mine]).sum().backward()
    (want * weights).sum().backward()
    _assert_shard_grads_equal(pm, eager, "block")


def check_gpt2_over_cp_and_tp() -> None:
    """GPT-2 with ``labels=`` over a ("cp", "tp") mesh of 2 x 2, at 13 tokens (7 and 6 per cp rank) then 12:
    this cp rank's logits, the loss (the whole sequence's, on every rank) and every gradient (this rank's
    shard) equal eager's; then two SGD steps' parameters (``pm.state_dict()``, whole tensors) do. (Not AdamW:
    GPT-2 computes its loss in float32, and Adam's first steps turn a gradient near 0 rounded otherwise, by
    the split sums, into a visibly different update.)"""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.mesh import local_batch

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    torch.manual_seed(0)
    model = _gpt2()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, mesh, example_kwargs=local_batch(_inputs(2, 13, 0), mesh), frontend="export",
                             tensor_parallel=True)  # fmt: skip
    assert pm.mode == "spmd_context_tensor_parallel" and "attention_over_group" in pm.code, pm.code
    assert "transformer.h.0.attn.c_attn.weight" in pm.shards and "transformer.h.0.mlp.c_fc.weight" in pm.shards
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    for step, seq in enumerate((13, 12)):
        whole = _inputs(2, seq, 20 + step)
        mine = torch.tensor_split(torch.arange(seq), 2)[mesh.get_local_rank("cp")]
        got, want = pm(**local_batch(whole, mesh)), eager(**whole)
        torch.testing.assert_close(got.logits, want.logits[:, mine])
        torch.testing.assert_close(got.loss, want.loss)
        got.loss.backward()
        want.loss.backward()
        _assert_shard_grads_equal(pm, eager, f"GPT-2, {seq} tokens")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        state = pm.state_dict()
        for name, value in eager.state_dict().items():
            torch.testing.assert_close(state[name], value, msg=lambda m, name=name, seq=seq: f"seq {seq}, AdamW, {name}: {m}")


def check_cp_tp_refusals() -> None:
    """Over a ("cp", "tp") mesh: FSDP, sequence_parallel=True, a dropout under exact_random=True and a call
    that departs from the traced one (eval mode) are refused by name; tensor_parallel= left out is implied
    by the mesh's "tp" dimension, as mesh= over a device list implies it."""
    import pytest
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile import DpCompileError
    from dpcompile.mesh import local_batch
    from tests.integration.test_context_parallel import CausalSelfAttention

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    x = local_batch(torch.randn(2, 7, 16), mesh)
    for kwargs, match in (({"data_parallel": "fsdp"}, r'data_parallel="fsdp" with a \(\'cp\', \'tp\'\) mesh is not built'),
                          ({"sequence_parallel": True}, r"sequence_parallel=True with cp over a DeviceMesh is not built")):  # fmt: skip
        with pytest.raises(DpCompileError, match=match):
            dpcompile.transform(CausalSelfAttention(), mesh, example_inputs=(x,), tensor_parallel=True, **kwargs)
    with pytest.raises(DpCompileError, match="draws random numbers"):
        dropout = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.1))
        dpcompile.transform(dropout, mesh, example_inputs=(x,), tensor_parallel=True)
    pm = dpcompile.transform(CausalSelfAttention(), mesh, example_inputs=(x,))  # tensor_parallel= implied
    assert pm.mode == "spmd_context_tensor_parallel", pm.mode
    pm.eval()
    with pytest.raises(DpCompileError, match=r"tracing again over a \('cp', 'tp'\) mesh is not built"):
        pm(x)


CHECKS = (("loss_exact", check_loss_exact_over_dp_and_cp), ("mean_exact", check_mean_of_split_values_exact),
          ("fsdp", check_fsdp_over_dp_and_cp), ("fsdp_cp", check_fsdp_over_cp),
          ("cp_tp_block", check_block_over_cp_and_tp), ("cp_tp_gpt2", check_gpt2_over_cp_and_tp),
          ("cp_tp_refused", check_cp_tp_refusals))


def _entry(rank: int, world: int, port: int, checks: tuple, results: mp.Queue) -> None:
    run_checks(rank, world, port, list(checks), results)


@pytest.fixture(scope="module")
def outcomes():
    pytest.importorskip("transformers")
    return run_spawned(_entry, WORLD, CHECKS, timeout=GROUP_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.slow  # one spawned group of 4 processes for every check
@pytest.mark.parametrize("check", [name for name, _ in CHECKS])
@pytest.mark.xdist_group("context_parallel_mesh_dp")  # one spawned group, on one worker
def test_context_parallel_over_dp_and_cp(outcomes, check):
    """Each check passed on every rank (see the module's docstring)."""
    assert_group_passed(outcomes, WORLD, check, timeout=GROUP_TIMEOUT_S)
