"""Grad mode inside a captured forward: what ``torch.no_grad()`` blocks leave behind."""

from __future__ import annotations

from typing import Any

import torch

from dpcompile.runtime.structures import map_structure


def without_grad(value: Any) -> Any:
    """``value`` as a ``torch.no_grad()`` block inside forward made it: its tensors carry no
    gradient back (detached), anything else is passed through.

        with torch.no_grad():                     # forward, as the user wrote it
            t = self.teacher(x)
        ...
        teacher = getattr(self, "teacher")(x)     # the captured program
        teacher_no_grad = without_grad(teacher)   # where the block's value leaves it
    """
    return map_structure(lambda leaf: leaf.detach() if isinstance(leaf, torch.Tensor) else leaf, value)


def grad_over_devices(outputs: Any, parts: list[list[Any]], combine: list[Any], device: Any, **options: Any) -> tuple:
    """``torch.autograd.grad(outputs, inputs, **options)`` where each input of forward is ``parts[i]``, the
    pieces the devices computed it as: its gradient is theirs gathered along ``combine[i]`` (a gather
    dim), or summed where ``combine[i]`` is None (a value each device computed alike, or one whole part).

        grad = grad_over_devices((energy,), [[x_dev0, x_dev1]], [0], 'cpu', create_graph=True)
    """
    from dpcompile.runtime.comm import gather
    from dpcompile.runtime.reduce import reduce_add

    flat = [p for group in parts for p in group]
    grads = torch.autograd.grad(outputs, flat, **options)
    out: list[Any] = []
    at = 0
    for group, dims in zip(parts, combine, strict=True):
        pieces, at = list(grads[at : at + len(group)]), at + len(group)
        if all(g is None for g in pieces):
            out.append(None)
        elif dims is None:
            out.append(reduce_add([g for g in pieces if g is not None], device))
        else:  # a device whose rows the output did not read (allow_unused): zeros, as the whole's rows would be
            out.append(gather([torch.zeros_like(p) if g is None else g for g, p in zip(pieces, group)], dims, device))
    return tuple(out)
