"""What programs made by the export frontend call at run time (plain functions, so the
generated code names them), and the pickling of ATen op overloads by name."""

from __future__ import annotations

import copyreg
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.errors import DpCompileError


@fx.node.has_side_effect
def expect_value(value: Any, expected: Any, name: str) -> None:
    """Checked at each call: a Python argument the program was exported for keeps its value."""
    if value is not expected and value != expected:
        raise DpCompileError(
            f"this program was exported with {name}={expected!r}; a call with {name}={value!r} takes another "
            f"path through forward: transform the model with example_kwargs holding {name}={value!r}"
        )


@fx.node.has_side_effect
def expect_mode(module: nn.Module, training: bool) -> None:
    """Checked at each call where the exported graph bakes in the mode (dropout in attention)."""
    if module.training != training:
        mode = "training" if training else "eval"
        raise DpCompileError(
            f"this program was exported in {mode} mode, and forward takes another path in the other mode "
            "(`if self.training:` around ops, which torch.export bakes in); "
            f"transform the model again after model.{'eval' if training else 'train'}() for the other mode"
        )


def cross_entropy_count(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """The denominator of ``cross_entropy(..., reduction='mean')``: the (weighted) count of
    targets that are not ``ignore_index`` (one per sample for class-probability targets)."""
    from dpcompile.runtime.reduce import target_weight

    return target_weight(target, weight, ignore_index)


def element_count(x: torch.Tensor) -> int:
    """The denominator of an element-wise loss with ``reduction='mean'``."""
    return x.numel()


def aten_op(namespace: str, name: str, overload: str) -> torch._ops.OpOverload:
    """An op overload by name (``aten``, ``view``, ``default``): how exported programs pickle
    their targets (torch's ``OpOverload`` objects do not pickle)."""
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _reduce_op(op: torch._ops.OpOverload) -> tuple:
    return (aten_op, (op.namespace, op._schema.name.split("::")[-1], op._overloadname))


copyreg.pickle(torch._ops.OpOverload, _reduce_op)


def mode_value(module: nn.Module, if_training: Any, if_eval: Any) -> Any:
    """A constant of forward that depends on the mode (``dropout_p`` of attention), chosen at run time."""
    return if_training if module.training else if_eval

__all__ = ["aten_op", "cross_entropy_count", "element_count", "expect_mode", "expect_value", "mode_value"]
