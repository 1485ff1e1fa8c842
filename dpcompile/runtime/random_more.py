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
  ``q``, then ``argmax``/``topk`` of ``probs / q`` per row (the Gumbel trick the CPU kernel uses);
  with replacement: a float64 uniform per sample and a binary search in the row's cumulative sum;
- ``torch.normal(mean, std, size)`` with floats: a ``normal_(mean, std)`` fill of the whole shape;
- ``torch.poisson(rates)``: sampled on the whole rates, joined from every device's piece;
- a random fill of an activation or of a view of it (``y[:, :4].normal_()``, functionalized as
  ``written``): the whole fill as eager fills it, this piece's slice written in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from dpcompile.runtime.random import Cols, RandomDraws, Rows, empty_laid_out

_ALPHA = 1.7580993408473766  # at::alpha_dropout's alpha (SELU's scale * alpha)
FEATURE = {"dropout1d", "dropout2d", "dropout3d", "feature_alpha"}
ALPHA = {"alpha", "feature_alpha"}


def stochastic_depth(input: torch.Tensor, p: float, mode: str, training: bool = True) -> torch.Tensor:
    """``torchvision.ops.stochastic_depth``, step for step (the same draws): what an exported
    program calls in its place, so that loading it needs neither torchvision nor a pickle."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"drop probability has to be between 0 and 1, but got {p}")
    if mode not in ("batch", "row"):
        raise ValueError(f"mode has to be either 'batch' or 'row', but got {mode}")
    if not training or p == 0.0:
        return input
    survival = 1.0 - p
    size = [input.shape[0]] + [1] * (input.ndim - 1) if mode == "row" else [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device).bernoulli_(survival)
    if survival > 0.0:
        noise.div_(survival)
    return input * noise


def exact_stochastic_depth(draws: RandomDraws, site: str, x: torch.Tensor, p: float, mode: str, training: bool = True,
                           *, rows: Rows = None, cols: Cols = None) -> torch.Tensor:  # fmt: skip
    """``torchvision.ops.stochastic_depth(x, p, mode, training)`` with this piece's rows of the
    single-device noise: ``bernoulli_(1 - p)`` of shape ``[N, 1, ...]`` (``"row"``) or ``[1, ...]``
    (``"batch"``), divided by ``1 - p``, as torchvision draws it; a shard's columns broadcast it."""
    if p < 0.0 or p > 1.0 or mode not in ("batch", "row"):
        raise ValueError(f"stochastic_depth: p must be in [0, 1] and mode 'batch' or 'row', got p={p}, mode={mode!r}")
    if not training or p == 0.0:
        return x
    survival = 1.0 - p
    like = x[(slice(None) if mode == "row" else slice(0, 1),) + (slice(0, 1),) * (x.dim() - 1)]
    noise = draws.piece(site, like, rows if mode == "row" else None, None,
                        lambda shape: torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(survival))  # fmt: skip
    return x * (noise.div(survival) if survival > 0.0 else noise)


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


def exact_written_fill(draws: RandomDraws, site: str, base: torch.Tensor, steps: Sequence[tuple[Any, tuple]],
                       method: str, *args: Any, rows: Rows = None, cols: Cols = None, **kwargs: Any) -> torch.Tensor:  # fmt: skip
    """``written(base, steps, method, *args)`` of a random fill (``y[:, :4].normal_()`` functionalized):
    ``base`` with this piece's slice of the whole fill written into its view, the gradient through
    the filled elements zero, as eager's. The whole is filled as eager fills it: the view of a
    whole-shaped tensor (its strides decide the CPU kernel's order), so a batch dim the view keeps
    at the tensor's index."""
    out = base.clone()
    view = _seen_through(out, steps)

    def whole_fill(shape: tuple[int, ...]) -> torch.Tensor:
        whole = list(base.shape)
        for dim, size in enumerate(shape):
            if size != view.shape[dim]:
                whole[dim] = size  # the split dims: the view keeps them whole, at the tensor's index
        filled = _seen_through(empty_laid_out(base)(tuple(whole)), steps)  # laid out as base: a fill runs in memory order
        return getattr(filled, method)(*args, **kwargs)

    piece = draws.piece(site, view, rows, cols, whole_fill)
    if not steps:
        piece = piece.contiguous()
        return _ZeroGradient.apply(piece, base) if base.requires_grad else piece
    view.copy_(piece)  # under autograd: CopySlices, a zero gradient through what the fill wrote
    return out


def _seen_through(tensor: torch.Tensor, steps: Sequence[tuple[Any, tuple]]) -> torch.Tensor:
    for step, step_args in steps:
        tensor = getattr(tensor, step)(*step_args) if isinstance(step, str) else step(tensor, *step_args)
    return tensor


class _ZeroGradient(torch.autograd.Function):
    """``value``, whose gradient to its inputs is zero, as ``torch.normal``'s and ``torch.poisson``'s
    backward say."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.likes = [(t.shape, t.dtype, t.device) for t in inputs]
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return None, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.likes)


def exact_multinomial(draws: RandomDraws, site: str, probs: torch.Tensor, num_samples: int,
                      replacement: bool = False, *, rows: Rows = None, cols: Cols = None) -> Any:  # fmt: skip
    """``torch.multinomial(probs, num_samples, replacement)`` as the CPU kernel draws it. Without
    replacement (or one sample): an ``exponential_(1)`` fill on the whole shape, then ``argmax``/``topk``
    of ``probs / q`` on this piece. With replacement: one float64 uniform per sample, row after row,
    on the whole ``[rows, num_samples]``, and each row's slot by binary search in its normalized
    cumulative sum (summed in ``probs``' dtype, element after element, as the kernel does)."""
    if cols is not None and cols[1] is not None:
        raise ValueError("multinomial over a sharded class dim has no exact rule: leave its input whole")
    if not replacement or num_samples == 1:
        q = draws.piece(site, probs, rows, None,
                        lambda s: torch.empty(s, dtype=probs.dtype, device=probs.device).exponential_(1))  # fmt: skip
        ratio = probs / q
        if num_samples == 1:
            return ratio.argmax(-1, keepdim=True)
        return torch.topk(ratio, num_samples).indices
    if probs.device.type != "cpu" or probs.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"multinomial with replacement is exact for float32/float64 on CPU, not {probs.dtype} on "
                         f"{probs.device.type}: pass exact_random=False to draw it per device")  # fmt: skip
    table = probs if probs.dim() > 1 else probs.unsqueeze(0)
    like = torch.empty((table.size(0), num_samples), dtype=torch.float64, device=probs.device)
    uniform = draws.piece(site, like, rows, None,
                          lambda s: torch.empty(s, dtype=torch.float64, device=probs.device).uniform_())  # fmt: skip
    with torch.no_grad():
        slots = torch.searchsorted(_normalized_cumsum(table).double(), uniform.contiguous())
    return slots if probs.dim() > 1 else slots.squeeze(0)


def _normalized_cumsum(table: torch.Tensor) -> torch.Tensor:
    """Each row's running sum over its last dim in the table's own dtype (``cumsum`` of float32
    accumulates in float64), divided by its total, the last slot 1: the CPU kernel's table."""
    if table.dtype == torch.float64:
        cum = table.cumsum(-1)
    else:
        running = torch.zeros(table.shape[:-1], dtype=table.dtype, device=table.device)
        columns = []
        for j in range(table.size(-1)):
            running = running + table[..., j]
            columns.append(running)
        cum = torch.stack(columns, -1)
    cum = cum / cum[..., -1:]
    cum[..., -1] = 1
    return cum


def exact_normal_size(draws: RandomDraws, site: str, mean: float, std: float, size: Any, *, rows: Rows = None,
                      cols: Cols = None, **options: Any) -> torch.Tensor:  # fmt: skip
    """``torch.normal(mean, std, size, dtype=, device=)`` with floats: the whole shape filled with
    ``normal_(mean, std)`` (as ``at::normal``), this piece's slice."""
    like = torch.empty(tuple(size), **options)
    piece = draws.piece(site, like, rows, cols, lambda s: torch.empty(s, **options).normal_(mean, std))
    return piece.contiguous() if not options.get("requires_grad") else piece.contiguous().requires_grad_()


def exact_poisson(draws: RandomDraws, site: str, rates: torch.Tensor, *, pieces: tuple[torch.Tensor, ...],
                  rows: Rows = None, cols: Cols = None) -> torch.Tensor:  # fmt: skip
    """``torch.poisson(rates)``: the number of draws depends on each rate, so the first piece to reach
    the site samples the *whole* rates (``pieces``: every device's, in order, joined along the split
    dim) and each piece takes its slice."""
    def whole(shape: tuple[int, ...]) -> torch.Tensor:
        dim = rows[1] if rows is not None else len(shape) + cols[1] if cols is not None and cols[1] is not None else 0
        joined = torch.cat([p.to(rates.device) for p in pieces], dim) if len(pieces) > 1 else pieces[0]
        if tuple(joined.shape) != tuple(shape):
            raise ValueError(f"poisson's pieces join to {tuple(joined.shape)}, the site's whole shape is {tuple(shape)}")
        return torch.poisson(joined.detach())

    value = draws.piece(site, rates, rows, cols, whole).contiguous()
    return _ZeroGradient.apply(value, rates) if rates.requires_grad else value


__all__ = ["exact_multinomial", "exact_stochastic_depth", "stochastic_depth", "exact_normal", "exact_normal_size", "exact_poisson", "exact_special_dropout",
           "exact_special_dropout_module", "exact_written_fill"]
