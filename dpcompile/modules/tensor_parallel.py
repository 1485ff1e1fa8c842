"""The trap of a tensor-parallel program: an optimizer over the model's own parameters, which the
program does not train (it owns its shards: its sharded state, :mod:`dpcompile.modules.sharded_state`).

A tensor-parallel program is a :class:`~dpcompile.modules.base.ParallelModule` built by
:class:`~dpcompile.recipes.tensor_parallel.TensorParallelRecipe`: ``pm.parameters()`` are its shards
(``fc1.weight_shard1`` on ``devices[1]``) and the replicated rest, ``pm.param_shards`` says which key
each makes, ``state_dict()`` has the original model's keys with full tensors and ``load_state_dict``
re-shards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from dpcompile.errors import DpCompileError

_SOURCE_PARAMETERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter of a transformed model -> its model's name
_hook_installed = False

OPTIMIZER_TRAP = (
    "this optimizer holds parameters of the {model} given to dpcompile.transform(..., tensor_parallel=...), "
    "and none of them has a gradient: the tensor-parallel program trains its own sharded copies, so this "
    "step would train nothing. Build the optimizer over the program's parameters: "
    "torch.optim.AdamW(pm.parameters())"
)


def watch_source_parameters(model: nn.Module) -> None:
    """Make the tensor-parallel trap loud: an optimizer step over ``model``'s own parameters
    (which ``pm`` does not use) raises :class:`~dpcompile.DpCompileError` pointing at
    ``pm.parameters()`` when none of its parameters has a gradient (the silent no-op it
    would be). The model is not changed; running it eagerly and stepping it still works.

    >>> import torch, dpcompile
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)   # the trap
    >>> pm(torch.randn(3, 4)).sum().backward()
    >>> opt.step()
    Traceback (most recent call last):
    ...
    dpcompile.errors.DpCompileError: this optimizer holds parameters of the Sequential given to ...
    """
    global _hook_installed
    for p in model.parameters():
        _SOURCE_PARAMETERS[p] = type(model).__name__
    if not _hook_installed:
        register_optimizer_step_pre_hook(_refuse_untrained_step)
        _hook_installed = True


def _refuse_untrained_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    watched = [p for p in params if p in _SOURCE_PARAMETERS]
    if watched and all(p.grad is None for p in params):
        raise DpCompileError(OPTIMIZER_TRAP.format(model=_SOURCE_PARAMETERS[watched[0]]))


__all__ = ["OPTIMIZER_TRAP", "watch_source_parameters"]
