"""The ``"auto"`` save rule: which matmul and attention outputs a recomputed region keeps under a
memory budget, chosen to recompute the fewest FLOPs (a 0/1 knapsack over one region).

Candidates are the region's matmul and attention nodes whose output backward reads (what ``"matmuls"``
keeps). Keeping one costs its output's bytes and spares its own FLOPs: the runtime's recompute runs
every op that is not kept up to the last one backward needs, so what a kept output spares does not
depend on what else is kept, and the choice is a knapsack, solved exactly.

No example input reaches the pass, so sizes are per row (a token, an image position): an
``nn.Linear(i, o)`` keeps ``o`` values per row and costs ``2*i*o`` FLOPs per row to recompute;
attention keeps the width of its value input and is kept first: it costs ``4*s`` FLOPs per kept
value (``s`` the sequence length), more than any matmul of inner width under ``2*s``. A candidate
of unknown size (a functional matmul on a computed weight) counts as one unit of the region's
median width and FLOPs.

Before (``budget=7/9`` on a pre-norm block: q, k, v, attention, o at width d, fc1 at 4d)::

    candidates  q k v attention o fc1     widths 1 1 1 1 1 4 (x d), budget 7 units

After::

    kept        attention, then fc1 + q + k (12 units of FLOPs spared of 16); v and o recomputed
"""

from __future__ import annotations

import operator
import re
import statistics

import torch
import torch.fx as fx
from torch import nn
from torch.utils.flop_counter import flop_registry

from dpcompile.analysis.checkpoint_regions import byte_budget
from dpcompile.analysis.save_choice import SaveCandidate, choose_saves, choose_within
from dpcompile.errors import DpCompileError
from passes.checkpoint_saves import (
    is_attention,
    is_matmul,
    is_matmul_module,
    kept_nodes,
    module_called,
    passes_through,
    read_in_backward,
)


def _sizes(module: nn.Module | None) -> tuple[int, int] | None:
    """``(inner, out)`` of a Linear or a transformers ``Conv1D``: per row, ``out`` values from ``inner``."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_matmul_module(module) and type(module).__name__ == "Conv1D":
        return int(module.weight.shape[0]), int(module.nf)
    return None


def _weight_sizes(gm: fx.GraphModule, node: fx.Node) -> tuple[int, int] | None:
    """``(inner, out)`` of a functional ``linear(x, w)`` on a weight the program holds (a tensor-parallel
    shard, ``get_attr``): per row, ``w.shape[0]`` values from ``w.shape[1]``."""
    if node.op != "call_function" or node.target not in (torch._C._nn.linear, nn.functional.linear):
        return None
    weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    if not isinstance(weight, fx.Node) or weight.op != "get_attr":
        return None
    try:
        value = gm.get_parameter(str(weight.target))
    except AttributeError:
        return None
    return (int(value.shape[1]), int(value.shape[0])) if value.dim() == 2 else None


def _matmul_sizes(gm: fx.GraphModule, node: fx.Node) -> tuple[int, int] | None:
    return _sizes(module_called(gm, node)) or _weight_sizes(gm, node)


def _split_size(node: fx.Node) -> int | None:
    """``getitem(split(x, n, dim=-1), i)`` (GPT-2's q, k, v out of one projection): ``n`` per row."""
    split = node.args[0] if node.target is operator.getitem and isinstance(node.args[0], fx.Node) else None
    if split is None or "split" not in str(getattr(split.target, "__name__", split.target)):
        return None
    size = split.args[1] if len(split.args) > 1 else split.kwargs.get("split_size")
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    return size if isinstance(size, int) and isinstance(dim, int) and (dim == -1 or dim >= 2) else None


def _width_of(gm: fx.GraphModule, node: fx.Node, seen: int = 0) -> int | None:
    """Values per row of ``node``'s output, where a matmul module, a split of the last dimension,
    or a view of one of those says."""
    sizes = _matmul_sizes(gm, node)
    if sizes:
        return sizes[1]
    if (size := _split_size(node)) is not None:
        return size
    if seen < 8 and passes_through(node) and node.all_input_nodes:  # a view keeps the values per row
        return _width_of(gm, node.all_input_nodes[0], seen + 1)
    return None


def _value(node: object) -> object:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _priced_by_value(node: fx.Node) -> tuple[int, int] | None:
    """Values and FLOPs of ``node`` where the capture recorded its tensors (``meta["val"]``, an
    exported program): torch's FLOP formula for the op, attention ``4 * b * h * s_q * s_k * d``."""
    out = node.meta.get("val")
    out = out[0] if isinstance(out, (tuple, list)) and out else out
    inputs = [a.meta.get("val") for a in node.all_input_nodes]
    if not isinstance(out, torch.Tensor) or not inputs or any(not isinstance(t, torch.Tensor) for t in inputs):
        return None
    if is_attention(node):
        query, key = inputs[0], inputs[1]
        return out.numel(), 4 * query.numel() * key.shape[-2]
    formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if formula is None:
        return None
    args, kwargs = fx.map_arg((node.args, node.kwargs), _value)
    return out.numel(), int(formula(*args, out_val=node.meta["val"], **kwargs))


def save_candidates(gm: fx.GraphModule, nodes: list[fx.Node], per_row: bool = False) -> list[SaveCandidate]:
    """The region's matmul and attention nodes backward reads the output of, priced by their
    recorded tensors where every one has them (unless ``per_row``), else per row by their modules."""
    needed = read_in_backward(nodes)
    chosen = [n for n in nodes if n in needed and (is_attention(n) or is_matmul(gm, n))]
    priced = [] if per_row else [_priced_by_value(n) for n in chosen]
    if chosen and priced and all(priced):
        return [SaveCandidate(n, float(w), float(f), is_attention(n))
                for n, (w, f) in zip(chosen, priced, strict=True)]  # type: ignore[misc]  # fmt: skip
    found: list[tuple[fx.Node, int | None, int | None, bool]] = []
    for node in nodes:
        if node not in needed:
            continue
        if is_attention(node):
            value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value")
            found.append((node, _width_of(gm, value) if isinstance(value, fx.Node) else None, None, True))
        elif is_matmul(gm, node):
            sizes = _matmul_sizes(gm, node)
            found.append((node, sizes[1], 2 * sizes[0] * sizes[1], False) if sizes else (node, None, None, False))
    widths = [w for _, w, _, _ in found if w]
    flops = [f for _, _, f, _ in found if f]
    unit_width = statistics.median(widths) if widths else 1.0
    unit_flops = statistics.median(flops) if flops else 1.0
    return [SaveCandidate(node, width or unit_width, f or unit_flops, attention) for node, width, f, attention in found]


def kept_under_budget(gm: fx.GraphModule, nodes: list[fx.Node], budget: float) -> list[fx.Node]:
    """The nodes of a region that keep their outputs under the ``"auto"`` rule at ``budget``."""
    return [c.node for c in choose_saves(save_candidates(gm, nodes), budget)]


def kept_over_regions(gm: fx.GraphModule, regions: list[list[fx.Node]], budget: float) -> list[list[fx.Node]]:
    """The kept nodes of each region under one knapsack over all of them (a device's regions):
    ``budget`` of their candidates' total width, attention first, then the matmuls sparing the most
    FLOPs. Ties go to later regions: what an early region keeps is alive through every later
    region's backward (where the peak is), what the last one keeps is freed first."""
    found = [save_candidates(gm, nodes) for nodes in regions]
    latest_first = [c for candidates in reversed(found) for c in candidates]
    chosen = {c.node for c in choose_saves(latest_first, budget)}
    return [[c.node for c in candidates if c.node in chosen] for candidates in found]


_PLACE = re.compile(r"_(dev\d+|mb\d+)$")


def _capacity(rule: str) -> float:
    """A byte budget's values per row: ``"auto:bytes=4096/row=128"`` keeps up to 32 values a row."""
    size, row = byte_budget(rule)  # type: ignore[misc]
    if row is None:
        raise DpCompileError(
            "activation_checkpointing 'budget_bytes' needs the bytes one value per row (a token) takes on a device: "
            "give transform example_inputs= (it sizes them from a fake run), or 'row_bytes' in the dict"
        )
    return size / row


def kept_within_bytes(gm: fx.GraphModule, regions: list[list[fx.Node]], rule: str) -> list[list[fx.Node]]:
    """The kept nodes of each region under a byte budget (``"auto:bytes=n/row=r"``): the candidates
    of each device (node name suffix ``_dev1``, ``_mb0``: a region may span the replicas of data
    parallelism) chosen within ``n`` bytes, priced per row; ``regions`` share one budget per device
    (``"budget_over": "device"``) or are each given one."""
    capacity = _capacity(rule)
    found = [save_candidates(gm, nodes, per_row=True) for nodes in regions]
    by_place: dict[str | None, list[SaveCandidate]] = {}
    for candidates in reversed(found):  # ties go to later regions (see kept_over_regions)
        for c in candidates:
            match = _PLACE.search(c.node.name)  # type: ignore[attr-defined]
            by_place.setdefault(match.group(0) if match else None, []).append(c)
    chosen = {c.node for group in by_place.values() for c in choose_within(group, capacity)}
    return [[c.node for c in candidates if c.node in chosen] for candidates in found]


def kept_for_rule(gm: fx.GraphModule, nodes: list[fx.Node], rule: str) -> list[fx.Node]:
    """The nodes of a region that keep their outputs under any save rule: ``"auto:<budget>"`` and
    ``"auto:bytes=..."`` here, the fixed rules in ``passes.checkpoint_saves``."""
    if byte_budget(rule):
        return kept_within_bytes(gm, [nodes], rule)[0]
    if rule.startswith("auto:"):
        return kept_under_budget(gm, nodes, float(rule.removeprefix("auto:")))
    return kept_nodes(gm, nodes, rule)


__all__ = ["SaveCandidate", "choose_saves", "kept_for_rule", "kept_over_regions", "kept_under_budget", "kept_within_bytes",
           "save_candidates"]
