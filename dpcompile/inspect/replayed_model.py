"""The model a program read back with ``dpcompile.load`` was made from, as the planner profiles it: the
program's module tree (the model's, with its whole parameters) running the single-device graph the
folder keeps (``captured``), each unit's nodes inside a call of the unit's module.

The planner cuts a model into units (its repeated blocks and what surrounds them,
:func:`dpcompile.analysis.model_profile.profile_model`) by their modules' calls. The captured graph calls
the leaf modules (``layers.0.up``), never the block (``layers.0``); so the graph is split where the unit
of its nodes changes, and each piece runs as a call of its unit's module.

Before::  profiled_model(loaded) is None          # explain of a loaded program: the program count
After::   profiled_model(loaded) -> ReplayedModel  # inp, layers (its blocks), head: the loaded modules
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch import nn
from torch.fx.passes.split_module import split_module

from dpcompile.analysis.checkpoint_regions import repeated_blocks
from dpcompile.analysis.model_profile import unit_paths

__all__ = ["replayed_model"]


class ReplayedModel(nn.Module):
    """The loaded program's modules, running ``graph`` one unit's call at a time."""

    def __init__(self, tree: nn.Module, graph: fx.Graph) -> None:
        super().__init__()
        for name, child in tree.named_children():
            self.add_module(name, child)
        units = unit_paths(self, repeated_blocks(self))
        pieces: dict[int, str | None] = {}
        unit_of: dict[fx.Node, int] = {}
        current: str | None = None
        for node in graph.nodes:
            if node.op in ("call_module", "get_attr"):
                current = next((u for u in units if node.target == u or str(node.target).startswith(f"{u}.")), current)
            if node.op not in ("placeholder", "output"):
                if not pieces or pieces[len(pieces) - 1] != current:
                    pieces[len(pieces)] = current
                unit_of[node] = len(pieces) - 1
        holder = fx.GraphModule(self, graph)
        split = split_module(holder, self, lambda node: unit_of[node], keep_original_order=True)
        modules = dict(self.named_modules())
        called = {node.target for node in graph.nodes if node.op == "call_module"}
        for name, piece in split.named_children():
            unit = pieces.get(int(name.removeprefix("submod_")))
            if unit is not None and unit not in called:  # the piece runs as a call of its unit's module (its hooks)
                split.add_module(name, _Call(modules[unit], piece))
        self.__dict__["split"] = split  # not a submodule: its parameters are this tree's

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["split"](*args, **kwargs)


class _Call(nn.Module):
    def __init__(self, unit: nn.Module, piece: nn.Module) -> None:
        super().__init__()
        self.__dict__["unit"], self.__dict__["piece"] = unit, piece

    def forward(self, *args: Any) -> Any:
        unit, piece = self.__dict__["unit"], self.__dict__["piece"]
        unit.__dict__["forward"] = piece.forward
        try:
            return unit(*args)
        finally:
            del unit.__dict__["forward"]


def replayed_model(pm: nn.Module) -> nn.Module | None:
    """The model ``pm`` (a loaded program) was made from, as the planner profiles it; None where the
    folder keeps no single-device graph of whole modules (tensor-parallel shards) or it cannot be split."""
    captured = pm.__dict__.get("captured")
    if not isinstance(captured, fx.GraphModule):
        return None
    try:
        return ReplayedModel(pm, captured.graph)
    except Exception:  # noqa: BLE001 - then no prediction: the program count
        return None
