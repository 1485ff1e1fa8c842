"""Context parallel's exchange per attention call: chosen on the marked program, the ring's lowered.

Two passes. ``choose_context_exchanges`` runs on the program ``insert_sequence_exchange`` marked
(before ``insert_scatter_gather``, where every attention call still has its shapes; after
``record_attention_shapes``, whose shapes say where the all-to-all applies): for each call
it asks the cost model (:func:`dpcompile.analysis.context_exchange.choose_exchange`) which exchange
runs it and records the :class:`ExchangeChoice` on the module (``gm.meta``), by the call's name.
What the ring cannot serve (dropout, a mask that needs a gradient, a dtype but float32/float64,
another device type, keys whose sequence dim is not ``-2``) falls back to the all-gather under
``"auto"``, the reason recorded; asked for by name, it is a ``DpCompileError`` naming the call.

``ring_exchange`` runs after ``regather_keys_values``: each device's call of the calls chosen for
the ring becomes :func:`dpcompile.runtime.sequence_ring.ring_attention`, and every attention call
carries its choice (``node.meta["dpcompile_exchange"]``) for ``explain`` and ``pm.strategies``.

Before (device 1 of 2)::

    sdpa_dev1 = dpcompile_runtime_attention_regathered(q_dev1, [k_dev0, k_dev1], [v_dev0, v_dev1], 2, 'cpu', pos_dev1)

After::

    sdpa_dev1 = dpcompile_runtime_ring_attention(q_dev1, [k_dev0, k_dev1], [v_dev0, v_dev1], 2, 'cpu', 1, pos_dev1)   # ..., device 1: its own block first
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from dpcompile import runtime
from dpcompile.analysis.batch_rules.attention import sdpa_arguments
from dpcompile.analysis.batch_rules.context import node_shape
from dpcompile.analysis.context_exchange import (
    CHOICE_META,
    CHOICES_META,
    AttentionShape,
    ContextParallelOptions,
    ExchangeChoice,
    choose_exchange,
)
from dpcompile.analysis.heads_exchange import all_to_all_applies
from dpcompile.analysis.sequence_exchange import is_sequence_marker
from dpcompile.errors import DpCompileError
from dpcompile.infra import PassResult, stamp
from dpcompile.runtime.sequence_ring import RING_KWARGS
from passes.all_to_all_exchange import SHAPES
from passes.context_parallel import SDPA_TARGETS

CHOOSE = "choose_context_exchanges"
PASS = "ring_exchange"
#: ``gm.meta`` key: {attention call's name: ExchangeChoice}; ``node.meta`` key: the call's choice
CHOICES = CHOICES_META
CHOICE = CHOICE_META
_DEVICE = re.compile(r"_dev(\d+)(?:_\d+)?$")


@dataclass(frozen=True)
class ExchangeSite:
    """One marked attention call: its node, its shape over the whole sequence, why the ring cannot serve it."""

    node: fx.Node
    shape: AttentionShape
    ring_cannot: str | None


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
        sites.append(ExchangeSite(node, shape, _ring_cannot(bound, q, key_dim)))
    return sites


def choose_context_exchanges(gm: fx.GraphModule, *, options: ContextParallelOptions, world: int,
                             calibration: Any = None) -> PassResult:  # fmt: skip
    """Each marked attention call's exchange, recorded in ``gm.meta`` (see the module's docstring)."""
    sites = find_exchange_sites(gm)
    choices: dict[str, ExchangeChoice] = {}
    shapes = gm.meta.get(SHAPES, {})  # record_attention_shapes: what the all-to-all reads
    for site in sites:
        ring_cannot = site.ring_cannot or ("load_balance=True: the ring's blocks are not balanced yet"
                                           if options.load_balance is True else None)  # fmt: skip
        cannot = {"ring": ring_cannot} if ring_cannot else {}
        if (found := shapes.get(call_name(site.node))) is not None:
            query, key, mask, dropout = found
            bound = _arguments(site.node)
            dim = bound["key"].args[1] % len(key) if bound is not None and key is not None else 2
            if (reason := all_to_all_applies(query, key, world, mask=mask, dim=dim, dropout=dropout)) is not None:
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
                                                        cannot=cannot)  # fmt: skip
    gm.meta[CHOICES] = {**gm.meta.get(CHOICES, {}), **choices}
    return PassResult(gm, False, {"exchanges": {name: c.exchange for name, c in choices.items()}})


@dataclass(frozen=True)
class RingSite:
    """One device's attention call chosen for the ring: the node and the device it runs for."""

    node: fx.Node
    device: int


def find_ring_sites(gm: fx.GraphModule) -> list[RingSite]:
    """Every device's ``attention_regathered`` call whose attention call was chosen for the ring."""
    choices = gm.meta.get(CHOICES, {})
    sites = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not runtime.attention_regathered:
            continue
        choice = choices.get(call_name(node))
        match = _DEVICE.search(node.name)
        if choice is not None and choice.exchange == "ring" and match:
            sites.append(RingSite(node, int(match.group(1))))
    return sites


def ring_exchange(gm: fx.GraphModule) -> PassResult:
    """Each ring site becomes a ``ring_attention`` call; every attention call carries its choice."""
    choices = gm.meta.get(CHOICES, {})
    sites = find_ring_sites(gm)
    for site in sites:
        node = site.node
        query, keys, values, dim, device, positions = node.args
        node.target = runtime.ring_attention
        node.args = (query, keys, values, dim, device, site.device, positions)
        stamp(node, PASS)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (runtime.attention_regathered, runtime.ring_attention):
            if call_name(node) in choices:
                node.meta[CHOICE] = choices[call_name(node)]
    return PassResult(gm, bool(sites), {"ring": [s.node.name for s in sites]})


__all__ = [
    "CHOICE", "CHOICES", "ExchangeSite", "RingSite", "call_name", "choose_context_exchanges", "find_exchange_sites",
    "find_ring_sites", "ring_exchange",
]  # fmt: skip
