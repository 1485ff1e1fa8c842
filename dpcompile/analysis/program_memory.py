"""What a built program holds per device, by kind: one rule for ``explain`` and for memory plans.

:func:`held_parameter_bytes` reads the parameters each device of a program holds (a replica, or
its shards plus the replicated rest); :func:`program_memory` adds the gradients, the optimizer's
state and the activations of the kinds :mod:`dpcompile.analysis.memory` counts. ``explain`` reports
it for the program that was built; ``transform(..., memory_per_device=)`` computes it for the
program it would build (the tensor-parallel one built on fake tensors first, with its own plan,
leaf modules and dtypes), so the two cannot disagree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from dpcompile.analysis.memory import optimizer_bytes

__all__ = ["held_parameter_bytes", "program_memory"]


def fsdp_pieces(pm: nn.Module) -> dict[str, tuple[int, str]]:
    """``{piece name: (dp copy, the program's parameter name)}`` of a program FSDP sharded in one
    process (``dpcompile.modules.fsdp_one_process``); empty for any other."""
    return dict(pm.__dict__.get("fsdp_pieces") or {})


def held_parameter_bytes(
    pm: nn.Module, labels: Sequence[str], devices: Sequence[torch.device], copy: int | None = None
) -> dict[str, int]:
    """Parameter bytes each device of ``pm`` holds, keyed by ``labels`` (one per device).

    Data parallel: every replica holds a full copy. Tensor parallel: each shard's bytes on its
    slot (``pm.shard_param_slots``), replicated parameters on every device. FSDP in one process:
    each piece on its copy's device (over dp alone); ``copy``: count copy ``copy``'s pieces only,
    at copy 0's places (over dp copies of another program).
    """
    out = dict.fromkeys(labels, 0)
    named = list(pm.named_parameters())
    pieces = fsdp_pieces(pm)
    replicated = getattr(getattr(pm, "recipe", None), "replicates_model", False)  # data parallel (FSDP: in pieces)
    if pieces and replicated:  # FSDP over dp alone: piece r on device r
        for name, p in named:
            out[labels[pieces.get(name, (0, name))[0]]] += p.numel() * p.element_size()
        return out
    if copy is not None:  # FSDP over dp copies: what copy `copy` holds, at copy 0's places
        named = [(name, p) for name, p in named if pieces.get(name, (0, name))[0] == copy]
    if replicated:
        total = sum(p.numel() * p.element_size() for _, p in named)
        return dict.fromkeys(labels, total)
    slots = getattr(pm, "shard_param_slots", None)
    for name, p in named:
        size = p.numel() * p.element_size()
        if isinstance(slots, Mapping) and name in slots:
            slot = slots[name]
            targets = list(labels) if slot is None else [labels[slot]]
        else:
            matching = [label for label, d in zip(labels, devices) if d == p.device]
            targets = matching[:1] or list(labels[:1])
        for label in targets:
            out[label] += size
    return out


def program_memory(
    pm: nn.Module, held: Mapping[str, int], *, optimizer: str | None, training: bool, activations: int,
    share: float | Mapping[str, float],
) -> dict[str, dict[str, int]]:
    """Bytes per device by kind: the parameters each device holds (``held``), as large a share of
    the gradients and of ``optimizer``'s state (``training``), and ``activations * share`` (data
    parallel: the device's share of the batch; tensor parallel: 1, counted whole; a mapping gives each
    device its own share: sequence parallel)."""
    params = list(pm.parameters())
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    total = sum(p.numel() * p.element_size() for p in params) or 1
    state = optimizer_bytes(params, optimizer) if training else 0
    out = {}
    for device, bytes_held in held.items():
        fraction = bytes_held / total
        out[device] = {
            "parameters": bytes_held,
            "gradients": round(trainable * fraction) if training else 0,
            "optimizer": round(state * fraction),
            "activations": round(activations * (share.get(device, 1.0) if isinstance(share, Mapping) else share)),
        }
    return out
