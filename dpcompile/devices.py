"""Parse and validate device lists.

``["cuda:0", "cuda:1"]``, ``[0, 1]``, ``[torch.device("cuda", 0)]``, an int ``n`` (the first
``n`` CUDA devices, or ``n`` virtual CPU devices without CUDA) and repeated entries
(``["cpu"] * 4``: virtual devices, one replica or shard each, sharing one physical device).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from dpcompile.errors import ArgumentError

ACCEPTED = (
    "a list of device specs such as ['cuda:0', 'cuda:1'], [0, 1], "
    "[torch.device('cuda', 0), ...] or ['cpu', 'cpu'] (repeated entries are virtual devices), "
    "a positive int n, or a torch.distributed DeviceMesh"
)


@dataclass(frozen=True)
class Devices:
    """An ordered list of (possibly repeated) devices; index ``k`` is replica or shard ``k``."""

    devices: tuple[torch.device, ...]

    def __len__(self) -> int:
        return len(self.devices)

    def __iter__(self):
        return iter(self.devices)

    def __getitem__(self, k: int) -> torch.device:
        return self.devices[k]

    @property
    def primary(self) -> torch.device:
        return self.devices[0]

    def strings(self) -> list[str]:
        """``['cpu', 'cpu']``: the form generated code spells devices in."""
        return [str(d) for d in self.devices]

    def labels(self) -> list[str]:
        """Unique per-slot labels, ``['cpu#0', 'cpu#1']`` for virtual devices."""
        if len(set(self.devices)) == len(self.devices):
            return self.strings()
        return [f"{d}#{k}" for k, d in enumerate(self.devices)]

    def shares_memory_with_primary(self, k: int) -> bool:
        """True when slot ``k`` is the primary's physical device (a virtual device)."""
        return self.devices[k] == self.devices[0]

    def prefix(self, n: int) -> Devices:
        return Devices(self.devices[:n])


def _parse_one(spec: object) -> torch.device:
    if isinstance(spec, torch.device):
        device = spec
    elif isinstance(spec, bool):
        raise ArgumentError(f"device spec {spec!r} is a bool; expected {ACCEPTED}")
    elif isinstance(spec, int):
        if spec < 0:
            raise ArgumentError(f"device index {spec} is negative; expected {ACCEPTED}")
        device = torch.device("cuda", spec)
    elif isinstance(spec, str):
        try:
            device = torch.device(spec)
        except RuntimeError as e:
            raise ArgumentError(f"cannot parse device spec {spec!r} ({e}); expected {ACCEPTED}") from None
    else:
        raise ArgumentError(f"cannot parse device spec {spec!r} of type {type(spec).__name__}; expected {ACCEPTED}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


def _check_available(device: torch.device) -> None:
    if device.type == "meta":
        raise ArgumentError(
            f"device {device} holds shapes, not data: the program would run on nothing (and data parallelism "
            "would move the model's weights there); build the model on meta if you like, and pass the devices it "
            "runs on, such as ['cpu', 'cpu'] (virtual devices) or ['cuda:0', 'cuda:1']"
        )
    if device.type not in ("cpu", "cuda"):
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError):
            raise ArgumentError(
                f"device {device} cannot be used here (torch cannot allocate a tensor on it on this machine); pass "
                "devices this machine has, such as "
                "['cpu', 'cpu'] (virtual devices)"
            ) from None
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if device.index >= count:
            usable = f"use indices 0..{count - 1}, or" if count else "use"
            raise ArgumentError(
                f"device {device} is beyond the {count} CUDA device(s) visible here "
                f"(torch.cuda.device_count() == {count}); {usable} "
                "repeated 'cpu' entries for virtual devices"
            )


def parse_devices(spec: object, *, check_available: bool = True) -> Devices:
    """Turn what a user passes as ``devices`` into a validated :class:`Devices`.

    >>> parse_devices(["cpu"] * 2).strings()
    ['cpu', 'cpu']
    """
    if isinstance(spec, Devices):
        return spec
    if isinstance(spec, bool):
        raise ArgumentError(f"devices={spec!r} is a bool; expected {ACCEPTED}")
    if isinstance(spec, int):
        if spec <= 0:
            raise ArgumentError(f"devices={spec} must be a positive number of devices; expected {ACCEPTED}")
        if torch.cuda.is_available():
            return parse_devices(list(range(spec)), check_available=check_available)
        return Devices(tuple(torch.device("cpu") for _ in range(spec)))
    if isinstance(spec, (str, torch.device)):
        device = _parse_one(spec)  # an unparsable spec says so first
        raise ArgumentError(f"devices={spec!r} is a single device; pass a list such as [{str(device)!r}]")
    if isinstance(spec, Mapping):
        raise ArgumentError(
            f"devices={spec!r} is a mapping; pass a list of devices, and name its dimensions with mesh= "
            "(transform(model, ['cpu'] * 4, mesh={'dp': 2, 'tp': 2}))"
        )
    if not isinstance(spec, Iterable):
        raise ArgumentError(f"devices={spec!r} of type {type(spec).__name__}; expected {ACCEPTED}")
    parsed = tuple(_parse_one(s) for s in spec)
    if not parsed:
        raise ArgumentError(f"devices is empty; expected {ACCEPTED}")
    if check_available:
        for d in parsed:
            _check_available(d)
    return Devices(parsed)


def parse_device(spec: object) -> torch.device:
    """One device spec, e.g. ``output_device=``."""
    device = _parse_one(spec)
    _check_available(device)
    return device

