"""The base of every recipe: options validated once, and the capture they share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.capture import capture, flag_arguments
from dpcompile.errors import TraceError

FRONTENDS = ("auto", "fx", "export")


@dataclass(frozen=True)
class Recipe:
    """How to compile a model, whatever the parallelism.

    ``leaf_modules``: module types the tracer must not enter; ``frontend``: ``"fx"``,
    ``"export"`` or ``"auto"``. Subclasses add what their kind needs and implement
    :meth:`compile` and :meth:`build_program`.
    """

    leaf_modules: tuple[type[nn.Module], ...] = ()
    frontend: str = "auto"

    def compile(self, model: nn.Module, example_inputs: Sequence[Any] | None) -> nn.Module:
        """``model`` compiled into this recipe's kind of ``ParallelModule``."""
        raise NotImplementedError

    def build_program(self, pm: Any, key: Any, args: tuple, kwargs: dict) -> fx.GraphModule | None:
        """The program of ``pm`` for a call with ``key`` (a :class:`~dpcompile.program_cache.CallKey`);
        None where ``pm``'s main program serves it."""
        raise NotImplementedError


def capture_with_flags(
    model: nn.Module, leaf_modules: tuple[type[nn.Module], ...], example_inputs: Sequence[Any] | None
) -> tuple[fx.GraphModule, dict[str, Any]]:
    """Capture ``model``; where forward branches on a Python flag argument (``if return_hidden:``),
    which fx traces as a value it cannot branch on, trace the flags as the values the example
    (else the defaults) gives them: the program then serves calls with those values, and the
    module traces again for others."""
    try:
        return capture(model, leaf_modules=leaf_modules), {}
    except TraceError as error:
        flags = flag_arguments(model, example_inputs) if not isinstance(model, fx.GraphModule) else {}
        if not flags:
            raise
        try:
            return capture(model, leaf_modules=leaf_modules, flags=flags), flags
        except TraceError:
            raise error from None


def move_to(model: nn.Module, device: torch.device) -> None:
    """``model.to(device)`` in place, skipped when everything is there already."""
    tensors = list(model.parameters()) + list(model.buffers())
    if any(t.device != device for t in tensors):
        model.to(device)
