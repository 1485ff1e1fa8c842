"""The guard of a program captured with ``torch.export`` (``frontend="export"``).

Such a program has no forward to trace again: export ran the model's Python once and baked in
what it read — hooks of the modules it traced through, attributes, submodules, the dtype of
each parameter (``torch.finfo(w.dtype).bits``), the shape of each argument but the dims it kept
dynamic. A change to any of them is refused at the next call with a ``DpCompileError`` naming
it and the way out (``dpcompile.transform`` again), never run on the old program:

    check = ExportedModelCheck(exported_from)   # at transform
    check.check(args, kwargs)                   # at each call
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from dpcompile.capture.inputs import ExportedFrom, check_inputs
from dpcompile.capture.state import installed_by_forward
from dpcompile.errors import DpCompileError
from dpcompile.program_cache import ModelGuard, describe_changes

_ROOT_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


class ModelChanged(DpCompileError):
    """The model behind a program that cannot be traced again changed since transform."""


class ExportedModelCheck:
    """Watches the model a ``torch.export``-captured program was made from, at every depth: the
    modules export traced through (all but those the program calls, whose hooks and modes apply
    at run time) as :class:`~dpcompile.program_cache.ModelGuard` watches an fx program's, and the
    dtype and device of one tensor of each module (``model.double()`` keeps the Parameters)."""

    def __init__(self, exported: ExportedFrom | nn.Module, is_leaf: Any = None):
        if not isinstance(exported, ExportedFrom):  # a model without the record (older programs)
            exported = ExportedFrom(exported)
        called = exported.called
        self.inputs = exported.inputs
        self.guard = ModelGuard(exported.model, lambda module, path: path in called)
        self.token = self._token()
        self.description = self.guard.description
        self.tensors = self._one_tensor_per_module()
        self.kinds = self._kinds()
        self.program: Any = None  # weakref to the program, where it holds tensors of its own (tensor parallel)
        self.own: list[tuple[str, torch.Tensor]] = []
        self.own_kinds: tuple = ()

    def watch_program(self, program: nn.Module) -> None:
        """Also one tensor of each module of ``program`` the model does not hold: a tensor-parallel program's
        shards, which ``pm.float()`` converts, not the model's (the program baked in the dtype)."""
        self.program = weakref.ref(program)
        self._read_own()

    def _read_own(self) -> None:
        program = self.program() if self.program is not None else None
        held = {id(t) for m in self.guard.model.modules() for t in (*m._parameters.values(), *m._buffers.values())}
        self.own = []
        for path, module in program.named_modules() if program is not None else ():
            for name, tensor in (*module._parameters.items(), *module._buffers.items()):
                if tensor is not None and id(tensor) not in held:
                    self.own.append((f"{path}.{name}" if path else name, tensor))
                    break
        self.own_kinds = tuple((t.dtype, t.device) for _, t in self.own)

    def read_again(self) -> None:
        """Take the model as it is now for what the program baked in: a change dpcompile made itself
        (FSDP in one process swaps the parameters it splits for their pieces). Read afresh: such a change
        swaps module classes (a parametrized Linear), which no watched dict's version shows."""
        self.guard.read_afresh()
        self.token = self._token()
        self.description = self.guard.description
        self.tensors = self._one_tensor_per_module()
        self.kinds = self._kinds()
        if self.program is not None:
            self._read_own()

    def _token(self) -> tuple:
        model = self.guard.model
        root_hooks = tuple(id(h) for name in _ROOT_HOOKS for h in getattr(model, name).values() if not installed_by_forward(h))
        return self.guard.fingerprint(), root_hooks

    def _one_tensor_per_module(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for path, module in self.guard.watched_modules():
            for name, tensor in (*module._parameters.items(), *module._buffers.items()):
                if tensor is not None:
                    out.append((f"{path}.{name}" if path else name, tensor))
                    break
        return out

    def _kinds(self) -> tuple:
        return tuple((t.dtype, t.device) for _, t in self.tensors)

    def changed(self) -> bool:
        """Whether what the program baked in (hooks, submodules, attributes, dtypes) changed."""
        return self._token() != self.token or self._kinds() != self.kinds or self._own_kinds() != self.own_kinds

    def _own_kinds(self) -> tuple:
        return tuple((t.dtype, t.device) for _, t in self.own)

    def check(self, args: tuple = (), kwargs: dict | None = None) -> None:
        model = self.guard.model
        if model._backward_hooks or model._backward_pre_hooks or self.guard.backward_hooked:
            paths = ["(the model)"] if model._backward_hooks or model._backward_pre_hooks else self.guard.backward_hooked
            raise DpCompileError(
                f"backward hooks on {', '.join(paths[:3])} cannot run in a program captured with torch.export "
                "(frontend='export'), and would be silently skipped: hook a tensor (tensor.register_hook), or use "
                "frontend='fx' where the model traces"
            )
        if self._token() != self.token:
            changes = describe_changes(self.description, self.guard.description)
            if self._token()[1] != self.token[1]:
                changes.append("a forward hook added to or removed from the model itself")
            self._refuse(changes or ["a hook, a submodule, a parameter or an attribute forward reads"])
        if self._kinds() != self.kinds:
            changed = [(path, t) for (path, t), kind in zip(self.tensors, self.kinds) if (t.dtype, t.device) != kind]
            path, tensor = changed[0]
            before = dict(zip((p for p, _ in self.tensors), self.kinds))[path]
            self._refuse([f"'{path}' is {tensor.dtype} on {tensor.device}, captured as {before[0]} on {before[1]} (model.to(...))"])
        if self._own_kinds() != self.own_kinds:
            path, tensor = next((p, t) for (p, t), kind in zip(self.own, self.own_kinds) if (t.dtype, t.device) != kind)
            before = dict(zip((p for p, _ in self.own), self.own_kinds))[path]
            self._refuse([f"the program's '{path}' is {tensor.dtype} on {tensor.device}, captured as {before[0]} on "
                          f"{before[1]} (pm.to(...))"])  # fmt: skip
        if self.inputs:
            check_inputs(self.inputs, args, kwargs or {}, type(model).__name__)

    def _refuse(self, changes: list[str]) -> None:
        raise ModelChanged(
            f"the model ({type(self.guard.model).__name__}) changed since transform: {'; '.join(changes[:3])}. "
            "This program was captured with torch.export (frontend='export'), which baked in what forward read "
            "and cannot be traced again at call time: call dpcompile.transform again on the changed model, or "
            "undo the change (frontend='fx', where the model traces, follows such changes)"
        )
