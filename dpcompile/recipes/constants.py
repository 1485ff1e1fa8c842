"""Tensor constants of a program traced on fake tensors (a model built on ``meta``).

A forward that makes a tensor from Python data (``torch.tensor([0.5, 2.0])``, a scale table;
``torch.arange(4)``, ``torch.ones(3)`` of constant sizes) gives the captured program a constant: fx records the value the call returned, torch.export
lifts it. On fake tensors that value would be fake, so the program would hold garbage once
allocated, and no checkpoint holds it. :class:`RealConstants` makes such calls return real
tensors while tracing; :func:`deepcopy_on_fake` copies a program holding them under a fake mode.

>>> from torch._subclasses.fake_tensor import FakeTensorMode
>>> with FakeTensorMode(), RealConstants():
...     table = torch.tensor([0.5, 2.0])
>>> table
tensor([0.5000, 2.0000])
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

#: the calls that make a tensor from Python data and sizes (not from another tensor)
DATA_FACTORIES = frozenset({
    torch.tensor, torch.as_tensor, torch.asarray, torch.scalar_tensor, torch.arange, torch.linspace, torch.logspace,
    torch.zeros, torch.ones, torch.full, torch.eye, torch.tril_indices, torch.triu_indices,
})  # fmt: skip

T = TypeVar("T")


class RealConstants(TorchFunctionMode):
    """While on: a tensor made from Python data is real (not fake), on the device asked for, and
    so is what is computed from such tensors alone (``table[1]``, which fx records too).

    Where the device cannot hold a real tensor (fake CUDA on a CPU machine, a layout to
    inspect), the call runs as it would have (fake)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
        made = func in DATA_FACTORIES and not tensors
        if any(isinstance(a, fx.Proxy) for a in leaves):
            made = False  # traced, not computed
        elif tensors and not any(is_fake(t) or t.is_meta for t in tensors):
            made = True  # computed from constants only (`table[1]`): a constant too
        if made:
            try:
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
            except (RuntimeError, AssertionError):  # a device this machine lacks: a fake layout
                pass
        return func(*args, **kwargs)


def deepcopy_on_fake(model: T) -> T:
    """``copy.deepcopy(model)`` where ``model`` may hold real tensors (constants) beside fake ones
    and a fake mode may be on: the real ones are copied with the mode off (a fake mode cannot
    copy a real tensor's storage), the fake ones stay in their own mode (not a copy of it). An
    exported program's lifted constants stay out of its state dict."""
    memo: dict[int, Any] = {}
    if isinstance(model, torch.nn.Module):
        with unset_fake_temporarily():
            for module in model.modules():
                held = [*vars(module).values(), *module._parameters.values(), *module._buffers.values()]
                for value in held:
                    mode = getattr(value, "fake_mode", None) if is_fake(value) else None
                    if mode is not None:  # the copy's fake tensors stay in their mode (deepcopy would copy it)
                        memo[id(mode)] = mode
                for value in list(vars(module).values()) + list(module._buffers.values()):
                    if isinstance(value, torch.Tensor) and not is_fake(value) and not value.is_meta:
                        # a weight torch.nn.utils.weight_norm's hook computed (not a leaf): the copy's hook computes its own
                        memo[id(value)] = copy.deepcopy(value) if value.grad_fn is None else value.detach().clone()
    copied = copy.deepcopy(model, memo)
    if isinstance(model, fx.GraphModule):  # its deepcopy rebuilds the root and forgets which buffers do not persist
        copied._non_persistent_buffers_set = set(model._non_persistent_buffers_set)
    return copied


__all__ = ["DATA_FACTORIES", "RealConstants", "deepcopy_on_fake"]
