"""What a batch rule sees: the node, its inputs' placements, its module; and helpers every family uses."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.analysis.placement import REPLICATED, Partial, Placement, Replicated, Split, Tuple, Whole
from dpcompile.runtime.batch_values import written


@dataclass
class RuleContext:
    """One node, the placements of the values before it, and the module it calls (``call_module``)."""

    node: fx.Node
    placements: Mapping[fx.Node, Placement]
    module: nn.Module | None
    ranks: Mapping[fx.Node, int] = field(default_factory=dict)  # lower bounds of ranks (see rank_bound)

    def p(self, value: Any) -> Placement:
        if isinstance(value, fx.Node):
            placement = self.placements[value]
            if isinstance(placement, Partial) or (isinstance(placement, Whole) and not placement.batch):
                return REPLICATED
            return placement
        if isinstance(value, (list, tuple)):
            items = [self.p(v) for v in value]
            if all(isinstance(i, Replicated) for i in items):
                return REPLICATED
            return Tuple(tuple(items))
        return REPLICATED

    def inputs(self) -> list[Placement]:
        return [self.p(n) for n in self.node.all_input_nodes]

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        args = self.node.args  # call_method args start with self, like call_function's tensor
        if index < len(args):
            return args[index]
        return self.node.kwargs.get(name, default)

    def tensor_arg(self) -> Any:
        return self.node.args[0] if self.node.args else None

    def ndim(self, value: Any) -> int | None:
        if isinstance(value, fx.Node):
            shape = node_shape(value)
            return None if shape is None else len(shape)
        return None

    def out_ndim(self) -> int | None:
        return self.ndim(self.node)

    def min_ndim(self, value: Any) -> int | None:
        """``value``'s rank if known, else a lower bound on it (a tensor split on dim d has d+1+)."""
        nd = self.ndim(value)
        if nd is not None or not isinstance(value, fx.Node):
            return nd
        return self.ranks.get(value)

    def example_batch(self) -> Any:
        """The batch size of the example (an int, or a symbol under export): the split dim's size
        of every split input, or None where shapes are unknown or the inputs disagree."""
        sizes = {}  # keyed by the symbol's expression: a SymInt is not hashable
        for node, placement in self.placements.items():
            if node.op != "placeholder":
                break  # placeholders come first
            shape = node_shape(node) if isinstance(placement, Split) else None
            if shape is not None and placement.dim < len(shape):
                size = shape[placement.dim]
                sizes[size.node.expr if isinstance(size, torch.SymInt) else size] = size
        return next(iter(sizes.values())) if len(sizes) == 1 else None

    def rows_per_sample(self, value: fx.Node, dim: int) -> int:
        """How many entries of ``value``'s split dim ``dim`` one sample owns, from the example's
        shapes: ``k`` where the dim is ``batch * k`` (Swin's windows, ``(B * nW, ws, ws, C)``);
        1 where shapes do not say (each entry may start a sample's block: always safe)."""
        shape, batch = node_shape(value), self.example_batch()
        if shape is None or batch is None or dim >= len(shape):
            return 1
        return whole_ratio(shape[dim], batch) or 1

    def resolve(self, dim: Any, value: Any, batch_dim: int, extra: int = 0) -> int | None:
        """A dim of ``value`` (of the result, ``extra`` dims more, for unsqueeze/stack) as a
        non-negative int; :data:`AFTER_BATCH` for a negative dim that surely lies after
        ``batch_dim`` though the rank is unknown; None when it might name the batch dim."""
        if not isinstance(dim, int) or isinstance(dim, bool):
            return None
        if dim >= 0:
            return dim
        nd = self.ndim(value)
        if nd is not None:
            return dim + nd + extra
        low = self.min_ndim(value)
        if low is not None and dim + low + extra > batch_dim:
            return AFTER_BATCH
        return None


def target_name(node: fx.Node) -> str:
    """The name of what ``node`` calls, the same for every spelling of an op: ``"unbind"`` for
    ``torch.unbind``, ``x.unbind()`` and ``aten.unbind.int``."""
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target._opname if isinstance(target, torch._ops.OpOverload) else target.__name__
    return getattr(target, "__name__", "") or ""


def is_aten(node: fx.Node) -> bool:
    """Whether ``node`` calls an ATen op (an exported graph's spelling)."""
    return isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


#: a tensor-parallel shard's node: the whole tensor's example value (its ``val`` is dropped: the shard's differs)
UNSHARDED_VAL = "dpcompile_unsharded_val"


def unsharded_shape(node: fx.Node) -> tuple[int, ...] | None:
    """``node``'s whole shape where it is a tensor-parallel shard (its batch dims are the shard's), else
    :func:`node_shape`: what a view of shards keeps and merges, read on the whole tensors."""
    val = node.meta.get(UNSHARDED_VAL)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else node_shape(node)


def node_shape(node: fx.Node) -> tuple[int, ...] | None:
    """``node``'s shape from shape propagation (``meta["val"]`` or ``meta["tensor_meta"]``), or ``None``."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(val.shape)
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return tuple(tm.shape)
    if node.op == "call_function" and node.target is written and isinstance(node.args[0], fx.Node):
        return node_shape(node.args[0])  # a write keeps its tensor's shape (a pass may not have kept its val)
    if node.op == "get_attr" and node.graph.owning_module is not None:  # a parameter or buffer: read it
        value: Any = node.graph.owning_module
        for atom in str(node.target).split("."):
            value = getattr(value, atom, None)
        if isinstance(value, torch.Tensor):
            return tuple(value.shape)
    return None


def whole_ratio(size: Any, batch: Any) -> int | None:
    """``size / batch`` where it is a whole number (ints, or symbols under export: ``4*s0 / s0``)."""
    if isinstance(size, int) and isinstance(batch, int):
        return size // batch if batch > 0 and size % batch == 0 else None
    if isinstance(size, torch.SymInt) or isinstance(batch, torch.SymInt):
        import sympy

        def expr(v: Any) -> Any:
            return v.node.expr if isinstance(v, torch.SymInt) else sympy.Integer(v)

        ratio = sympy.simplify(expr(size) / expr(batch))
        return int(ratio) if ratio.is_Integer and ratio > 0 else None
    return None


# a rule: the placement of the node's result, or None when it cannot run on chunks of the batch
Rule = Callable[[RuleContext], Placement | None]


AFTER_BATCH = 1 << 20  # "some dim after the batch dim", where shapes are unknown


def normalize_dim(dim: Any, ndim: int | None, batch_dim: int, min_ndim: int | None = None) -> int | None:
    """A non-negative dim, or None if unknown. Without the rank, a negative dim names some dim
    after the batch dim only where a lower bound of the rank says so (``h.mean(-2)`` of a 2-D
    batch is a mean over the batch): :data:`AFTER_BATCH`."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        return None
    if dim >= 0:
        return dim
    if ndim is not None:
        return dim + ndim
    if min_ndim is not None and dim + min_ndim > batch_dim:
        return AFTER_BATCH
    return None


def tuple_of(rule: Rule, count: int) -> Rule:
    """``rule`` for an op that returns ``count`` tensors split alike (``native_layer_norm``'s
    output, mean and rstd; ``max_pool2d_with_indices``' values and indices)."""

    def tupled(ctx: RuleContext) -> Placement | None:
        out = rule(ctx)
        return Tuple((out,) * count) if isinstance(out, Split) else out

    tupled.__name__ = tupled.__qualname__ = f"{rule.__name__}_x{count}"
    tupled.__doc__ = f"{count} tensors, each split as :func:`{rule.__name__}` splits one."
    tupled.__wrapped__ = rule  # type: ignore[attr-defined]
    return tupled
