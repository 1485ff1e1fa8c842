"""What a ``torch.export``-captured program fixed about its arguments, checked at every call.

``torch.export`` keeps the batch dim dynamic (and the dims ``dynamic_dims=`` names); every
other dim, each tensor's dtype and whether an argument is a tensor at all are baked into the
program. A call that departs from them would fail deep inside an ATen op (``size of tensor a
(12) must match ...``) or, worse, broadcast silently (a position table sliced to the example's
length); :func:`check_inputs` refuses it first, naming the argument, its shape and the shape
captured:

    specs = input_specs(gm)                 # at capture: one InputSpec per placeholder
    check_inputs(specs, args, kwargs)       # at each call: DpCompileError where one does not fit
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.errors import DpCompileError


class InputMismatch(DpCompileError):
    """A call's argument does not fit what the captured program fixed (a shape, a dtype, None)."""


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One argument of a captured program: ``shape`` has None for a dynamic dim; ``dtype``
    None where the argument was not a tensor (a Python value the program checks itself)."""

    name: str
    shape: tuple[int | None, ...] | None = None
    dtype: torch.dtype | None = None
    fixed_by_code: tuple[int, ...] = ()  # dims export was asked to keep dynamic, which the model's code fixed

    def describe(self) -> str:
        return "(" + ", ".join("*" if d is None else str(d) for d in self.shape or ()) + ("," if len(self.shape or ()) == 1 else "") + ")"


@dataclasses.dataclass
class ExportedFrom:
    """The model a ``torch.export`` program was captured from, and what it fixed: the arguments
    (:class:`InputSpec`) and the modules the program calls (the rest were traced through)."""

    model: nn.Module
    inputs: tuple[InputSpec, ...] = ()
    called: frozenset[str] = frozenset()


def input_specs(gm: fx.GraphModule) -> tuple[InputSpec, ...]:
    """The placeholders of an exported program, with the dims export left dynamic as None."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = tuple(None if is_dynamic(d) else int(d) for d in val.shape)
            fixed = tuple(i for i, d in enumerate(val.shape) if isinstance(d, torch.SymInt) and not is_dynamic(d))
            out.append(InputSpec(str(node.target), shape, val.dtype, fixed))
        else:
            out.append(InputSpec(str(node.target)))
    return tuple(out)


def is_dynamic(size: Any) -> bool:
    """A dim export left dynamic: a SymInt that is still a symbol (export's ``Dim.AUTO`` replaces a
    symbol the model's code fixed by its example value, and the placeholder keeps that SymInt)."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    return isinstance(size, torch.SymInt) and not is_concrete_int(size)


def called_modules(gm: fx.GraphModule) -> frozenset[str]:
    """The paths of the modules ``gm`` calls (their hooks and modes apply at run time)."""
    return frozenset(str(n.target) for n in gm.graph.nodes if n.op == "call_module")


def check_inputs(specs: Sequence[InputSpec], args: tuple, kwargs: Mapping[str, Any], model_name: str = "the model") -> None:
    """Raise :class:`InputMismatch` for the first argument whose shape, dtype or tensor-ness
    departs from what the program was captured with, or that the program has no place for."""
    names = {spec.name for spec in specs}
    extra = [k for k in kwargs if k not in names] + [f"positional argument {i + 1}" for i in range(len(specs), len(args))]
    if extra:
        raise InputMismatch(
            f"{model_name} was captured by torch.export without {extra[0]!r} (the examples did not pass it), so the "
            f"program takes only {sorted(names)}; call dpcompile.transform with examples that pass it "
            "(example_kwargs=) for calls that do"
        )
    for position, spec in enumerate(specs):
        if spec.dtype is None:
            continue
        if position < len(args):
            value = args[position]
        elif spec.name in kwargs:
            value = kwargs[spec.name]
        else:
            raise InputMismatch(
                f"argument '{spec.name}' is missing, but {model_name} was captured by torch.export with a tensor of "
                f"shape {spec.describe()} there, and export fixes which arguments are tensors; pass '{spec.name}', or "
                f"call dpcompile.transform with examples that leave it out (and keep this program for calls that pass it)"
            )
        if not isinstance(value, torch.Tensor):
            raise InputMismatch(
                f"argument '{spec.name}' is {_short(value)}, but the program was captured by torch.export with a "
                f"tensor of shape {spec.describe()} there, and export fixes which arguments are tensors; pass a "
                f"tensor, or call dpcompile.transform with examples that leave '{spec.name}' {_short(value)} "
                "(and keep this program for calls that pass it)"
            )
        shape = value.shape
        if len(shape) != len(spec.shape) or any(d is not None and d != s for d, s in zip(spec.shape, shape)):
            fixed = [i for i, (d, s) in enumerate(zip(spec.shape, shape)) if d is not None and d != s]
            where = f" (dim {fixed[0]}: {shape[fixed[0]]} vs {spec.shape[fixed[0]]})" if fixed else ""
            way_out = (
                f"Pass dynamic_dims={{'{spec.name}': [{fixed[0] if fixed else 1}]}} to dpcompile.transform "
                "(or examples of this shape); an example batch of 2 or more keeps the batch dim dynamic"
            )
            if fixed and fixed[0] in spec.fixed_by_code:  # CLIP's loss: torch.arange(len(logits))
                way_out = (
                    f"The model's code fixed that dim while torch.export captured it (a Python int made of a size, "
                    "such as len(tensor) or int(x.shape[0]), or a branch on it), so dynamic_dims= cannot free it: call "
                    f"with size {spec.shape[fixed[0]]} there, or transform again with examples of this shape (a program "
                    "per size), or move that code out of forward (CLIPModel: return_loss=False, the loss outside)"
                )
            elif fixed and spec.shape[fixed[0]] == 1:  # export fixes a size-1 dim: dynamic_dims= cannot free it
                way_out = (
                    f"The example gave '{spec.name}' size 1 there, and export fixes a dim of size 1 (a mask that "
                    "broadcasts, replicated): call dpcompile.transform with example_inputs= whose "
                    f"'{spec.name}' has the size calls give it there (the batch: an example batch of 2 or more "
                    "keeps the batch dim dynamic)"
                )
            raise InputMismatch(
                f"argument '{spec.name}' has shape {tuple(shape)}, but {model_name} was captured by torch.export "
                f"for shape {spec.describe()} (* = dynamic){where}: export fixed every dim the examples did not "
                f"say varies. {way_out}"
            )
        if value.dtype != spec.dtype:
            raise InputMismatch(
                f"argument '{spec.name}' is {value.dtype}, but {model_name} was captured by torch.export for "
                f"{spec.dtype} (dtypes are fixed in the program); pass {spec.dtype}, or call dpcompile.transform "
                f"again with {value.dtype} examples (after model.to({value.dtype}) where the model changed)"
            )


def _short(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"
