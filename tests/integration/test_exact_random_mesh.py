"""Random ops draw the single-device values over a gloo ``DeviceMesh`` (``exact_random=True``, the
default): every rank draws each site's whole tensor from its identically seeded generator and keeps
its slice, with no collective. An MLP with dropout (module, functional) and ``randn_like`` noise, a
stack of FSDP-wrapped blocks with dropout inside, GPT-2 and BERT with their default dropout and a ViT
with attention dropout (tiny, float64, exported), over ``("dp",)`` (DDP, FSDP), ``("tp",)``,
``("dp", "tp")``, ``("pp",)`` (GPipe, 1F1B), ``("pp", "dp")`` and ``("pp", "tp")`` meshes: over 3 SGD steps from the same seed the loss (averaged
over the dp ranks) and every gradient (this rank's shard, this stage's parameters) equal eager's on
the global batch, and ``torch.get_rng_state()`` after each step equals eager's on every rank; BERT
and ViT train with AdamW and their parameters after the 3 steps equal eager's too.
Spawning is the expensive part, so one group of 2 and one of 4 run every check."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tests.gloo_groups import assert_group_passed, run_checks, run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # 6 processes spawned; GPT-2 exported on each
GROUP_TIMEOUT_S = 900.0  # spawning, importing transformers and the first gloo connections are slow on a loaded machine
V = 64


def _mlp(rows: int, tied: bool = True):
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


def _blocks(rows: int, tied: bool = True):
    g = torch.Generator().manual_seed(1)
    kwargs = {"x": torch.randn(rows, 8, generator=g, dtype=torch.float64), "labels": torch.randint(0, 4, (rows,), generator=g)}
    return DropoutStack, kwargs


def _gpt2(rows: int, tied: bool = True):
    from tests.thirdparty import import_or_skip

    T = import_or_skip("transformers")

    config = T.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=V, n_positions=16, use_cache=False,
                          tie_word_embeddings=tied)  # a ("pp", "tp") mesh refuses tied weights across stages
    g = torch.Generator().manual_seed(0)
    kwargs = {"input_ids": torch.randint(1, V, (rows, 8), generator=g), "labels": torch.randint(0, V, (rows, 8), generator=g)}
    return (lambda: T.GPT2LMHeadModel(config)), kwargs


def _bert(rows: int, tied: bool = True):
    from tests.thirdparty import import_or_skip

    T = import_or_skip("transformers")
    config = T.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                          vocab_size=V, max_position_embeddings=16)  # default dropout: hidden and attention 0.1
    g = torch.Generator().manual_seed(0)
    kwargs = {"input_ids": torch.randint(1, V, (rows, 8), generator=g), "labels": torch.randint(0, 2, (rows,), generator=g)}
    return (lambda: T.BertForSequenceClassification(config)), kwargs


def _vit(rows: int, tied: bool = True):
    from tests.thirdparty import import_or_skip

    T = import_or_skip("transformers")
    config = T.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=32, num_labels=3, hidden_dropout_prob=0.1,
                         attention_probs_dropout_prob=0.1)  # fmt: skip
    g = torch.Generator().manual_seed(2)
    kwargs = {"pixel_values": torch.randn(rows, 3, 8, 8, generator=g, dtype=torch.float64),
              "labels": torch.randint(0, 3, (rows,), generator=g)}  # fmt: skip
    return (lambda: T.ViTForImageClassification(config)), kwargs


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


def check_trains_like_eager(name: str, layout: dict[str, int], data_parallel: str = "ddp") -> None:
    """3 steps over the mesh against eager on the global batch: loss, gradients, generator state."""
    import torch.distributed as dist

    import dpcompile
    from dpcompile.capture import capture_model
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
    program = model
    if name not in ("mlp", "blocks"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = capture_model(model, frontend="export", example_kwargs=local)[0]
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


def check_pipeline_trains_like_eager(name: str, layout: dict[str, int], schedule: str = "gpipe") -> None:
    """A pipeline over the mesh, 2 micro-batches per rank: 3 steps (each call runs forward and backward)
    against eager on the global batch: the last stage's loss, this stage's gradients (this tp rank's
    shards), every rank's generator state."""
    import dpcompile
    from dpcompile.capture import capture_model
    from dpcompile.fx_utils import unalias
    from dpcompile.runtime.tensor_parallel import shard_of

    mesh = _mesh(layout)
    dp = layout.get("dp", 1)
    dp_rank = mesh.get_local_rank("dp") if "dp" in layout else 0
    tp_rank = mesh.get_local_rank("tp") if "tp" in layout else 0
    make, kwargs = MODELS[name](4 * dp, tied="tp" not in layout)
    torch.manual_seed(0)
    model = make().double().train()
    reference = copy.deepcopy(model)
    per = 4
    local = {k: v[dp_rank * per : (dp_rank + 1) * per] for k, v in kwargs.items()}
    program = model
    if name != "mlp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = capture_model(model, frontend="export", example_kwargs=local)[0]
    options = {"tensor_parallel": True} if "tp" in layout else {}
    cut = ["transformer.h.1"] if name == "gpt2" and "tp" in layout else layout["pp"]  # whole blocks per stage
    pm = dpcompile.transform(program, mesh, pipeline=cut, micro_batches=2, schedule=schedule,
                             example_kwargs=local, **options)  # fmt: skip
    assert "current_random_draws" in pm.code, pm.code
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
            torch.testing.assert_close(p.grad, want, msg=lambda m, key=key, step=step: f"grad {key}, step {step}: {m}")
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    for path, p in pm.program.named_parameters():
        key = unalias(path)
        want = wanted[key].detach()
        want = shard_of(want, pm.shards[key], tp_rank) if key in pm.shards else want
        torch.testing.assert_close(p.detach(), want, msg=lambda m, key=key: f"param {key} after 3 steps: {m}")


#: the MLP runs on every layout; GPT-2, BERT and ViT (attention dropout) each on a few (the suite's time),
#: together one layout per strategy: dp, FSDP, tp, pp 1F1B and dp x tp
TRANSFORMERS_LAYOUTS = {"dp": ("gpt2", "bert"), "fsdp": ("vit",), "tp": ("bert",), "pp_1f1b": ("vit",),
                        "dp_tp": ("gpt2", "vit")}  # fmt: skip


def _models(label: str) -> tuple[str, ...]:
    return ("mlp", *TRANSFORMERS_LAYOUTS.get(label, ()))


def _checks(world: int) -> list[tuple[str, object]]:
    import functools

    if world == 2:
        layouts = {"dp": ({"dp": 2}, "ddp"), "fsdp": ({"dp": 2}, "fsdp"), "tp": ({"tp": 2}, "ddp")}
    else:
        layouts = {"dp_tp": ({"dp": 2, "tp": 2}, "ddp"), "fsdp_tp": ({"dp": 2, "tp": 2}, "fsdp")}
    checks = [
        (f"{name}-{label}", functools.partial(check_trains_like_eager, name, layout, data_parallel))
        for label, (layout, data_parallel) in layouts.items()
        for name in _models(label)
    ]
    if world == 2:  # FSDP's blocks are called whole: their random ops draw through a scope
        checks.append(("blocks-fsdp", functools.partial(check_trains_like_eager, "blocks", {"dp": 2}, "fsdp")))
    pipelines = {"pp": ({"pp": 2}, "gpipe"), "pp_1f1b": ({"pp": 2}, "1f1b")} if world == 2 else {
        "pp_dp": ({"pp": 2, "dp": 2}, "gpipe"), "pp_tp": ({"pp": 2, "tp": 2}, "gpipe")}  # fmt: skip
    return checks + [
        (f"{name}-{label}", functools.partial(check_pipeline_trains_like_eager, name, layout, schedule))
        for label, (layout, schedule) in pipelines.items()
        for name in _models(label)
    ]


def _entry(rank: int, world: int, port: int, results) -> None:
    run_checks(rank, world, port, _checks(world), results)


_OUTCOMES: dict[int, dict] = {}


def _outcomes(world: int) -> dict:
    if world not in _OUTCOMES:
        _OUTCOMES[world] = run_spawned(_entry, world, timeout=GROUP_TIMEOUT_S)
    return _OUTCOMES[world]


def _assert_passed(world: int, check: str) -> None:
    assert_group_passed(_outcomes(world), world, check, timeout=GROUP_TIMEOUT_S)


@pytest.mark.parametrize(
    "check", ["mlp-dp", "gpt2-dp", "bert-dp", "mlp-fsdp", "vit-fsdp", "blocks-fsdp", "mlp-tp", "bert-tp",
              "mlp-pp", "mlp-pp_1f1b", "vit-pp_1f1b"],
)  # fmt: skip
@pytest.mark.xdist_group("exact_random_mesh_2")  # one spawned group, on one worker
def test_exact_random_mesh_trains_like_eager(check):
    """dp (DDP, FSDP), tp and pp (GPipe, 1F1B) over 2 gloo ranks: losses, gradients, generator states
    (BERT and ViT: AdamW, and the parameters after 3 steps)."""
    _assert_passed(2, check)


@pytest.mark.parametrize(
    "check", ["mlp-dp_tp", "gpt2-dp_tp", "vit-dp_tp", "mlp-fsdp_tp", "mlp-pp_dp", "mlp-pp_tp"],
)  # fmt: skip
@pytest.mark.xdist_group("exact_random_mesh_4")  # one spawned group, on one worker
def test_exact_random_mesh_combinations_train_like_eager(check):
    """dp x tp (DDP, FSDP), pp x dp and pp x tp over 4 gloo ranks: losses, gradients, generator states."""
    _assert_passed(4, check)
