"""``TensorParallelModule``: a program whose parameters are shards, with the model's state dict.

Built by :class:`~dpcompile.recipes.tensor_parallel.TensorParallelRecipe`. It owns its shards
(``fc1.weight_shard1`` on ``devices[1]``); ``state_dict()`` has the original model's keys with
full tensors and ``load_state_dict`` re-shards. Calls that depart from the first one (the
other mode, an optional argument left None) run programs from the recipe, as every
``ParallelModule`` does.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from dpcompile.analysis.cost import CommCost
from dpcompile.errors import DpCompileError
from dpcompile.fx_utils import reserve_names, unalias
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.sharded_state import ShardedState
from dpcompile.runtime.tensor_parallel import ShardSpec

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


_PROGRAM_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()  # first trainable parameter of a program -> the program
_post_hook_installed = False

GRADIENTS_NOT_CLEARED = (
    "dpcompile: the gradients of this tensor-parallel program were not cleared since the last optimizer step, "
    "so this step adds to them. model.zero_grad() clears the original model's gradients, not the program's "
    "(pm trains its own sharded parameters): call optimizer.zero_grad() or pm.zero_grad() each step"
)


def watch_program_gradients(pm: nn.Module) -> None:
    """Make the other half of the trap loud: after an optimizer step over ``pm``'s parameters, a
    call of ``pm`` with gradients on that finds the gradients of that step still there
    (``model.zero_grad()`` called instead of ``pm.zero_grad()``, so they pile up) warns once,
    naming the fix. It reads one parameter's gradient per step."""
    global _post_hook_installed
    first = next((p for p in pm.parameters() if p.requires_grad), None)
    if first is None:
        return
    _PROGRAM_OF[first] = weakref.ref(pm)
    if not _post_hook_installed:
        register_optimizer_step_post_hook(_remember_stepped_gradients)
        _post_hook_installed = True


def _remember_stepped_gradients(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = _PROGRAM_OF.get(p)
            pm = ref() if ref is not None else None
            if pm is not None and p.grad is not None and not pm.__dict__.get("_warned_gradients"):
                pm.__dict__["_stepped_gradient"] = (p, p.grad)


def warn_if_gradients_not_cleared(pm: nn.Module) -> None:
    """The check :func:`watch_program_gradients` installs, at the head of a call."""
    stepped = pm.__dict__.pop("_stepped_gradient", None)
    if stepped is None:
        return
    p, grad = stepped
    if p.grad is grad and bool(grad.detach().ne(0).any()):
        pm.__dict__["_warned_gradients"] = True
        warnings.warn(GRADIENTS_NOT_CLEARED, stacklevel=3)


def _refuse_untrained_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    watched = [p for p in params if p in _SOURCE_PARAMETERS]
    if watched and all(p.grad is None for p in params):
        raise DpCompileError(OPTIMIZER_TRAP.format(model=_SOURCE_PARAMETERS[watched[0]]))


class TensorParallelModule(ShardedState, ParallelModule):
    """A tensor-parallel program. Build it with ``dpcompile.transform(..., tensor_parallel=...)``.

    * ``pm.plan``: ``{module path: "column" | "row" | "replicate"}`` as applied;
      ``pm.plan_reasons``: ``{module path: why}``.
    * ``pm.parameters()``: the shards (``fc1.weight_shard1`` on ``devices[1]``) and the
      replicated rest (on ``devices[0]``).
    * ``pm.param_shards``: ``{"fc1.weight": (ShardSpec(0, (5, 5)), ["fc1.weight_shard0", ...])}``.
    * ``pm.shard_param_slots``: ``{parameter name in pm: shard slot k, or None}``; None means
      replicated, i.e. held by every shard in SPMD form (here, once on ``devices[0]``). It is
      how ``explain`` attributes bytes to virtual devices that are all ``'cpu'``.
    * ``pm.comm_cost``: the plan's :class:`~dpcompile.analysis.cost.CommCost` per device.
    * ``state_dict()`` has the original model's keys with full tensors; ``load_state_dict``
      re-shards.
    """

    plan_reasons: dict[str, str]
    param_shards: dict[str, tuple[ShardSpec, list[str]]]
    shard_param_slots: dict[str, int | None]

    def init_tensor_parallel(
        self,
        *,
        state_keys: Sequence[str],
        param_shards: Mapping[str, tuple[ShardSpec, list[str]]],
        plan_reasons: Mapping[str, str],
        comm_cost: CommCost | None,
        captured_code: str = "",
        state_aliases: Mapping[str, str] | None = None,
    ) -> None:
        """Record what the recipe found: the state keys, the shards, the reasons, the cost, and
        the code of the trace the program was made from (a variant that traces to the same
        code is the main program)."""
        self.captured_code = captured_code
        self.state_keys = list(state_keys)
        self.state_aliases = dict(state_aliases or {})  # a tied key forward never reads -> a key of the same tensor
        # keys and shard names under the model's names (a pass saw `devices` as `user:devices`)
        self.param_shards = {unalias(k): (spec, [unalias(n) for n in names]) for k, (spec, names) in param_shards.items()}
        self.plan_reasons = dict(plan_reasons)
        self.comm_cost = comm_cost
        slot_of = {name: k for _, names in self.param_shards.values() for k, name in enumerate(names)}
        self.shard_param_slots = {name: slot_of.get(name) for name, _ in self.named_parameters()}
        watch_program_gradients(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if "_stepped_gradient" in self.__dict__ and torch.is_grad_enabled():  # not an evaluation under no_grad
            warn_if_gradients_not_cleared(self)
        return super().__call__(*args, **kwargs)

    def param_bytes_per_slot(self) -> dict[int, int]:
        """Bytes of parameters each shard slot holds: its shards plus the replicated rest."""
        n = len(self.devices)
        out = dict.fromkeys(range(n), 0)
        for name, p in self.named_parameters():
            size = p.numel() * p.element_size()
            slot = self.shard_param_slots.get(name)
            for k in range(n) if slot is None else (slot,):
                out[k] += size
        return out

    # ------------------------------------------------------------------ pickling
    def _extra_state_for_pickle(self) -> dict[str, Any]:
        return {
            "state_keys": self.state_keys,
            "param_shards": self.param_shards,
            "plan_reasons": self.plan_reasons,
            "comm_cost": self.comm_cost,
            "captured_code": self.captured_code,
        }

    def _restore_extra_state(self, extra: dict[str, Any]) -> None:
        self.init_tensor_parallel(
            state_keys=extra["state_keys"],
            param_shards=extra["param_shards"],
            plan_reasons=extra["plan_reasons"],
            comm_cost=extra["comm_cost"],
            captured_code=extra["captured_code"],
        )


reserve_names(dir(TensorParallelModule))
