"""What ``insert_scatter_gather`` asks of one node: its gather dims, whether it is a view, a pure
read, a training batch norm or a ``pad_packed_sequence``, and where its rows lie."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from dpcompile import runtime
from dpcompile.analysis.batch_rules.aten import trains_with_whole_batch_statistics
from dpcompile.analysis.placement import Placement, Replicated, Split, Tuple


def stamp_rows(new: fx.Node, placement: Placement, k: int) -> fx.Node:
    """Where device ``k``'s piece lies in the batch (``draw_random_whole`` slices random draws by it)."""
    if isinstance(placement, Tuple) and placement.items and isinstance(placement.items[0], Split):
        placement = placement.items[0]
    if isinstance(placement, Split):
        new.meta["dpcompile_rows"] = (k, placement.dim)
    return new


def gather_dims(placement: Placement) -> Any:
    """The ``dim`` argument of ``runtime.gather`` for a placement, or None if it cannot gather."""
    if isinstance(placement, Split):
        return placement.dim
    if isinstance(placement, Replicated):
        return None
    if isinstance(placement, Tuple):
        dims = []
        for item in placement.items:
            if isinstance(item, Replicated):
                dims.append(runtime.TAKE_FIRST)
                continue
            d = gather_dims(item)
            if d is None:
                return None
            dims.append(d)
        return tuple(dims)
    return None


_VIEW_METHODS = {"view", "reshape", "transpose", "permute", "t", "flatten", "unsqueeze", "squeeze", "contiguous", "expand"}
_VIEW_FUNCTIONS = {torch.transpose, torch.permute, torch.t, torch.flatten, torch.reshape, torch.unsqueeze, torch.squeeze}


def is_view(node: fx.Node) -> bool:
    """Cheap reshapes that are better recomputed from a gathered source than gathered again."""
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op == "call_function":
        return node.target in _VIEW_FUNCTIONS or (node.target is getattr and node.args[1] in ("T", "mT"))
    return False


def is_pure_read(node: fx.Node) -> bool:
    """A read of a shape, an attribute or an element: nothing lost when its result is unused."""
    if node.op == "call_method":
        return node.target in ("size", "dim")
    return node.op == "call_function" and node.target in (operator.getitem, getattr)


def names_read_from(root: fx.Node) -> set[str]:
    """The top-level names a replica root is used for (``replica_dev1.enc.fc1(...)``: ``enc``)."""
    names = set()
    for user in root.users:
        if user.op == "call_method" and user.args[0] is root:
            names.add(str(user.target).split(".")[0])
        elif user.op == "call_function" and user.target is getattr and user.args[0] is root:
            names.add(user.args[1])
        else:  # handed on whole: keep everything
            names.add("*")
    return names


def has_side_effect(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is runtime.flatten_parameters


def is_training_batch_norm_function(node: fx.Node) -> bool:
    """``F.batch_norm`` called with ``training=True`` (its rule splits it only then with constants), or
    the export frontend's ``aten.batch_norm`` in training or in its module's mode read at run time."""
    if trains_with_whole_batch_statistics(node):
        return True
    if node.op != "call_function" or node.target is not F.batch_norm:
        return False
    training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False)
    return training is True


def is_pad_packed(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.nn.utils.rnn.pad_packed_sequence


def packed_lengths(node: fx.Node) -> fx.Node | None:
    """Walk back from ``pad_packed_sequence`` to the ``lengths`` its sequence was packed with."""
    seen = 0
    current: Any = node.args[0]
    while isinstance(current, fx.Node) and seen < 64:
        seen += 1
        if current.op == "call_function" and current.target is torch.nn.utils.rnn.pack_padded_sequence:
            return current.args[1] if len(current.args) > 1 else current.kwargs.get("lengths")
        if not current.args:
            return None
        current = current.args[0]
    return None


__all__ = [
    "gather_dims",
    "has_side_effect",
    "is_pad_packed",
    "is_pure_read",
    "is_training_batch_norm_function",
    "is_view",
    "names_read_from",
    "packed_lengths",
    "stamp_rows",
]
