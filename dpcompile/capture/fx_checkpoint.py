"""Activation checkpointing the model writes itself, kept through fx capture.

``checkpoint(self.block, x)`` in forward becomes a ``torch.utils.checkpoint.checkpoint`` node calling
the submodule; a function that is not a submodule (a closure) is traced through, with a warning.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch.fx as fx
from torch import nn


def record_checkpoints(tracer: fx.Tracer, root: Any):
    """Keep activation checkpointing: ``checkpoint(self.block, x, ...)`` inside forward becomes a
    ``torch.utils.checkpoint.checkpoint`` node calling the submodule (run per device by data
    parallelism) instead of being traced through and lost. Other callables are traced through,
    as before. Returns the function that undoes the patch."""
    import torch.utils.checkpoint as checkpointing

    original = checkpointing.checkpoint

    def recorded_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
        module = function if isinstance(function, nn.Module) else None
        if module is None and getattr(function, "__name__", None) == "forward" and isinstance(getattr(function, "__self__", None), nn.Module):
            module = function.__self__
        if not any(isinstance(a, fx.Proxy) for a in args):
            return original(function, *args, **kwargs)
        if module is None:
            _warn_checkpoint_traced_through(function)
            return original(function, *args, **kwargs)
        try:
            path = tracer.path_of_module(module)
        except NameError:  # not a submodule of the traced model
            return original(function, *args, **kwargs)
        ref = tracer.create_proxy("get_attr", path, (), {})
        return tracer.create_proxy("call_function", original, (ref, *args), kwargs)

    patched: list[tuple[dict, str]] = []
    namespaces = [checkpointing.__dict__]
    if isinstance(root, nn.Module):
        for _, m in root.named_modules():
            namespace = getattr(sys.modules.get(type(m).__module__), "__dict__", None)
            if namespace is not None and namespace not in namespaces:
                namespaces.append(namespace)
    for namespace in namespaces:
        for name, value in list(namespace.items()):
            if value is original:
                namespace[name] = recorded_checkpoint
                patched.append((namespace, name))

    def undo() -> None:
        for namespace, name in patched:
            namespace[name] = original

    return undo


def _warn_checkpoint_traced_through(function: Any) -> None:
    """``checkpoint(closure, x)`` (torchvision's DenseNet with ``memory_efficient=True``): the
    program cannot call a function that is not a submodule, so its body is traced inline."""
    code = getattr(function, "__code__", None)
    where = f" ({code.co_filename}, line {code.co_firstlineno})" if code is not None else ""
    warnings.warn(
        f"torch.utils.checkpoint.checkpoint({getattr(function, '__qualname__', function)!s}, ...){where} calls a "
        "function that is not a submodule: its body is traced into the program, so its activations are kept, not "
        "recomputed, and state it writes (BatchNorm's running statistics) is updated once a call, where eager's "
        "recompute updates it a second time. Checkpoint a submodule (checkpoint(self.block, x)) or pass "
        "activation_checkpointing= to transform",
        stacklevel=2,
    )
