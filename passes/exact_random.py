"""``draw_random_whole``: every random op draws the single-device values (``exact_random=True``).

A lowered program runs a random op once per device (or micro-batch), each drawing its own piece
from the generator: values and generator state then differ from the single-device run. This pass
makes each random site draw its whole tensor once, in program order, and hand every device its
slice (:mod:`dpcompile.runtime.random`). The lowering passes stamped where each piece lies:
``insert_scatter_gather`` its rows (``dpcompile_rows``: device or micro-batch ``k``, batch dim),
``expand_shards`` its columns (``dpcompile_cols``: shard ``k``, dim, sizes).

Before (data parallel on ``["cpu", "cpu"]``)::

    drop_dev0 = replica_dev0.drop(relu_dev0)
    drop_dev1 = replica_dev1.drop(relu_dev1)

After::

    random_draws = dpcompile_runtime_random_draws(x_scatter, 0)
    drop_module = self.drop
    drop_dev0 = dpcompile_runtime_exact_dropout_module(drop_module, random_draws, 'drop', relu_dev0, rows = (0, 0))
    drop_dev1 = dpcompile_runtime_exact_dropout_module(drop_module, random_draws, 'drop', relu_dev1, rows = (1, 0))

A random op this pass cannot make exact (one given a ``generator``; ``torch.poisson`` where its first
piece cannot see every piece's rates: a pipeline's micro-batches, another rank's rows) keeps its
per-device draws; ``info["per_device"]`` names it (``explain`` reports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from dpcompile import runtime
from dpcompile.analysis.random_ops import (
    FILL_ATEN,
    LIKE_FUNCTIONS,
    SPECIAL_DROPOUT_FUNCTIONS,
    SPECIAL_DROPOUT_MODULES,
    called_module,
    called_module_path,
    random_kind,
)
from dpcompile.errors import DpCompileError
from dpcompile.infra import PassResult, stamp

PASS = "draw_random_whole"
ROWS = "dpcompile_rows"
COLS = "dpcompile_cols"
ORDER = "dpcompile_random_order"  # gm.meta: each random op's place in the captured program (number_random_sites)


@dataclass(frozen=True)
class RandomSite:
    """A random op of the lowered program: its ``kind``, and the per-device nodes that run it."""

    source: str  # the user's node (``dpcompile_source``): one whole draw per call
    kind: str  # "dropout" | "dropout_module" | "native_dropout" | "attention" | "like" | "bernoulli" | "fill" | ...
    nodes: tuple[fx.Node, ...]


def find_random_sites(gm: fx.GraphModule, scopes: tuple[str, ...] = ()) -> list[RandomSite]:
    """The random sites of ``gm`` in program order, each with its per-device nodes; a call of a module
    of ``scopes`` (an FSDP block, called whole) is a site of kind ``"scope"``."""
    sites: dict[str, tuple[str, list[fx.Node]]] = {}
    for node in gm.graph.nodes:
        kind = "scope" if node.op == "call_module" and node.target in scopes else random_kind(gm, node)
        if kind is not None and node.meta.get(COLS) == "sections":
            kind = "other"
        if kind is not None:
            source = node.meta.get("dpcompile_source", node.name)
            sites.setdefault(source, (kind, []))[1].append(node)
    return [RandomSite(source, kind, tuple(nodes)) for source, (kind, nodes) in sites.items()]


def number_random_sites(gm: fx.GraphModule) -> PassResult:
    """Record each random op of the captured program by its place in program order
    (``gm.meta[ORDER]``: ``{source: place}``, the source its lowered pieces carry), so that
    ``draw_random_whole`` draws the sites in the user's order even where the lowered program runs a
    later site's piece first (a GPipe stage's first micro-batch running Phi's MLP dropout before
    its attention dropout)."""
    sources = [n.meta.get("dpcompile_source", n.name) for n in gm.graph.nodes if random_kind(gm, n) is not None]
    gm.meta[ORDER] = {source: place for place, source in enumerate(dict.fromkeys(sources))}
    return PassResult(gm, False, {"numbered": len(gm.meta[ORDER])})


def _draw_in_program_order(graph: fx.Graph, sites: list[RandomSite], order: dict[str, int]) -> list[RandomSite]:
    """``sites`` in the captured program's order, each site's pieces moved after the previous site's
    first piece where a lowering ran them earlier, with what uses them before it (Pegasus' decoder
    embedding dropout and the decoder's first layer, which a GPipe stage's first micro-batch ran
    before the encoder's layer, that waits on the padding mask). A piece stays where its users
    cannot move (a write in place, the previous piece among them). Where the sites are not
    numbered (``number_random_sites`` did not run), as they are."""
    if not sites or any(s.source not in order for s in sites):
        return sites
    ordered = sorted(sites, key=lambda s: order[s.source])
    previous: fx.Node | None = None
    for site in ordered:
        if previous is not None:
            place = {n: i for i, n in enumerate(graph.nodes)}
            anchor = previous
            for node in sorted(site.nodes, key=place.__getitem__):
                if place[node] > place[previous]:  # after it already, or moved with an earlier piece
                    continue
                cone = _uses_before(node, previous, place)
                for moved in cone or ():
                    anchor.append(moved)
                    anchor = moved
        place = {n: i for i, n in enumerate(graph.nodes)}
        previous = min(site.nodes, key=place.__getitem__)
    return ordered


def _uses_before(node: fx.Node, limit: fx.Node, place: dict[fx.Node, int]) -> list[fx.Node] | None:
    """``node`` and every node placed before ``limit`` that uses it, directly or through others, in
    graph order: what moves after ``limit`` with it. None where one of them cannot move: ``limit``
    itself, or a write in place (a later read of what it writes could pass it)."""
    cone, todo = {node}, [node]
    while todo:
        for user in todo.pop().users:
            if place[user] < place[limit] and user not in cone:
                cone.add(user)
                todo.append(user)
            elif user is limit:
                return None
    if any(_writes_in_place(n) for n in cone):
        return None
    return sorted(cone, key=place.__getitem__)


def _writes_in_place(node: fx.Node) -> bool:
    if node.op == "call_method":
        return str(node.target).endswith("_") and not str(node.target).endswith("__")
    if node.op != "call_function":
        return node.op == "output"
    schema = getattr(node.target, "_schema", None)
    return node.target in fx.node._side_effectful_functions or (schema is not None and schema.is_mutable)


def draw_random_whole(
    gm: fx.GraphModule, *, rank_batch: tuple[str, int, int] | None = None, planned: bool = False,
    scopes: tuple[str, ...] = (),
) -> PassResult:
    """Rewrite each random site of the lowered ``gm`` to draw its whole tensor once and slice it.

    ``rank_batch=(input, dim, ranks)``: ``gm`` is one data-parallel rank's program over a mesh, fed
    its local batch as ``input`` (split on ``dim``); the global batch is ``ranks`` such batches.
    ``planned``: ``gm`` is a pipeline stage over a mesh, run once per micro-batch; it draws through
    the record its module opens for the call (``current_random_draws()``, every stage's sites in order).
    ``scopes``: paths of modules called whole (FSDP blocks), whose random ops draw through the record too."""
    _refuse_attention_drawing_inside_pieces(gm)
    over_ranks = rank_batch is not None or planned
    sites = [_poisson_joinable(_sized_over_ranks(s, over_ranks), gm.graph, over_ranks=over_ranks)
             for s in find_random_sites(gm, scopes)]  # fmt: skip
    exact = _draw_in_program_order(gm.graph, [s for s in sites if s.kind != "other"], gm.meta.get(ORDER, {}))
    info: dict[str, Any] = {"exact": [s.source for s in exact], "per_device": [s.source for s in sites if s.kind == "other"]}
    if not exact:
        return PassResult(gm, False, info)
    graph = gm.graph
    first = exact[0].nodes[0]
    with graph.inserting_before(first):
        target, args, kwargs = (runtime.current_random_draws, (), {}) if planned else _draws_call(graph, rank_batch)
        draws = _placed_as(stamp(graph.call_function(target, args, kwargs), PASS, first), first)
        draws.name = "random_draws"
    for site in exact:
        module = None
        _size_sequence_pieces_by_the_call(site, graph)
        for node in site.nodes:
            with graph.inserting_before(node):
                if site.kind in ("dropout_module", "special_dropout_module", "scope") and module is None:
                    module = _placed_as(stamp(graph.get_attr(str(called_module_path(node))), PASS, node), node)
                    module.name = f"{site.source}_module"
                new = graph.call_function(*_exact_call(gm, site, node, draws, module))
            stamp(new, PASS, node)
            new.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta", "dpcompile_pass")})
            node.replace_all_uses_with(new)
            name = node.name
            graph.erase_node(node)
            new.name = name
    return PassResult(gm, True, info)


def _refuse_attention_drawing_inside_pieces(gm: fx.GraphModule) -> None:
    """An ``nn.MultiheadAttention`` whose dropout draws inside its call (``decompose_attention`` could
    not write it out) run per micro-batch draws each piece's mask from the generator in turn: not the
    single-device values, and nothing would say so."""
    for node in gm.graph.nodes:
        mha = called_module(gm, node) if node.op == "call_module" and ROWS in node.meta else None
        if isinstance(mha, nn.MultiheadAttention) and mha.dropout and mha.training:
            raise DpCompileError(
                f"'{node.target}' (nn.MultiheadAttention, dropout={mha.dropout}) draws its attention dropout inside "
                "its call, so pieces of the batch run apart cannot draw the single-device mask (only plain "
                "self-attention is written out so they can). Pass exact_random=False (each piece draws its own), "
                "set its dropout to 0, or use data parallelism without a pipeline"
            )


def _exact_call(gm: fx.GraphModule, site: RandomSite, node: fx.Node, draws: fx.Node,
                module: fx.Node | None) -> tuple[Any, tuple, dict]:  # fmt: skip
    """The runtime call that replaces ``node``: target, args, kwargs."""
    where = {k: v for k, v in (("rows", node.meta.get(ROWS)), ("cols", node.meta.get(COLS))) if v is not None}
    head = (draws, site.source)
    args, kwargs = node.args, dict(node.kwargs)
    if site.kind == "dropout_module":
        return runtime.exact_dropout_module, (module, *head, args[-1]), where
    if site.kind == "dropout":
        names = ("input", "p", "training", "inplace") if node.target is F.dropout else ("input", "p", "train")
        bound = {**dict(zip(names, args)), **kwargs}
        p, training = bound.get("p", 0.5), bound.get("training", bound.get("train", True))
        return runtime.exact_dropout, (*head, bound["input"]), {"p": p, "training": training, **where}
    if site.kind == "special_dropout_module":
        variant = SPECIAL_DROPOUT_MODULES[type(called_module(gm, node))]
        return runtime.exact_special_dropout_module, (module, *head, variant, args[-1]), where
    if site.kind == "special_dropout":
        variant = SPECIAL_DROPOUT_FUNCTIONS[node.target]
        return runtime.exact_special_dropout, (*head, variant, *args), {**kwargs, **where}
    if site.kind == "stochastic_depth":
        return runtime.exact_stochastic_depth, (*head, *args), {**kwargs, **where}
    if site.kind == "normal":
        return runtime.exact_normal, (*head, *args), {**kwargs, **where}
    if site.kind == "multinomial":
        return runtime.exact_multinomial, (*head, *args), {**kwargs, **where}
    if site.kind == "normal_size":
        return runtime.exact_normal_size, (*head, *args), {**kwargs, **where}
    if site.kind == "poisson":
        split = any(ROWS in n.meta or isinstance(n.meta.get(COLS), tuple) and n.meta[COLS][1] is not None
                    for n in site.nodes)  # fmt: skip
        pieces = tuple(n.args[0] for n in sorted(site.nodes, key=_piece_index)) if split else (args[0],)
        return runtime.exact_poisson, (*head, args[0]), {"pieces": pieces, **where}
    if site.kind == "scope":
        return runtime.exact_random_scope, (*head, node.meta.get(ROWS), module, *args), kwargs
    if site.kind == "native_dropout":
        return runtime.exact_native_dropout, (*head, *args), {**kwargs, **where}
    if site.kind == "attention":
        return runtime.exact_attention, (*head, *args), {**kwargs, **where}
    if site.kind == "bernoulli":
        return runtime.exact_bernoulli, (*head, args[0]), where
    if site.kind == "written_fill":
        base, steps, op, *rest = args
        return runtime.exact_written_fill, (*head, base, steps, FILL_ATEN.get(op, op), *rest), {**kwargs, **where}
    if site.kind == "fill":
        method = FILL_ATEN.get(node.target, node.target)
        return runtime.exact_fill_random, (*head, method, *args), {**kwargs, **where}
    name = LIKE_FUNCTIONS.get(node.target, "bernoulli")  # a bernoulli(x, p) function or method
    return runtime.exact_random_like, (*head, name, *args), {**kwargs, **where}


def _size_sequence_pieces_by_the_call(site: RandomSite, graph: fx.Graph) -> None:
    """Sequence-parallel pieces (``dpcompile_sequence``) split the call's own sequence length, which
    may differ from the example's: their columns name the pieces' inputs instead of sizes, so the
    runtime reads each piece's length at the call (``cols=(0, -2, (ln_dev0, ln_dev1))``); with data
    parallelism, each copy's pieces (its ``rows``) name their own."""
    if not all(n.meta.get("dpcompile_sequence") and isinstance(n.meta.get(COLS), tuple) and n.meta[COLS][1] is not None
               for n in site.nodes):  # fmt: skip
        return
    copies: dict[Any, list[fx.Node]] = {}
    for node in site.nodes:
        copies.setdefault(node.meta.get(ROWS), []).append(node)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for nodes in copies.values():
        cols = [n.meta[COLS] for n in nodes]
        inputs = [next((a for a in n.all_input_nodes if _on_sequence_shards(a)), None) for n in nodes]
        first = min(order[n] for n in nodes)
        if any(a is None for a in inputs) or sorted(c[0] for c in cols) != list(range(len(cols))) or max(order[a] for a in inputs) > first:
            continue  # not every piece's input is there when the first piece draws: the example's sizes
        if any(len(c[2] or ()) != len(cols) for c in cols):
            continue  # one rank's piece over a mesh: lower_to_collectives sizes it by the call's sequence length
        by_index = tuple(a for _, a in sorted(zip((c[0] for c in cols), inputs)))
        for node, (k, dim, _) in zip(nodes, cols):
            node.meta[COLS] = (k, dim, by_index)


def _on_sequence_shards(node: fx.Node) -> bool:
    """A value of the sequence region, or a piece of a reduce-scatter or split into it."""
    return bool(node.meta.get("dpcompile_sequence") or node.meta.get("dpcompile_sequence_piece"))


def _piece_index(node: fx.Node) -> int:
    where = node.meta.get(ROWS) or node.meta.get(COLS)
    return where[0] if where else 0


def _sized_over_ranks(site: RandomSite, over_ranks: bool) -> RandomSite:
    """Over a mesh a rank's ``torch.normal(mean, std, size)`` not stamped with its rows may be sized by
    the local batch (a factory has no batch rule), where eager's is the global one: per device, named."""
    if site.kind == "normal_size" and over_ranks and not any(ROWS in n.meta for n in site.nodes):
        return RandomSite(site.source, "other", site.nodes)
    return site


def _poisson_joinable(site: RandomSite, graph: fx.Graph, *, over_ranks: bool) -> RandomSite:
    """A ``torch.poisson`` site draws exactly only where its first piece can see every piece's rates
    (their number of draws depends on them): one piece per device, split one way, each rate computed
    before the first draw; else (a pipeline's micro-batches, another rank's rows) it stays per device."""
    if site.kind != "poisson":
        return site
    rows = [n.meta.get(ROWS) for n in site.nodes]
    cols = [n.meta.get(COLS) if isinstance(n.meta.get(COLS), tuple) and n.meta[COLS][1] is not None else None
            for n in site.nodes]  # fmt: skip
    split = any(rows) or any(cols)
    one_way = not (any(rows) and any(cols)) and not (over_ranks and split)
    indices = sorted(_piece_index(n) for n in site.nodes)
    complete = indices == list(range(len(site.nodes))) and all(c is None or len(c[2]) == len(site.nodes) for c in cols)
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(order[n] for n in site.nodes)
    ready = all(not isinstance(n.args[0], fx.Node) or order[n.args[0]] < first for n in site.nodes)
    if one_way and (complete or not split) and ready:
        return site
    return RandomSite(site.source, "other", site.nodes)


def _draws_call(graph: fx.Graph, rank_batch: tuple[str, int, int] | None) -> tuple[Any, tuple, dict]:
    """The call that opens one call's record of draws, knowing the batch's split (over ranks, with a
    site whose rows are not placed: ``unplaced=True``, so that its refusal leaves the generator as it was)."""
    if rank_batch is not None:
        name, dim, ranks = rank_batch
        local = next((n for n in graph.nodes if n.op == "placeholder" and n.target == name), None)
        unplaced = any(isinstance(n.meta.get(ROWS), tuple) and n.meta[ROWS][1] is None for n in graph.nodes)
        return runtime.random_draws_over_ranks, (local, dim, ranks), {"unplaced": True} if unplaced else {}
    scatter = _batch_scatter(graph)
    args = (scatter, scatter.args[2] if len(scatter.args) > 2 else 0) if scatter is not None else ()
    return runtime.random_draws, args, {}


def _batch_scatter(graph: fx.Graph) -> fx.Node | None:
    """The scatter whose pieces give the batch's split: of a required input where there is one (an
    optional one may be None)."""
    scatters = [n for n in graph.nodes if n.op == "call_function" and n.target is runtime.scatter]
    required = [n for n in scatters if _is_required_input(n.args[0])]
    return (required or scatters or [None])[0]


def _is_required_input(value: Any) -> bool:
    """Whether ``value`` is an input without a default, seen through its move onto a device (a copy
    of a tensor-parallel program over ``dp`` scatters ``to_device(x)``: timm's ViT's ``attn_mask``,
    None, came first and gave no rows)."""
    while isinstance(value, fx.Node) and value.op == "call_function" and value.target is runtime.to_device:
        value = value.args[0]
    return isinstance(value, fx.Node) and value.op == "placeholder" and not value.args


def _placed_as(new: fx.Node, node: fx.Node) -> fx.Node:
    """``new`` on ``node``'s pipeline stage and device slot (the schedules run a node by its stage)."""
    new.meta.update({k: node.meta[k] for k in ("dpcompile_stage", "dpcompile_slot") if k in node.meta})
    return new


__all__ = ["PASS", "RandomSite", "draw_random_whole", "find_random_sites"]
