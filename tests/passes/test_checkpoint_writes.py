"""``passes.checkpoint_writes``: a checkpointed region whose nodes cannot write a tensor they did not make
runs its recompute without the runtime's undo (a dispatch mode over every op of the recompute); a region
that may write keeps it, and the model's state moves once a call, as in eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile.runtime import checkpoint
from passes.checkpoint_writes import may_write_outside


def _bump(buffer: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    buffer.add_(1.0)
    return h


fx.wrap("_bump")


class Pure(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return x + F.gelu(self.norm(self.fc(x)))


class Normed(Pure):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(8)


class Functional(Pure):
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("var", torch.ones(8))

    def forward(self, x):
        return x + F.batch_norm(self.fc(x), self.mean, self.var, training=True)


class Leaf(Pure):
    """A wrapped function (a call the tracer keeps whole) bumps a buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        return x + _bump(self.calls, self.fc(x))


class Stack(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.layers = nn.Sequential(block(), block())
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.layers(x)).pow(2).mean()


class Counted(nn.Module):
    """A parametrization counting its calls."""

    def __init__(self):
        super().__init__()
        self.calls = torch.zeros(())

    def forward(self, w):
        self.calls.add_(1.0)
        return w


class CountingLayer(nn.TransformerEncoderLayer):
    """A user layer inside torch.nn's TransformerEncoder (kept whole by the tracer)."""

    def __init__(self):
        super().__init__(8, 2, 16, dropout=0.0, batch_first=True)
        self.steps = nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, x, *args, **kwargs):
        with torch.no_grad():
            self.steps.add_(1)
        return super().forward(x, *args, **kwargs)


def _count_call(module, args):
    module.count.add_(1.0)


def _traced(fn) -> fx.Graph:
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.renorm = nn.Embedding(10, 8), nn.Embedding(10, 8, max_norm=1.0)
            self.relu, self.lstm = nn.ReLU(inplace=True), nn.LSTM(8, 8)
            self.hooked, self.parametrized = nn.Linear(8, 8), nn.Linear(8, 8)
            self.hooked.count = torch.zeros(())
            self.hooked.register_forward_pre_hook(_count_call)
            torch.nn.utils.parametrize.register_parametrization(self.parametrized, "weight", Counted())
            self.encoder = nn.TransformerEncoder(CountingLayer(), 1, enable_nested_tensor=False)

        def forward(self, x, ids):
            return fn(self, x, ids)

    return fx.symbolic_trace(Wrapper()).graph


@pytest.mark.parametrize("fn, writes", [
    (lambda m, x, ids: torch.tanh(x @ x.t()).softmax(-1) + m.emb(ids).sum(), False),
    (lambda m, x, ids: x.add_(1.0), True),
    (lambda m, x, ids: torch.add(x, 1.0, out=x), True),
    (lambda m, x, ids: m.relu(x), True),
    (lambda m, x, ids: F.relu(x, inplace=True), True),
    (lambda m, x, ids: m.renorm(ids), True),
    (lambda m, x, ids: F.embedding(ids, x, max_norm=1.0), True),
    (lambda m, x, ids: F.batch_norm(x, x[0], x[1], training=True), True),
    (lambda m, x, ids: m.lstm(x)[0], True),
    (lambda m, x, ids: _bump(x, x), True),
    (lambda m, x, ids: m.hooked(x), True),
    (lambda m, x, ids: m.parametrized(x), True),
    (lambda m, x, ids: m.encoder(x[None]), True),
    (lambda m, x, ids: torch._foreach_add_([x], 1.0), True),
    (lambda m, x, ids: F.embedding(ids, x, None, 1.0), True),
    (lambda m, x, ids: torch.ops.aten.instance_norm(x[None], None, None, x[0], x[1], True, 0.1, 1e-5, False), True),
], ids=["pure", "add_", "out=", "ReLU(inplace)", "relu(inplace=True)", "Embedding(max_norm)",
        "embedding(max_norm=)", "batch_norm", "LSTM", "wrapped function", "pre-hook", "parametrization",
        "user layer inside", "_foreach_add_", "embedding(max_norm positional)", "aten instance_norm"])  # fmt: skip
def test_only_nodes_known_not_to_write_run_without_the_undo(fn, writes):
    assert may_write_outside(_traced(fn).nodes) is writes


def test_an_aten_region_writes_where_its_schema_or_a_batch_norm_kernel_does():
    def graph_of(fn, *args):
        return torch.fx.experimental.proxy_tensor.make_fx(fn)(*args).graph.nodes

    x, stats = torch.randn(4, 3), torch.zeros(3)
    assert not may_write_outside(graph_of(lambda x: torch.relu(x @ x.t()), x))
    assert may_write_outside(graph_of(lambda x, s: s.mul_(0.9), x, stats))
    assert may_write_outside(graph_of(lambda x, m, v: torch.native_batch_norm(x, None, None, m, v, True, 0.1, 1e-5)[0],
                                      x, stats, torch.ones(3)))  # fmt: skip


def test_transformers_conv1d_is_known_not_to_write():
    transformers = pytest.importorskip("transformers")

    class Uses(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = transformers.pytorch_utils.Conv1D(24, 8)

        def forward(self, x):
            return self.c_attn(x)

    class Keeps(fx.Tracer):
        def is_leaf_module(self, m, qualified_name):
            return type(m).__name__ == "Conv1D" or super().is_leaf_module(m, qualified_name)

    module = Uses()
    graph = Keeps().trace(module)
    fx.GraphModule(module, graph)  # owning module: the call's target resolves
    assert not may_write_outside(graph.nodes)


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("block, undone", [(Pure, False), (Normed, True), (Functional, True), (Leaf, True)])
def test_checkpointed_blocks_keep_the_undo_where_they_may_write_and_match_eager(block, undone, frontend):
    if frontend == "export" and block is Leaf:
        pytest.skip("export traces through the wrapped function")
    torch.manual_seed(0)
    model = Stack(block).double()
    eager = copy.deepcopy(model)
    x = torch.randn(6, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, activation_checkpointing=True, frontend=frontend, example_inputs=(x,))
    calls = pm.code.count("dpcompile_runtime_checkpoint(")
    assert calls > 0
    if not undone:
        assert pm.code.count("undo_writes = False") == calls, pm.code
    elif frontend == "fx":  # the writer's region keeps it (export may compute statistics functionally, written after)
        assert pm.code.count("undo_writes = False") < calls, pm.code
    for _ in range(2):
        pm(x).backward()
        eager(x).backward()
        torch.testing.assert_close(pm.state_dict(), eager.state_dict())
        for (name, p), q in zip(pm.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
        x = torch.randn(6, 8, dtype=torch.float64)


class Hooked(Pure):
    """A pre-hook on a torch.nn Linear counts its calls (the tracer keeps the Linear whole)."""

    def __init__(self):
        super().__init__()
        self.fc.count = torch.zeros(())
        self.fc.register_forward_pre_hook(_count_call)


def test_a_hooked_module_keeps_the_undo_and_its_hook_counts_once_a_call():
    torch.manual_seed(0)
    model = Stack(Hooked).double()
    eager = copy.deepcopy(model)
    x = torch.randn(6, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"], activation_checkpointing=True, example_inputs=(x,))
    assert "undo_writes = False" not in pm.code, pm.code
    before = [float(b.fc.count) for b in model.layers]  # (transform's own run on the example may count)
    for _ in range(2):
        pm(x).backward()
        eager(x).backward()
    assert [float(b.fc.count) - c for b, c in zip(model.layers, before)] == [float(b.fc.count) for b in eager.layers]
    assert [float(b.fc.count) for b in eager.layers] == [2.0, 2.0]


@pytest.mark.parametrize("saving", [False, True])
def test_without_the_undo_a_region_recomputes_to_the_same_gradients(saving):
    torch.manual_seed(0)
    block = Pure().double()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    block(x).pow(2).sum().backward()
    expected = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
    x.grad = None
    block.zero_grad(set_to_none=True)
    checkpoint(block, x, saving=saving, undo_writes=False).pow(2).sum().backward()
    for got, want in zip([x.grad] + [p.grad for p in block.parameters()], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
