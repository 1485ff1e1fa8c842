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


def runs_user_forward_hooks(module: nn.Module) -> bool:
    """Whether ``module``, or a module inside it that its call runs on the batch, has forward hooks or
    pre-hooks of its user's: those ``torch.distributed`` installs (FSDP2's ``fully_shard`` gathering a
    block's weights) are not, nor those of a parametrization (they see the weight, not the batch)."""
    from torch.nn.utils.parametrize import ParametrizationList

    todo, seen = [module], set()
    while todo:
        m = todo.pop()
        if id(m) in seen:  # a module reached twice (shared, or a cycle a loaded program may hold)
            continue
        seen.add(id(m))
        hooks = [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]
        if any(not str(getattr(h, "__module__", "") or "").startswith("torch.distributed") for h in hooks):
            return True
        todo.extend(c for c in m._modules.values() if c is not None and not isinstance(c, ParametrizationList))
    return False
