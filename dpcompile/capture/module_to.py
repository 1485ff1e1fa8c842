"""``module.to(...)`` inside forward, where it changes nothing, while torch.export runs.

Switch Transformers' router runs ``self.classifier = self.classifier.to(self.dtype)`` at every call:
a no-op on a model already in that dtype, but under torch.export the parameters are fake tensors
that ``Module._apply`` cannot swap ("Couldn't swap Linear.weight"), so the model could not be
captured at all. While export runs, a ``to`` that would leave every parameter and buffer as it
is returns the module untouched, as eager's conversion does in effect; one that converts
something still runs (and fails as before: the program would not convert the model's weights).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch import nn


def changes_nothing(module: nn.Module, *args: Any, **kwargs: Any) -> bool:
    """Whether ``module.to(*args, **kwargs)`` would leave every parameter and buffer as it is."""
    device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if memory_format is not None:
        return False
    for tensor in (*module.parameters(), *module.buffers()):
        if device is not None and tensor.device != device:
            return False
        if dtype is not None and (tensor.is_floating_point() or tensor.is_complex()) and tensor.dtype != dtype:
            return False
    return True


@contextlib.contextmanager
def unchanged_module_to() -> Iterator[None]:
    """While in it, ``nn.Module.to`` returns the module itself where it would change nothing."""
    original = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        if changes_nothing(self, *args, **kwargs):
            return self
        return original(self, *args, **kwargs)

    with mock.patch.object(nn.Module, "to", to):
        yield
