"""Values the batch size makes, and writes into a tensor, as data-parallel code computes them.

``batch_arange`` is device ``k``'s slice of ``torch.arange(B)``: the positions, in the whole
batch, of the rows device ``k`` holds (device 1 of a batch of 5 split 3/2 holds ``[3, 4]``).
``rows_of_shard`` is device ``k``'s rows of a table sliced by a split size. ``running_sum`` is
device ``k``'s part of a ``cumsum`` along the split dim. ``local_positions`` turns such positions back into rows of the device's own chunk, for an
index into it. ``squeeze_except`` is ``squeeze()`` on a chunk that may hold one sample.
``written`` is an in-place write made functional: the written copy of a tensor, so a program
can say what a mutation produced instead of relying on aliasing; ``write_back`` puts such a
value into the caller's input tensor at the end of forward, as the eager write would have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def _offset(sizes: Sequence[int | torch.SymInt], k: int) -> int:
    return int(sum(int(s) for s in sizes[:k]))


def batch_arange(sizes: Sequence[int], k: int, **kwargs: Any) -> torch.Tensor:
    """Device ``k``'s slice of ``torch.arange(sum(sizes), **kwargs)``, where ``sizes`` are the
    chunk sizes of every device.

    >>> batch_arange([3, 2], 1)
    tensor([3, 4])
    """
    start = _offset(sizes, k)
    return torch.arange(start, start + int(sizes[k]), **kwargs)


def rows_of_shard(table: torch.Tensor, dim: int, sizes: Sequence[int], k: int) -> torch.Tensor:
    """Device ``k``'s rows of ``table.narrow(dim, 0, sum(sizes))``: a table sliced by a split
    size (``position_ids[:, :seq_len]``, ``cos_cached[:seq_len]``) holds each shard's own rows.

    >>> rows_of_shard(torch.arange(10), 0, [3, 2], 1)
    tensor([3, 4])
    """
    return table.narrow(dim, _offset(sizes, k), int(sizes[k]))


def local_positions(positions: torch.Tensor, sizes: Sequence[int], k: int) -> torch.Tensor:
    """Positions in the whole batch made rows of device ``k``'s chunk.

    >>> local_positions(torch.tensor([3, 4]), [3, 2], 1)
    tensor([0, 1])
    """
    offset = _offset(sizes, k)
    return positions - offset if offset else positions


def squeeze_except(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """``tensor.squeeze()`` that keeps ``dim``: a device's chunk of one sample keeps its batch
    dim, as the whole batch does.

    >>> squeeze_except(torch.zeros(1, 1, 3), 0).shape
    torch.Size([1, 3])
    """
    return tensor.squeeze([i for i, n in enumerate(tensor.shape) if n == 1 and i != dim])


Op = str | Callable[..., Any]  # a Tensor method's name (``"copy_"``, ``"__setitem__"``) or an ATen op


def _call(op: Op, tensor: torch.Tensor, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> Any:
    return getattr(tensor, op)(*args, **(kwargs or {})) if isinstance(op, str) else op(tensor, *args, **(kwargs or {}))


def written(
    base: torch.Tensor, steps: Sequence[tuple[Op, tuple[Any, ...]]], op: Op, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """``base`` after ``op`` wrote into a view of it, as a new tensor; ``base`` is left as it was.

    The view is ``base`` seen through ``steps`` (``[("__getitem__", ((slice(None), slice(1, None)),))]``
    for ``base[:, 1:]``, ``[(torch.ops.aten.select.int, (1, 0))]`` for ``base[:, 0]``); ``op`` is an
    in-place method's name (``"copy_"``, ``"__setitem__"``) or an in-place ATen op.

    >>> written(torch.zeros(2, 3), [], "__setitem__", (slice(None), 0), 7.0)
    tensor([[7., 0., 0.],
            [7., 0., 0.]])
    """
    out = base.clone()
    view = out
    for step, step_args in steps:
        view = _call(step, view, step_args)
    _call(op, view, args, kwargs)
    return out


def running_sum(own: torch.Tensor, earlier: Sequence[torch.Tensor], dim: int, **kwargs: Any) -> torch.Tensor:
    """Device ``k``'s part of ``torch.cumsum(x, dim)`` where ``x`` is split along ``dim``: its own
    chunk's running sum plus the totals of the chunks before it (``earlier``), exact for integers
    (a padding mask's positions); for floats the same sums in another order.

    >>> running_sum(torch.tensor([[1, 0, 1]]), [torch.tensor([[1, 1]])], 1)
    tensor([[3, 3, 4]])
    """
    out = torch.cumsum(own, dim, **kwargs)
    for chunk in earlier:
        out = out + chunk.to(own.device).sum(dim, keepdim=True, dtype=out.dtype)
    return out


def write_back(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Copy ``value`` (an input's written value, whole) into the caller's tensor ``target``.

    >>> x = torch.zeros(2); _ = write_back(x, torch.ones(2)); x
    tensor([1., 1.])
    """
    if value is not target:
        target.copy_(value)
    return target
