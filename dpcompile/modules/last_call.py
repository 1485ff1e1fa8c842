"""The program of the last call, for the next call that departs from it in nothing.

A call of ``pm`` computes its :class:`~dpcompile.program_cache.CallKey` (device count, modes,
optional arguments, flags, the model guard's fingerprint) and looks its program up. Most calls
repeat the last one: one tensor of the same rank whose batch gives the same device count (or,
where nothing is split, as in tensor parallelism, the same number of arguments), and
a model whose watched dicts all kept their versions. :class:`LastCall` remembers that call's
program and answers such a call without building the key, so the guard is still checked on
every call (the dict versions and the lists and dicts watched by value), only more cheaply:

    last = LastCall.of(pm, key, program, args, kwargs)   # None: no shortcut for such calls
    if last is not None and last.serves(args, kwargs):    # the same key, proved cheaply
        program = last.program
"""

from __future__ import annotations

from typing import Any

import torch

from dpcompile.program_cache import CallKey, ModelGuard


class LastCall:
    """What the last call was keyed on, in the form a new call is checked against cheaply.

    ``position``/``dim``/``rank``: where its one split tensor sat (-1: none is split), the dim
    split and the tensor's number of dims; ``devices``: the device count the key holds, ``all_devices`` the
    program's; ``guard``/``versions``: the guard and the dict versions it read for the key.
    """

    __slots__ = ("program", "nargs", "position", "dim", "rank", "devices", "all_devices", "guard", "versions")

    def __init__(self, program: Any, nargs: int, position: int, dim: int, rank: int, devices: int,
                 all_devices: int, guard: ModelGuard, versions: tuple[int, ...]):  # fmt: skip
        self.program = program
        self.nargs = nargs
        self.position = position
        self.dim = dim
        self.rank = rank
        self.devices = devices
        self.all_devices = all_devices
        self.guard = guard
        self.versions = versions

    @classmethod
    def of(cls, pm: Any, key: CallKey, program: Any, args: tuple, kwargs: dict) -> LastCall | None:
        """The shortcut for calls like this one, or None where a call's key depends on more than
        one positional tensor's rank and batch (keyword or optional arguments, flags, inputs
        replicated in the examples, an exported program's dtype checks, several split inputs)."""
        guard = pm.__dict__.get("_guard")
        signature = pm.call_signature
        split = pm._split_inputs
        if (
            kwargs or guard is None or guard.versions_read() is None or len(split) > 1
            or pm.__dict__.get("_exported_check") is not None or pm.__dict__.get("_exported_inputs") is not None
            or "_other_mode" in pm.__dict__  # the first call in the other mode completes the program
            or signature.optional or signature.flags or signature.replicated
        ):  # fmt: skip
            return None
        versions = guard.versions_read()
        if not split:  # nothing split (tensor parallel: inputs replicated): every call runs on all devices
            return cls(program, len(args), -1, 0, 0, key.devices, len(pm.devices), guard, versions)
        position, _, dim = split[0]
        value = args[position] if position < len(args) else None
        if type(value) is not torch.Tensor or value.dim() <= dim:
            return None
        return cls(program, len(args), position, dim, value.dim(), key.devices, len(pm.devices), guard, versions)

    def serves(self, args: tuple, kwargs: dict) -> bool:
        """Whether this call has the last call's key: as many positional arguments and no keyword
        ones, its split tensor of the same rank and a batch giving the same device count, and the
        model unchanged since (every watched dict at its version, watched lists and dicts equal)."""
        if kwargs or len(args) != self.nargs:
            return False
        if self.position < 0:
            return self.guard.unchanged_since(self.versions)
        value = args[self.position]
        if type(value) is not torch.Tensor or value.dim() != self.rank:
            return False
        size = value.shape[self.dim]
        if size <= 0 or min(size, self.all_devices) != self.devices:
            return False
        return self.guard.unchanged_since(self.versions)
