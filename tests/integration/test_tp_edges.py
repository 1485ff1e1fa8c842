"""Tensor parallelism at its edges, on both frontends, on real and on meta models: parameters
forward never reads (an unused head, the second name of a tied bias) keep their keys and their
tie; a tensor constant made in forward (a scale table) is real on a meta model; an embedding
whose weight a later matmul reads (a tied head written out) runs. Each against eager: outputs,
gradients, ``state_dict`` keys and values, and ``load_checkpoint`` of the model's own checkpoint."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_model
from torch import nn

import dpcompile
from tests.helpers import assert_steps_equal_eager, full_gradients


class UnusedAndTied(nn.Module):
    """An unused head, and a bias tied to a layer forward never calls."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.head = nn.Linear(8, 4)  # never called
        self.out, self.spare = nn.Linear(8, 8), nn.Linear(8, 8)
        self.spare.bias = self.out.bias  # the second name of a tied bias (spare is never called)

    def forward(self, x):
        return self.out(self.fc2(F.relu(self.fc1(x))))


class ScaleTable(nn.Module):
    """A tensor made in forward from Python data."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        scale = torch.tensor([0.5, 2.0, 3.0])
        return self.fc2(F.relu(self.fc1(x))) * scale[1] + scale[2]


class WrittenOutHead(nn.Module):
    """An LM head tied to the embedding, written as a matmul on its weight."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(16, 8)
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return h @ self.emb.weight.T if self.how == "matmul" else F.linear(h, self.emb.weight)


MODELS = {
    "unused_and_tied": (UnusedAndTied, lambda: torch.randn(3, 8)),
    "scale_table": (ScaleTable, lambda: torch.randn(3, 8)),
    "head_matmul": (lambda: WrittenOutHead("matmul"), lambda: torch.randint(0, 16, (2, 5))),
    "head_linear": (lambda: WrittenOutHead("linear"), lambda: torch.randint(0, 16, (2, 5))),
}


def _transformed(name: str, frontend: str, meta: bool, tmp_path):
    """(pm, eager twin, input); a meta model is loaded from the eager model's own checkpoint."""
    make, example = MODELS[name]
    torch.manual_seed(0)
    eager, x = make(), example()
    if meta:
        with torch.device("meta"):
            model = make()
    else:
        model = copy.deepcopy(eager)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,), frontend=frontend)
    if meta:
        save_model(eager, str(tmp_path / "model.safetensors"))  # tied keys written once, as transformers does
        dpcompile.load_checkpoint(pm, tmp_path)
    return pm, eager, x


def _assert_state_equal(pm, eager) -> None:
    got, want = pm.state_dict(), eager.state_dict()
    assert list(got) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("meta", [False, True], ids=["real", "meta"])
@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("name", list(MODELS))
def test_tp_edge_model_matches_eager(name, frontend, meta, tmp_path):
    """Outputs, gradients, state_dict keys and values equal eager's, before and after one SGD step."""
    pm, eager, x = _transformed(name, frontend, meta, tmp_path)
    _assert_state_equal(pm, eager)
    out, want = pm(x), eager(x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    weights = torch.linspace(0.5, 1.5, want.numel()).view(want.shape)
    (out * weights).sum().backward()
    (want * weights).sum().backward()
    grads = full_gradients(pm)
    for key, p in eager.named_parameters():
        torch.testing.assert_close(grads[key], p.grad, atol=1e-5, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    for optimizer in (torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)):
        optimizer.step()
    _assert_state_equal(pm, eager)  # ties stayed ties: the second name moved with the first


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_unused_and_tied_parameters_round_trip_a_checkpoint(frontend, tmp_path):
    """load_checkpoint takes the program's own save (and the model's, tied keys written once); the tie holds one parameter."""
    pm, eager, x = _transformed("unused_and_tied", frontend, False, tmp_path)
    with torch.no_grad():
        for p in eager.parameters():
            p.add_(1.0)
    save_model(eager, str(tmp_path / "model.safetensors"))
    dpcompile.load_checkpoint(pm, tmp_path)
    _assert_state_equal(pm, eager)
    dpcompile.save_checkpoint(pm, tmp_path / "again")
    dpcompile.load_checkpoint(pm, tmp_path / "again")
    _assert_state_equal(pm, eager)
    shards = pm.param_shards
    assert shards["spare.bias"][1] == shards["out.bias"][1]  # one set of shards under both keys
    names = {n for n, _ in pm.named_parameters()}
    assert "spare.bias" not in names and "head.weight" in names  # no stale copy of the tied bias


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("how", ["matmul", "linear"])
def test_embedding_read_by_a_later_matmul_stays_whole_and_tied(how, frontend, tmp_path):
    """The embedding whose weight a written-out head reads stays whole (one parameter), with the reason."""
    pm, _, _ = _transformed(f"head_{how}", frontend, False, tmp_path)
    assert pm.plan["emb"] == "replicate" and "read directly" in pm.plan_reasons["emb"]
    assert [n for n, _ in pm.named_parameters() if n.startswith("emb.")] == ["emb.weight"]
    assert pm.plan["fc1"] == "column" and pm.plan["fc2"] == "row"  # the rest is still sharded


class MadeInForward(nn.Module):
    """Constants of constant sizes made in forward: fx records their values."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 16), nn.Linear(16, 4)

    def forward(self, x):
        positions = torch.arange(4, dtype=x.dtype) + torch.ones(4)
        return self.fc2(F.relu(self.fc1(x * positions))) * torch.full((4,), 0.5)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_meta_model_constants_made_in_forward_are_real(frontend, tmp_path):
    """arange / ones / full of constant sizes in forward: a meta model's program holds their values."""
    torch.manual_seed(0)
    eager, x = MadeInForward(), torch.randn(3, 4)
    with torch.device("meta"):
        model = MadeInForward()
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,), frontend=frontend)
    save_model(eager, str(tmp_path / "model.safetensors"))
    dpcompile.load_checkpoint(pm, tmp_path)
    torch.testing.assert_close(pm(x), eager(x), atol=1e-5, rtol=1e-5)


class SharedBias(nn.Module):
    """Two called layers share one bias."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(8, 16)
        self.b.bias = self.a.bias
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        return self.out(F.relu(self.a(x)) + self.b(x))


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_bias_shared_by_two_called_layers_is_one_set_of_shards(frontend):
    """Both layers split alike and share the bias's shards; two SGD steps and the state dict equal eager's."""
    torch.manual_seed(0)
    eager, x = SharedBias(), torch.randn(3, 8)
    pm = dpcompile.transform(copy.deepcopy(eager), ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,), frontend=frontend)
    assert pm.plan["a"] == pm.plan["b"] == "column"
    assert pm.param_shards["a.bias"][1] == pm.param_shards["b.bias"][1] or pm.get_parameter(
        pm.param_shards["a.bias"][1][0]) is pm.get_parameter(pm.param_shards["b.bias"][1][0])  # fmt: skip
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(2):
        for module, optimizer in ((pm, opt), (eager, ref_opt)):
            optimizer.zero_grad()
            module(x).pow(2).mean().backward()
            optimizer.step()
    torch.testing.assert_close(pm(x), eager(x), atol=1e-5, rtol=1e-5)
    _assert_state_equal(pm, eager)


def test_bias_shared_by_layers_split_differently_keeps_them_whole():
    """A plan splitting two layers of one bias differently keeps both whole (the tie holds), with the reason."""
    torch.manual_seed(0)
    eager, x = SharedBias(), torch.randn(3, 8)
    plan = {"a": "column", "b": "row", "out": "row"}
    pm = dpcompile.transform(copy.deepcopy(eager), ["cpu"] * 2, tensor_parallel=plan, example_inputs=(x,))
    assert pm.plan["a"] == pm.plan["b"] == "replicate" and "bias is shared" in pm.plan_reasons["b"]
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    for module, optimizer in ((pm, opt), (eager, ref_opt)):
        module(x).pow(2).mean().backward()
        optimizer.step()
    torch.testing.assert_close(pm(x), eager(x), atol=1e-5, rtol=1e-5)
    _assert_state_equal(pm, eager)


class Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_layer_with_a_forward_hook_stays_whole_and_its_hook_sees_the_whole_output():
    """A forward hook on a layer sees the layer's whole output, as in eager (a sharded layer ran no
    hook: it was silently dropped); the layer stays whole, with the reason, and the rest is sharded."""
    torch.manual_seed(0)
    model, x = Hooked(), torch.randn(6, 8)
    eager = copy.deepcopy(model)
    seen, seen_eager = {}, {}
    model.b.register_forward_hook(lambda m, i, out: seen.__setitem__("b", out))
    eager.b.register_forward_hook(lambda m, i, out: seen_eager.__setitem__("b", out))
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,), frontend="fx")
    assert pm.plan["b"] == "replicate" and "forward hook" in pm.plan_reasons["b"] and pm.plan["a"] != "replicate"
    torch.testing.assert_close(pm(x), eager(x))
    torch.testing.assert_close(seen["b"], seen_eager["b"])


class ConstantsOnAnOptionalPath(nn.Module):
    """Tensors made in forward on the path an optional mask opens, before one made on every path."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x, mask=None):
        h = self.fc2(torch.relu(self.fc1(x)))
        if mask is not None:
            h = h + torch.tensor(0.5) * mask + torch.tensor([1.0, 2.0, 3.0])
        return h * torch.tensor(2.0)


def test_a_call_whose_trace_numbers_tensor_constants_anew_reads_its_own_values():
    """The call with a mask traces its own program, where the mask's constants come first: the
    program reads its own ``_tensor_constant0``..2 (the mask path's 0.5 and table, then 2.0), not the
    first program's ``_tensor_constant0`` (2.0) under the same name (it failed: no such attribute)."""
    torch.manual_seed(0)
    model = ConstantsOnAnOptionalPath()
    x, mask = torch.randn(6, 8), torch.ones(6, 3)
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    torch.testing.assert_close(pm(x, mask), model(x, mask))
    torch.testing.assert_close(pm(x), model(x))
    pm(x, mask).sum().backward()
    model(x, mask).sum().backward()
    for name, grad in full_gradients(pm).items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, msg=name)


def _shift_in(module, args):
    return (args[0] + 0.25,)


def _scale_out(module, args, output):
    return output * 1.5


class RootHooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_forward_pre_hook(_shift_in)
        self.register_forward_hook(_scale_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("layout", [{"tensor_parallel": True}, {"mesh": {"dp": 2, "tp": 2}}], ids=["tp", "dp_tp"])
def test_the_models_own_forward_hooks_run_around_a_tensor_parallel_program(layout):
    """Hooks on the model itself are not traced (tracing calls forward): a tensor-parallel program,
    which traced a private copy, silently skipped them; it now runs them as the model's call does."""
    model = RootHooked()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu"] * (4 if "mesh" in layout else 2), example_inputs=(x,), **layout)
    got, want = pm(x), eager(x)
    torch.testing.assert_close(got, want)
    got.square().sum().backward()
    want.square().sum().backward()
    grads = full_gradients(pm)
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda m, name=name: f"{name}: {m}")
    pm.eval(), eager.eval()
    torch.testing.assert_close(pm(x), eager(x))
    model.register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(dpcompile.DpCompileError, match="backward hook on itself"):
        dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))


class TimeMajorAttention(nn.Module):
    """``nn.MultiheadAttention(batch_first=False)``: (seq, batch, embed) in and out; an optional mask."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)
        self.out = nn.Linear(8, 4)

    def forward(self, x, mask=None):
        return self.out(self.attn(x, x, x, need_weights=False, key_padding_mask=mask)[0])


def test_time_major_attention_transformed_without_examples_runs_eval():
    """Without examples the time-major attention's in-projection is split as one column layer; the program
    for the eval call (mask left None), lowered on the call's shapes, split it by heads: refused ("takes another
    path ... shard differently"). It is lowered without shapes, as transform did: eval equals eager."""
    torch.manual_seed(0)
    model = TimeMajorAttention().double()
    eager = copy.deepcopy(model)
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True)
    assert pm.plan["attn"] == "column"
    assert_steps_equal_eager(pm, eager, lambda step: (x + step,), lambda ps: torch.optim.AdamW(ps, lr=0.1))
    pm.eval()
    eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(x), eager(x))


class ScaledLayers(nn.Module):
    """A buffer registered on two Linears (one tensor, two names), read beside each layer's call."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
        scale = torch.linspace(0, 1, 8)
        self.fc1.register_buffer("scale", scale)
        self.fc2.register_buffer("scale", scale)

    def forward(self, x):
        return self.fc2(self.fc1(x) * self.fc1.scale) + self.fc2.scale[:4]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_buffer_registered_on_sharded_linears_stays(frontend):
    """A sharded Linear's replacement held its parameters and children, not its buffers: the program's
    read of ``fc1.scale`` named nothing (PassError in expand_shards). They are kept, under their keys."""
    torch.manual_seed(0)
    model = ScaledLayers().double()
    eager = copy.deepcopy(model)
    x = torch.randn(6, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, frontend=frontend, example_inputs=(x,))
    assert pm.plan == {"fc1": "column", "fc2": "row"}
    assert_steps_equal_eager(pm, eager, lambda step: (x + step,), lambda ps: torch.optim.AdamW(ps, lr=0.1))
    assert list(pm.state_dict()) == list(eager.state_dict())
