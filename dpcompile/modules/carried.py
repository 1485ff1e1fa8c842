"""What a program needs beside its graph to build the programs of other calls: the training
flags of a mode applied while tracing, and the programs a pickle carries for a model that
cannot be imported where it is loaded."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.fx as fx
from torch import nn

from dpcompile.fx_utils import copy_graph, graph_module
from dpcompile.program_cache import CallKey


@contextlib.contextmanager
def modes_applied(model: nn.Module, modes: Sequence[tuple[str, bool]]) -> Iterator[nn.Module]:
    """``model`` with the training flag of each module set as ``modes`` (by path) says, for
    tracing a program of that mode; the flags are given back afterwards."""
    before = [(m, m.training) for m in model.modules()]
    try:
        modules = dict(model.named_modules())
        for path, training in modes:
            if path in modules:
                modules[path].training = training
        yield model
    finally:
        for m, training in before:
            m.training = training


class CarriedPrograms:
    """The build function of a program restored without its model: the programs carried in
    the pickle, or an error naming what the call needs."""

    def __init__(self, pm: Any, programs: Sequence[tuple[CallKey, fx.Graph | None]]):
        self.pm = pm
        self.programs = dict(programs)
        # what each program built is finished with (FSDP's: read the pieces where the program reads a weight)
        self.finish: Callable[[fx.GraphModule], None] | None = None

    def __call__(self, key: CallKey, args: tuple, kwargs: dict) -> fx.GraphModule | None:
        program = self._build(key, args, kwargs)
        if program is not None and self.finish is not None:
            self.finish(program)
        return program

    def _build(self, key: CallKey, args: tuple, kwargs: dict) -> fx.GraphModule | None:
        portable = key.portable()
        if portable in self.programs:
            graph = self.programs[portable]
            return None if graph is None else graph_module(self.pm, copy_graph(graph), type(self.pm).__name__)
        fewer = key.devices < max(len(self.pm.devices), self.pm.__dict__.get("micro_batches", 0))  # devices or micro-batches
        if (fewer or key.batched or key.unbatched) and self.pm.captured is not None:  # lowered again
            return self.pm.recipe.build_program(self.pm, key, args, kwargs)
        raise self.pm.cannot_trace_again(key)
