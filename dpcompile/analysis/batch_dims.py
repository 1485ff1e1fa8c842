"""Batch-dim propagation: where every value of a graph lives in a data-parallel program.

``propagate(gm, input_dims)`` walks the graph once, in order, and gives each node a
:mod:`placement <dpcompile.analysis.placement>` from the per-op rules of
:mod:`~dpcompile.analysis.batch_rules`. An op with no rule, or whose rule refuses, runs once
on the whole batch (after a gather), so the program is always correct; the rules decide how
much of it runs in parallel.

``infer_input_dims`` chooses how each input is split: dim 0 by default, dim 1 for an input
that reaches an RNN (or attention) with ``batch_first=False``, replicated for inputs that do
not carry the batch (non-tensor arguments; with ``example_inputs``, tensors whose size does
not match the batch).
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch import nn

from dpcompile.analysis.batch_rules import BATCH_RULES, RuleContext, batch_first, node_shape, rule_for
from dpcompile.analysis.batch_rules.checks import check_placement
from dpcompile.analysis.batch_rules.local_order import escaping_roots, local_order_placement
from dpcompile.analysis.placement import (
    REPLICATED,
    BatchSize,
    LocalOrder,
    Packed,
    Partial,
    Placement,
    Replicated,
    Split,
    Tuple,
    Whole,
    carries_batch,
)
from dpcompile.analysis.sequence_exchange import is_sequence_marker, marker_placement
from dpcompile.errors import ArgumentError
from dpcompile.runtime.hooks import runs_user_forward_hooks

log = logging.getLogger("dpcompile")

_NON_TENSOR_TYPES = (int, float, bool, str, type(None), "int", "float", "bool", "str", "None")


def _arg_placement(value: Any, placements: Mapping[fx.Node, Placement]) -> list[Placement]:
    out: list[Placement] = []
    fx.node.map_arg(value, lambda n: out.append(placements[n]))
    return out


def decide(
    node: fx.Node,
    placements: Mapping[fx.Node, Placement],
    module: nn.Module | None,
    ranks: Mapping[fx.Node, int] | None = None,
    whole_orders: Mapping[str, str] | None = None,
) -> Placement:
    """The placement of one node, given its inputs' placements (``whole_orders``: nodes whose
    device-local order would be read whole, and why; they run whole)."""
    if is_sequence_marker(node):  # context parallelism's exchanges take whole inputs too
        return marker_placement(node, placements)
    inputs = _arg_placement((node.args, node.kwargs), placements)
    if any(isinstance(p, Whole) and p.batch for p in inputs):
        first = next(n for n in node.all_input_nodes if isinstance(placements[n], Whole) and placements[n].batch)
        return Whole(batch=True, reason=f"its input '{first.name}' runs whole")
    if whole_orders and node.name in whole_orders:
        return Whole(batch=True, reason=whole_orders[node.name])
    if any(isinstance(p, LocalOrder) for p in inputs):
        ctx = RuleContext(node, placements, module, ranks if ranks is not None else {})
        local = local_order_placement(ctx)
        what = op_name(node, module)
        return local if local is not None else Whole(batch=True, reason=f"{what} reads rows in a device's own order")
    if not any(carries_batch(p) for p in inputs):
        mutates_shared = node.op == "call_method" and str(node.target).endswith("_")
        if mutates_shared or any(isinstance(p, Whole) for p in inputs):
            return Whole(batch=False)
        if any(isinstance(p, Partial) for p in inputs):
            return Whole(batch=False)
        return REPLICATED
    if node.op == "call_module" and module is not None and runs_user_forward_hooks(module):
        return Whole(batch=True, reason=_HOOKED.format(path=node.target, what=op_name(node, module)))
    rule = rule_for(node, module)
    placement = rule(RuleContext(node, placements, module, ranks if ranks is not None else {})) if rule is not None else None
    if placement is not None:
        check_placement(node, placement, rule, op_name(node, module))
    if placement is None or isinstance(placement, Whole):
        what = op_name(node, module)
        if rule is None:
            reason = f"no batch rule for {what}"
        elif isinstance(placement, Whole) and placement.reason:
            reason = placement.reason
        else:
            reason = f"the batch rule for {what} cannot split it ({_describe_inputs(node, placements)})"
        log.debug("%s: %s; it runs once, after a gather", node.name, reason)
        return Whole(batch=True, reason=reason)
    return placement


# a module the program calls whole (an RNN, a torch.nn layer, leaf_modules=) runs its hooks in its call: split,
# each device's call would run them on its part of the batch (a hook's ``out.mean()`` the last part's)
_HOOKED = ("'{path}' ({what}) has a forward hook or pre-hook, which reads its call's input and output: split, each "
           "device's call would run it on its part of the batch (for a split call, remove the hook while it is not "
           "needed)")  # fmt: skip


def op_name(node: fx.Node, module: nn.Module | None = None) -> str:
    """What ``node`` calls, by its qualified name: ``torchvision.ops.stochastic_depth``, ``Tensor.view``."""
    if node.op == "call_module":
        cls = type(module) if module is not None else None
        return f"{cls.__module__}.{cls.__qualname__}" if cls is not None else str(node.target)
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    target = node.target
    module_name = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    if module_name in ("_operator", "operator"):
        module_name = "operator"
    if module_name.rsplit(".", 1)[-1] == name:  # torchvision.ops.stochastic_depth.stochastic_depth
        module_name = module_name.rsplit(".", 1)[0]
    return f"{module_name}.{name}" if module_name else name


def _describe_inputs(node: fx.Node, placements: Mapping[fx.Node, Placement]) -> str:
    parts = []
    for n in node.all_input_nodes:
        p = placements[n]
        if isinstance(p, Split):
            parts.append(f"'{n.name}' split on dim {p.dim}")
        elif isinstance(p, Partial):
            parts.append(f"'{n.name}' a partial {p.kind}")
        elif not isinstance(p, Replicated):
            parts.append(f"'{n.name}' {type(p).__name__}")
    return ", ".join(parts) or "no split input"


def propagate(gm: fx.GraphModule, input_dims: Mapping[str, int | None]) -> dict[fx.Node, Placement]:
    """Placements for every node of ``gm`` (the output node excluded).

    A device-local order (:mod:`~dpcompile.analysis.batch_rules.local_order`) that something
    would read whole is not made: the propagation runs again with the node that made it whole."""
    whole_orders: dict[str, str] = {}
    while True:
        placements = _propagate_once(gm, input_dims, whole_orders)
        escaping = escaping_roots(gm, placements) - whole_orders.keys()
        if not escaping:
            return placements
        for root in escaping:
            whole_orders[root] = (
                "each device would order (or number) its own rows, and a value in that order is read whole further on"
            )


def _propagate_once(
    gm: fx.GraphModule, input_dims: Mapping[str, int | None], whole_orders: Mapping[str, str]
) -> dict[fx.Node, Placement]:
    modules = dict(gm.named_modules())
    placements: dict[fx.Node, Placement] = {}
    ranks: dict[fx.Node, int] = shape_reads(gm)
    for node in gm.graph.nodes:
        module = None
        if node.op == "placeholder":
            dim = input_dims.get(node.target)
            placements[node] = Split(dim, origin=node.target) if dim is not None else REPLICATED
        elif node.op == "get_attr":
            placements[node] = REPLICATED
        elif node.op == "output":
            continue
        else:
            module = modules.get(node.target) if node.op == "call_module" else None
            placements[node] = decide(node, placements, module, ranks, whole_orders)
        bound = rank_bound(node, placements[node], ranks, module)
        if bound is not None:
            ranks[node] = max(bound, ranks.get(node, 0))
    return placements


def shape_reads(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Lower bounds on ranks from what forward reads of shapes: ``b, t, d = x.shape`` reads
    ``x.shape[2]``, so ``x`` has 3 dims or more (a tensor's rank is the same all through forward);
    and from the modules that take it: a ``Conv2d``'s input has 3 dims or more (4 batched), so
    DeepLab's ``x.shape[-2:]`` of its input, traced without examples, does not read the batch size."""
    out: dict[fx.Node, int] = {}
    modules = dict(gm.named_modules())

    def note(tensor: Any, index: Any) -> None:
        if isinstance(tensor, fx.Node) and isinstance(index, int) and not isinstance(index, bool):
            need = index + 1 if index >= 0 else -index
            out[tensor] = max(out.get(tensor, 0), need)

    for node in gm.graph.nodes:
        module = modules.get(node.target) if node.op == "call_module" else None
        rank = next((r for cls, r in _CONV_RANKS.items() if isinstance(module, cls)), None)
        if rank is not None and node.args and isinstance(node.args[0], fx.Node):
            out[node.args[0]] = max(out.get(node.args[0], 0), rank - 1)  # unbatched, at the least
        if node.op == "call_method" and node.target == "size" and len(node.args) > 1:
            note(node.args[0], node.args[1])
        elif node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            shape = node.args[0]
            is_shape = (shape.op == "call_function" and shape.target is getattr and shape.args[1] == "shape") or (
                shape.op == "call_method" and shape.target == "size" and len(shape.args) == 1
            )
            if is_shape:
                note(shape.args[0], node.args[1])
    return out


_CONV_RANKS = {nn.Conv1d: 3, nn.Conv2d: 4, nn.Conv3d: 5, nn.BatchNorm2d: 4, nn.BatchNorm3d: 5, nn.MaxPool2d: 4,
               nn.AvgPool2d: 4, nn.AdaptiveAvgPool2d: 4, nn.ConvTranspose2d: 4}  # fmt: skip


def rank_bound(node: fx.Node, placement: Placement, ranks: Mapping[fx.Node, int], module: nn.Module | None) -> int | None:
    """A lower bound on the rank of ``node``'s value (its rank where shapes are known), so that
    a negative dim is resolved only where it surely does not name the batch dim.

    Without shapes: a tensor split on dim d has d+1 dims or more; a view to k sizes, a permute
    of k dims and a batched Conv2d have exactly k (4); element-wise ops keep the largest of
    their inputs'; an embedding adds one; ``unsqueeze``/``stack`` add one.
    """
    shape = node_shape(node)
    if shape is not None:
        return len(shape)
    low = placement.dim + 1 if isinstance(placement, Split) else None

    def best(*values: int | None) -> int | None:
        known = [v for v in values if v is not None]
        return max(known) if known else None

    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    inner = ranks.get(first) if first is not None else None
    if node.op == "call_module" and module is not None:
        for cls, rank in _CONV_RANKS.items():
            if isinstance(module, cls) and isinstance(placement, Split) and placement.dim == 0:
                return rank
        if isinstance(module, nn.Embedding):
            return best(low, inner + 1 if inner is not None else None)
        if isinstance(module, (nn.Linear, nn.LayerNorm, nn.Dropout, nn.Identity, nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh)):
            return best(low, inner)
        return low
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if name in ("view", "reshape", "permute", "expand", "new_zeros", "new_ones", "new_empty", "repeat"):
        sizes = list(node.args[1:]) if node.op == "call_method" else list(node.args[1:2])
        if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
            sizes = list(sizes[0])
        one_shape_node = len(sizes) == 1 and isinstance(sizes[0], fx.Node)  # x.view(shape): rank unknown here
        if sizes and not one_shape_node and all(not isinstance(x, (list, tuple)) for x in sizes):
            return best(low, len(sizes))
        return low
    if name in ("unsqueeze", "stack"):
        src = node.args[0][0] if name == "stack" and isinstance(node.args[0], (list, tuple)) and node.args[0] else first
        r = ranks.get(src) if isinstance(src, fx.Node) else None
        return best(low, r + 1 if r is not None else None)
    if name in ("bmm", "baddbmm"):
        return best(low, 3)
    if name == "addmm":
        return best(low, 2)
    if name == "einsum" and node.args and isinstance(node.args[0], str) and "->" in node.args[0] and "..." not in node.args[0]:
        return best(low, len(node.args[0].split("->")[1].strip()))
    if name == "getitem" and first is not None and first.op in ("call_method", "call_function"):
        chunked = getattr(first.target, "__name__", first.target)
        if chunked in ("chunk", "split") and isinstance(node.args[1], int):
            return best(low, ranks.get(first.args[0]) if isinstance(first.args[0], fx.Node) else None)
        return low
    if name == "embedding":
        return best(low, inner + 1 if inner is not None else None)
    if name in ("transpose", "contiguous", "softmax", "log_softmax", "cat", "roll", "flip", "to", "type_as", "clone",
                "dropout", "layer_norm", "linear", "matmul", "float", "half", "masked_fill", "cumsum", "normalize"):
        if name == "cat" and isinstance(node.args[0], (list, tuple)) and node.args[0]:
            src = node.args[0][0]
            return best(low, ranks.get(src) if isinstance(src, fx.Node) else None)
        return best(low, *(ranks.get(n) for n in node.all_input_nodes))
    from dpcompile.analysis.ops import POINTWISE

    if POINTWISE.matches(node) or node.op == "call_function" and target in POINTWISE.functions:
        return best(low, *(ranks.get(n) for n in node.all_input_nodes))
    return low


def _wanted_dim(node: fx.Node, module: nn.Module | None) -> int | None:
    """The dim a sequence module wants its first input split on, if it has an opinion."""
    if isinstance(module, (nn.RNNBase, nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)):
        return 0 if batch_first(module) else 1
    if node.op == "call_function" and node.target is torch.nn.utils.rnn.pack_padded_sequence:
        first = node.args[2] if len(node.args) > 2 else node.kwargs.get("batch_first", False)
        return 0 if first else 1
    if _is_recurrent_op(node):  # aten.lstm.input(x, hx, params, ..., batch_first): the export frontend's RNN
        return 0 if node.args[8] is True else 1
    return None


_RECURRENT_OPS = ("lstm.input", "gru.input", "rnn_tanh.input", "rnn_relu.input")


def _is_recurrent_op(node: fx.Node) -> bool:
    name = getattr(node.target, "_overloadname", None) and f"{node.target._opname}.{node.target._overloadname}"
    return node.op == "call_function" and name in _RECURRENT_OPS and len(node.args) > 8


def _wanted_dims(node: fx.Node, module: nn.Module | None) -> list[tuple[fx.Node, int]]:
    """``(argument, dim)`` for every argument of ``node`` that a sequence module wants split on
    a given dim: the input as :func:`_wanted_dim` says, and an RNN's initial state ``hx``
    (``(layers, batch, hidden)``, whatever ``batch_first`` says) on dim 1."""
    out: list[tuple[fx.Node, int]] = []
    want = _wanted_dim(node, module)
    if want is not None and node.args and isinstance(node.args[0], fx.Node):
        out.append((node.args[0], want))
    if isinstance(module, nn.RNNBase) or _is_recurrent_op(node):
        hx = node.args[1] if len(node.args) > 1 else node.kwargs.get("hx")
        states = hx if isinstance(hx, (tuple, list)) else [hx]
        out.extend((state, 1) for state in states if isinstance(state, fx.Node))
    return out


def _example_shapes(gm: fx.GraphModule, example_inputs: Sequence[Any] | None) -> dict[str, Any]:
    if example_inputs is None:
        return {}
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    return dict(zip(names, example_inputs))


def infer_input_dims(
    gm: fx.GraphModule,
    *,
    batch_dim: int | None = None,
    example_inputs: Sequence[Any] | None = None,
) -> dict[str, int | None]:
    """How each input is split: ``{argument name: dim}``, ``None`` for replicated inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    examples = _example_shapes(gm, example_inputs)
    dims: dict[str, int | None] = {}
    for node in placeholders:
        annotated = node.type in _NON_TENSOR_TYPES
        example = examples.get(node.target, ...)
        if annotated or (example is not ... and not _holds_tensor(example)):
            dims[node.target] = None
        elif isinstance(example, torch.Tensor) and example.dim() == 0:
            dims[node.target] = None
        else:
            dims[node.target] = 0 if batch_dim is None else batch_dim
    if batch_dim is None:
        dims = _follow_sequence_modules(gm, dims)
    if examples:
        dims = _drop_inputs_without_batch(dims, examples, forced=batch_dim is not None)
    return dims


def _holds_tensor(value: Any) -> bool:
    from dpcompile.runtime.structures import tensor_leaves

    return bool(tensor_leaves(value))


def _follow_sequence_modules(gm: fx.GraphModule, dims: dict[str, int | None]) -> dict[str, int | None]:
    """Move an input's split to dim 1 where it reaches a ``batch_first=False`` sequence module."""
    modules = dict(gm.named_modules())
    if not any(_wanted_dims(n, modules.get(n.target) if n.op == "call_module" else None) for n in gm.graph.nodes):
        return dims
    decided: dict[str, int] = {}
    for _ in range(4):
        placements = propagate(gm, dims)
        changed = False
        for node in gm.graph.nodes:
            module = modules.get(node.target) if node.op == "call_module" else None
            for arg, want in _wanted_dims(node, module):
                got = placements.get(arg)
                if not isinstance(got, Split) or got.origin is None or got.dim == want:
                    continue
                origin = got.origin
                if origin in decided and decided[origin] != want:
                    raise ValueError(
                        f"cannot tell the batch dim of input '{origin}': it reaches modules that want it "
                        f"split on dim {decided[origin]} and on dim {want}; pass batch_dim= to say which"
                    )
                decided[origin] = want
                dims[origin] = want
                changed = True
        if not changed:
            break
    return dims


def _drop_inputs_without_batch(
    dims: dict[str, int | None], examples: Mapping[str, Any], *, forced: bool
) -> dict[str, int | None]:
    """With example inputs: tensors whose size on their split dim is not the batch size are replicated."""
    from dpcompile.runtime.structures import tensor_leaves

    sizes: dict[str, int] = {}
    for name, dim in dims.items():
        if dim is None or name not in examples:
            continue
        leaves = [t for _, t in tensor_leaves(examples[name]) if t.dim() > dim]
        if leaves:
            sizes[name] = leaves[0].size(dim)
    if not sizes:
        return dims
    counts = Counter(sizes.values())
    first = next(iter(sizes.values()))
    top, top_count = counts.most_common(1)[0]
    if len(counts) > 1 and list(counts.values()).count(top_count) > 1 and top != first:
        names = ", ".join(f"'{n}' ({s})" for n, s in sizes.items())
        raise ValueError(
            f"cannot tell the batch size from the example inputs: {names} disagree on their split "
            "dims; pass batch_dim= or give inputs whose batch sizes agree"
        )
    batch = first if counts[first] >= top_count else top
    out = dict(dims)
    for name, size in sizes.items():
        if size != batch:
            if forced:
                raise ArgumentError(
                    f"input '{name}' has size {size} on batch_dim={dims[name]}, but the batch is {batch}: every "
                    "input is split on that dim. Where inputs hold their batch on different dims (a "
                    "key_padding_mask (batch, seq) beside a batch_first=False attention's (seq, batch, embed)), "
                    "leave batch_dim= out and use frontend='fx', which follows each input to the module that reads "
                    "it; or give the inputs one layout"
                )
            out[name] = None
    return out


def output_placements(gm: fx.GraphModule, placements: Mapping[fx.Node, Placement]) -> list[Placement]:
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return _arg_placement(out_node.args, placements)

# a rule that analyses a checkpointed block's own graph with propagate (so it lives here)

def checkpointed(ctx: RuleContext) -> Placement | None:
    """``torch.utils.checkpoint.checkpoint(self.block, x, ...)`` (captured as a call of the
    submodule): the block's own graph is analysed with the call's input placements; it runs per
    device, checkpointed on each, when everything in it runs split there (no partial or whole
    results, no BatchNorm that would need the whole batch's statistics)."""
    import torch.fx as fx

    from dpcompile.analysis.ops import BATCH_NORMS

    ref, *args = ctx.node.args
    owner = ctx.node.graph.owning_module
    if not (isinstance(ref, fx.Node) and ref.op == "get_attr" and owner is not None):
        return None
    try:
        block = owner.get_submodule(str(ref.target))
    except AttributeError:
        return None
    if any(isinstance(m, BATCH_NORMS) and m.training for m in block.modules()):
        return Whole(reason="a checkpointed block with BatchNorm in training needs the whole batch's statistics")
    dims: dict[str, int | None] = {}
    try:
        sub = fx.symbolic_trace(block)
    except Exception:  # noqa: BLE001 - a block fx cannot trace runs whole
        return Whole(reason="the checkpointed block cannot be traced to check how it treats the batch")
    inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(args) > len(inputs) or ctx.node.kwargs.keys() - {"use_reentrant", "preserve_rng_state", "determinism_check", "debug"}:
        return None
    for node, arg in zip(inputs, args):
        p = ctx.p(arg)
        if isinstance(p, Split):
            dims[node.target] = p.dim
        elif isinstance(p, Replicated):
            dims[node.target] = None
        else:
            return None
    placements = propagate(sub, dims)
    if any(isinstance(p, (Whole, Partial)) for p in placements.values()):
        return Whole(reason="the checkpointed block does not run split on its own")
    outputs = output_placements(sub, placements)
    return outputs[0] if len(outputs) == 1 else None


BATCH_RULES.register(torch.utils.checkpoint.checkpoint, checkpointed)


__all__ = [
    "propagate",
    "infer_input_dims",
    "decide",
    "output_placements",
    "node_shape",
    "BatchSize",
    "Packed",
    "Replicated",
    "Tuple",
]
