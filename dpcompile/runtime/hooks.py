"""A forward hook of a module the program was traced through, run at call time: a hook that
only records (``features[name] = output``, as feature extraction does) ran once while tracing,
on traced values; the program calls it at every call with the real ones."""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch import nn


@fx.node.has_side_effect
def run_forward_hook(module: nn.Module, hook_id: int, args: tuple, kwargs: dict | None, output: Any) -> None:
    """Call ``module``'s forward hook ``hook_id`` as ``module(*args)`` would have (its result is
    None: it records, it does not change the output). A hook removed since is not called (the
    program's guard then traces again)."""
    hook = module._forward_hooks.get(hook_id)
    if hook is None:
        return
    if kwargs is not None:
        hook(module, args, kwargs, output)
    else:
        hook(module, args, output)
