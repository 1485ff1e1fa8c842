"""``forward(self, x, **kwargs)``: a keyword a call passes is an argument like any other, split
on its batch in data parallel, given whole to tensor parallel's shards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpcompile


class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, **kwargs):
        return self.fc(x) + kwargs["bias"]


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["data_parallel", "tensor_parallel"])
def test_keyword_arguments_forward_is_split_like_any_argument(tensor_parallel):
    torch.manual_seed(0)
    model, x, bias = Keywords(), torch.randn(6, 8), torch.randn(6, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=tensor_parallel, example_inputs=(x,), example_kwargs={"bias": bias})
    torch.testing.assert_close(pm(x, bias=bias), model(x, bias=bias))


class ScaledPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, *xs, scale=2.0):
        return self.fc(xs[0]) * scale + self.fc(xs[-1])


@pytest.mark.parametrize("with_examples", [False, True])
def test_keyword_only_argument_after_star_args_stays_keyword_only(with_examples):
    """fx put ``scale`` before ``*xs`` in the program's signature: without examples ``forward(self, scale=2.0,
    *xs)``, so ``pm(a, b, c)`` took ``a`` for ``scale`` (silently ``fc(b) * a + fc(c)``); with examples
    ``(self, scale=2.0, xs_0, xs_1)``, a SyntaxError at transform. It follows the variadic arguments."""
    torch.manual_seed(0)
    model, xs = ScaledPair(), [torch.randn(6, 8) for _ in range(3)]
    examples = tuple(xs) if with_examples else None
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="fx", example_inputs=examples)
    torch.testing.assert_close(pm(*xs), model(*xs))
    torch.testing.assert_close(pm(*xs, scale=0.5), model(*xs, scale=0.5))
