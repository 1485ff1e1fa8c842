"""Programs built from a model on ``meta``: their memory is allocated, their values are not.

``transform`` of a meta model gives each device uninitialised memory for what it holds and
marks the program as waiting for weights (:func:`await_weights`); calling it then raises
:class:`WeightsNotLoadedError` until ``dpcompile.load_checkpoint`` fills it
(:func:`weights_loaded`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dpcompile.errors import ArgumentError, DpCompileError, StateDictError

NEEDS_WEIGHTS = "_needs_weights"
WEIGHTS_SOURCE = "_weights_source"
UNSET_BUFFERS = "_unset_buffers"
#: the state keys of a program built on meta that no load has filled yet (absent: all of them)
UNSET_KEYS = "_unset_keys"


class WeightsNotLoadedError(DpCompileError):
    """A program built from a ``meta`` model was called before its weights were loaded."""


def await_weights(pm: nn.Module, source: nn.Module, unset_buffers: Sequence[str]) -> None:
    """Mark ``pm`` (built from the meta model ``source``) as holding garbage until loaded.

    ``unset_buffers``: the non-persistent buffers (rotary ``inv_freq``, ``position_ids``) that
    were on meta, so no checkpoint holds them; loading computes them from ``source``'s modules.
    """
    pm.__dict__[NEEDS_WEIGHTS] = True
    pm.__dict__[WEIGHTS_SOURCE] = source
    pm.__dict__[UNSET_BUFFERS] = list(unset_buffers)


def needs_weights(pm: nn.Module) -> bool:
    """True for a program built from a ``meta`` model until ``dpcompile.load_checkpoint`` fills it."""
    return bool(pm.__dict__.get(NEEDS_WEIGHTS, False))


def weights_loaded(pm: nn.Module) -> None:
    """Every value of ``pm`` is real now: calls may run."""
    pm.__dict__[NEEDS_WEIGHTS] = False
    pm.__dict__[UNSET_BUFFERS] = []
    pm.__dict__.pop(UNSET_KEYS, None)


def weights_partly_loaded(pm: nn.Module, unset: Sequence[str]) -> None:
    """A load (``strict=False``) filled all but ``unset``: ``pm`` still waits for them (a call would read
    uninitialised memory); a later load that fills them lets it run."""
    pm.__dict__[NEEDS_WEIGHTS] = True
    pm.__dict__[UNSET_KEYS] = list(unset)


def unset_keys(pm: nn.Module, keys: Sequence[str]) -> list[str]:
    """Of ``keys`` (the program's state keys), those no load has filled yet on a program built on meta."""
    if not needs_weights(pm):
        return []
    unset = pm.__dict__.get(UNSET_KEYS)
    return list(keys) if unset is None else [k for k in keys if k in set(unset)]


class LoadsWeights:
    """``pm.load_state_dict(sd)`` of every key fills a program built on meta as ``load_checkpoint``
    does: its non-persistent buffers are computed and ``pm.needs_weights`` turns False."""

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        refuse_before_copying(self, state_dict, strict, assign)  # type: ignore[arg-type]
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]
        state_dict_loaded(self, result.missing_keys)  # type: ignore[arg-type]
        return result


def no_values(key: str, value: torch.Tensor) -> str | None:
    """Why ``copy_`` cannot read ``value`` (a meta tensor has no data, a sparse one no strides), or
    None: torch raises it midway through a load, after copying the keys before it."""
    if value.is_meta:
        return f"{key} is a tensor on the meta device: it has no values to load (nothing was loaded)"
    if value.layout != torch.strided:
        return f"{key} is a {value.layout} tensor: load a dense one, value.to_dense() (nothing was loaded)"
    return None


def refuse_before_copying(pm: nn.Module, state_dict: Mapping[str, Any], strict: bool, assign: bool = False) -> None:
    """The errors ``nn.Module.load_state_dict`` raises (missing or unexpected keys where ``strict``, a
    tensor of another shape), raised before anything is copied: torch copies every key that fits
    first, so a failed load would leave the program half loaded. Skipped where a module has a
    load_state_dict pre-hook (it may rename the keys)."""
    source = getattr(pm, "traced_model", None) if getattr(pm, "_shares_source", False) else None  # its hooks run too
    if any(m._load_state_dict_pre_hooks for m in [*pm.modules(), *([source] if isinstance(source, nn.Module) else [])]):
        return  # a hook may rename or drop keys before torch reads them: its own checks stand
    if not isinstance(state_dict, Mapping):
        raise ArgumentError(f"load_state_dict expected a dict-like state_dict (the model's keys), got {type(state_dict).__name__}")
    own = nn.Module.state_dict(pm, keep_vars=True)  # what torch's load copies into (over a mesh: this rank's shards)
    problems = []
    if strict:
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if missing:
            problems.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
        if unexpected:
            problems.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
    for key, value in state_dict.items():
        mine = own.get(key)
        if isinstance(mine, torch.Tensor) and not isinstance(value, torch.Tensor):
            problems.append(f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like object '
                            f"from checkpoint but received {type(value)}")  # fmt: skip
        elif isinstance(value, torch.Tensor) and isinstance(mine, torch.Tensor) and value.shape != mine.shape:
            problems.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                            f"checkpoint, the shape in current model is {tuple(mine.shape)}.")  # fmt: skip
        elif isinstance(value, torch.Tensor) and isinstance(mine, torch.Tensor) and not assign and no_values(key, value):
            problems.append(no_values(key, value))
    if problems:
        raise StateDictError(f"Error(s) in loading state_dict for {type(pm).__name__} (nothing was loaded):\n\t"
                           + "\n\t".join(problems))  # fmt: skip


#: ``compute(source model, buffer names) -> {name: value}``, set by ``dpcompile.checkpoint``
#: (``compute_buffers``): the non-persistent buffers no state dict holds
BUFFER_COMPUTERS: list[Callable[[nn.Module, Sequence[str]], Mapping[str, torch.Tensor]]] = []


def state_dict_loaded(pm: nn.Module, missing: Sequence[str]) -> None:
    """After ``pm.load_state_dict``: where every state key was loaded (by this load or earlier ones), compute the
    non-persistent buffers still on meta (or raise naming them) and mark the weights loaded."""
    if not needs_weights(pm):
        return
    if still := unset_keys(pm, missing):  # strict=False: what this load and earlier ones left has no values yet
        weights_partly_loaded(pm, still)
        return
    pending = list(pm.__dict__.get(UNSET_BUFFERS, []))
    if pending and BUFFER_COMPUTERS:
        values = BUFFER_COMPUTERS[-1](pm.__dict__[WEIGHTS_SOURCE], pending)
        own = dict(pm.named_buffers())
        with torch.no_grad():
            for name, value in values.items():
                own[name].copy_(value)
    elif pending:
        return
    weights_loaded(pm)


def refuse_copy_without_weights(pm: nn.Module) -> None:
    """``torch.save(pm)`` / ``copy.deepcopy(pm)`` of a program still waiting for its weights: refused
    (the copy lost the flag, so its calls ran on uninitialised memory)."""
    if needs_weights(pm):
        raise WeightsNotLoadedError(
            "this program was built on the meta device and holds no weights yet: a pickle or copy of it would run "
            "on uninitialised memory. Load them first (dpcompile.load_checkpoint(pm, path)), then torch.save(pm)"
        )


def weights_not_loaded(pm: nn.Module) -> WeightsNotLoadedError:
    source = pm.__dict__.get(WEIGHTS_SOURCE)
    name = type(source).__name__ if source is not None else "model"
    unset = pm.__dict__.get(UNSET_KEYS)
    if unset:
        shown = ", ".join(repr(k) for k in unset[:8]) + (f" and {len(unset) - 8} more" if len(unset) > 8 else "")
        return WeightsNotLoadedError(
            f"this program was built from a {name} on the meta device, and the loads so far (strict=False) "
            f"did not hold {shown}: they have no values yet. Load them: "
            "dpcompile.load_checkpoint(pm, 'path/holding/them', strict=False)"
        )
    return WeightsNotLoadedError(
        f"this program was built from a {name} on the meta device: its {len(pm.devices)} device(s) hold "
        "memory for their parameters but no values yet. Load them first: "
        "dpcompile.load_checkpoint(pm, 'path/to/model.safetensors' or a checkpoint folder)"
    )


__all__ = [
    "BUFFER_COMPUTERS", "LoadsWeights", "WeightsNotLoadedError", "await_weights", "needs_weights", "no_values",
    "unset_keys", "weights_partly_loaded",
    "refuse_copy_without_weights", "state_dict_loaded",
    "weights_loaded", "weights_not_loaded",
]  # fmt: skip
