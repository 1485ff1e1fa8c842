"""``regather_keys_values``: context parallel's attention keeps only its key and value shards for backward.

Lowered, context parallelism all-gathers attention's keys and values once and every device attends
its queries to them; autograd then keeps the whole gathered keys and values of every layer until
backward, the largest activation a device holds at a long sequence. This pass, on the lowered
program, has each device gather its keys and values inside its attention call, which backward runs
again (the gather included, as Megatron's and torchtitan's context parallel gather again): what is
kept is the device's queries and the shards the gather reads, the shards each device keeps anyway.

Before (two virtual devices)::

    sdpa_keys = dpcompile_runtime_gather_sequence([k_dev0, k_dev1], 2, 'cpu')
    sdpa_values = dpcompile_runtime_gather_sequence([v_dev0, v_dev1], 2, 'cpu')
    sdpa_dev0 = dpcompile_runtime_causal_attention(q_dev0, sdpa_keys, sdpa_values, positions_dev0)
    sdpa_dev1 = dpcompile_runtime_causal_attention(q_dev1, sdpa_keys, sdpa_values, positions_dev1)

After::

    sdpa_dev0 = dpcompile_runtime_attention_regathered(q_dev0, [k_dev0, k_dev1], [v_dev0, v_dev1], 2, 'cpu', positions_dev0)
    sdpa_dev1 = dpcompile_runtime_attention_regathered(q_dev1, [k_dev0, k_dev1], [v_dev0, v_dev1], 2, 'cpu', positions_dev1)

An attention with dropout is left as it is (its draws are the exact-random passes' to place).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from dpcompile import runtime
from dpcompile.analysis.batch_rules.attention import SDPA_ARGUMENTS, sdpa_arguments
from dpcompile.infra import PassResult, stamp
from passes.context_parallel import SDPA_TARGETS

PASS = "regather_keys_values"


@dataclass(frozen=True)
class RegatherSite:
    """One device's attention call reading all-gathered ``keys`` and ``values`` (the gather nodes)."""

    attention: fx.Node
    keys: fx.Node
    values: fx.Node


def _is_gather(value: Any) -> bool:
    return isinstance(value, fx.Node) and value.op == "call_function" and value.target is runtime.gather_sequence


def _keys_values_dropout(node: fx.Node) -> tuple[Any, Any, Any] | None:
    if node.op != "call_function":
        return None
    if node.target is runtime.causal_attention:
        return node.args[1], node.args[2], node.kwargs.get("dropout_p")
    if node.target in SDPA_TARGETS:
        bound = sdpa_arguments(node)
        return bound.get("key"), bound.get("value"), bound.get("dropout_p")
    return None


def find_regather_sites(gm: fx.GraphModule) -> list[RegatherSite]:
    """Every attention call whose keys and values are gathered along one dim, without dropout."""
    sites = []
    for node in gm.graph.nodes:
        found = _keys_values_dropout(node)
        if found is None:
            continue
        keys, values, dropout = found
        if dropout not in (None, 0, 0.0) or not (_is_gather(keys) and _is_gather(values)):
            continue
        if keys.args[1:] != values.args[1:]:
            continue  # gathered along different dims or onto different devices: not one exchange
        sites.append(RegatherSite(node, keys, values))
    return sites


def regather_keys_values(gm: fx.GraphModule) -> PassResult:
    """Each site's attention gathers its keys and values itself, again in backward (see the module's docstring)."""
    sites = find_regather_sites(gm)
    gathers: set[fx.Node] = set()
    for site in sites:
        _rewrite(site)
        gathers.update((site.keys, site.values))
    for gather in gathers:
        if not gather.users:
            gm.graph.erase_node(gather)
    return PassResult(gm, bool(sites), {"attention": [s.attention.name for s in sites]})


def _rewrite(site: RegatherSite) -> None:
    node, (key_shards, dim, device) = site.attention, site.keys.args
    value_shards = site.values.args[0]
    if node.target is runtime.causal_attention:
        query, positions, options = node.args[0], node.args[3], dict(node.kwargs)
    else:
        bound = sdpa_arguments(node)
        query, positions = bound["query"], None
        options = {name: value for name, value in bound.items() if name not in SDPA_ARGUMENTS[:3]}
    node.target = runtime.attention_regathered
    node.args = (query, list(key_shards), list(value_shards), dim, device, positions)
    node.kwargs = options
    stamp(node, PASS)


__all__ = ["RegatherSite", "find_regather_sites", "regather_keys_values"]
