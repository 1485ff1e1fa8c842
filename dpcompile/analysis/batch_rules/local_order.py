"""Rows in an order of the device's own: sorting tokens along the batch, as a mixture-of-experts
dispatch does, and putting them back.

transformers' grouped experts (``grouped_mm_experts_forward``, torchtitan's and megablocks' token
dispatch are alike) sort the flattened tokens ``(B*T*k,)`` by expert, compute each expert's rows
as one group, and restore the order::

    ids, perm = torch.sort(expert_ids)                    # along the token dim, split like the batch
    x = hidden[perm // k]                                 # the tokens' rows, by expert
    offsets = torch.cumsum(torch.histc(ids.float(), bins=E, min=0, max=E - 1), 0)
    y = grouped_mm(x, w, offsets) * weights[perm][:, None]
    inverse = torch.empty_like(perm); inverse[perm] = torch.arange(perm.size(0))
    out = y[inverse].view(n, k, h).sum(1)                 # each token's rows again, in order

Every token's result depends on its own row alone, so each device may sort *its own* tokens: the
values in between (``ids``, ``x``, ``offsets``, ``y``) then exist per device only, each device's
rows in an order of its own, and gathering them would not give the single-device value. This
module gives them the placement :class:`~dpcompile.analysis.placement.LocalOrder` (a ``Split``
on dim 0 that is never gathered) and decides, op by op, what may consume one:

=========================================  ===================================================
``sort(x)`` along the split dim of 1-D x   values: ``keys`` (ascending, non-negative integer
                                           indices), indices: ``positions`` (into x's chunk)
``positions // m``                         positions into a dim ``m`` times shorter per sample
``x[positions]``, ``index_select``         ``rows``: x's own rows in the order (x split on dim 0,
                                           ``x.shape[0] * m`` the sorted length)
row-local ops of ``rows`` (element-wise,   ``rows`` in the same order, where every other input is
``x @ W``, ``chunk``/``unsqueeze`` of      replicated and the op's own rule keeps dim 0 split
other dims, reductions along other dims)
``histc(keys, E, 0, E-1)``, ``cumsum``     ``counts``, ``offsets``: each device's groups
``grouped_mm(rows, W, offsets)``           ``rows``: every row times its own group's matrix
``arange(b * t)``                          ``arange``: the positions of the device's own rows
``empty_like(perm)[perm] = arange(n)``     ``inverse``: the permutation that undoes the order
``rows[inverse]``                          ``Split(0)``: the device's rows in batch order again
=========================================  ===================================================

Anything else that reads such a value (a gather for an op that runs whole, the program's
output, a shape read) would see the device-local order: :func:`escaping_roots` finds it, and the
propagation runs again with the ``sort`` (or ``arange``) that made the order running whole, as
it did before this module.
"""

from __future__ import annotations

import operator
from collections import ChainMap
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from dpcompile.analysis.batch_rules import matrix, model_constructs, pointwise, reductions
from dpcompile.analysis.batch_rules.aten import aten_rule
from dpcompile.analysis.batch_rules.context import RuleContext, node_shape, target_name
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.placement import BatchSize, LocalOrder, Partial, Placement, Replicated, Split, Tuple, Whole
from dpcompile.runtime import written

aten = torch.ops.aten

# ops that act on each row of dim 0 alone wherever their own rule keeps dim 0 split
_ROW_LOCAL_RULES = (pointwise.pointwise, matrix.matmul, matrix.linear_function, matrix.last_dim_op, matrix.addmm,
                    matrix.bmm, model_constructs.matmul_weight_left)  # fmt: skip
_ROW_LOCAL_NAMES = frozenset(
    {"unsqueeze", "squeeze", "permute", "transpose", "expand", "chunk", "split", "split_with_sizes", "unbind",
     "slice", "select", "sum", "mean", "amax", "amin", "prod", "var", "logsumexp", "any", "argmax", "argmin",
     "softmax", "_softmax", "log_softmax", "_log_softmax", "to", "_to_copy", "float", "double", "half", "long",
     "int", "type_as", "clone", "contiguous"}
)  # fmt: skip
_CASTS = frozenset({"to", "_to_copy", "float", "double", "half", "long", "int"})
_LIKE = frozenset({"empty_like", "zeros_like", "ones_like", "full_like"})
# the integer results that are indices, never negative: ``topk(x, k)[1]``, ``argmax(x)``
_INDEX_RESULTS = frozenset({"topk", "sort", "max", "min", "kthvalue", "mode"})
_INDEX_OPS = frozenset({"argmax", "argmin", "argsort"})
_SAME_VALUES = frozenset({"view", "reshape", "_unsafe_view", "flatten", "clone", "contiguous", "alias"})
_GROUPED_MM = frozenset({"_grouped_mm", "grouped_mm", "grouped_mm_fallback"})


def _size(node: Any, dim: int = 0) -> Any:
    shape = node_shape(node) if isinstance(node, fx.Node) else None
    return shape[dim] if shape is not None and len(shape) > dim else None


def _same_size(a: Any, b: Any) -> bool:
    """Whether two sizes (ints or symbolic) are surely equal."""
    if a is None or b is None:
        return False
    if not isinstance(a, torch.SymInt) and not isinstance(b, torch.SymInt):
        return int(a) == int(b)
    import sympy  # only symbolic sizes (export's) need it: ``import dpcompile`` stays without sympy

    exprs = [v.node.expr if isinstance(v, torch.SymInt) else sympy.Integer(int(v)) for v in (a, b)]
    return sympy.expand(exprs[0] - exprs[1]) == 0


def _nonnegative_indices(node: Any) -> bool:
    """Whether ``node`` holds indices an op returned (``topk(x, k)[1]``), reshaped or copied."""
    for _ in range(16):
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return False
        name = target_name(node)
        if node.target is operator.getitem:
            source = node.args[0]
            return (
                node.args[1] == 1 and isinstance(source, fx.Node) and target_name(source) in _INDEX_RESULTS
                and source.op == "call_function"
            )  # fmt: skip
        if name in _INDEX_OPS:
            return True
        if name not in _SAME_VALUES:
            return False
        node = node.args[0]
    return False


def _dtype(node: Any) -> torch.dtype | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value.dtype if isinstance(value, torch.Tensor) else None


def sort(ctx: RuleContext) -> Placement | None:
    """``sort`` along a dim that is not the batch: values and indices split alike; along the split
    dim of a 1-D tensor: each device sorts its own rows (:class:`LocalOrder` keys and positions)."""
    out = reductions.values_and_indices(ctx)
    if out is not None:
        return out
    x = ctx.tensor_arg()
    p = ctx.p(x)
    if not isinstance(p, Split) or isinstance(p, LocalOrder) or p.dim != 0 or ctx.ndim(x) != 1:
        return None
    if any(not isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes[1:]):
        return None
    args = list(ctx.node.args) + [None, None]
    if isinstance(args[1], bool):
        return None  # sort(x, stable) spelled positionally: read no further
    dim = ctx.node.kwargs.get("dim", args[1] if args[1] is not None else -1)
    descending = ctx.node.kwargs.get("descending", args[2] if args[2] is not None else False)
    if dim not in (0, -1) or not isinstance(descending, bool):
        return None
    dtype = _dtype(x)
    ascending_indices = (
        not descending and dtype is not None and not dtype.is_floating_point and not dtype.is_complex
        and dtype is not torch.bool and _nonnegative_indices(x)
    )  # fmt: skip
    root = ctx.node.name
    return Tuple((LocalOrder(0, root=root, kind="keys" if ascending_indices else "rows"),
                  LocalOrder(0, root=root, kind="positions")))  # fmt: skip


def local_arange(ctx: RuleContext) -> Placement | None:
    """``arange(b * t)`` of a row count: each device's positions of its own rows, ``0..n-1``."""
    args = list(ctx.node.args)
    if len(args) == 2 and args[0] == 0:
        args = args[1:]
    if ctx.node.kwargs.keys() & {"start", "end", "step"} or len(args) != 1 or not isinstance(args[0], fx.Node):
        return None
    size = ctx.p(args[0])
    if not (isinstance(size, BatchSize) and size.rows and size.shape_of_dim is None):
        return None
    if any(isinstance(v, fx.Node) and not isinstance(ctx.p(v), Replicated) for v in ctx.node.kwargs.values()):
        return None
    return LocalOrder(0, root=ctx.node.name, kind="arange")


def _sorted_length(placements: Mapping[fx.Node, Placement], graph: fx.Graph, root: str) -> Any:
    for node in graph.nodes:
        if node.name == root:
            return _size(node.args[0]) if target_name(node) == "sort" else _size(node)
    return None


def _locals(ctx: RuleContext) -> dict[fx.Node, LocalOrder]:
    return {n: p for n in ctx.node.all_input_nodes if isinstance(p := ctx.placements[n], LocalOrder)}


def local_order_placement(ctx: RuleContext) -> Placement | None:
    """The placement of a node that reads a :class:`LocalOrder` value, or None where it cannot
    run on the device's own order (it then needs the whole value: the order's root runs whole)."""
    node, found = ctx.node, _locals(ctx)
    roots = {p.root for p in found.values() if p.kind != "arange"}
    if len(roots) > 1:
        return None
    if node.target is operator.getitem and isinstance(ctx.placements.get(node.args[0]), Tuple):
        items = ctx.placements[node.args[0]].items
        return items[node.args[1]] if isinstance(node.args[1], int) and node.args[1] < len(items) else None
    kinds = {p.kind for p in found.values()}
    name = target_name(node)
    if name in _LIKE and len(found) == 1 and node.args[0] in found:
        p = found[node.args[0]]
        return LocalOrder(0, root=p.root, kind="blank", step=p.step)
    if kinds == {"positions"}:
        return _from_positions(ctx, found, name)
    if node.target is written:
        return _inverse(ctx, found)
    if "inverse" in kinds:
        return _undo(ctx, found)
    if name == "histc" and kinds == {"keys"}:
        return _counts(ctx, found)
    if name == "cumsum" and kinds == {"counts"} and ctx.arg(1, "dim") in (0, -1):
        return LocalOrder(0, root=next(iter(roots)), kind="offsets")
    if name in _GROUPED_MM:
        return _grouped_mm(ctx, found)
    if kinds <= {"rows", "keys"}:
        return _row_local(ctx, found, name)
    return None


def _from_positions(ctx: RuleContext, found: dict[fx.Node, LocalOrder], name: str) -> Placement | None:
    node = ctx.node
    args = node.args
    if name == "floor_divide" or (node.target is operator.floordiv):
        pos, m = args[0], args[1]
        if pos in found and isinstance(m, int) and not isinstance(m, bool) and m > 0:
            p = found[pos]
            return LocalOrder(0, root=p.root, kind="positions", step=p.step * m)
        return None
    if name == "index" or node.target is operator.getitem:
        x, index = args[0], args[1]
        items = list(index) if isinstance(index, (list, tuple)) else [index]
        if len(items) != 1 or items[0] not in found or x in found:
            return None
        return _rows_of(ctx, x, found[items[0]])
    if name == "index_select" and ctx.arg(1, "dim") == 0 and args[2] in found and args[0] not in found:
        return _rows_of(ctx, args[0], found[args[2]])
    return None


def _rows_of(ctx: RuleContext, x: Any, positions: LocalOrder) -> Placement | None:
    """``x[positions]``: x's own rows in the order, where x is split on dim 0 and its per-sample
    rows times the positions' step are the sorted length."""
    px = ctx.p(x)
    if not isinstance(px, Split) or isinstance(px, LocalOrder) or px.dim != 0:
        return None
    length = _sorted_length(ctx.placements, ctx.node.graph, positions.root)
    rows = _size(x)
    if rows is None or not _same_size(rows * positions.step, length):
        return None
    return LocalOrder(0, root=positions.root, kind="rows")


def _inverse(ctx: RuleContext, found: dict[fx.Node, LocalOrder]) -> Placement | None:
    """``written(blank, [], index_put_, [perm], arange(n))``: ``inverse[perm] = arange(n)``."""
    base, steps, op, *rest = ctx.node.args
    name = op if isinstance(op, str) else target_name_of(op)
    if steps or name not in ("index_put_", "__setitem__") or ctx.node.kwargs or len(rest) < 2:
        return None
    index, values = rest[0], rest[1]
    if len(rest) > 2 and rest[2] is not False:
        return None  # accumulate=True
    items = list(index) if isinstance(index, (list, tuple)) else [index]
    b, pos, ar = found.get(base), found.get(items[0]) if len(items) == 1 else None, found.get(values)
    if b is None or pos is None or ar is None or b.kind != "blank" or pos.kind != "positions" or ar.kind != "arange":
        return None
    if b.step != 1 or pos.step != 1 or b.root != pos.root:
        return None
    if not _same_size(_size(values), _sorted_length(ctx.placements, ctx.node.graph, pos.root)):
        return None
    return LocalOrder(0, root=pos.root, kind="inverse")


def target_name_of(op: Any) -> str:
    return op._opname if isinstance(op, torch._ops.OpOverload) else getattr(op, "__name__", "")


def _undo(ctx: RuleContext, found: dict[fx.Node, LocalOrder]) -> Placement | None:
    """``rows[inverse]``: the device's rows in the batch's order again, split on dim 0."""
    node = ctx.node
    if not (target_name(node) == "index" or node.target is operator.getitem):
        return None
    x, index = node.args[0], node.args[1]
    items = list(index) if isinstance(index, (list, tuple)) else [index]
    if len(items) != 1 or x not in found or items[0] not in found:
        return None
    rows, inverse = found[x], found[items[0]]
    if rows.kind not in ("rows", "keys") or inverse.kind != "inverse" or rows.root != inverse.root:
        return None
    return Split(0)


def _counts(ctx: RuleContext, found: dict[fx.Node, LocalOrder]) -> Placement | None:
    """``histc(keys, bins=E, min=0, max=E-1)``: bin ``g`` counts the device's rows of key ``g``."""
    bins, low, high = ctx.arg(1, "bins", 100), ctx.arg(2, "min", 0), ctx.arg(3, "max", 0)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (bins, low, high)):
        return None
    if bins < 2 or low != 0 or high != bins - 1 or ctx.node.args[0] not in found:
        return None
    return LocalOrder(0, root=found[ctx.node.args[0]].root, kind="counts")


def _grouped_mm(ctx: RuleContext, found: dict[fx.Node, LocalOrder]) -> Placement | None:
    """``grouped_mm(x, w, offs)``: row ``r`` times ``w[g]`` for the group ``g`` its position falls in;
    with x's rows sorted by key and ``offs`` the device's own group ends, ``g`` is row r's key."""
    args = list(ctx.node.args)
    x = args[0] if args else None
    w = args[1] if len(args) > 1 else ctx.node.kwargs.get("mat2")
    offs = args[2] if len(args) > 2 else ctx.node.kwargs.get("offs")
    px, po = found.get(x), found.get(offs)
    if px is None or po is None or px.kind != "rows" or po.kind != "offsets" or px.root != po.root:
        return None
    others = [n for n in ctx.node.all_input_nodes if n is not x and n is not offs]
    if ctx.ndim(x) != 2 or any(not isinstance(ctx.p(n), Replicated) for n in others) or w not in others:
        return None
    return LocalOrder(0, root=px.root, kind="rows")


def _row_local(ctx: RuleContext, found: dict[fx.Node, LocalOrder], name: str) -> Placement | None:
    """A row-local op of rows in one order: the op's own rule, with the rows seen as split on dim 0."""
    node = ctx.node
    for n in node.all_input_nodes:
        if n not in found and not isinstance(ctx.p(n), Replicated):
            return None  # rows in the batch's order, or a batch size, beside rows in the device's order
    rule = BATCH_RULES.lookup(node, ctx.module)
    if rule is None and node.op == "call_function":
        rule = aten_rule(node)
    if rule is None or not (any(rule is r or getattr(rule, "__wrapped__", None) is r for r in _ROW_LOCAL_RULES)
                            or name in _ROW_LOCAL_NAMES):  # fmt: skip
        return None
    if any(p.dim != 0 for p in found.values()):
        return None
    seen = ChainMap({n: Split(0) for n in found}, dict(ctx.placements))
    out = rule(RuleContext(node, seen, ctx.module, ctx.ranks))
    root = next(iter(found.values())).root
    keys = name in _CASTS and next(iter(found.values())).kind == "keys" and _dtype(node) not in (None, torch.bool)
    kind = "keys" if keys else "rows"
    if isinstance(out, Split) and out.dim == 0:
        return LocalOrder(0, root=root, kind=kind)
    if isinstance(out, Tuple) and all(isinstance(i, Split) and i.dim == 0 for i in out.items):
        return Tuple(tuple(LocalOrder(0, root=root, kind="rows") for _ in out.items))
    return None


def escaping_roots(gm: fx.GraphModule, placements: Mapping[fx.Node, Placement]) -> set[str]:
    """The roots of :class:`LocalOrder` values read where the whole value is needed: by a node
    that runs whole, or the program's output."""
    found: set[str] = set()
    for node in gm.graph.nodes:
        placement = placements.get(node)
        if node.op != "output" and not isinstance(placement, (Whole, Partial)):
            continue
        for n in node.all_input_nodes:
            p = placements.get(n)
            for item in p.items if isinstance(p, Tuple) else (p,):
                if isinstance(item, LocalOrder):
                    found.add(item.root)
    return found


__all__ = ["sort", "local_arange", "local_order_placement", "escaping_roots"]
