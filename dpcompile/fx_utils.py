"""Small torch.fx utilities every layer above the runtime shares.

* :func:`copy_graph`: a graph's copy that belongs to no module (linear time);
* :func:`adopt_state`: make a GraphModule hold *all* of a model's state, not only what its
  graph reads, so state dict keys stay the model's;
* :func:`propagate_shapes`: record each node's fake value (``node.meta["val"]``);
* :func:`placeholders`: a graph's inputs in order.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

log = logging.getLogger("dpcompile")


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` that belongs to no module (linear time, unlike ``copy.deepcopy``)."""
    clone = fx.Graph()
    clone._codegen = graph._codegen
    remap: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        remap[node] = clone.node_copy(node, lambda n: remap[n])
    return clone


def placeholders(graph: fx.Graph) -> list[fx.Node]:
    """The inputs of ``graph``, in order."""
    return [n for n in graph.nodes if n.op == "placeholder"]


def adopt_state(holder: nn.Module, model: nn.Module) -> None:
    """Make ``holder`` hold ``model``'s own submodules, parameters and buffers (the same
    objects) and training mode, so their state dicts have the same keys.

    ``fx.GraphModule`` keeps only what its graph reads, with empty stand-ins for the modules
    on the way; this restores the rest. Buffers the program holds beyond the model's (the
    tracer's ``_tensor_constant0`` for a tensor made in forward) stay out of ``state_dict``.
    """
    program_only = {key for key in holder._buffers if key not in model._buffers}
    for name in ("_modules", "_parameters", "_buffers"):
        ours, theirs = getattr(holder, name), getattr(model, name)
        merged = dict(theirs)  # the model's order, so state_dict keys come in the same order
        merged.update((key, value) for key, value in ours.items() if key not in theirs)
        ours.clear()
        ours.update(merged)
    holder._non_persistent_buffers_set = set(model._non_persistent_buffers_set) | program_only
    holder.training = model.training


def propagate_shapes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Record each node's shape (``node.meta['val']``) from fake copies of the example inputs.

    Costs no real compute; returns False (and records nothing) where fake tensors cannot run
    the model. Inputs that are fake already (``verify(..., fake_devices=)``) run in their own mode.
    """
    mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    try:
        fake_inputs = [
            mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
            for x in example_inputs
        ]
        FakeTensorProp(gm, mode).propagate(*fake_inputs)
        return True
    except Exception as e:  # noqa: BLE001 - shapes are a refinement, not a requirement
        log.debug("shape propagation on fake tensors failed (%s); continuing without shapes", e)
        for node in gm.graph.nodes:
            node.meta.pop("val", None)
        return False


def bind_inputs(gm: fx.GraphModule, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    """The value of each placeholder of ``gm`` for a call ``gm(*args, **kwargs)``, in order
    (defaults where the call leaves one out)."""
    values = []
    inputs = placeholders(gm.graph)
    for i, node in enumerate(inputs):
        name = str(node.target).lstrip("*")
        if i < len(args):
            values.append(args[i])
        elif name in kwargs:
            values.append(kwargs[name])
        elif node.args:
            values.append(node.args[0])
        else:
            raise TypeError(f"missing argument '{name}' (the program takes {[str(p.target) for p in inputs]})")
    return values
