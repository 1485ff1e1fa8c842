"""Whether a user's ``torch.autograd.Function`` differentiates as its own backward does.

torch.export traces through a Function's forward and drops its backward: the program differentiates
the forward's ops. That is eager's gradient only where the backward is the forward's derivative (BLOOM's
``GeLUFunction``); a straight-through estimator (``round`` forward, identity backward) or a gradient
reversal (``-grad``) would train with other gradients, silently::

    class STE(torch.autograd.Function):          # eager: d/dx = 1
        forward = staticmethod(lambda ctx, x: torch.round(x))
        backward = staticmethod(lambda ctx, g: g)  # exported: d round(x)/dx = 0

:func:`backward_departs` runs the Function once on random values of the shapes it was applied to at
capture, both ways (its backward, autograd through its forward), and compares the gradients.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArgumentSpec:
    """One argument of a Function's application: a tensor's shape, dtype and whether it needs a
    gradient, or a Python value as it was."""

    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    requires_grad: bool = False
    value: Any = None

    @classmethod
    def of(cls, value: Any) -> ArgumentSpec | None:
        """The spec of ``value`` (a fake tensor under export: its sizes' hints); None where a size has none."""
        if not isinstance(value, torch.Tensor):
            return cls(value=value)
        sizes = [d if isinstance(d, int) else getattr(getattr(d, "node", None), "hint", None) for d in value.shape]
        if any(s is None for s in sizes):
            return None
        return cls(tuple(int(s) for s in sizes), value.dtype, bool(value.requires_grad))


class _Context:
    """What an old-style ``forward(ctx, ...)`` may call on its context, run outside autograd's."""

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *args: Any) -> None:
        pass

    def mark_dirty(self, *args: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def backward_departs(function: type, specs: Sequence[ArgumentSpec], atol: float = 1e-4, rtol: float = 1e-3) -> bool:
    """Whether ``function``'s backward gives other gradients than autograd through its forward, on one
    random draw of ``specs`` (False where it cannot be told: the probe fails, or nothing needs a gradient)."""
    from torch.utils._python_dispatch import _disable_current_modes

    try:  # the caller's random state as it was; a forward that draws (a dropout mask) draws alike both ways
        with torch.random.fork_rng(devices=[]), _disable_current_modes(), torch.enable_grad():
            generator = torch.Generator().manual_seed(0)
            values = [(_draw(spec, generator), spec.requires_grad) for spec in specs]
            torch.manual_seed(0)
            custom = _gradients(function.apply, values)
            if custom is None:
                return False
            new_style = function.setup_context is not torch.autograd.Function.setup_context
            forward = function.forward if new_style else (lambda *args: function.forward(_Context(), *args))
            torch.manual_seed(0)
            plain = _gradients(forward, values, zeros_where_none=True)
    except Exception as e:  # noqa: BLE001 - a Function the probe cannot run: left as it was before
        log.debug("no gradient probe of %s (%s)", function.__qualname__, e)
        return False
    return plain is not None and any(
        not torch.allclose(a, b, atol=atol, rtol=rtol) for a, b in zip(custom, plain, strict=True)
    )


def _draw(spec: ArgumentSpec, generator: torch.Generator) -> Any:
    if spec.shape is None:
        return spec.value
    if spec.dtype is not None and (spec.dtype.is_floating_point or spec.dtype.is_complex):
        return torch.randn(spec.shape, generator=generator, dtype=spec.dtype)
    return torch.zeros(spec.shape, dtype=spec.dtype)


def _gradients(call: Any, values: list[tuple[Any, bool]], zeros_where_none: bool = False) -> list[torch.Tensor] | None:
    """The gradients of ``sum(out * weight)`` (weights drawn from a generator seeded anew, so both ways
    draw the same) with respect to the tensor arguments that needed one at capture."""
    leaves = [v.clone().requires_grad_(needs and v.is_floating_point()) if isinstance(v, torch.Tensor) else v for v, needs in values]
    inputs = [v for v in leaves if isinstance(v, torch.Tensor) and v.requires_grad]
    out = call(*leaves)
    outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.is_floating_point()]
    weights = torch.Generator().manual_seed(1)
    terms = [(o * torch.randn(o.shape, generator=weights, dtype=o.dtype)).sum() for o in outs]
    differentiable = [t for t in terms if t.requires_grad]
    if not inputs or not terms:
        return None
    if not differentiable:
        return [torch.zeros_like(i) for i in inputs] if zeros_where_none else None
    grads = torch.autograd.grad(sum(differentiable), inputs, allow_unused=True)
    return [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, grads, strict=True)]
