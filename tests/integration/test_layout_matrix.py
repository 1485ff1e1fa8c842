"""The layout matrix in one process: every layout built on virtual devices (``docs/layouts.md``) x
{an MLP stack, GPT-2 through the export frontend with ``labels=``, a Llama-style decoder}: the loss
of each of 3 AdamW steps, and the parameters after them, equal eager; ``state_dict`` keys and
values equal the model's; a model built on meta and filled by ``load_checkpoint`` gives eager's
outputs. (float64 models, so equal means equal up to float64 rounding.)"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.capture import capture_model
from tests.helpers import full_gradients
from tests.thirdparty import import_or_skip

LAYOUTS = [{"dp": 2}, {"tp": 2}, {"pp": 2}, {"pp": 2, "tp": 2}]
# dp composed over the program the other dimensions build (target.replicate_over_dp)
COMPOSED = [{"dp": 2, "tp": 2}, {"pp": 2, "dp": 2}, {"pp": 2, "dp": 2, "tp": 2}]
V = 64


class MLPStack(nn.Module):
    def __init__(self, width: int = 8, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(depth)
        )
        self.head = nn.Linear(width, 4)

    def forward(self, x, labels):
        for layer in self.layers:
            x = x + layer(x)
        return nn.functional.cross_entropy(self.head(x), labels)


def _mlp():
    g = torch.Generator().manual_seed(1)
    return MLPStack, {"x": torch.randn(6, 8, generator=g, dtype=torch.float64), "labels": torch.randint(0, 4, (6,), generator=g)}


def _gpt2():
    T = import_or_skip("transformers")
    config = T.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=V, n_positions=16, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)  # fmt: skip
    return (lambda: T.GPT2LMHeadModel(config)), _tokens()


def _llama():
    T = import_or_skip("transformers")
    config = T.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, vocab_size=V, max_position_embeddings=32, use_cache=False)  # fmt: skip
    return (lambda: T.LlamaForCausalLM(config)), _tokens()


def _tokens():
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(1, V, (4, 8), generator=g), "labels": torch.randint(0, V, (4, 8), generator=g)}


MODELS = {"mlp": _mlp, "gpt2": _gpt2, "llama": _llama}
# Llama computes its RMSNorms and logits in float32 whatever the parameters' dtype, and a sharded
# program sums those float32 values in another order: float32 tolerances there
TOLERANCE = {"llama": {"rtol": 1e-5, "atol": 1e-5}}
# AdamW divides each update by the gradient's running magnitude: an element whose gradient is near
# zero moves by ~lr whatever its rounding, so the parameters of a float32-rounding model are compared
# to a fraction of lr (its gradients, compared above at every step, are the exact check)
PARAMETER_TOLERANCE = {"llama": {"rtol": 1e-4, "atol": 1e-4}}


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def _build(make):
    torch.manual_seed(0)
    return make().double()


def _devices(layout):
    n = 1
    for size in layout.values():
        n *= size
    return ["cpu"] * n


def _transform(model, layout, kwargs, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dpcompile.transform(model, _devices(layout), mesh=layout, example_kwargs=kwargs, **options)


_CAPTURED: dict[str, tuple] = {}


def _captured(name):
    """``(make, kwargs, model, initial state, program)``: the transformers models are exported once
    per module (most of the time of a test), and every layout lowers that program."""
    if name not in _CAPTURED:
        make, kwargs = MODELS[name]()
        model = _build(make)
        program = model
        if name != "mlp":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                program = capture_model(model, frontend="export", example_kwargs=kwargs)[0]
        _CAPTURED[name] = (make, kwargs, model, copy.deepcopy(model.state_dict()), program)
    return _CAPTURED[name]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS + COMPOSED, ids=lambda layout: "x".join(layout))
@pytest.mark.parametrize("name", list(MODELS))
def test_layout_matrix_trains_like_eager(name, layout):
    """3 AdamW steps: each loss and gradient equals eager, and the parameters after them; state_dict
    equals the model's."""
    _check_trains_like_eager(name, layout)


ONE_F_ONE_B = [
    ("mlp", {"pp": 2, "dp": 2}),
    ("mlp", {"pp": 2, "tp": 2}),
    pytest.param("gpt2", {"pp": 2, "tp": 2}, marks=pytest.mark.slow),
    pytest.param("llama", {"pp": 2, "tp": 2}, marks=pytest.mark.slow),
    ("mlp", {"pp": 2, "dp": 2, "tp": 2}),
]


@pytest.mark.parametrize(("name", "layout"), ONE_F_ONE_B, ids=lambda v: v if isinstance(v, str) else "x".join(v))
def test_layout_matrix_1f1b_trains_like_eager(name, layout):
    """schedule='1f1b' with 2 micro-batches in each dp copy (each unit a stage's shards for one
    micro-batch, their collectives inside it): the same 3 steps as eager."""
    _check_trains_like_eager(name, layout, schedule="1f1b", micro_batches=2)


FSDP = [
    ("mlp", {"dp": 2}, {}),
    ("mlp", {"dp": 2, "tp": 2}, {}),
    ("mlp", {"pp": 2, "dp": 2}, {}),
    ("mlp", {"pp": 2, "dp": 2}, {"schedule": "1f1b", "micro_batches": 2}),
    ("mlp", {"pp": 2, "dp": 2, "tp": 2}, {}),
    pytest.param("gpt2", {"dp": 2, "tp": 2}, {}, marks=pytest.mark.slow),
]  # gpt2 over dp and pp x dp, and llama over dp x tp, pass too (~6 s, 5 s, 14 s): left out for the suite's time


@pytest.mark.parametrize(("name", "layout", "options"), FSDP,
                         ids=lambda v: v if isinstance(v, str) else "x".join(v) if "micro_batches" not in v else "1f1b")  # fmt: skip
def test_layout_matrix_fsdp_trains_like_eager(name, layout, options):
    """data_parallel="fsdp" in one process (each parameter one piece per dp copy, gathered where it
    is read): the same 3 steps as eager, and each parameter stored once, as pieces."""
    pm = _check_trains_like_eager(name, layout, data_parallel="fsdp", **options)
    assert pm.strategies["dp"] == "data parallel (fsdp)"
    whole = [n for n, p in pm.named_parameters() if ".parametrizations." not in n and p.dim() > 0]
    assert not whole, whole
    pieces = sum(p.numel() for p in pm.parameters())
    assert pieces == sum(p.numel() for p in _captured(name)[2].parameters())


def _check_trains_like_eager(name, layout, **options):
    make, kwargs, model, initial, program = _captured(name)
    model.load_state_dict(initial)
    model.zero_grad(set_to_none=True)
    reference = _build(make)
    reference.load_state_dict(initial)
    pm = _transform(program, layout, kwargs, **options)
    assert pm.layout == layout
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        loss = _loss(pm(**kwargs))
        loss.backward()
        expected = _loss(reference(**kwargs))
        expected.backward()
        torch.testing.assert_close(loss, expected, **TOLERANCE.get(name, {}),
                                   msg=lambda m, step=step: f"loss of step {step}: {m}")
        grads = full_gradients(pm) if getattr(pm, "param_shards", None) else dict(pm.named_parameters())
        for key, p in reference.named_parameters():
            got = grads[key] if getattr(pm, "param_shards", None) else grads[key].grad
            torch.testing.assert_close(got, p.grad, **TOLERANCE.get(name, {}),
                                       msg=lambda m, key=key, step=step: f"gradient of {key}, step {step}: {m}")
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    state, ref_state = pm.state_dict(), reference.state_dict()
    assert list(state) == list(ref_state)
    for key, value in ref_state.items():
        # AdamW divides by the gradient's running magnitude, so a float64 rounding difference in a
        # near-zero gradient (a rare token's embedding row, summed in another order) shows at ~1e-7
        torch.testing.assert_close(state[key], value, **PARAMETER_TOLERANCE.get(name, {"rtol": 1e-5, "atol": 1e-6}),
                                   msg=lambda m, key=key: f"{key} after 3 steps: {m}")
    return pm


PICKLED = {
    "pp": {"mesh": {"pp": 2}, "micro_batches": 2},
    "pp_1f1b": {"mesh": {"pp": 2}, "micro_batches": 2, "schedule": "1f1b"},
    "pp_dp": {"mesh": {"pp": 2, "dp": 2}},
    "pp_tp": {"mesh": {"pp": 2, "tp": 2}, "micro_batches": 2},
    "pp_tp_1f1b": {"mesh": {"pp": 2, "tp": 2}, "micro_batches": 2, "schedule": "1f1b"},
    "dp_tp": {"mesh": {"dp": 2, "tp": 2}},
    "pp_dp_tp": {"mesh": {"pp": 2, "dp": 2, "tp": 2}},
}


@pytest.mark.parametrize("options", list(PICKLED.values()), ids=list(PICKLED))
def test_layout_matrix_pipeline_pickles_with_its_outputs_and_gradients(options):
    """torch.save / torch.load of a one-process pipeline (tensor-parallel stages too): the copy is the
    same kind of program (stages, schedule, stage devices), its loss and every gradient equal the
    original's, after an SGD step on each their state dicts and the next losses are equal, and so
    are the losses of a program neither had built (eval, one sample)."""
    make, kwargs, model, initial, _ = _captured("mlp")
    model.load_state_dict(initial)
    layout = options["mesh"]
    pm = _transform(copy.deepcopy(model), layout, kwargs, **{k: v for k, v in options.items() if k != "mesh"})
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    kind = (type(pm).__mro__[1:], len(pm.stages), pm.schedule, pm.__dict__.get("stage_groups"))
    assert (type(loaded).__mro__[1:], len(loaded.stages), loaded.schedule, loaded.__dict__.get("stage_groups")) == kind
    assert [s.code for s in loaded.stages] == [s.code for s in pm.stages]
    losses = []
    for program in (pm, loaded):
        losses.append(_loss(program(**kwargs)))
        losses[-1].backward()
    torch.testing.assert_close(losses[1].detach(), losses[0].detach())
    for (name, p), q in zip(pm.named_parameters(), loaded.parameters(), strict=True):
        assert q.device == p.device, name
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")
    for program in (pm, loaded):
        torch.optim.SGD(program.parameters(), lr=0.1).step()
    after = pm.state_dict()
    assert list(loaded.state_dict()) == list(after)
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, after[key], msg=lambda m, key=key: f"{key} after a step: {m}")
    with torch.no_grad():
        torch.testing.assert_close(_loss(loaded(**kwargs)), _loss(pm(**kwargs)))
        one = {key: value[:1] for key, value in kwargs.items()}  # fewer samples than micro-batches, in eval:
        torch.testing.assert_close(_loss(loaded.eval()(**one)), _loss(pm.eval()(**one)))  # a program built anew


META_CELLS = [("mlp", layout) for layout in LAYOUTS + COMPOSED] + [("gpt2", LAYOUTS[-1]), ("llama", LAYOUTS[-1])]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "layout"), META_CELLS, ids=lambda v: v if isinstance(v, str) else "x".join(v))
def test_layout_matrix_meta_model_loads_checkpoint(name, layout, tmp_path):
    """A model built on meta, transformed, then filled by load_checkpoint gives eager's outputs."""
    make, kwargs = MODELS[name]()
    reference = _build(make)
    path = tmp_path / "ckpt"
    dpcompile.save_checkpoint(_transform(copy.deepcopy(reference), {"dp": 2}, kwargs), path)
    with torch.device("meta"):
        meta = _build(make)
    pm = _transform(meta, layout, kwargs)
    assert pm.needs_weights
    dpcompile.load_checkpoint(pm, path)
    assert not pm.needs_weights
    reference.eval()
    pm.eval()
    with torch.no_grad():
        torch.testing.assert_close(_loss(pm(**kwargs)), _loss(reference(**kwargs)), **TOLERANCE.get(name, {}))


def test_layout_matrix_every_layout_is_a_parallel_module():
    """Every layout built in one process (and FSDP, and 1F1B) is a dpcompile.ParallelModule, a
    torch.fx.GraphModule, whose code calls the model's layers and head, and which says what runs a call
    (``pm.executor``: the program, or a pipeline's schedule). Over a mesh:
    tests/helpers.py's assert_stage_is_a_parallel_module, in the gloo groups of test_pipeline_mesh*.py)."""
    _, kwargs, model, initial, _ = _captured("mlp")
    model.load_state_dict(initial)
    cells = [(layout, {}) for layout in LAYOUTS + COMPOSED]
    cells += [({"pp": 2, "dp": 2}, {"data_parallel": "fsdp"}), ({"pp": 2, "tp": 2}, {"schedule": "1f1b", "micro_batches": 2})]
    for layout, options in cells:
        pm = _transform(model, layout, kwargs, **options)
        assert isinstance(pm, dpcompile.ParallelModule) and isinstance(pm, torch.fx.GraphModule), (layout, type(pm))
        code = pm.code
        assert isinstance(code, str) and "head" in code and "layers_3" in code, (layout, code)
        # dp composed over tp runs dp copies of a one-stage pipeline (target.replicate_over_dp): its schedule too
        scheduled = "pp" in layout or len(layout) > 1
        assert pm.executor == (options.get("schedule", "gpipe") if scheduled else "plain"), (layout, options)
