"""Context parallel over a ``("cp",)`` DeviceMesh of 2 gloo processes: each rank passes its shard of
the sequence (``local_batch``: balanced ``tensor_split`` on dim 1) and gets its shard of the logits
and the whole sequence's loss. Against eager on the whole sequence (float64, a 1-layer GPT-2 with
``labels=``), at a length that divides and one that does not: the rank's logits, the loss, every
parameter gradient (summed over cp) and two AdamW steps; the same (no optimizer step) for Llama
(rotary, grouped-query heads), Mistral, Qwen2, Gemma, Phi, BERT (a padding mask, a pooled classifier),
RoBERTa (left padding, positions from a running sum), a T5 encoder and a ViT (the whole image on
every rank: its sequence is made inside), one check each; modules run
alike on whole values (a BatchNorm on the gathered sequence); a model cp cannot place is refused on
every rank with the same ``DpCompileError``. One spawned group of 2 runs those checks; one of 4 runs
small attention blocks (causal, a padding mask) over uneven shards and over a ("dp", "cp") mesh (GPT-2
over it: test_context_parallel_mesh_dp.py)."""

from __future__ import annotations

import functools

import pytest
import torch.multiprocessing as mp
from torch import nn

from tests.gloo_groups import assert_group_passed, run_checks, run_spawned
from tests.integration.test_context_parallel_all_to_all import check_all_to_all_over_a_cp_mesh
from tests.integration.test_context_parallel_balance import (
    check_balanced_block_on_four_ranks,
    check_balanced_models_over_a_cp_mesh,
)
from tests.integration.test_context_parallel_ring import MESH_CHECKS as RING_CHECKS

GROUP_TIMEOUT_S = 300.0  # spawning and the first gloo connections are slow on a loaded machine
WORLD = 2
V = 64


def _gpt2():
    import transformers as T

    config = T.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=V, n_positions=32, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return T.GPT2LMHeadModel(config).double()


def _inputs(seq: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(1, V, (2, seq), generator=g), "labels": torch.randint(0, V, (2, seq), generator=g)}


def _cp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))


def check_gpt2_equals_eager() -> None:
    """Logits (this rank's shard), loss, gradients (at 13 tokens accumulated over two calls) and 2 AdamW
    steps equal eager's, at 12 and 13 tokens."""
    import copy

    import torch
    import torch.distributed as dist

    import dpcompile
    from dpcompile.mesh import local_batch

    torch.manual_seed(0)
    model = _gpt2()
    eager = copy.deepcopy(model)
    mesh = _cp_mesh()
    rank = dist.get_rank()
    pm = dpcompile.transform(model, mesh, example_kwargs=local_batch(_inputs(12, 0), mesh), frontend="export")
    assert pm.mode == "spmd_context_parallel" and "attention_over_group" in pm.code, pm.code
    assert pm.layout == {"cp": WORLD} and pm.strategies == {"cp": "context parallel (all-gather keys/values)"}
    assert pm.strategy == "data_parallel"  # as mesh={"cp": N} in one process (main: "tensor_parallel")
    report = dpcompile.explain(pm, **local_batch(_inputs(12, 0), mesh))  # cp splits the batch: the fraction shown
    assert report.splits_batch and report.split_flop_fraction == 1.0  # whole: the causal mask, the loss's count
    assert report.whole and all(w["flops"] == 0 for w in report.whole), report.whole
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for seq, accumulated in ((12, 1), (13, 2)):  # at 13: two calls' gradients accumulate before the step
        mine = torch.tensor_split(torch.arange(seq), WORLD)[rank]
        for call in range(accumulated):
            whole = _inputs(seq, seq + call)
            got, want = pm(**local_batch(whole, mesh)), eager(**whole)
            torch.testing.assert_close(got.logits, want.logits[:, mine])
            torch.testing.assert_close(got.loss, want.loss)
            weights = torch.linspace(0.5, 1.5, want.logits.numel(), dtype=torch.float64).view(want.logits.shape)
            (got.loss + (got.logits * weights[:, mine]).sum()).backward()
            (want.loss + (want.logits * weights).sum()).backward()
        grads = dict(eager.named_parameters())
        for name, p in model.named_parameters():
            assert p.grad is not None, f"no gradient reached {name}"
            torch.testing.assert_close(p.grad, grads[name].grad, msg=lambda m, name=name, seq=seq: f"seq {seq}, grad {name}: {m}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, msg=lambda m, name=name, seq=seq: f"seq {seq}, AdamW, {name}: {m}")


def _matrix_model(name: str) -> nn.Module:
    """The tiny configs the one-process tests build (1 layer, d=32), in float64."""
    from tests.integration.test_context_parallel import _transformers_model
    from tests.integration.test_context_parallel_models import _model

    return (_transformers_model(name) if name in ("llama", "bert") else _model(name)).double()


def _matrix_inputs(name: str, seq: int, seed: int) -> dict:
    from tests.integration.test_context_parallel import _inputs as one_process_inputs
    from tests.integration.test_context_parallel_models import _inputs as more_inputs

    return one_process_inputs(name, seq, seed) if name in ("llama", "bert") else more_inputs(name, seq, seed)


def check_model_equals_eager(name: str) -> None:
    """``name``'s output (this rank's part of a per-token output, or the whole pooled one), loss and
    every parameter gradient equal eager's, at 12 and 13 tokens."""
    import copy

    import torch
    import torch.distributed as dist

    import dpcompile
    from dpcompile.mesh import local_batch

    torch.manual_seed(0)
    model = _matrix_model(name)
    eager = copy.deepcopy(model)
    mesh = _cp_mesh()
    rank = dist.get_rank()
    example = local_batch(_matrix_inputs(name, 12, 0), mesh)
    pm = dpcompile.transform(model, mesh, example_kwargs=example, frontend="export")
    assert "attention_over_group" in pm.code, pm.code
    key = "last_hidden_state" if name == "t5" else "logits"
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if name == "gemma" else {}  # its norms compute in float32
    for seq in (12, 13):
        whole = _matrix_inputs(name, seq, seq)
        got, want = pm(**local_batch(whole, mesh)), eager(**whole)
        out, expected = getattr(got, key), getattr(want, key)
        per_token = expected.dim() == 3  # (batch, seq, ...): the rank's tokens; a classifier's logits are whole
        mine = torch.tensor_split(torch.arange(seq), WORLD)[rank] if per_token else slice(None)
        torch.testing.assert_close(out, expected[:, mine])
        weights = torch.linspace(0.5, 1.5, expected.numel(), dtype=torch.float64).view(expected.shape)
        loss, expected_loss = (got.loss, want.loss) if want.get("loss") is not None else (0.0, 0.0)
        torch.testing.assert_close(loss, expected_loss)
        (loss + (out * weights[:, mine]).sum()).backward()
        (expected_loss + (expected * weights).sum()).backward()
        grads = dict(eager.named_parameters())
        for p_name, p in model.named_parameters():
            assert p.grad is not None, f"{name}: no gradient reached {p_name}"
            torch.testing.assert_close(p.grad, grads[p_name].grad, **tolerance,
                                       msg=lambda m, p_name=p_name, seq=seq: f"{name}, seq {seq}, grad {p_name}: {m}")  # fmt: skip
        model.zero_grad()
        eager.zero_grad()


def check_vit_equals_eager() -> None:
    """A ViT makes its sequence inside: every rank passes the whole image, its embedding (patches, CLS
    token, position embeddings) runs alike on every rank, then each rank's tokens. Logits, loss and
    every gradient equal eager's at 10 tokens (12x12 pixels: divides 2) and 17 (16x16: does not)."""
    import copy

    import torch

    import dpcompile
    from tests.helpers import assert_lm_step_equals_eager, model_gradients
    from tests.integration.test_context_parallel_models import _vit

    for image_size in (12, 16):
        torch.manual_seed(0)
        model = _vit(image_size).double()
        eager = copy.deepcopy(model)
        g = torch.Generator().manual_seed(image_size)
        inputs = {"pixel_values": torch.randn(2, 3, image_size, image_size, generator=g, dtype=torch.float64),
                  "labels": torch.tensor([0, 2])}  # fmt: skip
        pm = dpcompile.transform(model, _cp_mesh(), example_kwargs=inputs, frontend="export")
        assert "shard_of_whole" in pm.code and "attention_over_group" in pm.code, pm.code
        assert_lm_step_equals_eager(pm, eager, inputs, model_gradients(model))


MATRIX = ("llama", "mistral", "qwen2", "gemma", "phi", "bert", "roberta", "t5")


class SequenceBatchNorm(nn.Module):
    """BatchNorm over the channels of ``(batch, seq, 16)``: its statistics need every rank's tokens."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x):
        return self.bn(self.lin(x).transpose(1, 2)).transpose(1, 2)


class MeanSquareLoss(nn.Module):
    """A causal block that returns its output and a mean over every token (partial sums and counts per rank)."""

    def __init__(self):
        super().__init__()
        from tests.integration.test_context_parallel import CausalSelfAttention

        self.block = CausalSelfAttention()

    def forward(self, x):
        out = self.block(x)
        return out, out.square().mean()


def _refused_alike(model, x, *expected: str) -> None:
    """Building ``model`` over the cp mesh raises a DpCompileError saying ``expected``, the same on every rank."""
    import torch.distributed as dist

    import dpcompile
    from dpcompile import DpCompileError
    from dpcompile.mesh import local_batch

    mesh = _cp_mesh()
    try:
        dpcompile.transform(model, mesh, example_inputs=(local_batch(x, mesh),))
    except DpCompileError as e:
        message = str(e)
    else:
        raise AssertionError(f"{type(model).__name__} was built over the cp mesh")
    assert all(words in message for words in expected), message
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    assert len(set(messages)) == 1, messages


class SummaryBias(nn.Module):
    """Each token plus a linear map of the mean over every token: a module run on a whole value."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.summary = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        return h + self.summary(h.mean(1))[:, None]


def check_modules_on_whole_values_equal_eager() -> None:
    """A BatchNorm run on the gathered sequence and a linear map of the mean over every token run
    alike on every rank, on whole values: each rank returns the whole output, and backwarded alike,
    every gradient (those modules' scaled by 1/N: each rank gets the whole one) and BatchNorm's
    running statistics equal eager's, at 7 tokens."""
    import copy

    import torch

    import dpcompile
    from dpcompile.mesh import local_batch

    mesh = _cp_mesh()
    x = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for model in (SequenceBatchNorm().double(), SummaryBias().double()):
        eager = copy.deepcopy(model)
        pm = dpcompile.transform(model, mesh, example_inputs=(local_batch(x, mesh),))
        assert "scaling_parameter_gradients" in pm.code, pm.code
        got, want = pm(local_batch(x, mesh)), eager(x)
        torch.testing.assert_close(got, want)  # whole on every rank
        weights = torch.linspace(0.5, 1.5, want.numel(), dtype=torch.float64).view(want.shape)
        (got * weights).sum().backward()
        (want * weights).sum().backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            where = f"{type(model).__name__}.{name}"
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, where=where: f"{where}: {m}")
        for (name, b), c in zip(model.named_buffers(), eager.buffers()):
            torch.testing.assert_close(b, c, msg=lambda m, name=name: f"buffer {name}: {m}")


def check_unplaceable_models_refused_alike() -> None:
    """A rotary table read backwards (no rule splits it) and a dropout under exact_random (not built
    over a mesh) are refused by name on every rank, the same error."""
    import torch

    from tests.integration.test_context_parallel import CachedRotaryTable

    x = torch.randn(2, 7, 16)
    _refused_alike(CachedRotaryTable(reverse=True), x, "cannot run on sequence shards", "flip")
    _refused_alike(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1)), x, "draws random numbers", "exact_random=False")


def check_unbalanced_shards_refused_alike() -> None:
    """Shards of 5 and 2 tokens (not the 4 and 3 tensor_split makes of 7) are refused by every rank
    at the program's head, the same DpCompileError, before anything is computed."""
    import torch
    import torch.distributed as dist

    import dpcompile
    from dpcompile import DpCompileError
    from dpcompile.mesh import local_batch
    from tests.integration.test_context_parallel import CausalSelfAttention

    mesh = _cp_mesh()
    x = torch.randn(2, 7, 16)
    pm = dpcompile.transform(CausalSelfAttention(), mesh, example_inputs=(local_batch(x, mesh),))
    mine = x[:, :5] if dist.get_rank() == 0 else x[:, 5:]
    try:
        pm(mine)
    except DpCompileError as e:
        message = str(e)
    else:
        raise AssertionError("unbalanced shards ran")
    assert "have lengths [5, 2], but a sequence of 7 splits into [4, 3]" in message, message
    messages: list = [None] * WORLD
    dist.all_gather_object(messages, message)
    assert len(set(messages)) == 1, messages


def check_small_attention_on_four_ranks() -> None:
    """4 ranks, 7 tokens (shards 2, 2, 2, 1): causal attention at each rank's positions, a padding mask
    gathered along the keys (its gradient path summed onto owners), and a mean over every token (each
    rank's partial sum and count all-reduced); outputs, the mean and gradients equal eager. Calls that
    depart from the traced one (eval mode, an optional argument given) are traced again on every rank."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.mesh import local_batch
    from tests.integration.test_context_parallel import CausalSelfAttention, PaddedSelfAttention
    from tests.models import OptionalScale

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    mine = torch.tensor_split(torch.arange(7), 4)[dist.get_rank()]
    x = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 1:3] = False  # padding on the first ranks' tokens, read by every rank's queries
    for model, args in ((CausalSelfAttention(), (x,)), (PaddedSelfAttention(), (x, keep)), (MeanSquareLoss(), (x,))):
        model = model.double()
        eager = copy.deepcopy(model)
        pm = dpcompile.transform(model, mesh, example_inputs=local_batch(args, mesh))
        assert isinstance(model, MeanSquareLoss) == ("mean_over_group" in pm.code), pm.code
        got, want = pm(*local_batch(args, mesh)), eager(*args)
        got, want, got_mean, want_mean = (got[0], want[0], got[1], want[1]) if isinstance(got, tuple) else (got, want, 0, 0)
        torch.testing.assert_close(got, want[:, mine])
        torch.testing.assert_close(got_mean, want_mean)  # the same whole mean on every rank
        weights = torch.linspace(0.5, 1.5, want.numel(), dtype=torch.float64).view(want.shape)
        (got_mean + (got * weights[:, mine]).sum()).backward()
        (want_mean + (want * weights).sum()).backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            where = f"{type(model).__name__}.{name}"
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, where=where: f"{where}: {m}")
    model = OptionalScale().double()  # forward branches on self.training and on an optional argument
    eager = copy.deepcopy(model)
    x = x[..., :8]
    pm = dpcompile.transform(model, mesh, example_inputs=(local_batch(x, mesh),))
    pm.eval()
    eager.eval()
    torch.testing.assert_close(pm(local_batch(x, mesh)), eager(x)[:, mine])  # traced again, in eval mode
    pm.train()
    eager.train()
    scale = torch.tensor(2.0, dtype=torch.float64)
    torch.testing.assert_close(pm(local_batch(x, mesh), scale), eager(x, scale)[:, mine])  # and with scale=


def check_blocks_over_dp_and_cp() -> None:
    """A causal block over a ("dp", "cp") mesh of 2 x 2 ranks, 7 tokens (4 and 3 per cp rank): outputs
    equal eager's rows and tokens, and a summed loss's gradients are eager's over the whole batch halved
    (DDP averages over dp what each dp group sums over cp); a call in eval mode is traced again, and
    uneven rows (3: 2 and 1) run the same program."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.mesh import local_batch
    from tests.integration.test_context_parallel import CausalSelfAttention
    from tests.models import OptionalScale

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    x = torch.randn(4, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mine = torch.tensor_split(torch.arange(7), 2)[mesh.get_local_rank("cp")]

    def rows(n: int) -> torch.Tensor:
        return torch.tensor_split(torch.arange(n), 2)[mesh.get_local_rank("dp")]

    model = CausalSelfAttention().double()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, mesh, example_inputs=(local_batch(x, mesh),))
    got, want = pm(local_batch(x, mesh)), eager(x)
    torch.testing.assert_close(got, want[rows(4)][:, mine])
    weights = torch.linspace(0.5, 1.5, want.numel(), dtype=torch.float64).view(want.shape)
    (got * weights[rows(4)][:, mine]).sum().backward()
    (want * weights).sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad / 2, msg=lambda m, name=name: f"grad {name}: {m}")
    model = OptionalScale().double()
    eager = copy.deepcopy(model)
    x = x[..., :8]
    pm = dpcompile.transform(model, mesh, example_inputs=(local_batch(x, mesh),))
    pm.eval()
    eager.eval()
    torch.testing.assert_close(pm(local_batch(x, mesh)), eager(x)[rows(4)][:, mine])  # traced again, in eval mode
    torch.testing.assert_close(pm(local_batch(x[:3], mesh)), eager(x[:3])[rows(3)][:, mine])


def check_other_mode_in_place() -> None:
    """Exported once at transform; the first call in eval exports that mode and lowers this rank's
    program again in place (test_other_mode_in_place.py): eval equals eager's, then 2 more AdamW steps in
    training equal eager's (every gradient, the parameters), on the same parameter objects."""
    import copy

    import torch
    import torch.distributed as dist
    import torch.export

    import dpcompile
    from dpcompile.mesh import local_batch
    from tests.integration.test_other_mode_in_place import Scaled

    calls, real = [], torch.export.export
    torch.export.export = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        torch.manual_seed(0)
        model = Scaled().double()
        eager, mesh = copy.deepcopy(model), _cp_mesh()
        x = torch.randn(2, 6, 8, dtype=torch.float64)
        mine = torch.tensor_split(torch.arange(6), WORLD)[dist.get_rank()]
        pm = dpcompile.transform(model, mesh, example_kwargs=local_batch({"x": x}, mesh), frontend="export")
        params = list(pm.parameters())
        assert len(calls) == 1, calls
        pm.eval()
        torch.testing.assert_close(pm(x[:, mine]), eager.eval()(x)[:, mine])
        assert len(calls) == 2, calls
        pm.train()
        eager.train()
        opt, ref_opt = torch.optim.AdamW(pm.parameters(), lr=1e-2), torch.optim.AdamW(eager.parameters(), lr=1e-2)
        for _ in range(2):
            got, want = pm(x[:, mine]), eager(x)
            torch.testing.assert_close(got, want[:, mine])
            got.square().sum().backward()  # DDP averages the ranks' gradients, scaled to their sum: eager's
            want.square().sum().backward()
            for (name, p), q in zip(model.named_parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"grad {name}: {m}")
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p, q)
        assert all(p is q for p, q in zip(pm.parameters(), params, strict=True)) and len(calls) == 2
        _check_export_adds_the_other_mode(Scaled().double(), mesh, x, mine, calls)
    finally:
        torch.export.export = real


def _check_export_adds_the_other_mode(model, mesh, x, mine, calls) -> None:
    """Exported over the mesh before any call in the other mode, the folder holds both: export exports
    that mode first (every rank), and the loaded program's eval equals eager's."""
    import copy
    import shutil
    import tempfile

    import torch
    import torch.distributed as dist

    import dpcompile
    from dpcompile.mesh import local_batch

    eager, before = copy.deepcopy(model).eval(), len(calls)
    pm = dpcompile.transform(model, mesh, example_kwargs=local_batch({"x": x}, mesh), frontend="export")
    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    try:
        dpcompile.export(pm, f"{folder[0]}/out")
        assert len(calls) == before + 2, calls
        loaded = dpcompile.load(f"{folder[0]}/out", mesh=mesh).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(x[:, mine]), eager(x)[:, mine])
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(folder[0], ignore_errors=True)


CHECKS = (
    ("gpt2", check_gpt2_equals_eager),
    ("other_mode_in_place", check_other_mode_in_place),
    ("all_to_all", check_all_to_all_over_a_cp_mesh),  # test_context_parallel_all_to_all.py
    *((name, functools.partial(check_model_equals_eager, name)) for name in MATRIX),
    ("vit", check_vit_equals_eager),
    ("whole_modules", check_modules_on_whole_values_equal_eager),
    ("refused", check_unplaceable_models_refused_alike),
    ("unbalanced", check_unbalanced_shards_refused_alike),
    *RING_CHECKS,  # the ring exchange (test_context_parallel_ring.py), in this same group
    ("load_balance", check_balanced_models_over_a_cp_mesh),
)
CHECKS_4 = (
    ("attention_4", check_small_attention_on_four_ranks),
    ("blocks_dp_cp", check_blocks_over_dp_and_cp),
    ("load_balance_4", check_balanced_block_on_four_ranks),
)  # GPT-2 over ("dp", "cp"): test_context_parallel_mesh_dp.py


def _entry(rank: int, world: int, port: int, checks: tuple, results: mp.Queue) -> None:
    from tests.thirdparty import define_torchvision_ops

    define_torchvision_ops()
    run_checks(rank, world, port, list(checks), results)


@pytest.fixture(scope="module")
def outcomes():
    pytest.importorskip("transformers")
    return run_spawned(_entry, WORLD, CHECKS, timeout=GROUP_TIMEOUT_S)


@pytest.fixture(scope="module")
def outcomes_4():
    return run_spawned(_entry, 4, CHECKS_4, timeout=GROUP_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.slow  # one spawned group of 2 processes for every check
@pytest.mark.parametrize("check", [name for name, _ in CHECKS])
@pytest.mark.xdist_group("context_parallel_mesh")  # one spawned group, on one worker
def test_context_parallel_over_a_cp_mesh(outcomes, check):
    """Each check passed on both ranks (see the module's docstring)."""
    assert_group_passed(outcomes, WORLD, check, timeout=GROUP_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.slow  # one spawned group of 4 processes
@pytest.mark.xdist_group("context_parallel_mesh")
def test_context_parallel_over_four_cp_ranks(outcomes_4):
    """Causal attention and a gathered padding mask over 4 ranks with uneven shards equal eager."""
    assert_group_passed(outcomes_4, 4, "attention_4", timeout=GROUP_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.slow  # the same spawned group of 4 processes
@pytest.mark.xdist_group("context_parallel_mesh")
def test_context_parallel_over_a_dp_cp_mesh(outcomes_4):
    """A causal block over a 2 x 2 ("dp", "cp") mesh equals eager (outputs, gradients, eval mode, uneven rows)."""
    assert_group_passed(outcomes_4, 4, "blocks_dp_cp", timeout=GROUP_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.slow  # the same spawned group of 4 processes
@pytest.mark.xdist_group("context_parallel_mesh")
def test_load_balanced_attention_over_four_cp_ranks(outcomes_4):
    """load_balance=True over 4 ranks (all-to-all of query and output rows) equals eager (test_context_parallel_balance.py)."""
    assert_group_passed(outcomes_4, 4, "load_balance_4", timeout=GROUP_TIMEOUT_S)
