"""Pipelines that compose with data parallel over a gloo mesh, as torchtitan composes them (cut the
stage, shard it over ``"tp"``, then data parallel over ``"dp"``): FSDP2 on each stage of a 4-process
``("pp", "dp")`` mesh, and a ``("pp", "dp", "tp")`` mesh of 8 processes, replicated (by DDP on each stage
with ``ddp_options=`` too) and FSDP.

Models: an MLP stack (tied weights across the stages too, on ``("pp", "dp")`` and with FSDP on
``("pp", "dp", "tp")``) and, through the export frontend with ``labels=``, GPT-2 (tied
``wte``/``lm_head``) on ``("pp", "dp")`` and Llama on ``("pp", "dp", "tp")``;
on ``("pp", "dp", "tp")`` also an MLP with dropout and ``randn_like`` noise, GPT-2, BERT and ViT with
their dropout, whose 3 steps' losses, gradients and generator states equal eager's
(``test_exact_random_mesh.py``), and a model built on meta under FSDP, filled by ``load_checkpoint``.
Each scenario trains 3 AdamW steps on ``pm.parameters()`` beside eager on the whole batch (float64):
every step's loss and every gradient (FSDP shards all-gathered, tensor-parallel shards gathered)
equal eager's, and after the steps ``pm.state_dict()`` has the model's keys with eager's values.
Refused on main (a 3-D mesh, ``data_parallel="fsdp"`` with ``pipeline=``).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.multiprocessing as mp

from tests.gloo_groups import CAPTURED, assert_group_passed, run_checks, run_spawned
from tests.helpers import assert_mesh_pipeline_verifies, assert_stage_is_a_parallel_module, assert_whole_state_loads
from tests.integration.test_exact_random_mesh import PREPARE as EXACT_RANDOM_PREPARE
from tests.integration.test_exact_random_mesh import check_pipeline_trains_like_eager
from tests.integration.test_pipeline_mesh import TIED_ROTARY_PLAN, check_meta_model_fsdp

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # 12 processes spawned in all
GROUP_TIMEOUT_S = 480.0  # a loaded 2-core machine running 8 processes (each exports Llama)


class MLPStack(torch.nn.Module):
    """Residual MLP blocks, a head, a token loss with an ignored label."""

    def __init__(self, width: int = 8, depth: int = 4):
        super().__init__()
        nn = torch.nn
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(depth)
        )
        self.head = nn.Linear(width, 4)

    def forward(self, x, labels):
        for layer in self.layers:
            x = x + layer(x)
        return torch.nn.functional.cross_entropy(self.head(x), labels)


class TiedStack(MLPStack):
    """An embedding whose weight the head reads too (tied across the stages)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(4, 8)
        self.head.weight = self.emb.weight

    def forward(self, x, labels):
        return super().forward(x + self.emb(labels.clamp(min=0)), labels)


def _inputs(batch: int = 8):
    g = torch.Generator().manual_seed(1)
    x, labels = torch.randn(batch, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (batch,), generator=g)
    labels[0] = -100  # ignored: the mean is over the others, of the whole global batch
    return x, labels


def full_gradients(pm) -> dict[str, torch.Tensor]:
    """This stage's gradients, whole: FSDP shards all-gathered over dp, tp shards gathered (a collective)."""
    from dpcompile.fx_utils import unalias
    from dpcompile.modules.mesh_stage_dp import whole_tensor

    out = {}
    for name, p in pm.program.named_parameters():
        grad = p.grad
        if grad is None:
            continue
        name = unalias(name)
        out[name] = whole_tensor(grad, pm.shards.get(name), pm.tp_group)
    return out


def assert_steps_like_eager(pm, reference, local: tuple, whole: tuple, last: bool, *, lr: float = 0.05,
                            holds_any: tuple[str, ...] = ()) -> None:  # fmt: skip
    """3 AdamW steps of ``pm`` on this rank's ``local`` share and of ``reference`` on the ``whole``
    batch: each step's loss on the last stage (``None`` elsewhere), every gradient this stage holds
    (whole; one of ``holds_any`` among them), and then ``state_dict`` in the model's keys and values."""
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    expected_opt = torch.optim.AdamW(reference.parameters(), lr=lr)
    for step in range(3):
        out = pm(*local)
        expected = reference(*whole)
        expected = expected[1] if isinstance(expected, tuple) else expected
        expected.backward()
        if last:
            loss = out[1] if isinstance(out, tuple) else out
            torch.testing.assert_close(loss, expected.detach(), msg=lambda m, step=step: f"step {step} loss: {m}")
        else:
            assert out is None
        grads = full_gradients(pm)
        assert grads, "this stage holds no gradient"
        assert not holds_any or any(name in grads for name in holds_any), sorted(grads)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference.get_parameter(name).grad,
                                       msg=lambda m, name=name, step=step: f"step {step}, {name}: {m}")  # fmt: skip
        opt.step()
        expected_opt.step()
        opt.zero_grad()
        expected_opt.zero_grad()
    state = pm.state_dict()
    assert list(state) == list(reference.state_dict()), (list(state), list(reference.state_dict()))
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"state_dict[{key!r}]: {m}")


def _model_and_inputs(kind: str, dtype: torch.dtype = torch.float64):
    """``"mlp"`` or ``"tied"`` (an MLP stack whose head reads the embedding's weight), in ``dtype``, and
    a global batch of 8."""
    torch.manual_seed(0)
    x, labels = _inputs()
    return (TiedStack() if kind == "tied" else MLPStack()).to(dtype), (x.to(dtype), labels)


def check_trains_like_eager(shape, names, data_parallel, *, plan=False, micro=2, schedule="1f1b", kind="mlp",
                            verify=False, ddp_options=None, dtype=torch.float64):  # fmt: skip
    """3 AdamW steps: each loss and every gradient as eager's; then state_dict equals the model's. With
    ``verify``: first verify on the whole batch, OK, and a mismatch where eager's weights are corrupted.
    ``ddp_options``: DDP over "dp" on each stage with them (``pm.ddp``). ``dtype=torch.float32``: FSDP2
    reduces float32 gradients with the op it picks for its divide factor (gloo has no PREMUL_SUM)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.mesh import local_batch

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    reference, (x, labels) = _model_and_inputs(kind, dtype)
    model = copy.deepcopy(reference)
    local = local_batch((x, labels), mesh)  # this dp rank's part; the tp ranks of a dp rank feed the same
    pm = dpcompile.transform(model, mesh, pipeline=mesh.size(0), micro_batches=micro, schedule=schedule,
                             tensor_parallel=plan, data_parallel=data_parallel, example_inputs=local,
                             ddp_options=ddp_options)  # fmt: skip
    if ddp_options:
        assert pm.ddp is not None and pm.ddp.bucket_bytes_cap == int(ddp_options["bucket_cap_mb"] * 1024 * 1024)
    if plan:
        assert pm.shards, f"nothing sharded over tp: {pm.plan_reasons}"
    if data_parallel == "fsdp":
        assert pm.fsdp is not None and all(type(p).__name__ == "DTensor" for p in pm.parameters())
    if verify:
        assert_mesh_pipeline_verifies(pm, model, x, labels)
    assert_steps_like_eager(pm, reference, local, (x, labels), mesh.get_local_rank("pp") == mesh.size(0) - 1)
    assert_stage_is_a_parallel_module(pm)
    assert_whole_state_loads(pm, reference.state_dict())
    dist.barrier()


V = 64


def _transformers_decoder(kind: str):
    """A tiny GPT-2 (``wte`` and ``lm_head`` tied, read by the first and the last stage) or Llama
    (rotary ``cos``/``sin`` sent between the stages), float64, random weights, and its tokens with
    ``labels=``."""
    from tests.thirdparty import import_or_skip

    T = import_or_skip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = T.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=V, n_positions=16, resid_pdrop=0.0,
                              embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)  # fmt: skip
        model = T.GPT2LMHeadModel(config)
    else:
        config = T.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=2, vocab_size=V, max_position_embeddings=32, use_cache=False)  # fmt: skip
        model = T.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    kwargs = {"input_ids": torch.randint(1, V, (4, 8), generator=g), "labels": torch.randint(0, V, (4, 8), generator=g)}
    kwargs["labels"][0, :5] = -100
    return model.double(), kwargs


def _decoder_program(kind: str, model: torch.nn.Module, kwargs: dict) -> torch.nn.Module:
    """``model`` captured with the export frontend on ``kwargs``: captured once per process (in the
    fork server the ranks start from: ``export_for_ranks``), each call a copy loaded with ``model``'s
    weights (FSDP shards the program it is given in place)."""
    import warnings

    from dpcompile.capture import capture_model

    key = ("pipeline_mesh_compose", kind)
    if key not in CAPTURED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            CAPTURED[key] = capture_model(copy.deepcopy(model), frontend="export", example_kwargs=kwargs)[0]
    program = copy.deepcopy(CAPTURED[key])
    program.load_state_dict(model.state_dict())
    return program


def export_for_ranks() -> None:
    """Capture GPT-2 and Llama as the checks do, in the fork server the ranks start from
    (``PREPARE``, ``tests/gloo_rank_imports.py``), so that 4 and 8 ranks copy the programs instead of each
    exporting them again."""
    for kind in ("gpt2", "llama"):
        model, kwargs = _transformers_decoder(kind)
        _decoder_program(kind, model, kwargs)


def check_decoder_trains_like_eager(shape, names, data_parallel, kind, *, plan=False):
    """GPT-2 or Llama through the export frontend with labels=: 3 AdamW steps as eager (loss,
    gradients, then state_dict; GPT-2's tied weight's gradient summed over the two stages that read
    it). Llama computes its norms and logits in float32 whatever the parameters' dtype: float32
    tolerances there."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.mesh import local_batch

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    reference, kwargs = _transformers_decoder(kind)
    exported = _decoder_program(kind, reference, kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(exported, mesh, pipeline=mesh.size(0), micro_batches=2, schedule="1f1b",
                                 tensor_parallel=plan, data_parallel=data_parallel, example_kwargs=kwargs)  # fmt: skip
    if plan:
        assert pm.shards, pm.plan_reasons
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if kind == "llama" else {}
    opt = torch.optim.AdamW(pm.parameters(), lr=0.01)
    expected_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    last = mesh.get_local_rank("pp") == mesh.size(0) - 1
    local = local_batch(kwargs, mesh)
    for step in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = pm(**local)
        expected = reference(**kwargs)
        expected.loss.backward()
        if last:
            torch.testing.assert_close(out.loss, expected.loss.detach(), **tolerance)
        for name, grad in full_gradients(pm).items():
            torch.testing.assert_close(grad, reference.get_parameter(name).grad, **tolerance,
                                       msg=lambda m, name=name, step=step: f"step {step}, {name}: {m}")  # fmt: skip
        opt.step()
        expected_opt.step()
        opt.zero_grad()
        expected_opt.zero_grad()
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if kind == "llama" else {}  # AdamW moves near-zero gradients by ~lr
    state = pm.state_dict()
    assert list(state) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, **tolerance, msg=lambda m, key=key: f"state_dict[{key!r}]: {m}")
    dist.barrier()


def check_meta_model_fsdp_3d() -> None:
    """A model built on meta (a tied embedding, a rotary buffer, export's lifted constant), FSDP on each
    tensor-parallel stage of a ("pp", "dp", "tp") mesh, filled by load_checkpoint: 3 AdamW steps as eager."""
    import torch.distributed as dist

    check_meta_model_fsdp(dist.get_rank(), 8, (2, 2, 2), ("pp", "dp", "tp"), "export", TIED_ROTARY_PLAN)


#: the tied embedding's rows ("vocab") and the head's rows ("column") alike on both stages (the automatic
#: plan of stage 1 alone makes the head "row", which a tie across the stages refuses)
TIED_PLAN = {"emb": "vocab", "head": "column", **{f"layers.{i}.{j}": s for i in range(4) for j, s in ((0, "column"), (2, "row"))}}
SCENARIOS = {
    "pp_dp_fsdp": (4, [
        ("fsdp_1f1b", check_trains_like_eager, (((2, 2), ("pp", "dp"), "fsdp"), {"verify": True})),
        ("fsdp_gpipe_m1", check_trains_like_eager, (((2, 2), ("pp", "dp"), "fsdp"), {"micro": 1, "schedule": "gpipe", "dtype": torch.float32})),
        ("fsdp_tied", check_trains_like_eager, (((2, 2), ("pp", "dp"), "fsdp"), {"kind": "tied"})),
        ("replicate_tied", check_trains_like_eager, (((2, 2), ("pp", "dp"), "ddp"), {"kind": "tied"})),
        ("gpt2_fsdp", check_decoder_trains_like_eager, (((2, 2), ("pp", "dp"), "fsdp", "gpt2"), {})),
    ]),
    "pp_dp_tp": (8, [
        ("replicate_1f1b", check_trains_like_eager, (((2, 2, 2), ("pp", "dp", "tp"), "ddp"), {"plan": True})),
        ("ddp_options_tied", check_trains_like_eager,
         (((2, 2, 2), ("pp", "dp", "tp"), "ddp"), {"plan": TIED_PLAN, "kind": "tied", "ddp_options": {"bucket_cap_mb": 1e-4}})),
        ("fsdp_gpipe", check_trains_like_eager,
         (((2, 2, 2), ("pp", "dp", "tp"), "fsdp"), {"plan": True, "schedule": "gpipe", "micro": 4, "verify": True})),
        ("fsdp_tied", check_trains_like_eager, (((2, 2, 2), ("pp", "dp", "tp"), "fsdp"), {"plan": TIED_PLAN, "kind": "tied"})),
        ("llama_fsdp", check_decoder_trains_like_eager,
         (((2, 2, 2), ("pp", "dp", "tp"), "fsdp", "llama"), {"plan": True})),
        ("meta_fsdp_export", check_meta_model_fsdp_3d, ((), {})),
        # dropout and randn_like draw eager's values (test_exact_random_mesh.py; exact_random=True)
        ("exact_random_replicate_1f1b", check_pipeline_trains_like_eager,
         (("mlp", {"pp": 2, "dp": 2, "tp": 2}, "1f1b", "ddp"), {})),
        ("exact_random_fsdp_gpipe", check_pipeline_trains_like_eager,
         (("mlp", {"pp": 2, "dp": 2, "tp": 2}, "gpipe", "fsdp"), {})),
        *((f"exact_random_{name}", check_pipeline_trains_like_eager,
           ((name, {"pp": 2, "dp": 2, "tp": 2}, schedule, data_parallel), {}))
          for name, schedule, data_parallel in (("gpt2", "gpipe", "ddp"), ("bert", "1f1b", "fsdp"), ("vit", "gpipe", "ddp"))),
    ]),
}  # fmt: skip


#: what the fork server calls before it forks each scenario's ranks (``run_spawned(prepare=)``)
PREPARE = {"pp_dp_fsdp": ["tests.integration.test_pipeline_mesh_compose:export_for_ranks"],
           "pp_dp_tp": ["tests.integration.test_pipeline_mesh_compose:export_for_ranks", EXACT_RANDOM_PREPARE]}


def _entry(rank: int, world: int, port: int, scenario: str, results: mp.Queue) -> None:
    checks = [
        (name, functools.partial(check, *args, **kwargs)) for name, check, (args, kwargs) in SCENARIOS[scenario][1]
    ]
    run_checks(rank, world, port, checks, results)


@pytest.fixture(scope="module")
def outcomes():
    return {}


def _check(outcomes: dict, scenario: str, name: str) -> None:
    if scenario not in outcomes:
        outcomes[scenario] = run_spawned(_entry, SCENARIOS[scenario][0], scenario, timeout=GROUP_TIMEOUT_S,
                                         prepare=PREPARE[scenario])
    assert_group_passed(outcomes[scenario], SCENARIOS[scenario][0], name, timeout=GROUP_TIMEOUT_S)


@pytest.mark.parametrize("name", [name for name, _, _ in SCENARIOS["pp_dp_fsdp"][1]])
@pytest.mark.xdist_group("compose_4")  # one spawned group, on one worker
def test_pipeline_mesh_fsdp_trains_like_eager(outcomes, name):
    """A ("pp", "dp") mesh of 2 x 2 with FSDP2 on each stage (and tied weights summed over the
    stages, FSDP or replicated): 3 AdamW steps as eager."""
    _check(outcomes, "pp_dp_fsdp", name)


@pytest.mark.parametrize("name", [name for name, _, _ in SCENARIOS["pp_dp_tp"][1]])
@pytest.mark.xdist_group("compose_8")  # one spawned group, on one worker
def test_pipeline_mesh_three_dimensions_trains_like_eager(outcomes, name):
    """A ("pp", "dp", "tp") mesh of 2 x 2 x 2, data parallel replicated or FSDP: 3 AdamW steps as eager
    (``exact_random_*``: an MLP with dropout, 3 SGD steps, every rank's generator state as eager's)."""
    _check(outcomes, "pp_dp_tp", name)
