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
    drop_dev0 = dpcompile_runtime_exact_dropout(random_draws, 'drop', relu_dev0, drop_module, rows = (0, 0))
    drop_dev1 = dpcompile_runtime_exact_dropout(random_draws, 'drop', relu_dev1, drop_module, rows = (1, 0))

A random op this pass does not know (``nn.Dropout2d``, ``torch.multinomial``) keeps its per-device
draws; ``info["per_device"]`` names it (``explain`` reports it).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from dpcompile import runtime
from dpcompile.infra import PassResult, stamp

PASS = "draw_random_whole"
ROWS = "dpcompile_rows"
COLS = "dpcompile_cols"

aten = torch.ops.aten
_DROPOUT = {F.dropout, torch.dropout, aten.dropout.default}
_ATTENTION = {F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default}
_LIKE = {torch.rand_like: "rand_like", torch.randn_like: "randn_like", torch.randint_like: "randint_like",
         aten.rand_like.default: "rand_like", aten.randn_like.default: "randn_like",
         aten.randint_like.default: "randint_like", aten.randint_like.low_dtype: "randint_like",
         aten.bernoulli.p: "bernoulli"}  # fmt: skip
_FILL_METHODS = {"normal_", "uniform_", "bernoulli_", "exponential_", "random_"}
_FILL_ATEN = {aten.normal_.default: "normal_", aten.uniform_.default: "uniform_", aten.bernoulli_.float: "bernoulli_"}
# kinds of random op the runtime knows nothing about: they keep per-device draws, and are named
_OTHER_RANDOM = {torch.multinomial, torch.normal, torch.poisson, F.dropout1d, F.dropout2d, F.dropout3d,
                 F.alpha_dropout, F.feature_alpha_dropout}  # fmt: skip
_OTHER_MODULES = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


@dataclass(frozen=True)
class RandomSite:
    """A random op of the lowered program: its ``kind``, and the per-device nodes that run it."""

    source: str  # the user's node (``dpcompile_source``): one whole draw per call
    kind: str  # "dropout" | "dropout_module" | "native_dropout" | "attention" | "like" | "bernoulli" | "fill"
    nodes: tuple[fx.Node, ...]


def random_kind(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The kind of random op ``node`` runs ("other" for one this pass cannot make exact), or None."""
    if node.op == "call_function":
        target = node.target
        if target in _DROPOUT:
            return "dropout"
        if target is aten.native_dropout.default:
            return "native_dropout"
        if target in _ATTENTION or getattr(target, "__name__", "") == "scaled_dot_product_attention":
            p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
            return None if p == 0 else "attention"
        if target in _LIKE:
            return "like"
        if target in (torch.bernoulli, aten.bernoulli.default):
            return "like" if len(node.args) > 1 or "p" in node.kwargs else "bernoulli"
        if target in _FILL_ATEN:
            return "fill"
        return "other" if target in _OTHER_RANDOM else None
    if node.op in ("call_module", "call_method"):
        module = _module(gm, node)
        if module is not None:
            if type(module) is nn.Dropout:
                return "dropout_module"
            return "other" if isinstance(module, _OTHER_MODULES) else None
    if node.op == "call_method":
        if node.target in _FILL_METHODS:
            return "fill"
        if node.target == "bernoulli":
            return "like" if len(node.args) > 1 or "p" in node.kwargs else "bernoulli"
    return None


def find_random_sites(gm: fx.GraphModule) -> list[RandomSite]:
    """The random sites of ``gm`` in program order, each with its per-device nodes."""
    sites: dict[str, tuple[str, list[fx.Node]]] = {}
    for node in gm.graph.nodes:
        kind = random_kind(gm, node)
        if kind is not None and node.meta.get(COLS) == "sections":
            kind = "other"
        if kind is not None:
            source = node.meta.get("dpcompile_source", node.name)
            sites.setdefault(source, (kind, []))[1].append(node)
    return [RandomSite(source, kind, tuple(nodes)) for source, (kind, nodes) in sites.items()]


def draw_random_whole(gm: fx.GraphModule) -> PassResult:
    """Rewrite each random site of the lowered ``gm`` to draw its whole tensor once and slice it."""
    sites = find_random_sites(gm)
    exact = [s for s in sites if s.kind != "other"]
    info: dict[str, Any] = {"exact": [s.source for s in exact], "per_device": [s.source for s in sites if s.kind == "other"]}
    if not exact:
        return PassResult(gm, False, info)
    graph = gm.graph
    first = exact[0].nodes[0]
    scatter = next((n for n in graph.nodes if n.op == "call_function" and n.target is runtime.scatter), None)
    with graph.inserting_before(first):
        args = (scatter, scatter.args[2] if len(scatter.args) > 2 else 0) if scatter is not None else ()
        draws = _placed_as(stamp(graph.call_function(runtime.random_draws, args), PASS, first), first)
        draws.name = "random_draws"
    for site in exact:
        module = None
        for node in site.nodes:
            with graph.inserting_before(node):
                if site.kind == "dropout_module" and module is None:
                    module = _placed_as(stamp(graph.get_attr(str(_module_path(node))), PASS, node), node)
                    module.name = f"{site.source}_module"
                new = graph.call_function(*_exact_call(site, node, draws, module))
            stamp(new, PASS, node)
            new.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta", "dpcompile_pass")})
            node.replace_all_uses_with(new)
            name = node.name
            graph.erase_node(node)
            new.name = name
    return PassResult(gm, True, info)


def _exact_call(site: RandomSite, node: fx.Node, draws: fx.Node, module: fx.Node | None) -> tuple[Any, tuple, dict]:
    """The runtime call that replaces ``node``: target, args, kwargs."""
    where = {k: v for k, v in (("rows", node.meta.get(ROWS)), ("cols", node.meta.get(COLS))) if v is not None}
    head = (draws, site.source)
    args, kwargs = node.args, dict(node.kwargs)
    if site.kind == "dropout_module":
        return runtime.exact_dropout, (*head, args[-1], module), where
    if site.kind == "dropout":
        names = ("input", "p", "training", "inplace") if node.target is F.dropout else ("input", "p", "train")
        bound = {**dict(zip(names, args)), **kwargs}
        p, training = bound.get("p", 0.5), bound.get("training", bound.get("train", True))
        return runtime.exact_dropout, (*head, bound["input"], p, training), where
    if site.kind == "native_dropout":
        return runtime.exact_native_dropout, (*head, *args), {**kwargs, **where}
    if site.kind == "attention":
        return runtime.exact_attention, (*head, *args), {**kwargs, **where}
    if site.kind == "bernoulli":
        return runtime.exact_bernoulli, (*head, args[0]), where
    if site.kind == "fill":
        method = _FILL_ATEN.get(node.target, node.target)
        return runtime.exact_fill_random, (*head, method, *args), {**kwargs, **where}
    name = _LIKE.get(node.target, "bernoulli")  # a bernoulli(x, p) function or method
    return runtime.exact_random_like, (*head, name, *args), {**kwargs, **where}


def _placed_as(new: fx.Node, node: fx.Node) -> fx.Node:
    """``new`` on ``node``'s pipeline stage and device slot (the schedules run a node by its stage)."""
    new.meta.update({k: node.meta[k] for k in ("dpcompile_stage", "dpcompile_slot") if k in node.meta})
    return new


def _module(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    path = _module_path(node)
    if path is None:
        return None
    try:
        return gm.get_submodule(path)
    except AttributeError:
        return None


def _module_path(node: fx.Node) -> str | None:
    """The module a call runs: ``self.drop(x)``, or a replica's ``replica_dev1.drop(x)``."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "call_method" and isinstance(node.args[0], fx.Node):
        root = node.args[0]
        if root.op == "call_function" and root.target is operator.getitem and _is_replicas(root.args[0]):
            return str(node.target)
    return None


def _is_replicas(value: Any) -> bool:
    return isinstance(value, fx.Node) and value.op == "call_function" and value.target is runtime.replicate


__all__ = ["PASS", "RandomSite", "draw_random_whole", "find_random_sites", "random_kind"]
