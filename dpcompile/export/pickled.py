"""The opt-in pickle path: ``program.pkl`` for programs that hold Python classes fx kept as leaves.

Written only when the program cannot be data (see :mod:`dpcompile.export.serialize`), and read
only by ``load(path, trust_code=True)``: unpickling imports and runs code named by the file.
Tensors are not in the pickle: it refers to them by their key in ``weights.safetensors``.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

__all__ = ["dump", "restore"]


def _plain_module(state: dict[str, Any]) -> nn.Module:
    """Stand-in for a user container module that generated code never calls."""
    module = nn.Module()
    module._parameters.update(state["parameters"])
    module._buffers.update(state["buffers"])
    module._modules.update(state["modules"])
    module._non_persistent_buffers_set = set(state["non_persistent"])
    module.training = state["training"]
    return module


def _module_base() -> type:
    return nn.Module


def _nothing() -> None:
    return None


def _is_fake(obj: object) -> bool:
    return isinstance(obj, torch.Tensor) and (type(obj).__name__ == "FakeTensor" or obj.device.type == "meta")


def _called_modules(pm: nn.Module) -> set[int]:
    """The modules generated code calls, with their children: their classes must be kept."""
    graphs = [pm.graph] + ([pm.captured.graph] if getattr(pm, "captured", None) is not None else [])
    keep: set[int] = set()
    for graph in graphs:
        for node in graph.nodes:
            if node.op != "call_module" or not isinstance(node.target, str):
                continue
            try:
                target = pm.get_submodule(node.target)
            except AttributeError:
                target = getattr(pm, node.target, None) if "." not in node.target else None
            if isinstance(target, nn.Module):
                keep.update(id(m) for m in target.modules())
    return keep


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BufferedIOBase, keys: dict[int, str], keep: set[int], kept_classes: set[type]):
        super().__init__(file, protocol=4)
        self.keys, self.keep, self.kept_classes = keys, keep, kept_classes

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and id(obj) in self.keys:
            return ("tensor", self.keys[id(obj)])
        return None

    def reducer_override(self, obj: Any) -> Any:
        if _is_fake(obj):  # shapes recorded in node.meta: not needed to run
            return (_nothing, ())
        user = not getattr(obj, "__module__", "").startswith(("torch.", "dpcompile."))
        if isinstance(obj, type) and issubclass(obj, nn.Module) and obj not in self.kept_classes and user:
            return (_module_base, ())  # a class named only in metadata (nn_module_stack)
        if (
            isinstance(obj, nn.Module)
            and not isinstance(obj, fx.GraphModule)
            and id(obj) not in self.keep
            and not type(obj).__module__.startswith(("torch.", "dpcompile."))
        ):
            state = {
                "parameters": dict(obj._parameters),
                "buffers": dict(obj._buffers),
                "modules": dict(obj._modules),
                "non_persistent": set(obj._non_persistent_buffers_set),
                "training": obj.training,
            }
            return (_plain_module, (state,))
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, tensors: dict[str, torch.Tensor]):
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        from dpcompile.export.common import ExportError

        kind, key = pid
        if kind != "tensor" or key not in self.tensors:
            raise ExportError(f"program.pkl refers to tensor {key!r}, which weights.safetensors does not hold")
        return self.tensors[key]


def dump(pm: nn.Module, keys: dict[int, str]) -> bytes:
    """``pm`` pickled with its tensors replaced by their keys."""
    keep = _called_modules(pm)
    classes = {type(m) for m in pm.modules() if id(m) in keep}
    root = pm.__dict__.get("root")
    if isinstance(root, nn.Module):
        keep.update(id(m) for m in root.modules())
        classes.update(type(m) for m in root.modules())
    buffer = io.BytesIO()
    _Pickler(buffer, keys, keep, classes).dump(pm)
    return buffer.getvalue()


def restore(path: Path, tensors: dict[str, torch.Tensor], program: dict[str, Any], target: Any) -> nn.Module:
    """Unpickle ``program.pkl`` (runs code: only with ``trust_code=True``) onto ``target``."""
    from dpcompile.export.build import device_mapping, map_devices
    from dpcompile.export.common import ExportError, device_strings

    try:
        with open(path, "rb") as f:
            pm = _Unpickler(f, tensors).load()
    except ExportError:
        raise
    except (AttributeError, ModuleNotFoundError, ImportError) as e:
        raise ExportError(
            f"cannot rebuild the program from {path}: {e}; a module class that generated code calls must be "
            "importable where you load (define it in an installed module, not in __main__)"
        ) from e
    except Exception as e:
        raise ExportError(f"cannot rebuild the program from {path}: {type(e).__name__}: {e}") from e
    from dpcompile.modules.base import ParallelModule

    if not isinstance(pm, ParallelModule):
        raise ExportError(f"{path} holds a {type(pm).__name__}, not a ParallelModule")
    recorded = list(program["config"]["devices"])
    if device_strings(target) == recorded:
        return pm
    out = str(pm.output_device)
    output_device = target[recorded.index(out)] if out in recorded and recorded.index(out) < len(target) else target.primary
    if pm.recipe.lowers_capture and pm.captured is not None:  # data parallel: lowered again
        return pm.recipe.retarget(pm, target, output_device)
    map_devices(pm.graph, device_mapping(recorded, target))
    pm.recompile()
    pm.devices = target
    pm.output_device = output_device
    return pm
