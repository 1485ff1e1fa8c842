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


@fx.node.has_side_effect
def expect_grad_mode(enabled: bool, where: str, gradient_taken: bool = False) -> None:
    """Checked at each call where forward reads ``torch.is_grad_enabled()`` (``where``): the program took
    the branch of the grad mode it was captured in. ``gradient_taken``: forward turns gradients on
    (``torch.enable_grad()``) to take one (``torch.autograd.grad`` at ``where``), which the program does not
    switch, so a call under ``no_grad`` would fail inside it."""
    if gradient_taken and not torch.is_grad_enabled():
        raise DpCompileError(
            f"forward takes a gradient with torch.autograd.grad ({where}), which the program computes only with "
            "gradients on (it does not switch them on for a torch.enable_grad() block inside forward): called "
            "under torch.no_grad() it would fail inside. Call it with gradients on (for evaluation, pm.eval() "
            "and detach the outputs)"
        )
    if not gradient_taken and torch.is_grad_enabled() != enabled:
        mode = "with gradients on" if enabled else "under torch.no_grad()"
        raise DpCompileError(
            f"forward reads torch.is_grad_enabled() ({where}), and this program was captured {mode}: a call in the "
            "other grad mode would run the branch of the captured one. Call it in the mode it was captured in (for "
            "evaluation, pm.eval() with gradients on), or branch on self.training instead"
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
    """An op overload by name (``aten``, ``view``, ``default``): how pickled programs name their
    targets (torch's ``OpOverload`` objects do not pickle). Only a registered operator's own
    names resolve (the dispatcher is asked first), never other attributes along the way, and
    never an op that reads or writes files.

    >>> aten_op("aten", "add", "Tensor") is torch.ops.aten.add.Tensor
    True
    """
    names = (namespace, name, overload)
    if not all(isinstance(p, str) and p.isidentifier() and not p.startswith("__") for p in names[::2]) or not (
        isinstance(name, str) and name.isidentifier()
    ):
        raise DpCompileError(f"aten_op{names!r:.80}: not the name of an operator")
    if name.strip("_") in _FILE_OPS or "file" in name:
        raise DpCompileError(f"aten_op: {namespace}::{name} reads or writes files; no program calls it")
    try:
        torch._C._dispatch_find_schema_or_throw(f"{namespace}::{name}", "" if overload == "default" else overload)
    except RuntimeError:
        raise DpCompileError(f"aten_op: {namespace}::{name}.{overload} is not a registered operator") from None
    op = getattr(getattr(getattr(torch.ops, namespace), name), overload)  # a registered op's own names only
    if not isinstance(op, torch._ops.OpOverload):
        raise DpCompileError(f"aten_op: {namespace}::{name}.{overload} is not an operator overload")
    return op


_FILE_OPS = frozenset({"from_file", "save", "load", "to_file", "tofile"})


def _reduce_op(op: torch._ops.OpOverload) -> tuple:
    return (aten_op, (op.namespace, op._schema.name.split("::")[-1], op._overloadname))


copyreg.pickle(torch._ops.OpOverload, _reduce_op)


def mode_value(module: nn.Module, if_training: Any, if_eval: Any) -> Any:
    """A constant of forward that depends on the mode (``dropout_p`` of attention), chosen at run time."""
    return if_training if module.training else if_eval


class TransposedLinear(nn.Module):
    """``x @ weight + bias`` with ``weight`` stored ``(in, out)``: transformers' ``Conv1D`` (GPT-2's
    layers) as an exported program holds it, so a loaded program runs dpcompile's forward, not a
    class named by the folder. The same attributes (``nf``, ``nx``, ``weight``, ``bias``) and the
    same arithmetic as ``Conv1D.forward``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class MatmulLinear(nn.Linear):
    """``x @ weight.T`` (``+ bias``): an ``nn.Linear`` whose forward is a matmul and an add, transformers'
    ``FalconLinear`` as an exported program holds it (the same attributes and arithmetic as
    ``FalconLinear.forward``, so the loaded program runs dpcompile's forward, not a class the folder names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight.T
        return out if self.bias is None else out + self.bias


class ModelOutputRecord(dict):
    """A structured output (transformers' ``ModelOutput``) as a loaded program returns it: the
    fields that are not None, by name and in order, read as attributes (``out.logits``; a field
    left None reads None), keys (``out["logits"]``) or positions (``out[0]``, ``out.to_tuple()``),
    as ``ModelOutput`` reads them. It holds values only: no class named by the folder is built."""

    _name = "ModelOutput"
    _fields: tuple[str, ...] = ()

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_"):
            if name in self:
                return self[name]
            if name in self._fields:
                return None
        raise AttributeError(f"{self._name} has no field {name!r}")

    def __getitem__(self, key: Any) -> Any:
        return dict.__getitem__(self, key) if isinstance(key, str) else self.to_tuple()[key]

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(self.values())

    def __repr__(self) -> str:
        return f"{self._name.rpartition('.')[2]}({', '.join(f'{k}={v!r}' for k, v in self.items())})"


def model_output(name: str, fields: tuple[str, ...], *args: Any, **kwargs: Any) -> ModelOutputRecord:
    """A :class:`ModelOutputRecord` of the output class ``name`` with ``fields``, from the
    arguments its constructor was called with (positional in field order, or by keyword)."""
    values = dict(zip(fields, args))
    unknown = sorted(set(kwargs) - set(fields)) + (["(too many positional)"] if len(args) > len(fields) else [])
    if unknown:
        raise TypeError(f"{name} has no fields {unknown}")
    values.update(kwargs)
    record = ModelOutputRecord()
    record._name, record._fields = str(name), tuple(fields)
    for field in fields:
        if values.get(field) is not None:
            record[field] = values[field]
    return record


__all__ = [
    "MatmulLinear",
    "ModelOutputRecord",
    "TransposedLinear",
    "aten_op",
    "cross_entropy_count",
    "element_count",
    "expect_grad_mode",
    "expect_mode",
    "expect_value",
    "mode_value",
    "model_output",
]
