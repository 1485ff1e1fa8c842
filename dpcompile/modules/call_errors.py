"""A call that fails inside the program (torch's error from deep inside: a dtype, a shape, a None
where forward wants a tensor, an argument forward does not take) is raised as a :class:`CallFailed`:
an :class:`~dpcompile.InputMismatch` (a ``DpCompileError``) that is still the kind torch raised, so
``except RuntimeError`` / ``except TypeError`` keep working, naming the arguments the call gave.

    before: RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x9 and 8x16)   # a shard's shape
    after:  RuntimeCallFailed: pm(...) failed inside the program: mat1 and mat2 shapes ... The call
            gave x: float32 tensor of shape (8, 9) on cpu. ...
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dpcompile.capture.inputs import InputMismatch
from dpcompile.errors import ExampleError


class CallFailed(InputMismatch):
    """A call of ``pm`` failed inside the program; the message has torch's own and the call's arguments."""


class RuntimeCallFailed(CallFailed, RuntimeError):
    """:class:`CallFailed` where torch raised a ``RuntimeError``."""


class NotImplementedCallFailed(CallFailed, NotImplementedError):
    """:class:`CallFailed` where torch raised a ``NotImplementedError``."""


class TypeCallFailed(CallFailed, TypeError):
    """:class:`CallFailed` where torch (or Python's call of forward) raised a ``TypeError``."""


class ValueCallFailed(CallFailed, ValueError):
    """:class:`CallFailed` where torch raised a ``ValueError``."""


class ExampleCallFailed(CallFailed, ExampleError):
    """:class:`CallFailed` where the program built for this call (a departure: an argument left None, a
    flag) could not take the call's arguments as its examples (an ``ExampleError``)."""


class IndexCallFailed(CallFailed, IndexError):
    """:class:`CallFailed` where torch raised an ``IndexError``."""


#: the kinds a failure keeps, most derived first (NotImplementedError is a RuntimeError)
KINDS: tuple[tuple[type[Exception], type[CallFailed]], ...] = (
    (NotImplementedError, NotImplementedCallFailed),
    (RuntimeError, RuntimeCallFailed),
    (TypeError, TypeCallFailed),
    (ValueError, ValueCallFailed),
    (IndexError, IndexCallFailed),
)


def describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return f"{type(value).__name__} {value!r}"[:80]
    return f"a {type(value).__name__}" + (f" of {len(value)}" if isinstance(value, (list, tuple, dict)) else "")


def describe_call(graph: fx.Graph, args: tuple, kwargs: dict) -> str:
    """``x: float32 tensor of shape (8, 9) on cpu, mask: NoneType None``, by forward's argument names."""
    names = [str(n.target) for n in graph.nodes if n.op == "placeholder"]
    given = [f"{names[i] if i < len(names) else f'argument {i}'}: {describe_value(v)}" for i, v in enumerate(args)]
    given += [f"{k}: {describe_value(v)}" for k, v in kwargs.items()]
    taken = ", ".join(names) or "no arguments"
    return f"The call gave {', '.join(given) or 'no arguments'}; forward takes ({taken})"


def call_failed(graph: fx.Graph, exc: BaseException, args: tuple, kwargs: dict) -> CallFailed | None:
    """``exc``, raised while running the program, as the :class:`CallFailed` of its kind; None where it
    is one of the package's own errors, or of a kind a call's arguments do not cause."""
    if isinstance(exc, ExampleError):  # raised building this call's program from its arguments
        return ExampleCallFailed(
            f"pm(...) has no program for this call, and the arguments do not fit the model to build one: {exc}\n"
            f"{describe_call(graph, args, kwargs)}. Pass the arguments the model's forward takes"
        )
    if isinstance(exc, InputMismatch) or type(exc).__module__.startswith("dpcompile"):
        return None
    if isinstance(exc, getattr(torch.distributed, "DistError", ())):  # a collective's failure, not the call's
        return None
    if isinstance(exc, torch.OutOfMemoryError):  # the device's, not the arguments': torch's own error says so
        return None
    kind = next((failed for raised, failed in KINDS if isinstance(exc, raised)), None)
    if kind is None:
        return None
    return kind(
        f"pm(...) failed inside the program with {type(exc).__name__}: {exc}\n{describe_call(graph, args, kwargs)}. "
        "Pass the arguments the model's forward takes, of the dtype, rank and sizes it was built for (shapes inside "
        "the program are each device's part of the batch); if the model itself runs these arguments, the program "
        "does not: dpcompile.verify(pm, model, *args) compares the two"
    )


def refused_call(graph: fx.Graph, exc: BaseException, args: tuple, kwargs: dict) -> InputMismatch | None:
    """What a call that raised ``exc`` inside the program is refused as: a kept check of a branch on
    data that failed (``BranchNotCaptured``, naming the line), else :func:`call_failed`'s error; None
    where ``exc`` stays as it is."""
    from dpcompile.capture.decided import branch_not_captured  # export's; lazy: it imports sympy

    if isinstance(exc, RuntimeError) and (branch := branch_not_captured(exc)) is not None:
        return branch
    return call_failed(graph, exc, args, kwargs)


__all__ = [
    "CallFailed",
    "ExampleCallFailed",
    "IndexCallFailed",
    "NotImplementedCallFailed",
    "RuntimeCallFailed",
    "TypeCallFailed",
    "ValueCallFailed",
    "call_failed",
    "describe_call",
    "refused_call",
]
