"""Review findings on data-parallel semantics: batch dims, inputs, modes, against eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import check_against_eager


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


class CausalSelfAttention(nn.Module):
    """nanoGPT's causal mask: a buffer sliced by the sequence length read from the input."""

    def __init__(self, d: int = 8, block: int = 6):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, block, block))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        att = (q @ k.transpose(-2, -1)) * C**-0.5
        att = att.masked_fill(self.bias[:, :T, :T] == 0, float("-inf"))
        return torch.softmax(att, dim=-1) @ v


def test_capture_traces_buffer_sliced_by_input_size():
    """A causal-mask buffer sliced with x.size() traces and matches eager on uneven splits."""
    check_against_eager(CausalSelfAttention, ["cpu"] * 4, torch.randn(9, 5, 8), transform_kwargs={"copy_replicas": True})


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


class CellLoop(nn.Module):
    """A hand-rolled recurrence whose state starts as torch.zeros(x.size(0), hidden)."""

    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(4, 6)
        self.fc = nn.Linear(6, 2)

    def forward(self, x):
        h = torch.zeros(x.size(0), 6, device=x.device)
        for t in range(3):
            h = self.cell(x[:, t], h)
        return self.fc(h)


def test_capture_traces_size_factory_with_batch_size_first():
    """torch.zeros(x.size(0), 6) traces (fx alone refuses it) and the model matches eager."""
    check_against_eager(CellLoop, ["cpu"] * 3, torch.randn(7, 3, 4), transform_kwargs={"copy_replicas": True})


class LSTMCellLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(4, 6)
        self.fc = nn.Linear(6, 2)

    def forward(self, x, h0, c0):
        state = (h0, c0)
        for t in range(3):
            state = self.cell(x[:, t], state)
        return self.fc(state[0]), state[1]


@pytest.mark.parametrize("make, extra", [(CellLoop, 0), (LSTMCellLoop, 2)], ids=["gru_cell", "lstm_cell"])
def test_batch_rules_rnn_cells_run_per_device(make, extra):
    """RNN cells run on each device's chunk (input and state split on dim 0), matching eager."""
    states = [torch.randn(7, 6) for _ in range(extra)]
    pm = check_against_eager(make, ["cpu"] * 3, torch.randn(7, 3, 4), *states, transform_kwargs={"copy_replicas": True})
    assert "cell_2_dev2" in pm.code and "gather" not in pm.code.split("cell_2_dev2")[0]


def test_batch_rules_instance_norm_with_running_stats_updates_them_once():
    """InstanceNorm(track_running_stats=True) ends with eager's running statistics (one update, whole batch)."""
    check_against_eager(
        lambda: nn.Sequential(nn.Conv1d(3, 4, 3), nn.InstanceNorm1d(4, track_running_stats=True)),
        ["cpu"] * 3, torch.randn(7, 3, 8),
    )


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
