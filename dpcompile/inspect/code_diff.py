"""``diff``: the code before (the model as traced) and after (``pm.code``)."""

from __future__ import annotations

import difflib

import torch.fx as fx
from torch import nn

from dpcompile.capture import capture

__all__ = ["diff"]


def diff(model: nn.Module | None, pm: fx.GraphModule) -> str:
    """The code before (the model as traced) and after (``pm.code``), as a unified diff.

    >>> import torch, dpcompile
    >>> model = torch.nn.Linear(8, 4)
    >>> pm = dpcompile.transform(model, ["cpu", "cpu"])
    >>> [line for line in dpcompile.diff(model, pm).splitlines() if "scatter(" in line][0][:40]
    '+    input_1_scatter = dpcompile_runtime'
    """
    if model is None:
        captured = getattr(pm, "captured", None)
        if captured is None:
            raise ValueError("diff(None, pm) needs a pm that kept its captured graph; pass the model")
        before = captured.code
    else:
        before = capture(model).code
    after = pm.code
    lines = difflib.unified_diff(
        before.strip("\n").splitlines(),
        after.strip("\n").splitlines(),
        fromfile=f"{type(model).__name__ if model is not None else 'captured'} (traced)",
        tofile=f"{type(pm).__name__} ({getattr(pm, 'mode', '')})",
        lineterm="",
    )
    return "\n".join(lines) + "\n"
