"""One ProgramCache for every module kind: a call that departs from the traced one runs a
program traced for it — the mode, an optional argument left None, a flag value — alike in
data parallel and tensor parallel (the mesh runs the same checks in tests/test_spmd.py)."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.program_cache import CallKey, ProgramCache
from tests.helpers import check_against_eager
from tests.models import MLP, Departures

KINDS = {
    "data_parallel": {},
    "tensor_parallel": {"tensor_parallel": {"fc1": "column", "fc2": "row"}},
}


def _pair(kind: str, make: type[nn.Module] = Departures) -> tuple[nn.Module, dpcompile.ParallelModule]:
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, **KINDS[kind])
    return reference, pm


@pytest.mark.parametrize("kind", KINDS)
def test_program_cache_eval_turns_functional_dropout_off(kind):
    """pm.eval() runs a program traced in eval mode: F.dropout(x, p, self.training) is off, outputs equal eager."""
    reference, pm = _pair(kind)
    x = torch.randn(6, 8)
    assert not torch.allclose(pm(x), reference.eval()(x))  # traced in training mode: dropout on
    pm.eval()
    torch.testing.assert_close(pm(x), reference(x), atol=1e-5, rtol=1e-5)
    assert "training = False" in pm.program_for_call(x).code
    pm.train()
    assert "training = True" in pm.program_for_call(x).code


@pytest.mark.parametrize("kind", KINDS)
def test_program_cache_optional_argument_given_and_left_none(kind):
    """pm(x) and pm(x, scale=s) both equal eager (eval mode, so values are deterministic)."""
    reference, pm = _pair(kind)
    reference.eval(), pm.eval()
    x, scale = torch.randn(6, 8), torch.tensor(3.0)
    torch.testing.assert_close(pm(x, scale), reference(x, scale), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pm(x), reference(x), atol=1e-5, rtol=1e-5)
    assert pm.call_key(x).none_args == frozenset({"scale"})


@pytest.mark.parametrize("kind", KINDS)
def test_program_cache_flag_argument_values(kind):
    """A flag forward branches on (double=False traced) serves double=True with its own program."""
    reference, pm = _pair(kind)
    reference.eval(), pm.eval()
    x = torch.randn(6, 8)
    torch.testing.assert_close(pm(x, double=True), reference(x, double=True), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pm(x, None, False), reference(x, None, False), atol=1e-5, rtol=1e-5)
    assert dict(pm.call_key(x, double=True).flags) == {"double": True}


@pytest.mark.parametrize("kind", KINDS)
def test_program_cache_builds_each_program_once(kind):
    """Calls with the same departures reuse one program; the main program serves the traced call."""
    _, pm = _pair(kind)
    x = torch.randn(6, 8)
    assert pm.program_for_call(x) is pm  # traced as the defaults give it: scale None, double False
    first = pm.program_for_call(x, None, True)
    assert first is not pm and pm.program_for_call(x, None, True) is first
    assert len(pm.program_cache) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_program_cache_unpickled_copy_serves_eval_without_the_class(kind):
    """A copy whose model class cannot be imported carries the programs met so far and the other
    mode's: after unpickling, pm.eval() and an argument left None still run the right program."""

    class Local(Departures):  # pickle cannot import a class defined here
        pass

    reference, pm = _pair(kind, Local)
    x, scale = torch.randn(6, 8), torch.tensor(3.0)
    pm(x)  # training mode, scale left None: a program in the cache
    restored = pickle.loads(pickle.dumps(pm))
    assert restored.traced_model is None
    restored.eval(), reference.eval()
    torch.testing.assert_close(restored(x, scale), reference(x, scale), atol=1e-5, rtol=1e-5)
    twice = pickle.loads(pickle.dumps(restored))  # what was carried is carried on
    torch.testing.assert_close(twice(x, scale), reference(x, scale), atol=1e-5, rtol=1e-5)


def test_program_cache_refuses_a_call_it_has_no_program_for():
    """Without the model's class, a call no carried program serves raises and says why, never runs wrong."""

    class Local(Departures):
        pass

    _, pm = _pair("data_parallel", Local)
    restored = pickle.loads(pickle.dumps(pm))
    with pytest.raises(dpcompile.DpCompileError, match="double=True"):
        restored(torch.randn(6, 8), torch.tensor(2.0), True)


def test_program_cache_small_batch_keys_fewer_devices():
    """A batch of 2 on 4 devices runs the program for 2 devices, and the full batch the main one."""
    pm = dpcompile.transform(MLP(), ["cpu"] * 4)
    assert pm.call_key(torch.randn(2, 8)).devices == 2
    assert pm.program_for_call(torch.randn(8, 8)) is pm


def test_program_cache_warns_past_its_limit():
    """More programs than the limit warn once (as torch.compile's recompile limit) and drop the oldest."""
    built = []
    cache = ProgramCache(CallKey(2, ()), lambda key, args, kwargs: built.append(key) or nn.Identity(), limit=2)
    keys = [CallKey(2, (), flags=(("step", k),)) for k in range(4)]
    with pytest.warns(UserWarning, match="more than 2 programs"):
        for key in keys:
            cache.program(key, (), {})
    assert len(cache) == 2 and cache.program(keys[-1], (), {}) is not None and len(built) == 4


class OptionalInputs(nn.Module):
    """The Hugging Face shape: optional mask and labels that default to None."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, labels=None, mask=None):
        logits = self.fc(x)
        if mask is not None:
            logits = logits * mask
        if labels is not None:
            return {"logits": logits, "loss": torch.nn.functional.cross_entropy(logits, labels)}
        return {"logits": logits}


@pytest.mark.parametrize(
    "call",
    [
        {},
        {"labels": True},
        {"mask": True},
        {"labels": True, "mask": None},
    ],
    ids=["neither", "labels", "mask", "labels-mask-none"],
)
@pytest.mark.parametrize("batch", [7, 2])
def test_parallel_module_optional_arguments_left_none_take_eagers_branch(call, batch):
    """Calls that leave optional arguments None take forward's None branch, as eager does."""
    kwargs = {}
    if call.get("labels"):
        kwargs["labels"] = torch.randint(0, 4, (batch,))
    if "mask" in call:
        kwargs["mask"] = torch.ones(batch, 4) if call["mask"] else None
    check_against_eager(OptionalInputs, ["cpu"] * 3, torch.randn(batch, 8), **kwargs)


class ReturnsHidden(nn.Module):
    """Branches on a Python flag argument, which fx alone traces as a value it cannot branch on."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x, return_hidden: bool = False):
        h = torch.relu(self.fc(x))
        if return_hidden:
            return self.head(h), h
        return self.head(h)


@pytest.mark.parametrize("call", [(), (False,), (True,)], ids=["default", "false", "true"])
def test_transform_traces_flag_arguments_as_their_values(call):
    """A model branching on a bool argument transforms and follows the flag of each call, as eager."""
    check_against_eager(ReturnsHidden, ["cpu"] * 3, torch.randn(7, 4), *call)
    check_against_eager(ReturnsHidden, ["cpu"] * 3, torch.randn(7, 4), return_hidden=bool(call and call[0]))


_SAVE_IN_MAIN = r"""
import sys, torch, torch.nn as nn, torch.nn.functional as F
import dpcompile

class Net(nn.Module):  # defined in __main__: the loading process cannot import it
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 16), nn.Linear(16, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, scale=None):
        h = self.drop(torch.relu(self.fc1(x)))
        h = F.dropout(h, 0.3, self.training)
        y = self.fc2(h)
        return y if scale is None else y * scale

torch.manual_seed(0)
model = Net()
pm = dpcompile.transform(model, ["cpu", "cpu"])
x, scale = torch.randn(6, 4), torch.full((6, 3), 2.0)
pm(x, scale).sum().backward()  # the program met so far: training, scale given
model.eval()
torch.save({"pm": pm, "x": x, "scale": scale, "eval": model(x), "eval_scaled": model(x, scale)}, sys.argv[1])
"""

_LOAD_ELSEWHERE = r"""
import sys, torch
import dpcompile
assert "torch._dynamo" not in sys.modules, "import dpcompile imported torch._dynamo (1-2 s of every process's start)"
saved = torch.load(sys.argv[1], weights_only=False)
pm, x, scale = saved["pm"], saved["x"], saved["scale"]
assert "Net" not in dir(__import__("__main__"))
pm.eval()
torch.testing.assert_close(pm(x), saved["eval"])                 # dropout off, scale left None
torch.testing.assert_close(pm(x), pm(x))
torch.testing.assert_close(pm(x, scale), saved["eval_scaled"])
pm.train()
a, b = pm(x), pm(x)
assert not torch.equal(a, b), "training mode: dropout is on again"
print("LOADED OK")
"""


def test_program_cache_main_class_program_honours_eval_and_none_after_load(tmp_path):
    """A program whose model class lives in __main__, torch.save'd in one process and loaded in
    another: pm.eval() turns dropout off (module and F.dropout(self.training)), an optional
    argument left None runs its own program, training turns dropout back on; ``import dpcompile``
    there does not import torch._dynamo (torch.compile's lookup imports it when first called)."""
    import os
    import subprocess
    import sys

    path = tmp_path / "pm.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))}
    for script in (_SAVE_IN_MAIN, _LOAD_ELSEWHERE):
        done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, env=env, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
    assert "LOADED OK" in done.stdout
