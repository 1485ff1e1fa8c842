"""Pipeline parallelism over a gloo mesh: ``torch.distributed.pipelining`` runs dpcompile's stage
programs (``PipelineStage`` with ``ScheduleGPipe`` / ``Schedule1F1B``). The loss is the whole
batch's mean, every gradient the single-device one, on a ``("pp",)`` mesh of 2 and 4 processes
and a ``("pp", "dp")`` mesh of 4: an MLP stack, a transformers decoder through the export
frontend (GPT-2 with ``labels=``, its tied ``wte``/``lm_head``) and a CNN with BatchNorm, with 1, 2
and 4 micro-batches and an uneven last one (a batch of 7 in 4 runs as 3 micro-batches of 2, then
one of 1: two steps of equal micro-batches).

Spawning is the expensive part: each process group runs a whole scenario and reports each
check's outcome (the pattern of ``test_spmd.py``).
"""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch
import torch.multiprocessing as mp

from tests.gloo_groups import CAPTURED, assert_group_passed, run_checks, run_spawned
from tests.helpers import assert_mesh_pipeline_verifies, assert_stage_is_a_parallel_module, assert_whole_state_loads
from tests.integration.test_export_mesh import check_pipeline_round_trip_in_group

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # 6 processes spawned in all; GPT-2 exported once a process
GROUP_TIMEOUT_S = 240.0  # a loaded 2-core machine; unloaded a group takes well under a minute


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
    rank: int, world: int, shape: tuple[int, ...], names: tuple[str, ...], schedule: str, micro: int, batch: int = 8,
    verify: bool = False,
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
    x, labels = _inputs(batch)
    pm = dpcompile.transform(model, mesh, pipeline=mesh.size(0), micro_batches=micro, schedule=schedule)
    out = pm(*local_batch((x, labels), mesh))
    expected_logits, expected_loss = reference(x, labels)
    expected_loss.backward()
    pp_rank = mesh.get_local_rank("pp")
    if pp_rank == mesh.size(0) - 1:
        logits, loss = out
        torch.testing.assert_close(loss, expected_loss)
        torch.testing.assert_close(logits, local_batch(expected_logits.detach(), mesh))
        loss.backward()  # the step ran it: the usual loop's one backward adds nothing
        try:  # the logits have no gradient path: a backward through them refuses instead of being dropped
            logits.sum().backward()
        except dpcompile.DpCompileError as e:
            assert "no gradient path" in str(e) and "return it" in str(e)
        else:
            raise AssertionError("a backward through the returned logits was not refused")
    else:
        assert out is None
    _grads_equal_on_stage(model, reference, pm.module_paths)
    assert_stage_is_a_parallel_module(pm)
    assert_whole_state_loads(pm, reference.state_dict())
    if verify:  # the whole batch on every rank; each dp rank runs its share
        assert_mesh_pipeline_verifies(pm, model, x, labels)
    dist.barrier()


def _grads_equal_on_stage(model, reference, module_paths) -> None:
    """This stage's parameters have eager's gradients; the others none (another rank's stage)."""
    mine = set(module_paths)
    checked = 0
    for name, p in model.named_parameters():
        if name.rpartition(".")[0] in mine:
            q = reference.get_parameter(name)
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")
            checked += 1
        else:
            assert p.grad is None, f"{name} is another stage's, yet has a gradient here"
    assert checked > 0


def _gpt2_decoder() -> tuple[torch.nn.Module, dict]:
    """The tiny GPT-2 (float64, no dropout) and its batch (labels, the first row's first 5 ignored)."""
    from tests.thirdparty import import_or_skip

    T = import_or_skip("transformers")
    V = 64
    torch.manual_seed(0)
    config = T.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=V, n_positions=16, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)  # fmt: skip
    model = T.GPT2LMHeadModel(config).double()
    g = torch.Generator().manual_seed(0)
    kwargs = {"input_ids": torch.randint(1, V, (5, 8), generator=g), "labels": torch.randint(0, V, (5, 8), generator=g)}
    kwargs["labels"][0, :5] = -100
    return model, kwargs


def _decoder_program(model: torch.nn.Module, kwargs: dict) -> torch.nn.Module:
    """``model`` captured with the export frontend on ``kwargs``: captured once per process (in the
    fork server the ranks start from: ``export_for_ranks``), each call a copy that holds ``model``'s
    own parameters (the checks read their gradients), as ``capture_model(model)`` gives."""
    import warnings

    from dpcompile.capture import capture_model

    key = ("pipeline_mesh", "gpt2")
    if key not in CAPTURED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            CAPTURED[key] = capture_model(copy.deepcopy(model), frontend="export", example_kwargs=kwargs)[0]
    captured = CAPTURED[key]
    own = {id(p): model.get_parameter(name) for name, p in captured.named_parameters(remove_duplicate=False)}
    return copy.deepcopy(captured, memo=own)


def export_for_ranks() -> None:
    """Capture GPT-2 as ``check_decoder`` does, in the fork server the ranks start from
    (``run_spawned(prepare=)``, ``tests/gloo_rank_imports.py``), so that the 2 and 4 ranks copy the
    program instead of each exporting it again (about 1.5 s of CPU a rank)."""
    _decoder_program(*_gpt2_decoder())


def check_decoder(rank: int, world: int, configs: tuple) -> None:
    """GPT-2 (tiny, float64) exported once per process (the fork server's copy), then one pipeline
    per (micro, schedule) config over a ("pp",) mesh: logits, the mean loss over non-ignored tokens,
    every gradient (the tied wte/lm_head weight: summed over the two stages that read it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    reference, kwargs = _gpt2_decoder()
    model = copy.deepcopy(reference)
    exported = _decoder_program(model, kwargs)
    assert {id(p) for p in exported.parameters()} == {id(p) for p in model.parameters()}  # the model's own
    expected = reference(**kwargs)
    expected.loss.backward()
    for micro, schedule in configs:
        model.zero_grad(set_to_none=True)
        pm = dpcompile.transform(exported, mesh, pipeline=world, micro_batches=micro, schedule=schedule,
                                 example_kwargs=kwargs)  # fmt: skip
        out = pm(**kwargs)
        assert pm.bubble_fraction == (world - 1) / (micro + world - 1)  # a stage knows the stage count
        if rank == world - 1:
            torch.testing.assert_close(out.loss, expected.loss)
            torch.testing.assert_close(out.logits, expected.logits)
        else:
            assert out is None
        tied = {"transformer.wte", "lm_head"}  # one Parameter: named wte.weight, read by both ends
        paths = set(pm.module_paths) | (tied if tied & set(pm.module_paths) else set())
        _grads_equal_on_stage(model, reference, paths)
    result = dpcompile.verify(pm, model, **kwargs)  # keyword inputs, a ModelOutput, the tied weight on two stages
    assert result.ok and result.checked["outputs"] == 2, result
    dist.barrier()


class BNClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.conv1, self.bn1 = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.conv2, self.bn2 = nn.Conv2d(6, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x, labels):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        logits = self.fc(x.mean((2, 3)))
        return logits, torch.nn.functional.cross_entropy(logits, labels)


def check_batchnorm(rank: int, world: int, eval_micro: tuple[int, ...]) -> None:
    """A CNN with BatchNorm over a ("pp",) mesh: in training with micro_batches=1 (logits, loss,
    gradients, running statistics as eager); in eval mode with ``eval_micro`` micro-batches (a batch
    of 7: uneven); in training with 2 micro-batches refused, at transform and at a call."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.errors import DpCompileError

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    reference = BNClassifier()
    model = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(2)
    x, labels = torch.randn(7, 3, 6, 6, generator=g), torch.randint(0, 4, (7,), generator=g)
    last = rank == world - 1
    pm = dpcompile.transform(model, mesh, pipeline=world, micro_batches=1)
    out = pm(x, labels)
    expected_logits, expected_loss = reference(x, labels)
    expected_loss.backward()
    if last:
        torch.testing.assert_close(out[0], expected_logits.detach())
        torch.testing.assert_close(out[1], expected_loss)
    _grads_equal_on_stage(model, reference, pm.module_paths)
    for name, b in model.named_buffers():
        if name.rpartition(".")[0] in pm.module_paths:
            torch.testing.assert_close(b, reference.get_buffer(name), msg=lambda m, name=name: f"{name}: {m}")
    result = dpcompile.verify(pm, model, x, labels)  # running statistics: each rank its stage's
    assert result.ok and result.checked["buffers"] == 6 and result.checked["parameter gradients"] == 10, result
    model.eval()
    reference.eval()
    expected_logits, expected_loss = reference(x, labels)
    for micro in eval_micro:
        out = dpcompile.transform(model, mesh, pipeline=world, micro_batches=micro)(x, labels)
        if last:
            torch.testing.assert_close(out[0], expected_logits)
            torch.testing.assert_close(out[1], expected_loss)
    pm = dpcompile.transform(model, mesh, pipeline=world, micro_batches=2)
    model.train()
    for attempt in (lambda: pm(x, labels), lambda: dpcompile.transform(model, mesh, pipeline=world, micro_batches=2)):
        try:
            attempt()
        except DpCompileError as e:
            assert "one micro-batch at a time" in str(e) and "micro_batches=1" in str(e) and "eval mode" in str(e)
        else:
            raise AssertionError("BatchNorm in training with 2 micro-batches over a mesh was not refused")
    dist.barrier()


class Counted(torch.nn.Module):
    """A step counter written in forward (``self.calls.add_(1)``) and read again after the write, an
    EMA of a parameter; with ``batch_ema``, an EMA of an activation's batch mean too."""

    def __init__(self, batch_ema: bool = False):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
        self.batch_ema = batch_ema
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("weight_ema", torch.zeros(3, 8))
        self.register_buffer("feature_ema", torch.zeros(8))

    def forward(self, x, labels):
        self.calls.add_(1)
        self.weight_ema.mul_(0.5).add_(self.b.weight.detach(), alpha=0.5)
        h = torch.tanh(self.a(x))
        if self.batch_ema:
            self.feature_ema.mul_(0.9).add_(0.1 * h.detach().mean(0))
        logits = self.b(h) * (1 + self.calls / 10)
        return logits, torch.nn.functional.cross_entropy(logits, labels)


def check_writes(rank: int, world: int) -> None:
    """Writes in forward over a ("pp",) mesh with 2 micro-batches: a counter and an EMA of a parameter
    run once per call on the rank holding them (buffers and loss equal eager's after each call); an
    EMA of an activation's batch mean would run once per micro-batch: refused, naming it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    reference = Counted().double()
    model = copy.deepcopy(reference)
    x, labels = _inputs(6)
    pm = dpcompile.transform(model, mesh, pipeline=["b"], micro_batches=2, schedule="1f1b")  # a, then b
    writes_here = pm.writes_once is not None
    for _ in range(2):
        out = pm(x.double(), labels)
        expected = reference(x.double(), labels)[1]
        if rank == world - 1:
            torch.testing.assert_close(out[1], expected.detach())
        mine = [name for name in ("calls", "weight_ema") if writes_here and f"self.{name}" in pm.writes_once.code]
        for name in mine:  # the rank whose stage makes the write holds eager's value
            torch.testing.assert_close(model.get_buffer(name), reference.get_buffer(name), msg=name)
    assert int(reference.calls) == 2
    checked = torch.tensor(len(mine))
    dist.all_reduce(checked)
    assert int(checked) == 2, "each write runs on one rank"
    try:
        dpcompile.transform(Counted(batch_ema=True), mesh, pipeline=["b"], micro_batches=2)
    except dpcompile.DpCompileError as e:
        assert "add_" in str(e) and "2 times a call" in str(e) and "one process" in str(e)
    else:
        raise AssertionError("an EMA of a batch mean with 2 micro-batches over a mesh was not refused")
    try:  # a statistic over the batch read by the next op would be each micro-batch's
        dpcompile.transform(Centered(), mesh, pipeline=["b"], micro_batches=2)
    except dpcompile.DpCompileError as e:
        assert "mixes the rows of the batch" in str(e) and "micro_batches=1" in str(e) and "sub" in str(e)
    else:
        raise AssertionError("a batch-centred activation with 2 micro-batches over a mesh was not refused")
    dist.barrier()


class Centered(torch.nn.Module):
    """``h - h.mean(0, keepdim=True)``: runs split (a partial mean), but couples the micro-batches."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

    def forward(self, x, labels):
        h = torch.tanh(self.a(x))
        logits = self.b(h - h.mean(0, keepdim=True))
        return logits, torch.nn.functional.cross_entropy(logits, labels)


class EarlyOutput(torch.nn.Module):
    """Returns, next to the loss, the first layer's activations (made on stage 0); with ``aux``, a
    second mean too."""

    def __init__(self, aux: bool = False):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(4)])
        self.head, self.aux = torch.nn.Linear(8, 3), aux

    def forward(self, x, labels):
        early = h = torch.tanh(self.layers[0](x))
        for layer in self.layers[1:]:
            h = torch.tanh(layer(h))
        loss = torch.nn.functional.cross_entropy(self.head(h), labels)
        return (loss, early, early.square().mean()) if self.aux else (loss, early)


def check_earlier_stage_output(rank: int, world: int) -> None:
    """``return loss, early`` with ``early`` made on stage 0 (1F1B, 2 micro-batches, an uneven batch
    of 7): it passes through to the last stage, which returns it as eager's; loss and each stage's
    gradients as eager. A second mean returned is refused on every rank, naming it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    reference = EarlyOutput()
    model = copy.deepcopy(reference)
    x, labels = _inputs(7)
    pm = dpcompile.transform(model, mesh, pipeline=world, micro_batches=2, schedule="1f1b")
    out = pm(x, labels)
    expected_loss, expected_early = reference(x, labels)
    expected_loss.backward()
    if rank == world - 1:
        torch.testing.assert_close(out[0], expected_loss)
        torch.testing.assert_close(out[1], expected_early.detach())
    else:
        assert out is None
    _grads_equal_on_stage(model, reference, pm.module_paths)
    try:
        dpcompile.transform(EarlyOutput(aux=True), mesh, pipeline=world, micro_batches=2)
    except dpcompile.DpCompileError as e:
        assert "'mean' is a second mean" in str(e) and "into the loss" in str(e)
    else:
        raise AssertionError("a second mean output over a mesh was not refused")
    dist.barrier()


def check_inspection(rank: int, world: int) -> None:
    """verify over a ("pp",) mesh: OK as eager (each rank its stage's gradients, the last the outputs),
    the same verdict on every rank; a weight corrupted on one rank's eager model: the same mismatches
    on every rank; one rank's inputs failing its eager run, or differing from another rank's: the same
    DpCompileError on every rank, before the schedule (never a hang). explain with inputs and measure
    are refused alike with the way out; call_key and model_changed_since_transform name what to use."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    model = _stack()
    x, labels = _inputs(8)
    pm = dpcompile.transform(model, mesh, pipeline=world, micro_batches=2, schedule="1f1b")
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def every_rank(value) -> list:
        gathered = [None] * world
        dist.all_gather_object(gathered, value)
        return gathered

    result = dpcompile.verify(pm, model, x, labels)
    assert result.ok and result.checked["parameter gradients"] == 10 and result.checked["outputs"] == 2, result
    assert all(p.grad is None for p in model.parameters())  # verify leaves no trace
    with torch.no_grad():
        model.layers[0].weight.add_(rank)  # stage 0's weight, corrupted on the other rank's eager model
    corrupted = dpcompile.verify(pm, model, x, labels)
    with torch.no_grad():
        model.layers[0].weight.sub_(rank)
    assert not corrupted.ok and any(m.kind == "gradient" for m in corrupted.mismatches), corrupted
    assert len(set(every_rank(str(corrupted)))) == 1
    refusals = []
    for inputs in ((x[:, :5] if rank else x, labels), (x + rank, labels)):
        try:
            dpcompile.verify(pm, model, *inputs)
        except dpcompile.DpCompileError as e:
            refusals.append(str(e))
        else:
            raise AssertionError(f"verify with rank 1's inputs {inputs[0].shape} was not refused")
    assert "rank 1: RuntimeError" in refusals[0] and "fails on every rank" in refusals[0], refusals
    assert "same inputs on every rank" in refusals[1], refusals
    for name, attempt in (("explain", lambda: dpcompile.explain(pm, x, labels)),
                          ("measure", lambda: dpcompile.measure(pm, x, labels)),
                          ("measure without inputs", lambda: dpcompile.measure(pm)),
                          ("call_key", lambda: pm.call_key(x, labels)),
                          ("changed", pm.model_changed_since_transform)):  # fmt: skip
        try:
            attempt()
        except dpcompile.DpCompileError as e:
            refusals.append(str(e))
            assert "in one process" in str(e) or "pm.code" in str(e) or "transform(" in str(e), (name, e)
        else:
            raise AssertionError(f"{name} over a mesh pipeline was not refused")
    assert pm.batch_size((x, labels), {}) == 8
    assert all(seen == refusals for seen in every_rank(refusals))
    torch.testing.assert_close(dict(model.state_dict()), before)
    assert dpcompile.verify(pm, model, x, labels).ok  # the refusals left nothing behind


class SpectralNormed(torch.nn.Module):
    """A layer under ``parametrizations.spectral_norm`` (its power iteration updates ``_u``/``_v`` in training)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(8, 8))
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x, labels):
        return torch.nn.functional.cross_entropy(self.b(torch.relu(self.a(x))), labels)


def check_spectral_norm(rank: int, world: int) -> None:
    """spectral_norm over a ("pp",) mesh: PipelineStage ran the power iteration once per micro-batch (every
    gradient off); with 2 micro-batches it is refused by name, the model unchanged, and with one the loss and
    each stage's gradients and buffers equal eager's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model = SpectralNormed().double()
    reference = copy.deepcopy(model)
    x, labels = _inputs(6)
    try:
        dpcompile.transform(model, mesh, pipeline=2, micro_batches=2)
    except dpcompile.DpCompileError as e:
        assert "'a.parametrizations.weight'" in str(e) and "iterate 2 times a call" in str(e), e
    else:
        raise AssertionError("spectral_norm with 2 micro-batches over a mesh was not refused")
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0)
    pm = dpcompile.transform(model, mesh, pipeline=2, micro_batches=1)
    out, expected = pm(x.double(), labels), reference(x.double(), labels)
    expected.backward()
    if rank == world - 1:
        torch.testing.assert_close(out, expected.detach())
        out.backward()
    held = [(name, p) for name, p in pm.named_parameters() if p.grad is not None]
    assert held
    for name, p in held:
        torch.testing.assert_close(p.grad, reference.get_parameter(name).grad, msg=name)
    for key, value in pm.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[key], msg=key)
    dist.barrier()


def check_rank_raising_in_step(rank: int, world: int, shape: tuple[int, ...], names: tuple[str, ...],
                               ddp_options: dict | None = None, fsdp: bool = False) -> None:  # fmt: skip
    """One rank raises inside the step (a label out of range in its dp share: the loss on the last
    stage raises): every rank raises the same DpCompileError naming that rank, within seconds, not the
    group's 30 s timeout (its groups were shut down); later calls and verify refuse, naming it. On
    groups of its own (new_group), so the spawned group's world stays usable. With ``ddp_options``
    or ``fsdp`` the stages run under DDP or FSDP2 over "dp"."""
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import dpcompile
    from dpcompile.mesh import local_batch

    if len(shape) == 1:  # a 1-D mesh over the world would be the world's own group
        mesh = DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu", mesh_dim_names=names)
    else:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _stack()
    x, labels = _inputs(16)
    labels[-1] = 99  # the last row: the last dp rank's share, the last stage's loss
    options = {"ddp_options": ddp_options} if ddp_options else {"data_parallel": "fsdp"} if fsdp else {}
    pm = dpcompile.transform(model, mesh, pipeline=mesh.size(0), micro_batches=2, schedule="1f1b", **options)
    assert (pm.ddp is not None) == bool(ddp_options) and (pm.fsdp is not None) == fsdp
    failing = world - 1
    start = time.monotonic()
    try:
        pm(*local_batch((x, labels), mesh))
    except dpcompile.CollectiveError as e:  # a DpCompileError
        message, took = str(e), time.monotonic() - start
    else:
        raise AssertionError("a step in which a rank raised returned")
    assert f"failed on global rank {failing} (IndexError" in message and "out of bounds" in message, message
    assert took < 15.0, f"rank {rank} waited {took:.1f} s: for the group's timeout, not the failing rank"
    seen: list = [None] * world
    dist.all_gather_object(seen, message)
    assert len(set(seen)) == 1, seen
    for again in (lambda: pm(*local_batch((x, labels), mesh)), lambda: dpcompile.verify(pm, model, x, labels)):
        try:
            again()
        except dpcompile.DpCompileError as e:
            assert f"global rank {failing}" in str(e) and "again" in str(e), e
        else:
            raise AssertionError("a pipeline whose step failed ran again")
    dist.barrier()


def check_meta_model(rank: int, world: int, shape: tuple[int, ...], names: tuple[str, ...], frontends: tuple[str, ...],
                     plan: dict | None = None, ddp_options: dict | None = None) -> None:  # fmt: skip
    """A model built on meta (an embedding tied to the head across the stages, a rotary buffer no
    checkpoint holds): each rank gives memory to its stage only (its tp shards with ``plan``), waits
    for its weights, and after load_checkpoint runs a step with eager's loss and gradients
    (``ddp_options``: under DDP over "dp", built once the stage has memory)."""
    import os
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.fake import is_placeholder
    from dpcompile.mesh import local_batch
    from tests.integration.test_pipeline_edges import TiedRotaryLM
    from tests.integration.test_pipeline_mesh_compose import full_gradients

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    reference = TiedRotaryLM().double()
    ids, labels = torch.randint(0, 11, (4, 3)), torch.randint(0, 11, (4, 3))
    _, expected = reference(ids, labels)
    expected.backward()
    options = {"tensor_parallel": plan} if plan else {}
    options.update({"ddp_options": ddp_options} if ddp_options else {})
    with tempfile.TemporaryDirectory() as folder:  # each rank its own copy of the checkpoint
        path = os.path.join(folder, "model.safetensors")
        dpcompile.save_checkpoint(dpcompile.transform(copy.deepcopy(reference), ["cpu"]), path)
        for frontend in frontends:
            with torch.device("meta"):
                model = TiedRotaryLM().double()
            pm = dpcompile.transform(model, mesh, pipeline=2, micro_batches=2, example_inputs=(ids, labels),
                                     frontend=frontend, **options)  # fmt: skip
            held = [*pm.program.parameters(), *pm.program.buffers()]
            assert pm.needs_weights and held and not any(is_placeholder(t) for t in held), frontend
            assert (pm.ddp is not None) == bool(ddp_options), pm.ddp
            dpcompile.load_checkpoint(pm, path)
            assert not pm.needs_weights
            out = pm(*local_batch((ids, labels), mesh))  # ("pp", "dp"): each dp rank its share
            if mesh.get_local_rank("pp") == 1:
                torch.testing.assert_close(out[1], expected.detach())
            else:
                assert out is None
            grads = full_gradients(pm)
            assert grads and ("embed.weight" in grads or "head.weight" in grads), sorted(grads)
            for name, grad in grads.items():  # the tied weight's copy on each stage: the sum of both stages'
                torch.testing.assert_close(grad, reference.get_parameter(name).grad,
                                           msg=lambda m, name=name, frontend=frontend: f"{frontend} {name}: {m}")  # fmt: skip
    dist.barrier()


class TableReader(torch.nn.Module):
    """Every row reads a table given as an input: the table is not batched (5 rows, a batch of 8)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)

    def forward(self, x, table, labels):
        h = torch.tanh(self.a(x) + table.sum(0))
        return torch.nn.functional.cross_entropy(self.b(h), labels)


class TimeMajor(torch.nn.Module):
    """Inputs (time, batch, 4), a cumulative sum over time: the batch is dim 1."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.cumsum(self.a(x), 0))


def check_input_dims(rank: int, world: int) -> None:
    """An input the batch does not run through (a table of 5 rows beside a batch of 8) goes whole to
    every micro-batch, as eager reads it (main split it along dim 0 with the batch: other values,
    silently): the loss and each gradient as eager's, with 2 micro-batches and with an uneven batch
    of 7 in 4. A batch along dim 1 (batch_dim=1) is honoured with one micro-batch and refused by
    name, on every rank, with several (the schedule splits dim 0: main split the time, silently)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    g = torch.Generator().manual_seed(3)
    for batch, micro in ((8, 2), (7, 4)):
        torch.manual_seed(0)
        reference = TableReader()
        model = copy.deepcopy(reference)
        x, table, labels = torch.randn(batch, 4, generator=g), torch.randn(5, 8, generator=g), torch.randint(0, 3, (batch,))
        pm = dpcompile.transform(model, mesh, pipeline=2, micro_batches=micro, example_inputs=(x, table, labels))
        loss = pm(x, table, labels)
        expected = reference(x, table, labels)
        expected.backward()
        if rank == 1:
            torch.testing.assert_close(loss, expected.detach())
        _grads_equal_on_stage(model, reference, pm.module_paths)
    torch.manual_seed(0)
    reference = TimeMajor()
    x = torch.randn(6, 4, 4, generator=g)
    pm = dpcompile.transform(copy.deepcopy(reference), mesh, pipeline=2, batch_dim=1, example_inputs=(x,))
    with torch.no_grad():
        out = pm(x)
        if rank == 1:
            torch.testing.assert_close(out, reference(x))
    try:
        dpcompile.transform(copy.deepcopy(reference), mesh, pipeline=2, micro_batches=2, batch_dim=1, example_inputs=(x,))
    except dpcompile.DpCompileError as e:
        assert "'x' along dim 1" in str(e) and "micro_batches=1" in str(e), e
    else:
        raise AssertionError("a batch along dim 1 with 2 micro-batches over a mesh was not refused")
    dist.barrier()


class OptionalBias(torch.nn.Module):
    """``if bias is not None:`` on an optional argument the examples leave None."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)

    def forward(self, x, labels, bias=None):
        h = torch.relu(self.a(x))
        if bias is not None:
            h = h + bias
        return torch.nn.functional.cross_entropy(self.b(h), labels)


def check_arguments_left_none(rank: int, world: int) -> None:
    """An optional argument the examples leave None, on which forward branches, is traced as None:
    ``pm(x, labels)`` and ``pm(x, labels, bias=None)`` give eager's loss and gradients (main traced
    ``bias`` as a tensor: "missing argument 'bias'", a crash on None, ``bias`` split over the
    micro-batches); a call passing it, a misspelt keyword or one argument too many is refused by name
    on every rank, before the step (main dropped an unknown keyword silently)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    g = torch.Generator().manual_seed(5)
    x, labels = torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)
    torch.manual_seed(0)
    reference = OptionalBias()
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, mesh, pipeline=2, micro_batches=2, example_inputs=(x, labels))
    for kwargs in ({}, {"bias": None}):
        loss = pm(x, labels, **kwargs)
        expected = reference(x, labels)
        expected.backward()
        if rank == 1:
            torch.testing.assert_close(loss, expected.detach())
        _grads_equal_on_stage(model, reference, pm.module_paths)
    for call, refusal in (({"bias": torch.ones(8)}, "built with 'bias' left None"),
                          ({"biass": None}, "unexpected argument 'biass'")):  # fmt: skip
        try:
            pm(x, labels, **call)
        except dpcompile.DpCompileError as e:
            assert refusal in str(e), e
        else:
            raise AssertionError(f"pm(x, labels, **{call}) was not refused")
    try:
        pm(x, labels, None, 3)
    except dpcompile.DpCompileError as e:
        assert "4 were given" in str(e), e
    else:
        raise AssertionError("a call with one argument too many was not refused")
    dist.barrier()


class ScaledPair(torch.nn.Module):
    """Outputs ``(y * scale, x.mean())``: the last stage's cut refuses ``y * scale`` (no batch rule)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)

    def forward(self, x, scale=1.0):
        return self.b(torch.relu(self.a(x))) * scale, x.mean()


def check_cut_refused_on_every_stage(rank: int, world: int) -> None:
    """A refusal of the last stage's cut is raised by every stage's rank at transform (main: rank 1 raised,
    rank 0 built its stage and waited for rank 1 in its first step)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    try:
        dpcompile.transform(ScaledPair(), mesh, example_inputs=(torch.randn(4, 4),))
    except dpcompile.DpCompileError as e:
        assert "a pipeline's outputs must be split along the batch or be a mean loss" in str(e), e
        assert rank == 1 or "stage 1 of the pipeline refused its cut" in str(e), e
    else:
        raise AssertionError(f"rank {rank} built a pipeline whose last stage was refused")
    dist.barrier()


def check_cumulative_batchnorm(rank: int, world: int) -> None:
    """BatchNorm with ``momentum=None`` (a cumulative average: the factor is 1 / num_batches_tracked) in a
    ("pp",) pipeline of one micro-batch: two training calls give eager's loss, gradients and running
    statistics (main: every call failed on every rank, the stage shapes worked out on fake tensors
    read the count's value: DataDependentOutputException)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8, momentum=None), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))  # fmt: skip
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, mesh, pipeline=2, micro_batches=1)
    g = torch.Generator().manual_seed(4)
    for _ in range(2):
        x = torch.randn(6, 4, generator=g)
        with torch.no_grad():
            expected = reference(x)
        out = pm(x)
        if rank == 1:
            torch.testing.assert_close(out, expected)
    want, got = reference.state_dict(), pm.state_dict()
    assert list(got) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, msg=lambda m, key=key: f"state_dict[{key!r}]: {m}")
    assert int(got["1.num_batches_tracked"]) == 2
    dist.barrier()


def check_ddp_options(rank: int, world: int, kind: str, schedule: str, batch: int, options: dict) -> None:
    """ddp_options= over a ("pp", "dp") mesh: DDP over "dp" on each stage with those options (its
    bucket size, gradient_as_bucket_view), and it alone reduces over dp: 3 AdamW steps' losses, every
    gradient, then pm.state_dict() as eager's. ``kind``: an MLP stack, its tied variant (a weight
    summed over the stages too), or SquareMean (the count only the last stage finds); a ``batch``
    that does not divide runs two schedule steps a call. Refused on main ("not built yet")."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.mesh import local_batch
    from tests.integration.test_pipeline_mesh_compose import TiedStack, assert_steps_like_eager

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    reference = {"square": SquareMean, "tied": TiedStack}.get(kind, _stack)().double()
    model = copy.deepcopy(reference)
    x, labels = _inputs(batch)
    x, local = x.double(), local_batch((x.double(), labels), mesh)
    pm = dpcompile.transform(model, mesh, pipeline=2, micro_batches=2, schedule=schedule, ddp_options=options,
                             example_inputs=local)  # fmt: skip
    assert isinstance(pm.ddp, torch.nn.parallel.DistributedDataParallel) and pm.fsdp is None
    assert pm.ddp.process_group is mesh.get_group("dp")
    assert pm.ddp.bucket_bytes_cap == int(options["bucket_cap_mb"] * 1024 * 1024)
    assert pm.ddp.gradient_as_bucket_view is options.get("gradient_as_bucket_view", False)
    assert_steps_like_eager(pm, reference, local, (x, labels), mesh.get_local_rank("pp") == 1)
    dist.barrier()


def check_fsdp_unequal_micro_batches(rank: int, world: int) -> None:
    """data_parallel="fsdp" over a ("pp", "dp") mesh with micro-batches of unequal sizes: a global batch of 15
    (dp shares of 8 and 7: the 7 runs two schedule steps, the 8 is split alike, since FSDP reduce-scatters once
    per step), then a batch of 6 accumulated onto it (a new shape: a new schedule), then an AdamW step: the
    gradients and the state as eager's. On main each new schedule's set-up dropped the FSDP gradients held
    (torch's _post_metadata_inference_cleanup), and the 8/7 shares hung or crashed."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.mesh import local_batch
    from tests.integration.test_pipeline_mesh_compose import full_gradients

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    reference = _stack().double()
    pm = dpcompile.transform(copy.deepcopy(reference), mesh, pipeline=2, micro_batches=2, schedule="1f1b",
                             data_parallel="fsdp")  # fmt: skip
    for batch in (15, 6):  # the second call's gradients added to the first's, as eager's
        x, labels = _inputs(batch)
        pm(*local_batch((x.double(), labels), mesh))
        reference(x.double(), labels)[1].backward()
        for name, grad in full_gradients(pm).items():
            torch.testing.assert_close(grad, reference.get_parameter(name).grad,
                                       msg=lambda m, name=name, batch=batch: f"batch {batch}, {name}: {m}")  # fmt: skip
    torch.optim.AdamW(pm.parameters(), lr=0.05).step()
    torch.optim.AdamW(reference.parameters(), lr=0.05).step()
    state = pm.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"state_dict[{key!r}]: {m}")
    dist.barrier()


def check_batchnorm_over_dp(rank: int, world: int) -> None:
    """BatchNorm in training over a ("pp", "dp") mesh is refused by name, at transform and at a call
    (main: each dp rank normalised with its share of the batch, silently: other gradients and running
    statistics); in eval mode it runs as eager."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.mesh import local_batch

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    model = BNClassifier()
    g = torch.Generator().manual_seed(2)
    x, labels = torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
    message = "BatchNorm with batch statistics (bn1, bn2) over a pipeline mesh with a 'dp' dimension of 2"
    for options in ({}, {"ddp_options": {"broadcast_buffers": True}}):
        with pytest.raises(dpcompile.DpCompileError, match=re.escape(message)):
            dpcompile.transform(model, mesh, pipeline=2, micro_batches=1, **options)
    model.eval()
    pm = dpcompile.transform(model, mesh, pipeline=2, micro_batches=1)
    out = pm(*local_batch((x, labels), mesh))
    if mesh.get_local_rank("pp") == 1:
        torch.testing.assert_close(out[1], model(x, labels)[1])
    pm.train()
    with pytest.raises(dpcompile.DpCompileError, match=re.escape(message)):
        pm(*local_batch((x, labels), mesh))
    dist.barrier()


def check_meta_model_fsdp(rank: int, world: int, shape: tuple[int, ...], names: tuple[str, ...], frontend: str,
                          plan: dict | None = None) -> None:  # fmt: skip
    """A model built on meta with data_parallel="fsdp" over a ("pp", "dp") or ("pp", "dp", "tp") mesh:
    each rank allocates its stage, FSDP2 shards it (each parameter this rank's rows, none whole), and
    load_checkpoint fills them. Then 3 AdamW steps as eager's (the model built
    on CPU from the same checkpoint): the loss, every gradient, and pm.state_dict() after the steps
    (the model's keys, whole tensors, on every rank). Refused on main ("not built yet")."""
    import os
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.mesh import local_batch
    from tests.integration.test_pipeline_edges import TiedRotaryLM
    from tests.integration.test_pipeline_mesh_compose import assert_steps_like_eager

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    saved = TiedRotaryLM().double()
    ids, labels = torch.randint(0, 11, (8, 3)), torch.randint(0, 11, (8, 3))
    options = {"tensor_parallel": plan} if plan else {}
    with tempfile.TemporaryDirectory() as folder:  # each rank its own copy of the checkpoint
        path = os.path.join(folder, "model.safetensors")
        dpcompile.save_checkpoint(dpcompile.transform(copy.deepcopy(saved), ["cpu"]), path)
        reference = TiedRotaryLM().double()  # eager: built on CPU, from the checkpoint
        reference.load_state_dict(saved.state_dict())
        with torch.device("meta"):
            model = TiedRotaryLM().double()
        pm = dpcompile.transform(model, mesh, pipeline=2, micro_batches=2, example_inputs=(ids, labels),
                                 data_parallel="fsdp", frontend=frontend, **options)  # fmt: skip
        assert pm.needs_weights and pm.fsdp is not None
        for name, p in pm.program.named_parameters():  # this rank's rows of each; none whole
            assert type(p).__name__ == "DTensor" and not p.to_local().is_meta, name
            assert p.to_local().shape[0] < p.shape[0], (name, p.to_local().shape, p.shape)
        dpcompile.load_checkpoint(pm, path)
        assert not pm.needs_weights
    # each dp rank its share of the batch; the tied weight's copy on each stage: the sum of both stages'
    assert_steps_like_eager(pm, reference, local_batch((ids, labels), mesh), (ids, labels), mesh.get_local_rank("pp") == 1,
                            holds_any=("embed.weight", "head.weight"))  # fmt: skip
    dist.barrier()


def check_export(rank: int, world: int, layout: dict[str, int], data_parallel: str = "ddp", keywords=None) -> None:
    """Export over ``layout`` and load on every rank (``test_export_mesh.py``'s check)."""
    check_pipeline_round_trip_in_group(layout, data_parallel, **(keywords or {}))


# the automatic plan shards the tied head by rows and the embedding by vocab: refused, so both by vocab
TIED_ROTARY_PLAN = {"embed": "vocab", "head": "column", "blocks.0": "column", "blocks.1": "row"}
SCENARIOS = {
    "pp2": (2, [("gpipe_m1", check_pipeline, ((2,), ("pp",), "gpipe", 1)),
                ("gpipe_m4", check_pipeline, ((2,), ("pp",), "gpipe", 4)),
                ("1f1b_m4", check_pipeline, ((2,), ("pp",), "1f1b", 4)),
                ("square_mean", check_pipeline, ((2,), ("pp",), "square:gpipe", 2)),
                ("uneven_gpipe_m4", check_pipeline, ((2,), ("pp",), "gpipe", 4, 7)),
                ("uneven_1f1b_m4", check_pipeline, ((2,), ("pp",), "1f1b", 4, 10)),
                ("uneven_1f1b_m2", check_pipeline, ((2,), ("pp",), "1f1b", 2, 7)),
                ("uneven_square_mean", check_pipeline, ((2,), ("pp",), "square:1f1b", 4, 7)),
                ("decoder", check_decoder, (((1, "gpipe"), (2, "1f1b"), (4, "1f1b")),)),
                ("batchnorm", check_batchnorm, ((2, 4),)),
                ("writes", check_writes, ()),
                ("spectral_norm", check_spectral_norm, ()),
                ("earlier_stage_output", check_earlier_stage_output, ()),
                ("inspection", check_inspection, ()),
                ("rank_raising_in_step", check_rank_raising_in_step, ((2,), ("pp",))),
                ("meta_model", check_meta_model, ((2,), ("pp",), ("fx", "export"))),
                ("input_dims", check_input_dims, ()),
                ("arguments_left_none", check_arguments_left_none, ()),
                ("cut_refused_on_every_stage", check_cut_refused_on_every_stage, ()),
                ("cumulative_batchnorm", check_cumulative_batchnorm, ())]),
    "pp4": (4, [("gpipe_m2", check_pipeline, ((4,), ("pp",), "gpipe", 2)),
                ("1f1b_m4", check_pipeline, ((4,), ("pp",), "1f1b", 4)),
                ("pp_dp", check_pipeline, ((2, 2), ("pp", "dp"), "1f1b", 2, 16, True)),
                ("uneven_gpipe_m4", check_pipeline, ((4,), ("pp",), "gpipe", 4, 10)),
                ("1f1b_m1", check_pipeline, ((4,), ("pp",), "1f1b", 1, 7)),
                ("uneven_1f1b_m2", check_pipeline, ((4,), ("pp",), "1f1b", 2, 7)),
                ("uneven_1f1b_m4", check_pipeline, ((4,), ("pp",), "1f1b", 4, 9)),
                ("uneven_pp_dp", check_pipeline, ((2, 2), ("pp", "dp"), "gpipe", 2, 15)),
                # the count only the last stage finds: summed over dp too (each dp rank's was its own)
                ("pp_dp_square_mean", check_pipeline, ((2, 2), ("pp", "dp"), "square:1f1b", 2, 8)),
                ("decoder", check_decoder, (((2, "gpipe"), (4, "1f1b")),)),
                ("batchnorm", check_batchnorm, ((4,),)),
                ("pp_dp_rank_raising_in_step", check_rank_raising_in_step, ((2, 2), ("pp", "dp"))),
                ("meta_model_pp_tp", check_meta_model, ((2, 2), ("pp", "tp"), ("export",), TIED_ROTARY_PLAN)),
                ("meta_model_pp_dp", check_meta_model, ((2, 2), ("pp", "dp"), ("fx",))),
                ("meta_model_fsdp", check_meta_model_fsdp, ((2, 2), ("pp", "dp"), "fx")),
                ("meta_model_ddp_options", check_meta_model, ((2, 2), ("pp", "dp"), ("fx",), None, {"bucket_cap_mb": 1})),
                ("ddp_options_1f1b", check_ddp_options, ("mlp", "1f1b", 8, {"bucket_cap_mb": 1e-4})),
                ("ddp_options_tied_uneven", check_ddp_options,
                 ("tied", "gpipe", 14, {"bucket_cap_mb": 1, "gradient_as_bucket_view": True})),
                ("ddp_options_square_mean", check_ddp_options, ("square", "1f1b", 8, {"bucket_cap_mb": 1})),
                # dp shares of 8 and 7: DDP all-reduces once per schedule step, so both run two
                ("ddp_options_unequal_dp_shares", check_ddp_options,
                 ("mlp", "1f1b", 15, {"bucket_cap_mb": 1e-4, "find_unused_parameters": True})),
                ("fsdp_unequal_micro_batches", check_fsdp_unequal_micro_batches, ()),
                ("batchnorm_over_dp_refused", check_batchnorm_over_dp, ()),
                ("ddp_rank_raising_in_step", check_rank_raising_in_step,
                 ((2, 2), ("pp", "dp"), {"broadcast_buffers": False})),
                ("fsdp_rank_raising_in_step", check_rank_raising_in_step, ((2, 2), ("pp", "dp"), None, True)),
                # dpcompile.export over the mesh, load(path, mesh=) on every rank: trains as the original
                ("export_pp_dp", check_export, ({"pp": 2, "dp": 2}, "ddp", {"ddp_options": {"bucket_cap_mb": 1}})),
                ("export_pp_dp_tp_fsdp", check_export, ({"pp": 2, "dp": 2, "tp": 1}, "fsdp")),  # the 3-D mesh, on 4
                ("export_pp_tp", check_export, ({"pp": 2, "tp": 2}, "ddp", {"schedule": "1f1b"}))]),
}  # fmt: skip


def _entry(rank: int, world: int, port: int, scenario: str, results: mp.Queue) -> None:
    checks = [(name, functools.partial(check, rank, world, *config)) for name, check, config in SCENARIOS[scenario][1]]
    run_checks(rank, world, port, checks, results)


#: what the fork server calls before it forks either group's ranks (``run_spawned(prepare=)``)
PREPARE = "tests.integration.test_pipeline_mesh:export_for_ranks"


def run_group(scenario: str) -> dict[int, dict[str, str | None]]:
    return run_spawned(_entry, SCENARIOS[scenario][0], scenario, timeout=GROUP_TIMEOUT_S, prepare=[PREPARE])


@pytest.fixture(scope="module")
def outcomes():
    return {}


def _check(outcomes: dict, scenario: str, name: str) -> None:
    if scenario not in outcomes:
        outcomes[scenario] = run_group(scenario)
    assert_group_passed(outcomes[scenario], SCENARIOS[scenario][0], name, timeout=GROUP_TIMEOUT_S)


@pytest.mark.parametrize("name", [name for name, _, _ in SCENARIOS["pp2"][1]])
@pytest.mark.xdist_group("pipeline_mesh_2")  # one spawned group, on one worker
def test_pipeline_mesh_two_processes_equal_eager(outcomes, name):
    """A 2-process ("pp",) mesh: loss, outputs and each stage's gradients as eager (GPipe, 1F1B;
    a loss over labels, and one whose count only the last stage finds; uneven micro-batches;
    GPT-2 through the export frontend; BatchNorm with one micro-batch, or in eval mode; a value of
    stage 0 returned through the last; a model built on meta, loaded); verify, explain and measure give
    every rank the same answer."""
    _check(outcomes, "pp2", name)


@pytest.mark.parametrize("name", [name for name, _, _ in SCENARIOS["pp4"][1]])
@pytest.mark.xdist_group("pipeline_mesh_4")  # one spawned group, on one worker
def test_pipeline_mesh_four_processes_equal_eager(outcomes, name):
    """4 processes: a ("pp",) mesh of 4 stages, and a ("pp", "dp") mesh of 2 x 2, as eager; a model
    built on meta over ("pp", "tp") and ("pp", "dp"), and with FSDP or DDP over ("pp", "dp"), loaded;
    ddp_options= honoured (DDP on each stage)."""
    _check(outcomes, "pp4", name)
