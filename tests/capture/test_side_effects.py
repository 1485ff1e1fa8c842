"""What forward writes (parameters, buffers, attributes, hooks, the RNG seed) is replayed at each
call as eager does it, or refused at transform by name; and ``transform`` leaves the user's model
exactly as it found it (docs/guards.md, "Side effects in forward")."""

from __future__ import annotations

import copy
import io
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module

import dpcompile
from tests import models
from tests.helpers import assert_steps_equal_eager
from tests.thirdparty import import_or_skip, import_timm

_GLOBAL_HOOKS = [n for n in dir(nn_module) if n.startswith("_global_") and isinstance(getattr(nn_module, n), dict)]


def _value(value: Any, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.detach().clone())
    if isinstance(value, nn.Module):
        return ("module", id(value))
    if depth < 4 and isinstance(value, dict):
        return (type(value).__name__, [(repr(k), _value(v, depth + 1)) for k, v in value.items()])
    if depth < 4 and isinstance(value, (list, tuple)):
        return (type(value).__name__, [_value(v, depth + 1) for v in value])
    if isinstance(value, (bool, int, float, str, type(None))):
        return ("plain", value)
    return ("object", type(value).__name__, id(value))


def snapshot(model: nn.Module) -> dict:
    """The model's full state: every module's ``__dict__`` (attributes, hook dicts, parameters,
    buffers and their values, recursively) and nn.Module's global hook dicts."""
    state = {(path, name): _value(v) for path, m in model.named_modules() for name, v in m.__dict__.items()}
    state.update({("<global>", name): _value(getattr(nn_module, name)) for name in _GLOBAL_HOOKS})
    return state


def _equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def changed(before: dict, after: dict) -> list[str]:
    return sorted(f"{p}.{n}" for p, n in before.keys() | after.keys() if not _equal(before.get((p, n)), after.get((p, n))))


def _bert_hidden_states(layers: int = 1) -> nn.Module:
    transformers = import_or_skip("transformers")
    config = transformers.BertConfig(
        num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = transformers.BertModel(config)

        def forward(self, input_ids):
            out = self.bert(input_ids=input_ids, output_hidden_states=True)
            return out.last_hidden_state, out.hidden_states

    return Wrapper().eval()


def _gpt2() -> nn.Module:
    transformers = import_or_skip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt2 = transformers.GPT2LMHeadModel(config)

        def forward(self, input_ids):
            out = self.gpt2(input_ids=input_ids, output_hidden_states=True)
            return out.logits, out.hidden_states

    return Wrapper().eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (4, 8))


FAMILIES = {
    "mlp": lambda: (models.MLP(), (torch.randn(4, 8),), {}),
    "batchnorm_cnn": lambda: (models.CNN(), (torch.randn(4, 3, 8, 8),), {}),
    "rnn": lambda: (models.SeqEncoder(), (torch.randint(0, 20, (5, 4)),), {}),
    "bert": lambda: (_bert_hidden_states(), (_ids(),), {}),
    "gpt2": lambda: (_gpt2(), (_ids(),), {}),
    "timm": lambda: (import_timm().create_model("convnext_atto", num_classes=10), (torch.randn(4, 3, 32, 32),), {}),
}


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["dp", "tp"])
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in ("bert", "gpt2", "timm") else f for f in FAMILIES])
def test_transform_leaves_the_model_as_it_found_it(family, tensor_parallel):
    """Attributes (recursively), hooks of every kind (also nn.Module's global ones), parameters and
    buffers, by value: the same before and after transform (transformers 5 installs its output
    recorders in the first forward, which capture runs: they are removed again)."""
    model, args, kwargs = FAMILIES[family]()
    model(*args, **kwargs) if family == "rnn" else None  # nothing: a model called before is as good
    before = snapshot(model)
    dpcompile.transform(model, ["cpu"] * 2, example_inputs=args or None, example_kwargs=kwargs or None,
                        tensor_parallel=tensor_parallel)  # fmt: skip
    assert changed(before, snapshot(model)) == []


def test_bert_hidden_states_are_not_duplicated_by_transform():
    """Two transforms of a BERT wrapper asking output_hidden_states: the model and the program both
    return 2 hidden states (1 layer), as before transform (they returned 4: hooks left behind)."""
    torch.manual_seed(0)
    model, ids = _bert_hidden_states(), _ids()
    for frontend in ("export", "export"):
        pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(ids,), frontend=frontend)
    eager = model(ids)
    out = pm(ids)
    assert len(eager[1]) == 2 and len(out[1]) == 2
    for got, want in zip(out[1], eager[1]):
        torch.testing.assert_close(got, want)


def test_export_program_serves_calls_after_an_eager_call_that_installs_hooks():
    """transformers 5's output recorders, which forward installs at its first eager call, are the
    model's own: the export program keeps serving (it refused every call with ModelChanged)."""
    torch.manual_seed(0)
    model, ids = _bert_hidden_states(), _ids()
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(ids,), frontend="export")
    eager = model(ids)  # installs the hooks
    out = pm(ids)
    torch.testing.assert_close(out[0], eager[0])
    assert len(out[1]) == len(eager[1]) == 2


class RescaleOnce(nn.Module):
    """A parameter rescaled in place once, behind a Python flag (read before it is written)."""

    def __init__(self):
        super().__init__()
        self.block = nn.Linear(4, 4)
        self.rescaled = False

    def forward(self, x):
        if not self.rescaled:
            with torch.no_grad():
                self.block.weight.div_(2)
            self.rescaled = True
        return self.block(x)


class SeedInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        torch.manual_seed(3)
        return self.fc(x) + torch.randn(x.shape[-1])


class CacheOfAnotherShape(nn.Module):
    """A buffer rebound to a newly computed tensor of another shape, and a tensor kept as an attribute."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(1))
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        self.cache = y.mean(0)
        self.inner.last = y.sum(0)
        return self.inner(y)


class WritesFirst(nn.Module):
    """An attribute forward writes before it reads: no change of the model."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        self.scale = 2.0
        return self.fc(x) * self.scale


def _pair(cls):
    torch.manual_seed(0)
    model, eager = cls(), cls()
    eager.load_state_dict(model.state_dict())
    return model, eager


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["dp", "tp"])
def test_flag_written_by_forward_is_replayed_at_each_call(tensor_parallel):
    """fx: the first call rescales and sets the flag, as eager does; the next calls run the program
    traced for the flag's new value (they rescaled again at every call: outputs drifted). Tensor
    parallel (sharded copies of the state) refuses it at transform, by name."""
    model, eager = _pair(RescaleOnce)
    x = torch.randn(4, 4)
    if tensor_parallel:
        with pytest.raises(dpcompile.DpCompileError, match=r"updates block.weight in place \(div_\).*tensor-parallel"):
            dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True)
        assert model.rescaled is False
        torch.testing.assert_close(model.block.weight, eager.block.weight)
        return
    pm = dpcompile.transform(model, ["cpu"] * 2)
    for _ in range(3):
        torch.testing.assert_close(pm(x), eager(x))
    assert model.rescaled is True
    torch.testing.assert_close(model.block.weight, eager.block.weight)


def test_flag_written_by_forward_is_refused_by_the_export_frontend():
    model, _ = _pair(RescaleOnce)
    with pytest.raises(dpcompile.DpCompileError, match="sets 'rescaled' to True"):
        dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(torch.randn(4, 4),))
    assert model.rescaled is False


def test_seed_set_in_forward_is_set_as_eager_sets_it():
    """fx: the program seeds the global generator where forward does: the same draw, and the
    generator left as eager leaves it; export refuses by name (it kept the draw, not the seed)."""
    model, eager = _pair(SeedInForward)
    x = torch.randn(4, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    torch.manual_seed(100)
    out, after = pm(x), torch.rand(3)
    torch.manual_seed(100)
    want, eager_after = eager(x), torch.rand(3)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(after, eager_after)
    with pytest.raises(dpcompile.DpCompileError, match=r"torch.manual_seed\(3\)"):
        dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))


def test_buffer_rebound_to_another_shape_is_written():
    """fx: ``self.cache = y.mean(0)`` rebinds the (1,) buffer to a (4,) one, and a tensor kept as a
    plain attribute is kept, as eager leaves them (it failed at every call: copy_ into (1,))."""
    model, eager = _pair(CacheOfAnotherShape)
    x = torch.randn(4, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    for _ in range(2):
        torch.testing.assert_close(pm(x), eager(x))
        torch.testing.assert_close(model.cache, eager.cache)
        torch.testing.assert_close(model.inner.last, eager.inner.last)
    assert "cache" in dict(model.named_buffers())
    with pytest.raises(dpcompile.DpCompileError, match="cache"):
        dpcompile.transform(CacheOfAnotherShape(), ["cpu"] * 2, frontend="export", example_inputs=(x,))


class CallCounter(nn.Module):
    """A buffer counted up in place and then read by what is differentiated."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return self.fc(x) * self.calls


@pytest.mark.parametrize("layout", [{}, {"tensor_parallel": True}, {"pipeline": 2}])
def test_buffer_counted_in_place_then_read_trains_under_the_export_frontend(layout):
    """export writes ``calls`` back with ``copy_(calls, calls.add_(1))``; that copy onto itself only
    bumped the version autograd checks, so backward failed ("modified by an inplace operation").
    Two training calls: outputs, the counter and the gradients equal eager."""
    model, eager = _pair(CallCounter)
    x = torch.randn(4, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,), **layout)
    for _ in range(2):
        got, want = pm(x), eager(x)
        torch.testing.assert_close(got, want)
        got.sum().backward()
        want.sum().backward()
        assert pm.state_dict()["calls"] == eager.calls  # tensor parallel keeps its own copy of the model
    torch.testing.assert_close(pm.state_dict(), eager.state_dict())
    if not layout:
        torch.testing.assert_close(model.fc.weight.grad, eager.fc.weight.grad)


def test_attribute_written_before_read_is_no_change():
    """An eager call after transform sets ``scale`` as forward does: the export program keeps
    serving (it refused every call with ModelChanged)."""
    model, eager = _pair(WritesFirst)
    x = torch.randn(4, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    assert "scale" not in model.__dict__  # transform left it as found
    model(x)
    torch.testing.assert_close(pm(x), eager(x))
    torch.testing.assert_close(pm(x), eager(x))


class _Reversible(torch.autograd.Function):
    """A reversible layer's shape: its forward holds a ``torch.no_grad()`` block, its backward is its own."""

    @staticmethod
    def forward(ctx, x, w):
        with torch.no_grad():
            y = x * 2
        ctx.save_for_backward(w)
        return y @ w

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad @ w.t() * 2, None


class Reversible(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return _Reversible.apply(self.fc(x), self.fc.weight).sum()


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["dp", "tp"])
def test_autograd_function_with_no_grad_block_keeps_its_backward(tensor_parallel):
    """fx calls the Function whole: the loss has a grad_fn and the gradients are its backward's
    (the loss had none: tracing through its no_grad block detached everything after it)."""
    model, eager = _pair(Reversible)
    x = torch.randn(4, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=tensor_parallel)
    loss, want = pm(x), eager(x)
    assert loss.grad_fn is not None
    torch.testing.assert_close(loss, want)
    loss.backward()
    want.backward()
    got = dict(pm.named_parameters())
    for name, param in eager.named_parameters():
        full = got[name] if name in got else None
        if full is not None and full.grad is not None and full.grad.shape == param.grad.shape:
            torch.testing.assert_close(full.grad, param.grad)
    assert any(p.grad is not None for p in pm.parameters())


def test_autograd_function_is_refused_by_the_export_frontend():
    model, _ = _pair(Reversible)
    with pytest.raises(dpcompile.DpCompileError, match="autograd.Function _Reversible"):
        dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(torch.randn(4, 4),))


class _StraightThrough(torch.autograd.Function):
    """Rounding with an identity gradient: no grad-mode switch in forward, a backward that is not its derivative."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ReverseGradient(torch.autograd.Function):
    """Gradient reversal (new style: ``setup_context``): identity forward, negated gradient."""

    @staticmethod
    def forward(x, scale):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class _Gelu(torch.autograd.Function):
    """BLOOM's GeLUFunction's shape: a backward that is its forward's derivative."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s + x * s * (1 - s))


class AppliesFunctions(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.fc, self.head, self.function = nn.Linear(4, 4), nn.Linear(4, 2), function

    def forward(self, x):
        h = self.fc(x) * 4
        return self.head(self.function.apply(h, 0.5) if self.function is _ReverseGradient else self.function.apply(h))


@pytest.mark.parametrize("function", [_StraightThrough, _ReverseGradient])
def test_autograd_function_whose_backward_is_not_its_derivative_is_refused_by_the_export_frontend(function):
    """torch.export keeps a Function's forward only: a straight-through estimator trained ``fc`` with zero
    gradients, a gradient reversal with unreversed ones, silently. Each is refused by name at transform, which
    changes nothing; fx calls it whole, with its own backward."""
    torch.manual_seed(0)
    model = AppliesFunctions(function).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    state, rng = {k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state()
    with pytest.raises(dpcompile.DpCompileError, match=f"autograd.Function {function.__name__}, whose backward is not"):
        dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items()) and torch.equal(torch.get_rng_state(), rng)


def test_autograd_function_whose_backward_is_its_derivative_exports():
    """The probe passes BLOOM's kind of Function: exported, its gradients are eager's."""
    torch.manual_seed(0)
    model = AppliesFunctions(_Gelu).double()
    eager = copy.deepcopy(model)
    x = torch.randn(5, 4, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    got, want = pm(x), eager(x)
    torch.testing.assert_close(got, want)
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


class _MaskedHalf(torch.autograd.Function):
    """A dropout-like Function: forward draws a mask, backward applies the mask it saved (its derivative)."""

    @staticmethod
    def forward(ctx, x):
        mask = (torch.rand_like(x) > 0.5).to(x.dtype)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask


def test_autograd_function_that_draws_is_probed_with_one_draw_and_leaves_the_random_state():
    """The gradient probe runs the Function twice (its own backward, then autograd through its forward):
    a forward that draws a mask drew two masks, so its true derivative was refused as 'not its forward's'.
    Both runs now draw from one seed, and the caller's random state is left as it was."""
    torch.manual_seed(0)
    model = AppliesFunctions(_MaskedHalf).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    rng = torch.get_rng_state()
    dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_program_calling_an_autograd_function_round_trips_torch_save():
    """fx keeps the Function whole as ``_StraightThrough_apply``, a function made at trace time that pickle
    could not find by name (a bare PicklingError from torch.save); the copy keeps the Function's backward."""
    torch.manual_seed(0)
    model = AppliesFunctions(_StraightThrough).double()
    eager = copy.deepcopy(model)
    x = torch.randn(5, 4, dtype=torch.float64)
    buffer = io.BytesIO()
    torch.save(dpcompile.transform(model, ["cpu"] * 2), buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    got, want = restored(x), eager(x)
    torch.testing.assert_close(got, want)
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(restored.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


class ReversibleBranching(Reversible):
    """Reformer's shape: the Function, and a branch on a shape fx cannot trace."""

    def forward(self, x):
        if x.size(1) != 4:
            raise ValueError("4 features")
        return super().forward(x)


def test_autograd_function_refusal_says_why_fx_did_not_take_the_model_either():
    """Under frontend="auto" the export refusal's way out (the fx frontend) had failed first: the
    refusal says why (the line fx stopped at, and its own ways out) instead of sending the user there."""
    model, _ = _pair(ReversibleBranching)
    with pytest.raises(dpcompile.DpCompileError, match=r"(?s)autograd.Function _Reversible.*fx frontend failed first.*x.size\(1\) != 4"):
        dpcompile.transform(model, ["cpu"] * 2, example_inputs=(torch.randn(4, 4),))


def test_program_without_watched_modes_is_not_described_as_mixed_mode():
    """An export program of a model in eval with ``**kwargs`` watches no module's mode: its key
    says so ("any mode"), not "mixed-mode" (which it is not)."""

    class KeywordForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, **kwargs):
            return self.fc(x)

    model, x = KeywordForward().eval(), torch.randn(4, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    assert "mixed-mode" not in pm.program_cache.main_key.describe()
    torch.testing.assert_close(pm(x), model(x))


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_export_frontend_warns_of_a_forward_hook_that_only_records():
    """torch.export keeps a hook's tensor ops, not its Python effects: a hook filling a feature dict
    is never called by the exported program, so transform says so, naming the module (it was silent:
    the dict stayed empty). A hook that returns a new output is part of the program: no warning,
    and its effect is eager's."""
    model, x = TwoLayers(), torch.randn(4, 4)
    features: dict[str, torch.Tensor] = {}
    model.a.register_forward_hook(lambda m, i, out: features.__setitem__("a", out))
    model.b.register_forward_hook(lambda m, i, out: out * 2)
    with pytest.warns(UserWarning, match=r"forward hooks of 'a' return nothing .* frontend='fx'") as caught:
        pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    assert not any("'b'" in str(w.message) for w in caught)
    torch.testing.assert_close(pm(x), model(x))


class EmaUnderNoGrad(nn.Module):
    """An EMA buffer updated inside ``torch.no_grad()``, read after the update."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("avg", torch.zeros(8))

    def forward(self, x):
        h = self.fc(x)
        if self.training:
            with torch.no_grad():
                self.avg.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return h - self.avg


@pytest.mark.parametrize("layout", [{"tensor_parallel": True}, {"mesh": {"dp": 2, "tp": 2}}], ids=["tp", "dp_tp"])
def test_buffer_updated_under_no_grad_is_written_by_a_tensor_parallel_program(layout):
    """The buffer is the program's own (as the same write outside no_grad is): it was refused as if
    it were a parameter, which tensor parallelism shards."""
    model, eager = _pair(EmaUnderNoGrad)
    x = torch.randn(6, 8)
    pm = dpcompile.transform(model, ["cpu"] * (4 if "mesh" in layout else 2), example_inputs=(x,), **layout)
    for step in range(2):
        torch.testing.assert_close(pm(x + step), eager(x + step))
    torch.testing.assert_close(pm.state_dict()["avg"], eager.avg)
    pm.eval(), eager.eval()
    torch.testing.assert_close(pm(x), eager(x))
    torch.testing.assert_close(pm.state_dict()["avg"], eager.avg)


def test_buffer_updated_under_no_grad_is_refused_by_the_export_frontend():
    """Export keeps the no_grad block as a call whose output nothing reads, and the program dropped
    it: the EMA stayed zero, in every layout. Refused by name; the model is left as found."""
    model, _ = _pair(EmaUnderNoGrad)
    with pytest.raises(dpcompile.DpCompileError, match=r"writes 'avg' in place inside torch.no_grad\(\)"):
        dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(torch.randn(6, 8),))
    assert model.training and not model.avg.any()


class NumpyMask(nn.Module):
    """wav2vec2's SpecAugment: in training, a mask drawn from numpy's global generator."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if self.training:
            import numpy as np

            h = h * torch.from_numpy(np.random.rand(x.size(1)) > 0.5).to(h.dtype)
        return h


def test_numpy_draw_is_refused_not_kept_as_a_constant():
    """Export ran numpy once and kept its draw as a constant (every call the same mask, wav2vec2's
    logits off by 0.5 from eager's): refused in training, naming the draw; in eval the other mode
    refuses at its first call instead of reusing the draw; numpy's state is left as found."""
    import numpy as np

    state = np.random.get_state()[1].copy()
    with pytest.raises(dpcompile.DpCompileError, match=r"draws numpy.random.rand.*mask_time_prob"):
        dpcompile.transform(NumpyMask(), ["cpu"] * 2, frontend="export", example_inputs=(torch.randn(4, 4),))
    assert (np.random.get_state()[1] == state).all()
    model, x = NumpyMask().eval(), torch.randn(4, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    torch.testing.assert_close(pm(x), model(x))
    pm.train()
    with pytest.raises(dpcompile.DpCompileError, match="eval mode"):
        pm(x)


class SharedScaleWrite(nn.Module):
    """One buffer registered on two Linears; forward writes it through one name by a Python number
    (``buf.mul_(1.5)``: a method call under fx) and reads it through the other."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8, dtype=torch.float64), nn.Linear(8, 4, dtype=torch.float64)
        scale = torch.linspace(0.5, 1, 8, dtype=torch.float64)
        self.fc1.register_buffer("scale", scale)
        self.fc2.register_buffer("scale", scale)

    def forward(self, x):
        self.fc1.scale.mul_(1.5)
        return self.fc2(self.fc1(x) * self.fc2.scale)


@pytest.mark.parametrize("tensor_parallel", [False, True])
def test_fx_shape_run_leaves_a_buffer_a_method_writes(tensor_parallel):
    """fx's shape run on the examples ran ``self.fc1.scale.mul_(1.5)`` for real (a real buffer times a
    number) and kept it: the buffer was advanced once by ``transform``, every output after it wrong.
    The buffer stays one tensor under both names, in ``pm`` and in the model."""
    torch.manual_seed(0)
    model, x = SharedScaleWrite(), torch.randn(4, 8, dtype=torch.float64)
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="fx", tensor_parallel=tensor_parallel, example_inputs=(x,))
    torch.testing.assert_close(model.fc1.scale, eager.fc1.scale, rtol=0, atol=0)
    assert pm.get_buffer("fc1.scale") is pm.get_buffer("fc2.scale") and model.fc1.scale is model.fc2.scale
    assert_steps_equal_eager(pm, eager, lambda step: (x + step,), lambda ps: torch.optim.AdamW(ps, lr=0.1))


class ClipsItsGradient(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.fc1(x)
        h.register_hook(lambda grad: grad.clamp(-0.01, 0.01))
        return self.fc2(h)


def test_a_gradient_hook_forward_registers_is_refused_by_the_export_frontend():
    """torch.export drops ``h.register_hook(...)`` made in forward: fc1's gradients were the unclipped ones
    (off by 1.9, silently; frontend='auto' lands there, as fx cannot trace the hook). Refused by name, and
    the model is left as it was."""
    model, x = ClipsItsGradient(), torch.randn(4, 8)
    before = snapshot(model)
    with pytest.raises(dpcompile.DpCompileError, match=r"registers a gradient hook on a tensor .*test_side_effects.py"):
        dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,))
    assert changed(before, snapshot(model)) == []


class CollectsFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
        self.features: list[torch.Tensor] = []

    def forward(self, x):
        h = self.fc1(x)
        self.features.append(h.detach())
        return self.fc2(h)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_list_forward_fills_is_named_in_a_warning(frontend):
    """``self.features.append(h)`` in forward: the program does not repeat it, and the list stayed empty
    after each call without a word. A warning names it at transform; the outputs are eager's."""
    model, x = CollectsFeatures(), torch.randn(4, 8)
    with pytest.warns(UserWarning, match="changes the list 'features'"):
        pm = dpcompile.transform(model, ["cpu"] * 2, frontend=frontend, example_inputs=(x,))
    assert model.features == []
    torch.testing.assert_close(pm(x), CollectsFeatures.forward(copy.deepcopy(model), x))


class FillsADict(CollectsFeatures):
    def __init__(self):
        super().__init__()
        self.cache: dict[str, torch.Tensor] = {}
        self.biases: dict[str, torch.Tensor] = {}

    def forward(self, x):
        h = self.fc1(x)
        self.cache["hidden"] = h.detach()
        if "bias" not in self.biases:  # of the weights alone: a cache, as timm's attention biases
            self.biases["bias"] = self.fc2.bias * 2
        return self.fc2(h) + self.biases["bias"]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_dict_forward_fills_from_its_inputs_is_named_in_a_warning(frontend):
    """``self.cache[k] = h`` in forward: the program does not repeat it, and the dict stayed empty without a word
    (a list was named). A warning names the dict filled from the inputs, not the one of the weights alone; the
    outputs are eager's."""
    torch.manual_seed(0)
    model, x = FillsADict().eval(), torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pm = dpcompile.transform(model, ["cpu"] * 2, frontend=frontend, example_inputs=(x,))
    named = [str(w.message) for w in seen if "forward changes the dict" in str(w.message)]
    assert len(named) == 1 and "'cache'" in named[0] and "'biases'" not in named[0], named
    assert model.cache == {}
    torch.testing.assert_close(pm(x), FillsADict.forward(copy.deepcopy(model), x))
