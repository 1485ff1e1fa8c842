"""The other mode of an exported program: ``torch.export`` bakes ``model.training`` in, so where forward
reads it (beyond the modules the program calls) the model is exported in its other mode too and the two
programs merged (:mod:`~dpcompile.capture.modes`): at once, or at the first need (:class:`OtherModeExport`,
``export_program(lazy_other_mode=True)``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.capture.modes import (
    READS_MODE_ELSEWHERE,
    add_mode_check,
    bakes_mode,
    forward_reads_training,
    merge_modes,
)

OTHER_MODE_PENDING = "dpcompile_other_mode_pending"  # gm.meta key: exported in the model's mode only (an OtherModeExport)


def serve_both_modes(gm: fx.GraphModule, other: fx.GraphModule | None, model: nn.Module, training: bool,
                     same: bool = False) -> None:  # fmt: skip
    """``gm`` (exported with the root in ``training`` mode) made to serve both modes from ``other``, its
    program in the other mode (None: that export failed): where they differ in constants only, each is
    read by mode at run time (:func:`merge_modes`), else the mode is checked. ``same``: forward reads
    no mode beyond its modules', nothing to do."""
    if not same and (other is None or not merge_modes(gm, other, model, training=training)):
        add_mode_check(gm, model, training=training)


class OtherModeExport:
    """The other mode of a program exported in one (``export_program(lazy_other_mode=True)``), exported at
    its first need, once, and merged into the capture or any copy of it (:meth:`complete`): what
    ``export_program`` would have done at once. A copy of the capture (``copy.deepcopy``) shares it, never
    copying the model it exports again::

        pending = gm.meta[OTHER_MODE_PENDING]
        pending.complete(copy_of_gm)   # exports the model in the other mode (the first time), merges it in
    """

    def __init__(self, model: nn.Module, export_other: Callable[[nn.Module, fx.GraphModule], fx.GraphModule | None]):
        """``export_other(model, gm)``: ``gm``'s program in the other mode, exported from ``model`` in the mode
        ``gm`` was exported in (``gm`` itself where that export failed)."""
        self.model, self.export_other = model, export_other
        self.modes = {m: m.training for m in model.modules()}  # as exported
        self.training = model.training
        self._other: fx.GraphModule | None = None
        self._exported = False

    def export_on_a_stand_in(self) -> None:
        """Export the other mode from a stand-in of the model as it is now (its structure and buffers; each
        parameter on meta, given uninitialised memory for the export only), not from the model itself, which
        changes after transform (FSDP's pieces in a private copy); the model is not held any longer."""
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                for p in self.model.parameters()}  # fmt: skip
        modes = {path: self.modes[m] for path, m in self.model.named_modules()}
        self.model = copy.deepcopy(self.model, memo)
        self.modes = {m: modes[path] for path, m in self.model.named_modules()}
        self._stand_in_device: torch.device | None = device

    def _exported_model(self) -> tuple[nn.Module, dict[nn.Module, bool]]:
        """The model to export and the modes of its modules at transform: the model, or a stand-in given memory."""
        device = self.__dict__.get("_stand_in_device")
        if device is None:
            return self.model, self.modes
        model = copy.deepcopy(self.model)
        for m in model.modules():
            for name, p in list(m._parameters.items()):
                if p is not None:
                    m._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
        paths = {m: path for path, m in self.model.named_modules()}
        by_path = {paths[m]: training for m, training in self.modes.items()}
        return model, {m: by_path[path] for path, m in model.named_modules()}

    def __deepcopy__(self, memo: dict[int, Any]) -> OtherModeExport:
        return self

    def __reduce__(self) -> Any:  # a pickled capture keeps no reference to the model: it serves its mode only
        return (_no_pending, ())

    def other_program(self, gm: fx.GraphModule) -> fx.GraphModule | None:
        """The program of the other mode (exported with every module's mode as at transform, then the
        model's modes put back as they are now); None where it cannot be exported."""
        if not self._exported:
            model, modes = self._exported_model()
            now = {m: m.training for m in model.modules()}
            try:
                for m, training in modes.items():
                    m.training = training
                other = self.export_other(model, gm)
            finally:
                for m, training in now.items():
                    m.training = training
            self._other, self._exported = (None if other is gm else other), True
        return self._other

    def complete(self, gm: fx.GraphModule) -> None:
        """Make ``gm`` (the capture, or a copy of its graph over any modules of the same paths) serve both
        modes, as an eager export of both would have made it."""
        serve_both_modes(gm, self.other_program(gm), self.model, self.training)
        gm.meta.pop(OTHER_MODE_PENDING, None)
        gm.recompile()


def _no_pending() -> None:
    return None


def reads_mode(model: nn.Module, gm: fx.GraphModule) -> bool:
    """Whether the program may differ in the other mode (forward reads ``self.training`` beyond the
    modules the program calls, or an op baked the mode in)."""
    return (
        gm.meta.get(READS_MODE_ELSEWHERE, False) or any(bakes_mode(n) for n in gm.graph.nodes)
        or any(forward_reads_training(type(m)) for m in model.modules())
    )
