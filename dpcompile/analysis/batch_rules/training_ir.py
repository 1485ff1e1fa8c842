"""Rules for ops that ``torch.export``'s default (training) IR keeps and the core opset does not
(``aten.linalg_vector_norm``, ``aten.argsort``, ``aten.reshape_as``, ``aten.einsum``, ...), and
for their fx spellings (``x.norm(dim=-1)``, ``torch.argsort``, ``x.reshape_as(y)``).

:mod:`~dpcompile.analysis.batch_rules.table` registers them by op, with every spelling."""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from dpcompile.analysis.batch_rules.context import RuleContext, is_aten, node_shape, normalize_dim
from dpcompile.analysis.placement import Placement, Replicated, Split, Tuple


def _bound(ctx: RuleContext, names: tuple[str, ...]) -> dict[str, Any]:
    """The node's arguments by name: an ATen op's from its schema, an fx spelling's by ``names``
    (the positions of ``torch.<op>(input, ...)``; a method's ``self`` is its first argument)."""
    node = ctx.node
    if is_aten(node) and hasattr(node.target, "_schema"):
        names = tuple(a.name for a in node.target._schema.arguments)
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    return bound


def _others_replicated(ctx: RuleContext) -> bool:
    return all(isinstance(ctx.p(n), Replicated) for n in ctx.node.all_input_nodes[1:])


def norm(ctx: RuleContext) -> Placement | None:
    """``x.norm(p, dim, keepdim)`` / ``torch.linalg.vector_norm(x, ord, dim, keepdim)`` (and their
    ATen ops): a reduction along ``dim``; per sample where ``dim`` is given and is not the batch
    dim. Without ``dim`` it reduces the whole tensor (the batch too): whole."""
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split) or not _others_replicated(ctx):
        return None
    bound = _bound(ctx, ("input", "p", "dim", "keepdim", "dtype"))
    dim, keepdim = bound.get("dim"), bound.get("keepdim", False)
    if dim is None or not isinstance(keepdim, bool):
        return None
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    if not dims:
        return None
    nd, low = ctx.ndim(ctx.tensor_arg()), ctx.min_ndim(ctx.tensor_arg())
    normal = [normalize_dim(d, nd, p.dim, low) for d in dims]
    if any(d is None or d == p.dim for d in normal):
        return None
    if keepdim:
        return p
    return Split(p.dim - sum(1 for d in set(normal) if d < p.dim))


def argsort(ctx: RuleContext) -> Placement | None:
    """``torch.argsort(x, dim=-1)``: the order along a dim of each sample, unless that dim is the batch's."""
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split) or not _others_replicated(ctx):
        return None
    dim = _bound(ctx, ("input", "dim", "descending")).get("dim", -1)
    if isinstance(dim, bool):
        return None
    dim = normalize_dim(dim, ctx.ndim(ctx.tensor_arg()), p.dim, ctx.min_ndim(ctx.tensor_arg()))
    return p if dim is not None and dim != p.dim else None


def shaped_as(ctx: RuleContext) -> Placement | None:
    """``x.reshape_as(y)`` / ``x.view_as(y)``: split as ``x`` where ``y`` is split on the same dim
    and both hold whole samples on it: on dim 0, each device's chunk of ``x`` is then as many
    elements as its chunk of ``y`` (the same samples), in the order of the whole's rows; on a
    later dim, where the shapes are the same."""
    x, other = ctx.node.args[0], ctx.arg(1, "other")
    p, q = ctx.p(x), ctx.p(other)
    if not (isinstance(p, Split) and isinstance(q, Split)):
        return None
    if p.dim == q.dim == 0:
        return Split(0)
    shape_x, shape_y = node_shape(x), node_shape(other) if isinstance(other, fx.Node) else None
    if p.dim == q.dim and shape_x is not None and shape_x == shape_y:
        return Split(p.dim)
    return None


def recurrent(ctx: RuleContext) -> Placement | None:
    """``aten.lstm.input(x, [h, c], params, ..., dropout, train, bidirectional, batch_first)`` and
    ``gru`` / ``rnn_tanh`` / ``rnn_relu`` (a single ``hx``): what ``torch.export`` keeps of an
    ``nn.LSTM`` call. Each sample's sequence runs alone: the output split as ``x`` (on dim 0 with
    ``batch_first``, else 1), each final state on dim 1, where the states are split on dim 1 and the
    weights replicated. Dropout between layers in training draws per device: whole."""
    if getattr(ctx.node.target, "_overloadname", "input") != "input":  # ``.data``: a packed sequence
        return None
    bound = _bound(ctx, ("input", "hx", "params", "has_biases", "num_layers", "dropout", "train", "bidirectional",
                         "batch_first"))  # fmt: skip
    x, hx, params = bound.get("input"), bound.get("hx"), bound.get("params")
    p = ctx.p(x)
    batch = 1 if bound.get("batch_first") is False else 0 if bound.get("batch_first") is True else None
    if not isinstance(p, Split) or p.dim != batch or ctx.ndim(x) != 3 or not isinstance(params, (list, tuple)):
        return None  # an unbatched (2-D) sequence, or the split on the time dim
    if bound.get("dropout") and bound.get("train") is not False:
        return None
    states = list(hx) if isinstance(hx, (list, tuple)) else [hx]
    if not all(isinstance(h, fx.Node) and isinstance(ctx.p(h), Split) and ctx.p(h).dim == 1 for h in states):
        return None
    if not all(isinstance(w, fx.Node) and isinstance(ctx.p(w), Replicated) for w in params):
        return None
    return Tuple((p, *(Split(1) for _ in states)))


__all__ = ["norm", "argsort", "shaped_as", "recurrent"]


def fft(ctx: RuleContext) -> Placement | None:
    """``torch.fft.fft(x, n, dim)`` / ``fft2(x, s, dim)`` / ``fftn(x, s, dim)`` and their real and
    Hermitian forms: transforms along ``dim`` (the last, the last two, or every dim, or the last
    ``len(s)`` for ``*n``), per sample unless the batch dim is among them."""
    p = ctx.p(ctx.tensor_arg())
    if not isinstance(p, Split) or not _others_replicated(ctx):
        return None
    name = _fft_name(ctx)
    bound = _bound(ctx, ("input", "s", "dim", "norm"))
    dim = bound.get("dim")
    nd = ctx.ndim(ctx.tensor_arg())
    if dim is None:
        if name.endswith("2"):
            dim = (-2, -1)
        elif name.endswith("n"):
            s = bound.get("s")
            if not isinstance(s, (list, tuple)) or nd is None:
                return None  # every dim, the batch's too
            dim = tuple(range(nd - len(s), nd))
        else:
            dim = -1
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    low = ctx.min_ndim(ctx.tensor_arg())
    normal = [normalize_dim(d, nd, p.dim, low) for d in dims]
    return p if dims and all(d is not None and d != p.dim for d in normal) else None


def _fft_name(ctx: RuleContext) -> str:
    target = ctx.node.target
    name = getattr(target, "_opname", None) or getattr(target, "__name__", "")
    return name.removeprefix("fft_")


FFTS = "fft ifft rfft irfft hfft ihfft fft2 ifft2 rfft2 irfft2 hfft2 ihfft2 fftn ifftn rfftn irfftn hfftn ihfftn"
