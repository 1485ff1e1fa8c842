"""Small helpers over ``torch.fx`` programs that modules and tools share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.fx as fx

__all__ = ["bind_inputs"]


def bind_inputs(gm: fx.GraphModule, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    """The value of each placeholder of ``gm`` for a call ``gm(*args, **kwargs)``, in order.

    Positional arguments fill the first placeholders, keyword arguments the rest by name; a
    placeholder left out takes its default.

    >>> import torch, torch.fx as fx
    >>> class Scaled(torch.nn.Module):
    ...     def forward(self, x, scale=2.0):
    ...         return x * scale
    >>> bind_inputs(fx.symbolic_trace(Scaled()), (1.0,), {})
    [1.0, 2.0]
    """
    values = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        name = str(node.target).lstrip("*")
        if i < len(args):
            values.append(args[i])
        elif name in kwargs:
            values.append(kwargs[name])
        elif node.args:
            values.append(node.args[0])
        else:
            raise TypeError(f"explain: missing argument '{name}' (the program takes {[str(p.target) for p in placeholders]})")
    return values
