"""Random ops draw the single-device values over a gloo ``DeviceMesh`` (``exact_random=True``, the
default): every rank draws each site's whole tensor from its identically seeded generator and keeps
its slice, with no collective. An MLP with dropout (module, functional) and ``randn_like`` noise,
GPT-2 (its lm_head tied to wte, across the stages of a pipeline) and BERT with their default dropout
and a ViT with attention dropout (tiny, one layer, float64, exported once per rank), each on every layout built over a mesh: ``("dp",)`` (DDP, FSDP), ``("tp",)``,
``("pp",)`` (GPipe, 1F1B) over 2 ranks; ``("dp", "tp")`` (DDP, FSDP), ``("pp", "dp")`` (replicas, FSDP;
GPipe, 1F1B) and ``("pp", "tp")`` (GPipe, 1F1B) over 4; and a stack of FSDP-wrapped blocks with
dropout inside. Over 3 steps from the same seed the loss (averaged over the dp ranks) and every
gradient (this rank's shard, this stage's parameters) equal eager's on the global batch, and
``torch.get_rng_state()`` after each step equals eager's on every rank; BERT and ViT train with AdamW
and their parameters after the 3 steps equal eager's too. ``("pp", "dp", "tp")`` (8 ranks): the MLP,
in the group of ``test_pipeline_mesh_compose.py``. Spawning is the expensive part, so one group of 2
and one of 4 run every check."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tests.gloo_groups import CAPTURED, assert_group_passed, run_checks, run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # 6 processes spawned; GPT-2 exported on each
GROUP_TIMEOUT_S = 900.0  # spawning, importing transformers and the first gloo connections are slow on a loaded machine
V = 64


def _mlp(rows: int):
    from tests.integration.test_exact_random import DropoutMLP

    g = torch.Generator().manual_seed(1)
    kwargs = {"x": torch.randn(rows, 8, generator=g, dtype=torch.float64), "labels": torch.randint(0, 4, (rows,), generator=g)}
    return DropoutMLP, kwargs


class DropoutBlock(torch.nn.Module):
    """A residual block with dropout as a module and as a function, and ``randn_like`` noise."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.drop = torch.nn.Dropout(0.25)

    def forward(self, h):
        import torch.nn.functional as F

        h = h + self.drop(torch.tanh(self.fc(h)))
        return F.dropout(h + 0.1 * torch.randn_like(h), p=0.5, training=self.training)


class DropoutStack(torch.nn.Module):
    """Repeated blocks (FSDP wraps each and the program calls it whole) between dropout at the top."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.drop = torch.nn.Dropout(0.1)
        self.layers = torch.nn.ModuleList(DropoutBlock(d) for _ in range(2))
        self.head = torch.nn.Linear(d, 4)

    def forward(self, x, labels):
        h = self.drop(self.inp(x))
        for layer in self.layers:
            h = layer(h)
        return torch.nn.functional.cross_entropy(self.head(h), labels)


def _blocks(rows: int):
    g = torch.Generator().manual_seed(1)
    kwargs = {"x": torch.randn(rows, 8, generator=g, dtype=torch.float64), "labels": torch.randint(0, 4, (rows,), generator=g)}
    return DropoutStack, kwargs


def _gpt2(rows: int):
    from tests.thirdparty import import_or_skip

    T = import_or_skip("transformers")

    config = T.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=V, n_positions=16, use_cache=False)
    g = torch.Generator().manual_seed(0)
    kwargs = {"input_ids": torch.randint(1, V, (rows, 8), generator=g), "labels": torch.randint(0, V, (rows, 8), generator=g)}
    return (lambda: T.GPT2LMHeadModel(config)), kwargs


def _bert(rows: int):
    from tests.thirdparty import import_or_skip

    T = import_or_skip("transformers")
    config = T.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                          vocab_size=V, max_position_embeddings=16)  # default dropout: hidden and attention 0.1
    g = torch.Generator().manual_seed(0)
    kwargs = {"input_ids": torch.randint(1, V, (rows, 8), generator=g), "labels": torch.randint(0, 2, (rows,), generator=g)}
    return (lambda: T.BertForSequenceClassification(config)), kwargs


def _vit(rows: int):
    from tests.thirdparty import import_or_skip

    T = import_or_skip("transformers")
    config = T.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=32, num_labels=3, hidden_dropout_prob=0.1,
                         attention_probs_dropout_prob=0.1)  # fmt: skip
    g = torch.Generator().manual_seed(2)
    kwargs = {"pixel_values": torch.randn(rows, 3, 8, 8, generator=g, dtype=torch.float64),
              "labels": torch.randint(0, 3, (rows,), generator=g)}  # fmt: skip
    return (lambda: T.ViTForImageClassification(config)), kwargs


#: with "tp", where the second stage starts: the block and its sharded pairs whole on the first
STAGE_CUTS = {"gpt2": ["transformer.ln_f"], "bert": ["bert.pooler"], "vit": ["vit.layernorm"]}
MODELS = {"mlp": _mlp, "blocks": _blocks, "gpt2": _gpt2, "bert": _bert, "vit": _vit}
#: BERT and ViT train with AdamW (its state moves every parameter, so the parameters after 3 steps are checked too)
ADAMW = {"bert", "vit"}


def _optimizers(name: str, params, ref_params):
    if name in ADAMW:
        return torch.optim.AdamW(params, lr=1e-2), torch.optim.AdamW(ref_params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1), torch.optim.SGD(ref_params, lr=0.1)


def _local(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _mesh(layout: dict[str, int]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(layout.values()), mesh_dim_names=tuple(layout))


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def _program(name: str, model: torch.nn.Module, local: dict) -> torch.nn.Module:
    """``model`` as the program to transform: the MLPs as they are, the transformers exported once per
    rank and input shapes (the cells' time), a copy loaded with ``model``'s weights (FSDP shards the
    program it is given in place)."""
    if name in ("mlp", "blocks"):
        return model
    from dpcompile.capture import capture_model

    key = ("exact_random_mesh", name, *((k, tuple(v.shape)) for k, v in local.items()))
    if key not in CAPTURED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            CAPTURED[key] = capture_model(copy.deepcopy(model), frontend="export", example_kwargs=local)[0]
    program = copy.deepcopy(CAPTURED[key])
    program.load_state_dict(model.state_dict())
    return program


def export_for_ranks() -> None:
    """Fill ``CAPTURED`` (``tests/gloo_groups.py``) with what every cell exports (each transformers model at 2 rows a rank, the
    local batch of every layout here and in ``test_pipeline_mesh_compose.py``). The fork server the
    ranks start from calls it before it forks a group that asks (``PREPARE``), so that the ranks of every group
    copy the programs instead of each exporting them again; the models are built as the cells build
    them (their weights do not matter: ``_program`` loads the cell's)."""
    for name in ("gpt2", "bert", "vit"):
        make, kwargs = MODELS[name](2)
        _program(name, make().double().train(), kwargs)


#: what the fork server calls before it forks ranks that run these cells (``run_spawned(prepare=)``)
PREPARE = "tests.integration.test_exact_random_mesh:export_for_ranks"


def check_trains_like_eager(name: str, layout: dict[str, int], data_parallel: str = "ddp") -> None:
    """3 steps over the mesh against eager on the global batch: loss, gradients, generator state."""
    import torch.distributed as dist

    import dpcompile
    from dpcompile.runtime.tensor_parallel import shard_of

    mesh = _mesh(layout)
    dp = layout.get("dp", 1)
    dp_rank = mesh.get_local_rank("dp") if "dp" in layout else 0
    tp_rank = mesh.get_local_rank("tp") if "tp" in layout else 0
    make, kwargs = MODELS[name](2 * dp)
    torch.manual_seed(0)
    model = make().double().train()
    reference = copy.deepcopy(model)
    per = 2
    local = {k: v[dp_rank * per : (dp_rank + 1) * per] for k, v in kwargs.items()}
    program = _program(name, model, local)
    options = {"tensor_parallel": True} if "tp" in layout else {}
    if data_parallel != "ddp":
        options["data_parallel"] = data_parallel
    pm = dpcompile.transform(program, mesh, example_kwargs=local, **options)
    assert "random_draws" in pm.code, pm.code
    pm.train()
    opt, ref_opt = _optimizers(name, pm.parameters(), reference.parameters())
    shards = getattr(pm, "shards", {}) or {}
    for step in range(3):
        torch.manual_seed(100 + step)
        loss = _loss(pm(**local))
        loss.backward()
        state = torch.get_rng_state()
        torch.manual_seed(100 + step)
        expected = _loss(reference(**kwargs))
        expected.backward()
        assert torch.equal(state, torch.get_rng_state()), f"the generator after step {step} is not eager's"
        mean_loss = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(mean_loss, group=mesh.get_group("dp"))
            mean_loss /= dp
        torch.testing.assert_close(mean_loss, expected.detach(), msg=lambda m, step=step: f"loss of step {step}: {m}")
        grads = {n.removeprefix("module."): p.grad for n, p in pm.named_parameters()}
        for key, p in reference.named_parameters():
            want = shard_of(p.grad, shards[key], tp_rank) if key in shards else p.grad
            got = _local(grads[key])
            torch.testing.assert_close(got, want, msg=lambda m, key=key, step=step: f"grad {key}, step {step}: {m}")
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    params = {n.removeprefix("module."): p for n, p in pm.named_parameters()}
    for key, p in reference.named_parameters():
        want = shard_of(p.detach(), shards[key], tp_rank) if key in shards else p.detach()
        torch.testing.assert_close(_local(params[key].detach()), want, msg=lambda m, key=key: f"param {key} after 3 steps: {m}")


def check_pipeline_trains_like_eager(name: str, layout: dict[str, int], schedule: str = "gpipe",
                                     data_parallel: str = "ddp") -> None:
    """A pipeline over the mesh, 2 micro-batches per rank: 3 steps (each call runs forward and backward)
    against eager on the global batch: the last stage's loss, this stage's gradients (this tp rank's
    shards; FSDP's gathered), every rank's generator state."""
    import dpcompile
    from dpcompile.fx_utils import unalias
    from dpcompile.runtime.tensor_parallel import shard_of

    mesh = _mesh(layout)
    dp = layout.get("dp", 1)
    dp_rank = mesh.get_local_rank("dp") if "dp" in layout else 0
    tp_rank = mesh.get_local_rank("tp") if "tp" in layout else 0
    make, kwargs = MODELS[name](2 * dp)
    torch.manual_seed(0)
    model = make().double().train()
    reference = copy.deepcopy(model)
    per = 2  # micro-batches of one row: the shapes of the dp cells, so one export serves both
    local = {k: v[dp_rank * per : (dp_rank + 1) * per] for k, v in kwargs.items()}
    program = _program(name, model, local)
    options = {"tensor_parallel": True} if "tp" in layout else {}
    if data_parallel != "ddp":
        options["data_parallel"] = data_parallel
    cut = layout["pp"] if name == "mlp" or "tp" not in layout else STAGE_CUTS[name]  # whole blocks per stage
    pm = dpcompile.transform(program, mesh, pipeline=cut, micro_batches=2, schedule=schedule,
                             example_kwargs=local, **options)  # fmt: skip
    plan = pm.random_plan  # a stage without random sites of its own still draws the others' (the generator)
    assert plan is not None and ("current_random_draws" in pm.code or not plan.own), pm.code
    pm.train()
    opt, ref_opt = _optimizers(name, pm.parameters(), reference.parameters())
    last = mesh.get_local_rank("pp") == layout["pp"] - 1
    wanted = dict(reference.named_parameters(remove_duplicate=False))  # a tied lm_head.weight too
    for step in range(3):
        torch.manual_seed(100 + step)
        out = pm(**local)
        state = torch.get_rng_state()
        torch.manual_seed(100 + step)
        expected = _loss(reference(**kwargs))
        expected.backward()
        assert torch.equal(state, torch.get_rng_state()), f"the generator after step {step} is not eager's"
        if last:
            torch.testing.assert_close(_loss(out), expected.detach(), msg=lambda m, step=step: f"loss of step {step}: {m}")
        for path, p in pm.program.named_parameters():
            key = unalias(path)
            want = shard_of(wanted[key].grad, pm.shards[key], tp_rank) if key in pm.shards else wanted[key].grad
            torch.testing.assert_close(_local(p.grad), want, msg=lambda m, key=key, step=step: f"grad {key}, step {step}: {m}")
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    for path, p in pm.program.named_parameters():
        key = unalias(path)
        want = wanted[key].detach()
        want = shard_of(want, pm.shards[key], tp_rank) if key in pm.shards else want
        torch.testing.assert_close(_local(p.detach()), want, msg=lambda m, key=key: f"param {key} after 3 steps: {m}")


#: every layout built over a mesh, by group size: (mesh, data parallel, pipeline schedule or None)
LAYOUTS = {
    2: {"dp": ({"dp": 2}, "ddp", None), "fsdp": ({"dp": 2}, "fsdp", None), "tp": ({"tp": 2}, "ddp", None),
        "pp": ({"pp": 2}, "ddp", "gpipe"), "pp_1f1b": ({"pp": 2}, "ddp", "1f1b")},
    4: {"dp_tp": ({"dp": 2, "tp": 2}, "ddp", None), "fsdp_tp": ({"dp": 2, "tp": 2}, "fsdp", None),
        "pp_dp": ({"pp": 2, "dp": 2}, "ddp", "gpipe"), "pp_dp_1f1b": ({"pp": 2, "dp": 2}, "ddp", "1f1b"),
        "pp_fsdp": ({"pp": 2, "dp": 2}, "fsdp", "gpipe"), "pp_fsdp_1f1b": ({"pp": 2, "dp": 2}, "fsdp", "1f1b"),
        "pp_tp": ({"pp": 2, "tp": 2}, "ddp", "gpipe"), "pp_tp_1f1b": ({"pp": 2, "tp": 2}, "ddp", "1f1b")},
}  # fmt: skip
MESH_MODELS = ("mlp", "gpt2", "bert", "vit")  # every model on every layout


class _WrittenOutAttention(torch.nn.Module):
    """Dropout after an attention written out with ``@``: without shapes the batch rules cannot split
    the matmul of ``(b, t, d)`` values, so the dropout's rows are unknown."""

    def __init__(self):
        super().__init__()
        self.inp, self.head, self.drop = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Dropout(0.25)

    def forward(self, x):
        h = self.inp(x)
        return self.head(h + self.drop(torch.softmax(h @ h.transpose(1, 2) / 4, dim=-1) @ h)).square().mean()


def check_dropout_rows_unknown_without_examples() -> None:
    """Over a ``("dp",)`` mesh, a dropout whose rows the batch rules lose without shapes refuses to draw
    (main drew it with the local shape: another loss than eager's, silently), leaving the generator as it
    was; in eval it runs as eager; given ``example_inputs=``, the program draws eager's values."""
    import torch.distributed as dist

    import dpcompile

    mesh = _mesh({"dp": 2})
    torch.manual_seed(0)
    model = _WrittenOutAttention().double()
    x = torch.randn(4, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    local = x[2 * dist.get_rank() : 2 * dist.get_rank() + 2]
    unplaced = dpcompile.transform(copy.deepcopy(model), mesh)
    state = torch.get_rng_state()
    with pytest.raises(dpcompile.ArgumentError, match=r"random op 'drop' .* example_inputs="):
        unplaced(local)
    assert torch.equal(torch.get_rng_state(), state)
    unplaced.eval()
    expected = model.eval()(x)
    loss = unplaced(local).detach().clone()
    dist.all_reduce(loss, group=mesh.get_group("dp"))
    torch.testing.assert_close(loss / 2, expected.detach())
    model.train()
    pm = dpcompile.transform(copy.deepcopy(model), mesh, example_inputs=(local,))
    torch.manual_seed(5)
    expected = model(x)
    torch.manual_seed(5)
    loss = pm(local).detach().clone()
    dist.all_reduce(loss, group=mesh.get_group("dp"))
    torch.testing.assert_close(loss / 2, expected.detach())


def check_cells_copy_the_fork_servers_programs() -> None:
    """Before any cell ran, the programs the fork server captured (``export_for_ranks``) are in the
    dict this rank's cells read: they copy them instead of exporting each model again (about 5 s of
    CPU a model a rank)."""
    import sys

    if "transformers" not in sys.modules:  # the fork server had no transformers to export with
        return
    captured = {key[1] for key in CAPTURED if key[0] == "exact_random_mesh"}
    assert captured >= {"gpt2", "bert", "vit"}, f"the fork server's programs did not reach the rank: {sorted(CAPTURED)}"


def check_full_tensors_equal_each_full_tensor() -> None:
    """``state_dict()`` of an FSDP program gathers its row shards in one flat all-gather per dtype
    (``dpcompile.runtime.dtensor_gather.full_tensors``): equal to each ``full_tensor()``, bit for bit,
    for rows that divide the ranks, that do not (a rank with none), a 3-D and an empty tensor, two
    dtypes, beside a replicated DTensor, one that needs its gradient and a plain tensor (each as it is)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from dpcompile.runtime.dtensor_gather import full_tensors

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    g = torch.Generator().manual_seed(3)
    shapes = {"w": (4, 3), "odd": (3, 2), "one": (1, 5), "cube": (5, 2, 2), "empty": (0, 4), "ids": (3,)}
    values = {key: torch.randn(*shape, generator=g, dtype=torch.float64) for key, shape in shapes.items()}
    values["ids"] = torch.arange(7, 10)
    values["single"] = torch.randn(5, 2, generator=g, dtype=torch.float32)
    sharded = {key: distribute_tensor(v, mesh, [Shard(0)]) for key, v in values.items()}
    sharded["whole"] = distribute_tensor(values["w"] * 2, mesh, [Replicate()])
    sharded["grad"] = distribute_tensor(values["odd"], mesh, [Shard(0)]).requires_grad_()
    sharded["plain"] = values["w"]
    got = full_tensors(sharded)
    assert list(got) == list(sharded)
    for key, value in sharded.items():
        want = value.full_tensor() if hasattr(value, "full_tensor") else value
        assert not isinstance(got[key], DTensor) and got[key].dtype == want.dtype, key
        assert torch.equal(got[key].detach(), want.detach()), f"{key}: {got[key]} != {want}"


def _check(name: str, layout: dict[str, int], data_parallel: str, schedule: str | None):
    import functools

    if schedule is None:
        return functools.partial(check_trains_like_eager, name, layout, data_parallel)
    return functools.partial(check_pipeline_trains_like_eager, name, layout, schedule, data_parallel)


def _checks(world: int) -> list[tuple[str, object]]:
    checks = [("cells-copy-the-fork-servers-programs", check_cells_copy_the_fork_servers_programs),
              ("full-tensors-equal-each-full-tensor", check_full_tensors_equal_each_full_tensor)] if world == 2 else []
    checks += [
        (f"{name}-{label}", _check(name, *spec))
        for label, spec in LAYOUTS[world].items()
        for name in MESH_MODELS
    ]
    if world == 2:  # FSDP's blocks are called whole: their random ops draw through a scope
        checks.append(("blocks-fsdp", _check("blocks", {"dp": 2}, "fsdp", None)))
        checks.append(("dropout-rows-unknown-without-examples", check_dropout_rows_unknown_without_examples))
    return checks


def _entry(rank: int, world: int, port: int, results) -> None:
    run_checks(rank, world, port, _checks(world), results)


_OUTCOMES: dict[int, dict] = {}


def _outcomes(world: int) -> dict:
    if world not in _OUTCOMES:
        _OUTCOMES[world] = run_spawned(_entry, world, timeout=GROUP_TIMEOUT_S, prepare=[PREPARE])
    return _OUTCOMES[world]


def _assert_passed(world: int, check: str) -> None:
    assert_group_passed(_outcomes(world), world, check, timeout=GROUP_TIMEOUT_S)


@pytest.mark.parametrize("check", [name for name, _ in _checks(2)])
@pytest.mark.xdist_group("exact_random_mesh_2")  # one spawned group, on one worker
def test_exact_random_mesh_trains_like_eager(check):
    """dp (DDP, FSDP), tp and pp (GPipe, 1F1B) over 2 gloo ranks: losses, gradients, generator states
    (BERT and ViT: AdamW, and the parameters after 3 steps)."""
    _assert_passed(2, check)


@pytest.mark.parametrize("check", [name for name, _ in _checks(4)])
@pytest.mark.xdist_group("exact_random_mesh_4")  # one spawned group, on one worker
def test_exact_random_mesh_combinations_train_like_eager(check):
    """dp x tp (DDP, FSDP), pp x dp (replicated, FSDP) and pp x tp, GPipe and 1F1B (the transformers
    each composition in one of them), over 4 gloo ranks: losses, gradients, generator states."""
    _assert_passed(4, check)
