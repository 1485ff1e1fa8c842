"""The layouts of values in one shard's program, and the helpers every sharding rule reads.

A value is :class:`Sharded` (split along a dim, counted from the end), replicated
(:data:`~dpcompile.analysis.placement.REPLICATED`), :class:`Copied` (a replicated value passed
through *f* into a sharded region) or :class:`NotTensor` (a Python value, the same everywhere).
A rule that cannot carry a sharded value raises :class:`NeedsWhole`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx as fx

from dpcompile.analysis.placement import Replicated


# ---------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Sharded:
    """A value split along ``dim`` (counted from the end, so broadcasting lines dims up)."""

    dim: int
    sizes: tuple[int, ...]
    origins: frozenset[str] = frozenset()  # the column layers whose outputs it carries
    unit: int = 1  # output features of the origin layers per unit of ``dim``
    sections: int = 1  # a fused projection: ``dim`` holds this many blocks (q, k, v), each split

    def same_split(self, other: Sharded) -> bool:
        """True when ``other`` is split along the same dim into the same pieces."""
        return (self.dim, self.sizes, self.sections) == (other.dim, other.sizes, other.sections)


@dataclass(frozen=True)
class Copied:
    """A replicated value passed through *f* into a sharded region (one copy per shard)."""


@dataclass(frozen=True)
class NotTensor:
    """A Python value (a size, a dtype) that is the same on every shard."""


COPIED = Copied()
NOT_TENSOR = NotTensor()
Layout = Sharded | Replicated | Copied | NotTensor


class NeedsWhole(Exception):
    """The op needs whole inputs; ``problem`` marks a view the pass should have kept sharded."""

    def __init__(self, reason: str, *, problem: bool = False, granularity: int | None = None, sections: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.problem = problem
        self.granularity = granularity
        self.sections = sections  # a fused projection: shard each of this many blocks of the origin layers


def node_val(node: Any) -> Any:
    """The fake value shape propagation left on ``node`` (``None`` for non-nodes or without shapes)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def tensor_shape(node: Any) -> tuple[int, ...] | None:
    """``node``'s static shape, or ``None`` when unknown (no shapes, or a symbolic size)."""
    v = node_val(node)
    if isinstance(v, torch.Tensor):
        if all(isinstance(s, int) for s in v.shape):
            return tuple(v.shape)
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode  # lazy: it imports sympy

        try:
            return tuple(int(s) for s in v.shape)
        except (TypeError, ValueError, GuardOnDataDependentSymNode):  # a size nonzero() / masked_select() counts
            return None
    return None


def may_need_grad(node: fx.Node) -> bool:
    """False for values that never carry a gradient (masks, integer tensors): f's backward is then free."""
    v = node_val(node)
    return not (isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex()))


def tensor_ndim(node: Any) -> int | None:
    """``node``'s rank (known where its sizes are not: ``x.nonzero()``), or ``None`` when unknown."""
    v = node_val(node)
    return v.dim() if isinstance(v, torch.Tensor) else None


def from_end(dim: int, ndim: int | None) -> int:
    """``dim`` counted from the end (``-1`` is the last); :class:`NeedsWhole` when the rank is unknown."""
    if dim < 0:
        return dim
    if ndim is None:
        raise NeedsWhole("dim counted from the front of a tensor of unknown rank; pass example_inputs=")
    return dim - ndim


def describe_op(node: fx.Node) -> str:
    """``"relu (relu)"``: a node and its target, for reasons shown to users."""
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{node.name} ({target})"


def node_arg(node: fx.Node, pos: int, name: str, default: Any = None) -> Any:
    """Argument ``pos`` of ``node``, or its keyword ``name``, or ``default``."""
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def flat_nodes(value: Any) -> list[fx.Node]:
    """Every node inside ``value`` (nested args and kwargs), in order."""
    out: list[fx.Node] = []
    fx.node.map_arg(value, lambda n: out.append(n) or n)
    return out


def is_part_read(node: fx.Node, parts: fx.Node) -> bool:
    """Whether ``node`` reads one tensor of the tuple ``parts``: ``parts[i]`` or a named field (``.values``)."""
    if node.op != "call_function" or len(node.args) != 2 or node.args[0] is not parts:
        return False
    key_ok = (node.target is operator.getitem and isinstance(node.args[1], int)) or (
        node.target is getattr and isinstance(node.args[1], str))
    return key_ok and isinstance(node_val(node), torch.Tensor)


def refuse_tuple_read_whole(node: fx.Node) -> None:
    """A sharded tuple is only ever read a part at a time: a use of the whole tuple (``torch.cat(x.chunk(..))``,
    the model's output) would get the per-shard tuples, which no collective joins, so the op runs whole."""
    if not all(is_part_read(user, node) for user in node.users):
        raise NeedsWhole("its tuple of results is used whole (not a part at a time)")


class LayoutContext(Protocol):
    """What a rule reads and records: the layout of a value, and a view's rewritten constant."""

    def layout(self, node: Any) -> Layout: ...

    def rewrite_view(self, node: fx.Node, position: int, sizes: tuple[int, ...]) -> None: ...

    def mark_tuple(self, node: fx.Node) -> None: ...

    def mark_vocab_loss(self, node: fx.Node, sizes: tuple[int, ...]) -> None: ...

    def split_arg(self, consumer: fx.Node, producer: fx.Node, dim: int, sizes: tuple[int, ...]) -> None: ...

    def mark_sharded_size(self, node: fx.Node) -> None: ...

    def is_sharded_size(self, node: Any) -> bool: ...

    def rewritten_at(self, node: fx.Node) -> int | None: ...

    def is_tuple(self, node: Any) -> bool: ...
