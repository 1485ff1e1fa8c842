"""Sequence parallelism's collectives over a ``torch.distributed`` group (``sequence_parallel=True``
over a ``DeviceMesh``), as one rank's generated code calls them.

Each rank holds its slice of the sequence between the tensor-parallel pairs: slice ``r`` of the
balanced split of the call's own length (``tensor_split``'s sizes: 13 over 2 ranks is 7, 6), so a
call may have another length than the example's. The generated code reads that length once, from
the first whole value that enters the sequence region (``sequence_length = x.size(1)``), and passes
it to the collectives that need every rank's size (the gathers):

==================================  ============================  ==============================
function                            forward                       backward
==================================  ============================  ==============================
``reduce_scatter``                  sum, keep this rank's slice   all-gather of the gradient
``reduce_scatter_by_all_reduce``    the same, as an all-reduce    all-gather of the gradient
                                    and this rank's slice (the
                                    gloo fallback, see below)
``all_gather_sequence``             all-gather (*f*)              reduce-scatter of the gradient
``gather_sequence``                 all-gather (an exit)          keep this rank's slice
``sequence_slice``                  keep this rank's slice        all-gather of the gradient
``linear_of_gathered``              a column layer on the         all-gathers the slice again
                                    all-gathered input, saving    (the whole input is not kept)
                                    only this rank's slice
==================================  ============================  ==============================

On gloo the lowering picks ``reduce_scatter_by_all_reduce``: gloo's own reduce-scatter (torch 2.13
has one) measured slower than an all-reduce and the rank's slice over 2 ranks of one machine
(``benchmarks/bench_sequence_parallel_mesh.py``: the fallback 0.69x to 0.96x of its time); nccl runs
``reduce_scatter``.

>>> y = reduce_scatter_by_all_reduce(fc2_partial, tp_group, 1)            # doctest: +SKIP
>>> x = all_gather_sequence(ln, tp_group, 1, sequence_length)             # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from dpcompile.runtime import kept
from dpcompile.runtime.distributed import (
    GroupLike,
    all_gather_into,
    all_reduce_grad,
    all_reduce_inplace,
    collective_failure,
    process_group,
    settle_deferred_check,
)

__all__ = [
    "all_gather_sequence",
    "balanced_sizes",
    "call_summing_grads",
    "gather_sequence",
    "linear_of_gathered",
    "reduce_scatter",
    "reduce_scatter_by_all_reduce",
    "sequence_sizes",
    "sequence_slice",
    "whole_size",
]


REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # reduce_scatter_tensor: deprecated in 2.13


def balanced_sizes(length: int, world: int) -> list[int]:
    """``tensor_split``'s sizes: ``13`` over 2 ranks is ``[7, 6]``.

    >>> balanced_sizes(13, 2)
    [7, 6]
    """
    return [length // world + (1 if k < length % world else 0) for k in range(world)]


def call_summing_grads(module: torch.nn.Module, group: GroupLike, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` on this rank's sequence slice, its parameters read through
    ``all_reduce_grad``: each rank's gradient is the sum over the ranks' slices (a norm's weight)."""
    params = {name: all_reduce_grad(p, group) for name, p in module.named_parameters() if p.requires_grad}
    return kept.functional_call(module, params, args, kwargs)


def sequence_sizes(length: int, group: GroupLike) -> list[int]:
    """Every rank's slice of a sequence of ``length`` (a random draw's pieces, ``exact_random``)."""
    return balanced_sizes(int(length), dist.get_world_size(process_group(group)))


def _slice(x: torch.Tensor, dim: int, sizes: Sequence[int], rank: int) -> torch.Tensor:
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank])


def _gather(x: torch.Tensor, group: Any, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Every rank's slice along ``dim`` concatenated (uneven slices padded to the largest, trimmed)."""
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, max(sizes) - x.size(dim)]
    padded = F.pad(x, pad).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    all_gather_into(parts, padded, group)
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes)], dim)


def _reduce_scatter(x: torch.Tensor, group: Any, dim: int, by_all_reduce: bool) -> torch.Tensor:
    """This rank's slice of the sum over ``group`` of ``x`` (whole along ``dim``)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = balanced_sizes(x.size(dim), world)
    if by_all_reduce:
        return _slice(all_reduce_inplace(x.clone(memory_format=torch.contiguous_format), group), dim, sizes, rank).clone()
    settle_deferred_check()
    largest = max(sizes)  # reduce_scatter_tensor takes equal chunks: each slice padded to the largest
    chunks = [F.pad(_slice(x, dim, sizes, k), [0, 0] * (x.dim() - 1 - dim) + [0, largest - sizes[k]]) for k in range(world)]
    flat = torch.stack(chunks).reshape(-1)  # rank k's chunk k-th, as reduce_scatter_tensor takes them
    out = flat.new_empty(chunks[0].numel())
    try:
        REDUCE_SCATTER(out, flat, group=group)
    except (RuntimeError, dist.DistError) as e:
        raise collective_failure("reduce_scatter", group, e) from e
    return out.view(chunks[0].shape).narrow(dim, 0, sizes[rank])


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx, x, group, dim, by_all_reduce):  # noqa: ANN001, ANN205
        ctx.group, ctx.dim, ctx.length = group, dim, x.size(dim)
        return _reduce_scatter(x, group, dim, by_all_reduce)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        sizes = balanced_sizes(ctx.length, dist.get_world_size(ctx.group))
        return _gather(grad, ctx.group, ctx.dim, sizes), None, None, None


class _AllGatherSequence(Function):
    @staticmethod
    def forward(ctx, x, group, dim, length, by_all_reduce):  # noqa: ANN001, ANN205
        ctx.group, ctx.dim, ctx.by_all_reduce = group, dim, by_all_reduce
        return _gather(x, group, dim, balanced_sizes(length, dist.get_world_size(group)))

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return _reduce_scatter(grad, ctx.group, ctx.dim, ctx.by_all_reduce), None, None, None, None


class _GatherSequence(Function):
    @staticmethod
    def forward(ctx, x, group, dim, length):  # noqa: ANN001, ANN205
        sizes = balanced_sizes(length, dist.get_world_size(group))
        ctx.dim, ctx.sizes, ctx.rank = dim, sizes, dist.get_rank(group)
        return _gather(x, group, dim, sizes)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return _slice(grad, ctx.dim, ctx.sizes, ctx.rank), None, None, None


class _SequenceSlice(Function):
    @staticmethod
    def forward(ctx, x, group, dim):  # noqa: ANN001, ANN205
        sizes = balanced_sizes(x.size(dim), dist.get_world_size(group))
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return _slice(x, dim, sizes, dist.get_rank(group)).clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return _gather(grad, ctx.group, ctx.dim, ctx.sizes), None, None


class _LinearOfGathered(Function):
    @staticmethod
    def forward(ctx, gathered, x, weight, bias, group, dim, length, transposed):  # noqa: ANN001, ANN205
        ctx.group, ctx.dim, ctx.transposed, ctx.has_bias = group, dim, transposed, bias is not None
        ctx.sizes = balanced_sizes(length, dist.get_world_size(group))
        ctx.save_for_backward(x, weight)
        if transposed:
            out = gathered @ weight
            return out if bias is None else out + bias
        return F.linear(gathered, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        whole = _gather(x, ctx.group, ctx.dim, ctx.sizes)  # gathered again, not saved
        grad_input = grad @ weight.t() if ctx.transposed else grad @ weight
        flat_grad, flat_in = grad.reshape(-1, grad.shape[-1]), whole.reshape(-1, whole.shape[-1])
        grad_weight = flat_in.t() @ flat_grad if ctx.transposed else flat_grad.t() @ flat_in
        grad_bias = flat_grad.sum(0) if ctx.has_bias else None
        return grad_input, None, grad_weight, grad_bias, None, None, None, None


def reduce_scatter(x: torch.Tensor, group: GroupLike, dim: int) -> torch.Tensor:
    """Sequence parallelism's *g* after a row layer: this rank's slice along ``dim`` of the sum of the
    ranks' partial results (``torch.distributed.reduce_scatter_tensor``). Backward: all-gather."""
    return _ReduceScatter.apply(x, process_group(group), dim % x.dim(), False)


def reduce_scatter_by_all_reduce(x: torch.Tensor, group: GroupLike, dim: int) -> torch.Tensor:
    """:func:`reduce_scatter` as an all-reduce of the whole partial result, of which this rank keeps its
    slice (twice a reduce-scatter's traffic): gloo's fallback, faster there than its own reduce-scatter."""
    return _ReduceScatter.apply(x, process_group(group), dim % x.dim(), True)


def all_gather_sequence(x: torch.Tensor, group: GroupLike, dim: int, length: int,
                        by_all_reduce: bool = False) -> torch.Tensor:  # fmt: skip
    """Sequence parallelism's *f* before a column layer: the whole sequence (``length``) on every rank
    from the slices each holds. Backward: reduce-scatter of the gradient (``by_all_reduce``: as
    :func:`reduce_scatter_by_all_reduce`)."""
    return _AllGatherSequence.apply(x, process_group(group), dim % x.dim(), int(length), by_all_reduce)


def gather_sequence(x: torch.Tensor, group: GroupLike, dim: int, length: int) -> torch.Tensor:
    """The whole sequence where a value leaves the region whole (an output, a shift of the labels);
    every rank then holds the same value, so backward keeps this rank's slice of the gradient."""
    return _GatherSequence.apply(x, process_group(group), dim % x.dim(), int(length))


def sequence_slice(x: torch.Tensor, group: GroupLike, dim: int) -> torch.Tensor:
    """This rank's slice of a whole (replicated) value along the sequence ``dim``, by its own length;
    backward all-gathers the gradient."""
    return _SequenceSlice.apply(x, process_group(group), dim % x.dim())


def linear_of_gathered(gathered: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       group: GroupLike, dim: int, length: int, transposed: bool = False) -> torch.Tensor:  # fmt: skip
    """A column layer on ``gathered`` (:func:`all_gather_sequence` of ``x``) that keeps ``x`` for backward,
    not ``gathered``, and all-gathers it again there (Megatron's sequence-parallel linear).
    ``transposed``: ``weight`` is ``(in, out)`` (transformers' Conv1D)."""
    return _LinearOfGathered.apply(gathered, x, weight, bias, process_group(group), dim % x.dim(), int(length), transposed)


def whole_size(x: torch.Tensor, dim: int, length: int, index: int | None = None) -> Any:
    """``x.size(index)`` (``x.shape`` where ``index`` is None) of the whole tensor whose sequence slice
    ``x`` is: its shape with ``length`` along ``dim``, read without gathering."""
    shape = list(x.shape)
    shape[dim % x.dim()] = int(length)
    return torch.Size(shape) if index is None else shape[index]
