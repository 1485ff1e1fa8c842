"""Which modules ``activation_checkpointing=`` recomputes: the user's list checked against the
model, or (``True``) every repeated block.

>>> import torch.nn as nn
>>> model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]))
>>> repeated_blocks(model)
('1.0', '1.1', '1.2')
"""

from __future__ import annotations

import difflib
from typing import Any

from torch import nn

from dpcompile.errors import DpCompileError


def repeated_blocks(model: nn.Module) -> tuple[str, ...]:
    """The items of the model's largest ``ModuleList`` / ``Sequential`` of blocks of one type
    (the most items; ties: the most parameters); empty where there is none."""
    best: tuple[int, int, str, list[str]] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        kinds = {type(child) for child in module}
        if len(kinds) != 1 or not any(True for _ in next(iter(module)).parameters()):
            continue
        size = sum(p.numel() for p in module.parameters())
        names = [f"{path}.{name}" if path else name for name, _ in module.named_children()]
        if best is None or (len(names), size) > best[:2]:
            best = (len(names), size, path, names)
    return tuple(best[3]) if best else ()


def checkpoint_paths(model: nn.Module, activation_checkpointing: Any) -> tuple[str, ...]:
    """The module paths to recompute in backward for ``activation_checkpointing=`` (False: none).

    An unknown path is a ``ValueError`` naming the nearest ones; ``True`` on a model without
    repeated blocks is a ``DpCompileError`` saying to name the modules.
    """
    if activation_checkpointing is None or activation_checkpointing is False:
        return ()
    if activation_checkpointing == "auto":
        raise DpCompileError(
            'activation_checkpointing="auto" (the planner choosing what to recompute under memory_per_device=) is '
            "not built yet: pass True (every repeated block) or the module paths to recompute"
        )
    if activation_checkpointing is True:
        blocks = repeated_blocks(model)
        if not blocks:
            raise DpCompileError(
                "activation_checkpointing=True recomputes the items of the model's repeated blocks (a ModuleList or "
                f"Sequential of one block type), and {type(model).__name__} has none: name the modules to recompute, "
                "e.g. activation_checkpointing=['encoder', 'decoder']"
            )
        return blocks
    known = {path for path, _ in model.named_modules() if path}
    paths = tuple(dict.fromkeys(activation_checkpointing))
    for path in paths:
        if path not in known:
            near = difflib.get_close_matches(str(path), sorted(known), n=3) or sorted(known)[:3]
            raise ValueError(
                f"activation_checkpointing names {path!r}, which is not a module of {type(model).__name__}; nearest: "
                f"{near} (paths as model.named_modules() spells them)"
            )
    return paths


__all__ = ["checkpoint_paths", "repeated_blocks"]
