"""What the inspection tools read off a program's nodes and a module's devices."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.fx as fx
from torch import nn

from dpcompile.capture.errors import user_source
from dpcompile.devices import Devices
from passes.name_dp_copies import COPY

__all__ = ["copy_labels", "device_labels", "device_list", "label_slots", "slot_of", "target_name", "user_source"]

_SLOT = re.compile(r"_(?:dev|shard|rank)(\d+)$")


def device_labels(pm: nn.Module) -> list[str]:
    """``pm``'s device labels (``Devices.labels()``: ``"cuda:0"``, or ``"cpu#1"`` for virtual devices)."""
    devices = getattr(pm, "devices", None)
    if devices is None:
        return ["cpu"]
    if hasattr(devices, "labels"):
        return list(devices.labels())
    try:
        return [str(d) for d in devices]
    except TypeError:
        return [str(devices)]


def copy_labels(pm: nn.Module) -> tuple[list[list[str]], list[str]] | None:
    """Each dp copy's device labels, and every label in canonical order (pp, dp, cp, tp: ``cpu#2`` is
    stage 0 of copy 1 with ``{"pp": 2, "dp": 2}``), where ``dp`` composes over a pipeline, a
    tensor-parallel or a context-parallel program (``recipe.dp_devices``); None for other programs."""
    copies = getattr(getattr(pm, "recipe", None), "dp_devices", None)
    if not copies:
        return None
    layout = getattr(pm, "layout", None) or {}
    # {"dp", "cp"}: each copy spans cp; {"cp", "tp"} (and dp over it): the copies are cp's pieces
    inside_copy = layout.get("cp", 1) if layout.get("dp", 1) > 1 and layout.get("tp", 1) == 1 else 1
    d, shards = len(copies), layout.get("tp", 1) * inside_copy  # inside each copy, innermost
    stages = len(copies[0]) // shards
    place = {(r, s * shards + t): s * d * shards + r * shards + t for r in range(d) for s in range(stages) for t in range(shards)}
    canonical = [""] * len(place)
    for (r, k), i in place.items():
        canonical[i] = copies[r][k]
    labels = Devices(tuple(torch.device(x) for x in canonical)).labels()
    return [[labels[place[(r, k)]] for k in range(len(copies[r]))] for r in range(d)], labels


def device_list(pm: nn.Module) -> list[torch.device]:
    """``pm``'s devices as ``torch.device`` (one CPU device for meshes and unknown layouts)."""
    devices = getattr(pm, "devices", None)
    try:
        return [torch.device(d) for d in devices]  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - meshes and unknown layouts
        return [torch.device("cpu")]


def slot_of(node: fx.Node) -> int | None:
    """The device slot of a per-device node (``fc1_dev1`` → 1), else None."""
    slot = node.meta.get("dpcompile_slot")
    if isinstance(slot, int):
        return slot
    m = _SLOT.search(node.name)
    return int(m.group(1)) if m else None


def label_slots(pm: nn.Module) -> tuple[list[str], Callable[[fx.Node], int]]:
    """Every device label of ``pm`` and, for a node, the index of the label it runs on: its slot, and
    where dp copies compose over a pipeline or tensor-parallel program, its copy's device of that
    slot (``_dp1_dev0`` of ``{"dp": 2, "tp": 2}`` runs on ``cpu#2``). A node of no one device: 0."""
    own = device_labels(pm)
    found = copy_labels(pm)
    labels = found[1] if found is not None else own
    index = {label: i for i, label in enumerate(labels)}

    def slot_index(node: fx.Node) -> int:
        slot = slot_of(node)
        if slot is None or slot >= len(own):
            return 0
        copy = node.meta.get(COPY) or 0
        if found is None or not 0 <= copy < len(found[0]) or slot >= len(found[0][copy]):
            return slot
        return index[found[0][copy][slot]]

    return labels, slot_index


def target_name(node: fx.Node) -> str:
    """A short name for what ``node`` calls: ``runtime.scatter``, ``torch.relu``, ``F.linear``, ``fc1``."""
    target = node.target
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None) or repr(target)
    if module.startswith("dpcompile.runtime"):
        return f"runtime.{name}"
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    if module.startswith("torch") or module == "":
        return f"torch.{name}" if not module.startswith("torch.nn.functional") else f"F.{name}"
    return f"{module}.{name}"
