"""Collectives over ``torch.distributed`` process groups, as SPMD generated code calls them.

Each process runs one shard (tensor parallel) or one part of the batch (data parallel) of
the program; these functions are the points where processes talk. Every one is an autograd
``Function`` whose backward is the collective that autograd needs, so the generated code
trains like the single-process model:

=====================  ==========================  ===============================
function               forward                     backward
=====================  ==========================  ===============================
``all_reduce``         sum over the group (g)      identity
``all_reduce_grad``    identity (f)                sum of the gradient (all-reduce)
``all_gather``         concatenate shards          keep this rank's slice
``local_slice``        keep this rank's slice      all-gather of the gradient
``sum_across``         sum over the group          sum over the group
``sync_batch_norm``    BatchNorm with statistics   exact gradients of the whole
                       of the whole batch          batch (via ``sum_across``)
=====================  ==========================  ===============================

``all_reduce`` / ``all_reduce_grad`` are Megatron-LM's ``g`` / ``f``: they assume that what
follows ``all_reduce`` (and what precedes ``all_reduce_grad``) is replicated — every rank
holds the same value and so the same gradient. They are the process-group lowering of
:mod:`dpcompile.runtime.collectives` (``reduce_from_shards``, ``copy_to_shards``,
``gather_from_shards``, ``split_to_shards``, ``local_size``). ``sum_across`` is the plain sum of per-rank
values, each rank holding its own loss (data parallel).

Generated code refers to a group through a :class:`MeshGroup` submodule of the program, so
it reads ``dpcompile_runtime_distributed_all_reduce(fc2, tp_group)``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.autograd import Function

from dpcompile.errors import DpCompileError, first_line
from dpcompile.runtime import kept
from dpcompile.runtime.rank_device import group_device
from dpcompile.runtime.sequence import causal_attention

__all__ = [
    "CollectiveError",
    "MeshGroup",
    "collective_failure",
    "defer_to_next_collective",
    "settle_deferred_check",
    "all_gather",
    "all_gather_into",
    "all_reduce",
    "all_reduce_inplace",
    "attention_over_group",
    "all_reduce_grad",
    "gather_over_group",
    "gather_onto_owners",
    "mean_over_group",
    "scale_gradient",
    "scaling_parameter_gradients",
    "sequence_sizes",
    "shard_of_whole",
    "local_offset",
    "local_size",
    "local_slice",
    "process_group",
    "running_sum_over_group",
    "sum_across",
    "sync_batch_norm",
]


class CollectiveError(DpCompileError):
    """A collective failed: most often another rank raised, exited or timed out first."""



class MeshGroup(nn.Module):
    """One dimension of a ``DeviceMesh``, as a (state-less) submodule generated code can name.

    It holds no parameters or buffers, so it adds no ``state_dict`` keys.

    >>> from torch.distributed.device_mesh import init_device_mesh  # doctest: +SKIP
    >>> tp = MeshGroup(init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), "tp")  # doctest: +SKIP
    >>> tp.size(), tp.rank()  # doctest: +SKIP
    (2, 0)
    """

    def __init__(self, mesh: object, dim: str | int | None = None):
        super().__init__()
        self.mesh = mesh
        self.dim = dim
        self._group: dist.ProcessGroup | None = None

    @property
    def group(self) -> dist.ProcessGroup:
        if self._group is None:
            self._group = self.mesh.get_group(self.dim)  # type: ignore[attr-defined]
        return self._group

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def rank(self) -> int:
        return dist.get_rank(self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - never called
        return x

    def extra_repr(self) -> str:
        return f"dim={self.dim!r}"

    def __deepcopy__(self, memo: dict) -> MeshGroup:
        return MeshGroup(self.mesh, self.dim)


GroupLike = MeshGroup | dist.ProcessGroup | None


def process_group(group: GroupLike) -> dist.ProcessGroup | None:
    """The process group a :class:`MeshGroup` names (a group or None as it is)."""
    return group.group if isinstance(group, MeshGroup) else group


def collective_failure(what: str, group: dist.ProcessGroup | None, error: BaseException) -> CollectiveError:
    try:
        where = f"rank {dist.get_rank(group)} of {dist.get_world_size(group)}"
    except Exception:  # noqa: BLE001 - the group itself may be gone
        where = "this rank"
    first = first_line(error)
    return CollectiveError(
        f"{what} failed on {where} (global rank {dist.get_rank() if dist.is_initialized() else '?'}): "
        f"another rank most likely raised, exited or timed out first — see its log for the first "
        f"error. Pass timeout= to torch.distributed.init_process_group to fail sooner. ({first})"
    )


# a check this thread's next collective runs first (the input check over a mesh, overlapped with the
# program's local work up to its first collective)
_deferred = threading.local()


def defer_to_next_collective(check: Callable[[], None]) -> None:
    """Run ``check`` before this thread's next collective of this module, or at
    :func:`settle_deferred_check`, whichever comes first (a check deferred before runs now)."""
    settle_deferred_check()
    _deferred.check = check


def settle_deferred_check() -> None:
    """Run the check :func:`defer_to_next_collective` left, if it has not run yet."""
    if torch.compiler.is_compiling():  # a compiled program's collectives: the check ran before it
        return
    check = _deferred.__dict__.pop("check", None)
    if check is not None:
        check()


def all_reduce_inplace(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``dist.all_reduce(t)`` (sum) after the deferred input check; a failure named by rank."""
    settle_deferred_check()
    try:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    except (RuntimeError, dist.DistError) as e:
        raise collective_failure("all_reduce", group, e) from e
    return t


def all_gather_into(parts: list[torch.Tensor], t: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """``dist.all_gather(parts, t)`` after the deferred input check; a failure named by rank."""
    settle_deferred_check()
    try:
        dist.all_gather(parts, t, group=group)
    except (RuntimeError, dist.DistError) as e:
        raise collective_failure("all_gather", group, e) from e


def _gather(x: torch.Tensor, group, dim: int, sizes: tuple[int, ...] | None) -> torch.Tensor:
    world = dist.get_world_size(group)
    local = x.contiguous()
    if sizes is None or len(set(sizes)) == 1:
        parts = [torch.empty_like(local) for _ in range(world)]
        all_gather_into(parts, local, group)
        return torch.cat(parts, dim)
    # uneven shards: pad to the largest, gather, trim
    pad = [0, 0] * (local.dim() - 1 - dim) + [0, max(sizes) - local.size(dim)]
    padded = F.pad(local, pad).contiguous()
    parts = [torch.empty_like(padded) for _ in range(world)]
    all_gather_into(parts, padded, group)
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes)], dim)


def _sizes_or_even(length: int, group, sizes: tuple[int, ...] | None) -> tuple[int, ...]:
    world = dist.get_world_size(group)
    if sizes is None:
        return (length,) * world
    if len(sizes) != world:
        raise ValueError(f"sizes {list(sizes)} name {len(sizes)} shards, but the process group has {world} ranks")
    return sizes


class _AllReduce(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        return all_reduce_inplace(x.clone(memory_format=torch.contiguous_format), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceGrad(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_inplace(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class _SumAcross(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        return all_reduce_inplace(x.clone(memory_format=torch.contiguous_format), group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_inplace(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class _AllGather(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int, sizes: tuple[int, ...] | None):
        dim = dim % x.dim()
        sizes = _sizes_or_even(x.size(dim), group, sizes)
        rank = dist.get_rank(group)
        ctx.dim, ctx.start, ctx.length = dim, sum(sizes[:rank]), sizes[rank]
        return _gather(x, group, dim, sizes)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.start, ctx.length), None, None, None


class _LocalSlice(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int, sizes: tuple[int, ...]):
        dim = dim % x.dim()
        rank = dist.get_rank(group)
        if x.size(dim) != sum(sizes):
            raise ValueError(f"cannot split dim {dim} of size {x.size(dim)} into shards {list(sizes)} (sum {sum(sizes)})")
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return x.narrow(dim, sum(sizes[:rank]), sizes[rank]).clone()

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim, ctx.sizes), None, None, None


def all_reduce(x: torch.Tensor, group: GroupLike) -> torch.Tensor:
    """Sum of ``x`` over ``group`` (Megatron's g, after a row-parallel layer); backward: identity.

    The sum of the partial products of a row split is the layer's full output, which every
    rank then holds (replicated), so each rank's gradient is already the full gradient.

    >>> y = all_reduce(partial, tp_group)  # doctest: +SKIP
    """
    if not (x.requires_grad and torch.is_grad_enabled()):  # nothing to record: the collective alone
        return all_reduce_inplace(x.clone(memory_format=torch.contiguous_format), process_group(group))
    return _AllReduce.apply(x, process_group(group))


def all_reduce_grad(x: torch.Tensor, group: GroupLike) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (Megatron's f, before a column layer).

    The input of a column-parallel layer is replicated, but each rank only sees the
    gradient through its own output columns; the sum over ranks is the full gradient.

    >>> x = all_reduce_grad(x, tp_group)  # doctest: +SKIP
    """
    if not (x.requires_grad and torch.is_grad_enabled()):  # no gradient will reach x: identity
        return x
    return _AllReduceGrad.apply(x, process_group(group))


def all_gather(
    x: torch.Tensor, group: GroupLike, dim: int = -1, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """This rank's shard of a tensor concatenated with every other rank's along ``dim``.

    ``sizes`` are the shard lengths along ``dim`` in rank order (uneven shards, e.g.
    ``[4, 3, 3]``); None means every shard has ``x``'s length. Backward keeps this rank's
    slice of the (replicated) gradient — no communication.

    >>> full = all_gather(fc1, tp_group, dim=-1, sizes=[5, 5])  # doctest: +SKIP
    """
    return _AllGather.apply(x, process_group(group), dim, None if sizes is None else tuple(sizes))


def local_slice(x: torch.Tensor, group: GroupLike, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """This rank's slice of a replicated ``x`` along ``dim`` (shard lengths ``sizes``, rank order).

    No communication forward; backward all-gathers the gradient slices, so the replicated
    ``x`` receives its whole gradient on every rank.

    >>> x_shard = local_slice(x, tp_group, -1, [512, 512])  # doctest: +SKIP
    """
    g = process_group(group)
    return _LocalSlice.apply(x, g, dim, _sizes_or_even(0, g, tuple(sizes)))


def local_size(sizes: Sequence[int], group: GroupLike) -> int:
    """This rank's extent of a sharded dimension, ``sizes[rank]`` (for ``view`` shapes).

    >>> heads = local_size([2, 2], tp_group)  # doctest: +SKIP
    """
    g = process_group(group)
    return int(_sizes_or_even(0, g, tuple(sizes))[dist.get_rank(g)])


def local_offset(sizes: Sequence[int], group: GroupLike) -> int:
    """Where this rank's slice of a sharded dimension starts, ``sum(sizes[:rank])`` (the first
    row of a vocab-parallel embedding's shard).

    >>> first_row = local_offset([50, 50], tp_group)  # doctest: +SKIP
    """
    g = process_group(group)
    return int(sum(_sizes_or_even(0, g, tuple(sizes))[: dist.get_rank(g)]))


def sum_across(x: torch.Tensor, group: GroupLike) -> torch.Tensor:
    """The sum over ``group`` of each rank's own ``x``; backward sums the gradients alike.

    Use it where every rank holds a different value (its part of the batch) and its own
    loss, as in data parallel: the gradient of the sum of all ranks' losses.

    >>> total = sum_across(x.sum(0), dp_group)  # doctest: +SKIP
    """
    if not (x.requires_grad and torch.is_grad_enabled()):
        return all_reduce_inplace(x.clone(memory_format=torch.contiguous_format), process_group(group))
    return _SumAcross.apply(x, process_group(group))


class _GatherOntoOwners(Function):
    """All-gather along ``dim`` forward; backward sums every rank's gradient and keeps this rank's
    slice (a reduce-scatter, written as an all-reduce: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, sizes: tuple[int, ...]) -> torch.Tensor:
        rank = dist.get_rank(group)
        ctx.group, ctx.dim, ctx.start, ctx.length = group, dim, sum(sizes[:rank]), sizes[rank]
        return _gather(x, group, dim, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        summed = all_reduce_inplace(grad.contiguous().clone(), ctx.group)
        return summed.narrow(ctx.dim, ctx.start, ctx.length), None, None, None


def attention_over_group(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: GroupLike,
    dim: int,
    sizes: Sequence[int],
    positions: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """This rank's queries against every rank's keys and values, all-gathered along ``dim`` (shard
    lengths ``sizes`` in rank order, uneven allowed) here and again in backward: backward keeps this
    rank's queries, keys and values only; each key's and value's gradient is summed over the ranks
    onto its owner. ``positions``: causal at these query positions in the whole sequence, else
    ``scaled_dot_product_attention(**kwargs)`` (a mask: this rank's query rows).

    Context parallel's attention for one rank of a ``cp`` group, as ``attention_regathered`` is
    over virtual devices (``passes.lower_sequence_to_rank`` writes calls of it).

    >>> out = attention_over_group(q_local, k_local, v_local, cp_group, 2, [4, 3], positions)  # doctest: +SKIP
    """
    g = process_group(group)
    dim = dim % key.dim()
    shards = _sizes_or_even(key.size(dim), g, tuple(sizes))

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        keys = _GatherOntoOwners.apply(key, g, dim, shards)
        values = _GatherOntoOwners.apply(value, g, dim, shards)
        if positions is None:
            return F.scaled_dot_product_attention(query, keys, values, **kwargs)
        return causal_attention(query, keys, values, positions, **kwargs)

    if not torch.is_grad_enabled():
        return attend(query, key, value)
    return torch.utils.checkpoint.checkpoint(attend, query, key, value, use_reentrant=False, preserve_rng_state=True)


class _ScaleGradient(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def scale_gradient(x: Any, factor: float) -> Any:
    """``x`` itself; backward multiplies its gradient by ``factor``. Anything but a tensor that
    needs a gradient passes through untouched.

    >>> logits = scale_gradient(logits, 2.0)  # doctest: +SKIP
    """
    if not (isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled()):
        return x
    return _ScaleGradient.apply(x, factor)


def running_sum_over_group(own: torch.Tensor, group: GroupLike, dim: int, **kwargs: Any) -> torch.Tensor:
    """This rank's part of ``torch.cumsum(x, dim)`` where ``x`` is split along ``dim`` over ``group``
    in rank order: its own running sum plus the totals of the ranks before it (one all-gather of the
    totals). For integers (a padding mask's positions, exact); no gradient flows between ranks.

    >>> running_sum_over_group(keep, cp_group, 1)  # rank 1 of [[1, 1]], [[1, 0, 1]]: [[3, 3, 4]]  # doctest: +SKIP
    """
    out = torch.cumsum(own, dim, **kwargs)
    g = process_group(group)
    total = own.sum(dim, keepdim=True, dtype=out.dtype).contiguous()
    parts = [torch.empty_like(total) for _ in range(dist.get_world_size(g))]
    all_gather_into(parts, total.detach(), g)
    for part in parts[: dist.get_rank(g)]:
        out = out + part
    return out


def scaling_parameter_gradients(module: nn.Module, factor: float, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)``, the gradients its parameters get from this call multiplied by
    ``factor`` (its inputs' are not): a module every cp rank runs alike on the whole sequence.

    >>> pooled = scaling_parameter_gradients(self.pooler.dense, 0.5, first_token)  # doctest: +SKIP
    """
    parameters = {name: scale_gradient(p, factor) for name, p in module.named_parameters()}
    return kept.functional_call(module, parameters, args, kwargs)


def sequence_sizes(length: int, group: GroupLike, *, balanced: bool = False) -> list[int]:
    """Every rank's ``length`` (its shard of a split dim), in rank order: one all-gather of an int.
    ``balanced``: the lengths must be the balanced ``tensor_split`` parts one process splits a
    sequence into (context parallel's inputs), else a ``DpCompileError`` on every rank.

    >>> sequence_sizes(k.size(2), cp_group)  # doctest: +SKIP
    [4, 3]
    """
    g = process_group(group)
    mine = torch.tensor([int(length)], dtype=torch.int64, device=group_device(g))  # an NCCL group refuses CPU tensors
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(g))]
    all_gather_into(parts, mine, g)
    sizes = [int(p) for p in parts]
    if not balanced:
        return sizes
    total, world = sum(sizes), len(sizes)
    balanced = [total // world + (1 if r < total % world else 0) for r in range(world)]
    if sizes != balanced:
        raise DpCompileError(
            f"context parallel over a mesh: the ranks' shards of the sequence have lengths {sizes}, but a sequence of "
            f"{total} splits into {balanced} (balanced tensor_split, as in one process): give each rank its part with "
            "dpcompile.mesh.local_batch(inputs, mesh)"
        )
    return sizes


def gather_over_group(x: torch.Tensor, group: GroupLike, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (uneven shards: their lengths exchanged first),
    for a value every rank then uses alike (backward keeps this rank's slice): ``gather`` of one
    process's data-parallel code, over a process group.

    >>> logits = gather_over_group(logits_local, cp_group, 1)  # doctest: +SKIP
    """
    dim = dim % x.dim()
    return all_gather(x, group, dim, sequence_sizes(x.size(dim), group))


def gather_onto_owners(x: torch.Tensor, group: GroupLike, dim: int, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """As :func:`gather_over_group`, for a value each rank uses differently (a mask gathered along
    the keys): backward sums every rank's gradient onto the owner of each slice. ``sizes``: every
    rank's length along ``dim`` where the caller knows them (else one all-gather of the lengths)."""
    dim = dim % x.dim()
    sizes = tuple(sequence_sizes(x.size(dim), group)) if sizes is None else tuple(int(s) for s in sizes)
    return _GatherOntoOwners.apply(x, process_group(group), dim, sizes)


def shard_of_whole(x: torch.Tensor, group: GroupLike, dim: int) -> torch.Tensor:
    """This rank's balanced ``tensor_split`` part of a value every rank holds whole (a mask's query
    rows); backward all-gathers the parts' gradients."""
    g = process_group(group)
    world, length = dist.get_world_size(g), x.size(dim)
    sizes = [length // world + (1 if r < length % world else 0) for r in range(world)]
    return local_slice(x, g, dim, sizes)


def mean_over_group(partial_sum: torch.Tensor, count: Any, group: GroupLike) -> torch.Tensor:
    """``sum / count`` over every rank's partial sum and count: the mean over the whole sequence,
    exact for uneven shards, the same value on every rank (backward: each rank's own share)."""
    counted = count if isinstance(count, torch.Tensor) else torch.tensor(count, device=partial_sum.device)
    total = all_reduce(partial_sum, group)
    return total / all_reduce(counted.to(total.dtype), group)


def _channel_shape(x: torch.Tensor) -> tuple[int, ...]:
    return (1, x.size(1)) + (1,) * (x.dim() - 2)


def sync_batch_norm(bn: nn.modules.batchnorm._BatchNorm, x: torch.Tensor, group: GroupLike) -> torch.Tensor:
    """``bn(x)`` with the statistics of the whole batch, every rank holding its part of it.

    The semantics of ``nn.SyncBatchNorm`` (which runs only on GPUs), on every device:
    per-rank sums and counts are summed across ``group`` with :func:`sum_across`, so uneven
    parts are exact, the running statistics are updated once with the global mean and
    unbiased variance (identically on every rank), and autograd gives the gradients of the
    whole batch. In eval mode it is ``bn(x)`` with the running statistics, no communication.

    >>> y = sync_batch_norm(self.bn, x, dp_group)  # doctest: +SKIP
    """
    if not (bn.training or bn.running_mean is None or bn.running_var is None):
        return F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
    bn._check_input_dim(x)  # type: ignore[operator]
    dims = [d for d in range(x.dim()) if d != 1]
    shape = _channel_shape(x)
    xs = x if x.dtype in (torch.float32, torch.float64) else x.float()  # statistics in float32 at least
    local_count = xs.new_full((1,), x.numel() // max(x.size(1), 1))
    packed = sum_across(torch.cat([xs.sum(dims), local_count]), group)
    count = packed[-1]
    mean = packed[:-1] / count
    centered = xs - mean.view(shape)
    var = sum_across((centered * centered).sum(dims), group) / count
    y = centered * torch.rsqrt(var + bn.eps).view(shape)
    if bn.weight is not None:
        y = y * bn.weight.view(shape)
    if bn.bias is not None:
        y = y + bn.bias.view(shape)
    y = y.to(x.dtype)
    if bn.training and bn.track_running_stats:
        _update_running_stats(bn, mean.detach(), var.detach(), count.detach())
    return y


@torch.no_grad()
def _update_running_stats(
    bn: nn.modules.batchnorm._BatchNorm, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor
) -> None:
    if bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
    if bn.running_mean is None or bn.running_var is None:
        return
    if bn.momentum is None:
        factor = 1.0 / float(bn.num_batches_tracked)
    else:
        factor = bn.momentum
    unbiased = var * (count / (count - 1).clamp_min(1))
    bn.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
    bn.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
