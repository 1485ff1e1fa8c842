"""The other mode of a program the export frontend captured in one mode only.

A model whose forward reads ``self.training`` (GPT-2's attention: ``dropout_p`` in training
only) exports to a different graph in each mode. ``transform`` exports the mode the model is
in; the first call in the other mode (``pm.train()`` / ``pm.eval()``, or any module's mode
switched) captures again, both modes merged, exactly as an eager capture of both would, and
every later call runs that program::

    pm = dpcompile.transform(model.eval(), devices, frontend="export", example_kwargs=kw)  # one export
    pm.train(); pm(**kw)   # exports the training mode now; the program serves both from here on
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx as fx
from torch import nn

# what transform sets on the program after building it, carried to the one built later
_CARRIED = ("memory_options", "memory_plan", "candidates", "calibration")


class OtherModePending:
    """``build()`` makes the program of both modes (with ``model``'s modules in their modes at transform,
    so that it is the program transform would have made); it runs at the first call where a module of
    ``model`` is in another mode than at transform (or where the program is saved or copied)."""

    def __init__(self, build: Callable[[], nn.Module], model: nn.Module):
        self.modes = [(m, m.training) for m in model.modules()]

        def in_modes_at_transform() -> nn.Module:
            now = [(m, m.training) for m, _ in self.modes]
            try:
                for m, training in self.modes:
                    m.training = training
                return build()
            finally:
                for m, training in now:
                    m.training = training

        self.build = in_modes_at_transform
        self.program: nn.Module | None = None

    def departed(self) -> bool:
        return any(m.training is not training for m, training in self.modes)

    def resolve(self, pm: Any) -> nn.Module:
        if self.program is None:
            program = self.build()
            for name in _CARRIED:
                if name in pm.__dict__:
                    setattr(program, name, pm.__dict__[name])
            self.program = program
        return self.program


class OtherModeInPlace:
    """The other mode of a program that owns its state (tensor parallel's shards, FSDP's pieces, a pipeline's
    placed stages; one rank's program over a mesh, wrapped by DDP): ``complete()`` makes ``pm`` itself serve
    both modes (the capture's other mode exported and merged in, lowered again by the recipe and swapped
    into ``pm``'s graph over ``pm``'s own modules and parameters, so an optimizer and DDP keep theirs). It runs at the first call where a module of ``pm`` is in another mode than at transform
    (or where ``pm`` is saved or copied); a failure leaves ``pm`` as it was, and the next call tries again::

        pm = dpcompile.transform(model, devices, tensor_parallel=True, example_kwargs=kw)  # one export
        pm.eval(); pm(**kw)   # exports the eval mode now; pm.parameters() are the same objects
    """

    def __init__(self, complete: Callable[[], None], pm: nn.Module):
        self.complete = complete
        self.modes = [(m, m.training) for m in pm.modules()]

    def departed(self) -> bool:
        return any(m.training is not training for m, training in self.modes)

    def resolve(self, pm: Any) -> nn.Module:
        from torch.nn.utils import parametrize

        cached = dict(parametrize._cache)  # inside FSDP's call, parametrize.cached(): what the build (on fake
        try:  # tensors) gathers must not be what the call reads
            self.complete()
        finally:
            parametrize._cache.clear()
            parametrize._cache.update(cached)
        pm.__dict__.pop("_other_mode", None)
        return pm


def waiting_in_place(pm: Any, recipe: Any, captured: fx.GraphModule, first_mode: fx.Graph, examples: tuple | None,
                     sharded_after: bool = False) -> Any:  # fmt: skip
    """``pm`` (``recipe`` lowered ``captured``, exported in one mode: ``first_mode`` is a copy of its graph)
    made to serve the other mode in place at its first call in it (:class:`OtherModeInPlace`); ``sharded_after``:
    the model changes after this (FSDP's pieces in its private copy): that mode is exported from a stand-in."""
    if sharded_after:
        from dpcompile.capture.export import OTHER_MODE_PENDING

        captured.meta[OTHER_MODE_PENDING].export_on_a_stand_in()

    def complete() -> None:
        from dpcompile.capture.export import OTHER_MODE_PENDING
        from dpcompile.fx_utils import copy_graph, graph_module

        merged = graph_module(captured, copy_graph(first_mode), type(captured).__name__)  # over the model's modules
        merged.meta.update({k: v for k, v in captured.meta.items() if k != OTHER_MODE_PENDING})
        merged.__dict__.update({k: v for k, v in captured.__dict__.items() if k.startswith("_dpcompile")})
        captured.meta[OTHER_MODE_PENDING].complete(merged)
        recipe.complete_other_mode(pm, merged, examples)()

    object.__setattr__(pm, "_other_mode", OtherModeInPlace(complete, pm))
    return pm


def swap_graph(pm: Any, graph: Any, constants: dict[str, Any] | None = None) -> None:
    """``pm``'s program made ``graph`` (the same placeholders, built over ``pm``'s own modules and
    tensors), the tensors it reads that ``pm`` does not hold added (``constants``)."""
    from dpcompile.errors import DpCompileError

    def held(target: str) -> bool:
        value = pm
        try:
            for atom in target.split("."):
                value = getattr(value, atom)
        except AttributeError:
            return False
        return True

    constants = dict(constants or {})
    missing = [str(n.target) for n in graph.nodes
               if n.op in ("get_attr", "call_module") and str(n.target) not in constants and not held(str(n.target))]  # fmt: skip
    if missing:
        raise DpCompileError(
            f"the program of both modes reads {missing[:3]}, which this program does not hold; transform the model "
            "again in the mode of this call"
        )
    for name, value in constants.items():
        if not held(name):
            pm.__dict__[name] = value
    pm.graph = graph
    pm.__dict__.pop("_attributes_written", None)  # what forward writes to the model: read from the new graph
    pm.__dict__.pop("one_f_one_b_steps", None)  # a pipeline's 1F1B steps, lowered from the first mode's graph
    pm.program_cache.clear()  # programs for other calls, lowered from it too


def agreed_over_mesh(mesh: Any, build: Callable[[], Any]) -> Any:
    """``build()`` on every rank of ``mesh``; where it failed on any rank, every rank raises (its own
    error, or one naming the ranks that failed)."""
    from dpcompile.errors import DpCompileError
    from dpcompile.modules.mesh_failure import built_on_every_rank

    def refusal(failed: list[tuple[int, str]]) -> DpCompileError:
        return DpCompileError(
            f"the program of both modes could not be built on rank(s) {[i for i, _ in failed]} of the mesh "
            f"({failed[0][1]}); this rank's program is left as it was: transform the model again in this mode"
        )

    return built_on_every_rank(build, mesh.get_group() if mesh.ndim == 1 else None, refusal)


def swap_program(pm: Any, built: Any, *fields: str) -> Callable[[], None]:
    """What swaps ``built`` (a program compiled again over the modules ``pm`` holds) into ``pm``: its graph
    (:func:`swap_graph`) and its ``fields`` (``captured``, a pipeline's ``stages``)."""
    from dpcompile.fx_utils import copy_graph

    def swap() -> None:
        swap_graph(pm, copy_graph(built.graph))
        for name in fields:
            object.__setattr__(pm, name, getattr(built, name))

    return swap


def program_in_other_mode(pm: Any) -> nn.Module | None:
    """The program of both modes where a call needs it (built on first need), else None (``pm``
    itself serves the call, made to serve both modes in place where it owns its state)."""
    pending = pm.__dict__.get("_other_mode")
    if isinstance(pending, OtherModeInPlace):
        if pending.departed():
            pending.resolve(pm)
        return None
    if pending is None or (pending.program is None and not pending.departed()):
        return None
    program = pending.resolve(pm)
    program.training = pm.training  # its submodules are ours: their own modes stand
    return program


def both_modes(pm: Any) -> Any:
    """``pm``, or the program of both modes where ``pm`` waits for the other one (to save or copy)."""
    pending = pm.__dict__.get("_other_mode")
    return pm if pending is None else pending.resolve(pm)
