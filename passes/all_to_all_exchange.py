"""``all_to_all_exchange``: context parallel's attention by the head-to-sequence all-to-all (DeepSpeed Ulysses).

Where ``choose_context_exchanges`` chose it (``context_parallel={"exchange": ...}``), each attention call's
devices (the ``attention_regathered`` calls ``regather_keys_values`` made, one per device) are
rewritten: the queries, keys and values are exchanged so that device ``r`` holds the whole
sequence for its share of the heads, it runs the ordinary attention (``is_causal=True`` as it is;
a mask's rows for its heads, a mask shared by every head whole), and the outputs are exchanged
back to sequence shards of every head.

Before (two virtual devices)::

    sdpa_dev0 = dpcompile_runtime_attention_regathered(q_dev0, [k_dev0, k_dev1], [v_dev0, v_dev1], 2, 'cpu', positions_dev0)
    sdpa_dev1 = dpcompile_runtime_attention_regathered(q_dev1, [k_dev0, k_dev1], [v_dev0, v_dev1], 2, 'cpu', positions_dev1)

After::

    sdpa_shard_len_dev0 = q_dev0.size(2)
    sdpa_shard_len_dev1 = q_dev1.size(2)
    sdpa_query_heads_dev0 = dpcompile_runtime_heads_of_sequence([q_dev0, q_dev1], 0, 2, [sdpa_shard_len_dev0, sdpa_shard_len_dev1], 'cpu')
    ... (keys, values; device 1)
    sdpa_heads_dev0 = torch._C._nn.scaled_dot_product_attention(sdpa_query_heads_dev0, sdpa_key_heads_dev0, sdpa_value_heads_dev0, is_causal = True)
    ... (device 1)
    sdpa_dev0 = dpcompile_runtime_sequence_of_heads([sdpa_heads_dev0, sdpa_heads_dev1], 0, 2, [sdpa_shard_len_dev0, sdpa_shard_len_dev1], 'cpu')
    sdpa_dev1 = dpcompile_runtime_sequence_of_heads([sdpa_heads_dev0, sdpa_heads_dev1], 1, 2, [...], 'cpu')

A mask split by query rows from a whole one (``scatter(mask)[r]``) is read whole, its heads
``r`` (``dpcompile_runtime_heads_share``); other row shards are exchanged like the queries. Where
the all-to-all does not apply (``all_to_all_applies``: heads that do not divide, a mask of other
heads), asked for by name is a ``DpCompileError`` naming the attention and why; under ``"auto"`` the
call keeps the all-gather, the reason in its exchange choice (``explain``), which
``choose_context_exchanges`` (``passes/choose_exchange.py``) made from the cost model.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
import torch.nn.functional as F
from torch.fx.passes.tools_common import legalize_graph

from dpcompile import runtime
from dpcompile.analysis.context_exchange import (
    CHOICE_META,
    CHOICES_META,
    EXCHANGES,
    ContextParallelOptions,
    chosen_exchange,
)
from dpcompile.analysis.heads_exchange import all_to_all_applies
from dpcompile.errors import DpCompileError
from dpcompile.infra import PassResult, stamp
from passes.choose_exchange import SHAPES
from passes.sequence_rank import device_of

PASS = "all_to_all_exchange"


@dataclass(frozen=True)
class AllToAllSite:
    """One attention call over ``N`` devices: its per-device calls in device order and whether the
    all-to-all serves it (``reason``: None, or why not)."""

    attentions: tuple[fx.Node, ...]
    dim: int
    reason: str | None
    mask_rows_dim: int | None = None  # the mask's query-rows dim (its length less 2), where it has one

    @property
    def name(self) -> str:
        return str(self.attentions[0].meta.get("dpcompile_source", self.attentions[0].name))


def _mask(node: fx.Node) -> Any:
    return node.kwargs.get("attn_mask")


def find_all_to_all_sites(gm: fx.GraphModule) -> list[AllToAllSite]:
    """Every context-parallel attention call (its devices' ``attention_regathered`` calls, grouped
    by the key shards they read), and whether the all-to-all applies to it."""
    groups: dict[tuple[Any, ...], dict[int | None, fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is runtime.attention_regathered:
            key = (tuple(node.args[1]), tuple(node.args[2]), node.args[3])
            groups.setdefault(key, {})[device_of(node)] = node
    sites = []
    for (keys, _values, dim), by_device in groups.items():
        world = len(keys)
        ordered = tuple(by_device.get(k) for k in range(world))
        if None in ordered or len(by_device) != world:
            calls = tuple(by_device.values())
            sites.append(AllToAllSite(calls, dim, "its devices' calls are not one per shard of the sequence"))
            continue
        first = ordered[0]
        source = str(first.meta.get("dpcompile_source", first.name))
        query, key, mask, dropout = gm.meta.get(SHAPES, {}).get(source, (None, None, None, None))
        reason = all_to_all_applies(query, key, world, mask=mask, dim=dim, dropout=dropout)
        if reason is None and mask is None and _mask(first) is not None:
            reason = "its mask's shape is not known"
        rows = len(mask) - 2 if mask is not None and len(mask) >= 2 else None
        sites.append(AllToAllSite(ordered, dim, reason, rows))
    return sites


def all_to_all_exchange(gm: fx.GraphModule, *, options: ContextParallelOptions) -> PassResult:
    """Rewrite each attention call ``chosen_exchange(options, ...)`` names the all-to-all for (see
    the module's docstring); refuse, by name, one asked for by name where it does not apply."""
    rewritten, kept, dropped = [], [], []
    sites = find_all_to_all_sites(gm)
    for site in sites:  # every refusal before any rewrite
        if site.reason is not None and options.exchange == "all-to-all":
            raise DpCompileError(_refusal(site, len(site.attentions)))
    for site in sites:
        choice = gm.meta.get(CHOICES_META, {}).get(site.name)  # choose_context_exchanges' cost model
        wanted = choice.exchange if choice is not None else chosen_exchange(options)
        if site.reason is not None or wanted != "all-to-all":
            if choice is not None and wanted == "all-to-all":  # the lowering found what the shapes did not say
                kept_choice = dataclasses.replace(choice, exchange="all-gather", why_not={
                    **{k: v for k, v in choice.why_not.items() if k != "all-gather"},
                    "all-to-all": f"cannot serve this call: {site.reason}"})  # fmt: skip
                for node in site.attentions:
                    node.meta[CHOICE_META] = kept_choice
            kept.append(site.name)
            continue
        dropped += _rewrite(gm.graph, site)
        rewritten.append(site.name)
    if rewritten:
        _erase_unused(gm.graph, dropped)
        if not _in_order(gm.graph):
            legalize_graph(gm)
        gm.recompile()
    return PassResult(gm, bool(rewritten), {"all_to_all": rewritten, "all_gather": kept})


def _refusal(site: AllToAllSite, world: int) -> str:
    others = [f"'{e}'" for e in EXCHANGES if e != "all-to-all"]
    return (
        f"context_parallel={{'exchange': 'all-to-all'}}: attention '{site.name}' cannot run as the head-to-sequence "
        f"all-to-all over {world} devices because {site.reason}. Use an exchange that serves every attention "
        f"({' or '.join(others) or 'none built'}) or leave 'exchange' out ('auto': the all-to-all where it applies)"
        + (", or a 'cp' size that divides the heads" if "divide" in str(site.reason) else "")
    )


def _rewrite(graph: fx.Graph, site: AllToAllSite) -> list[Any]:
    """Rewrite ``site``'s calls; what they read that may now be unread (positions, masks)."""
    calls, dim = site.attentions, site.dim
    base = site.name
    queries = [c.args[0] for c in calls]
    keys, values = list(calls[0].args[1]), list(calls[0].args[2])
    dropped = [a for c in calls for a in (c.args[5], _mask(c))]
    last = next(n for n in reversed(graph.nodes) if n in calls)
    with graph.inserting_before(last):
        lengths = [_made(graph.call_method("size", (q, dim)), f"{base}_shard_len_dev{r}", calls[r])
                   for r, q in enumerate(queries)]  # fmt: skip
        heads = []
        for r, call in enumerate(calls):
            device = call.args[4]

            def exchange(shards: list[Any], what: str, r: int = r, device: Any = device, call: fx.Node = call,
                         dim: int = dim) -> fx.Node:  # fmt: skip
                new = graph.call_function(runtime.heads_of_sequence, (shards, r, dim, lengths, device))
                return _made(new, f"{base}_{what}_heads_dev{r}", call)

            q, k, v = exchange(queries, "query"), exchange(keys, "key"), exchange(values, "value")
            options = {name: value for name, value in call.kwargs.items() if name != "attn_mask"}
            if call.args[5] is not None:  # causal at the queries' positions: over the whole sequence, as it is
                options["is_causal"] = True
            elif _mask(call) is not None:
                options["attn_mask"] = _mask_heads(graph, site, r, exchange)
            attention = graph.call_function(F.scaled_dot_product_attention, (q, k, v), options)
            heads.append(_made(attention, f"{base}_heads_dev{r}", call))
    for r, call in enumerate(calls):
        call.target = runtime.sequence_of_heads
        call.args, call.kwargs = (list(heads), r, dim, lengths, call.args[4]), {}
        stamp(call, PASS)
        (heads[-1] if r == 0 else calls[r - 1]).append(call)  # after every device's attention
    return dropped


def _mask_heads(graph: fx.Graph, site: AllToAllSite, r: int, exchange: Any) -> fx.Node:
    """Device ``r``'s heads of the mask over the whole sequence: a mask every device reads (shared
    rows, gathered along the keys) or the whole one its row shards were scattered from, narrowed
    to its heads; other row shards exchanged as the queries are."""
    masks = [_mask(c) for c in site.attentions]
    call = site.attentions[r]
    if all(m is masks[0] for m in masks):
        whole = masks[0]
    else:
        whole = _scattered_from(masks, site.mask_rows_dim)
        if whole is None:
            return exchange(masks, "mask", dim=site.mask_rows_dim)
    share = graph.call_function(runtime.heads_share, (whole, r, len(masks)))
    return _made(share, f"{site.name}_mask_heads_dev{r}", call)


def _scattered_from(masks: list[Any], rows_dim: int | None) -> fx.Node | None:
    """The whole mask where ``masks`` are ``scatter(whole, devices, rows)[r]`` in device order."""
    held = [m.args[0] if isinstance(m, fx.Node) and m.target is operator.getitem else None for m in masks]
    scatter = held[0]
    if not (isinstance(scatter, fx.Node) and scatter.target is runtime.scatter and all(h is scatter for h in held)):
        return None
    if scatter.args[2] != rows_dim or [m.args[1] for m in masks] != list(range(len(masks))):
        return None
    return scatter.args[0]


def _made(node: fx.Node, name: str, source: fx.Node) -> fx.Node:
    node.name = node.graph._graph_namespace.create_name(name, None)
    return stamp(node, PASS, source)


def _erase_unused(graph: fx.Graph, dropped: list[Any]) -> None:
    """What the rewrite left unread (the query positions, a mask's scatter), back to what is read."""
    stack, erased = [n for n in dropped if isinstance(n, fx.Node)], set()
    while stack:
        node = stack.pop()
        if node not in erased and node.op in ("call_function", "call_method") and not node.users and not node.is_impure():
            inputs = node.all_input_nodes
            graph.erase_node(node)
            erased.add(node)
            stack.extend(inputs)


def _in_order(graph: fx.Graph) -> bool:
    seen: set[fx.Node] = set()
    for node in graph.nodes:
        if any(i not in seen for i in node.all_input_nodes):
            return False
        seen.add(node)
    return True


__all__ = ["AllToAllSite", "all_to_all_exchange", "find_all_to_all_sites"]
