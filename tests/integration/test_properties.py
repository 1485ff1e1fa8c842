"""Property tests: random small models, batch sizes and device counts equal eager."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import dpcompile
from tests.helpers import assert_same_outputs, scalar_of

LAYER_KINDS = ["linear", "relu", "tanh", "layernorm", "residual", "gelu", "softmax", "batchnorm"]


class RandomNet(nn.Module):
    def __init__(self, kinds: list[str], width: int, reduce: str):
        super().__init__()
        self.kinds = kinds
        self.reduce = reduce
        self.layers = nn.ModuleList()
        for kind in kinds:
            if kind == "linear":
                self.layers.append(nn.Linear(width, width))
            elif kind == "layernorm":
                self.layers.append(nn.LayerNorm(width))
            elif kind == "residual":
                self.layers.append(nn.Sequential(nn.Linear(width, width), nn.ReLU()))
            elif kind == "batchnorm":
                self.layers.append(nn.BatchNorm1d(width))
            else:
                self.layers.append(nn.Identity())

    def forward(self, x):
        for kind, layer in zip(self.kinds, self.layers):
            if kind == "relu":
                x = F.relu(x)
            elif kind == "tanh":
                x = torch.tanh(x)
            elif kind == "gelu":
                x = F.gelu(x)
            elif kind == "softmax":
                x = torch.softmax(x, dim=-1)
            elif kind == "residual":
                x = x + layer(x)
            else:
                x = layer(x)
        if self.reduce == "mean":
            return x, x.mean()
        if self.reduce == "sum":
            return x.sum(dim=0), x
        return x


@given(
    kinds=st.lists(st.sampled_from(LAYER_KINDS), min_size=1, max_size=5),
    width=st.integers(2, 6),
    batch=st.integers(2, 11),
    n_devices=st.integers(1, 4),
    reduce=st.sampled_from(["none", "mean", "sum"]),
    real_replicas=st.booleans(),
)
def test_random_models_match_eager(kinds, width, batch, n_devices, reduce, real_replicas):
    """Any stack of supported layers gives eager's outputs, gradients and buffers."""
    torch.manual_seed(len(kinds) * 100 + width)
    model = RandomNet(kinds, width, reduce)
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * n_devices, copy_replicas=real_replicas)
    x = torch.randn(batch, width)
    got, want = pm(x), reference(x)
    assert_same_outputs(got, want, atol=1e-4, rtol=1e-4)
    got_scalar, want_scalar = scalar_of(got), scalar_of(want)
    assert got_scalar.requires_grad == want_scalar.requires_grad
    if want_scalar.requires_grad:  # models of activations only have nothing to differentiate
        got_scalar.backward()
        want_scalar.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    for (name, b), (_, c) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(b, c, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
