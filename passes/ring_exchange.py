"""``ring_exchange``: context parallel's attention calls chosen for the ring, lowered.

It runs after ``regather_keys_values``: each device's call of the calls ``choose_context_exchanges``
(``passes/choose_exchange.py``) chose for the ring becomes
:func:`dpcompile.runtime.sequence_ring.ring_attention`, and every attention call carries its choice
(``node.meta["dpcompile_exchange"]``) for ``explain`` and ``pm.strategies``.

Before (device 1 of 2)::

    sdpa_dev1 = dpcompile_runtime_attention_regathered(q_dev1, [k_dev0, k_dev1], [v_dev0, v_dev1], 2, 'cpu', pos_dev1)

After::

    sdpa_dev1 = dpcompile_runtime_ring_attention(q_dev1, [k_dev0, k_dev1], [v_dev0, v_dev1], 2, 'cpu', 1, pos_dev1)   # ..., device 1: its own block first
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.fx as fx

from dpcompile import runtime
from dpcompile.analysis.context_exchange import CHOICE_META
from dpcompile.infra import PassResult, stamp
from passes.choose_exchange import CHOICES, call_name

PASS = "ring_exchange"
#: ``node.meta`` key: the call's choice
CHOICE = CHOICE_META
_DEVICE = re.compile(r"_dev(\d+)(?:_\d+)?$")


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


__all__ = ["CHOICE", "RingSite", "find_ring_sites", "ring_exchange"]
