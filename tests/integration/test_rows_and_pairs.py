"""Constructs where the batch dim holds more (or less) than one row per sample, and products of two batches.

* ``squeeze()`` without dims (mBART's ``shift_tokens_right``): a device's chunk of one sample
  keeps its batch dim;
* ``view(-1, ...)`` where a sample owns several rows (Swin's windows, ``(B * nW, ws, ws, C)``);
* ``a.T @ b`` (a partial sum over the batch) and ``a @ b.T`` (a ``B x B`` pairing: whole).

Each runs on a batch of 5 over 4 virtual devices (chunks of 2, 1, 1, 1): forward and every
gradient against eager, and what ``explain`` says runs whole.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile.runtime import squeeze_except
from tests.helpers import assert_weighted_gradients_equal

DEVICES = ["cpu"] * 4


class ShiftTokensRight(nn.Module):
    """mBART's ``shift_tokens_right``: the last non-pad token, ``gather``-ed and ``squeeze()``-d."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, labels):
        tokens = labels.clone()
        tokens.masked_fill_(tokens == -100, 1)
        eos = (tokens.ne(1).sum(dim=1) - 1).unsqueeze(-1)
        start = tokens.gather(1, eos).squeeze()
        tokens[:, 1:] = tokens[:, :-1].clone()
        tokens[:, 0] = start
        return self.fc(self.emb(tokens)) + self.emb(start).unsqueeze(1)  # (b, 1, 8): b is 1 on a device


def window_partition(x, ws):
    b, h, w, c = x.shape
    x = x.view(b, h // ws, ws, w // ws, ws, c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws, ws, c)


def window_reverse(windows, ws, h, w):
    c = windows.shape[-1]
    x = windows.view(-1, h // ws, w // ws, ws, ws, c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, h, w, c)


class ShiftedWindows(nn.Module):
    """timm's Swin block: cyclic shift, windows of ``(B * nW, ws * ws, C)``, attention with a
    per-window mask added through ``view(-1, nW, heads, N, N)``, windows put back."""

    def __init__(self, ws=2, size=4, heads=2, c=8):
        super().__init__()
        self.ws, self.heads = ws, heads
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        nw, n = (size // ws) ** 2, ws * ws
        self.register_buffer("mask", torch.randn(nw, n, n))

    def forward(self, x):
        b, h, w, c = x.shape
        shifted = torch.roll(x, shifts=(-1, -1), dims=(1, 2))
        windows = window_partition(shifted, self.ws).view(-1, self.ws * self.ws, c)
        bw, n, _ = windows.shape
        q, k, v = self.qkv(windows).reshape(bw, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        attn = q @ k.transpose(-2, -1)
        nw = self.mask.shape[0]
        attn = attn.view(-1, nw, self.heads, n, n) + self.mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, self.heads, n, n).softmax(-1)
        out = self.proj((attn @ v).transpose(1, 2).reshape(bw, n, -1))
        out = window_reverse(out.view(-1, self.ws, self.ws, c), self.ws, h, w)
        return torch.roll(out, shifts=(1, 1), dims=(1, 2)) + x


class WindowsOfTwoSamples(nn.Module):
    """``view(-1, 5, ...)`` of ``(B * 4, ...)`` windows: a row holds windows of two samples."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        windows = window_partition(self.fc(x), 2)  # (B * 4, 2, 2, 8)
        return windows.reshape(-1, 5, 2, 2, 8).sum(1)


class GramOverBatch(nn.Module):
    """``a.T @ b``: a cross-covariance over the batch, a sum over samples."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        return self.a(x).T @ self.b(x)


class ContrastiveLogits(nn.Module):
    """CLIP's loss: ``text @ image.T`` logits (``B x B``) against ``arange(B)`` labels."""

    def __init__(self):
        super().__init__()
        self.t = nn.Linear(6, 8)
        self.i = nn.Linear(5, 8)

    def forward(self, text, image):
        a, b = F.normalize(self.t(text), dim=-1), F.normalize(self.i(image), dim=-1)
        logits = 2.0 * a @ b.T
        labels = torch.arange(text.shape[0], device=text.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _inputs(name: str, b: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(b)
    if name == "shift_tokens_right":
        labels = torch.randint(2, 20, (b, 6), generator=g)
        labels[0, 4:] = -100
        return (labels,)
    if name in ("shifted_windows", "windows_of_two_samples"):
        return (torch.randn(b, 4, 4, 8, generator=g),)
    if name == "gram_over_batch":
        return (torch.randn(b, 6, generator=g),)
    return (torch.randn(b, 6, generator=g), torch.randn(b, 5, generator=g))


CASES = {
    "shift_tokens_right": ShiftTokensRight,
    "shifted_windows": ShiftedWindows,
    "windows_of_two_samples": WindowsOfTwoSamples,
    "gram_over_batch": GramOverBatch,
    "contrastive_logits": ContrastiveLogits,
}
# what runs whole (``explain``'s reason, by its start), besides values recomputed on the gathered batch
WHOLE = {"windows_of_two_samples": "view(-1, 5, 2, 2, 8) groups rows", "contrastive_logits": "a @ b.T of two batches"}
RUNS = [(name, "fx") for name in CASES] + [(name, "export") for name in ("shift_tokens_right", "shifted_windows")]


@pytest.mark.parametrize(("name", "frontend"), RUNS)
def test_runs_split_where_it_can_and_equals_eager(name, frontend):
    torch.manual_seed(0)
    model = CASES[name]()
    eager = copy.deepcopy(model)
    example = _inputs(name, 10 if name == "windows_of_two_samples" else 4)  # 5 windows: 4B of them
    pm = dpcompile.transform(model, DEVICES, frontend=frontend, example_inputs=example)
    inputs = _inputs(name, 5)  # chunks of 2, 1, 1, 1
    out, expected = pm(*inputs), eager(*inputs)
    torch.testing.assert_close(out, expected)
    assert_weighted_gradients_equal(model, eager, out, expected)
    report = dpcompile.explain(pm, *inputs)
    whole = [w for w in report.whole if not w["reason"].startswith(("recomputed", "its input"))]
    if name in WHOLE:
        assert [w["reason"][: len(WHOLE[name])] for w in whole] == [WHOLE[name]]
    else:
        assert whole == []
        assert report.split_flop_fraction in (None, 1.0)


def test_gram_over_batch_is_a_partial_sum():
    pm = dpcompile.transform(GramOverBatch(), DEVICES, example_inputs=_inputs("gram_over_batch", 4))
    code = pm.code
    assert "matmul_dev3 = " in code and "dpcompile_runtime_reduce_add" in code


def test_squeeze_runs_whole_where_the_example_batch_is_one():
    """With a batch of one, ``squeeze()`` drops the batch dim: the example cannot tell it survives."""
    model = ShiftTokensRight()
    pm = dpcompile.transform(model, DEVICES, example_inputs=_inputs("shift_tokens_right", 1))
    inputs = _inputs("shift_tokens_right", 5)
    torch.testing.assert_close(pm(*inputs), model(*inputs))
    assert any(w["node"] == "squeeze" for w in dpcompile.explain(pm, *inputs).whole)


def test_squeeze_except_keeps_the_batch_dim():
    assert squeeze_except(torch.zeros(1, 1, 3, 1), 0).shape == (1, 3)
    assert squeeze_except(torch.zeros(2, 1), 1).shape == (2, 1)
