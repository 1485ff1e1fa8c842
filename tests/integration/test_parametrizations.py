"""Layers under ``torch.nn.utils.parametrizations`` (``spectral_norm``, ``weight_norm``) in every
one-process layout: outputs, buffers and parameters after two SGD steps equal eager's.

``spectral_norm``'s power iteration updates its ``_u``/``_v`` buffers each time the weight is
computed in training mode; run per replica or per micro-batch it ran once per copy, silently
changing the weight. The tracer now enters such a layer: its weight is one call, run once.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

import dpcompile
from tests.helpers import assert_steps_equal_eager


class Normed(nn.Module):
    """``fc1`` normed by ``norm``: a parametrization, or the older hook-based ``torch.nn.utils.weight_norm``
    / ``spectral_norm``."""

    def __init__(self, norm):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 3)
        norm(self.fc1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


LAYOUTS = {
    "dp": {},
    "pipeline": {"pipeline": 2, "micro_batches": 2},
    "fsdp": {"data_parallel": "fsdp"},
    "tp": {"tensor_parallel": True},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("norm", [parametrizations.spectral_norm, parametrizations.weight_norm], ids=["spectral", "weight"])
def test_parametrized_layer_trains_as_eager(norm, layout):
    torch.manual_seed(0)
    model = Normed(norm)
    with torch.no_grad():  # far from the power iteration's fixed point: each extra iteration shows
        for original in model.fc1.parametrizations.weight.parameters():
            original.mul_(torch.rand_like(original) * 3)
    eager = copy.deepcopy(model)
    x = torch.randn(6, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), **LAYOUTS[layout])
    opt, eager_opt = torch.optim.SGD(pm.parameters(), lr=0.5), torch.optim.SGD(eager.parameters(), lr=0.5)
    for step in range(2):
        got, want = pm(x + step), eager(x + step)  # eager: its class is not changed by fsdp's gathers
        torch.testing.assert_close(got, want)
        got.square().mean().backward()
        want.square().mean().backward()
        opt.step()
        eager_opt.step()
        opt.zero_grad()
        eager_opt.zero_grad()
    state, eager_state = pm.state_dict(), eager.state_dict()
    assert list(state) == list(eager_state)
    for key, value in eager_state.items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"{key}: {m}")


def test_pickling_a_parametrized_program_is_refused_by_name_and_deepcopy_works(tmp_path):
    """torch does not pickle parametrized modules: ``torch.save(pm)`` said so with a bare
    RuntimeError from inside torch; it is a DpCompileError naming the modules and the way out."""
    model = Normed(parametrizations.weight_norm)
    x = torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,))
    with pytest.raises(dpcompile.DpCompileError, match=r"parametrized modules \(fc1.*save_checkpoint"):
        torch.save(pm, tmp_path / "pm.pt")
    torch.testing.assert_close(copy.deepcopy(pm)(x), pm(x))


@pytest.mark.parametrize("norm", [parametrizations.spectral_norm, parametrizations.weight_norm], ids=["spectral", "weight"])
def test_tensor_parallel_plan_says_a_parametrized_layer_stays_whole_and_why(norm):
    """A plan naming it (or the automatic one) keeps it whole, saying it is a parametrization
    (it said "not called in forward")."""
    x = torch.randn(4, 8)
    pm = dpcompile.transform(Normed(norm), ["cpu"] * 2, tensor_parallel={"fc1": "column", "fc2": "row"}, example_inputs=(x,))
    assert pm.plan["fc1"] == "replicate"
    assert "parametrization" in pm.plan_reasons["fc1"]


def test_hook_based_spectral_norm_in_training_is_refused_by_name():
    """Its pre-hook's power iteration ran once per replica (a silently different weight): refused,
    naming the parametrization that works; in eval mode (no iteration) it runs as eager."""
    model = Normed(nn.utils.spectral_norm)
    x = torch.randn(4, 8)
    with pytest.raises(dpcompile.DpCompileError, match="'fc1' .*torch.nn.utils.parametrizations.spectral_norm"):
        dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,))
    eager = Normed(nn.utils.spectral_norm).eval()
    eager.load_state_dict(model.state_dict())
    pm = dpcompile.transform(model.eval(), ["cpu"] * 2, example_inputs=(x,))
    torch.testing.assert_close(pm(x), eager(x))


def test_hook_based_weight_norm_runs_tensor_parallel():
    """The weight its hook computed (not a leaf) broke the private copy tensor parallelism makes
    (RuntimeError: only graph leaves support deepcopy); the layer stays whole, saying why."""
    torch.manual_seed(0)
    model = Normed(nn.utils.weight_norm)
    eager = Normed(nn.utils.weight_norm)
    eager.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    torch.testing.assert_close(pm(x), eager(x))
    assert pm.plan["fc1"] == "replicate" and "computed at each call" in pm.plan_reasons["fc1"]


class NormedLoss(Normed):
    """``Normed`` returning its outputs' mean square: the loss a 1F1B call backwards itself."""

    def forward(self, x):
        return super().forward(x).square().mean()


@pytest.mark.parametrize(("frontend", "options"), [
    ("fx", {"pipeline": 2, "micro_batches": 2, "schedule": "1f1b"}),
    ("export", {}),
    ("export", {"pipeline": 2, "micro_batches": 2, "schedule": "1f1b"}),
    ("fx", {"activation_checkpointing": ["fc1"]}),
    ("fx", {"pipeline": 2, "micro_batches": 2, "activation_checkpointing": ["fc1"]}),
], ids=["fx-1f1b", "export-dp", "export-1f1b", "fx-checkpointed", "fx-gpipe-checkpointed"])  # fmt: skip
def test_spectral_norm_iterates_once_a_step_in_float64(frontend, options):
    """1F1B ran the weight's parametrization again in each micro-batch's unit: two power iterations a
    step (gradients 1e-4 off relatively, in float64); it now runs each from the buffers of the call's
    first. The export frontend crashed at the first call (its no_grad power iteration writes ``out=_u``
    from the weight, which required grad) and the transform itself iterated the real buffers once. A
    checkpointed layer computed its weight inside the region: once per micro-batch in a pipeline, and again
    from the iterated vectors in each recompute; it is computed once a call, outside the regions."""
    torch.manual_seed(0)
    model = NormedLoss(parametrizations.spectral_norm).double()
    with torch.no_grad():
        model.fc1.parametrizations.weight.original.mul_(torch.rand_like(model.fc1.parametrizations.weight.original) * 3)
    eager = copy.deepcopy(model)
    x = torch.randn(6, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), frontend=frontend, **options)
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")
    # 1F1B backwarded the loss in the call: backward of it adds nothing
    assert_steps_equal_eager(pm, eager, lambda step: (x + step,), lambda params: torch.optim.SGD(params, lr=0.5), lambda out: out)


@pytest.mark.parametrize("options", [{}, {"mesh": {"dp": 2}, "data_parallel": "fsdp"}, {"mesh": {"dp": 2, "tp": 2}}],
                         ids=["dp", "fsdp", "dpxtp"])  # fmt: skip
def test_hook_based_weight_norm_converted_to_float64_trains_as_eager(options):
    """``model.double()`` leaves the older weight_norm's computed ``weight`` in float32 until its pre-hook
    runs: the examples' dtype check read it and refused float64 examples, and the copies fsdp and
    dp x tp make crashed (deepcopy refuses a computed tensor). Two AdamW steps now equal eager's."""
    torch.manual_seed(0)
    model = Normed(nn.utils.weight_norm).double()
    eager = Normed(nn.utils.weight_norm).double()
    eager.load_state_dict(model.state_dict())
    x = torch.randn(4, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * (4 if "tp" in options.get("mesh", {}) else 2), example_inputs=(x,), **options)
    assert_steps_equal_eager(pm, eager, lambda step: (x + step,), lambda params: torch.optim.AdamW(params, lr=1e-2))


def test_export_checkpointed_spectral_norm_is_refused_naming_the_buffer_it_writes():
    """The export frontend inlines the power iteration (``div.out(mv, norm, out=_u)``) into the layer's
    region, which a recompute cannot run again: refused, naming ``_u`` (it named the op's input, ``mv``)."""
    torch.manual_seed(0)
    model = Normed(parametrizations.spectral_norm).double()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(dpcompile.DpCompileError, match=r"'fc1' writes in place into 'fc1_parametrizations_weight_0__u'"):
        dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), frontend="export", activation_checkpointing=["fc1"])
    for key, value in before.items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0)
