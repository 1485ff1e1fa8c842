"""Random ops that draw the single-device values on every device (``exact_random=True``).

Each random site of the program draws its *whole* tensor once per call, from the default
generator, in program order: exactly what the single-device run draws there. Every device (a
data-parallel replica's rows, a tensor-parallel shard's columns, a micro-batch) takes its slice
of it, so the values match and the generator ends where the single-device run leaves it::

    draws = random_draws(x_scatter, 0)                   # once per call: the batch's split
    drop_dev0 = exact_dropout(draws, 'drop', relu_dev0, 0.1, True, rows=(0, 0))
    drop_dev1 = exact_dropout(draws, 'drop', relu_dev1, 0.1, True, rows=(1, 0))

``rows=(k, dim)``: the piece is the ``k``-th of the batch split, along ``dim``; ``cols=(k, dim,
sizes)``: the ``k``-th tensor-parallel shard along ``dim`` (counted from the end) of pieces
``sizes`` (or of the pieces' inputs' lengths: a sequence split, set by the call's own length);
``cols=(k, None, None)``: a replicated value, whole on each shard. The first piece to
reach a site draws for all: in a pipeline, micro-batch 0 (both schedules send it first).
The whole tensor is drawn where the first piece lives; on virtual devices that is the one device.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from dpcompile.errors import ArgumentError
from dpcompile.runtime.random_cuda import attention_kernel, attention_noise, dropout_of_ones

Rows = tuple[int, int | None] | None  # (piece, dim); dim None: rows not placed
Cols = tuple[int, int | None, Sequence[int] | None] | None


class RandomDraws:
    """One call's whole draws, by site, and the batch split (rows per device or micro-batch)."""

    def __init__(self, batch_sizes: Sequence[int] | None = None):
        self.batch_sizes = list(batch_sizes) if batch_sizes is not None else None
        self.drawn: dict[str, torch.Tensor] = {}
        self.generator_state: Callable[[], None] | None = None

    def piece(self, site: str, like: torch.Tensor, rows: Rows, cols: Cols,
              draw: Callable[[tuple[int, ...]], torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """The piece shaped as ``like`` of the whole tensor ``draw(whole shape)`` drawn at ``site``."""
        shape = list(like.shape)
        index: list[slice] = [slice(None)] * len(shape)
        if rows is not None:
            k, dim = self.rows_of(site, rows)
            if dim is None:
                if self.generator_state is not None:  # the refusal leaves the generator as the call found it
                    self.generator_state()
                raise ArgumentError(
                    f"exact_random=True over a mesh: the random op '{site}' draws on a value of the batch whose rows "
                    "this rank could not place when the program was built (an op the batch rules cannot split "
                    "without shapes, such as a written-out attention), so it would not draw eager's values: "
                    "transform with example_inputs= (this rank's local batch), or exact_random=False (each rank "
                    "draws its own)"
                )
            sizes = self._batch_sizes()
            per_row, rest = divmod(shape[dim], sizes[k]) if sizes[k] else (0, 1)
            if rest:
                raise ValueError(f"a piece of {shape[dim]} along dim {dim} is not a multiple of its {sizes[k]} rows")
            index[dim] = slice(per_row * sum(sizes[:k]), per_row * sum(sizes[: k + 1]))
            shape[dim] = per_row * sum(sizes)
        if cols is not None and cols[1] is not None:
            k, dim = cols[0], len(shape) + cols[1]
            sizes = [int(s.shape[dim]) if isinstance(s, torch.Tensor) else s for s in cols[2] or ()]
            if shape[dim] != sizes[k]:
                raise ValueError(f"shard {k} holds {shape[dim]} along dim {dim}, the plan says {sizes[k]}")
            index[dim] = slice(sum(sizes[:k]), sum(sizes[: k + 1]))
            shape[dim] = sum(sizes)
        whole = self.whole(site, tuple(shape), draw)
        piece = whole[tuple(index)] if any(s != slice(None) for s in index) else whole
        return piece.to(like.device)

    def rows_of(self, site: str, rows: tuple[int, int]) -> tuple[int, int]:
        """``(piece, dim)``: which piece of the batch split a site's value is, along which dim."""
        return rows

    def replay_state(self) -> Any:
        """What :meth:`replaying` needs to run a region's sites again as they first ran (a recompute in
        backward, ``runtime.checkpoint``): nothing here, where a site's piece depends on its call alone."""
        return None

    @contextlib.contextmanager
    def replaying(self, state: Any) -> Iterator[None]:
        """Within the block the sites give the pieces they gave after :meth:`replay_state` returned ``state``."""
        yield

    def whole(self, site: str, shape: tuple[int, ...], draw: Callable[[tuple[int, ...]], torch.Tensor]) -> torch.Tensor:
        """The whole tensor of ``site``: drawn by the first piece to reach it."""
        if site not in self.drawn:
            self.drawn[site] = draw(shape)
        return self.drawn[site]

    def _batch_sizes(self) -> list[int]:
        if self.batch_sizes is None:
            raise ValueError("a random site split by rows needs the batch's split: random_draws(scattered, dim)")
        return self.batch_sizes


def random_draws(scattered: Sequence[torch.Tensor] | None = None, dim: int = 0) -> RandomDraws:
    """A fresh record of one call's draws; ``scattered``: the pieces of a split input (their rows)."""
    pieces = list(scattered) if scattered is not None else []
    if not pieces or not all(isinstance(t, torch.Tensor) for t in pieces):
        return RandomDraws(None)  # an optional input left None: no rows to slice by (a site with rows says so)
    return RandomDraws([int(t.shape[dim]) for t in pieces])


def random_draws_over_ranks(local: torch.Tensor | None, dim: int, ranks: int, *, unplaced: bool = False) -> RandomDraws:
    """A fresh record of one call's draws on one rank of ``ranks`` data-parallel ranks: the global
    batch is the ranks' equal local batches in rank order (``local`` is this rank's, split on ``dim``).
    ``unplaced``: a site's rows are not placed; the generator's state is kept to restore if it draws."""
    if not isinstance(local, torch.Tensor):
        return RandomDraws(None)
    draws = RandomDraws([int(local.shape[dim])] * ranks)
    if unplaced:
        draws.generator_state = _generator_state(local.device)
    return draws


def _generator_state(device: torch.device) -> Callable[[], None]:
    """A function that puts ``device``'s default generator back where it is now."""
    if device.type == "cuda":
        state = torch.cuda.get_rng_state(device)
        return lambda: torch.cuda.set_rng_state(state, device)
    state = torch.get_rng_state()
    return lambda: torch.set_rng_state(state)


def empty_laid_out(like: torch.Tensor, dtype: torch.dtype | None = None) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """An empty whole tensor laid out as ``like`` is, as ``empty_like`` lays out eager's noise: a
    random fill runs in memory order, so a transposed input (``nn.MultiheadAttention``'s
    ``batch_first`` output, a permuted or channels-last activation) draws its values in another order."""
    order = _dim_order(like)

    def empty(shape: tuple[int, ...]) -> torch.Tensor:
        if order is None:
            return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)
        return torch.empty_permuted(shape, order, dtype=dtype or like.dtype, device=like.device)

    return empty


def _dim_order(like: torch.Tensor) -> list[int] | None:
    """``like``'s dims outermost first in memory (None: contiguous). Where a size-1 dim (a piece of
    one row) ties on stride with another dim, it is the inner one, as ``permute`` leaves it."""
    strides, sizes = like.stride(), like.shape
    order = sorted(range(like.dim()), key=lambda d: (-strides[d], sizes[d] == 1, d))
    return None if order == list(range(like.dim())) else order


def _dropout_noise(like: torch.Tensor, p: float) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """What dropout multiplies its input by, drawn as dropout draws it on this device: on CPU
    ``empty.bernoulli_(1 - p).div_(1 - p)``, the noise ``at::dropout`` draws (no tensor of ones to
    fill and multiply); elsewhere dropout of ones (on CUDA the fused kernel's mask and stream)."""
    if like.device.type == "cpu":
        keep = 1.0 - p
        return lambda shape: empty_laid_out(like)(shape).bernoulli_(keep).div_(keep)
    return dropout_of_ones(like, p)


def exact_dropout(draws: RandomDraws, site: str, x: torch.Tensor, p: Any = 0.5, training: bool = True,
                  inplace: bool = False, *, rows: Rows = None, cols: Cols = None) -> torch.Tensor:  # fmt: skip
    """``F.dropout(x, p, training)`` with this piece's slice of the single-device mask."""
    if not training or p == 0 or x.numel() == 0:
        return x
    if p == 1:
        return x.mul(torch.zeros((), dtype=x.dtype, device=x.device))
    return x * draws.piece(site, x, rows, cols, _dropout_noise(x, p))


def exact_dropout_module(module: torch.nn.Module, draws: RandomDraws, site: str, x: torch.Tensor, *,
                         rows: Rows = None, cols: Cols = None) -> torch.Tensor:  # fmt: skip
    """An ``nn.Dropout`` call, its ``p`` and mode read at run time: :func:`exact_dropout`."""
    return exact_dropout(draws, site, x, module.p, module.training, rows=rows, cols=cols)


def exact_native_dropout(draws: RandomDraws, site: str, x: torch.Tensor, p: float, train: bool | None, *,
                         rows: Rows = None, cols: Cols = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``aten.native_dropout`` (the export frontend's): ``x * mask * (1 / (1 - p))`` and the mask."""
    if not train or x.numel() == 0:
        return torch.ops.aten.native_dropout.default(x, p, train)
    keep = 1.0 - p
    mask = draws.piece(site, x, rows, cols, lambda shape: empty_laid_out(x)(shape).bernoulli_(keep))
    return x.mul(mask).mul_(0.0 if keep == 0 else 1.0 / keep), mask.bool()


LIKE_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "rand_like": torch.rand_like, "randn_like": torch.randn_like, "randint_like": torch.randint_like,
    "bernoulli": torch.bernoulli,
}  # fmt: skip


def exact_random_like(draws: RandomDraws, site: str, name: str, x: torch.Tensor, *args: Any, rows: Rows = None,
                      cols: Cols = None, **kwargs: Any) -> torch.Tensor:  # fmt: skip
    """``torch.<name>(x, *args, **kwargs)`` for a draw whose values ignore ``x``'s (``rand_like``,
    ``randn_like``, ``randint_like``, ``bernoulli(x, p)``): on the whole shape, this piece's slice."""
    fn = LIKE_FUNCTIONS[name]
    return draws.piece(site, x, rows, cols, lambda shape: fn(empty_laid_out(x)(shape), *args, **kwargs)).contiguous()


def exact_bernoulli(draws: RandomDraws, site: str, probs: torch.Tensor, *, rows: Rows = None,
                    cols: Cols = None) -> torch.Tensor:  # fmt: skip
    """``torch.bernoulli(probs)``: the CPU kernel compares one uniform draw per element with its probability."""
    uniform = draws.piece(site, probs, rows, cols, lambda shape: torch.rand(shape, dtype=probs.dtype, device=probs.device))
    return (uniform < probs).to(probs.dtype)


def exact_fill_random(draws: RandomDraws, site: str, method: str, x: torch.Tensor, *args: Any,
                      rows: Rows = None, cols: Cols = None, **kwargs: Any) -> torch.Tensor:  # fmt: skip
    """``x.normal_(...)``, ``x.uniform_(...)``, ``x.bernoulli_(p)``: the whole tensor filled, this piece copied in."""
    piece = draws.piece(site, x, rows, cols, lambda shape: getattr(empty_laid_out(x)(shape), method)(*args, **kwargs))
    with torch.no_grad():
        return x.copy_(piece)


def exact_attention(draws: RandomDraws, site: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                    scale: float | None = None, enable_gqa: bool = False, *, rows: Rows = None,
                    cols: Cols = None) -> torch.Tensor:  # fmt: skip
    """``F.scaled_dot_product_attention`` with ``dropout_p``: the math kernel (the one CPU runs with
    dropout) written out, its dropout this piece's slice of the single-device mask (on CUDA the mask
    of the kernel eager runs there: :mod:`dpcompile.runtime.random_cuda`)."""
    if not dropout_p:
        return F.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)  # fmt: skip
    kernel = attention_kernel(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    negative = scale is not None and scale < 0
    factor = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(query.size(-1)))
    q = query * (-factor if negative else factor)
    L, S = query.size(-2), key.size(-2)
    if is_causal:
        attn_mask = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        zero = torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device)
        attn_mask = torch.where(attn_mask.logical_not(), -math.inf, zero)
    if enable_gqa and key.size(-3) != query.size(-3):
        repeat = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    attn = torch.matmul(q, key.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn = attn + attn_mask
    attn = torch.ops.aten._safe_softmax(attn, -1)
    noise = attention_noise(site, kernel, attn, dropout_p, _dropout_noise(attn, dropout_p))
    attn = attn * draws.piece(site, attn, rows, cols, noise)
    return torch.matmul(attn, value)


__all__ = [
    "RandomDraws",
    "exact_attention",
    "exact_bernoulli",
    "exact_dropout",
    "exact_dropout_module",
    "exact_fill_random",
    "exact_native_dropout",
    "exact_random_like",
    "random_draws",
    "random_draws_over_ranks",
]
