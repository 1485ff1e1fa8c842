"""``cut_stage`` and ``find_shared_parameters`` on programs lowered for one device, as a mesh rank
lowers them (no process group needed): tied weights found, a mean loss cut into its sum and count,
an output class rebuilt, an op that mixes rows refused with its name."""

from __future__ import annotations

import copy
import functools
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import passes
from dpcompile.capture import capture
from dpcompile.devices import Devices
from dpcompile.errors import DpCompileError
from dpcompile.infra import info_of, run_passes
from passes.cut_stage import cut_stage, find_row_meetings, find_shared_parameters


class Out(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor


class TiedLM(nn.Module):
    """An embedding and a head that share one weight (as GPT-2's wte and lm_head)."""

    def __init__(self, mix: bool = False, whole: bool = False):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.mix, self.whole = mix, whole

    def forward(self, ids, labels):
        h = torch.tanh(self.body(self.embed(ids)))
        if self.mix:
            h = h - h.mean(0, keepdim=True)
        if self.whole:
            h = torch.cumsum(h, 0)  # along the batch: runs whole, on the gathered batch
        logits = self.head(h)
        return Out(logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def _lowered(model: nn.Module, boundaries: list[str]):
    gm = capture(model)
    cpu = torch.device("cpu")
    options = passes.PipelineOptions(devices=Devices((cpu,)), input_dims={"ids": 0, "labels": 0}, output_device=cpu)
    gm, _ = run_passes(gm, passes.frontend_pipeline(options))
    plan = passes.find_stage_boundaries(gm, stages=boundaries)
    lowering = [
        functools.partial(passes.split_stages, plan=plan),
        functools.partial(passes.insert_scatter_gather, devices=Devices((cpu,)), input_dims={"ids": 0, "labels": 0},
                          output_device=cpu),
    ]  # fmt: skip
    gm, _ = run_passes(gm, lowering)
    return gm, plan


def test_tied_weight_is_shared_by_first_and_last_stage():
    gm, plan = _lowered(TiedLM(), ["body", "head"])
    assert find_shared_parameters(gm, plan) == [("embed.weight", (0, 2))]


def test_last_stage_returns_sum_count_and_rebuilds_the_output_class():
    """The last stage's flat outputs: logits, the loss's partial sum and count; the module
    rebuilds ``Out(logits, sum / count)`` from them."""
    torch.manual_seed(0)
    model = TiedLM()
    gm, plan = _lowered(model, ["head"])
    cut, records = run_passes(gm, [functools.partial(cut_stage, plan=plan, stage=1)])
    found = info_of(records, "cut_stage")
    assert found["has_loss"] and found["count"] is not None
    ids, labels = torch.randint(0, 16, (3, 5)), torch.randint(0, 16, (3, 5))
    h = torch.tanh(model.body(model.embed(ids)))
    assert found["inputs"] == ["labels", "tanh_dev0"]  # live across the boundary, in graph order
    logits, partial_sum, count = cut(labels, h)
    out = found["outputs"].assemble([logits, partial_sum / count])
    expected = model(ids, labels)
    assert isinstance(out, Out)
    torch.testing.assert_close(out.logits, expected.logits)
    torch.testing.assert_close(out.loss, expected.loss.reshape(1))


def test_rows_mixed_in_the_program_are_found_by_name():
    """``h - h.mean(0, keepdim=True)`` runs split, as a partial mean read by a subtraction: a meeting
    of the rows that a pipeline over a mesh (each micro-batch apart) refuses for micro_batches > 1."""
    gm, plan = _lowered(TiedLM(mix=True), ["head"])
    assert [(c.name, r.name) for c, r in find_row_meetings(gm)] == [("mean", "sub_dev0")]
    gm, plan = _lowered(TiedLM(), ["head"])
    assert find_row_meetings(gm) == []  # the mean loss and the gathered logits only make outputs


def test_an_output_computed_from_the_whole_batch_is_refused_by_name():
    gm, plan = _lowered(TiedLM(whole=True), ["head"])
    with pytest.raises(DpCompileError, match="mixes the rows of the batch"):
        run_passes(gm, [functools.partial(cut_stage, plan=plan, stage=1)])


class EarlyOutput(nn.Module):
    """Returns, next to the loss, a value made on the first stage (and, with ``aux``, a second mean)."""

    def __init__(self, aux: bool = False):
        super().__init__()
        self.embed, self.body, self.head = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16)
        self.aux = aux

    def forward(self, ids, labels):
        early = torch.tanh(self.embed(ids))
        logits = self.head(torch.tanh(self.body(early)))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return (loss, early, early.square().mean()) if self.aux else (loss, early)


def test_a_value_of_an_earlier_stage_passes_through_the_later_ones():
    """``return loss, early`` with ``early`` made on stage 0 of 3: stage 1 gets it and passes it on
    (as the labels), the last stage returns it as a batch-split output."""
    torch.manual_seed(0)
    model = EarlyOutput()
    gm, plan = _lowered(model, ["body", "head"])
    ids, labels = torch.randint(0, 16, (3, 5)), torch.randint(0, 16, (3, 5))
    early = torch.tanh(model.embed(ids))
    body = model.body(early)
    middle, records = run_passes(copy.deepcopy(gm), [functools.partial(cut_stage, plan=plan, stage=1)])
    assert info_of(records, "cut_stage")["inputs"] == ["labels", "tanh_dev0"]
    passed_labels, passed_early, tanh_1 = middle(labels, early)
    assert passed_early is early and passed_labels is labels
    last, records = run_passes(gm, [functools.partial(cut_stage, plan=plan, stage=2)])
    found = info_of(records, "cut_stage")
    assert found["inputs"] == ["labels", "tanh_dev0", "tanh_1_dev0"]
    partial_sum, count, returned = last(labels, early, torch.tanh(body))
    loss, got = found["outputs"].assemble([partial_sum / count, returned])
    expected_loss, expected_early = model(ids, labels)
    torch.testing.assert_close(loss, expected_loss.reshape(1))
    torch.testing.assert_close(got, expected_early)


def test_a_second_mean_output_is_refused_by_name_on_every_stage():
    """The schedule runs backward from one mean loss, and the module adds up one sum and count:
    a second mean is refused (on stage 0 too, so that every rank fails at once)."""
    gm, plan = _lowered(EarlyOutput(aux=True), ["head"])
    for stage in (0, 1):
        with pytest.raises(DpCompileError, match="output 'mean' is a second mean. Add it into the loss"):
            run_passes(copy.deepcopy(gm), [functools.partial(cut_stage, plan=plan, stage=stage)])
