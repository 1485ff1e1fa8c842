"""explain and measure leave the program and the model as they were: on every layout of a model with
an embedding tied to its head, each parameter and buffer slot holds the same object with the same
value, each parameter the same grad, each module the same hooks; also where explain raises."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile.runtime.kept import functional_call


class TiedLM(nn.Module):
    """An embedding tied to its LM head, two blocks between (one a stage under pipeline=2); its
    forward returns the mean loss (what schedule='1f1b' runs backward from)."""

    def __init__(self, vocab: int = 16, d: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(nn.Linear(d, d), nn.Linear(d, d))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids, labels):
        logits = self.head(self.norm(torch.tanh(self.blocks(self.embed(ids)))))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


LAYOUTS = {
    "dp": {},
    "fsdp": {"data_parallel": "fsdp"},
    "tp": {"tensor_parallel": {"embed": "vocab", "head": "column"}},
    "pp2_gpipe": {"pipeline": 2, "micro_batches": 2},
    "pp2_1f1b": {"pipeline": 2, "micro_batches": 2, "schedule": "1f1b"},
    "dp_tp": {"mesh": {"dp": 2, "tp": 2}},
    "dp_fsdp_tp": {"mesh": {"dp": 2, "tp": 2}, "data_parallel": "fsdp"},
}


def state_of(*roots: nn.Module) -> dict:
    """Every tensor slot under ``roots`` (shared modules under each of their names): its object,
    value and grad; every module's hooks."""
    out = {}
    for r, root in enumerate(roots):
        for path, m in root.named_modules(remove_duplicate=False):
            for kind in ("_parameters", "_buffers"):
                for name, t in getattr(m, kind).items():
                    value = None if t is None else t.detach().clone()
                    out[(r, path, kind, name)] = (t, value, getattr(t, "grad", None))
            for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks"):
                out[(r, path, kind)] = dict(getattr(m, kind))
    return out


def assert_same_state(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key, was in before.items():
        now = after[key]
        if isinstance(was, dict):
            assert now == was, key
            continue
        assert now[0] is was[0], f"{key}: {type(was[0]).__name__} replaced by {type(now[0]).__name__}"
        assert now[2] is was[2], f"{key}: grad replaced"
        if was[1] is not None:
            assert type(now[0]) is type(was[0]) and torch.equal(now[0].detach(), was[1]), key


def _transformed(layout: str) -> tuple[nn.Module, nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model, ids = TiedLM(), torch.randint(0, 16, (4, 5))
    n = 4 if "mesh" in LAYOUTS[layout] else 2
    pm = dpcompile.transform(model, ["cpu"] * n, example_inputs=(ids, ids), **LAYOUTS[layout])
    pm(ids, ids).backward()  # grads to keep
    return pm, model, (ids, ids)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_explain_and_measure_leave_program_and_model_as_they_were(layout):
    pm, model, inputs = _transformed(layout)
    before = state_of(pm, model)
    dpcompile.explain(pm, *inputs)
    assert_same_state(before, state_of(pm, model))
    dpcompile.measure(pm, *inputs)
    assert_same_state(before, state_of(pm, model))
    torch.testing.assert_close(pm(*inputs), model(*inputs))


def test_explain_that_raises_midway_leaves_the_program_as_it_was(monkeypatch):
    """A failure after the fake runs (here: the memory figures, made when the report's memory_estimate
    is first read) changes nothing either."""
    pm, model, inputs = _transformed("fsdp")
    before = state_of(pm, model)

    def fails(*args, **kwargs):
        raise RuntimeError("midway")

    monkeypatch.setattr("dpcompile.inspect.explanation.program_memory", fails)
    monkeypatch.setattr("dpcompile.inspect.explanation.planner_memory", fails)  # one-process FSDP's prediction
    with pytest.raises(RuntimeError, match="midway"):
        dpcompile.explain(pm, *inputs).memory_estimate  # noqa: B018 - reading it makes it
    assert_same_state(before, state_of(pm, model))


class SharedBlock(nn.Module):
    """One Linear reached under two names: torch.func.functional_call swaps it twice."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = self.a

    def forward(self, x):
        if x.shape[0] > 2:
            raise ValueError("too many rows")
        return self.b(self.a(x))


@pytest.mark.parametrize("rows", [2, 3], ids=["returns", "raises"])
def test_functional_call_leaves_a_module_reached_twice_as_it_was(rows):
    module = SharedBlock()
    weight, bias = module.a.weight, module.a.bias
    state = {name: torch.zeros_like(p) for name, p in module.named_parameters()}
    try:
        out = functional_call(module, state, (torch.ones(rows, 4),))
        torch.testing.assert_close(out, torch.zeros(rows, 4))  # ran on the given state
    except ValueError:
        assert rows == 3
    assert module.a._parameters["weight"] is weight and module.a._parameters["bias"] is bias


class ReadsItsParameters(TiedLM):
    def own_names(self):  # as transformers' PreTrainedModel does: the guard watches lm_head._parameters
        return list(self._parameters)


def test_explain_of_an_exported_fsdp_program_leaves_it_callable():
    """FSDP in one process swaps the head's weight for pieces after transform read the model; explain
    then must not be taken for a change of the model (it was: ModelChanged at the next call)."""
    torch.manual_seed(0)
    model, ids = ReadsItsParameters(), torch.randint(0, 16, (4, 5))
    expected = model(ids, ids)
    pm = dpcompile.transform(model, ["cpu"] * 2, data_parallel="fsdp", frontend="export", example_inputs=(ids, ids))
    dpcompile.explain(pm, ids, ids)
    torch.testing.assert_close(pm(ids, ids), expected)


class BlockTwice(TiedLM):
    """The first block also reached as ``again``, and called a second time under that name."""

    def __init__(self):
        super().__init__()
        self.again = self.blocks[0]

    def forward(self, ids, labels):
        logits = self.head(self.norm(torch.tanh(self.again(self.blocks(self.embed(ids))))))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_planner_fake_runs_leave_the_model_as_it_was():
    """memory_per_device= runs the model on fake tensors to count its activations: the user's model,
    a block of it under two names, keeps its own tensors (it was left with fake ones)."""
    torch.manual_seed(0)
    model, ids = BlockTwice(), torch.randint(0, 16, (4, 5))
    expected, before = model(ids, ids), state_of(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(ids, ids), memory_per_device="1GiB", optimizer="adamw")
    assert_same_state(before, state_of(model))
    torch.testing.assert_close(pm(ids, ids), expected)


def test_verify_on_fake_devices_leaves_program_and_model_as_they_were():
    pm, model, inputs = _transformed("fsdp")
    torch.manual_seed(0)
    reference = TiedLM()  # the weights _transformed's model started from
    before = state_of(pm, model)
    result = dpcompile.verify(pm, reference, *inputs, fake_devices=2)
    assert result, str(result)
    assert_same_state(before, state_of(pm, model))
