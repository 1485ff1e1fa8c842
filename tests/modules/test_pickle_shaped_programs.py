"""``torch.save(pm)`` of a program built with ``example_inputs=`` (or by the export frontend, which
always propagates shapes): its graphs hold fake tensors in ``node.meta["val"]``, which pickle
cannot write. The copy drops them and propagates the example shapes again where it is loaded, so
a call that lowers the captured program anew (another batch, the mask given the batch) still
reads them."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import dpcompile
from tests.helpers import assert_weighted_gradients_equal
from tests.integration.test_replicated_inputs import L, MaskedScores
from tests.thirdparty import import_or_skip


def _round_trip(pm: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("devices", [2, 3])
def test_torch_save_of_a_program_built_with_example_inputs(devices):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * devices, example_inputs=(torch.randn(6, 4),))
    restored = _round_trip(pm)
    for batch in (6, 5, 2):  # the example's batch, uneven, fewer rows than devices
        x = torch.randn(batch, 4)
        out, expected = restored(x), eager(x)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(restored.state_dict(), eager.state_dict())  # running stats too
    restored.eval(), eager.eval()
    x = torch.randn(4, 4)
    torch.testing.assert_close(restored(x), eager(x))


def test_an_unimportable_model_carries_the_replicated_input_guard_and_lowers_its_variant():
    """A class pickle cannot import: the copy carries its programs; the mask given the batch is a
    program lowered again from the captured one, which reads the propagated shapes."""

    class Local(MaskedScores):
        pass

    torch.manual_seed(0)
    model = Local()
    eager = copy.deepcopy(model)
    x = torch.randn(4, L, 8)
    pm = dpcompile.transform(model, ["cpu", "cpu"], example_inputs=(x, torch.randn(1, 1, L, L)))
    restored = pickle.loads(pickle.dumps(pm))
    assert restored.traced_model is None  # nothing to trace with: the carried programs serve
    shared, per_sample = torch.randn(1, 1, L, L), torch.randn(4, 1, L, L)
    torch.testing.assert_close(restored(x, shared), eager(x, shared))
    out, expected = restored(x, per_sample), eager(x, per_sample)
    torch.testing.assert_close(out, expected)
    assert_weighted_gradients_equal(restored, eager, out, expected)


def test_torch_save_of_an_export_frontend_program():
    """GPT-2 (a class pickle cannot import) through the export frontend on 3 devices: the copy carries every
    program (hundreds of nodes each: pickled as flat node lists, pickle's recursion through
    fx's linked nodes overflowed) and lowers the captured one again for a batch of 2 and of 1."""
    transformers = import_or_skip("transformers")

    class Local(transformers.GPT2LMHeadModel):
        pass

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    model = Local(config)
    eager = copy.deepcopy(model)
    ids = torch.randint(0, 64, (6, 8))
    pm = dpcompile.transform(model, ["cpu"] * 3, example_inputs=(ids,), example_kwargs={"labels": ids})
    restored = _round_trip(pm)
    assert restored.traced_model is None
    for batch in (6, 4, 2, 1):  # even, uneven, fewer rows than devices (a program lowered again)
        ids = torch.randint(0, 64, (batch, 8))
        out, expected = restored(ids, labels=ids), eager(ids, labels=ids)
        torch.testing.assert_close(out.logits, expected.logits)
        torch.testing.assert_close(out.loss, expected.loss)
        out.loss.backward(), expected.loss.backward()
        for (name, p), q in zip(restored.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
        restored.zero_grad(), eager.zero_grad()


class OptionalBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, bias=None):
        return self.fc(x) if bias is None else self.fc(x) + bias


def test_a_copy_of_an_export_frontend_program_takes_the_optional_argument_the_examples_left_none():
    """The export frontend checks an argument its examples left None by value; a copy (deepcopy, torch.save)
    found the None default in its graph and keyed the call as one departing from the program, which it could
    not trace again: refused ("the model's class is not available to trace again"). It keys calls as the
    original does: the copy runs them; a bias given is refused as the original refuses it."""
    torch.manual_seed(0)
    model = OptionalBias().double()
    eager = copy.deepcopy(model)
    x = torch.randn(5, 4, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x, None))
    for restored in (copy.deepcopy(pm), _round_trip(pm)):
        for args in ((x, None), (x,)):
            torch.testing.assert_close(restored(*args), eager(x))
        with pytest.raises(dpcompile.DpCompileError, match="exported with bias=None"):
            restored(x, torch.ones(3, dtype=torch.float64))


def _add_one(module, args):  # importable: pickle saves it by name
    return (args[0] + 1,)


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["dp", "tp"])
def test_a_copy_without_the_model_runs_the_models_own_forward_pre_hook(tensor_parallel, tmp_path):
    """The model's own hooks run around the program (tracing forward never records them). A copy that
    cannot carry the model (its class is not importable) lost them: its outputs were not eager's. They go with
    the copy; ``dpcompile.export`` says they are code (a trusted pickle), where tensor parallel's wrote data."""

    class Local(nn.Sequential):
        pass

    torch.manual_seed(0)
    model = Local(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    model.register_forward_pre_hook(_add_one)
    eager = copy.deepcopy(model)
    x = torch.randn(5, 4, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=tensor_parallel)
    restored = _round_trip(pm)
    assert restored.traced_model is None
    torch.testing.assert_close(restored(x), eager(x))
    with pytest.raises(dpcompile.ExportError, match="hooks .* on itself"):
        dpcompile.load(dpcompile.export(pm, tmp_path / "out"))


class _Corrupted:
    """Pickles as ``pm`` does, with ``edit`` applied to its state: what a damaged file unpickles to."""

    def __init__(self, pm, edit):
        self.restore, (self.cls, self.state) = pm.__reduce__()
        edit(self.state)

    def __reduce__(self):
        return self.restore, (self.cls, self.state)


def _drop_a_node(state):  # a node an argument names is gone: a KeyError rebuilding the graph
    del state["graph"].nodes[1]


def _config_missing(state):
    del state["config"]["mode"]


@pytest.mark.parametrize("edit", [_drop_a_node, _config_missing], ids=["node_missing", "config_field_missing"])
def test_a_corrupt_pickled_program_is_a_dpcompile_error_naming_the_way_out(edit):
    """Was a bare KeyError from inside the graph rebuild or the restore."""
    pm = dpcompile.transform(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), ["cpu"] * 2)
    buffer = io.BytesIO()
    torch.save(_Corrupted(pm, edit), buffer)
    buffer.seek(0)
    with pytest.raises(dpcompile.DpCompileError, match="cannot be restored .*corrupt.*save_checkpoint"):
        torch.load(buffer, weights_only=False)
