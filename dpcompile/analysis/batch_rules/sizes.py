"""Arithmetic on a chunk's batch size: ``b * k``, ``b * nW // 4``, ``b * h + b``, ``n // heads``.

A size read from a split tensor's split dim (``x.size(0)``, ``x.shape[0]``, ``aten.sym_size``)
is :class:`~dpcompile.analysis.placement.BatchSize`: on each device it is the size of the
device's chunk. What forward computes from it is again the chunk's value where it is the batch
size times a whole number ``k`` (its *multiple*): ``BatchSize()`` for ``k == 1`` (``b * 2 // 2``,
``b + 0``), ``BatchSize(rows=True)`` for a larger ``k`` (``b * 4``: the rows of ``(b, 4, ...)``
flattened, which ``view``/``reshape`` and the factories take as the size of the split dim). A
window partition's ``view(B * nW, ws, ws, C)`` and back ``view(n // nW, ...)``, heads folded into
the batch (``reshape(B * heads, L, d)``) and frames into it (``reshape(B * T, C, H, W)``) keep the
split that way. One batch size over another
(``(b * nW) // b``) is the same number on every device: it carries no batch. Anything else
(``b - 1``, ``b * b``, ``b // 3`` where 3 does not divide the multiple) runs as before: it is
not the chunk's share of a size of the whole batch.

The multiple is computed from the graph (literal numbers, and sizes that carry no batch by the
value the example gave them); under the export frontend, where sizes are symbols (``4*s0``), it
is also read exactly from the symbol.
"""

from __future__ import annotations

import operator
from fractions import Fraction
from typing import Any

import torch
import torch.fx as fx

from dpcompile.analysis.batch_rules.context import Rule, RuleContext, whole_ratio
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.placement import REPLICATED, BatchSize, Placement, Replicated, Split

_ARITHMETIC = {operator.mul, operator.floordiv, operator.truediv, operator.add, operator.sub}


def _constant(ctx: RuleContext, value: Any) -> Fraction | None:
    """A number that carries no batch: a literal, or a replicated size with its example value."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return Fraction(value)
    if isinstance(value, fx.Node) and isinstance(ctx.p(value), Replicated):
        val = value.meta.get("val")
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            return Fraction(val)
    return None


def batch_multiple(ctx: RuleContext, value: Any, depth: int = 0) -> Fraction | None:
    """``k`` where ``value`` is a chunk's batch size times ``k`` on every device, else None."""
    if not isinstance(value, fx.Node) or depth > 32:
        return None
    p = ctx.p(value) if depth else BatchSize()  # the node being decided has no placement yet
    if not isinstance(p, BatchSize) or p.shape_of_dim is not None:
        return None
    if value.op == "call_function" and value.target in _ARITHMETIC and len(value.args) == 2:
        a, b = value.args
        ma, mb = batch_multiple(ctx, a, depth + 1), batch_multiple(ctx, b, depth + 1)
        ka, kb = _constant(ctx, a), _constant(ctx, b)
        found: Fraction | None = None
        if value.target is operator.mul:
            found = ma * kb if ma is not None and kb is not None else mb * ka if mb is not None and ka is not None else None
        elif value.target in (operator.floordiv, operator.truediv) and ma is not None and kb:
            found = ma / kb
            if value.target is operator.floordiv and found.denominator != 1:
                found = None  # b * k // c is a multiple of b only where c divides k
        elif value.target in (operator.add, operator.sub):
            sign = 1 if value.target is operator.add else -1
            if ma is not None and mb is not None:
                found = ma + sign * mb
            elif ma is not None and kb == 0 or mb is not None and ka == 0 and sign == 1:
                found = ma if ma is not None else mb
        if found is not None:
            return found
    return _example_multiple(ctx, value, whole_read=p == BatchSize())


def is_whole_split_size(ctx: RuleContext, x: fx.Node, p: Split, value: Any) -> bool:
    """``value`` is the size of ``x``'s split dim on every device: a batch size whose multiple is
    the rows one sample owns along that dim (TimeSformer's ``embeddings[:batch_size]``, the batch
    size read from the input, takes each device's whole chunk)."""
    if not isinstance(value, fx.Node) or not isinstance(ctx.p(value), BatchSize):
        return False
    multiple = batch_multiple(ctx, value, depth=1)
    return multiple is not None and multiple == ctx.rows_per_sample(x, p.dim)


def _example_multiple(ctx: RuleContext, value: fx.Node, *, whole_read: bool) -> Fraction | None:
    """The multiple the example shows: exact for a symbol of the export frontend (``4*s0 / s0``);
    for a plain size read (``x.size(0)``, a chunk's size) the example's rows per sample, 1 where
    no example says."""
    val, batch = value.meta.get("val"), ctx.example_batch()
    is_read = value.op in ("call_method", "call_function") and value.target not in _ARITHMETIC
    if isinstance(val, torch.SymInt) or isinstance(batch, torch.SymInt):
        ratio = whole_ratio(val, batch) if val is not None and batch is not None else None
        return Fraction(ratio) if ratio is not None else None
    if whole_read and is_read:
        ratio = whole_ratio(val, batch) if isinstance(val, int) and isinstance(batch, int) else None
        return Fraction(ratio or 1)
    return None


def _classify(multiple: Fraction | None) -> Placement | None:
    if multiple is None or multiple.denominator != 1 or multiple < 1:
        return None
    return BatchSize() if multiple == 1 else BatchSize(rows=True)


def _ratio_of_batch_sizes(ctx: RuleContext) -> bool:
    """``(b * k) // (b * m)`` (or ``/``): one batch size over another, ``k / m`` on every device, a
    number that carries no batch (GCViT's windows per image, ``B // q_global.shape[0]``)."""
    if ctx.node.target not in (operator.floordiv, operator.truediv) or len(ctx.node.args) != 2:
        return False
    a, b = ctx.node.args
    multiples = [batch_multiple(ctx, v, depth=1) for v in (a, b)]
    return all(isinstance(v, fx.Node) and isinstance(ctx.p(v), BatchSize) for v in (a, b)) and all(
        m is not None and m > 0 for m in multiples
    )


def size_arithmetic(fallback: Rule) -> Rule:
    """``fallback`` (the op's rule for tensors) unless a chunk's batch size is among the operands:
    then the batch size times its multiple (:func:`batch_multiple`), or ``fallback``'s answer."""

    def rule(ctx: RuleContext) -> Placement | None:
        sizes = [a for a in ctx.node.args[:2] if isinstance(a, fx.Node) and isinstance(ctx.p(a), BatchSize)]
        if not sizes or any(ctx.p(a).shape_of_dim is not None for a in sizes):
            return fallback(ctx)
        found = _classify(batch_multiple(ctx, ctx.node))
        if found is None and _ratio_of_batch_sizes(ctx):
            return REPLICATED
        return found if found is not None else fallback(ctx)

    rule.__name__ = rule.__qualname__ = f"size_arithmetic_{fallback.__name__}"
    rule.__doc__ = f"Batch-size arithmetic (:func:`size_arithmetic`), else :func:`{fallback.__name__}`."
    rule.__wrapped__ = fallback  # type: ignore[attr-defined]
    return rule


def joined_shape(ctx: RuleContext) -> Placement | None:
    """``a + b`` of two shapes where exactly one entry is the chunk's batch size (read from the split
    dim) and no other carries the batch: the joined shape holds it at its place. Each side is a
    literal tuple (``(x.shape[0],)``, whose entries are nodes or numbers), a shape read from a split
    tensor (``x.size()[:-1]``), or a replicated tuple (``(1,) * (x.ndim - 1)``, the rest of timm's
    ``drop_path`` mask shape); a batch size on the right needs the left's length. None otherwise.
    """
    left, right = (list(ctx.node.args) + [None, None])[:2]
    parts = [_shape_part(ctx, left), _shape_part(ctx, right)]
    if any(part is None for part in parts) or not any(isinstance(v, (tuple, list)) or _is_batch_shape(ctx, v) for v in (left, right)):
        return None
    (left_len, left_at), (_, right_at) = parts
    if (left_at is None) == (right_at is None):
        return None  # no batch entry (element-wise +, or constants), or two
    if left_at is not None:
        return BatchSize(shape_of_dim=left_at)
    return BatchSize(shape_of_dim=left_len + right_at) if left_len is not None else None


def _is_batch_shape(ctx: RuleContext, value: Any) -> bool:
    return isinstance(value, fx.Node) and isinstance(ctx.p(value), BatchSize) and ctx.p(value).shape_of_dim is not None


def _shape_part(ctx: RuleContext, value: Any) -> tuple[int | None, int | None] | None:
    """``(length or None, position of the batch size or None)`` of one side of ``+``, or None where it
    is not a shape that carries the batch at most once as a plain size."""
    if isinstance(value, (tuple, list)):
        at = [i for i, v in enumerate(value) if isinstance(v, fx.Node) and ctx.p(v) == BatchSize()]
        others = [v for i, v in enumerate(value) if i not in at]
        if len(at) > 1 or any(isinstance(v, fx.Node) and not isinstance(ctx.p(v), Replicated) for v in others):
            return None
        return len(value), (at[0] if at else None)
    if not isinstance(value, fx.Node):
        return None
    val = value.meta.get("val")
    length = len(val) if isinstance(val, (tuple, list, torch.Size)) else None
    if _is_batch_shape(ctx, value):
        return length, ctx.p(value).shape_of_dim
    return (length, None) if isinstance(ctx.p(value), Replicated) else None


def register() -> None:
    """Wrap the rules of ``*``, ``//``, ``/``, ``+`` and ``-`` (after every family registered them)."""
    for op in _ARITHMETIC:
        current = BATCH_RULES.function_rule(op)
        if current is not None and getattr(current, "__name__", "").startswith("size_arithmetic_"):
            continue
        if current is not None:
            BATCH_RULES.register(op, size_arithmetic(current), replace=True)
