"""The collectives of a tensor-parallel SPMD program: what one shard's code calls.

``passes.tensor_parallel.shard_linear`` rewrites a captured graph into the program of *one*
shard (SPMD form). Every step that involves the other shards is a call to one of the
functions below; nothing else in the program communicates. Each is differentiable, and its
backward is the collective Megatron-LM pairs with it:

======================  ===========================  ===============================
call                    forward                      backward
======================  ===========================  ===============================
``copy_to_shards``      identity (Megatron's *f*)    all-reduce (sum) the gradient
``reduce_from_shards``  all-reduce (sum) (*g*)        identity
``gather_from_shards``  all-gather along ``dim``      keep this shard's slice
``split_to_shards``     keep this shard's slice       all-gather along ``dim``
``reduce_scatter_to_``  sum, keep this shard's slice  all-gather along ``dim``
``shards``              (sequence parallel's *g*)
``all_gather_to_``      all-gather along ``dim``,     reduce-scatter along ``dim``
``shards``              whole on every shard (*f*)
``local_size``          ``sizes[rank]`` (an int)      (not a tensor)
``local_offset``        ``sum(sizes[:rank])``         (not a tensor)
======================  ===========================  ===============================

Passes stamp these calls with ``dpcompile.infra.stamp_comm`` as follows (kinds ``identity``
and ``split`` move nothing; ``dpcompile.analysis.cost`` knows them):

======================  ====================================
``copy_to_shards``      ``Comm("identity", backward="all_reduce")``
``reduce_from_shards``  ``Comm("all_reduce")``
``gather_from_shards``  ``Comm("all_gather")``
``split_to_shards``     ``Comm("split", backward="all_gather")``
``reduce_scatter_...``  ``Comm("reduce_scatter", backward="all_gather")``
``all_gather_to_...``   ``Comm("all_gather", backward="reduce_scatter")``
======================  ====================================

``sizes`` lists every shard's extent along ``dim`` (``[4, 3, 3]`` for 10 features over 3
shards), so uneven shards are explicit in the program. ``dim`` may be negative.

Here the functions run over ``torch.distributed`` (``group`` defaults to the world group);
without an initialised process group they behave as a world of one rank (``sizes`` must
then have one entry). Two lowerings replace these targets:

* ``passes.tensor_parallel.expand_shards`` turns the SPMD program into single-process
  multi-device code, calling :mod:`dpcompile.runtime.tensor_parallel`;
* the SPMD (``DeviceMesh``) lowering may call these directly or swap in its own.

>>> import torch
>>> x = torch.ones(2, 3, requires_grad=True)
>>> copy_to_shards(x).sum().backward()   # a world of one: identity both ways
>>> x.grad
tensor([[1., 1., 1.],
        [1., 1., 1.]])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd import Function

__all__ = [
    "COLLECTIVES",
    "all_gather_to_shards",
    "copy_to_shards",
    "gather_from_shards",
    "local_offset",
    "linear_of_gathered",
    "local_size",
    "reduce_from_shards",
    "reduce_scatter_to_shards",
    "split_to_shards",
    "whole_size",
]


def _dist():
    import torch.distributed as dist

    return dist


def _world(group: Any = None) -> tuple[int, int]:
    """``(rank, world size)`` of ``group``; ``(0, 1)`` without an initialised process group."""
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _check_sizes(sizes: Sequence[int], world: int) -> None:
    if len(sizes) != world:
        raise ValueError(
            f"sizes {list(sizes)} name {len(sizes)} shards, but the process group has {world} rank(s)"
        )


def _offset(sizes: Sequence[int], rank: int) -> int:
    return sum(sizes[:rank])


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    _, world = _world(group)
    if world == 1:
        return t
    t = t.contiguous().clone()
    _dist().all_reduce(t, group=group)
    return t


def _all_gather(t: torch.Tensor, dim: int, sizes: Sequence[int], group: Any) -> torch.Tensor:
    rank, world = _world(group)
    _check_sizes(sizes, world)
    if world == 1:
        return t
    dim = dim % t.dim()
    largest = max(sizes)
    pad = [0, 0] * (t.dim() - dim - 1) + [0, largest - t.size(dim)]
    padded = torch.nn.functional.pad(t, pad).contiguous()  # all_gather needs equal sizes
    parts = [torch.empty_like(padded) for _ in range(world)]
    _dist().all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes)], dim)


def _own_slice(t: torch.Tensor, dim: int, sizes: Sequence[int], group: Any) -> torch.Tensor:
    rank, world = _world(group)
    _check_sizes(sizes, world)
    if t.size(dim) != sum(sizes):
        raise ValueError(f"cannot split dim {dim} of size {t.size(dim)} into shards {list(sizes)} (sum {sum(sizes)})")
    return t.narrow(dim, _offset(sizes, rank), sizes[rank])


class _CopyToShards(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromShards(Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromShards(Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, group):
        ctx.dim, ctx.sizes, ctx.group = dim, list(sizes), group
        return _all_gather(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.dim, ctx.sizes, ctx.group), None, None, None


class _SplitToShards(Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, group):
        ctx.dim, ctx.sizes, ctx.group = dim, list(sizes), group
        return _own_slice(x, dim, sizes, group).clone()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.sizes, ctx.group), None, None, None


class _ReduceScatterToShards(Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, group):
        ctx.dim, ctx.sizes, ctx.group = dim, list(sizes), group
        return _own_slice(_all_reduce(x, group), dim, sizes, group).clone()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.sizes, ctx.group), None, None, None


class _AllGatherToShards(Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, group):
        ctx.dim, ctx.sizes, ctx.group = dim, list(sizes), group
        return _all_gather(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(_all_reduce(grad, ctx.group), ctx.dim, ctx.sizes, ctx.group).clone(), None, None, None


def copy_to_shards(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Megatron's *f*, on the input of a column-parallel region.

    Forward: identity (every shard already holds the whole, replicated ``x``).
    Backward: all-reduce (sum) of the gradient, since each shard only sees the part of
    ``dL/dx`` that flows through its own columns.
    """
    return _CopyToShards.apply(x, group)


def reduce_from_shards(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Megatron's *g*, on the output of a row-parallel layer.

    Forward: all-reduce (sum) of the shards' partial sums, giving every shard the whole value.
    Backward: identity (the gradient of a replicated value is the same on every shard).
    """
    return _ReduceFromShards.apply(x, group)


def gather_from_shards(x: torch.Tensor, dim: int, sizes: Sequence[int], group: Any = None) -> torch.Tensor:
    """All-gather: concatenate every shard's slice along ``dim`` into the whole tensor.

    Forward: all-gather (uneven ``sizes`` are padded to the largest and trimmed).
    Backward: this shard keeps its own slice of the (replicated) gradient, no communication.
    """
    return _GatherFromShards.apply(x, dim, tuple(sizes), group)


def split_to_shards(x: torch.Tensor, dim: int, sizes: Sequence[int], group: Any = None) -> torch.Tensor:
    """Keep this shard's slice of a replicated tensor, e.g. the input of a row-parallel layer.

    Forward: ``x.narrow(dim, sum(sizes[:rank]), sizes[rank])``, no communication.
    Backward: all-gather of the gradient slices along ``dim``, so the replicated ``x``
    receives its whole gradient on every shard.
    """
    return _SplitToShards.apply(x, dim, tuple(sizes), group)


def reduce_scatter_to_shards(x: torch.Tensor, dim: int, sizes: Sequence[int], group: Any = None) -> torch.Tensor:
    """Sequence parallelism's *g*, on the output of a row-parallel layer: sum the shards' partial
    results and keep this shard's slice of the sum along ``dim`` (the sequence).

    Forward: reduce-scatter. Backward: all-gather of the gradient slices along ``dim``.
    """
    return _ReduceScatterToShards.apply(x, dim, tuple(sizes), group)


def all_gather_to_shards(x: torch.Tensor, dim: int, sizes: Sequence[int], group: Any = None) -> torch.Tensor:
    """Sequence parallelism's *f*, on the input of a column-parallel layer: every shard gets the
    whole tensor from the slices along ``dim`` (the sequence) each holds.

    Forward: all-gather. Backward: reduce-scatter (sum the shards' gradients, keep this slice).
    """
    return _AllGatherToShards.apply(x, dim, tuple(sizes), group)


class _LinearOfGathered(Function):
    @staticmethod
    def forward(ctx, gathered, x, weight, bias, dim, sizes, transposed, group):
        ctx.dim, ctx.sizes, ctx.transposed, ctx.group, ctx.has_bias = dim, list(sizes), transposed, group, bias is not None
        ctx.save_for_backward(x, weight)
        return _linear(gathered, weight, bias, transposed)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole = _all_gather(x, ctx.dim, ctx.sizes, ctx.group)  # gathered again, not saved
        grad_input = grad @ weight if not ctx.transposed else grad @ weight.t()
        flat_grad, flat_in = grad.reshape(-1, grad.shape[-1]), whole.reshape(-1, whole.shape[-1])
        grad_weight = flat_grad.t() @ flat_in if not ctx.transposed else flat_in.t() @ flat_grad
        grad_bias = flat_grad.sum(0) if ctx.has_bias else None
        return grad_input, None, grad_weight, grad_bias, None, None, None, None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    if not transposed:
        return torch.nn.functional.linear(x, weight, bias)
    out = x @ weight
    return out if bias is None else out + bias


def linear_of_gathered(
    gathered: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dim: int,
    sizes: Sequence[int], transposed: bool = False, group: Any = None,
) -> torch.Tensor:  # fmt: skip
    """A column layer on ``gathered`` (the all-gather of ``x``, this shard's sequence slice) that saves
    ``x`` for backward, not ``gathered``, and all-gathers it again there (Megatron's sequence parallel
    linear). ``transposed``: ``weight`` is ``(in, out)`` (transformers' Conv1D)."""
    return _LinearOfGathered.apply(gathered, x, weight, bias, dim, tuple(sizes), transposed, group)


def whole_size(x: torch.Tensor, dim: int, sizes: Sequence[int], index: int | None = None) -> Any:
    """``x.size(index)`` (``x.shape`` where ``index`` is None) of the whole tensor whose slices along
    ``dim`` the shards hold (``sizes``): ``x.shape`` read without gathering ``x``."""
    shape = list(x.shape)
    shape[dim % x.dim()] = sum(sizes)
    return torch.Size(shape) if index is None else shape[index]


def local_size(sizes: Sequence[int], group: Any = None) -> int:
    """This shard's extent of a sharded dimension: ``sizes[rank]``.

    Shape constants that depend on the sharded size (``view(b, t, heads, d)`` with the
    heads sharded) become ``view(b, t, local_size([2, 1]), d)``.
    """
    rank, world = _world(group)
    _check_sizes(sizes, world)
    return int(sizes[rank])


def local_offset(sizes: Sequence[int], group: Any = None) -> int:
    """Where this shard's slice of a sharded dimension starts: ``sum(sizes[:rank])`` (the first
    vocabulary row of a vocab-parallel embedding's shard)."""
    rank, world = _world(group)
    _check_sizes(sizes, world)
    return _offset(sizes, rank)


COLLECTIVES = (
    copy_to_shards, reduce_from_shards, gather_from_shards, split_to_shards, reduce_scatter_to_shards, all_gather_to_shards,
)
"""The tensor-valued collectives; ``local_size`` is a shape helper, not a collective."""
