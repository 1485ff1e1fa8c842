"""Random ops inside a module the program calls whole (an FSDP block), drawing the single-device values.

FSDP2 hooks each repeated block's forward, so the program calls the block as a module and its ops
are not nodes of the program. :func:`exact_random_scope` runs the call under a
``TorchFunctionMode`` that turns each random op the block runs (dropout, module or functional;
``scaled_dot_product_attention``'s ``dropout_p``; ``rand_like``, ``randn_like``) into the exact
runtime call, the ``i``-th of the call drawing site ``"<site>.<i>"``. Each is taken to hold the
batch on the block's batch dim (``rows``), as a transformer block's activations do::

    layers_0 = exact_random_scope(random_draws, 'layers_0', (1, 0), layers_0_module, h)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from dpcompile.runtime.random import RandomDraws, Rows, exact_attention, exact_dropout, exact_random_like

_LIKE = {torch.rand_like: "rand_like", torch.randn_like: "randn_like"}
_ATTENTION_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _ExactRandomMode(TorchFunctionMode):
    def __init__(self, draws: RandomDraws, site: str, rows: Rows):
        super().__init__()
        self.draws, self.site, self.rows = draws, site, rows
        self.count = 0

    def _next_site(self) -> str:
        self.count += 1
        return f"{self.site}.{self.count - 1}"

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout:
            bound = {**dict(zip(("input", "p", "training", "inplace"), args)), **kwargs}
            p, training = bound.get("p", 0.5), bound.get("training", True)
            if training and p:
                return exact_dropout(self.draws, self._next_site(), bound["input"], p, training, rows=self.rows)
        elif func is F.scaled_dot_product_attention:
            bound = {**dict(zip(_ATTENTION_NAMES, args)), **kwargs}
            if bound.get("dropout_p", 0.0):
                return exact_attention(self.draws, self._next_site(), **bound, rows=self.rows)
        elif func in _LIKE:
            return exact_random_like(self.draws, self._next_site(), _LIKE[func], *args, rows=self.rows, **kwargs)
        return func(*args, **kwargs)


def exact_random_scope(draws: RandomDraws, site: str, rows: Rows, module: torch.nn.Module, *args: Any,
                       **kwargs: Any) -> Any:  # fmt: skip
    """``module(*args, **kwargs)`` (its hooks run), each random op inside drawing its slice of the
    single-device values."""
    with _ExactRandomMode(draws, site, rows):
        return module(*args, **kwargs)


__all__ = ["exact_random_scope"]
