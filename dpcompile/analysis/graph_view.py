"""A ``networkx`` view of an fx graph, and the Linear chains tensor parallelism pairs up.

``to_networkx(gm)`` gives a ``DiGraph`` whose nodes are the fx nodes' names (attributes
``op``, ``target``, ``node``) and whose edges run from a value to each of its users.

Two questions the automatic tensor-parallel plan asks of it, given which nodes are Linear
layers and which ops a sharded value can pass through (``is_transparent``: element-wise
ops, softmax, attention, views; supplied by the pass that knows the rules):

* :func:`find_linear_chains`: pairs ``(a, b)`` where Linear ``a``'s output reaches Linear
  ``b``'s input through transparent ops only: a column ``a`` and a row ``b`` then need no
  collective between them (Megatron's pairing). In an MLP: ``[("fc1", "fc2")]``.
* :func:`linear_groups`: the Linear layers whose choices interact (a chain, or layers
  reading the same input, like ``q``, ``k``, ``v``), so the plan can search each group
  on its own.

>>> import torch, torch.fx as fx
>>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
>>> gm = fx.symbolic_trace(mlp)
>>> linears = {n for n in gm.graph.nodes if n.target in ("0", "2")}
>>> find_linear_chains(gm, linears, lambda n: n.target == "1")
[('_0', '_2')]
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import torch.fx as fx

if TYPE_CHECKING:  # imported where a graph is built: ``import dpcompile`` stays without networkx
    import networkx as nx

NodePredicate = Callable[[fx.Node], bool]


def to_networkx(gm: fx.GraphModule) -> nx.DiGraph:
    """The data-flow graph of ``gm``: one node per fx node (by name), an edge per use."""
    import networkx as nx

    g = nx.DiGraph()
    for node in gm.graph.nodes:
        g.add_node(node.name, op=node.op, target=node.target, node=node)
    for node in gm.graph.nodes:
        for user in node.users:
            g.add_edge(node.name, user.name)
    return g


def _transparent_subgraph(gm: fx.GraphModule, linears: Collection[fx.Node], is_transparent: NodePredicate) -> nx.DiGraph:
    """Edges a sharded value can travel: out of a Linear or transparent op into another.

    Only transparent ops a Linear's output reaches count: a value computed before every Linear
    (Llama's rotary ``cos`` / ``sin``, read by every layer) does not tie the layers together."""
    import networkx as nx

    full = to_networkx(gm)
    keep = {n.name for n in linears}
    for node in gm.graph.nodes:  # in order: a transparent op joins when one of its inputs is kept
        if node.name not in keep and is_transparent(node) and any(a.name in keep for a in node.all_input_nodes):
            keep.add(node.name)
    g = nx.DiGraph()
    g.add_nodes_from(keep)
    for u, v in full.edges:
        if u in keep and v in keep:
            g.add_edge(u, v)
    return g


def find_linear_chains(
    gm: fx.GraphModule, linears: Collection[fx.Node], is_transparent: NodePredicate
) -> list[tuple[str, str]]:
    """``(a, b)`` names of Linear nodes where ``a``'s output reaches ``b`` through transparent ops.

    Paths stop at Linear layers: ``fc1 -> fc2 -> fc3`` gives ``(fc1, fc2)`` and ``(fc2, fc3)``.
    """
    g = _transparent_subgraph(gm, linears, is_transparent)
    names = [n.name for n in gm.graph.nodes if n in linears]
    linear_names = set(names)
    chains: list[tuple[str, str]] = []
    for a in names:
        seen, frontier = {a}, [a]
        while frontier:
            current = frontier.pop()
            for nxt in g.successors(current):
                if nxt in seen:
                    continue
                seen.add(nxt)
                if nxt in linear_names:
                    chains.append((a, nxt))
                else:
                    frontier.append(nxt)
    order = {name: i for i, name in enumerate(names)}
    return sorted(chains, key=lambda c: (order[c[0]], order[c[1]]))


def linear_groups(gm: fx.GraphModule, linears: Collection[fx.Node], is_transparent: NodePredicate) -> list[list[str]]:
    """The Linear layers (by node name) whose styles interact, as groups in graph order.

    Two layers interact when one's output reaches the other through transparent ops, or
    when they read the same value (they share Megatron's *f* on it).
    """
    import networkx as nx

    g = _transparent_subgraph(gm, linears, is_transparent).to_undirected()
    names = [n.name for n in gm.graph.nodes if n in linears]
    for node in gm.graph.nodes:
        readers = [u.name for u in node.users if u in linears and u.args and u.args[0] is node]
        for a, b in zip(readers, readers[1:]):
            g.add_edge(a, b)
    order = {name: i for i, name in enumerate(names)}
    groups = []
    for component in nx.connected_components(g):
        members = sorted((m for m in component if m in order), key=order.__getitem__)
        if members:
            groups.append(members)
    return sorted(groups, key=lambda grp: order[grp[0]])
