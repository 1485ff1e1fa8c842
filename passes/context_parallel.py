"""``insert_sequence_exchange``: what attention needs of the sequence, made explicit for context parallelism.

Context parallelism splits the sequence as data parallelism splits the batch (the same lowering,
``insert_scatter_gather``, on the sequence dim). Everything position-wise then runs on each
device's own tokens; attention is the one op that mixes positions. Each device keeps its own
queries and needs every key and value: this pass marks keys and values ``sequence_whole`` (an
all-gather, once lowered), a mask's query rows ``sequence_split``, and turns ``is_causal=True``
into ``runtime.causal_attention`` at the queries' positions, so a device's queries see the keys up
to their own positions (with the causal kernel as it is: no mask of queries by keys).

Before::

    def forward(self, q, k, v):
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return sdpa

After::

    def forward(self, q, k, v):
        sdpa_keys = dpcompile_runtime_sequence_whole(k, 2)
        sdpa_values = dpcompile_runtime_sequence_whole(v, 2)
        sdpa_query_len = q.size(2)
        getattr_1 = q.device
        sdpa_query_positions = torch.arange(sdpa_query_len, device = getattr_1)
        sdpa = dpcompile_runtime_causal_attention(q, sdpa_keys, sdpa_values, sdpa_query_positions)
        return sdpa

Lowered over two devices, ``sdpa_keys = dpcompile_runtime_gather_sequence([k_dev0, k_dev1], 2, 'cpu')``
and each device's query positions are its own (``dpcompile_runtime_batch_arange``). An
attention that would still run whole (its queries could not be split: a table indexed by
the sequence that no rule splits) is a ``DpCompileError`` naming the value and the op; so is an
attention with dropout (``dropout_p`` not zero: not built on sequence shards).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.passes.shape_prop import TensorMetadata

from dpcompile import runtime
from dpcompile.analysis.batch_dims import op_name, propagate
from dpcompile.analysis.batch_rules.attention import SDPA_ARGUMENTS, sdpa_arguments
from dpcompile.analysis.batch_rules.context import node_shape
from dpcompile.analysis.placement import Placement, Whole
from dpcompile.analysis.sequence_exchange import is_sequence_marker
from dpcompile.errors import DpCompileError
from dpcompile.infra import PassResult, stamp

PASS = "insert_sequence_exchange"
SDPA_TARGETS = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
#: what ``explain`` and ``pm.strategies`` call the exchange chosen, and the ones not chosen (yet)
EXCHANGE = "all-gather keys/values"
OTHER_EXCHANGES = ("ring exchange of keys/values (built with cp alone or beside dp; beside tp or pp the all-gather runs)",
                   "head-to-sequence all-to-all (built with cp alone or beside dp; beside tp or pp the all-gather runs)")


@dataclass(frozen=True)
class AttentionSite:
    """One attention call: its node, the queries' and keys' sequence dims, what its mask needs."""

    node: fx.Node
    query_dim: int
    key_dim: int
    causal: bool
    mask: fx.Node | None
    mask_rows_dim: int | None  # the mask's query-rows dim, to split; None where its rows broadcast
    mask_keys_dim: int | None  # the mask's key dim, to gather where its rows broadcast


def is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in SDPA_TARGETS or node.target is runtime.causal_attention)


def find_sequence_attention(gm: fx.GraphModule) -> list[AttentionSite]:
    """Every batched attention call whose shapes are known (``example_inputs=``), not marked yet."""
    sites = []
    for node in gm.graph.nodes:
        if not is_attention(node) or node.target is runtime.causal_attention:
            continue
        bound = sdpa_arguments(node)
        if is_sequence_marker(bound["key"]):
            continue  # marked already: the pass runs once per graph
        q_shape, k_shape = node_shape(bound["query"]), node_shape(bound["key"])
        if q_shape is None or k_shape is None or len(q_shape) < 3:
            continue
        mask = bound.get("attn_mask") if isinstance(bound.get("attn_mask"), fx.Node) else None
        mask_shape = node_shape(mask) if mask is not None else None
        rows_dim = keys_dim = None
        if mask_shape is not None and len(mask_shape) >= 2:
            if mask_shape[-2] == 1:
                keys_dim = len(mask_shape) - 1
            else:
                rows_dim = len(mask_shape) - 2
        causal = bound.get("is_causal") is True
        sites.append(AttentionSite(node, len(q_shape) - 2, len(k_shape) - 2, causal, mask, rows_dim, keys_dim))
    return sites


def insert_sequence_exchange(gm: fx.GraphModule, *, input_dims: Mapping[str, int | None]) -> PassResult:
    """Mark what each attention needs of the sequence (see the module's docstring); refuse, by
    name, an attention whose queries cannot be split."""
    sites = find_sequence_attention(gm)
    for site in sites:
        if _drops_out(site.node):
            raise DpCompileError(_dropout_message(site.node))
    for site in sites:
        _rewrite(gm.graph, site)
    placements = propagate(gm, input_dims)
    for site in sites:
        if isinstance(placements[site.node], Whole) and placements[site.node].batch:
            raise DpCompileError(_whole_attention_message(site.node, placements))
    return PassResult(gm, bool(sites), {"attention": [s.node.name for s in sites], "exchange": EXCHANGE})


def _rewrite(graph: fx.Graph, site: AttentionSite) -> None:
    node = site.node
    bound = sdpa_arguments(node)
    with graph.inserting_before(node):
        keys = _marker(graph, runtime.sequence_whole, bound["key"], site.key_dim, f"{node.name}_keys", node)
        values = _marker(graph, runtime.sequence_whole, bound["value"], site.key_dim, f"{node.name}_values", node)
        mask: Any = bound.get("attn_mask")
        if site.causal:
            positions = _query_positions(graph, bound["query"], site, node)
            options = {name: value for name, value in bound.items() if name not in SDPA_ARGUMENTS[:4] + ("is_causal",)}
            node.target, node.args, node.kwargs = runtime.causal_attention, (bound["query"], keys, values, positions), options
            return
        if site.mask is not None and site.mask_rows_dim is not None:
            mask = _marker(graph, runtime.sequence_split, site.mask, site.mask_rows_dim, f"{node.name}_mask_rows", node)
        elif site.mask is not None and site.mask_keys_dim is not None:
            mask = _marker(graph, runtime.sequence_whole, site.mask, site.mask_keys_dim, f"{node.name}_mask_keys", node)
    named = {**bound, "key": keys, "value": values, "attn_mask": mask}
    positional = len(node.args)
    if mask is not None and positional < 4 and "attn_mask" not in node.kwargs:
        node.kwargs = {**node.kwargs, "attn_mask": mask}
    node.args = tuple(named[name] for name in SDPA_ARGUMENTS[:positional])
    node.kwargs = {name: named.get(name, value) for name, value in node.kwargs.items()}


def _marker(graph: fx.Graph, fn: Any, value: fx.Node, dim: int, name: str, source: fx.Node) -> fx.Node:
    new = stamp(graph.call_function(fn, (value, dim)), PASS, source)
    new.name = graph._graph_namespace.create_name(name, None)
    for key in ("val", "tensor_meta"):
        if key in value.meta:
            new.meta[key] = value.meta[key]
    return new


def _query_positions(graph: fx.Graph, query: fx.Node, site: AttentionSite, source: fx.Node) -> fx.Node:
    """``arange(q.size(dim))``: split, each device holds its queries' positions in the whole sequence."""
    length = node_shape(query)[site.query_dim]  # type: ignore[index]
    size = stamp(graph.call_method("size", (query, site.query_dim)), PASS, source)
    size.name = graph._graph_namespace.create_name(f"{source.name}_query_len", None)
    device = stamp(graph.call_function(getattr, (query, "device")), PASS, source)
    positions = stamp(graph.call_function(torch.arange, (size,), {"device": device}), PASS, source)
    positions.name = graph._graph_namespace.create_name(f"{source.name}_query_positions", None)
    positions.meta["tensor_meta"] = TensorMetadata(torch.Size((length,)), torch.int64, False, (1,), None, False, {})
    return positions


def _drops_out(node: fx.Node) -> bool:
    """A dropout probability that is known and not zero (the export frontend bakes training mode's)."""
    p = sdpa_arguments(node).get("dropout_p")
    return isinstance(p, (int, float)) and p != 0


def _dropout_message(node: fx.Node) -> str:
    p = sdpa_arguments(node)["dropout_p"]
    return (
        f"context parallel: attention '{node.name}' has dropout_p={p}, and attention dropout on sequence shards is "
        "not built yet (each device would draw its query rows of the single-device mask). Set the model's "
        "attention dropout to 0 (GPT-2's attn_pdrop, BERT's and ViT's attention_probs_dropout_prob; the other "
        "dropouts stay exact under 'cp'), or leave 'cp' out of mesh= "
        "(data, tensor and pipeline parallelism draw attention dropout exactly)"
    )


def _whole_attention_message(node: fx.Node, placements: Mapping[fx.Node, Placement]) -> str:
    root = _first_whole(node, placements)
    placement = placements[root]
    reason = placement.reason if isinstance(placement, Whole) and placement.reason else "it runs whole"
    where = _user_line(root)
    return (
        f"context parallel: attention '{node.name}' cannot run on sequence shards: the value '{root.name}' "
        f"({op_name(root)}{', ' + where if where else ''}) that it reads runs on the whole sequence, because {reason}. "
        "Every value indexed by the sequence (positions, rotary cos/sin tables, masks) must be split with it: compute "
        "it from positions (torch.arange(seq_len), position_ids), teach its op with dpcompile.register_batch_rule, "
        "or leave 'cp' out of mesh="
    )


def _first_whole(node: fx.Node, placements: Mapping[fx.Node, Placement]) -> fx.Node:
    """Back from ``node`` to the first value that runs whole on its own account (not because of an input)."""
    current = node
    while True:
        inputs = [n for n in current.all_input_nodes if isinstance(placements.get(n), Whole) and placements[n].batch]
        if not inputs:
            return current
        current = inputs[0]


def _user_line(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    frames = [line for line in lines if line.startswith("File ")]
    if not frames:
        return ""
    last = frames[-1]
    code = lines[lines.index(last) + 1] if lines.index(last) + 1 < len(lines) else ""
    filename = last.split('"')[1].rsplit("/", 1)[-1] if '"' in last else last
    line = last.split("line ")[1].split(",")[0] if "line " in last else "?"
    return f"{filename}:{line}: {code}"



LAYOUT = "dpcompile_layout"  # node.meta: a value's layout over tensor-parallel shards (shard_linear)


def markers_take_shard_layouts(gm: fx.GraphModule) -> PassResult:
    """On ``shard_linear``'s one-shard program (``{"cp", "tp"}``), each marker and causal attention
    ``insert_sequence_exchange`` made takes its first input's shard layout: keys sharded over heads
    are gathered along the sequence shard by shard (``expand_shards`` then makes one gather per
    shard, never shard 0's keys for every shard)."""
    made = 0
    for node in gm.graph.nodes:
        is_marker = node.op == "call_function" and node.target in (runtime.sequence_whole, runtime.sequence_split, runtime.causal_attention)
        source = node.args[0] if is_marker and node.args else None
        if isinstance(source, fx.Node) and LAYOUT not in node.meta and LAYOUT in source.meta:
            node.meta[LAYOUT] = source.meta[LAYOUT]
            made += 1
    return PassResult(gm, bool(made), {"layouts": made})

__all__ = ["EXCHANGE", "OTHER_EXCHANGES", "AttentionSite", "find_sequence_attention", "insert_sequence_exchange",
           "markers_take_shard_layouts"]
