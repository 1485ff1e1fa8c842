"""Views with explicit strides in a loaded program, bounded to their input's own elements.

``as_strided(x, size, stride, storage_offset)`` addresses ``x``'s storage directly, and torch
checks only that the view fits the storage: called on a chunk of the caller's batch (a view
of the caller's tensor), it reads and writes the caller's memory outside the chunk. So a
loaded program (``dpcompile.load``) never calls the op itself: :func:`bound` swaps each call of
``as_strided``, ``as_strided_``, ``as_strided_copy`` or ``as_strided_scatter`` (any namespace:
``torch.X``, ``Tensor.X``, ``torch.ops.aten.X``, ``x.X(...)``) for the function of this module
of that name, which raises a :class:`~dpcompile.DpCompileError` unless every element of the
requested view is an element of the input, then calls the op. ``module.py`` shows these
functions, as it shows what runs. A program that ``transform`` returns calls the ops as traced.

>>> import torch
>>> x = torch.arange(8.0)
>>> as_strided(x[:4], (2, 2), (2, 1)).tolist()
[[0.0, 1.0], [2.0, 3.0]]
>>> as_strided(x[:4], (2, 2), (2, 1), 4)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
dpcompile.errors.DpCompileError: as_strided: the view (sizes [2, 2], strides [2, 1], storage offset 4) reaches elements outside its input (sizes [4], strides [1], storage offset 0)...
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from dpcompile.errors import DpCompileError
from dpcompile.export.common import ExportError

__all__ = ["as_strided", "as_strided_", "as_strided_copy", "as_strided_scatter", "bound", "original_name", "strided_ops"]

def _positions(sizes: Sequence[int], strides: Sequence[int], offset: int) -> torch.Tensor:
    """The storage position of every element of a view, flat (int64)."""
    pos = torch.tensor(offset, dtype=torch.int64)
    for size, stride in zip(sizes, strides):
        pos = pos.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return pos.reshape(-1)


def _span(sizes: Sequence[int], strides: Sequence[int], offset: int) -> tuple[int, int] | None:
    """The lowest and highest storage position a view reaches; None for an empty view."""
    if any(s == 0 for s in sizes):
        return None
    low = offset + sum((s - 1) * st for s, st in zip(sizes, strides) if st < 0)
    high = offset + sum((s - 1) * st for s, st in zip(sizes, strides) if st > 0)
    return low, high


def _dense(x: torch.Tensor) -> bool:
    """Whether ``x``'s elements are exactly the positions of its span (no gaps, no overlap):
    its dims, by stride, step 1, then each the size of the ones before."""
    expected = 1
    for stride, size in sorted((abs(st), s) for s, st in zip(x.shape, x.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def check_view(name: str, x: Any, size: Any, stride: Any, storage_offset: Any) -> None:
    """Raise unless the view ``(size, stride, storage_offset)`` of ``x``'s storage holds only
    elements of ``x`` itself (an offset of None: ``x``'s own)."""
    if not isinstance(x, torch.Tensor):
        raise DpCompileError(f"{name}: expected a tensor, got {type(x).__name__}")
    try:
        sizes, strides = [int(s) for s in size], [int(s) for s in stride]
        offset = x.storage_offset() if storage_offset is None else int(storage_offset)
    except (TypeError, ValueError):
        raise DpCompileError(f"{name}: sizes, strides and offset must be integers, got {size!r:.60}, {stride!r:.60}") from None
    if len(sizes) != len(strides):
        raise DpCompileError(f"{name}: {len(sizes)} sizes but {len(strides)} strides")
    wanted = _span(sizes, strides, offset)
    if wanted is None:
        return
    own = _span(list(x.shape), list(x.stride()), x.storage_offset())
    inside = own is not None and own[0] <= wanted[0] and wanted[1] <= own[1]
    if inside and not _dense(x):  # gaps in x's span: every element, one by one
        inside = bool(torch.isin(_positions(sizes, strides, offset), _positions(x.shape, x.stride(), x.storage_offset())).all())
    if not inside:
        raise DpCompileError(
            f"{name}: the view (sizes {sizes}, strides {strides}, storage offset {offset}) reaches elements outside "
            f"its input (sizes {list(x.shape)}, strides {list(x.stride())}, storage offset {x.storage_offset()}); "
            "a loaded program may only view its input's own elements (the memory around it is the caller's)"
        )


def as_strided(input: torch.Tensor, size: Any, stride: Any, storage_offset: Any = None) -> torch.Tensor:
    """``torch.as_strided``, within ``input``'s own elements."""
    check_view("as_strided", input, size, stride, storage_offset)
    return torch.ops.aten.as_strided.default(input, size, stride, storage_offset)


def as_strided_(input: torch.Tensor, size: Any, stride: Any, storage_offset: Any = None) -> torch.Tensor:
    """``Tensor.as_strided_``, within ``input``'s own elements."""
    check_view("as_strided_", input, size, stride, storage_offset)
    return torch.ops.aten.as_strided_.default(input, size, stride, storage_offset)


def as_strided_copy(input: torch.Tensor, size: Any, stride: Any, storage_offset: Any = None) -> torch.Tensor:
    """``torch.as_strided_copy``, within ``input``'s own elements."""
    check_view("as_strided_copy", input, size, stride, storage_offset)
    return torch.ops.aten.as_strided_copy.default(input, size, stride, storage_offset)


def as_strided_scatter(
    input: torch.Tensor, src: torch.Tensor, size: Any, stride: Any, storage_offset: Any = None
) -> torch.Tensor:
    """``torch.as_strided_scatter``, within ``input``'s own elements."""
    check_view("as_strided_scatter", input, size, stride, storage_offset)
    return torch.ops.aten.as_strided_scatter.default(input, src, size, stride, storage_offset)


_BOUNDED = {"as_strided": as_strided, "as_strided_": as_strided_, "as_strided_copy": as_strided_copy,
            "as_strided_scatter": as_strided_scatter}  # fmt: skip
_NAMES = {fn: f"torch.ops.aten.{name}.default" for name, fn in _BOUNDED.items()}


@functools.cache
def strided_ops() -> tuple[tuple[Any, str], ...]:
    """``(function, op name)`` for each vocabulary entry of an op taking explicit strides."""
    from dpcompile.export.vocabulary import vocabulary

    table = vocabulary()
    found = []
    for name in _BOUNDED:
        for qualified in (f"torch.{name}", f"torch.Tensor.{name}", f"torch.ops.aten.{name}.default"):
            if qualified in table:
                found.append((table[qualified], name))
    return tuple(found)


def _strided_name(node: fx.Node) -> str | None:
    """The op name (``as_strided``...) ``node`` calls, in any namespace, or None."""
    if node.op == "call_method":
        return node.target if node.target in _BOUNDED else None
    if node.op != "call_function":
        return None
    return next((name for fn, name in strided_ops() if node.target is fn), None)


def _bind(args: tuple, kwargs: dict, names: Sequence[str]) -> tuple:
    """The arguments of a call as positions (``input``/``self`` the first; keywords by name)."""
    kwargs = dict(kwargs)
    first = "self" if "self" in kwargs else "input"
    values = list(args)
    for name in (first, *names[1:])[len(values):]:
        if name in kwargs:
            values.append(kwargs.pop(name))
        elif name == "storage_offset":
            values.append(None)
        else:
            raise ExportError(f"program.json: a call of a strided view without {name}")
    if kwargs:
        raise ExportError(f"program.json: a call of a strided view with unknown keywords {sorted(kwargs)!r:.80}")
    return tuple(values)


def bound(graph: fx.Graph, kinds: Mapping[fx.Node, Any] | None = None) -> None:
    """Swap every call of an op that takes explicit strides for the function of this module that
    checks the view lies within its input (see the module docstring); in place. ``kinds``
    (:func:`~dpcompile.export.kinds.check_graph`'s): a ``call_method`` on a module or replica
    calls a child module that happens to be named ``as_strided``, and stays."""
    for node in graph.nodes:
        name = _strided_name(node)
        if name is None:
            continue
        receiver = node.args[0] if node.args else None
        if node.op == "call_method" and kinds is not None and isinstance(receiver, fx.Node):
            if getattr(kinds.get(receiver), "what", "value") != "value":
                continue
        names = ("input", "src", "size", "stride", "storage_offset") if name == "as_strided_scatter" else (
            "input", "size", "stride", "storage_offset"
        )
        node.args = _bind(node.args, dict(node.kwargs), names)
        node.kwargs = {}
        node.op = "call_function"
        node.target = _BOUNDED[name]


def original_name(target: Any) -> str | None:
    """The vocabulary's name for one of this module's functions (what ``program.json`` stores)."""
    try:
        return _NAMES.get(target)
    except TypeError:  # an unhashable target
        return None
