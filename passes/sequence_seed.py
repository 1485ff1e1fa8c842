"""``split_sequence_made_inside``: context parallel for a model that makes its sequence itself (a ViT).

A ViT's input is an image, ``(batch, channels, h, w)``: its dim 1 is channels, not a sequence. The
sequence appears inside the model (patch embedding, a CLS token concatenated, position embeddings
added). With no input split (the inputs go whole to every device), this pass starts the split at
the value that feeds the first attention's layer: back from the attention's queries through the
modules and views of one token each (q projection, layer norm) to the first value made otherwise
(the position embeddings' add), marked ``sequence_split`` along dim 1 (lowered: scattered). The
embedding runs whole on every device, once; everything after it on the device's own tokens.

export bakes the sequence's length into each later view (the image's size is static, so is the
length): a view or reshape whose input has the whole length at dim 1 or 2 and writes that number
at the same dim reads it from its input instead (``x.size(d)``), which is the shard's length once split.

Before::

    add = cat + position_embeddings
    layernorm_before = self.layernorm_before(add)
    reshape = q_proj.reshape([2, 17, 4, 8])

After::

    add = cat + position_embeddings
    sequence_split = dpcompile_runtime_sequence_split(add, 1)
    layernorm_before = self.layernorm_before(sequence_split)
    sym_size = torch.ops.aten.sym_size.int(q_proj, 1)
    reshape = q_proj.reshape([2, sym_size, 4, 8])

Nothing changes where an input is split (a text model) or no seed is found (then the attention is
refused by name, as before).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
import torch.fx as fx

from dpcompile import runtime
from dpcompile.analysis.batch_rules.attention import sdpa_arguments
from dpcompile.analysis.batch_rules.context import node_shape
from dpcompile.infra import PassResult, stamp
from passes.context_parallel import find_sequence_attention

PASS = "split_sequence_made_inside"
#: ops that keep each token's values apart along the walk back from the queries (q, k, v taken
#: apart from one projection included); propagation then checks that each op really splits
_PER_TOKEN_VIEWS = {torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten.transpose.int,
                    torch.ops.aten.permute.default, torch.ops.aten.unbind.int, torch.ops.aten.split.Tensor,
                    torch.ops.aten.chunk.default, torch.ops.aten.contiguous.default, operator.getitem}  # fmt: skip
_VIEWS = (torch.ops.aten.reshape.default, torch.ops.aten.view.default)


def find_sequence_seed(gm: fx.GraphModule) -> fx.Node | None:
    """The value ``(batch, seq, ...)`` the first attention's queries are made from, ``seq`` its keys' length."""
    sites = find_sequence_attention(gm)
    if not sites:
        return None
    site = sites[0]
    length = node_shape(sdpa_arguments(site.node)["key"])[site.key_dim]  # type: ignore[index]
    current = sdpa_arguments(site.node)["query"]
    while isinstance(current, fx.Node) and (current.op == "call_module" or current.target in _PER_TOKEN_VIEWS):
        current = current.args[0]
    shape = node_shape(current) if isinstance(current, fx.Node) else None
    if shape is None or len(shape) != 3 or shape[1] != length:
        return None
    return current


def split_sequence_made_inside(gm: fx.GraphModule, *, input_dims: Mapping[str, int | None]) -> PassResult:
    """Split the sequence where the model makes it (see the module's docstring), when no input is split."""
    if any(dim is not None for dim in input_dims.values()):
        return PassResult(gm, False, {})
    seed = find_sequence_seed(gm)
    if seed is None:
        return PassResult(gm, False, {})
    length = node_shape(seed)[1]  # type: ignore[index]
    graph = gm.graph
    with graph.inserting_after(seed):
        split = stamp(graph.call_function(runtime.sequence_split, (seed, 1)), PASS, seed)
    for key in ("val", "tensor_meta"):
        if key in seed.meta:
            split.meta[key] = seed.meta[key]
    seed.replace_all_uses_with(split, delete_user_cb=lambda user: user is not split)
    rewritten = [node.name for node in _after(graph, split) if _reads_its_length(graph, node, length)]
    gm.recompile()
    return PassResult(gm, True, {"seed": seed.name, "views": rewritten})


def _after(graph: fx.Graph, start: fx.Node) -> list[fx.Node]:
    nodes = list(graph.nodes)
    return nodes[nodes.index(start) + 1 :]


def _reads_its_length(graph: fx.Graph, node: fx.Node, length: int) -> bool:
    """``x.reshape([b, 17, ...])`` of an ``x`` 17 long at that dim: the size read from ``x``."""
    if node.op != "call_function" or node.target not in _VIEWS or not isinstance(node.args[0], fx.Node):
        return False
    source, sizes = node.args[0], list(node.args[1])
    shape = node_shape(source)
    for dim in (1, 2):
        if shape is not None and len(shape) > dim and len(sizes) > dim and shape[dim] == length and sizes[dim] == length:
            with graph.inserting_before(node):
                sizes[dim] = stamp(graph.call_function(torch.ops.aten.sym_size.int, (source, dim)), PASS, node)
            node.args = (source, sizes, *node.args[2:])
            return True
    return False


__all__ = ["find_sequence_seed", "split_sequence_made_inside"]
