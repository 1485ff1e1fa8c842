"""Leave a module's tensors as they were: the objects in every parameter and buffer slot, and grads.

``torch.func.functional_call`` swaps the given tensors into a module and back by name, and a
module reached under two names (a tied weight's parametrization, a block used twice) is swapped
twice, so the second swap takes the first's stand-in for the original and puts it back at the
end: a fake tensor left as the model's parameter. :func:`functional_call` keeps every slot.

Before::

    torch.func.functional_call(pm, fake_state, args)   # pm.lm_head.parametrizations.weight.original0: FakeTensor

After::

    functional_call(pm, fake_state, args)              # the Parameter it was
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["functional_call", "tensors_kept"]

_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


@contextlib.contextmanager
def tensors_kept(*roots: nn.Module) -> Iterator[None]:
    """Within: anything may be swapped into the modules under ``roots``. After (also on an error):
    each module's parameter and buffer slots hold the objects they held, each parameter its grad,
    each module the forward and backward hooks it had."""
    modules = list({id(m): m for root in roots for m in root.modules()}.values())
    slots = [(m, kind, dict(getattr(m, kind))) for m in modules for kind in ("_parameters", "_buffers", *_HOOKS)]
    grads = [(p, p.grad) for _, kind, held in slots if kind == "_parameters" for p in held.values() if p is not None]
    try:
        yield
    finally:
        for module, kind, held in slots:
            now = getattr(module, kind)
            if now.keys() != held.keys() or any(now[k] is not v for k, v in held.items()):
                now.clear()
                now.update(held)
        for p, grad in grads:
            if p.grad is not grad:
                p.grad = grad


def functional_call(module: nn.Module, state: Mapping[str, Any], args: Any = (), kwargs: Any = None) -> Any:
    """``torch.func.functional_call(module, state, args, kwargs)`` that leaves ``module`` as it was,
    also where a submodule is reached under two names. A module without children (a norm called
    at every step) is called directly: it has one name, so nothing to keep."""
    if not module._modules:
        return torch.func.functional_call(module, state, args, kwargs)
    with tensors_kept(module):
        return torch.func.functional_call(module, state, args, kwargs)
