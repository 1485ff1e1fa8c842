"""Where one rank's pieces of the random draws lie, over a ``DeviceMesh`` (``exact_random=True``).

Over a mesh each rank runs its own program: a data-parallel rank on its local batch, a
tensor-parallel rank on its shards. ``draw_random_whole`` makes every random site draw the whole
tensor (the same on every rank: each rank's generator is seeded alike and draws the same sites in
the same order, so no collective is needed) and keep this rank's slice; these passes stamp where
that slice lies, as the one-process lowerings do for their devices:

* ``stamp_rank_rows`` (on the captured program): a site whose value is split by the batch holds
  rank ``dp_rank``'s rows of the global batch (``dpcompile_rows``), the ranks' equal local batches
  concatenated in rank order;
* ``stamp_rank_cols`` (on ``shard_linear``'s program of one shard): a site on a sharded value holds
  rank ``tp_rank``'s columns (``dpcompile_cols``).

Before (rank 1 of a ``("dp",)`` mesh of 2)::

    drop = self.drop(relu)

After ``stamp_rank_rows`` then ``draw_random_whole(gm, rank_batch=("x", 0, 2))``::

    random_draws = dpcompile_runtime_random_draws_over_ranks(x, 0, 2)
    drop_module = self.drop
    drop = dpcompile_runtime_exact_dropout_module(drop_module, random_draws, 'drop', relu, rows = (1, 0))
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx as fx

from dpcompile.analysis.batch_dims import propagate
from dpcompile.analysis.placement import Split, Tuple, Whole
from dpcompile.analysis.random_ops import random_kind
from dpcompile.analysis.sharding import Copied, Sharded
from dpcompile.infra import PassResult
from passes.exact_random import COLS, ROWS


def find_random_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``gm`` that draw from a generator, in program order."""
    return [n for n in gm.graph.nodes if random_kind(gm, n) is not None]


def stamp_rank_rows(
    gm: fx.GraphModule, *, input_dims: Mapping[str, int | None], dp_rank: int, scopes: tuple[str, ...] = (),
    dp_size: int = 2,
) -> PassResult:
    """Stamp each random site split by the batch with rank ``dp_rank``'s rows (``(dp_rank, dim)``);
    ``scopes``: modules called whole (FSDP blocks), stamped by their input's batch dim. A site whose
    value holds the batch where the batch rules lost its rows (an op they cannot split without shapes:
    a written-out attention traced without ``example_inputs=``) is stamped ``(dp_rank, None)`` over
    ``dp_size`` > 1 ranks: drawing it raises, naming the way out, rather than drawing another mask than
    eager's (its local shape is not its piece of the whole); in eval it draws nothing and runs."""
    sites = [n for n in gm.graph.nodes if n.op == "call_module" and n.target in scopes or random_kind(gm, n)]
    if not sites or not any(d is not None for d in input_dims.values()):
        return PassResult(gm, False, {"rows": {}})
    placements = _placements_by_name(gm, input_dims, scopes)
    stamped: dict[str, tuple[int, int]] = {}
    for node in sites:
        scope = node.op == "call_module" and node.target in scopes  # its random ops: its input's rows
        placement = placements.get((node.args[0] if scope and node.args else node).name)
        if isinstance(placement, Tuple) and placement.items and isinstance(placement.items[0], Split):
            placement = placement.items[0]
        if isinstance(placement, Split) and placement.dim is not None:
            node.meta[ROWS] = stamped[node.name] = (dp_rank, placement.dim)
        elif not scope and dp_size > 1 and isinstance(placement, Whole) and placement.batch:
            node.meta[ROWS] = stamped[node.name] = (dp_rank, None)  # unplaced: refused when it draws
    return PassResult(gm, False, {"rows": stamped})  # metadata only: the code is unchanged


def _placements_by_name(gm: fx.GraphModule, input_dims: Mapping[str, int | None], scopes: tuple[str, ...]) -> dict:
    """Batch placements of ``gm``'s nodes by name, each module of ``scopes`` (a transformer block that
    FSDP wraps, no batch rule of its own) read as per sample: an identity of its first input."""
    if not scopes:
        return {n.name: p for n, p in propagate(gm, input_dims).items()}
    root = torch.nn.Module()
    for name, child in gm.named_children():
        root.add_module(name, child)
    for name, value in [*gm.named_parameters(recurse=False), *gm.named_buffers(recurse=False)]:
        setattr(root, name, value)
    root.add_module("per_sample_block", torch.nn.Identity())
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in scopes:
            env[node] = graph.call_module("per_sample_block", (env[node.args[0]],))
            env[node].name = node.name
        else:
            env[node] = graph.node_copy(node, lambda a: env[a])
    return {n.name: p for n, p in propagate(fx.GraphModule(root, graph), input_dims).items()}


def stamp_rank_cols(gm: fx.GraphModule, *, tp_rank: int) -> PassResult:
    """Stamp each random site on a sharded value with rank ``tp_rank``'s columns (``(tp_rank, dim,
    sizes)``; ``"sections"`` for blocks of a fused projection, which no one slice holds)."""
    stamped: dict[str, object] = {}
    for node in find_random_nodes(gm):
        layout = node.meta.get("dpcompile_layout")
        if isinstance(layout, Sharded):
            cols = (tp_rank, layout.dim, tuple(layout.sizes)) if layout.sections == 1 else "sections"
        elif isinstance(layout, Copied):
            cols = (tp_rank, None, None)
        else:
            continue
        node.meta[COLS] = stamped[node.name] = cols
    return PassResult(gm, False, {"cols": stamped})


def rank_batch_input(input_dims: Mapping[str, int | None], ranks: int) -> tuple[str, int, int] | None:
    """``(input, dim, ranks)`` for ``draw_random_whole``: the first input split by the batch."""
    for name, dim in input_dims.items():
        if dim is not None:
            return name, dim, ranks
    return None


__all__ = ["find_random_nodes", "rank_batch_input", "stamp_rank_cols", "stamp_rank_rows"]
