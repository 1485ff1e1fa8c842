"""``verify(pm, model, *inputs, fake_devices=n)`` of the layouts with ``cp`` in one process: the
program rebuilt on fake ``cuda:0..n-1`` (any op mixing devices raises), every piece of the sequence
on its device. cp composed with dp, tp or pp runs every copy on copy 0's devices in one process
(``dpcompile.target.check_virtual_copies``), so its places are checked as built there.

Reuses ``test_compose_sequence``'s tiny GPT-like model (d=16, one block).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import dpcompile
from dpcompile.fake import fake_devices
from dpcompile.verify import check_layout
from dpcompile.verify.sequence_layout import repeated_devices
from tests.integration.test_compose_sequence import TinyLM, build, lm_batch


class PositionsOnTheCpu(TinyLM):
    """TinyLM whose positions are made without ``device=``: on the CPU, wrong on a GPU."""

    def forward(self, ids, labels):
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize(
    ("mesh", "options"),
    [({"cp": 2}, {}), ({"cp": 2}, {"context_parallel": {"exchange": "ring"}}), ({"cp": 2, "tp": 2}, {}),
     ({"dp": 2, "cp": 2, "tp": 2}, {}), ({"pp": 2, "cp": 2}, {})],
)  # fmt: skip
def test_a_cp_layout_passes_the_fake_cuda_placement_check(mesh, options):
    """Every value of every piece on its own fake device, the outputs back on cuda:0 (causal attention
    finds its queries' first position from shapes: fake positions have no values); composed layouts
    say which devices their copies share. ``check_layout`` is verify's fake_devices= part (the values
    are compared in test_compose_sequence)."""
    pm, eager = build(1, mesh, rows=2, **options)
    n = math.prod(mesh.values())
    result = check_layout(pm, eager, n, *lm_batch(2, 7, 0))
    assert result, str(result)
    assert result.checked["fake devices"] == n and result.checked["placed nodes"] > 8 * n
    shared = [note for note in result.notes if "copy runs on copy 0's devices" in note]
    assert len(shared) == (len(mesh) > 1)


def test_a_sequence_shorter_than_the_pieces_is_checked_as_pm_runs_it():
    """One row of one token on cp x tp: pm runs it as one piece (a program built again for the call),
    and the fake check builds that program too (it was refused as 'cannot run on sequence shards')."""
    pm, eager = build(1, {"cp": 2, "tp": 2}, rows=2)
    result = check_layout(pm, eager, 4, *lm_batch(1, 1, 1))
    assert result, str(result)
    assert result.checked["copies (dp, cp)"] == 2


def test_dp_copies_of_the_cp_program_run_on_one_device_and_are_checked_there():
    """{"dp": 2, "cp": 2} keeps every piece of the sequence on one device (the split into copies scatters a
    copy's rows onto its first device): transform refuses the pieces on distinct devices by name, and the
    fake check places all four on cuda:0, as transform can build it."""
    with pytest.raises(dpcompile.DpCompileError, match="pieces of the sequence run on"):
        dpcompile.transform(TinyLM().double(), ["cpu:0", "cpu:1"] * 2, mesh={"dp": 2, "cp": 2})
    pm, eager = build(1, {"dp": 2, "cp": 2}, rows=2)
    result = check_layout(pm, eager, 4, *lm_batch(2, 7, 0))
    assert result, str(result)
    assert any(note.endswith("checked on cuda:0") for note in result.notes), result.notes


@pytest.mark.parametrize("mesh", [{"cp": 2}, {"pp": 2, "cp": 2}])
def test_a_tensor_made_on_the_cpu_fails_the_cp_layout_with_the_users_line(mesh):
    """Positions made without device= pass on virtual devices and fail on fake GPUs, at the user's line."""
    torch.manual_seed(0)
    model = PositionsOnTheCpu().double()
    n = math.prod(mesh.values())
    pm = dpcompile.transform(model, ["cpu"] * n, mesh=mesh, example_inputs=lm_batch(2, 7, 0))
    assert dpcompile.verify(pm, model, *lm_batch(2, 7, 0))
    result = dpcompile.verify(pm, model, *lm_batch(2, 7, 0), fake_devices=n)
    assert not result
    (problem,) = result.mismatches
    assert problem.kind == "layout" and "cpu" in problem.detail and "cuda:" in problem.detail, problem.detail
    assert "test_fake_layouts_sequence.py" in problem.detail, problem.detail


def test_a_composed_cp_layout_of_another_device_count_says_which():
    """dp copies of the cp program place 4 devices: fake_devices=2 is refused with the count to ask for."""
    pm, eager = build(1, {"dp": 2, "cp": 2}, rows=2)
    with pytest.raises(dpcompile.DpCompileError, match=r"runs on 4 devices, not 2; pass fake_devices=4"):
        check_layout(pm, eager, 2, *lm_batch(2, 7, 0))


def test_copies_share_the_devices_of_copy_0_as_built_in_one_process():
    """cp beside tp or pp copies the program (each copy on the tp shards' or the stages' devices);
    beside dp alone the pieces of the sequence take devices of their own and dp copies."""
    devices = fake_devices(4)
    assert repeated_devices({"cp": 2, "tp": 2}, devices) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert repeated_devices({"pp": 2, "cp": 2}, devices) == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert repeated_devices({"dp": 2, "cp": 2}, devices) == ["cuda:0"] * 4
