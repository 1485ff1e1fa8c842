"""``diff``: the code before (the model as traced) and after (``pm.code``)."""

from __future__ import annotations

import difflib

import torch.fx as fx
from torch import nn

from dpcompile.capture import capture
from dpcompile.errors import ArgumentError, TraceError

__all__ = ["diff"]


def diff(model: nn.Module | None, pm: fx.GraphModule) -> str:
    """The code before (the model as traced) and after (``pm.code``), as a unified diff.

    >>> import torch, dpcompile
    >>> model = torch.nn.Linear(8, 4)
    >>> pm = dpcompile.transform(model, ["cpu", "cpu"])
    >>> [line for line in dpcompile.diff(model, pm).splitlines() if "scatter(" in line][0][:40]
    '+    input_1_scatter = dpcompile_runtime'
    """
    kept = _captured_code(pm)
    if model is None:
        if kept is None:
            raise ArgumentError("diff(None, pm) needs a pm that kept its captured graph; pass the model")
        before = kept
    else:
        try:
            before = capture(model).code
        except TraceError:  # fx cannot trace it (transform captured it with torch.export): the program pm was built from
            if kept is None:
                raise
            before = kept
    after = pm.code
    lines = difflib.unified_diff(
        before.strip("\n").splitlines(),
        after.strip("\n").splitlines(),
        fromfile=f"{type(model).__name__ if model is not None else 'captured'} (traced)",
        tofile=f"{type(pm).__name__} ({getattr(pm, 'mode', '')})",
        lineterm="",
    )
    return "\n".join(lines) + "\n"


def _captured_code(pm: fx.GraphModule) -> str | None:
    """The code of the program ``pm`` was lowered from, where ``pm`` kept it (a tensor-parallel
    program keeps only its code)."""
    captured = getattr(pm, "captured", None)
    if isinstance(captured, fx.GraphModule):
        return captured.code
    code = getattr(pm, "captured_code", None)
    return code if isinstance(code, str) else None
