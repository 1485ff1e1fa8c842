"""A program that owns its state (tensor parallel's shards, a pipeline's placed stages, FSDP's pieces) exports the
model once at transform; the first call in the other mode exports that mode and lowers the program
again in place: ``pm.parameters()`` stay the same objects (the optimizer keeps training them), and
both modes give eager's numbers (``dpcompile.modules.other_mode.OtherModeInPlace``). Over a mesh:
``check_other_mode_in_place`` in ``test_context_parallel_mesh.py``'s spawned group."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.export
from torch import nn

import dpcompile
from tests.helpers import assert_steps_equal_eager


class Scaled(nn.Module):
    """Forward reads ``self.training`` beyond its modules: export bakes the constant in, per mode."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) * (2.0 if self.training else 1.0)


LAYOUTS = {
    "tensor_parallel": {"tensor_parallel": True},
    "pipeline": {"pipeline": 2, "micro_batches": 2},
    "fsdp": {"data_parallel": "fsdp"},  # one process: the pieces stay, the user's model exports the other mode
}


@pytest.fixture
def exports(monkeypatch):
    """The calls of ``torch.export.export`` (the frontend's exports), counted."""
    calls = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _transformed(layout: str):
    torch.manual_seed(0)
    model = Scaled().double().train()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,), **LAYOUTS[layout])
    return pm, eager, x


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_other_mode_is_exported_at_its_first_call_and_trains_on(layout, exports):
    """One export at transform; 2 AdamW steps; eval equals eager's (one more export); 2 more steps in
    training equal eager's (outputs, every gradient, the state after), on the same parameter objects."""
    pm, eager, x = _transformed(layout)
    assert len(exports) == 1
    params = list(pm.parameters())
    opt, eager_opt = torch.optim.AdamW(pm.parameters(), lr=1e-2), torch.optim.AdamW(eager.parameters(), lr=1e-2)
    optimizers = iter([opt, eager_opt, opt, eager_opt])
    steps = dict(inputs=lambda step: (x + step,), optimizer=lambda _: next(optimizers))
    assert_steps_equal_eager(pm, eager, **steps)
    pm.eval()
    eager.eval()
    torch.testing.assert_close(pm(x), eager(x))
    assert len(exports) == 2
    assert "mode_value" in pm.code  # pm itself serves both modes now, as a transform exporting both makes it
    pm.train()
    eager.train()
    assert_steps_equal_eager(pm, eager, **steps)
    assert len(exports) == 2
    assert all(p is q for p, q in zip(pm.parameters(), params, strict=True))


def test_a_copy_and_a_folder_serve_both_modes(tmp_path, exports):
    """``copy.deepcopy``, pickling and ``dpcompile.export`` before any call in the other mode export it
    then: the copy, the unpickled and the loaded programs give eager's eval numbers; pm still trains."""
    pm, eager, x = _transformed("tensor_parallel")
    assert len(exports) == 1
    twin = copy.deepcopy(pm)
    assert len(exports) == 2
    buffer = io.BytesIO()
    pickle.dump(pm, buffer)
    dpcompile.export(pm, tmp_path / "tp")
    loaded = dpcompile.load(tmp_path / "tp")
    unpickled = pickle.loads(buffer.getvalue())
    assert len(exports) == 2
    eager.eval()
    for program in (twin, unpickled, loaded, pm):
        program.eval()
        torch.testing.assert_close(program(x), eager(x))
    eager.train()
    pm.train()
    torch.testing.assert_close(pm(x), eager(x))


def test_a_failed_completion_leaves_the_program_as_it_was(monkeypatch, exports):
    """Where lowering the program of both modes fails, the call raises, pm keeps its program and
    parameters, and the next call in the other mode completes it."""
    from dpcompile.recipes.tensor_parallel import TensorParallelRecipe

    pm, eager, x = _transformed("tensor_parallel")
    code, params = pm.code, list(pm.parameters())
    real = TensorParallelRecipe.complete_other_mode

    def failing(*args, **kwargs):
        raise dpcompile.DpCompileError("lowering failed")

    monkeypatch.setattr(TensorParallelRecipe, "complete_other_mode", failing)
    pm.eval()
    with pytest.raises(dpcompile.DpCompileError, match="lowering failed"):
        pm(x)
    assert pm.code == code and all(p is q for p, q in zip(pm.parameters(), params, strict=True))
    monkeypatch.setattr(TensorParallelRecipe, "complete_other_mode", real)
    torch.testing.assert_close(pm(x), eager.eval()(x))
    assert len(exports) == 2  # the other mode was exported once, at the failed call


class RenormedLookup(nn.Module):
    """``nn.Embedding(max_norm=)`` renormalises the rows it looks up in its weight (export spells it
    ``embedding_renorm_(detach(weight), ids)``); tensor parallelism keeps it whole."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8, padding_idx=0, max_norm=1.0)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.emb(ids))


def test_tensor_parallel_eval_keeps_a_whole_layer_whole_and_its_in_place_write():
    """The eval mode's program is lowered again with ``pm.plan``, which names the embedding kept whole
    (``"replicate"``): the exported source holds it as a plain module, so eval was refused (ArgumentError:
    'emb', a Module, not an nn.Linear). Lowered on fake shapes, whose storages told ``detach`` apart from the
    weight, the max_norm write was made functional and lost: eval read rows not renormalised."""
    torch.manual_seed(0)
    model = RenormedLookup().double()
    eager = copy.deepcopy(model)
    ids, other = torch.randint(0, 10, (6, 5)), torch.randint(0, 10, (6, 5))
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(ids,), tensor_parallel=True)
    assert pm.plan == {"head": "row", "emb": "replicate"}
    assert_steps_equal_eager(pm, eager, lambda step: (ids,), lambda ps: torch.optim.AdamW(ps, lr=0.1))
    pm.eval()
    eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(other), eager(other))
    torch.testing.assert_close(pm.state_dict()["emb.weight"], eager.emb.weight.detach())
