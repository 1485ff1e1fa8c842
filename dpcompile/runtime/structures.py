"""Walk nested values: tuples, lists, dicts, namedtuples, dataclasses, PackedSequence.

``map_structure(fn, *values)`` applies ``fn`` to matching leaves and rebuilds the
structure of the first value; non-container leaves (tensors, None, Python scalars,
anything else) are passed to ``fn`` as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence


def is_namedtuple(value: object) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def is_structseq(value: object) -> bool:
    """A ``torch.return_types`` value (``x.topk(k)``, ``x.max(dim)``): a tuple whose fields are named."""
    return isinstance(value, tuple) and hasattr(type(value), "n_fields")


def is_dataclass_instance(value: object) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def children(value: Any) -> list[Any] | None:
    """The direct children of a container, or None for a leaf."""
    if isinstance(value, PackedSequence):
        return None
    if isinstance(value, (tuple, list)):
        return list(value)
    if isinstance(value, dict):
        return list(value.values())
    if is_dataclass_instance(value):
        return [getattr(value, f.name) for f in dataclasses.fields(value) if f.init]
    return None


def rebuild(template: Any, new_children: list[Any]) -> Any:
    """A container like ``template`` holding ``new_children``."""
    if is_namedtuple(template):
        return type(template)(*new_children)
    if is_structseq(template):
        return type(template)(new_children)
    if isinstance(template, tuple):
        return tuple(new_children)
    if isinstance(template, list):
        return list(new_children)
    if isinstance(template, dict):
        out = type(template)() if type(template) is not dict else {}
        for key, child in zip(template.keys(), new_children):
            out[key] = child
        return out
    if is_dataclass_instance(template):
        names = [f.name for f in dataclasses.fields(template) if f.init]
        return dataclasses.replace(template, **dict(zip(names, new_children)))
    raise TypeError(f"not a container: {type(template).__name__}")


def map_structure(fn: Callable[..., Any], *values: Any) -> Any:
    """Apply ``fn`` leaf-wise over values of the same structure."""
    first = values[0]
    kids = children(first)
    if kids is None:
        return fn(*values)
    others = [children(v) for v in values[1:]]
    for other in others:
        if other is None or len(other) != len(kids):
            raise ValueError(
                f"replicas returned different structures: {type(first).__name__} of {len(kids)} "
                f"vs {type(other).__name__ if other is not None else 'leaf'}"
            )
    return rebuild(first, [map_structure(fn, *parts) for parts in zip(kids, *others)])


def tensor_leaves(value: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """``[(path, tensor)]`` for every tensor leaf, paths such as ``['x'][0]``."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, PackedSequence):
        return [(f"{path}.data", value.data)]
    kids = children(value)
    if kids is None:
        return []
    if isinstance(value, dict):
        keys = [f"[{k!r}]" for k in value.keys()]
    elif is_dataclass_instance(value) or is_namedtuple(value):
        fields = value._fields if is_namedtuple(value) else [f.name for f in dataclasses.fields(value) if f.init]
        keys = [f".{name}" for name in fields]
    else:
        keys = [f"[{i}]" for i in range(len(kids))]
    out: list[tuple[str, torch.Tensor]] = []
    for key, kid in zip(keys, kids):
        out.extend(tensor_leaves(kid, path + key))
    return out


def is_fake(t: object) -> bool:
    """True for a tensor without data: a fake tensor (``FakeTensorMode``), a functional
    wrapper of one, or a tensor on the ``meta`` device."""
    return isinstance(t, torch.Tensor) and (
        type(t).__name__ in ("FakeTensor", "FunctionalTensor") or t.device.type == "meta"
    )
