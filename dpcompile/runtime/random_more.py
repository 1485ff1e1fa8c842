"""More random ops drawing the single-device values: channel and alpha dropouts, ``torch.normal``
with tensor arguments, ``torch.multinomial`` without replacement (``exact_random=True``).

Each draws what the CPU kernel draws, on the whole shape, through the call's record
(:class:`~dpcompile.runtime.random.RandomDraws`), and finishes on its piece with the kernel's own
element-wise arithmetic:

- ``Dropout1d/2d/3d`` (``feature_dropout``): a ``bernoulli_(1 - p)`` mask of shape ``[N, C, 1, ...]``,
  broadcast over the rest (a tensor-parallel shard of a broadcast dim takes the whole mask);
- ``AlphaDropout`` / ``FeatureAlphaDropout``: the same mask (per element, or per channel), then
  ``x * mask * a + (mask - 1) * alpha * a + alpha * a * p``, as ``at::alpha_dropout``;
- ``torch.normal(mean, std)``: a standard normal fill, times ``std`` plus ``mean`` (zero gradient to
  both, as eager's);
- ``torch.multinomial(probs, n)`` without replacement (or ``n == 1``): an ``exponential_(1)`` fill
  ``q``, then ``argmax``/``topk`` of ``probs / q`` per row (the Gumbel trick the CPU kernel uses).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dpcompile.runtime.random import Cols, RandomDraws, Rows

_ALPHA = 1.7580993408473766  # at::alpha_dropout's alpha (SELU's scale * alpha)
FEATURE = {"dropout1d", "dropout2d", "dropout3d", "feature_alpha"}
ALPHA = {"alpha", "feature_alpha"}


def exact_special_dropout(draws: RandomDraws, site: str, variant: str, x: torch.Tensor, p: float = 0.5,
                          training: bool = True, inplace: bool = False, *, rows: Rows = None,
                          cols: Cols = None) -> torch.Tensor:  # fmt: skip
    """``F.<variant>(x, p, training)`` (``variant``: ``dropout1d``, ``dropout2d``, ``dropout3d``,
    ``alpha`` or ``feature_alpha``) with this piece's slice of the single-device mask."""
    if not training or p == 0 or x.numel() == 0:
        return x
    if p == 1:
        return x.mul(torch.zeros((), dtype=x.dtype, device=x.device))
    unbatched = (variant == "dropout1d" and x.dim() == 2) or (variant == "dropout3d" and x.dim() == 4)
    y = x.unsqueeze(0) if unbatched else x
    like = y[(slice(None), slice(None)) + (slice(0, 1),) * (y.dim() - 2)] if variant in FEATURE else y
    if variant in FEATURE and cols is not None and cols[1] is not None and like.dim() + cols[1] >= 2:
        cols = None  # a shard of a dim the mask broadcasts over: the whole mask, as every shard's
    keep = 1.0 - p
    mask = draws.piece(site, like, rows, cols,
                       lambda shape: torch.empty(shape, dtype=y.dtype, device=y.device).bernoulli_(keep))  # fmt: skip
    if variant in ALPHA:
        a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * keep)
        b = mask.add(-1).mul_(_ALPHA * a).add_(_ALPHA * a * p)
        out = y.mul(mask.mul(a)).add_(b)
    else:
        out = y.mul(mask.div(keep))
    return out.squeeze(0) if unbatched else out


def exact_special_dropout_module(module: torch.nn.Module, draws: RandomDraws, site: str, variant: str,
                                 x: torch.Tensor, *, rows: Rows = None, cols: Cols = None) -> torch.Tensor:  # fmt: skip
    """A ``Dropout1d/2d/3d``, ``AlphaDropout`` or ``FeatureAlphaDropout`` call, ``p`` and mode read at run time."""
    return exact_special_dropout(draws, site, variant, x, module.p, module.training, rows=rows, cols=cols)


def exact_normal(draws: RandomDraws, site: str, mean: torch.Tensor, std: torch.Tensor, *, rows: Rows = None,
                 cols: Cols = None) -> torch.Tensor:  # fmt: skip
    """``torch.normal(mean, std)`` with tensors: a standard normal fill of the whole broadcast shape,
    this piece's slice times ``std`` plus ``mean`` (as ``at::normal``)."""
    shape = torch.broadcast_shapes(mean.shape, std.shape)
    noise = draws.piece(site, mean.expand(shape), rows, cols,
                        lambda s: torch.empty(s, dtype=mean.dtype, device=mean.device).normal_(0, 1))  # fmt: skip
    with torch.no_grad():
        value = noise.clone().mul_(std).add_(mean)
    return _ZeroGradient.apply(value, mean, std)


class _ZeroGradient(torch.autograd.Function):
    """``value``, whose gradient to ``mean`` and ``std`` is zero, as ``torch.normal``'s backward says."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        ctx.mean_like, ctx.std_like = (mean.shape, mean.dtype, mean.device), (std.shape, std.dtype, std.device)
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        zeros = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in (ctx.mean_like, ctx.std_like)]
        return None, *zeros


def exact_multinomial(draws: RandomDraws, site: str, probs: torch.Tensor, num_samples: int,
                      replacement: bool = False, *, rows: Rows = None, cols: Cols = None) -> Any:  # fmt: skip
    """``torch.multinomial(probs, num_samples)`` without replacement (or one sample): the CPU kernel's
    ``exponential_(1)`` draw on the whole shape, then ``argmax``/``topk`` of ``probs / q`` on this piece."""
    if replacement and num_samples > 1:
        raise ValueError("multinomial with replacement draws per sample: it has no exact rule (exact_random=False)")
    if cols is not None and cols[1] is not None:
        raise ValueError("multinomial over a sharded class dim has no exact rule: leave its input whole")
    q = draws.piece(site, probs, rows, None,
                    lambda s: torch.empty(s, dtype=probs.dtype, device=probs.device).exponential_(1))  # fmt: skip
    ratio = probs / q
    if num_samples == 1:
        return ratio.argmax(-1, keepdim=True)
    return torch.topk(ratio, num_samples).indices


__all__ = ["exact_multinomial", "exact_normal", "exact_special_dropout", "exact_special_dropout_module"]
