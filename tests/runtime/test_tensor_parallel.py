"""The single-process tensor-parallel runtime (:mod:`dpcompile.runtime.tensor_parallel`)."""

from __future__ import annotations

import torch

from dpcompile.runtime import tensor_parallel as tp_runtime


def test_runtime_copy_to_devices_backward_sums_the_shards_gradients():
    """f's single-process form: the input's gradient is the sum over the copies (the all-reduce)."""
    x = torch.ones(2, requires_grad=True)
    a, b = tp_runtime.copy_to_devices(x, ["cpu", "cpu"])
    (2 * a + 3 * b).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2,), 5.0))


def test_runtime_split_and_gather_are_inverse_with_uneven_sizes():
    """Splitting 10 columns 4/3/3 and gathering them gives the tensor back."""
    x = torch.randn(2, 10)
    parts = tp_runtime.split_to_devices(x, -1, [4, 3, 3], ["cpu"] * 3)
    assert [p.shape[-1] for p in parts] == [4, 3, 3]
    torch.testing.assert_close(tp_runtime.gather_to_device(parts, -1, "cpu"), x)
