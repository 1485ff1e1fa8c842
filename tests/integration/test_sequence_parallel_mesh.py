"""Sequence parallelism over a 2-rank gloo DeviceMesh (``sequence_parallel=True`` on a ``("tp",)``
mesh): the test file's ``Stack`` of blocks (training, dropout drawn exactly) and a 1-layer GPT-2
with ``labels=``, float64, on a sequence of 13 (7 and 6 tokens per rank): loss, outputs, every
gradient (this rank's shard) and the parameters after 2 AdamW steps equal eager; a call of another
length runs equal eager; each rank's code shows the sequence collectives (on gloo the reduce-scatter
is an all-reduce and the rank's slice, named so in the code; the backend's own reduce-scatter, nccl's
path, is checked equal to it)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.multiprocessing as mp

from tests.gloo_groups import assert_group_passed, run_checks, run_spawned

GROUP_TIMEOUT_S = 300.0  # spawning, importing and the first gloo connections are slow on a loaded machine
WORLD = 2
SEQ = 13  # uneven over 2 ranks: 7 and 6 tokens


def _assert_state_equal(pm, eager, **tolerance) -> None:
    got, want = pm.state_dict(), eager.state_dict()  # a collective: every rank gathers the shards
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, **tolerance, msg=lambda m, key=key: f"{key}: {m}")


def _assert_grads_equal(pm, eager, rank: int) -> None:
    from dpcompile.runtime.tensor_parallel import shard_of

    mine = dict(pm.named_parameters())
    for key, p in eager.named_parameters():
        expected = p.grad if key not in pm.shards else shard_of(p.grad, pm.shards[key], rank)
        torch.testing.assert_close(mine[key].grad, expected, msg=lambda m, key=key: f"grad {key}: {m}")


def _train_two_steps(pm, eager, rank: int, loss_of, **tolerance) -> None:
    """Two AdamW steps on each: losses equal at each step, gradients after the first, parameters after
    both (to ``tolerance``)."""
    opts = torch.optim.AdamW(pm.parameters(), lr=0.01), torch.optim.AdamW(eager.parameters(), lr=0.01)
    for step in range(2):
        torch.manual_seed(step)
        got = loss_of(pm, step)
        torch.manual_seed(step)
        want = loss_of(eager, step)
        torch.testing.assert_close(got, want)
        got.backward()
        want.backward()
        if step == 0:
            _assert_grads_equal(pm, eager, rank)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    _assert_state_equal(pm, eager, **tolerance)


def check_stack() -> None:
    """The test file's blocks, with labels: cross-entropy of the logits; then a call of 12 tokens."""
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from tests.integration.test_sequence_parallel import Stack, V, _ids

    torch.manual_seed(0)
    model = Stack().double().train()
    eager = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    pm = dpcompile.transform(model, mesh, tensor_parallel=True, sequence_parallel=True, example_inputs=(_ids(SEQ),))
    code = pm.code
    assert code.count("reduce_scatter_by_all_reduce(") == 5  # emb, fc2 and fc4 of both blocks
    assert code.count("all_gather_sequence(") == 5  # ln1, ln2 of both blocks, the final ln
    assert "sequence_length = emb_partial.size(1)" in code  # the call's own length, read where it enters
    assert "dpcompile_runtime_distributed_all_reduce(" not in code  # nothing between the pairs all-reduced
    assert "blocks_0_ln1 = dpcompile_runtime_sequence_mesh_call_summing_grads(" in code  # a norm on the slice
    assert pm.strategies == {"tp": "tensor parallel with sequence parallel"}
    report = dpcompile.explain(pm, _ids(SEQ))
    assert len(report.sequence_parallel["reduce_scatters"]) == 5 and len(report.sequence_parallel["all_gathers"]) == 5
    assert report.sequence_parallel["reduce_scatter"] == "all_reduce_then_slice"
    assert "the gloo fallback" in str(report)
    labels = _ids(SEQ, seed=7) % V

    def loss_of(m, step):
        logits = m(_ids(SEQ, seed=step + 1))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    _train_two_steps(pm, eager, mesh.get_local_rank("tp"), loss_of)
    for seq in (12, 5):  # another length at call time: each rank's slice by the call's own split
        torch.manual_seed(seq)
        got = pm(_ids(seq, seed=seq))
        torch.manual_seed(seq)
        torch.testing.assert_close(got, eager(_ids(seq, seed=seq)))
    pm.eval()  # another mode: this rank's program traced again, sequence parallel too
    eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(_ids(SEQ, seed=9)), eager(_ids(SEQ, seed=9)))


def check_gpt2() -> None:
    """A 1-layer GPT-2 (training, dropout drawn exactly) with labels=: the loss is transformers' own."""
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from tests.integration.test_sequence_parallel import _inputs, _transformers_model

    torch.manual_seed(0)
    model = _transformers_model("gpt2", layers=1).double().train()
    eager = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    pm = dpcompile.transform(model, mesh, tensor_parallel=True, sequence_parallel=True, example_kwargs=_inputs(SEQ))
    assert pm.code.count("reduce_scatter_by_all_reduce(") == 4  # the two lookups, the layer's two row layers
    assert pm.code.count("all_gather_sequence(") == 3  # the layer's two norms and the final norm
    outputs = {}

    def loss_of(m, step):
        out = m(**_inputs(SEQ, seed=step + 1))
        outputs.setdefault(step, []).append(out.logits)
        return out.loss

    # transformers computes the loss in float32: the gradients agree to its rounding, which AdamW's
    # normalisation carries into the parameters (one element of c_attn off by 1.6e-7 after 2 steps)
    _train_two_steps(pm, eager, mesh.get_local_rank("tp"), loss_of, atol=1e-6, rtol=1e-6)
    for got, want in outputs.values():
        torch.testing.assert_close(got, want)


class ReadsShape(torch.nn.Module):
    """A norm whose output's shape is read (``h.shape``, not gathered) and used whole after the pair."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.ln, self.fc1, self.fc2 = torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.ln(x)
        b, t, _ = h.shape
        return (x + self.fc2(torch.relu(self.fc1(h)))).reshape(b * t, -1)


def check_shape_read() -> None:
    """``h.shape`` of a value on sequence slices is the whole value's, at the example's length (13) and
    at another (12): outputs and gradients equal eager."""
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    torch.manual_seed(0)
    model = ReadsShape().double()
    eager = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    x = torch.randn(2, SEQ, 16, dtype=torch.float64)
    pm = dpcompile.transform(model, mesh, tensor_parallel=True, sequence_parallel=True, example_inputs=(x,))
    assert "dpcompile_runtime_sequence_mesh_whole_size(ln, 1, sequence_length, None)" in pm.code
    for seq in (SEQ, 12):
        x = torch.randn(2, seq, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seq))
        got, want = pm(x), eager(x)
        torch.testing.assert_close(got, want)
        got.sum().backward()
        want.sum().backward()
    _assert_grads_equal(pm, eager, mesh.get_local_rank("tp"))


def check_reduce_scatters_agree() -> None:
    """The backend's own reduce-scatter (nccl's path; gloo has one too) equals the gloo fallback, forward
    and backward, on an uneven sequence (5 over 2 ranks), and the all-gather is its conjugate."""
    import torch.distributed as dist

    from dpcompile.runtime import sequence_mesh

    x = torch.arange(2 * 5 * 3, dtype=torch.float64).view(2, 5, 3) * (dist.get_rank() + 1)
    x.requires_grad_()
    own, fallback = sequence_mesh.reduce_scatter(x, None, 1), sequence_mesh.reduce_scatter_by_all_reduce(x, None, 1)
    whole = x.detach() * 3 / (dist.get_rank() + 1)  # the sum over the 2 ranks
    torch.testing.assert_close(own, whole[:, :3] if dist.get_rank() == 0 else whole[:, 3:])
    torch.testing.assert_close(own, fallback)
    weights = torch.linspace(0.5, 1.5, own.numel(), dtype=torch.float64).view(own.shape)
    grads = [torch.autograd.grad((y * weights).sum(), x)[0] for y in (own, fallback)]
    torch.testing.assert_close(*grads)
    for by_all_reduce in (False, True):
        y = own.detach().requires_grad_()
        gathered = sequence_mesh.all_gather_sequence(y, None, 1, 5, by_all_reduce=by_all_reduce)
        torch.testing.assert_close(gathered, whole)
        (grad,) = torch.autograd.grad((gathered * (dist.get_rank() + 1)).sum(), y)
        torch.testing.assert_close(grad, torch.full_like(y, 3.0))  # the ranks' gradients summed, this slice


CHECKS = {"stack": check_stack, "gpt2": check_gpt2, "shape": check_shape_read, "reduce_scatters": check_reduce_scatters_agree}


def _entry(rank: int, world: int, port: int, results: mp.Queue) -> None:
    run_checks(rank, world, port, [(name, functools.partial(check)) for name, check in CHECKS.items()], results)


@pytest.fixture(scope="module")
def outcomes():
    return run_spawned(_entry, WORLD, timeout=GROUP_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.slow  # one spawned group of 2 processes for all cases
@pytest.mark.parametrize("case", list(CHECKS))
@pytest.mark.xdist_group("sequence_parallel_mesh")  # one spawned group, on one worker
def test_sequence_parallel_over_a_mesh_equals_eager(outcomes, case):
    """Over 2 gloo ranks: loss, outputs, gradients and parameters after 2 AdamW steps as eager."""
    if case == "gpt2":
        pytest.importorskip("transformers")
    assert_group_passed(outcomes, WORLD, case, timeout=GROUP_TIMEOUT_S)
