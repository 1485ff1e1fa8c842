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
