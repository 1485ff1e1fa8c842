"""``name_dp_copies``: name each piece of a batch split over dp copies and micro-batches by both.

A ``dp`` dimension over a pipeline or a tensor-parallel program in one process is ``D`` copies of
that program: ``insert_scatter_gather`` splits the batch into ``D x M`` pieces, and piece ``j`` is
micro-batch ``j % M`` of copy ``j // M`` (``dpcompile.target.replicate_over_dp``). The lowerings
name piece ``j`` ``_mb<j>``; this pass, last, spells the copy out. Nodes keep their place and
their meta: only names change, and a node already named stays as it is.

Before (``mesh={"pp": 2, "dp": 2}``, ``micro_batches=1``)::

    x_mb1 = x_scatter[1]
    fc1_mb1 = self.fc1(x_mb1)
    fc1_mb1_to_stage1 = dpcompile_runtime_send(fc1_mb1, 'cpu')

After::

    x_dp1 = x_scatter[1]
    fc1_dp1 = self.fc1(x_dp1)
    fc1_dp1_to_stage1 = dpcompile_runtime_send(fc1_dp1, 'cpu')

With ``micro_batches=2`` piece 3 is ``fc1_dp1_mb1``.
"""

from __future__ import annotations

import re

import torch.fx as fx

from dpcompile.infra import PassResult

PASS = "name_dp_copies"
COPY = "dpcompile_dp_copy"  # node.meta: the dp copy a named node belongs to
_PIECE = re.compile(r"_mb(\d+)(?=_|$)")


def find_piece_names(gm: fx.GraphModule, *, micro_batches: int, prefix: str = "dp") -> dict[fx.Node, tuple[str, int]]:
    """``{node: (new name, copy)}`` for every node named after a piece (``_mb<j>``) not named yet
    (``prefix="cp"``: the pieces are pieces of the sequence, ``{"cp", "tp"}``)."""
    found = {}
    for node in gm.graph.nodes:
        if COPY in node.meta or node.op == "placeholder" or not _PIECE.search(node.name):
            continue
        copy = int(_PIECE.search(node.name).group(1)) // micro_batches  # type: ignore[union-attr]
        found[node] = (_PIECE.sub(lambda m: _piece_name(int(m.group(1)), micro_batches, prefix), node.name), copy)
    return found


def name_dp_copies(gm: fx.GraphModule, *, micro_batches: int, prefix: str = "dp") -> PassResult:
    """Rename ``_mb<j>`` to ``_dp<r>`` (one micro-batch per copy) or ``_dp<r>_mb<m>``, ``j = r*M + m``
    (``M = micro_batches``, each copy's)."""
    found = find_piece_names(gm, micro_batches=micro_batches, prefix=prefix)
    for node, (name, copy) in found.items():
        node._rename(name)
        node.meta[COPY] = copy
    return PassResult(gm, bool(found), {"renamed": len(found)})


def find_copies_of_pieces(gm: fx.GraphModule, *, pieces: int) -> dict[fx.Node, int]:
    """``{node: copy}`` for every node :func:`name_dp_copies` numbered as piece ``c`` of the sequence
    whose name says dp copy ``d`` (``x_dp1_cp0``): the program's copy ``d * pieces + c``."""
    found = {}
    for node in gm.graph.nodes:
        copy_of = _COPY_OF_PIECE.search(node.name)
        if copy_of and isinstance(node.meta.get(COPY), int):
            found[node] = int(copy_of.group(1)) * pieces + node.meta[COPY]
    return found


def number_copies_of_pieces(gm: fx.GraphModule, *, pieces: int) -> PassResult:
    """dp copies of cp's pieces (``{"dp", "cp", "tp"}``: ``split_batch_into_copies`` named copy ``d``
    ``_dp<d>``, :func:`name_dp_copies` then piece ``c`` of the sequence ``_cp<c>``, copy ``c``):
    ``x_dp1_cp0`` becomes copy ``1 * pieces + 0`` (``recipe.dp_devices`` lists every copy's pieces;
    ``explain`` places each node by it). Names do not change."""
    found = find_copies_of_pieces(gm, pieces=pieces)
    for node, copy in found.items():
        node.meta[COPY] = copy
    return PassResult(gm, bool(found), {"numbered": len(found)})


_COPY_OF_PIECE = re.compile(r"_dp(\d+)(?=_|$)")


def _piece_name(piece: int, micro_batches: int, prefix: str) -> str:
    copy, micro = divmod(piece, micro_batches)
    return f"_{prefix}{copy}" if micro_batches == 1 else f"_{prefix}{copy}_mb{micro}"


__all__ = ["COPY", "find_copies_of_pieces", "find_piece_names", "name_dp_copies", "number_copies_of_pieces"]
