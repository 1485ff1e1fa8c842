"""``dpcompile.export`` / ``load`` of a program over a gloo ``DeviceMesh`` (``dpcompile/export/mesh.py``).

Every rank exports (rank 0 writes the single-device program and the layout) and every rank loads it
over the mesh: on ``("dp",)``, ``("tp",)``, ``("dp", "tp")`` and ``("pp",)`` meshes, and with FSDP2 over
``("dp",)`` and ``("dp", "tp")`` (repeated blocks wrapped one by one too), the loaded program's code is the
original's, its loss, every gradient and the parameters after 2 AdamW steps equal the original program's
and eager's (dropout after attention drawing the same masks: the examples' shapes are recorded), and its
``state_dict`` equals the original's (keys in the model's order, not forward's). Context parallel over
``("cp",)`` and ``("cp", "tp")`` the same (:func:`check_context_round_trip`). :func:`check_pipeline_round_trip_in_group`
runs the same in ``test_pipeline_mesh.py``'s group of 4 for ``("pp", "dp")`` (DDP with ``ddp_options=``),
``("pp", "tp")`` (1F1B) and ``("pp", "dp", "tp")`` of (2, 2, 1) with FSDP2. A ``("dp", "tp")`` export loads over other sizes (lowered for
them) and, without a mesh, as the single-device program. A mesh of other dimension names, a folder
exported without a mesh, a rank whose program is not the exported one, an edited layout: refused on
every rank; what cannot be recorded is refused by name, and a failure on rank 0 alone fails every
rank; neither writes anything. GPT-2 captured by the export frontend (``labels=``) over ``("dp",)``, ``("dp", "tp")``
(of (1, 2): its tp shards; ``("tp",)`` alone passes too, left out for the suite's time), ``("cp",)`` and ``("pp",)``
round-trips the same way (``("pp", "dp")`` too, run by hand in ``test_pipeline_mesh.py``'s group of 4: it
added 28 s there)
(:func:`check_export_frontend_round_trip`). A program the export frontend captured over ``("dp",)`` or ``("pp",)``
refuses a call that departs from what export fixed as one process does, on every rank alike where one rank's call
alone departs (:func:`check_export_frontend_arguments_refused_on_every_rank`). One group of 2 runs every check here.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.gloo_groups import CAPTURED, assert_group_passed, run_checks, run_spawned

pytestmark = [pytest.mark.distributed]
GROUP_TIMEOUT_S = 300.0
ROWS, SEQ = 4, 3  # rows of the global batch, tokens a row
PLAN = {"up": "column", "down": "row"}  # the ("dp", "tp") export's tensor_parallel=: a plan, recorded as one


class Net(nn.Module):
    """Linear, LayerNorm, an MLP pair (column, row), dropout, a non-persistent buffer, an unread int buffer, a head."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(16, 4)
        self.register_buffer("scale", torch.tensor(0.5, dtype=torch.float64), persistent=False)
        self.register_buffer("steps", torch.tensor(3))  # forward never reads it: the loaded state_dict holds it still

    def forward(self, x, labels):
        h = self.norm(self.inp(x))
        h = h + self.drop(torch.softmax(h @ h.transpose(1, 2) / 4, dim=-1) @ h)  # attention over the sequence
        h = self.drop(self.down(F.gelu(self.up(h)))) * self.scale + h
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class Blocks(nn.Module):
    """Repeated blocks (a ``ModuleList`` of ``block``), which ``data_parallel="fsdp"`` over a mesh wraps one by one."""

    def __init__(self, block=lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU())):
        super().__init__()
        self.layers = nn.ModuleList(block() for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x, labels):
        for layer in self.layers:
            x = x + layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class Block(nn.Module):
    """A block of a class a folder cannot hold (neither torch.nn nor registered)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(ROWS, SEQ, 8, generator=g, dtype=torch.float64),
            "labels": torch.randint(0, 4, (ROWS, SEQ), generator=g)}  # fmt: skip


def _mesh(layout: dict[str, int]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(layout.values()), mesh_dim_names=tuple(layout))


def _model(cls=Net) -> nn.Module:
    torch.manual_seed(0)
    return cls().double()


def _folder(root: str, name: str) -> Path:
    return Path(root) / name


def _tree_digest(folder: Path) -> dict[str, str] | None:
    if not folder.exists():
        return None
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _named(pm) -> dict[str, torch.Tensor]:
    return {n.removeprefix("module."): p for n, p in pm.named_parameters()}


def _whole(t: torch.Tensor) -> torch.Tensor:
    """An FSDP2 shard (a DTensor over "dp") all-gathered: a collective; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _trains_alike(layout: dict[str, int], mesh, pm, loaded, reference, *, bitwise: bool = True) -> None:
    """2 AdamW steps of ``pm``, ``loaded`` (this rank's part of the batch) and eager ``reference``
    (the whole batch): the loss, every gradient (this rank's shard) and the parameters after the steps;
    ``bitwise``: ``loaded``'s gradients are ``pm``'s bit for bit (the same weights)."""
    import torch.distributed as dist

    from dpcompile.runtime.tensor_parallel import shard_of

    dp = layout.get("dp", 1)
    dp_rank = mesh.get_local_rank("dp") if "dp" in layout else 0
    tp_rank = mesh.get_local_rank("tp") if "tp" in layout else 0
    rows = ROWS // dp
    batch = _batch()
    local = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in batch.items()}
    shards = getattr(pm, "shards", {}) or {}
    assert shards == (getattr(loaded, "shards", {}) or {})
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (pm, loaded, reference)]
    for step in range(2):
        torch.manual_seed(100 + step)
        expected = reference(**batch)
        expected.backward()
        for program in (pm, loaded):
            torch.manual_seed(100 + step)
            loss = program(**local)
            loss.backward()
            mean = loss.detach().clone()
            if dp > 1:
                dist.all_reduce(mean, group=mesh.get_group("dp"))
                mean /= dp
            torch.testing.assert_close(mean, expected.detach(), msg=lambda m, s=step: f"loss of step {s}: {m}")
        got, original = _named(loaded), _named(pm)
        assert sorted(got) == sorted(original)
        for key, p in reference.named_parameters():
            want = shard_of(p.grad, shards[key], tp_rank) if key in shards else p.grad
            grad = _whole(got[key].grad)
            torch.testing.assert_close(grad, want, msg=lambda m, k=key: f"grad {k}: {m}")
            torch.testing.assert_close(grad, _whole(original[key].grad), **({"rtol": 0, "atol": 0} if bitwise else {}))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    got = _named(loaded)
    for key, p in reference.named_parameters():
        want = shard_of(p.detach(), shards[key], tp_rank) if key in shards else p.detach()
        torch.testing.assert_close(_whole(got[key].detach()), want, msg=lambda m, k=key: f"param {k}: {m}")
    _assert_state_equal(loaded, reference, exact=False)


def _assert_state_equal(loaded, reference, *, exact: bool) -> None:
    """``state_dict()`` (a collective over tp: whole tensors) has the model's keys, in order, and values."""
    state, wanted = loaded.state_dict(), reference.state_dict()
    assert list(state) == list(wanted)
    for key, value in wanted.items():
        torch.testing.assert_close(state[key], value, **({"rtol": 0, "atol": 0} if exact else {}))


def _sgd_step(layout: dict[str, int], mesh, pm, reference) -> None:
    """One SGD step of ``pm`` (this rank's rows) and ``reference`` (the whole batch): the weights exported
    are trained ones, not the model's initial values."""
    dp = layout.get("dp", 1)
    dp_rank = mesh.get_local_rank("dp") if "dp" in layout else 0
    rows = ROWS // dp
    batch = _step_batch()
    _step(pm, {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in batch.items()})
    _step(reference, batch)


def _step_batch() -> dict[str, torch.Tensor]:
    return {k: v.flip(0) for k, v in _batch().items()}


def _step(module: nn.Module, data: dict[str, torch.Tensor]) -> None:
    torch.manual_seed(7)
    module(**data).backward()
    with torch.no_grad():
        for p in module.parameters():
            p -= 0.1 * p.grad
            p.grad = None


def _stepped_model() -> Net:
    """The eager model after :func:`_sgd_step`: what a folder exported by ``check_round_trip`` holds."""
    model = _model()
    _step(model, _step_batch())
    return model


def check_round_trip(root: str, layout: dict[str, int], data_parallel: str = "ddp", model_class=Net) -> None:
    """Export over ``layout`` (after a step) and load over the same mesh: trains as the original and eager
    (``data_parallel="fsdp"``: FSDP2 over "dp", recorded and applied again on load; of :class:`Blocks`,
    each block wrapped on its own, called whole by the exported program too)."""
    import dpcompile

    mesh = _mesh(layout)
    model = _model(model_class)
    reference = copy.deepcopy(model)
    options = {"tensor_parallel": PLAN if "dp" in layout else True} if "tp" in layout else {}
    options.update({"data_parallel": data_parallel} if data_parallel != "ddp" else {})
    if "dp" not in layout or layout["dp"] == 2:  # shaped by examples (this rank's rows): recorded, lowered with again
        rows = ROWS // layout.get("dp", 1)  # (without them, dropout's rows after attention differ: load refuses it)
        options["example_inputs"] = tuple(v[mesh.get_local_rank("dp") * rows :][:rows] if "dp" in layout else v
                                          for v in _batch().values())  # fmt: skip
    pm = dpcompile.transform(model, mesh, **options)
    _sgd_step(layout, mesh, pm, reference)
    assert pm.recipe.fsdp_blocks == ((nn.Sequential,) if model_class is Blocks else ())
    suffix = ("_fsdp" if data_parallel == "fsdp" else "") + ("_blocks" if model_class is Blocks else "")
    folder = _folder(root, "_".join(f"{k}{n}" for k, n in layout.items()) + suffix)
    rng = torch.random.get_rng_state()
    assert dpcompile.export(pm, folder) == folder
    loaded = dpcompile.load(folder, mesh=mesh)
    assert torch.equal(torch.random.get_rng_state(), rng)  # neither draws from the generator
    assert loaded.mode == pm.mode and loaded.code == pm.code
    assert (loaded.fsdp is not None) == (pm.fsdp is not None) == (data_parallel == "fsdp")
    _assert_state_equal(loaded, pm, exact=True)
    _assert_state_equal(loaded, reference, exact=False)
    _trains_alike(layout, mesh, pm, loaded, reference)


def check_pipeline_round_trip(root: str, layout: dict[str, int] | None = None, data_parallel: str = "ddp",
                              **keywords) -> None:  # fmt: skip
    """A pipeline (2 stages, 2 micro-batches, examples; GPipe, or ``keywords``: ``schedule="1f1b"``,
    ``ddp_options=``) over ``layout`` (``("pp",)`` by default; ``"dp"``
    feeds each rank its rows, ``"tp"`` shards ``up``/``down``), exported after a step and loaded over the
    mesh: every rank's code is the original's, the last stage's loss (the mean over ``"dp"``), this rank's
    gradients (its tp shards) and parameters after 2 AdamW steps equal the original program's (bit for bit)
    and eager's; ``state_dict`` (whole, every stage's) the original's bit for bit."""
    import torch.distributed as dist

    import dpcompile
    from dpcompile.fx_utils import unalias
    from dpcompile.runtime.tensor_parallel import shard_of

    layout = layout or {"pp": 2}
    mesh = _mesh(layout)
    model = _model()
    reference = copy.deepcopy(model)
    dp = layout.get("dp", 1)
    rows = ROWS // dp
    mine = slice(mesh.get_local_rank("dp") * rows, (mesh.get_local_rank("dp") + 1) * rows) if dp > 1 else slice(None)
    batch = {k: v[mine] for k, v in _batch().items()}
    options = {"pipeline": ["up"], "micro_batches": 2, "example_inputs": tuple(batch.values())}
    options.update({"tensor_parallel": PLAN} if "tp" in layout else {})
    options.update({"data_parallel": data_parallel} if data_parallel != "ddp" else {}, **keywords)
    pm = dpcompile.transform(model, mesh, **options)
    assert (pm.schedule_name, pm.ddp is not None) == (keywords.get("schedule", "gpipe"), "ddp_options" in keywords)
    for module in (pm, reference):  # a step before the export: a pipeline's call runs backward
        torch.manual_seed(7)
        loss = module(**{k: v if module is reference else v[mine] for k, v in _step_batch().items()})
        if module is reference:
            loss.backward()
        with torch.no_grad():
            for p in module.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    folder = _folder(root, "_".join(f"{k}{n}" for k, n in layout.items()) + ("_fsdp" if data_parallel == "fsdp" else ""))
    dpcompile.export(pm, folder)
    loaded = dpcompile.load(folder, mesh=mesh)
    assert loaded.mode == "spmd_pipeline" and loaded.code == pm.code
    assert (loaded.schedule_name, loaded.ddp is not None) == (pm.schedule_name, pm.ddp is not None)
    _assert_state_equal(loaded, pm, exact=True)
    last = mesh.get_local_rank("pp") == 1
    tp_rank = mesh.get_local_rank("tp") if "tp" in layout else 0
    shards = pm.shards
    assert loaded.shards == shards and bool(shards) == ("tp" in layout and last)  # stage 1 holds up, down
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (pm, loaded, reference)]
    wanted = dict(reference.named_parameters())
    for step in range(2):
        torch.manual_seed(100 + step)
        expected = reference(**_batch())
        expected.backward()
        grads = []
        for program in (pm, loaded):
            torch.manual_seed(100 + step)
            out = program(**batch)
            if last:
                if dp > 1:
                    dist.all_reduce(out, group=mesh.get_group("dp"))
                    out /= dp
                torch.testing.assert_close(out, expected.detach(), msg=lambda m, s=step: f"loss of step {s}: {m}")
            grads.append({unalias(n): _whole(p.grad) for n, p in program.program.named_parameters()})
        assert sorted(grads[0]) == sorted(grads[1]) and grads[0]
        for key, grad in grads[1].items():
            want = shard_of(wanted[key].grad, shards[key], tp_rank) if key in shards else wanted[key].grad
            torch.testing.assert_close(grad, want, msg=lambda m, k=key: f"grad {k}: {m}")
            torch.testing.assert_close(grad, grads[0][key], rtol=0, atol=0)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for path, p in loaded.program.named_parameters():
        key = unalias(path)
        want = shard_of(wanted[key].detach(), shards[key], tp_rank) if key in shards else wanted[key].detach()
        torch.testing.assert_close(_whole(p.detach()), want, msg=lambda m, k=path: f"param {k}: {m}")
    _assert_state_equal(loaded, reference, exact=False)


def check_pipeline_round_trip_in_group(layout: dict[str, int], data_parallel: str = "ddp", **keywords) -> None:
    """:func:`check_pipeline_round_trip` as a check of another spawned group (``test_pipeline_mesh.py``'s
    4 processes): rank 0 makes the folder's parent and removes it after."""
    with _group_root() as root:
        check_pipeline_round_trip(root, layout, data_parallel, **keywords)


@contextlib.contextmanager
def _group_root():
    """A folder every rank of the group names: rank 0 makes it, and removes it once every rank is done."""
    import tempfile

    import torch.distributed as dist

    rank = dist.get_rank()
    root = [tempfile.mkdtemp(prefix="export_mesh_") if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    try:
        yield root[0]
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root[0], ignore_errors=True)


class Attention(nn.Module):
    """Causal attention and a token loss; forward reads ``att.pos`` before ``att.qkv`` (the model's order
    differs from forward's: ``state_dict()``'s keys keep the model's)."""

    def __init__(self):
        super().__init__()
        from tests.integration.test_context_parallel import CausalSelfAttention

        self.att = CausalSelfAttention()
        self.head = nn.Linear(16, 4)

    def forward(self, x, labels):
        return F.cross_entropy(self.head(self.att(x)).flatten(0, 1), labels.flatten())


def check_context_round_trip(root: str, layout: dict[str, int]) -> None:
    """:class:`Attention` over ``layout`` (``"cp"``: each rank its part of the sequence; ``"dp"``: its rows;
    ``"tp"``: ``tensor_parallel=True``), exported and loaded over the mesh: the code and ``state_dict`` (keys in
    the model's order) are the original's; 2 AdamW steps' loss (the whole batch's), every gradient (bit for bit
    the original's) and the parameters equal the original's and eager's."""
    import torch.distributed as dist

    import dpcompile
    from dpcompile.mesh import local_batch
    from dpcompile.runtime.tensor_parallel import shard_of

    mesh = _mesh(layout)
    model = _model(Attention)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    batch = (torch.randn(2, 6, 16, generator=g, dtype=torch.float64), torch.randint(0, 4, (2, 6), generator=g))
    local = local_batch(batch, mesh)
    pm = dpcompile.transform(model, mesh, example_inputs=local, **({"tensor_parallel": True} if "tp" in layout else {}))
    folder = _folder(root, "attention_" + "_".join(f"{k}{n}" for k, n in layout.items()))
    dpcompile.export(pm, folder)
    loaded = dpcompile.load(folder, mesh=mesh)
    assert loaded.mode == pm.mode and loaded.code == pm.code
    _assert_state_equal(loaded, pm, exact=True)
    shards, tp_rank = getattr(pm, "shards", {}) or {}, mesh.get_local_rank("tp") if "tp" in layout else 0
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (pm, loaded, reference)]
    for step in range(2):
        expected = reference(*batch)
        expected.backward()
        for program in (pm, loaded):
            loss = program(*local)
            loss.backward()
            loss = loss.detach()
            if "dp" in layout:  # each dp rank's rows' mean
                dist.all_reduce(loss, group=mesh.get_group("dp"))
                loss /= mesh.size(list(layout).index("dp"))
            torch.testing.assert_close(loss, expected.detach(), msg=lambda m, s=step: f"loss of step {s}: {m}")
        got, original = _named(loaded), _named(pm)
        for key, p in reference.named_parameters():
            want = shard_of(p.grad, shards[key], tp_rank) if key in shards else p.grad
            torch.testing.assert_close(_whole(got[key].grad), want, msg=lambda m, k=key: f"grad {k}: {m}")
            torch.testing.assert_close(got[key].grad, original[key].grad, rtol=0, atol=0)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    _assert_state_equal(loaded, pm, exact=True)
    _assert_state_equal(loaded, reference, exact=False)


GPT2_VOCAB, GPT2_SEQ = 64, 8


def _gpt2(seq: int = GPT2_SEQ) -> tuple[nn.Module, torch.fx.GraphModule]:
    """Tiny GPT-2 (1 layer, n_embd 32, 2 heads, vocab 64) in float64, and its program as the export frontend
    captures it with ``labels=`` of ``seq`` tokens (the batch dynamic; a cp rank's part, half: the sequence) once per process
    (the ranks' fork server captures both into ``CAPTURED``, which its ranks see), each layout transforming a copy."""
    key = ("export_mesh_gpt2", seq)
    if key not in CAPTURED:
        CAPTURED[key] = _capture_gpt2(seq)
    return CAPTURED[key]


def export_for_ranks() -> None:
    """GPT-2 as the export frontend captures it (whole sequences, a cp rank's half), in the fork server
    the group's ranks start from (``run_spawned(prepare=)``), so that its 2 ranks copy it."""
    for seq in (GPT2_SEQ, GPT2_SEQ // 2):
        _gpt2(seq)


def _capture_gpt2(seq: int) -> tuple[nn.Module, torch.fx.GraphModule]:
    import warnings

    from dpcompile.capture import capture_model
    from tests.thirdparty import import_or_skip

    T = import_or_skip("transformers")
    torch.manual_seed(0)
    config = T.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=GPT2_VOCAB, n_positions=GPT2_SEQ, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)  # fmt: skip
    model = T.GPT2LMHeadModel(config).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured, _ = capture_model(model, frontend="export", example_kwargs={k: v[:, :seq] for k, v in _gpt2_batch(1).items()},
                                    batch_dim=1 if seq < GPT2_SEQ else None)  # cp keeps the sequence dynamic, as transform
    return model, captured


def _gpt2_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, GPT2_VOCAB, (ROWS, GPT2_SEQ), generator=g),
            "labels": torch.randint(0, GPT2_VOCAB, (ROWS, GPT2_SEQ), generator=g)}  # fmt: skip


def _record_of_output(code: str) -> str:
    """``code`` with GPT-2's output class written as the record a folder holds (what a loaded program builds)."""
    import dataclasses

    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions as Output

    fields = tuple(f.name for f in dataclasses.fields(Output))
    return code.replace("transformers_modeling_outputs_CausalLMOutputWithCrossAttentions(",
                        f"dpcompile_runtime_exported_model_output({Output.__module__ + '.' + Output.__name__!r}, {fields!r}, ")


def check_export_frontend_round_trip(root: str, layout: dict[str, int]) -> None:
    """GPT-2 captured by the export frontend with ``labels=``, over ``layout`` (``"tp"``: ``tensor_parallel=True``;
    ``"pp"``: 2 stages, 2 micro-batches; ``"cp"``: each rank its part of the sequence, captured from it), after an
    SGD step: exported and loaded over the mesh, its code is the
    original's (the output class written as its record), its ``state_dict`` the original's bit for bit (the
    model's keys, in order), and over 2 AdamW steps the loss, every gradient (bit for bit the original's) and
    the parameters equal the original's and eager's. Both refuse an int32 ``input_ids`` on every rank (export fixed int64)."""
    import torch.distributed as dist

    import dpcompile
    from dpcompile.capture.inputs import InputMismatch
    from dpcompile.fx_utils import unalias
    from dpcompile.mesh import local_batch
    from dpcompile.runtime.tensor_parallel import shard_of

    mesh = _mesh(layout)
    model, captured = _gpt2(GPT2_SEQ // layout.get("cp", 1))
    reference = copy.deepcopy(model)
    dp, pipeline = layout.get("dp", 1), "pp" in layout
    rows = ROWS // dp
    mine = slice(mesh.get_local_rank("dp") * rows, (mesh.get_local_rank("dp") + 1) * rows) if dp > 1 else slice(None)
    last = not pipeline or mesh.get_local_rank("pp") == 1
    options = {"tensor_parallel": True} if "tp" in layout else {}
    options.update({"pipeline": 2, "micro_batches": 2} if pipeline else {})

    def local(batch):  # this rank's rows (dp), or its part of the sequence (cp)
        if "cp" in layout:
            return dict(zip(batch, local_batch(tuple(batch.values()), mesh)))
        return {k: v[mine] for k, v in batch.items()}

    pm = dpcompile.transform(copy.deepcopy(captured), mesh, example_kwargs=local(_gpt2_batch(2)), **options)

    def run(program, batch):  # the loss (the mean over dp: the whole batch's) on the ranks that have it
        out = program(**(batch if program is reference else local(batch)))
        if out is None:
            return None
        if not pipeline or program is reference:
            out.loss.backward()
        loss = out.loss.detach().clone()
        if dp > 1 and program is not reference:
            dist.all_reduce(loss, group=mesh.get_group("dp"))
            loss /= dp
        return loss

    for module in (pm, reference):  # a step before the export: the folder holds trained weights
        run(module, _gpt2_batch(3))
        with torch.no_grad():
            for p in module.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    folder = _folder(root, "gpt2_" + "_".join(f"{k}{n}" for k, n in layout.items()))
    assert dpcompile.export(pm, folder) == folder
    loaded = dpcompile.load(folder, mesh=mesh)
    assert loaded.mode == pm.mode and loaded.code == _record_of_output(pm.code)
    assert (loaded.code == pm.code) == pipeline  # a pipeline's last stage returns the output's fields, not it
    _assert_state_equal(loaded, pm, exact=True)
    _assert_state_equal(loaded, reference, exact=False)
    shards, tp_rank = getattr(pm, "shards", {}) or {}, mesh.get_local_rank("tp") if "tp" in layout else 0
    assert (getattr(loaded, "shards", {}) or {}) == shards and bool(shards) == ("tp" in layout)
    for program in (pm, loaded):  # both check the call against what export fixed, every rank alike, before computing
        with pytest.raises(InputMismatch, match="argument 'input_ids' is torch.int32, but .* captured by torch.export"):
            program(**{k: v.int() if k == "input_ids" else v for k, v in local(_gpt2_batch(3)).items()})

    def params(program) -> dict[str, torch.Tensor]:
        held = program.program if pipeline else program
        return {unalias(n.removeprefix("module.")): p for n, p in held.named_parameters()}

    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (pm, loaded, reference)]
    for step in range(2):
        batch = _gpt2_batch(10 + step)
        expected = run(reference, batch)
        for program in (pm, loaded):
            loss = run(program, batch)
            assert (loss is None) == (not last)
            if last:
                torch.testing.assert_close(loss, expected, msg=lambda m, s=step: f"loss of step {s}: {m}")
        got, original = params(loaded), params(pm)
        assert sorted(got) == sorted(original) and got
        for key, p in got.items():  # a pipeline's stage 1 names the tied weight lm_head.weight
            grad = reference.get_parameter(key).grad
            want = shard_of(grad, shards[key], tp_rank) if key in shards else grad
            torch.testing.assert_close(_whole(p.grad), want, msg=lambda m, k=key: f"grad {k}: {m}")
            torch.testing.assert_close(_whole(p.grad), _whole(original[key].grad), rtol=0, atol=0)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    original = params(pm)
    for key, p in params(loaded).items():  # AdamW's first steps divide each gradient by its own size, which makes a
        # last-bit difference of a near-zero one (GPT-2's loss is float32) a relative 1e-4 (float64 elsewhere)
        weight = reference.get_parameter(key).detach()
        want = shard_of(weight, shards[key], tp_rank) if key in shards else weight
        torch.testing.assert_close(_whole(p.detach()), want, rtol=1e-4, atol=1e-6, msg=lambda m, k=key: f"param {k}: {m}")
        torch.testing.assert_close(_whole(p.detach()), _whole(original[key].detach()), rtol=0, atol=0)
    _assert_state_equal(loaded, pm, exact=True)


def check_other_sizes_and_one_process(root: str) -> None:
    """A ``("dp", "tp")`` export of sizes (1, 2) loads over (2, 1) (lowered for it) and, without a mesh, as
    the single-device program; both train as eager."""
    import dpcompile

    folder = _folder(root, "dp1_tp2")  # written by check_round_trip
    for layout in ({"dp": 2, "tp": 1},):
        mesh = _mesh(layout)
        loaded = dpcompile.load(folder, mesh=mesh)
        reference = _stepped_model()
        _assert_state_equal(loaded, reference, exact=False)
        again = dpcompile.transform(copy.deepcopy(reference), mesh, tensor_parallel=PLAN)  # transform's for this mesh
        for module in (loaded, again, reference):  # without examples, dropout after attention draws other rows
            module.eval()  # over dp than eager (transform's too): compared without dropout
        _trains_alike(layout, mesh, again, loaded, reference, bitwise=False)  # again: eager's step, not the mesh's
    one = dpcompile.load(folder)
    assert one.mode == "data_parallel" and [str(d) for d in one.devices] == ["cpu"]
    reference = _stepped_model()
    batch = _batch()
    for step in range(2):
        torch.manual_seed(100 + step)
        got = one(**batch)
        torch.manual_seed(100 + step)
        torch.testing.assert_close(got, reference(**batch))


def check_export_frontend_arguments_refused_on_every_rank(layout: dict[str, int]) -> None:
    """A program over ``layout`` captured with ``frontend="export"`` refuses a call that departs from what
    export fixed (a dtype, an argument it never saw, a dim the examples did not say varies) with the
    ``InputMismatch`` one process raises; where one rank's call alone departs, every rank raises (the others
    naming that rank), none waits in a collective; the refusals change nothing, and the next call equals eager."""
    import warnings

    import torch.distributed as dist

    import dpcompile
    from dpcompile.capture.inputs import InputMismatch

    mesh, model, batch = _mesh(layout), _model().eval(), _batch()
    options = {"pipeline": 2, "micro_batches": 2} if "pp" in layout else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(copy.deepcopy(model), mesh, example_kwargs=batch, frontend="export", **options)
    before = {name: p.detach().clone() for name, p in pm.named_parameters()}
    x, labels = batch["x"], batch["labels"]
    refused = {
        "argument 'x' is torch.float32, but Net was captured by torch.export for torch.float64": {"x": x.float()},
        "captured by torch.export without 'extra'": {"x": x, "extra": torch.ones(1)},
        r"argument 'x' has shape \(4, 2, 8\), but Net was captured by torch.export for shape \(\*, 3, 8\)":
            {"x": x[:, :2], "labels": labels[:, :2]},
    }  # fmt: skip
    for message, call in refused.items():
        with pytest.raises(InputMismatch, match=message):
            pm(**{"labels": labels, **call})
    own = r"argument 'x' has shape \(4, 3, 7\), but Net was captured"
    with pytest.raises(InputMismatch, match=own if dist.get_rank() == 1 else f"refused.*global rank 1: {own}"):
        pm(x=x[..., :7] if dist.get_rank() == 1 else x, labels=labels)  # rank 1's call alone departs
    pm.check_inputs = False  # no cross-rank checks: each rank checks its own call, and no collective runs
    with pytest.raises(InputMismatch, match="argument 'x' is torch.float32"):
        pm(x=x.float(), labels=labels)
    pm.check_inputs = True
    for name, p in pm.named_parameters():
        assert torch.equal(p, before[name]), name
    loss = pm(**batch)
    if "pp" not in layout or mesh.get_local_rank("pp") == 1:
        torch.testing.assert_close(loss, model(**batch))


def check_refusals_write_nothing(root: str) -> None:
    """A mesh of other dimension names, a one-process folder, a rank's program that is not the exported one,
    an unrecordable keyword, FSDP2, and a failure on rank 0 alone: every rank raises ``ExportError``, and
    the folder is as before (absent, or holding only its stranger)."""
    import torch.distributed as dist

    import dpcompile
    from dpcompile.export import ExportError

    with pytest.raises(ExportError, match=r"dims \('dp',\) \(sizes \[2\]\).*dims \('tp',\) \(sizes \[2\]\)"):
        dpcompile.load(_folder(root, "dp2"), mesh=_mesh({"tp": 2}))
    mesh = _mesh({"dp": 2})
    one_process = _folder(root, f"one_process{dist.get_rank()}")
    dpcompile.export(dpcompile.transform(_model(), ["cpu"]), one_process)
    with pytest.raises(ExportError, match="exported without a mesh"):
        dpcompile.load(one_process, mesh=mesh)
    tensor_parallel = _folder(root, f"one_process_tp{dist.get_rank()}")  # its shards refused another device count first
    dpcompile.export(dpcompile.transform(_model(), ["cpu"] * 2, tensor_parallel=True), tensor_parallel)
    with pytest.raises(ExportError, match="exported without a mesh"):
        dpcompile.load(tensor_parallel, mesh=mesh)
    edited = _folder(root, "dp2_other_code")  # rank 1's program hash edited (module.py made to match, rehashed)
    shaped = _folder(root, "dp1_tp2_examples")  # as if exported with examples
    if dist.get_rank() == 0:
        _edit_mesh(_folder(root, "dp2"), edited, lambda section: section["rank_code"].__setitem__(1, "0" * 64))
        _edit_mesh(_folder(root, "dp1_tp2"), shaped, lambda section: section.update(examples=[[{"value": None}]] * 2))
    dist.barrier()
    refusal = "is not the exported one" if dist.get_rank() == 1 else "failed on another rank.*rank 1: ExportError"
    with pytest.raises(ExportError, match=refusal):
        dpcompile.load(edited, mesh=mesh)
    with pytest.raises(ExportError, match=r"sizes \[1, 2\] from examples.*sizes \[2, 1\] does not feed"):
        dpcompile.load(shaped, mesh=_mesh({"dp": 2, "tp": 1}))
    pm = dpcompile.transform(_model(), mesh, activation_checkpointing=["up"])
    folder = _folder(root, f"refused{dist.get_rank()}")
    with pytest.raises(ExportError, match="activation_checkpointing="):
        dpcompile.export(pm, folder)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    pm = dpcompile.transform(_model(), mesh, data_parallel="fsdp", mixed_precision=MixedPrecisionPolicy())
    with pytest.raises(ExportError, match="cannot record mixed_precision="):
        dpcompile.export(pm, folder)
    pm = dpcompile.transform(_model(functools.partial(Blocks, Block)), mesh, data_parallel="fsdp")
    with pytest.raises(ExportError, match=r"blocks \(Block\) whole.*register_module_class\(Block\)"):
        dpcompile.export(pm, folder)
    pm = dpcompile.transform(torch.fx.symbolic_trace(_model()), mesh)  # a GraphModule of the user's: no model to copy
    with pytest.raises(ExportError, match="holds no model to copy: it was transformed from an fx.GraphModule"):
        dpcompile.export(pm, folder)
    assert not folder.exists()
    pm = dpcompile.transform(_model(), mesh)
    crowded = _folder(root, "crowded")
    if dist.get_rank() == 0:
        crowded.mkdir()
        (crowded / "notes.txt").write_text("mine")
    dist.barrier()
    before = _tree_digest(crowded)
    with pytest.raises(ExportError, match="notes.txt"):
        dpcompile.export(pm, crowded)
    assert _tree_digest(crowded) == before == {"notes.txt": hashlib.sha256(b"mine").hexdigest()}


def _edit_mesh(folder: Path, edited: Path, change) -> None:
    """A copy of ``folder`` whose ``config.mesh`` ``change`` edited, with ``module.py`` made to match, rehashed."""
    from dpcompile.export.build import readable_programs
    from dpcompile.export.common import readable_mode
    from dpcompile.export.kinds import TreeIndex
    from dpcompile.export.source import program_source
    from tests.tools.export_attacks import rehash

    shutil.copytree(folder, edited)
    program = json.loads((folder / "program.json").read_text())
    change(program["config"]["mesh"])
    (edited / "program.json").write_text(json.dumps(program))
    readable = readable_programs(program["data"], TreeIndex(program["modules"]))
    mode = readable_mode(program["kind"], program["config"])
    (edited / "module.py").write_text(program_source(readable, class_name=program["class_name"], mode=mode,
                                                     devices=program["config"]["devices"]))  # fmt: skip
    rehash(edited)


def test_export_and_load_over_a_mesh(tmp_path):
    root = str(tmp_path)
    checks = [
        ("dp", functools.partial(check_round_trip, root, {"dp": 2})),
        ("tp", functools.partial(check_round_trip, root, {"tp": 2})),
        ("dp_tp", functools.partial(check_round_trip, root, {"dp": 1, "tp": 2})),
        ("dp_fsdp", functools.partial(check_round_trip, root, {"dp": 2}, "fsdp")),
        ("dp_tp_fsdp", functools.partial(check_round_trip, root, {"dp": 2, "tp": 1}, "fsdp")),
        ("dp_fsdp_blocks", functools.partial(check_round_trip, root, {"dp": 2}, "fsdp", Blocks)),
        ("pp", functools.partial(check_pipeline_round_trip, root)),
        ("attention_dp", functools.partial(check_context_round_trip, root, {"dp": 2})),
        ("attention_cp", functools.partial(check_context_round_trip, root, {"cp": 2})),
        ("attention_cp_tp", functools.partial(check_context_round_trip, root, {"cp": 2, "tp": 1})),
        ("gpt2_export_dp", functools.partial(check_export_frontend_round_trip, root, {"dp": 2})),
        ("gpt2_export_dp_tp", functools.partial(check_export_frontend_round_trip, root, {"dp": 1, "tp": 2})),
        ("gpt2_export_pp", functools.partial(check_export_frontend_round_trip, root, {"pp": 2})),
        ("gpt2_export_cp", functools.partial(check_export_frontend_round_trip, root, {"cp": 2})),
        ("other_sizes", functools.partial(check_other_sizes_and_one_process, root)),
        ("refusals", functools.partial(check_refusals_write_nothing, root)),
        ("export_arguments_dp", functools.partial(check_export_frontend_arguments_refused_on_every_rank, {"dp": 2})),
        ("export_arguments_pp", functools.partial(check_export_frontend_arguments_refused_on_every_rank, {"pp": 2})),
    ]
    outcomes = run_spawned(run_checks, 2, checks, timeout=GROUP_TIMEOUT_S,
                           prepare=["tests.integration.test_export_mesh:export_for_ranks"])
    assert_group_passed(outcomes, 2, *(name for name, _ in checks), timeout=GROUP_TIMEOUT_S)
    _check_layout_is_recorded_and_checked(tmp_path / "dp1_tp2", tmp_path)
    examples = json.loads((tmp_path / "tp2" / "program.json").read_text())["config"]["mesh"]["examples"]
    assert examples == [[{"shape": [ROWS, SEQ, 8], "dtype": "float64"}, {"shape": [ROWS, SEQ], "dtype": "int64"}]] * 2
    context = json.loads((tmp_path / "attention_cp2" / "program.json").read_text())["config"]["mesh"]
    assert (context["dims"], context["mode"]) == (["cp"], "spmd_context_parallel")
    assert context["keywords"]["context_parallel"] == {"exchange": "auto", "load_balance": "auto"}
    assert "context_parallel" not in json.loads((tmp_path / "dp2" / "program.json").read_text())["config"]["mesh"]["keywords"]
    pipeline = json.loads((tmp_path / "pp2" / "program.json").read_text())["config"]["mesh"]
    assert (pipeline["dims"], pipeline["mode"]) == (["pp"], "spmd_pipeline")
    assert {k: pipeline["keywords"][k] for k in ("pipeline", "micro_batches", "schedule")} == {
        "pipeline": ["up"], "micro_batches": 2, "schedule": "gpipe"}  # fmt: skip


def _check_layout_is_recorded_and_checked(folder: Path, tmp_path: Path) -> None:
    """``config.mesh`` records the layout, ``module.py``'s first line shows it; an edited layout (rehashed)
    no longer matches ``module.py``, and a keyword value export never writes is refused by name."""
    import dpcompile
    from dpcompile.export import ExportError
    from tests.tools.export_attacks import rehash

    program = json.loads((folder / "program.json").read_text())
    section = program["config"]["mesh"]
    assert (section["dims"], section["sizes"], section["mode"]) == (["dp", "tp"], [1, 2], "spmd_2d")
    assert section["keywords"] == {"tensor_parallel": PLAN, "data_parallel": "ddp", "ddp_options": {},
                                   "exact_random": True, "frontend": "auto", "pipeline": None, "micro_batches": 1,
                                   "schedule": "gpipe", "batch_dim": None}  # fmt: skip
    assert len(section["rank_code"]) == 2 and section["examples"] is None
    first = (folder / "module.py").read_text().splitlines()[0]
    assert first.startswith('"""Generated by dpcompile: data_parallel, exported over a DeviceMesh {') and '"sizes": [1, 2]' in first
    for k, (edit, refusal) in enumerate((({"sizes": [2, 1]}, "module.py is not the program"),
                          ({"keywords": {**section["keywords"], "data_parallel": "zero3"}}, "mesh keywords"),
                          ({"keywords": {**section["keywords"], "context_parallel": {"exchange": "auto", "load_balance": "auto"}}},
                           "mesh keywords"))):  # fmt: skip
        edited = tmp_path / f"edited{k}"
        shutil.copytree(folder, edited)
        program["config"]["mesh"] = {**section, **edit}
        (edited / "program.json").write_text(json.dumps(program))
        rehash(edited)
        with pytest.raises(ExportError, match=refusal):
            dpcompile.load(edited)
