"""The sharded state of a program that stores parameters as pieces (``pm.param_shards``): a
component any :class:`~dpcompile.modules.base.ParallelModule` holds where it owns pieces
(tensor-parallel shards, FSDP's pieces in one process, or both; a pipeline's stages too), not a
class: the module's own attributes (``state_keys``, ``param_shards``, ``state_aliases``,
``plan_reasons``, ``comm_cost``, ``shard_param_slots``) and the functions here, which
``ParallelModule`` calls where ``param_shards`` is set.

``state_dict()`` has the original model's keys (``pm.state_keys``), each a whole tensor put
together from its pieces; ``load_state_dict`` cuts the pieces out of whole tensors. A program that
owns its shards also warns where its gradients were not cleared since an optimizer step
(:func:`watch_program_gradients`).
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from dpcompile.errors import ArgumentError, StateDictError
from dpcompile.fx_utils import unalias
from dpcompile.modules.weights import no_values, state_dict_loaded
from dpcompile.runtime.tensor_parallel import ShardSpec, shard_of, unshard

#: what a pickled copy carries of the sharded state (``dpcompile.load`` reads the same from program.json)
PICKLED = ("state_keys", "param_shards", "plan_reasons", "comm_cost", "captured_code")


def hold_shards(pm: nn.Module, *, state_keys: Sequence[str], param_shards: Mapping[str, tuple[ShardSpec, list[str]]],
                plan_reasons: Mapping[str, str], comm_cost: Any, captured_code: str = "",
                state_aliases: Mapping[str, str] | None = None) -> None:  # fmt: skip
    """Record on ``pm`` what the recipe found: the state keys, the shards, the reasons, the cost, and
    the code of the trace the program was made from (a variant that traces to the same code is the
    main program); each parameter's slot (``pm.shard_param_slots``: shard ``k``, or None where
    replicated)."""
    pm.captured_code = captured_code
    pm.state_keys = list(state_keys)
    pm.state_aliases = dict(state_aliases or {})  # a tied key forward never reads -> a key of the same tensor
    # keys and shard names under the model's names (a pass saw `devices` as `user:devices`)
    pm.param_shards = {unalias(k): (spec, [unalias(n) for n in names]) for k, (spec, names) in param_shards.items()}
    pm.plan_reasons = dict(plan_reasons)
    pm.comm_cost = comm_cost
    slot_of = {name: k for _, names in pm.param_shards.values() for k, name in enumerate(names)}
    pm.shard_param_slots = {name: slot_of.get(name) for name, _ in pm.named_parameters()}
    watch_program_gradients(pm)


def param_bytes_per_slot(pm: nn.Module) -> dict[int, int]:
    """Bytes of parameters each shard slot holds: its shards plus the replicated rest."""
    n = len(pm.devices)
    out = dict.fromkeys(range(n), 0)
    for name, p in pm.named_parameters():
        size = p.numel() * p.element_size()
        slot = pm.shard_param_slots.get(name)
        for k in range(n) if slot is None else (slot,):
            out[k] += size
    return out


def whole_state_dict(pm: nn.Module, own: Mapping[str, Any], destination: Any, prefix: str, keep_vars: bool) -> Any:
    """The original model's keys, each holding the full (gathered) tensor, from ``own`` (the
    module's stored state: the pieces under their own names)."""
    if destination is None:
        destination = OrderedDict()
    aliases = pm.__dict__.get("state_aliases", {})
    for key in pm.state_keys:
        source = key if key in pm.param_shards or key in own else aliases.get(key, key)  # T5's `shared`, never called
        if source in pm.param_shards:
            spec, names = pm.param_shards[source]
            value = unshard([own[name] for name in names], spec, pm.devices.primary)
            destination[prefix + key] = value if keep_vars else value.detach()
        elif source in own:
            destination[prefix + key] = own[source]
    return destination


def load_pieces(pm: nn.Module, own: Mapping[str, Any], state_dict: Mapping[str, Any], strict: bool) -> Any:
    """Load full tensors under the original keys into ``own`` (the stored state, ``keep_vars``),
    cutting the shards out of them. Every key is checked (a tensor, each piece of the shape it
    replaces) before the first is copied: a refused load changes nothing."""
    if not isinstance(state_dict, Mapping):
        raise ArgumentError(f"load_state_dict expected a dict-like state_dict (the model's keys), got {type(state_dict).__name__}")
    keys = set(pm.state_keys)
    missing = [k for k in pm.state_keys if k not in state_dict]
    unexpected = [k for k in state_dict if k not in keys]
    if strict and (missing or unexpected):
        raise StateDictError(
            f"Error(s) in loading state_dict for {type(pm).__name__} (nothing was loaded): missing keys "
            f"{missing}, unexpected keys {unexpected}"
        )
    copies = []  # (destination, value), all checked first
    for key in pm.state_keys:
        if key not in state_dict:
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            raise StateDictError(f"{key} is a {type(value).__name__}, not a tensor (nothing was loaded)")
        if no_values(key, value):
            raise StateDictError(no_values(key, value))
        if key in pm.param_shards:
            spec, names = pm.param_shards[key]
            expected = sum(spec.sizes)
            fits = value.dim() > spec.dim and value.size(spec.dim) == expected
            pieces = [shard_of(value, spec, k) for k in range(len(names))] if fits else []
            if not fits or any(piece.shape != own[name].shape for piece, name in zip(pieces, names)):
                raise StateDictError(
                    f"size mismatch for {key}: got {tuple(value.shape)}, the sharded parameter has "
                    f"{expected} along dim {spec.dim} (shards {list(spec.sizes)}) (nothing was loaded)"
                )
            copies += [(own[name], piece) for name, piece in zip(names, pieces)]
        elif key in own:
            if own[key].shape != value.shape:
                raise StateDictError(
                    f"size mismatch for {key}: got {tuple(value.shape)}, expected {tuple(own[key].shape)} "
                    "(nothing was loaded)"
                )
            copies.append((own[key], value))
    with torch.no_grad():
        for destination, value in copies:
            destination.copy_(value)
    state_dict_loaded(pm, missing)  # a program built on meta holds its weights now
    return _IncompatibleKeys(missing, unexpected)


def cut_pieces(pm: nn.Module, state_dict: Any, prefix: str, error_msgs: list) -> None:
    """``parent.load_state_dict(...)`` of a module holding ``pm``: cut each full tensor under its
    original key into the shard keys the submodules load, before they load."""
    for key, (spec, names) in pm.param_shards.items():
        value = state_dict.get(prefix + key)
        if not isinstance(value, torch.Tensor):
            continue
        del state_dict[prefix + key]
        if value.dim() <= spec.dim or value.size(spec.dim) != sum(spec.sizes):
            error_msgs.append(
                f"size mismatch for {prefix + key}: got {tuple(value.shape)}, the sharded parameter has "
                f"{sum(spec.sizes)} along dim {spec.dim} (shards {list(spec.sizes)})"
            )
            continue
        for k, name in enumerate(names):
            state_dict[prefix + name] = shard_of(value, spec, k)


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
        warnings.warn(GRADIENTS_NOT_CLEARED, stacklevel=4)  # the caller of pm(...): pm.__call__, then its executor


__all__ = [
    "PICKLED", "cut_pieces", "hold_shards", "load_pieces", "param_bytes_per_slot", "warn_if_gradients_not_cleared",
    "watch_program_gradients", "whole_state_dict",
]
