"""Random ops draw the single-device values in every one-process layout (``exact_random=True``, the
default): an MLP with dropout (module, functional) and ``randn_like`` noise, GPT-2 and BERT with
their default dropout and a ViT with attention dropout (transformers, tiny configs, the export
frontend with ``labels=``). Over 3 SGD steps from the same seed each loss and gradient equals
eager's and ``torch.get_rng_state()`` after each step equals eager's, on dp, tp (with and without
``sequence_parallel=True``), the pipeline and its compositions (pp, pp x tp, pp x dp, pp x dp x tp), each
under GPipe and 1F1B, and dp x tp. (float64 models: equal up to float64 rounding.)"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile.capture import capture_model
from tests.helpers import full_gradients
from tests.thirdparty import import_or_skip

LAYOUTS = {
    "dp": {"mesh": {"dp": 2}},
    "tp": {"mesh": {"tp": 2}},
    "gpipe": {"mesh": {"pp": 2}, "micro_batches": 2},
    "1f1b": {"mesh": {"pp": 2}, "micro_batches": 2, "schedule": "1f1b"},
    "pp_tp": {"mesh": {"pp": 2, "tp": 2}, "micro_batches": 2},
}
COMPOSED = {  # data parallel over what the other dimensions build (dp copies on their own devices)
    "dp_tp": {"mesh": {"dp": 2, "tp": 2}},
    "pp_dp": {"mesh": {"pp": 2, "dp": 2}, "micro_batches": 2},
    "pp_dp_tp": {"mesh": {"pp": 2, "dp": 2, "tp": 2}, "micro_batches": 2},
}
MORE = {  # the pipelines' compositions under 1F1B, and tp with the activations on sequence shards
    "pp_tp_1f1b": {"mesh": {"pp": 2, "tp": 2}, "micro_batches": 2, "schedule": "1f1b"},
    "pp_dp_1f1b": {"mesh": {"pp": 2, "dp": 2}, "micro_batches": 2, "schedule": "1f1b"},
    "pp_dp_tp_1f1b": {"mesh": {"pp": 2, "dp": 2, "tp": 2}, "micro_batches": 2, "schedule": "1f1b"},
    "tp_sp": {"mesh": {"tp": 2}, "sequence_parallel": True},
}
FSDP = {  # data parallel as FSDP in one process: one piece of each parameter per dp copy
    "fsdp": {"mesh": {"dp": 2}, "data_parallel": "fsdp"},
    "fsdp_tp": {"mesh": {"dp": 2, "tp": 2}, "data_parallel": "fsdp"},
    "pp_fsdp": {"mesh": {"pp": 2, "dp": 2}, "micro_batches": 2, "data_parallel": "fsdp"},
}
#: every layout built in one process but context parallel (its own tests below: a block with attention)
ALL_LAYOUTS = {**LAYOUTS, **COMPOSED, **MORE, **FSDP}
V = 64


class DropoutMLP(nn.Module):
    """Dropout in both pipeline stages, as a module and as a function, and noise from ``randn_like``."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.drop1 = nn.Dropout(0.25)
        self.fc2 = nn.Linear(4 * width, width)
        self.fc3 = nn.Linear(width, 4 * width)
        self.fc4 = nn.Linear(4 * width, 4)

    def forward(self, x, labels):
        h = self.fc2(self.drop1(F.gelu(self.fc1(x))))
        h = h + 0.1 * torch.randn_like(h)
        h = F.dropout(F.gelu(self.fc3(h)), p=0.5, training=self.training)
        return F.cross_entropy(self.fc4(h), labels)


def _mlp():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=g, dtype=torch.float64)
    return DropoutMLP, {"x": x, "labels": torch.randint(0, 4, (6,), generator=g)}


def _tokens():
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(1, V, (4, 8), generator=g), "labels": torch.randint(0, V, (4, 8), generator=g)}


def _gpt2():
    T = import_or_skip("transformers")
    config = T.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=V, n_positions=16, use_cache=False)
    return (lambda: T.GPT2LMHeadModel(config)), _tokens()


def _bert():
    T = import_or_skip("transformers")
    config = T.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                          vocab_size=V, max_position_embeddings=16)  # fmt: skip
    kwargs = _tokens()
    kwargs["labels"] = kwargs["labels"][:, 0] % 2
    return (lambda: T.BertForSequenceClassification(config)), kwargs


def _vit():
    T = import_or_skip("transformers")
    config = T.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=32, num_labels=3, hidden_dropout_prob=0.1,
                         attention_probs_dropout_prob=0.1)  # fmt: skip
    g = torch.Generator().manual_seed(2)
    pixels = torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64)
    return (lambda: T.ViTForImageClassification(config)), {"pixel_values": pixels, "labels": torch.tensor([0, 2, 1, 2])}


MODELS = {"mlp": _mlp, "gpt2": _gpt2, "bert": _bert, "vit": _vit}
_CAPTURED: dict[str, tuple] = {}


def _captured(name):
    """``(make, kwargs, initial state, program)``: each transformers model is exported once per module."""
    if name not in _CAPTURED:
        make, kwargs = MODELS[name]()
        torch.manual_seed(0)
        model = make().double().train()
        program = model
        if name != "mlp":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                program = capture_model(model, frontend="export", example_kwargs=kwargs)[0]
        _CAPTURED[name] = (make, kwargs, copy.deepcopy(model.state_dict()), program)
    return _CAPTURED[name]


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def _devices(layout):
    n = 1
    for size in layout["mesh"].values():
        n *= size
    return ["cpu"] * n


def _check_training_matches_eager(name, layout):
    make, kwargs, initial, program = _captured(name)
    program.load_state_dict(initial)
    program.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    reference = make().double().train()
    reference.load_state_dict(initial)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(program, _devices(layout), example_kwargs=kwargs, **layout)
    pm.train()
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    sharded = bool(getattr(pm, "param_shards", None))
    for step in range(3):
        torch.manual_seed(100 + step)
        loss = _loss(pm(**kwargs))
        loss.backward()
        state = torch.get_rng_state()
        torch.manual_seed(100 + step)
        expected = _loss(reference(**kwargs))
        expected.backward()
        assert torch.equal(state, torch.get_rng_state()), f"the generator after step {step} is not eager's"
        torch.testing.assert_close(loss, expected, msg=lambda m, step=step: f"loss of step {step}: {m}")
        grads = full_gradients(pm) if sharded else {k: p.grad for k, p in pm.named_parameters()}
        for key, p in reference.named_parameters():
            torch.testing.assert_close(grads[key], p.grad, msg=lambda m, key=key, step=step: f"grad {key}, step {step}: {m}")
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize("layout", list(ALL_LAYOUTS))
def test_exact_random_mlp_trains_like_eager(layout):
    """Dropout and randn_like in both stages: 3 steps' losses, gradients and generator states equal eager's."""
    _check_training_matches_eager("mlp", ALL_LAYOUTS[layout])


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(ALL_LAYOUTS))
@pytest.mark.parametrize("name", ["gpt2", "bert", "vit"])
def test_exact_random_transformers_train_like_eager(name, layout):
    """GPT-2 and BERT with their default dropout, ViT with attention dropout: as eager over 3 steps
    on every one-process layout (pp x dp x tp: every dimension composed at once)."""
    _check_training_matches_eager(name, ALL_LAYOUTS[layout])


@pytest.mark.parametrize("batch", [3, 5])
@pytest.mark.parametrize("layout", ["dp", "gpipe", "1f1b"])
def test_exact_random_uneven_and_small_batches(layout, batch):
    """A batch that splits unevenly (3 or 5 over 2), or is smaller than the micro-batches (3 or 5 over 4):
    the program built for it still draws eager's values and leaves the generator where eager does."""
    make, kwargs, initial, program = _captured("mlp")
    program.load_state_dict(initial)
    reference = make().double().train()
    reference.load_state_dict(initial)
    options = dict(LAYOUTS[layout])
    if "micro_batches" in options:
        options["micro_batches"] = 4
    pm = dpcompile.transform(program, _devices(options), example_kwargs=kwargs, **options)
    x, labels = kwargs["x"][:batch], kwargs["labels"][:batch]
    torch.manual_seed(7)
    got = pm(x, labels)
    state = torch.get_rng_state()
    torch.manual_seed(7)
    torch.testing.assert_close(got, reference(x, labels))
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dp", "tp", "gpipe"])
def test_exact_random_on_cuda_matches_eager(layout):
    """On CUDA (two virtual devices on cuda:0) dropout and randn_like draw eager's values from the
    CUDA generator (dropout of ones draws the fused kernel's mask), which ends where eager's does."""
    make, kwargs, initial, _ = _captured("mlp")
    torch.manual_seed(0)
    model = make().double().cuda().train()
    model.load_state_dict(initial)
    reference = make().double().cuda().train()
    reference.load_state_dict(initial)
    cuda_kwargs = {k: v.cuda() for k, v in kwargs.items()}
    pm = dpcompile.transform(model, ["cuda:0"] * 2, example_kwargs=cuda_kwargs, **LAYOUTS[layout])
    torch.cuda.manual_seed(5)
    got = pm(**cuda_kwargs)
    state = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(5)
    torch.testing.assert_close(got, reference(**cuda_kwargs))
    assert torch.equal(state, torch.cuda.get_rng_state())


@pytest.mark.gpu
def test_exact_attention_on_cuda_draws_the_memory_efficient_kernels_mask():
    """float32 SDPA with dropout on CUDA runs the memory-efficient kernel: split in two by rows, the
    written-out attention multiplies by that kernel's mask (equal up to float32 rounding) and leaves the
    CUDA generator where the kernel does."""
    from dpcompile.runtime import exact_attention, random_draws

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 2, 16, 8, generator=g).cuda() for _ in range(3))
    torch.cuda.manual_seed(3)
    want = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True)
    state = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(3)
    pieces = [(t[:2], t[2:]) for t in (q, k, v)]
    draws = random_draws(pieces[0], 0)
    got = torch.cat([exact_attention(draws, "attn", pieces[0][r], pieces[1][r], pieces[2][r], None, 0.25, True,
                                     rows=(r, 0)) for r in range(2)])  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(state, torch.cuda.get_rng_state())


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dp", "tp", "gpipe"])
def test_exact_random_gpt_block_with_sdpa_dropout_on_cuda_trains_like_eager(layout):
    """A hand-written GPT block (SDPA dropout, float32) on ``["cuda:0"] * 2``: 2 steps' losses equal
    eager's up to float32 rounding and the CUDA generator's state after each equals eager's."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    torch.manual_seed(0)
    model = gpu_check.TinyGPT().cuda().train()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, 64, (8, 16), generator=g).cuda() for _ in range(2))
    pm = dpcompile.transform(model, ["cuda:0"] * 2, example_inputs=(ids, labels), **LAYOUTS[layout])
    for step in range(2):
        torch.manual_seed(10 + step)
        loss = pm(ids, labels)
        loss.backward()
        state = torch.cuda.get_rng_state()
        torch.manual_seed(10 + step)
        want = reference(ids, labels)
        want.backward()
        assert torch.equal(state, torch.cuda.get_rng_state()), f"the CUDA generator after step {step} is not eager's"
        torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-5)


def test_attention_dropout_of_an_unreproduced_kernel_warns_once():
    """Where eager would run the flash or cuDNN kernel (half precision on CUDA), whose mask is not
    reproduced, the site warns once, naming itself and the kernel, and draws dropout of ones."""
    from dpcompile.runtime.random_cuda import attention_noise

    fallback = object()
    with pytest.warns(UserWarning, match="'attn_half'.*flash kernel.*not reproduced"):
        assert attention_noise("attn_half", "flash", torch.empty(2, 2, 4, 4), 0.1, fallback) is fallback
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert attention_noise("attn_half", "flash", torch.empty(2, 2, 4, 4), 0.1, fallback) is fallback
        assert attention_noise("attn_math", "math", torch.empty(2, 2, 4, 4), 0.1, fallback) is fallback



class CausalDropoutBlock(nn.Module):
    """Causal self-attention over ``(batch, seq, 16)`` with dropout on its input and output, and
    attention dropout ``attn_p`` (SDPA's ``dropout_p`` in training)."""

    def __init__(self, attn_p: float = 0.0):
        super().__init__()
        self.attn_p = attn_p
        self.pos = nn.Embedding(16, 16)
        self.drop_in = nn.Dropout(0.25)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        b, s, d = x.shape
        h = self.drop_in(x + self.pos(torch.arange(s, device=x.device)))
        q, k, v = self.qkv(h).view(b, s, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.attn_p if self.training else 0.0)
        y = h + F.dropout(self.out(a.transpose(1, 2).reshape(b, s, d)), p=0.5, training=self.training)
        return y.pow(2).mean()


def _sequence(length: int = 7):
    return torch.randn(2, length, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def test_exact_random_context_parallel_trains_like_eager():
    """Context parallel (the sequence split, 7 positions over 2 devices): dropout before and after
    attention draws the single-device values, each device its positions: 3 steps' losses, gradients
    and generator states equal eager's. (Attention dropout is refused: the next test.)"""
    torch.manual_seed(0)
    model = CausalDropoutBlock().double().train()
    reference = copy.deepcopy(model)
    x = _sequence()
    pm = dpcompile.transform(model, ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,))
    assert "exact_dropout" in pm.code, pm.code
    for step in range(3):
        torch.manual_seed(100 + step)
        loss = pm(x)
        loss.backward()
        state = torch.get_rng_state()
        torch.manual_seed(100 + step)
        expected = reference(x)
        expected.backward()
        assert torch.equal(state, torch.get_rng_state()), f"the generator after step {step} is not eager's"
        torch.testing.assert_close(loss, expected, msg=lambda m, step=step: f"loss of step {step}: {m}")
        for key, p in reference.named_parameters():
            got = pm.get_parameter(key)
            torch.testing.assert_close(got.grad, p.grad, msg=lambda m, key=key, step=step: f"grad {key}, step {step}: {m}")
            got.grad = p.grad = None


def test_exact_random_context_parallel_refuses_attention_dropout_by_name():
    """Attention dropout on sequence shards is not built: a DpCompileError naming the attention, its
    dropout_p and the ways out; the model is left as it was."""
    torch.manual_seed(0)
    model = CausalDropoutBlock(attn_p=0.1).double().train()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(dpcompile.DpCompileError) as caught:
        dpcompile.transform(model, ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(_sequence(),))
    message = str(caught.value)
    assert "attention 'scaled_dot_product_attention' has dropout_p=0.1" in message, message
    assert "attention dropout to 0" in message and "leave 'cp' out of mesh=" in message, message
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
