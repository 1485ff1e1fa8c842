"""``data_parallel="fsdp"`` in one process, exported and loaded (``dpcompile.export`` / ``load``) and
pickled (``torch.save`` / ``torch.load``, ``copy.deepcopy``): written as the replicated program it was
sharded from (whole tensors, the model's keys) and sharded again where it is restored, in every
layout with ``dp`` (issue 28's matrix): the copy stores pieces, its outputs, losses, every gradient
and the parameters after 2 AdamW steps equal the original's and eager's. Then what is refused or
checked: a model changed since transform, a folder edited by hand, other devices."""

from __future__ import annotations

import copy
import io
import json
import warnings

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.export import ExportError
from dpcompile.modules.fsdp_one_process import FsdpProgram, GatherShards
from tests.helpers import assert_steps_equal_eager, full_gradients
from tests.integration.test_fsdp_one_process import ModeBranch
from tests.integration.test_layout_matrix import MLPStack
from tests.tools.export_attacks import rehash

LAYOUTS = {
    "dp": ({"dp": 2}, {}),
    "dp_tp": ({"dp": 2, "tp": 2}, {}),
    "pp_dp": ({"pp": 2, "dp": 2}, {}),
    "pp_dp_1f1b": ({"pp": 2, "dp": 2}, {"schedule": "1f1b", "micro_batches": 2}),
    "pp_dp_tp": ({"pp": 2, "dp": 2, "tp": 2}, {}),
}


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(6, 8, generator=g, dtype=torch.float64), "labels": torch.randint(0, 4, (6,), generator=g)}


def _fsdp(layout, options, devices=None):
    torch.manual_seed(0)
    model = MLPStack(depth=2).double()
    reference = copy.deepcopy(model)
    n = 1
    for size in layout.values():
        n *= size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(model, devices or ["cpu"] * n, mesh=layout, example_kwargs=_inputs(),
                                 data_parallel="fsdp", **options)  # fmt: skip
    return pm, reference


def _exported(pm, folder, **load_options):
    dpcompile.export(pm, folder)
    return dpcompile.load(folder, **load_options)


def _pickled(pm, _folder):
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _assert_pieces_like(copied, pm):
    """The copy stores each parameter as pieces, named and shaped as the original's."""
    assert isinstance(copied, FsdpProgram) and copied.mode == pm.mode
    assert {n: p.shape for n, p in copied.named_parameters()} == {n: p.shape for n, p in pm.named_parameters()}
    whole = [n for n, p in copied.named_parameters() if "parametrizations." not in n and p.dim() > 0]
    assert not whole, whole
    assert copied.param_shards.keys() == pm.param_shards.keys()


def _assert_steps_like(programs, reference, steps=2):
    """Each step's loss and every gradient of each program equal eager's, and the state dicts after."""
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (*programs, reference)]
    for step in range(steps):
        kwargs = _inputs(seed=step)
        expected = reference(**kwargs)
        expected.backward()
        for pm in programs:
            loss = pm(**kwargs)
            loss.backward()
            torch.testing.assert_close(loss, expected, msg=lambda m, step=step: f"loss of step {step}: {m}")
            grads = full_gradients(pm)
            for key, p in reference.named_parameters():
                torch.testing.assert_close(grads[key], p.grad, msg=lambda m, key=key, step=step: f"gradient of {key}, step {step}: {m}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for pm in programs:
        state = pm.state_dict()
        assert sorted(state) == sorted(reference.state_dict())
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"{key} after {steps} steps: {m}")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fsdp_program_round_trips_as_pieces_and_trains_like_eager(name, tmp_path):
    """export -> load and torch.save -> torch.load: pieces again (named, shaped and placed as the
    original's; AdamW's state over them is sharded too), the model's state dict, then 2 AdamW steps
    of the original and both copies equal eager's (losses, every gradient, the parameters after)."""
    layout, options = LAYOUTS[name]
    pm, reference = _fsdp(layout, options)
    copies = [_exported(pm, tmp_path / "fsdp"), _pickled(pm, None)]
    for copied in copies:
        _assert_pieces_like(copied, pm)
        for key, value in reference.state_dict().items():
            assert torch.equal(copied.state_dict()[key], value), key
        assert [m.piece_devices for m in copied.modules() if isinstance(m, GatherShards)] == [
            m.piece_devices for m in pm.modules() if isinstance(m, GatherShards)
        ]
    _assert_steps_like([pm, *copies], reference)


class TiedWithRootParameter(nn.Module):
    """A parameter of the root itself (gathered by the program and by the model copy the other mode
    is traced from), a weight tied between two layers, and a forward that reads the mode."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(8))
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.b.weight = self.a.weight

    def forward(self, x, labels):
        h = self.b(torch.tanh(self.a(x + self.pos)))
        return nn.functional.cross_entropy(self.head(h * 2 if self.training else h), labels)


@pytest.mark.parametrize("layout", [{"dp": 2}, {"dp": 2, "tp": 2}], ids=["dp", "dp_tp"])
def test_a_root_parameter_and_a_tied_weight_round_trip(layout, tmp_path):
    """The root's pieces and the tied weight's one set of pieces come back as such (the root's class
    was torch's Parametrized<class>, which pickle cannot name; under dp x tp the meta copy of the private
    model holds the root's pieces on meta, which cannot be gathered); both copies train and evaluate as
    eager (pp x dp and pp x dp x tp pass too, by hand)."""
    torch.manual_seed(0)
    model = TiedWithRootParameter().double()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(model, ["cpu"] * 2 * len(layout), mesh=layout, example_kwargs=_inputs(),
                                 data_parallel="fsdp")  # fmt: skip
    copies = [_exported(pm, tmp_path / "fsdp"), _pickled(pm, None)]
    for copied in copies:
        _assert_pieces_like(copied, pm)
        assert copied.b.parametrizations.weight is copied.a.parametrizations.weight
        assert "parametrizations.pos.original1" in dict(copied.named_parameters())
    _assert_steps_like([pm, *copies], reference)
    kwargs = _inputs(seed=5)
    with torch.no_grad():
        for copied in copies:
            torch.testing.assert_close(copied.eval()(**kwargs), reference.eval()(**kwargs))


def test_a_program_torch_export_captured_round_trips_in_both_modes(tmp_path):
    """frontend="export": no model to trace again, so the copies run the programs they carry (both
    modes, captured before sharding) on their pieces; training and eval outputs equal eager's."""
    torch.manual_seed(0)
    model, x = ModeBranch().double(), torch.randn(4, 8, dtype=torch.float64)
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, data_parallel="fsdp", frontend="export", example_inputs=(x,))
    for copied in (_exported(pm, tmp_path / "fsdp"), _pickled(pm, None)):
        _assert_pieces_like(copied, pm)
        for mode in ("train", "eval", "train"):
            getattr(copied, mode)(), getattr(reference, mode)()
            torch.testing.assert_close(copied(x), reference(x), msg=lambda m, mode=mode: f"{mode}: {m}")


def test_a_copy_is_independent_and_a_save_changes_nothing():
    """copy.deepcopy (was KeyError 'plan_reasons' for dp alone): its own pieces; saving and copying
    leave the original's pieces, parametrized classes and outputs as they were."""
    pm, reference = _fsdp(*LAYOUTS["dp"])
    before = {n: p.clone() for n, p in pm.named_parameters()}
    classes = {path: type(m) for path, m in pm.named_modules()}
    clone = copy.deepcopy(pm)
    _pickled(pm, None)
    assert {path: type(m) for path, m in pm.named_modules()} == classes
    _assert_pieces_like(clone, pm)
    assert not {id(p) for p in clone.parameters()} & {id(p) for p in pm.parameters()}
    with torch.no_grad():
        next(clone.parameters()).add_(1.0)
    for n, p in pm.named_parameters():
        assert torch.equal(p, before[n]), n
    kwargs = _inputs()
    torch.testing.assert_close(pm(**kwargs), reference(**kwargs))


def test_a_model_changed_since_transform_is_refused_by_export_and_followed_by_a_pickle(tmp_path):
    """A layer added to a block of the program (which holds the model's modules): export refuses (the
    folder is not made); a pickled copy traces the changed model, as the original does (its main
    program, traced before, would leave the new layer out)."""
    pm, reference = _fsdp(*LAYOUTS["dp"])
    for model in (pm, reference):
        model.layers[0].append(nn.Tanh())  # the program traced before calls layers.0.0 to .2 only
    with pytest.raises(ExportError, match="the model changed since transform"):
        dpcompile.export(pm, tmp_path / "changed")
    assert not (tmp_path / "changed").exists()
    copied = _pickled(pm, None)
    kwargs = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(copied(**kwargs), reference(**kwargs))
        torch.testing.assert_close(pm(**kwargs), reference(**kwargs))


def _edit_config(folder, edit):
    program = json.loads((folder / "program.json").read_text())
    edit(program["config"])
    (folder / "program.json").write_text(json.dumps(program))
    rehash(folder)


@pytest.mark.parametrize(
    ("edit", "message"),
    [(lambda config: config.pop("data_parallel"), "module.py is not the program"),
     (lambda config: config.update(data_parallel="zero"), "data_parallel 'zero'")],
    ids=["flag_dropped", "flag_unknown"],
)  # fmt: skip
def test_a_folder_whose_fsdp_flag_was_edited_is_refused(edit, message, tmp_path):
    """``config.data_parallel`` is shown in module.py's first line: dropping it (rehashed) leaves module.py
    naming FSDP, so the folder is refused; a value export never writes is refused by name."""
    pm, _ = _fsdp(*LAYOUTS["dp"])
    folder = dpcompile.export(pm, tmp_path / "fsdp")
    assert 'data_parallel with data_parallel="fsdp"' in (folder / "module.py").read_text().splitlines()[0]
    _edit_config(folder, edit)
    with pytest.raises(ExportError, match=message):
        dpcompile.load(folder)


def test_a_dp_export_loads_on_other_devices_as_that_many_pieces(tmp_path):
    """dp alone is regenerated for any device list, as replication's export is: 3 devices, 3 pieces
    (rows balanced as tensor_split cuts); distinct devices hold piece r on copy r's device."""
    pm, reference = _fsdp(*LAYOUTS["dp"])
    folder = dpcompile.export(pm, tmp_path / "fsdp")
    three = dpcompile.load(folder, devices=["cpu"] * 3)
    assert tuple(three.get_parameter(f"layers.0.0.parametrizations.weight.original{r}").shape[0] for r in range(3)) == (6, 5, 5)
    distinct = dpcompile.load(folder, devices=["cpu:0", "cpu:1"])
    assert {m.piece_devices for m in distinct.modules() if isinstance(m, GatherShards)} == {("cpu:0", "cpu:1")}
    _assert_steps_like([three, distinct], reference, steps=1)


def test_a_pipeline_export_loads_only_on_its_devices(tmp_path):
    pm, _ = _fsdp(*LAYOUTS["pp_dp"])
    folder = dpcompile.export(pm, tmp_path / "fsdp")
    with pytest.raises(ExportError, match="has 2 devices"):
        dpcompile.load(folder, devices=["cpu"] * 3)


@pytest.mark.parametrize("data_parallel", ["replicate", "fsdp"])
def test_a_program_waiting_for_its_weights_is_not_exported(data_parallel, tmp_path):
    """Built on meta and not loaded yet: export wrote its uninitialised memory as the weights (a
    pickle and a copy were refused already); now refused by name, no folder made."""
    with torch.device("meta"):
        model = MLPStack(depth=1).double()
    pm = dpcompile.transform(model, ["cpu"] * 2, example_kwargs=_inputs(), data_parallel=data_parallel)
    with pytest.raises(ExportError, match="holds no weights yet.*load_checkpoint"):
        dpcompile.export(pm, tmp_path / "meta")
    assert not (tmp_path / "meta").exists() and pm.needs_weights



def test_a_weight_read_directly_exports_and_runs_in_both_modes(tmp_path):
    """A program traced from the sharded model (the other mode) reads ``embed.weight``, not a call of its gather
    (``self.embed.parametrizations.weight()``), which the replicated program export writes lacks. Before, export
    refused it ("calls 'embed.parametrizations.weight' on a replica, which is not a module of the tree"). The class
    is local, as one in a user's script (``__main__``): not importable, so the program carries its other mode."""

    class WrittenOutTiedHead(nn.Module):  # GPT-2's head written out: h @ embed.weight.T
        def __init__(self):
            super().__init__()
            self.embed, self.fc = nn.Embedding(16, 8), nn.Linear(8, 8)

        def forward(self, ids):
            return torch.relu(self.fc(self.embed(ids))) @ self.embed.weight.T

    torch.manual_seed(0)
    model, ids = WrittenOutTiedHead().double(), torch.randint(0, 16, (5, 3))
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, mesh={"dp": 2}, data_parallel="fsdp", example_inputs=(ids,))
    dpcompile.export(pm, tmp_path / "e")
    loaded = dpcompile.load(tmp_path / "e")
    for training in (True, False):
        for m in (pm, eager, loaded):
            m.train(training)
        want = eager(ids)
        torch.testing.assert_close(loaded(ids), want)
        got = pm(ids)
        torch.testing.assert_close(got, want)
        got.square().sum().backward()
        want.square().sum().backward()
        grads = full_gradients(pm)
        for name, p in eager.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=name)
        pm.zero_grad(), eager.zero_grad()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_class_pickle_cannot_import_runs_a_small_batch_on_its_pieces(how):
    """``{"dp": 2, "tp": 2}`` of a class defined in a function, after a call of one row (a program for
    fewer rows than copies): a deep copy refused that call (it carried no model to trace it from), and
    an unpickled copy ran the program it carried on the weights of the save, stale after a step."""

    class Local(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(0)
    model = Local().double()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 4, mesh={"dp": 2, "tp": 2}, data_parallel="fsdp")
    x = torch.randn(1, 8, dtype=torch.float64)
    pm(x)
    if how == "deepcopy":
        copied = copy.deepcopy(pm)
    else:
        buffer = io.BytesIO()
        torch.save(pm, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    assert_steps_equal_eager(copied, reference, lambda step: (x,), lambda params: torch.optim.SGD(params, lr=0.5))
