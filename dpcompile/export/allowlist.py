"""What a loaded program may call, and which module classes it may build.

A call target in ``program.json`` is a qualified name (``torch.relu``,
``operator.getitem``, ``dpcompile.runtime.scatter``): :func:`resolve_target` looks it up in
the closed vocabulary of :mod:`dpcompile.export.vocabulary` (built once, frozen), or among
the output types the caller registered; nothing else resolves, and no name is followed
attribute by attribute.

Module classes are the ``torch.nn`` classes (a table built once from ``torch.nn.modules``),
dpcompile's own stand-ins (:data:`STAND_INS`), or classes the caller registers with
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

import collections
import functools
import re
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from dpcompile.errors import DpCompileError
from dpcompile.export.strided import original_name
from dpcompile.export.vocabulary import TENSOR_METHODS, denied, vocabulary
from dpcompile.fx_utils import unalias
from dpcompile.runtime.exported import MatmulLinear, TransposedLinear

__all__ = [
    "NotAllowed",
    "STAND_INS",
    "class_name",
    "module_classes",
    "op_name",
    "qualified_name",
    "register_module_class",
    "register_output_type",
    "resolve_class",
    "resolve_op",
    "resolve_target",
    "safe_attribute",
    "safe_name_part",
    "stand_in_name",
]


class NotAllowed(DpCompileError):
    """A name in an export folder that the allowlist does not hold."""


# classes a program holds as dpcompile's own, by the class they stand for: same attributes,
# same arithmetic, dpcompile's forward (the folder never names the library's class)
STAND_INS: Mapping[str, type[nn.Module]] = types.MappingProxyType(
    {"transformers.pytorch_utils.Conv1D": TransposedLinear,
     "transformers.models.falcon.modeling_falcon.FalconLinear": MatmulLinear}
)

_registered: dict[str, type[nn.Module]] = {}
_outputs: dict[str, type] = {"collections.OrderedDict": collections.OrderedDict}  # torchvision's segmentation outputs


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


@functools.cache
def module_classes() -> Mapping[str, type[nn.Module]]:
    """The module classes a program may hold (registered ones aside), by qualified name: every
    class ``torch.nn.modules`` defines, and dpcompile's stand-ins. Built once, read-only."""
    table: dict[str, type[nn.Module]] = {}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("torch.nn.modules.") or module is None:
            continue
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, nn.Module) and obj.__module__ == module_name and obj is not nn.Module:
                table[class_name(obj)] = obj
    table.update({class_name(cls): cls for cls in STAND_INS.values()})
    return types.MappingProxyType(table)


def stand_in_name(module: nn.Module) -> str | None:
    """The class name a program stores for ``module``: its own where it can be rebuilt, a
    stand-in's for a library class dpcompile reimplements (exactly that class, no hooks), else None."""
    cls = type(module)
    name = class_name(cls)
    if _registered.get(name) is cls or module_classes().get(name) is cls:
        return name
    stand_in = STAND_INS.get(name)
    if stand_in is not None and not (module._forward_hooks or module._forward_pre_hooks):
        return class_name(stand_in)
    return None


def resolve_class(name: str) -> type[nn.Module]:
    """The module class named ``name`` (a ``torch.nn`` class, a stand-in or a registered one)."""
    cls = _registered.get(name) or module_classes().get(name) if isinstance(name, str) else None
    if cls is None:
        raise NotAllowed(
            f"module class {name!r:.80} is neither a torch.nn class nor registered with "
            "register_module_class (from dpcompile.export import register_module_class)"
        )
    return cls


def can_rebuild(cls: type) -> bool:
    """Whether instances of ``cls`` can be stored as data."""
    name = class_name(cls)
    return _registered.get(name) is cls or module_classes().get(name) is cls or name in STAND_INS


def safe_name_part(part: Any) -> bool:
    """One part of an attribute path: an identifier, a number, or a module name with hyphens
    (torchvision RegNet's ``block1-0``, which ``add_module`` allows); never a dunder."""
    return isinstance(part, str) and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_-]*", part) is not None and not part.startswith("__")


def safe_attribute(name: Any) -> bool:
    """An attribute name a program may read: a path of :func:`safe_name_part` parts."""
    if not isinstance(name, str) or not name:
        return False
    name = unalias(name)  # the model's `devices`, as generated code reads it ("user:devices")
    return all(safe_name_part(part) for part in name.split("."))


def allowed_method(name: Any) -> bool:
    """A ``call_method`` name a program may use on a value that is not a module: a Tensor method
    of the vocabulary."""
    return isinstance(name, str) and name in TENSOR_METHODS


def resolve_target(qualname: Any) -> Callable[..., Any]:
    """The function an exported program names ``qualname``: from the vocabulary, or a registered output type."""
    obj = None
    if isinstance(qualname, str):
        obj = vocabulary().get(qualname)
        if obj is None and not denied(qualname.rpartition(".")[2]):
            obj = _outputs.get(qualname)
    if obj is None:
        raise NotAllowed(
            f"{qualname!r:.100} is not an op a loaded program may call (allowed: the vocabulary of "
            "dpcompile.export.vocabulary: ATen ops, torch functions, torch.nn.functional, Tensor methods, "
            "operator, math, dpcompile.runtime; and registered output types)"
        )
    return obj


def op_name(op: Any) -> str:
    """An ATen op's qualified name as ``program.json`` holds an op passed as a value: ``"aten::slice.Tensor"``."""
    return f"{op._schema.name}.{op._overloadname}"


def resolve_op(name: Any) -> Callable[..., Any]:
    """The ATen op named ``"aten::<op>.<overload>"``: the vocabulary's ``torch.ops.aten.<op>.<overload>``,
    nothing else (no attribute is followed, so an edited name reaches no other object).

    >>> import torch
    >>> resolve_op("aten::slice.Tensor") is torch.ops.aten.slice.Tensor
    True
    """
    namespace, _, rest = name.partition("::") if isinstance(name, str) else ("", "", "")
    op, _, overload = rest.partition(".")
    found = vocabulary().get(f"torch.ops.aten.{op}.{overload}") if namespace == "aten" and op and overload else None
    if not isinstance(found, torch._ops.OpOverload):
        raise NotAllowed(
            f"the op {name!r:.100} is no ATen op of the vocabulary (a value a program may hold is "
            "'aten::<op>.<overload>' naming one of dpcompile.export.vocabulary's torch.ops.aten entries)"
        )
    return found


@functools.cache
def _names_by_identity() -> Mapping[int, str]:
    names: dict[int, str] = {}
    for name, obj in vocabulary().items():
        names.setdefault(id(obj), name)
    return names


def qualified_name(target: Any) -> str | None:
    """The vocabulary's name of ``target`` (or a registered output type's), or None where it has none."""
    if isinstance(target, type) and _outputs.get(class_name(target)) is target:
        return class_name(target)
    bounded = original_name(target)  # a loaded program's bounded as_strided: stored as the op
    if bounded is not None:
        return bounded
    name = _names_by_identity().get(id(target))
    if name is None:
        return _STAND_INS.get(f"{getattr(target, '__module__', None)}.{getattr(target, '__qualname__', None)}")
    return name if vocabulary()[name] is target else None


# third-party functions fx keeps as calls, written as dpcompile's copies of them (the same ops and draws)
_STAND_INS = {"torchvision.ops.stochastic_depth.stochastic_depth": "dpcompile.runtime.stochastic_depth"}


def output_fields() -> frozenset[str]:
    """The field names of the registered output types (what ``getattr`` may read of them)."""
    import dataclasses

    fields: set[str] = set()
    for cls in _outputs.values():
        if dataclasses.is_dataclass(cls) or hasattr(cls, "_fields"):
            fields.update(getattr(cls, "_fields", ()) or (f.name for f in dataclasses.fields(cls)))
    return frozenset(fields)
