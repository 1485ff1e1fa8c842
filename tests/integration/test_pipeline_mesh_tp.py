"""Pipeline stages sharded by tensor parallel: a 4-process gloo ``("pp", "tp")`` mesh of 2 x 2.

Each stage's program (``cut_stage``'s) is rewritten by the ``("tp",)`` mesh's lowering
(``shard_linear`` → ``lower_to_collectives`` over ``"tp"``) and run under
``torch.distributed.pipelining`` (GPipe, 1F1B) with 1, 2 and 4 micro-batches, on an MLP stack
(an explicit Megatron plan and the automatic one) and a tiny decoder (automatic plan: a
vocab-parallel embedding, heads split by ``view``). The loss and the outputs equal eager's, and
so does every gradient: a sharded parameter's once its tp shards are gathered, a replicated
one's on every tp rank; after an SGD step on ``pm.parameters()`` a forward still equals eager's. A
weight tied across the stages (the checkpoint tests' LM: embedding and LM head) trains 3 AdamW steps
as eager, its copies identical. All checks run in one spawned group (spawning is the slow part on
two cores).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.multiprocessing as mp

from tests.gloo_groups import assert_group_passed, run_checks, run_spawned
from tests.helpers import assert_mesh_pipeline_verifies, assert_stage_is_a_parallel_module

GROUP_TIMEOUT_S = 240.0  # 10 configurations built on a loaded 2-core machine
MEGATRON = {"layers.0": "column", "layers.1": "row", "layers.2": "column", "layers.3": "row", "head": "column"}


def _stack():
    from tests.integration.test_pipeline import Stack

    torch.manual_seed(0)
    return Stack(depth=4)


def _inputs(batch: int = 8):
    g = torch.Generator().manual_seed(1)
    x, labels = torch.randn(batch, 8, generator=g), torch.randint(0, 3, (batch,), generator=g)
    labels[0] = -100  # ignored: the mean is over the others, of the whole batch
    return x, labels


class TinyDecoder(torch.nn.Module):
    """Embedding, two attention blocks (heads split by ``view``), LayerNorm, LM head, token loss."""

    def __init__(self, vocab: int = 16, d: int = 8):
        super().__init__()
        from tests.integration.test_spmd import Block

        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([Block(d) for _ in range(2)])
        self.norm = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab)

    def forward(self, ids, labels):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        logits = self.lm_head(self.norm(h))
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _decoder():
    torch.manual_seed(0)
    return TinyDecoder()


def _tokens(batch: int = 4):
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 16, (batch, 6), generator=g), torch.randint(0, 16, (batch, 6), generator=g)
    labels[0, :3] = -100
    return ids, labels


def _full_grad(pm, name: str, grad: torch.Tensor, group) -> torch.Tensor:
    """The whole gradient of parameter ``name``: its tp shards gathered where it is sharded."""
    import torch.distributed as dist

    from dpcompile.runtime.tensor_parallel import unshard

    spec = pm.shards.get(name)
    if spec is None:
        return grad
    shape = list(grad.shape)
    shape[spec.dim] = max(spec.sizes)  # gloo gathers equal shapes: pad uneven shards, then trim
    padded = grad.new_zeros(shape)
    padded.narrow(spec.dim, 0, grad.size(spec.dim)).copy_(grad)
    gathered = [torch.empty_like(padded) for _ in spec.sizes]
    dist.all_gather(gathered, padded, group=group)
    return unshard([g.narrow(spec.dim, 0, size) for g, size in zip(gathered, spec.sizes)], spec, "cpu")


def check_pipeline_tp(
    schedule: str,
    micro: int,
    plan: object,
    kind: str = "stack",
    pipeline: object = 2,
    sharded: tuple[str, ...] = (),
    then_step: bool = False,
    verify: bool = False,
) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.fx_utils import unalias

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    reference, inputs = (_stack(), _inputs()) if kind == "stack" else (_decoder(), _tokens())
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, mesh, pipeline=pipeline, micro_batches=micro, schedule=schedule,
                             tensor_parallel=plan, example_inputs=inputs)  # fmt: skip
    if verify:  # OK, then a mismatch with eager's weights corrupted; it leaves no trace (checked below)
        assert_mesh_pipeline_verifies(pm, model, *inputs)
    out = pm(*inputs)
    expected_logits, expected_loss = reference(*inputs)
    expected_loss.backward()
    if mesh.get_local_rank("pp") == 1:
        logits, loss = out
        torch.testing.assert_close(loss, expected_loss)
        torch.testing.assert_close(logits, expected_logits.detach())
    else:
        assert out is None
    assert pm.shards, f"nothing sharded in stage {mesh.get_local_rank('pp')}: {pm.plan_reasons}"
    assert_stage_is_a_parallel_module(pm)
    assert "all_reduce(" in pm.code and "tp_group" in pm.code, pm.code
    mine = [path for path in sharded if any(path == m or path.startswith(m + ".") for m in pm.module_paths)]
    assert mine or not sharded, (sharded, pm.module_paths)
    assert set(mine) <= {n.rpartition(".")[0] for n in pm.shards}, pm.plan_reasons
    for name, p in pm.program.named_parameters():
        name = unalias(name)
        full = reference.get_parameter(name)
        if name in pm.shards:
            assert p.shape != full.shape, f"{name} is said sharded, yet whole: {tuple(p.shape)}"
        torch.testing.assert_close(
            _full_grad(pm, name, p.grad, mesh.get_group("tp")), full.grad, msg=lambda m, name=name: f"{name}: {m}"
        )
    assert all(p.grad is None for p in model.parameters()), "the user's model trained: pm holds its own shards"
    if then_step:  # an SGD step on pm's shards and on eager's parameters, then a forward alone (no_grad)
        torch.optim.SGD(pm.parameters(), lr=0.5).step()
        torch.optim.SGD(reference.parameters(), lr=0.5).step()
        with torch.no_grad():
            out = pm(*inputs)
            expected_logits, expected_loss = reference(*inputs)
        if mesh.get_local_rank("pp") == 1:
            torch.testing.assert_close(out[1], expected_loss)
            torch.testing.assert_close(out[0], expected_logits)
    dist.barrier()


def check_tied_pipeline_tp(schedule: str, micro: int) -> None:
    """The checkpoint tests' LM (fused qkv, a vocab-parallel embedding in stage 0 tied to the LM head
    in stage 1): each stage's tp rank t holds shard t of the tied weight, the same rows on both stages;
    3 AdamW steps: each loss and every gradient (shards gathered) as eager, the two stages' copies
    identical after every step, and state_dict the model's keys with eager's values."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from tests.integration.test_pipeline_mesh_compose import full_gradients
    from tests.integration.test_training_checkpoint import batches, make_model

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    reference = make_model()
    pm = dpcompile.transform(copy.deepcopy(reference), mesh, pipeline=2, micro_batches=micro, schedule=schedule,
                             tensor_parallel=True, example_inputs=batches()[0])  # fmt: skip
    ((tied, stages),) = pm.shared
    assert stages == (0, 1) and {"embed.weight", "head.weight"} & set(pm.shards)
    assert tied.shape == (16, 12) and any(tied is p for p in pm.parameters())
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    expected_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for step, batch in enumerate(batches()):
        loss = pm(*batch)
        expected = reference(*batch)
        expected.backward()
        if mesh.get_local_rank("pp") == 1:
            torch.testing.assert_close(loss, expected.detach(), msg=lambda m, step=step: f"step {step} loss: {m}")
        for name, grad in full_gradients(pm).items():
            torch.testing.assert_close(grad, reference.get_parameter(name).grad,
                                       msg=lambda m, name=name, step=step: f"step {step}, {name}: {m}")  # fmt: skip
        opt.step()
        expected_opt.step()
        opt.zero_grad()
        expected_opt.zero_grad()
        copies = [torch.empty_like(tied) for _ in range(2)]
        dist.all_gather(copies, tied.detach(), group=mesh.get_group("pp"))
        assert torch.equal(copies[0], copies[1]), f"step {step}: the stages' copies of the tied shard parted"
    state = pm.state_dict()
    assert list(state) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"state_dict[{key!r}]: {m}")
    dist.barrier()


def check_tied_sharded_unlike_is_refused() -> None:
    """The embedding vocab-parallel in stage 0, its tied LM head whole in stage 1: refused on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.errors import DpCompileError
    from tests.integration.test_training_checkpoint import batches, make_model

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    with pytest.raises(DpCompileError, match=r"is sharded over 'tp' unlike on each stage .*stage 1: whole.*Plan its "):
        dpcompile.transform(make_model(), mesh, pipeline=2, tensor_parallel={"embed": "vocab"},
                            example_inputs=batches()[0])  # fmt: skip


BLOCK_LAYERS = tuple(f"blocks.{i}.{layer}" for i in range(2) for layer in ("q", "k", "v", "out", "up", "down"))
CHECKS = [
    ("gpipe_m1", ("gpipe", 1, MEGATRON)),
    ("gpipe_m2", ("gpipe", 2, MEGATRON, "stack", 2, (), False, True)),  # and verify
    ("gpipe_m4", ("gpipe", 4, MEGATRON)),
    ("1f1b_m2", ("1f1b", 2, MEGATRON)),
    ("1f1b_m4_then_step", ("1f1b", 4, MEGATRON, "stack", 2, (), True)),
    ("1f1b_m4_auto", ("1f1b", 4, True)),
    ("decoder_1f1b_m2_auto", ("1f1b", 2, True, "decoder", ["blocks.1"], ("emb", "lm_head", *BLOCK_LAYERS), True)),
]


TIED_CHECKS = [
    ("tied_gpipe_m2", functools.partial(check_tied_pipeline_tp, "gpipe", 2)),
    ("tied_1f1b_m2", functools.partial(check_tied_pipeline_tp, "1f1b", 2)),
    ("tied_sharded_unlike_refused", check_tied_sharded_unlike_is_refused),
]


def _entry(rank: int, world: int, port: int, results: mp.Queue) -> None:
    checks = [(name, functools.partial(check_pipeline_tp, *config)) for name, config in CHECKS]
    run_checks(rank, world, port, checks + TIED_CHECKS, results)


@pytest.fixture(scope="module")
def outcomes():
    return run_spawned(_entry, 4, timeout=GROUP_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.slow  # 4 processes spawned
@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
@pytest.mark.xdist_group("pipeline_mesh_tp")  # one spawned group, on one worker
def test_pipeline_over_pp_tp_mesh_equals_eager(outcomes, name):
    """A ("pp", "tp") mesh of 2 x 2: loss, outputs and every gradient (tp shards gathered) as eager."""
    assert_group_passed(outcomes, 4, name, timeout=GROUP_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.slow  # the same spawned group
@pytest.mark.parametrize("name", [name for name, _ in TIED_CHECKS])
@pytest.mark.xdist_group("pipeline_mesh_tp")
def test_weight_tied_across_pp_tp_stages_trains_as_eager(outcomes, name):
    """The embedding tied to the LM head across stages of a ("pp", "tp") mesh: each stage keeps its copy
    of shard t, their gradients summed over the pp group of tp rank t; 3 AdamW steps as eager. Readers
    that shard it unlike each other are refused."""
    assert_group_passed(outcomes, 4, name, timeout=GROUP_TIMEOUT_S)


def test_pipeline_mesh_names_its_tensor_parallel_dimension():
    """A "tp" dimension needs tensor_parallel=, tensor_parallel= needs a "tp" dimension; "dp" and
    "tp" together are built (data_parallel="fsdp" needs "dp"); a dimension beside them is not."""
    from dpcompile.errors import DpCompileError
    from dpcompile.recipes.pipeline_mesh import check_pipeline_mesh

    check_pipeline_mesh(("pp", "tp"), True)
    check_pipeline_mesh(("pp", "tp"), MEGATRON)
    with pytest.raises(ValueError, match="pass tensor_parallel=True"):
        check_pipeline_mesh(("pp", "tp"))
    with pytest.raises(ValueError, match="has none; build a \\('pp', 'tp'\\) mesh"):
        check_pipeline_mesh(("pp", "dp"), True)
    check_pipeline_mesh(("pp", "dp", "tp"), True)
    check_pipeline_mesh(("pp", "dp", "tp"), True, "fsdp")
    with pytest.raises(ValueError, match="data_parallel=\"fsdp\" shards each stage over the mesh's 'dp'"):
        check_pipeline_mesh(("pp", "tp"), True, "fsdp")
    with pytest.raises(DpCompileError, match="names \\['cp'\\], which is not built yet"):
        check_pipeline_mesh(("pp", "cp"), False)
