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
