"""Batch-dim propagation: how inputs are split, and the placement every node gets."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpcompile.analysis.batch_dims import decide, infer_input_dims, output_placements, propagate
from dpcompile.analysis.batch_rules import batch_first
from dpcompile.analysis.placement import REPLICATED, Partial, Split, Whole
from tests.helpers import captured, check_against_eager
from tests.models import MLP, SeqEncoder


class TwoInputs(nn.Module):
    def forward(self, x, scale: float):
        return x * scale


class WithMask(nn.Module):
    def forward(self, x, mask):
        return x.masked_fill(mask, 0.0)


class Mean(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x).mean()


# ---------------------------------------------------------------------- infer_input_dims
def test_infer_input_dims_splits_dim_0_by_default():
    """A plain tensor input is split on dim 0."""
    assert infer_input_dims(captured(MLP())) == {"x": 0}


def test_infer_input_dims_follows_a_sequence_first_lstm_to_dim_1():
    """An input that reaches an LSTM with batch_first=False is split on dim 1."""
    assert infer_input_dims(captured(SeqEncoder())) == {"tokens": 1}


def test_infer_input_dims_replicates_non_tensor_arguments():
    """An argument annotated as a Python scalar carries no batch."""
    assert infer_input_dims(captured(TwoInputs())) == {"x": 0, "scale": None}


def test_infer_input_dims_honours_a_forced_batch_dim():
    """batch_dim= overrides the sequence-module inference."""
    assert infer_input_dims(captured(SeqEncoder()), batch_dim=0) == {"tokens": 0}


def test_infer_input_dims_replicates_an_example_without_the_batch():
    """With examples, a tensor whose size on its split dim is not the batch size is replicated."""
    gm = captured(WithMask())
    dims = infer_input_dims(gm, example_inputs=(torch.randn(6, 3), torch.zeros(1, 3, dtype=torch.bool)))
    assert dims == {"x": 0, "mask": None}


def test_infer_input_dims_rejects_a_forced_dim_the_examples_contradict():
    """A forced batch_dim whose sizes disagree across inputs is an error that shows the sizes."""
    gm = captured(WithMask())
    with pytest.raises(ValueError, match="input 'mask' has size 1 on batch_dim=0, but the batch is 6"):
        infer_input_dims(gm, batch_dim=0, example_inputs=(torch.randn(6, 3), torch.zeros(1, 3, dtype=torch.bool)))


# ---------------------------------------------------------------------- propagate
def test_propagate_splits_inputs_and_replicates_parameters():
    """Placeholders get their split (traced to their name), get_attr values are replicated."""
    gm = captured(MLP(), torch.randn(4, 8))
    by_name = {n.name: p for n, p in propagate(gm, {"x": 0}).items()}
    assert by_name["x"] == Split(0, origin="x")
    assert by_name["fc1"] == by_name["relu"] == by_name["fc2"] == Split(0, origin="x")


def test_propagate_a_mean_over_the_batch_is_partial():
    """A mean over everything becomes a per-device partial result, combined at the output."""
    gm = captured(Mean(), torch.randn(4, 4))
    placements = propagate(gm, {"x": 0})
    assert output_placements(gm, placements) == [Partial("mean")]


def test_propagate_replicated_inputs_stay_replicated():
    """With no batch-carrying input, every node is replicated."""
    gm = captured(MLP(), torch.randn(4, 8))
    assert set(propagate(gm, {"x": None}).values()) == {REPLICATED}


def test_decide_a_whole_batch_input_makes_the_result_whole():
    """Once a value needs the whole batch, everything computed from it does too."""
    gm = captured(MLP(), torch.randn(4, 8))
    relu = next(n for n in gm.graph.nodes if n.name == "relu")
    placements = {n: Whole(batch=True) for n in relu.all_input_nodes}
    assert decide(relu, placements, None) == Whole(batch=True)


def test_decide_an_in_place_method_on_a_replicated_value_runs_whole():
    """x.add_(1) on a value shared by every replica would mutate it once per device: it runs once."""

    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(1))

        def forward(self, x):
            self.count.add_(1)
            return x * 2

    gm = captured(InPlace(), torch.randn(4, 3))
    by_name = {n.name: p for n, p in propagate(gm, {"x": 0}).items()}
    assert by_name["add_"] == Whole(batch=False)


# ---------------------------------------------------------------------- batch_first
@pytest.mark.parametrize(
    "module, want",
    [
        (nn.LSTM(3, 4), False),
        (nn.GRU(3, 4, batch_first=True), True),
        (nn.TransformerEncoderLayer(8, 2, batch_first=True), True),
        (nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2), 1, enable_nested_tensor=False), False),
    ],
    ids=["lstm", "gru_batch_first", "encoder_layer", "encoder"],
)
def test_batch_first_reads_the_module_or_its_attention(module, want):
    """batch_first of an RNN, a transformer layer (its self_attn), or an encoder (its first layer)."""
    assert batch_first(module) is want


class EncoderWithState(nn.Module):
    """An RNN whose initial state the caller passes: (layers, batch, hidden) whatever batch_first says."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.rnn = nn.LSTM(8, 6, num_layers=2, batch_first=batch_first)
        self.fc = nn.Linear(6, 2)

    def forward(self, x, h0, c0):
        out, (h, c) = self.rnn(x, (h0, c0))
        return self.fc(out), h, c


@pytest.mark.parametrize("batch_first", [True, False])
def test_infer_input_dims_splits_rnn_initial_state_on_dim_1(batch_first):
    """h0 and c0 fed to an RNN are split on dim 1 (their batch dim), and the RNN runs per device."""
    x = torch.randn(5, 4, 8) if batch_first else torch.randn(4, 5, 8)
    pm = check_against_eager(
        lambda: EncoderWithState(batch_first), ["cpu"] * 3, x, torch.randn(2, 5, 6), torch.randn(2, 5, 6),
        transform_kwargs={"copy_replicas": True},
    )
    assert pm.input_dims == {"x": 0 if batch_first else 1, "h0": 1, "c0": 1}
    assert "x_whole" not in pm.code


def test_infer_input_dims_splits_lstm_root_state_tuple_on_dim_1():
    """An nn.LSTM root called with (h0, c0) as one argument matches eager."""
    state = (torch.randn(1, 5, 6), torch.randn(1, 5, 6))
    check_against_eager(lambda: nn.LSTM(8, 6), ["cpu"] * 3, torch.randn(4, 5, 8), state)
