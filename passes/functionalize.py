"""``functionalize_mutations``: writes into tensors made explicit, so each device writes its own slice.

Before (transformers' ``shift_tokens_right``, captured by fx)::

    def forward(self, labels):
        new_zeros = labels.new_zeros(getattr_1)
        getitem = labels[(slice(None, None, None), slice(None, -1, None))]
        clone = getitem.clone()
        setitem = operator.setitem(new_zeros, (slice(None, None, None), slice(1, None, None)), clone)
        setitem_1 = operator.setitem(new_zeros, (slice(None, None, None), 0), 2)
        eq = new_zeros == -100
        masked_fill_ = new_zeros.masked_fill_(eq, 1)
        return self.emb(new_zeros)

After::

    def forward(self, labels):
        new_zeros = labels.new_zeros(getattr_1)
        getitem = labels[(slice(None, None, None), slice(None, -1, None))]
        clone = getitem.clone()
        setitem = dpcompile_runtime_written(new_zeros, [], operator.setitem, (slice(None, None, None), slice(1, None, None)), clone)
        setitem_1 = dpcompile_runtime_written(setitem, [], operator.setitem, (slice(None, None, None), 0), 2)
        eq = setitem_1 == -100
        masked_fill_ = setitem_1.masked_fill(eq, 1)
        return self.emb(masked_fill_)

A write through a view (``aten.copy_(aten.slice(t, 1, 1), src)`` in an exported graph) becomes
``written(t, [(aten.slice.Tensor, (1, 1))], aten.copy_.default, src)``; an in-place op on a whole
tensor becomes its out-of-place twin where there is one (``silu_`` -> ``silu``). Later reads of
the tensor read the written value, so batch rules see a plain data flow, and a mutation of a
split value runs on every device's own chunk instead of on a gathered copy.

A view of the tensor made before the write and read after it is made again from the written value
(as ``torch.func.functionalize`` regenerates views). Whether ``reshape``, ``contiguous`` or ``to``
returned a view is read from the shapes propagated on the examples (shared storage).
With ``inputs=True`` (data parallelism) a write into an input is made functional too, and the
input's last value is copied into the caller's tensor at the end: ``write_back(x, written)``.

A write is left as it is where that could change what the program computes: into a parameter or a
buffer (the caller sees those), or an input without ``inputs``; through an op that may or may not
copy, with no shapes to tell; or where a view read after the write cannot be made again (a write's
result). :func:`refuse_lost_writes` then refuses, at lowering, a write data parallelism would make
into a gathered copy while the original is still read.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from dpcompile.analysis.placement import BatchSize, Replicated, Whole
from dpcompile.errors import DpCompileError
from dpcompile.infra import PassResult, stamp
from dpcompile.runtime import write_back, written

PASS = "functionalize_mutations"
aten = torch.ops.aten

# ops whose result always shares memory with their first argument (``detach`` too: nn.Embedding's max_norm
# renormalises ``weight.detach()`` in place, a write into the weight, whatever fake shapes' storages say)
_VIEW_METHODS = frozenset(
    {"view", "transpose", "permute", "unsqueeze", "squeeze", "expand", "narrow", "select", "t", "unflatten",
     "diagonal", "movedim", "unfold", "view_as", "expand_as", "swapaxes", "as_strided", "detach"}
)  # fmt: skip
_VIEW_FUNCTIONS = frozenset(
    {torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze, torch.narrow, torch.select, torch.t,
     torch.diagonal, torch.movedim, torch.moveaxis, torch.swapaxes, torch.swapdims, torch.as_strided,
     torch.unflatten, torch.adjoint}
)  # fmt: skip
_VIEW_ATEN = frozenset(
    {aten.slice, aten.select, aten.view, aten.unsqueeze, aten.squeeze, aten.transpose, aten.permute, aten.expand,
     aten.t, aten.alias, aten.diagonal, aten.narrow, aten.unfold, aten.as_strided, aten.detach}
)  # fmt: skip
# ops that return their argument itself or a copy, depending on values: a write through them is left alone
_MAYBE_VIEW_METHODS = frozenset(
    {"reshape", "flatten", "contiguous", "to", "type_as", "float", "half", "double", "bfloat16", "long", "int",
     "bool", "type", "reshape_as", "cuda", "cpu", "data", "chunk", "split", "unbind", "tensor_split"}
)  # fmt: skip
_MAYBE_VIEW_ATEN = frozenset({aten.reshape, aten.contiguous, aten.flatten, aten._to_copy, aten.to, aten.split,
                              aten.chunk, aten.unbind, aten.split_with_sizes, aten.lift_fresh})  # fmt: skip
# in-place methods that are not writes into the batch's values
_NOT_WRITES = frozenset({"requires_grad_", "retain_grad_", "share_memory_", "record_stream_", "resize_", "set_", "_"})
_INPLACE_FUNCTIONS = frozenset(
    {F.relu, F.relu6, F.elu, F.selu, F.celu, F.leaky_relu, F.hardtanh, F.hardswish, F.hardsigmoid, F.silu, F.mish,
     F.rrelu, F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.threshold}
)  # fmt: skip


@dataclass
class Mutation:
    """One write: ``op`` into ``base`` seen through ``chain`` (view nodes, base first)."""

    node: fx.Node
    base: fx.Node
    chain: list[fx.Node]
    op: Any  # what ``written`` calls: a Tensor method's name or an ATen op
    rest: tuple[Any, ...]  # op's arguments after the written tensor
    kwargs: dict[str, Any]
    twin: Any = None  # an out-of-place op giving the same value (no chain): ``(op, is_method)``
    stale: tuple[fx.Node, ...] = ()  # views of ``base`` made before the write and read after: made again


def _is_view(node: fx.Node) -> bool | None:
    """True where ``node`` is surely a view of its first argument, None where it may be one, False otherwise.

    Where the syntax leaves it open (``reshape``, ``contiguous``, ``to``: a view or a copy depending on
    strides), the shapes propagated on the examples say which it was: whether ``node``'s value shares
    its first argument's storage."""
    syntactic = _is_view_by_syntax(node)
    if syntactic is None and _write_of(node) is None:
        return _shares_storage(node)
    return syntactic


def _shares_storage(node: fx.Node) -> bool | None:
    """Whether ``node``'s value shares memory with its first argument's, as the examples ran (None: unknown)."""
    value = node.meta.get("val")
    source = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    if not isinstance(value, torch.Tensor) or not isinstance(source, torch.Tensor):
        return None
    try:
        return StorageWeakRef(value.untyped_storage()) == StorageWeakRef(source.untyped_storage())
    except (RuntimeError, NotImplementedError):  # a tensor with no storage (sparse, nested)
        return None


def _is_view_by_syntax(node: fx.Node) -> bool | None:
    if node.op == "call_method":
        if node.target in _VIEW_METHODS:
            return True if not node.kwargs else None
        return None if node.target in _MAYBE_VIEW_METHODS or str(node.target).endswith("_") else False
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        base, index = node.args
        if not isinstance(base, fx.Node):
            return False
        value = base.meta.get("val", ...)
        if isinstance(value, (tuple, list)) and isinstance(index, int) and _returns_fresh(base):
            return False  # one result of an op that returns new tensors (topk's values), not a view
        known_tensor = isinstance(value, torch.Tensor) or (value is ... and isinstance(index, tuple))
        return True if known_tensor and _is_basic_index(index) else None
    if target is getattr:
        return None if node.args[1] in ("T", "mT", "H", "real", "imag", "data") else False
    if target in _VIEW_FUNCTIONS:
        return True if not node.kwargs else None
    if isinstance(target, torch._ops.OpOverload):
        packet = target.overloadpacket
        if packet in _VIEW_ATEN:
            return True if not node.kwargs else None
        if packet in _MAYBE_VIEW_ATEN or _aten_inplace(target):
            return None
    return False


def _returns_fresh(node: fx.Node) -> bool:
    """Whether ``node`` is an ATen op none of whose results alias an argument (``topk``, not ``chunk``)."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and not _aten_inplace(target)
        and all(r.alias_info is None for r in target._schema.returns)
    )


def _is_basic_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) and not isinstance(i, bool) for i in items)


def _aten_inplace(target: Any) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    return (
        bool(schema.arguments)
        and schema.arguments[0].alias_info is not None
        and schema.arguments[0].alias_info.is_write
    )


def _write_of(node: fx.Node) -> tuple[Any, Any, tuple, dict] | None:
    """``(written tensor, callable, other args, kwargs)`` where ``node`` writes into its first argument."""
    if node.op == "call_function" and node.target is operator.setitem:
        return node.args[0], "__setitem__", tuple(node.args[1:]), dict(node.kwargs)
    if node.op == "call_method":
        name = str(node.target)
        if name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES and hasattr(torch.Tensor, name):
            return node.args[0], name, tuple(node.args[1:]), dict(node.kwargs)
        return None
    if node.op == "call_function" and node.target in _INPLACE_FUNCTIONS and node.kwargs.get("inplace") is True:
        return node.args[0], node.target, tuple(node.args[1:]), dict(node.kwargs)
    if (
        node.op == "call_function"
        and _aten_inplace(node.target)
        and node.target.overloadpacket not in (aten.set_, aten.resize_)
    ):
        return node.args[0], node.target, tuple(node.args[1:]), dict(node.kwargs)
    return None


# no out-of-place op computes these writes' result: ``x.bernoulli_(p)`` draws in ``x``'s memory order,
# ``x.bernoulli(p)`` in its index order (a transposed ``x`` gets other values)
_NO_TWIN = frozenset({"copy", "fill", "zero", "bernoulli"})


def _out_of_place_twin(node: fx.Node) -> tuple[Any, str] | None:
    """The op computing an in-place op's result out of place: ``("silu", "call_method")``."""
    if node.op == "call_method":
        name = str(node.target)[:-1]
        return (name, "call_method") if name not in _NO_TWIN and hasattr(torch.Tensor, name) else None
    if node.op == "call_function" and node.target in _INPLACE_FUNCTIONS:
        return node.target, "call_function"
    if isinstance(node.target, torch._ops.OpOverload):
        packet = getattr(aten, node.target.overloadpacket.__name__[:-1], None)
        if packet is not None and packet.__name__ not in ("copy", "fill", "zero", "index_put"):
            overload = getattr(packet, node.target._overloadname, None)
            if overload is not None:
                return overload, "call_function"
    return None


def _analyse(node: fx.Node, order: dict[fx.Node, int], inputs: bool = False) -> Mutation | None:
    """The write ``node`` makes, where it can be made functional (into an input too with ``inputs``); None otherwise."""
    write = _write_of(node)
    if write is None or not isinstance(write[0], fx.Node):
        return None
    target, op, rest, kwargs = write
    chain: list[fx.Node] = []
    base = target
    while (view := _is_view(base)) is True:
        chain.insert(0, base)
        base = base.args[0]
    kept = ("get_attr",) if inputs else ("placeholder", "get_attr")
    stale = _stale_views(base, node, order)
    if view is None or base.op in kept or stale is None:
        return None
    twin = _out_of_place_twin(node) if not chain and op != "__setitem__" else None
    if twin is None and not isinstance(op, (str, torch._ops.OpOverload)):
        return None  # F.silu(x[:, 0], inplace=True): no name generated code can call it by
    return Mutation(node, base, chain, op, rest, kwargs, twin, tuple(stale))


def find_mutations(gm: fx.GraphModule, *, inputs: bool = False) -> list[Mutation]:
    """Every write into a tensor the program made itself (or an input, with ``inputs``) that can be
    made functional, in order."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [m for node in gm.graph.nodes if (m := _analyse(node, order, inputs)) is not None]


def _aliases(base: fx.Node) -> list[fx.Node]:
    """Values that may share memory with ``base``: its views, views of those, and writes' results."""
    out: list[fx.Node] = []
    stack = [base]
    while stack:
        tensor = stack.pop()
        for user in tensor.users:
            if user in out or not user.args or user.args[0] is not tensor:
                continue
            if _is_view(user) is not False or _write_of(user) is not None:
                out.append(user)
                stack.append(user)
    return out


def _stale_views(base: fx.Node, write: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node] | None:
    """The aliases of ``base`` made before ``write`` and read after it, which the functional program
    makes again from the written value (as ``torch.func.functionalize`` does); None where one of them
    is not surely a view of ``base`` (a write's result, a ``reshape`` that may copy)."""
    at = order[write]
    stale = []
    for alias in _aliases(base):
        if alias is write or order[alias] > at or not any(order[u] > at for u in alias.users if u is not write):
            continue
        if any(_is_view(link) is not True or _write_of(link) is not None for link in _view_path(base, alias)):
            return None
        stale.append(alias)
    return sorted(stale, key=order.__getitem__)


def _view_path(base: fx.Node, alias: fx.Node) -> list[fx.Node]:
    """The nodes from ``base`` (excluded) to its alias ``alias`` (included), base first."""
    path = [alias]
    while path[0].args and path[0].args[0] is not base:
        path.insert(0, path[0].args[0])
    return path


def functionalize_mutations(gm: fx.GraphModule, *, inputs: bool = False) -> PassResult:
    """Replace each write :func:`find_mutations` finds by the value it produces (see the module docstring).

    With ``inputs`` a write into an input is made functional too, and the input's last value is
    copied into the caller's tensor at the end (``write_back(x, mul)``), as eager's write lands there:
    data parallelism writes each device's slice, then the gathered whole, not into a scattered copy."""
    graph = gm.graph
    done: list[str] = []
    inputs_written: dict[fx.Node, fx.Node] = {}  # an input's current value -> the input
    for node in [n for n in graph.nodes if _write_of(n) is not None]:
        m = _analyse(node, {n: i for i, n in enumerate(graph.nodes)}, inputs)
        if m is not None:
            done.append(m.node.name)
            origin = m.base if m.base.op == "placeholder" else inputs_written.pop(m.base, None)
            value = _replace(graph, m)
            if origin is not None:
                inputs_written[value] = origin
    output = next(n for n in graph.nodes if n.op == "output")
    for value, placeholder in inputs_written.items():
        with graph.inserting_before(output):
            stamp(graph.call_function(write_back, (placeholder, value)), PASS, value)
    return PassResult(gm, bool(done), {"functionalized": done, "written_back": [p.name for p in inputs_written.values()]})


def _replace(graph: fx.Graph, m: Mutation) -> fx.Node:
    order = {n: i for i, n in enumerate(graph.nodes)}
    with graph.inserting_before(m.node):
        if m.twin is not None:
            op, kind = m.twin
            kwargs = {k: v for k, v in m.kwargs.items() if k != "inplace"}
            value = graph.create_node(kind, op, (m.base, *m.rest), kwargs)
        else:
            steps = [_step(view) for view in m.chain]
            value = graph.call_function(written, (m.base, steps, m.op, *m.rest), m.kwargs)
    stamp(value, PASS, m.node)
    value.meta["dpcompile_source"] = value.name  # the written op's node is erased: the stage plan knows this one
    for key in ("val", "tensor_meta"):  # the written tensor keeps its shape and dtype
        if key in m.base.meta:
            value.meta[key] = m.base.meta[key]
    for user in list(m.base.users):
        if user is not value and order.get(user, -1) > order[m.node]:
            user.replace_input_with(m.base, value)
    made: dict[fx.Node, fx.Node] = {m.base: value}
    for alias in m.stale:  # a view read after the write reads the written value: made again from it
        with graph.inserting_before(m.node):
            for link in _view_path(m.base, alias):
                if link not in made:
                    made[link] = graph.node_copy(link, lambda n: made.get(n, n))
        for user in list(alias.users):
            if user is not m.node and order.get(user, -1) > order[m.node]:
                user.replace_input_with(alias, made[alias])
    if m.node.users:
        result: fx.Node = value
        if m.chain:  # the write's own result: the written view, read again from the new value
            with graph.inserting_before(m.node):
                for link in m.chain:
                    result = graph.node_copy(link, lambda n, link=link, prev=result: prev if n is link.args[0] else n)
        m.node.replace_all_uses_with(result)
    graph.erase_node(m.node)
    for link in reversed(m.chain):
        if not link.users:
            graph.erase_node(link)
    return value


def _step(view: fx.Node) -> tuple[Any, tuple[Any, ...]]:
    """A view node as ``(callable, arguments after the tensor)`` for :func:`~dpcompile.runtime.written`."""
    if view.op == "call_method":
        return str(view.target), tuple(view.args[1:])
    if view.target is operator.getitem:
        return "__getitem__", tuple(view.args[1:])
    if isinstance(view.target, torch._ops.OpOverload):
        return view.target, tuple(view.args[1:])
    return view.target.__name__, tuple(view.args[1:])  # torch.transpose(x, 0, 1) as x.transpose(0, 1)


# ---------------------------------------------------------------- writes data parallelism would lose
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n(?P<code>[^\n]*)')
_SKIPPED_DIRS = (str(Path(torch.__file__).parent) + "/", str(Path(__file__).parent) + "/",
                 str(Path(__file__).parent.parent / "dpcompile") + "/")  # fmt: skip


def _per_device(placement: Any) -> bool:
    """Whether a value lives as per-device pieces (split, partial sums), not whole or replicated."""
    return placement is not None and not isinstance(placement, (Whole, Replicated, BatchSize))


def find_lost_writes(gm: fx.GraphModule, placements: Mapping[fx.Node, Any]) -> list[fx.Node]:
    """The writes left in place that data parallelism, with these placements, would make into a
    copy while the program (or the caller, for an input) still reads the original afterwards:

    * a write that runs whole (its view has no batch rule: ``torch.diagonal(h).zero_()``) into a
      view of a value split across devices: it lands in the gathered copy, not in the slices;
    * a write that runs on each device's slice while a gathered copy made before it is read after.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    lost = []
    for node in gm.graph.nodes:
        write = _write_of(node)
        if write is None or not isinstance(write[0], fx.Node):
            continue
        path = [write[0]]
        while _is_view(path[-1]) is not False and path[-1].args and isinstance(path[-1].args[0], fx.Node):
            path.append(path[-1].args[0])
        root, at = path[-1], order[node]
        if not any(_per_device(placements.get(n)) for n in path):
            continue  # a whole or replicated value: every copy is written
        earlier = [a for a in (root, *_aliases(root)) if a is not node and order[a] < at]
        if isinstance(placements.get(node), Whole):
            if root.op == "placeholder" or any(order[u] > at for a in earlier for u in a.users if u is not node):
                lost.append(node)
        elif any(_stale_copy(a, placements, order, at) for a in earlier):
            lost.append(node)
    return lost


def _stale_copy(alias: fx.Node, placements: Mapping[fx.Node, Any], order: dict[fx.Node, int], at: int) -> bool:
    """Whether a whole copy of ``alias`` made before position ``at`` is read after it."""
    later_whole = [u for u in alias.users if order[u] > at and isinstance(placements.get(u), Whole)]
    if isinstance(placements.get(alias), Whole):
        return any(order[u] > at for u in alias.users)
    earlier_whole = [u for u in alias.users if order[u] < at and isinstance(placements.get(u), Whole)]
    return bool(earlier_whole and later_whole)


def refuse_lost_writes(gm: fx.GraphModule, placements: Mapping[fx.Node, Any]) -> None:
    """Raise :class:`~dpcompile.errors.DpCompileError` naming the first write :func:`find_lost_writes` finds."""
    lost = find_lost_writes(gm, placements)
    if not lost:
        return
    node = lost[0]
    op = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    where = source_line(node)
    raise DpCompileError(
        f"data parallelism cannot split the in-place write '{op}' ({node.name})"
        f"{' at ' + where if where else ''}: it writes through a view of a value split across the devices "
        "that runs on a gathered copy (or while a gathered copy is read later), so the write would not land "
        "in every device's slice. Write it out of place (h = h.clone(); ...; or torch.diagonal_scatter / "
        "select_scatter / slice_scatter), write through a view the batch rules split, or register a batch "
        "rule for the view (dpcompile.register_batch_rule)"
    )


def source_line(node: fx.Node) -> str | None:
    """``"model.py:42 in forward: h[:, 0].mul_(2)"``: the user's frame in ``node``'s stack trace."""
    for m in reversed(list(_FRAME.finditer(node.meta.get("stack_trace") or ""))):
        if m.group("file").startswith(_SKIPPED_DIRS) or m.group("file").startswith("<"):
            continue
        return f"{m.group('file').rsplit('/', 1)[-1]}:{m.group('line')} in {m.group('func')}: {m.group('code').strip()}"
    return None
