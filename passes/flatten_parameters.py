"""``hoist_flatten_parameters``: one ``flatten_parameters`` per RNN, at the head of forward.

Before (the user flattened inside a nested encoder, twice, and never flattened ``gru``)::

    def forward(self, x):
        enc_rnn = self.enc.rnn
        flatten_parameters = dpcompile_runtime_flatten_parameters(enc_rnn)
        enc_rnn_1 = self.enc.rnn(x)
        ...
        flatten_parameters_1 = dpcompile_runtime_flatten_parameters(enc_rnn_2)
        gru = self.gru(getitem)

After::

    def forward(self, x):
        enc_rnn = self.enc.rnn
        flatten_parameters_enc_rnn = dpcompile_runtime_flatten_parameters(enc_rnn)
        gru = self.gru
        flatten_parameters_gru = dpcompile_runtime_flatten_parameters(gru)
        enc_rnn_1 = self.enc.rnn(x)
        ...

The data-parallel pass then copies each call once per device, before any computation, on
the replica that will run the RNN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from dpcompile.infra import PassResult, stamp
from dpcompile.runtime import flatten_parameters

PASS = "hoist_flatten_parameters"


@dataclass
class FlattenSites:
    """Every ``flatten_parameters`` call in a graph, and the RNNs that need one, in order."""

    calls: list[fx.Node]
    rnn_paths: list[str]


def _is_flatten_call(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is flatten_parameters


# what torch.export keeps of an RNN call, and where each overload takes the weights
_RECURRENT_PARAMS = {f"{op}.{overload}": index for op in ("lstm", "gru", "rnn_tanh", "rnn_relu")
                     for overload, index in (("input", 2), ("data", 3))}  # fmt: skip


def _weights_owner(node: fx.Node) -> str | None:
    """The module holding the weights an exported recurrent op reads (``aten.lstm.input(x, hx,
    [rnn.weight_ih_l0, ...], ...)`` reads ``rnn``'s), where they are all one module's attributes."""
    name = f"{getattr(node.target, '_opname', '')}.{getattr(node.target, '_overloadname', '')}"
    index = _RECURRENT_PARAMS.get(name) if node.op == "call_function" else None
    params = node.args[index] if index is not None and len(node.args) > index else None
    if not isinstance(params, (list, tuple)) or not params:
        return None
    owners = {w.target.rpartition(".")[0] if isinstance(w, fx.Node) and w.op == "get_attr" else None for w in params}
    owner = owners.pop() if len(owners) == 1 else None
    return owner or None


def find_flatten_sites(gm: fx.GraphModule) -> FlattenSites:
    """The recorded calls and the RNN modules (called, flattened, or whose weights an exported
    ``aten.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` reads), by first appearance."""
    modules = dict(gm.named_modules())
    calls: list[fx.Node] = []
    paths: list[str] = []
    for node in gm.graph.nodes:
        if _is_flatten_call(node):
            calls.append(node)
            ref = node.args[0]
            path = ref.target if isinstance(ref, fx.Node) and ref.op == "get_attr" else None
        elif node.op == "call_module" and isinstance(modules.get(node.target), nn.RNNBase):
            path = node.target
        elif (owner := _weights_owner(node)) is not None:
            path = owner
        else:
            continue
        if path is not None and path not in paths:
            paths.append(path)
    return FlattenSites(calls, paths)


def _already_hoisted(gm: fx.GraphModule, sites: FlattenSites) -> bool:
    nodes = [n for n in gm.graph.nodes if n.op != "placeholder"]
    head = nodes[: 2 * len(sites.rnn_paths)]
    expected = []
    for path in sites.rnn_paths:
        expected += [("get_attr", path), ("call_function", flatten_parameters)]
    return len(sites.calls) == len(sites.rnn_paths) and [(n.op, n.target) for n in head] == expected


def hoist_flatten_parameters(gm: fx.GraphModule) -> PassResult:
    """Move every ``flatten_parameters`` call to the head of forward, one per RNN module."""
    sites = find_flatten_sites(gm)
    if not sites.rnn_paths or _already_hoisted(gm, sites):
        return PassResult(gm, False, {"rnns": sites.rnn_paths})
    graph = gm.graph
    for call in sites.calls:
        ref = call.args[0]
        graph.erase_node(call)
        if isinstance(ref, fx.Node) and not ref.users:
            graph.erase_node(ref)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    for path in sites.rnn_paths:
        context = graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(next(iter(graph.nodes)))
        with context:
            ref = stamp(graph.get_attr(path), PASS)
        with graph.inserting_after(ref):
            call = stamp(graph.call_function(flatten_parameters, (ref,)), PASS)
            call._rename(f"flatten_{path.replace('.', '_')}")
        anchor = call
    return PassResult(gm, True, {"rnns": sites.rnn_paths, "removed_calls": len(sites.calls)})
