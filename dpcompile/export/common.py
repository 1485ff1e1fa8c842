"""Names shared by the export modules: file names, format versions, the error."""

from __future__ import annotations

import json
from typing import Any

import torch

from dpcompile.errors import DpCompileError
from dpcompile.modules.executors import executor_of

FORMAT = "dpcompile-export"
FORMAT_VERSION = 2
PROGRAM_FORMAT = "dpcompile-program"
MODULE_FILE = "module.py"
PROGRAM_FILE = "program.json"
WEIGHTS_FILE = "weights.safetensors"
PICKLE_FILE = "program.pkl"
MANIFEST_FILE = "manifest.json"
KINDS = ("data_parallel", "tensor_parallel", "pipeline", "pipeline_tensor_parallel")
SUMMARY_FIELDS = ("kind", "class_name", "devices", "dpcompile_version", "torch_version", "trust_code")


def readable_mode(kind: str, config: dict[str, Any]) -> str:
    """How ``module.py``'s first line names the program: its kind, whether ``dp`` is FSDP, the mesh it was exported over."""
    if isinstance(config.get("mesh"), dict):  # the single-device program of one over a mesh: every field shown
        return f"{kind}, exported over a DeviceMesh {json.dumps(config['mesh'], sort_keys=True, separators=(', ', ': '))}"
    if config.get("data_parallel") == "fsdp":
        return f'{kind} with data_parallel="fsdp" (each parameter stored as pieces over dp, gathered where it is read)'
    return kind


class ExportError(DpCompileError):
    """An export folder cannot be written or loaded; the message says why and what to do."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def device_strings(devices: Any) -> list[str]:
    return devices.strings() if hasattr(devices, "strings") else [str(d) for d in devices]


def runs_stages(pm: Any) -> bool:
    """A pipeline in one process: GPipe or 1F1B over ``pm.stages`` (its executor says)."""
    return executor_of(pm).runs_stages_in_one_process


def shards_stages(pm: Any) -> bool:
    """A pipeline in one process whose stages are sharded: it holds the sharded state (``pm.param_shards``)."""
    return runs_stages(pm) and pm.__dict__.get("param_shards") is not None
