"""What a loaded program may call, and which module classes it may build.

A call target in ``program.json`` is a qualified name (``torch.relu``,
``operator.getitem``, ``dpcompile.runtime.scatter``). :func:`resolve_target` turns it
back into the function by looking it up in a fixed set of namespaces that are already
imported (``torch``, ``torch.nn.functional``, ``torch._C._nn``, ``torch.Tensor``,
``operator``, ``math``, a few ``builtins``, ``dpcompile.runtime``); it never imports a
module named by the folder. Functions that touch files (``torch.load``, ``torch.save``,
``torch.from_file``) are not ops and are refused.

Module classes are ``torch.nn`` classes (looked up in the already imported
``torch.nn.modules.*``), or classes the caller registers with
:func:`register_module_class` in both the exporting and the loading process.

>>> import torch
>>> resolve_target("torch.relu") is torch.relu
True
>>> resolve_target("torch.load")
Traceback (most recent call last):
...
dpcompile.export.allowlist.NotAllowed: 'torch.load' is not an op a loaded program may call (...)
"""

from __future__ import annotations

import builtins
import math
import operator
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx._symbolic_trace import _assert_is_none
from torch.fx.node import _get_qualified_name

from dpcompile.errors import DpCompileError
from dpcompile.fx_utils import unalias

__all__ = [
    "NotAllowed",
    "class_name",
    "qualified_name",
    "register_module_class",
    "register_output_type",
    "resolve_class",
    "resolve_target",
    "safe_attribute",
]


class NotAllowed(DpCompileError):
    """A name in an export folder that the allowlist does not hold."""


# functions under ``torch`` that read or write files, or change global state: never ops
_TORCH_DENIED = frozenset(
    {"from_file", "load", "save", "set_default_dtype", "set_default_device", "set_default_tensor_type",
     "manual_seed", "seed", "set_rng_state", "set_num_threads", "set_num_interop_threads", "compile",
     "set_printoptions", "set_flush_denormal", "use_deterministic_algorithms", "set_warn_always"}
)  # fmt: skip
_TORCH_PRIVATE_OK = frozenset({"_assert"})
_ASSERT_IS_NONE = "torch.fx._symbolic_trace._assert_is_none"
_OPERATORS = frozenset(
    {"getitem", "setitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "neg", "pos",
     "invert", "and_", "or_", "xor", "lshift", "rshift", "eq", "ne", "lt", "le", "gt", "ge", "not_", "is_",
     "is_not", "contains", "abs", "index", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow",
     "imatmul", "iand", "ior", "ixor", "truth", "concat"}
)  # fmt: skip
_BUILTINS = frozenset(
    {"getattr", "len", "int", "float", "bool", "min", "max", "abs", "tuple", "list", "slice", "range",
     "round", "sum", "all", "any", "pow", "divmod", "hasattr"}
)  # fmt: skip
# the runtime modules generated code calls (not the SPMD ones: an SPMD program is not exported)
_RUNTIME_MODULES = (
    "dpcompile.runtime",
    "dpcompile.runtime.comm",
    "dpcompile.runtime.reduce",
    "dpcompile.runtime.replicate",
    "dpcompile.runtime.rnn",
    "dpcompile.runtime.batchnorm",
    "dpcompile.runtime.tensor_parallel",
    "dpcompile.runtime.exported",
)
# Tensor methods a program must not call on what it holds (``numpy`` leaves torch's world)
_METHODS_DENIED = frozenset({"numpy", "tofile", "storage", "untyped_storage", "share_memory_", "register_hook"})

_registered: dict[str, type[nn.Module]] = {}
_outputs: dict[str, type] = {}


def register_module_class(cls: type[nn.Module]) -> type[nn.Module]:
    """Let exported programs hold instances of ``cls`` as data (usable as a decorator).

    The class is rebuilt on load without its constructor (``cls.__new__`` then
    ``nn.Module.__init__``) and given the plain attributes it had (ints, floats, strings,
    tuples, dtypes, allowlisted functions); its ``forward`` is the one installed where you
    load, never code from the folder. Register it in the exporting and the loading process.

    >>> import torch
    >>> @register_module_class
    ... class Scale(torch.nn.Module):
    ...     def forward(self, x):
    ...         return 2 * x
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_module_class needs an nn.Module subclass, got {cls!r}")
    _registered[class_name(cls)] = cls
    return cls


def register_output_type(cls: type) -> type:
    """Let exported programs build ``cls``, a namedtuple or dataclass the model returns
    (usable as a decorator). Register it in the exporting and the loading process; the
    class installed where you load is the one called, never code from the folder.

    >>> import collections
    >>> Pair = register_output_type(collections.namedtuple("Pair", "a b"))
    """
    import dataclasses

    if not (isinstance(cls, type) and (issubclass(cls, tuple) and hasattr(cls, "_fields") or dataclasses.is_dataclass(cls))):
        raise TypeError(f"register_output_type needs a namedtuple or dataclass class, got {cls!r}")
    _outputs[class_name(cls)] = cls
    return cls


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _torch_nn_class(name: str) -> type[nn.Module] | None:
    module_name, _, qualname = name.rpartition(".")
    if not module_name.startswith("torch.nn.modules.") or "<" in qualname:
        return None
    module = sys.modules.get(module_name)  # only what torch has imported already
    cls = getattr(module, qualname, None) if module is not None and "." not in qualname else None
    if isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == module_name:
        return cls
    return None


def resolve_class(name: str) -> type[nn.Module]:
    """The module class named ``name`` (a ``torch.nn`` class or a registered one)."""
    cls = _registered.get(name) or _torch_nn_class(name)
    if cls is None:
        raise NotAllowed(
            f"module class {name!r} is neither a torch.nn class nor registered with "
            "register_module_class (from dpcompile.export import register_module_class)"
        )
    return cls


def can_rebuild(cls: type) -> bool:
    """Whether instances of ``cls`` can be stored as data."""
    name = class_name(cls)
    return _registered.get(name) is cls or _torch_nn_class(name) is cls


def safe_attribute(name: Any) -> bool:
    """An attribute name a program may read: an identifier path without dunders."""
    if not isinstance(name, str) or not name:
        return False
    name = unalias(name)  # the model's `devices`, as generated code reads it ("user:devices")
    return all((part.isidentifier() or part.isdigit()) and not part.startswith("__") for part in name.split("."))


def allowed_method(name: Any) -> bool:
    """A ``call_method`` target that names a ``torch.Tensor`` method."""
    return (
        isinstance(name, str)
        and name.isidentifier()
        and not name.startswith("_")
        and name not in _METHODS_DENIED
        and callable(getattr(torch.Tensor, name, None))
    )


def _runtime(module_name: str, name: str) -> Any:
    module = sys.modules.get(module_name)
    if module is None:
        import dpcompile.runtime  # noqa: F401 - our own package: imports its submodules
        import dpcompile.runtime.exported  # noqa: F401
        import dpcompile.runtime.tensor_parallel  # noqa: F401

        module = sys.modules.get(module_name)
    obj = getattr(module, name, None)
    public = getattr(module, "__all__", None)
    if obj is None or (public is not None and name not in public) or isinstance(obj, type) and not callable(obj):
        return None
    owner = getattr(obj, "__module__", "") or ""
    return obj if owner.startswith("dpcompile.runtime") or obj is getattr(module, "TAKE_FIRST", None) else None


def _aten(qualname: str) -> Any:
    """``torch.ops.aten.<op>.<overload>`` (the torch.export frontend's ops), from torch's own
    registry; ops that read or write files are not ops here."""
    parts = qualname.split(".")
    if len(parts) != 5 or not all(p.isidentifier() and not p.startswith("__") for p in parts[3:]):
        return None
    op, overload = parts[3], parts[4]
    if "file" in op or op.lstrip("_") in _TORCH_DENIED:
        return None
    try:
        obj = getattr(getattr(torch.ops.aten, op), overload)
    except (AttributeError, RuntimeError):
        return None
    return obj if isinstance(obj, torch._ops.OpOverload) else None


def _lookup(qualname: str) -> Any:
    if qualname in _outputs:
        return _outputs[qualname]
    if qualname == _ASSERT_IS_NONE:  # the check of an optional argument a program was traced with as None
        return _assert_is_none
    if qualname.startswith("torch.ops.aten."):
        return _aten(qualname)
    namespace, _, name = qualname.rpartition(".")
    if not name or name.startswith("__"):
        return None
    if namespace == "torch":
        if (name.startswith("_") and name not in _TORCH_PRIVATE_OK) or name in _TORCH_DENIED:
            return None
        obj = getattr(torch, name, None)
        native = getattr(torch._C._VariableFunctions, name, None)
        if obj is not None and (obj is native or name in torch.functional.__all__ or name in _TORCH_PRIVATE_OK):
            return obj
        return None
    if namespace == "torch.functional":
        return getattr(torch.functional, name, None) if name in torch.functional.__all__ else None
    if namespace == "torch.nn.functional":
        obj = getattr(F, name, None)
        if name.startswith("_") or not callable(obj) or isinstance(obj, type):
            return None
        native = obj is getattr(torch._C._VariableFunctions, name, None) or obj is getattr(torch._C._nn, name, None)
        return obj if native or getattr(obj, "__module__", None) == "torch.nn.functional" else None
    if namespace == "torch._C._nn":
        return None if name.startswith("_") else getattr(torch._C._nn, name, None)
    if namespace == "torch.Tensor":
        return getattr(torch.Tensor, name) if allowed_method(name) else None
    if namespace in ("operator", "_operator"):
        return getattr(operator, name) if name in _OPERATORS else None
    if namespace == "builtins":
        return getattr(builtins, name) if name in _BUILTINS else None
    if namespace == "math":
        obj = getattr(math, name, None)
        return obj if callable(obj) or isinstance(obj, float) else None
    if namespace in _RUNTIME_MODULES and not name.startswith("_"):
        return _runtime(namespace, name)
    return None


def resolve_target(qualname: Any) -> Callable[..., Any]:
    """The function an exported program names ``qualname``, from the allowlist only."""
    obj = _lookup(qualname) if isinstance(qualname, str) else None
    if obj is None:
        raise NotAllowed(
            f"{qualname!r} is not an op a loaded program may call (allowed: torch ops, torch.nn.functional, "
            "Tensor methods, operator, math, dpcompile.runtime)"
        )
    return obj


def qualified_name(target: Any) -> str | None:
    """The allowlisted name of ``target``, or None where it has none."""
    names = []
    try:
        names.append(_get_qualified_name(target))
    except Exception:  # noqa: BLE001 - a callable fx cannot name
        pass
    module, name = getattr(target, "__module__", None), getattr(target, "__name__", None)
    if isinstance(target, type):
        names.append(class_name(target))
    if name:
        names += [f"{module}.{name}"] if module else []
        names += [f"torch.{name}", f"torch.nn.functional.{name}", f"torch._C._nn.{name}", f"builtins.{name}"]
        names += [f"{m}.{name}" for m in _RUNTIME_MODULES]
    for candidate in names:
        if _lookup(candidate) is target:
            return candidate.replace("_operator.", "operator.", 1)
    return None
