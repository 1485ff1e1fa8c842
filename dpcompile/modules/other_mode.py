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

from torch import nn

# what transform sets on the program after building it, carried to the one built later
_CARRIED = ("memory_options", "memory_plan", "candidates", "calibration")


class OtherModePending:
    """``build()`` makes the program of both modes; it runs at the first call where a module of
    ``model`` is in another mode than at transform (or where the program is saved or copied)."""

    def __init__(self, build: Callable[[], nn.Module], model: nn.Module):
        self.build = build
        self.modes = [(m, m.training) for m in model.modules()]
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


def program_in_other_mode(pm: Any) -> nn.Module | None:
    """The program of both modes where a call needs it (built on first need), else None."""
    pending = pm.__dict__.get("_other_mode")
    if pending is None or (pending.program is None and not pending.departed()):
        return None
    program = pending.resolve(pm)
    program.training = pm.training  # its submodules are ours: their own modes stand
    return program


def both_modes(pm: Any) -> Any:
    """``pm``, or the program of both modes where ``pm`` waits for the other one (to save or copy)."""
    pending = pm.__dict__.get("_other_mode")
    return pm if pending is None else pending.resolve(pm)
