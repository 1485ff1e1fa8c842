"""``torch.autograd.grad`` inside forward, under ``insert_scatter_gather``: a gradient with respect to a
value forward computed per device (an energy model's ``x = x.detach().requires_grad_()``, a gradient
penalty's inputs) is taken with respect to the parts the devices computed it as, then put back together.
The gathered value is a new tensor no output was computed from: its gradient was an error at call time::

    grad = torch.autograd.grad((energy,), (x_req,), create_graph=True)   # forward, as captured

    x_req = gather([x_req_dev0, x_req_dev1], 0, 'cpu')                   # before: x_req is not in the graph
    grad = torch.autograd.grad((energy,), (x_req,), create_graph=True)

    grad = grad_over_devices((energy,), [[x_req_dev0, x_req_dev1]], [0], 'cpu', create_graph=True)   # after

A value each device computed alike (replicated: ``w2 = self.w * 2``) has its parts' gradients summed;
inputs, parameters and values computed whole are passed as they are (the devices' copies of them are
computed from them, so their gradient counts every device).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dpcompile import runtime
from dpcompile.analysis.placement import Replicated
from passes.data_parallel_nodes import gather_dims


def is_autograd_grad(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.autograd.grad


def emit_grad_over_devices(b: Any, node: fx.Node) -> fx.Node | None:
    """Emit ``node`` (``torch.autograd.grad``) on builder ``b`` with its per-device inputs as their parts;
    None where no input was computed per device (then it runs whole as any op)."""
    inputs = node.args[1] if len(node.args) > 1 else node.kwargs.get("inputs")
    single = isinstance(inputs, fx.Node)
    values = [inputs] if single else list(inputs) if isinstance(inputs, (tuple, list)) else None
    if not values or not all(isinstance(v, fx.Node) for v in values):
        return None
    parts: list[list[Any]] = []
    combine: list[Any] = []
    for value in values:
        placement = b.placements.get(value)
        dims = gather_dims(placement) if placement is not None else None
        if value.op not in ("placeholder", "get_attr") and value in b.per_device and dims is not None:
            parts.append(list(b.per_device[value]))
            combine.append(dims)
        elif value.op not in ("placeholder", "get_attr") and value in b.per_device and isinstance(placement, Replicated):
            parts.append(list(dict.fromkeys(b.per_device[value])))  # a part shared by devices counts once
            combine.append(None)
        else:
            parts.append([b.whole_value(value)])
            combine.append(None)
    if all(len(p) == 1 for p in parts):
        return None
    outputs = fx.node.map_arg(node.args[0] if node.args else node.kwargs["outputs"], b.whole_value)
    kwargs = {k: v for k, v in node.kwargs.items() if k not in ("outputs", "inputs")}
    kwargs = fx.node.map_arg(kwargs, b.whole_value)
    new = b.call(runtime.grad_over_devices, (outputs, parts, combine, b.primary), kwargs, name=node.name, source=node)
    new.meta["dpcompile_whole"] = "a gradient with respect to values the devices computed, put back together"
    b.whole[node] = new
    return new
