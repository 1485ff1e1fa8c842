"""How much of a data-parallel program runs split: the share of forward FLOPs that runs per device.

An op with no batch rule (or whose rule cannot split its inputs) runs once, on the gathered
batch; everything after it that depends on it does too. With 95% of the work whole, 8 devices
give at most 1.05x (Amdahl), so :func:`whole_ops` says which ops run whole and why, and
:func:`split_fraction` weighs them by FLOPs.

FLOPs come from ``torch.utils.flop_counter`` on fake tensors (:func:`node_flops`), so they
need example inputs. Without them :func:`parameter_weights` stands in: each op weighs the
parameter elements it reads (a Linear or convolution counts its weight; a reshape counts
nothing), which ranks the ops that matter (matmuls and convolutions) as FLOPs do.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.analysis.placement import Placement, Whole
from dpcompile.fx_utils import FreshArguments, attribute_at, state_writes_undone

log = logging.getLogger("dpcompile")

__all__ = ["WholeOp", "node_flops", "node_flops_from_shapes", "parameter_weights", "split_fraction", "whole_ops"]


@dataclass(frozen=True)
class WholeOp:
    """One op that runs on the gathered batch: its node, what it calls, why, and its weight."""

    node: str
    target: str
    reason: str
    flops: int = 0


def whole_ops(gm: fx.GraphModule, placements: Mapping[fx.Node, Placement], weights: Mapping[str, int]) -> list[WholeOp]:
    """The nodes of a captured graph that run whole along the batch, in graph order."""
    from dpcompile.analysis.batch_dims import op_name
    from dpcompile.analysis.batch_rules import builds_returned_structure

    modules = dict(gm.named_modules())
    out = []
    for node in gm.graph.nodes:
        p = placements.get(node)
        if isinstance(p, Whole) and p.batch and not builds_returned_structure(node):
            module = modules.get(node.target) if node.op == "call_module" else None
            out.append(
                WholeOp(node.name, op_name(node, module), p.reason or "runs whole", int(weights.get(node.name, 0)))
            )
    return out


def split_fraction(weights: Mapping[str, int], whole: Sequence[str]) -> float | None:
    """``1 - weight(whole nodes) / weight(all nodes)``; None where nothing weighs anything."""
    total = sum(weights.values())
    if total <= 0:
        return None
    names = set(whole)
    return 1.0 - sum(w for name, w in weights.items() if name in names) / total


class _FlopRecorder(FreshArguments):
    def __init__(self, gm: fx.GraphModule, counter: Any):
        super().__init__(gm, garbage_collect_values=True)
        self.counter = counter
        self.flops: dict[str, int] = {}

    def run_node(self, n: fx.Node) -> Any:
        before = self.counter.get_total_flops()
        result = super().run_node(n)
        self.flops[n.name] = int(self.counter.get_total_flops() - before)
        return result


def node_flops(gm: fx.GraphModule, inputs: Sequence[Any]) -> dict[str, int] | None:
    """Forward FLOPs per node of ``gm`` run on fake copies of ``inputs``; None where that fails.
    Buffers (BatchNorm running statistics) are left as they were."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
        with _buffers_kept(gm), state_writes_undone(gm), mode, FlopCounterMode(display=False) as counter:
            recorder = _FlopRecorder(gm, counter)
            recorder.run(*fake)
        return recorder.flops
    except Exception as e:  # noqa: BLE001 - a figure, not a requirement
        log.debug("cannot count FLOPs on fake tensors: %s", e)
        return None


@contextlib.contextmanager
def _buffers_kept(*values: Any) -> Iterator[None]:
    """Run the block, then put the real buffers (BatchNorm running statistics) of every module in
    ``values`` (a module called, or passed to a function: ``checkpoint(self.block, x)``) back as they were."""
    modules = [v for v in torch.utils._pytree.tree_leaves(values) if isinstance(v, nn.Module)]
    buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers() if type(b) is torch.Tensor]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                if not torch.equal(b, saved):
                    b.copy_(saved)


_NO_FLOPS = (operator.getitem, getattr, len)
#: modules whose forward runs no op FlopCounterMode counts (no matmul, convolution or attention)
_NO_FLOP_MODULES = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.Embedding, nn.Dropout, nn.Identity,
                    nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Softmax)  # fmt: skip


def _standard_forward(module: nn.Module, classes: tuple[type, ...]) -> bool:
    """``module`` is one of ``classes`` and runs that class's own forward (not a subclass's)."""
    return any(isinstance(module, c) and type(module).forward is c.forward for c in classes)


def node_flops_from_shapes(gm: fx.GraphModule) -> dict[str, int] | None:
    """Forward FLOPs per node from the shapes shape propagation recorded (``node.meta['val']``),
    without running the graph again: an ATen op with a FLOP formula (``mm``, ``addmm``, attention,
    convolution) is counted from its arguments' shapes; a module call, or an op that decomposes
    into such ops, runs alone on its recorded fake arguments. None where a node has no shape.

    The figures equal :func:`node_flops` on the inputs the shapes were propagated from, at the
    cost of a few module calls instead of a second fake run of the whole graph.
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    def recorded(n: fx.Node) -> Any:
        return attribute_at(gm, str(n.target)) if n.op == "get_attr" and "val" not in n.meta else n.meta["val"]

    def value(arg: Any) -> Any:
        return fx.node.map_arg(arg, recorded)

    out: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            out[node.name] = 0
            continue
        target = node.target
        formula = flop_registry.get(target.overloadpacket) if isinstance(target, torch._ops.OpOverload) else None
        if (node.op == "call_function" and target in _NO_FLOPS) or (
            isinstance(target, torch._ops.OpOverload) and formula is None
            and not torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd")
        ):  # fmt: skip
            out[node.name] = 0  # a kernel of its own and no FLOP formula: FlopCounterMode counts 0 too
            continue
        if (
            any("val" not in arg.meta and arg.op != "get_attr" for arg in node.all_input_nodes)
            or "val" not in node.meta
        ):
            return None
        if formula is not None:
            out[node.name] = _count(formula(*value(node.args), **value(node.kwargs), out_val=node.meta["val"]))
            continue
        args, kwargs = value(node.args), value(node.kwargs)
        module = gm.get_submodule(str(target)) if node.op == "call_module" else None
        if module is not None and _standard_forward(module, (nn.Linear,)) and isinstance(args[0], torch.Tensor):
            out[node.name] = _count(2 * args[0].numel() * module.out_features)  # what FlopCounterMode counts of its mm
            continue
        if module is not None and _standard_forward(module, _NO_FLOP_MODULES):
            out[node.name] = 0
            continue
        fake = [v for v in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(v, FakeTensor)]
        if not fake:
            if isinstance(node.meta["val"], torch.Tensor):
                return None
            out[node.name] = 0  # Python values in and out (the mode's dropout_p)
            continue
        if module is not None:
            fn = module
        elif node.op == "call_method":
            fn = getattr(args[0], str(target))
            args = args[1:]
        else:
            fn = target
        try:
            with _buffers_kept(fn, args, kwargs), fake[0].fake_mode, FlopCounterMode(display=False) as counter:
                fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a figure, not a requirement
            log.debug("cannot count FLOPs of %s from its shapes: %s", node.name, e)
            return None
        out[node.name] = _count(counter.get_total_flops())
    return out


def _count(flops: Any) -> int:
    """A node's FLOPs as an int; a count that depends on a data-dependent size (the rows
    ``nonzero`` selects) is unknown before the call and counts 0."""
    try:
        return int(flops)
    except Exception:  # noqa: BLE001 - torch's GuardOnDataDependentSymNode: no value to count
        return 0


def parameter_weights(gm: fx.GraphModule) -> dict[str, int]:
    """Per node, the parameter elements it reads (a module's own, or ``get_attr`` inputs):
    the stand-in for FLOPs where no example inputs give shapes."""
    modules = dict(gm.named_modules())
    out: dict[str, int] = {}
    for node in gm.graph.nodes:
        weight = 0
        if node.op == "call_module" and isinstance(modules.get(node.target), nn.Module):
            weight = sum(p.numel() for p in modules[node.target].parameters())
        elif node.op in ("call_function", "call_method"):
            for arg in node.all_input_nodes:
                if arg.op == "get_attr":
                    value = attribute_at(gm, arg.target)
                    if isinstance(value, torch.Tensor) and value.dim() >= 2:
                        weight += value.numel()
        out[node.name] = weight
    return out

