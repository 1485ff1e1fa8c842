"""Activation checkpointing in generated code: a region run so that backward recomputes it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint


def checkpoint(region: Callable[..., Any], *args: Any) -> Any:
    """``region(*args)``, saving only ``args`` for backward, which runs ``region`` again to get its
    activations; the RNG state is restored first, so dropout draws the same values.

    >>> import torch
    >>> x = torch.ones(2, requires_grad=True)
    >>> checkpoint(torch.sin, x).sum().backward(); x.grad.shape
    torch.Size([2])
    """
    if not torch.is_grad_enabled():
        return region(*args)
    return torch.utils.checkpoint.checkpoint(region, *args, use_reentrant=False, preserve_rng_state=True)


__all__ = ["checkpoint"]
