"""``choose_context_exchanges``: which exchange runs each context-parallel attention call.

It runs on the program ``insert_sequence_exchange`` marked, before ``insert_scatter_gather``, where
every attention call still has its shapes: for each call it asks the cost model
(:func:`dpcompile.analysis.context_exchange.choose_exchange`) which exchange runs it, and records
the :class:`ExchangeChoice` on the module (``gm.meta[CHOICES]``) by the call's name, with the
shapes the all-to-all's lowering reads (``gm.meta[SHAPES]``). The costs use the machine's cached
mesh calibration where one exists (``calibrate_mesh`` of ``world`` ranks; nothing is measured here),
else the reference gloo figures; under ``memory_per_device=`` an exchange fits where its transient is
no more than the all-gather's (which the planner's prediction holds) plus the headroom the budget
leaves (``options.memory_headroom``). The lowerings of the ring
(``passes/ring_exchange.py``) and of the all-to-all (``passes/all_to_all_exchange.py``) rewrite the
calls chosen for them; the rest keep the all-gather. What an exchange cannot serve (the ring:
dropout, a mask that needs a gradient, a dtype but float32/float64, another device type, keys whose
sequence dim is not ``-2``; the all-to-all: heads that do not divide, a mask of other heads) is a
reason the cost model passes it over for, under ``"auto"``; the ring asked for by name where it
cannot serve is a ``DpCompileError`` naming the call (the all-to-all's lowering refuses its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from dpcompile import runtime
from dpcompile.analysis.batch_rules.attention import sdpa_arguments
from dpcompile.analysis.batch_rules.context import node_shape
from dpcompile.analysis.calibration import cached_mesh
from dpcompile.analysis.context_exchange import (
    CHOICES_META,
    AttentionShape,
    ContextParallelOptions,
    ExchangeChoice,
    choose_exchange,
    exchange_costs,
)
from dpcompile.analysis.heads_exchange import all_to_all_applies
from dpcompile.analysis.sequence_exchange import is_sequence_marker
from dpcompile.errors import DpCompileError
from dpcompile.infra import PassResult
from dpcompile.runtime.sequence_ring import RING_KWARGS
from passes.context_parallel import SDPA_TARGETS

PASS = "choose_context_exchanges"
#: ``gm.meta`` key: {attention call's name: ExchangeChoice}
CHOICES = CHOICES_META
#: ``gm.meta`` key: {attention call's name: (query, key, mask shapes, dropout_p)}, for the all-to-all's lowering
SHAPES = "dpcompile_attention_shapes"


@dataclass(frozen=True)
class ExchangeSite:
    """One marked attention call: its node, its shape over the whole sequence, why the ring cannot
    serve it, and what the all-to-all reads (the query, key and mask shapes, the keys' sequence
    dim, ``dropout_p``)."""

    node: fx.Node
    shape: AttentionShape
    ring_cannot: str | None
    shapes: tuple[Any, Any, Any, Any]  # (query, key, mask, dropout_p)
    key_dim: int


def call_name(node: fx.Node) -> str:
    """The attention call a node is (or was lowered from): its source's name."""
    return str(node.meta.get("dpcompile_source", node.name))


def _unmarked(value: Any) -> Any:
    return value.args[0] if isinstance(value, fx.Node) and is_sequence_marker(value) else value


def _tensor_meta(value: Any) -> tuple[torch.dtype | None, bool, str | None]:
    """``(dtype, requires_grad, device type)`` of a node from shape propagation (unknowns: None)."""
    if not isinstance(value, fx.Node):
        return None, False, None
    val = value.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dtype, bool(val.requires_grad), val.device.type
    tm = value.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "dtype"):
        return tm.dtype, bool(getattr(tm, "requires_grad", False)), None
    return None, False, None


def _arguments(node: fx.Node) -> dict[str, Any] | None:
    """A marked attention call's arguments by name (keys and values behind their markers), or None."""
    if node.op != "call_function":
        return None
    if node.target is runtime.causal_attention:
        bound = {"query": node.args[0], "key": node.args[1], "value": node.args[2], **node.kwargs}
    elif node.target in SDPA_TARGETS:
        bound = sdpa_arguments(node)
    else:
        return None
    if not (isinstance(bound.get("key"), fx.Node) and is_sequence_marker(bound["key"])):
        return None
    return bound


def _ring_cannot(bound: dict[str, Any], q_shape: tuple[int, ...], k_dim: int) -> str | None:
    """Why the ring cannot serve a call, or None."""
    unknown = sorted(set(bound) - RING_KWARGS - {"query", "key", "value"})
    if unknown:
        return f"scaled_dot_product_attention's {', '.join(unknown)}"
    if bound.get("dropout_p") not in (None, 0, 0.0):
        return "dropout in attention"
    if k_dim != len(q_shape) - 2:
        return "its keys' sequence dim is not -2"
    dtype, _grad, device = _tensor_meta(_unmarked(bound["query"]))
    if dtype not in (torch.float32, torch.float64):
        return f"dtype {dtype}: the ring merges blocks in the queries' dtype (float32 and float64 only)"
    if device not in (None, "cpu"):
        return f"device type {device!r}: the ring is checked on CPU only"
    mask = _unmarked(bound.get("attn_mask"))
    if isinstance(mask, fx.Node) and (_tensor_meta(mask)[1] or _reads_trained_tensor(mask)):
        return "its mask needs a gradient (a learned bias)"
    return None


def _reads_trained_tensor(node: fx.Node) -> bool:
    """Whether ``node`` is computed from a parameter that requires grad (read as an attribute: a
    learned slope; or by a module kept whole: T5's relative position bias embedding). Shape
    propagation's fake values do not say so."""
    owner = node.graph.owning_module
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr" and owner is not None:
            try:
                value = owner.get_parameter(str(n.target))
            except AttributeError:
                value = None
            if isinstance(value, torch.Tensor) and value.requires_grad:
                return True
        if n.op == "call_module" and owner is not None:  # a module kept whole (T5's bias embedding)
            try:
                module = owner.get_submodule(str(n.target))
            except AttributeError:
                module = None
            if module is not None and any(p.requires_grad for p in module.parameters()):
                return True
        stack.extend(n.all_input_nodes)
    return False


def find_exchange_sites(gm: fx.GraphModule) -> list[ExchangeSite]:
    """Every marked attention call whose query, key and value shapes are known."""
    sites = []
    for node in gm.graph.nodes:
        bound = _arguments(node)
        if bound is None:
            continue
        q, k, v = (node_shape(_unmarked(bound[name])) for name in ("query", "key", "value"))
        dtype = _tensor_meta(_unmarked(bound["query"]))[0]
        if q is None or k is None or v is None or len(q) < 3 or len(k) < 3:
            continue
        key_dim = bound["key"].args[1] % len(k)
        batch = q[0] if len(q) == 4 else 1
        itemsize = torch.empty((), dtype=dtype).element_size() if dtype is not None else 4
        shape = AttentionShape(batch=batch, heads=q[-3], kv_heads=k[-3], seq=k[key_dim], head_dim=k[-1],
                               value_dim=v[-1], itemsize=itemsize)  # fmt: skip
        mask = bound.get("attn_mask")
        shapes = (q, k, node_shape(mask) if isinstance(mask, fx.Node) else None, bound.get("dropout_p"))
        sites.append(ExchangeSite(node, shape, _ring_cannot(bound, q, key_dim), shapes, key_dim))
    return sites


def _room(options: ContextParallelOptions, shape: AttentionShape, world: int, calibration: Any) -> int | None:
    """The bytes an exchange's transient may take: the all-gather's, which the prediction under
    ``memory_per_device=`` holds, plus the headroom the budget leaves (None: no budget)."""
    if options.memory_headroom is None:
        return None
    return exchange_costs(shape, world, calibration)["all-gather"].transient_bytes + options.memory_headroom


def choose_context_exchanges(gm: fx.GraphModule, *, options: ContextParallelOptions, world: int,
                             calibration: Any = None, ranks: bool = False) -> PassResult:  # fmt: skip
    """Each marked attention call's exchange, and what the all-to-all reads of it, recorded in
    ``gm.meta`` (see the module's docstring; ``calibration``: None, the cached mesh calibration;
    ``ranks``: the devices are ranks of a process group, which take the first rank's, so that
    every rank chooses alike: a collective)."""
    sites = find_exchange_sites(gm)
    if calibration is None and (sites or ranks):  # every rank joins the broadcast, with sites or not
        calibration = cached_mesh(world, agree=ranks)
    choices: dict[str, ExchangeChoice] = {}
    for site in sites:
        ring_cannot = site.ring_cannot or ("load_balance=True: the ring's blocks are not balanced yet"
                                           if options.load_balance is True else None)  # fmt: skip
        cannot = {"ring": ring_cannot} if ring_cannot else {}
        query, key, mask, dropout = site.shapes
        if (reason := all_to_all_applies(query, key, world, mask=mask, dim=site.key_dim, dropout=dropout)) is not None:
            cannot["all-to-all"] = reason
        if options.load_balance is True:  # balancing rewrites the all-gather's calls; the all-to-all's are not
            cannot.setdefault("all-to-all", "load_balance=True balances the all-gather's causal query rows (the "
                                            "all-to-all is balanced as it is: leave 'load_balance' out to let 'auto' "
                                            "take it)")  # fmt: skip
        if options.exchange == "ring" and site.ring_cannot:
            raise DpCompileError(
                f"context_parallel={{'exchange': 'ring'}}: the attention call '{call_name(site.node)}' cannot run on the "
                f"ring: {site.ring_cannot}. Leave 'exchange' out ('auto': it falls back to the all-gather there) or "
                "ask for 'all-gather'"
            )
        choices[call_name(site.node)] = choose_exchange(options, site.shape, world, calibration=calibration,
                                                        memory_bytes=_room(options, site.shape, world, calibration),
                                                        cannot=cannot)  # fmt: skip
    gm.meta[CHOICES] = {**gm.meta.get(CHOICES, {}), **choices}
    gm.meta[SHAPES] = {**gm.meta.get(SHAPES, {}), **{call_name(site.node): site.shapes for site in sites}}
    return PassResult(gm, False, {"exchanges": {name: c.exchange for name, c in choices.items()}})


__all__ = ["CHOICES", "SHAPES", "ExchangeSite", "call_name", "choose_context_exchanges", "find_exchange_sites"]
