"""``config.mesh`` of ``program.json`` (``export`` of a program over a DeviceMesh, ``export/mesh.py``):
the mesh's dimension names and sizes, the program's mode, the keywords that shaped it and each rank's
program hash, checked before anything is built."""

from __future__ import annotations

from typing import Any

import torch

from dpcompile.export.common import PROGRAM_FILE, ExportError

__all__ = ["CONTEXT_MODES", "DDP_SCALARS", "MESH_MODES", "checked_mesh_section"]

#: the programs over a mesh that export writes: data parallel (DDP or FSDP2), tensor parallel, dp x tp, pipelines,
#: context parallel
MESH_MODES = ("spmd_data_parallel", "spmd_tensor_parallel", "spmd_2d", "spmd_pipeline", "spmd_context_parallel",
              "spmd_context_tensor_parallel")  # fmt: skip
#: context parallel over a mesh: ``keywords.context_parallel`` is theirs (and only theirs)
CONTEXT_MODES = ("spmd_context_parallel", "spmd_context_tensor_parallel")
_MESH_DIMS = {"spmd_data_parallel": ((), ("dp",)), "spmd_tensor_parallel": ((), ("tp",)), "spmd_2d": (("dp", "tp"),),
              "spmd_pipeline": (("pp",), ("pp", "dp"), ("pp", "tp"), ("pp", "dp", "tp")),
              "spmd_context_parallel": (("cp",), ("dp", "cp")), "spmd_context_tensor_parallel": (("cp", "tp"),)}  # fmt: skip
_STYLES = ("column", "row", "replicate", "vocab")
#: what a recorded ddp_options value may be
DDP_SCALARS = (bool, int, float, str)


def checked_mesh_section(section: Any) -> dict[str, Any]:
    """``config.mesh`` of ``program.json``, its shape and values checked (``ExportError`` otherwise)."""
    fields = {"dims", "sizes", "mode", "keywords", "rank_code", "examples"}
    if not isinstance(section, dict) or set(section) != fields:
        raise ExportError(f"{PROGRAM_FILE}: a mesh section it cannot read")
    dims, sizes, mode, keywords, codes = (section[k] for k in ("dims", "sizes", "mode", "keywords", "rank_code"))
    if mode not in MESH_MODES or not isinstance(dims, list) or tuple(dims) not in _MESH_DIMS[mode]:
        raise ExportError(f"{PROGRAM_FILE}: mesh {dims!r:.60} of a {mode!r:.40} program")
    if not isinstance(sizes, list) or len(sizes) != max(len(dims), 1) or not all(type(s) is int and s >= 1 for s in sizes):
        raise ExportError(f"{PROGRAM_FILE}: mesh sizes {sizes!r:.60}")
    count = 1
    for s in sizes:
        count *= s
    if not isinstance(codes, list) or len(codes) != count or not all(isinstance(c, str) and len(c) == 64 for c in codes):
        raise ExportError(f"{PROGRAM_FILE}: rank_code must hold one sha256 per rank ({count})")
    _check_examples(section["examples"], count)
    expected = {"tensor_parallel", "data_parallel", "ddp_options", "exact_random", "frontend", "pipeline", "micro_batches",
                "schedule", "batch_dim", *(("context_parallel",) if mode in CONTEXT_MODES else ())}  # fmt: skip
    if not isinstance(keywords, dict) or set(keywords) != expected:
        raise ExportError(f"{PROGRAM_FILE}: mesh keywords {sorted(keywords) if isinstance(keywords, dict) else keywords!r:.80}")
    plan = keywords["tensor_parallel"]
    if not (type(plan) is bool or (isinstance(plan, dict) and all(isinstance(k, str) and v in _STYLES for k, v in plan.items()))):
        raise ExportError(f"{PROGRAM_FILE}: tensor_parallel {plan!r:.60}")
    _check_pipeline(keywords, mode)
    _check_context(keywords.get("context_parallel"))
    if (plan is False) != (mode in ("spmd_data_parallel", "spmd_context_parallel") or (mode == "spmd_pipeline" and "tp" not in dims)):
        raise ExportError(f"{PROGRAM_FILE}: tensor_parallel {plan!r:.40} with a {mode} program")
    options = keywords["ddp_options"]
    if keywords["data_parallel"] not in ("ddp", "fsdp") or type(keywords["exact_random"]) is not bool or keywords["frontend"] not in ("auto", "fx", "export"):
        raise ExportError(f"{PROGRAM_FILE}: mesh keywords {keywords!r:.120}")
    if not isinstance(options, dict) or not all(isinstance(k, str) and isinstance(v, DDP_SCALARS) for k, v in options.items()):
        raise ExportError(f"{PROGRAM_FILE}: ddp_options {options!r:.60}")
    return section


def _check_examples(examples: Any, count: int) -> None:
    """``null``, or per rank a list of ``{shape, dtype}`` (a tensor) or ``{value}`` (a plain value)."""
    if examples is None:
        return
    if not isinstance(examples, list) or len(examples) != count or not all(isinstance(e, list) for e in examples):
        raise ExportError(f"{PROGRAM_FILE}: examples must hold one list per rank ({count})")
    for entry in (e for rank in examples for e in rank):
        tensor = isinstance(entry, dict) and set(entry) == {"shape", "dtype"}
        if tensor and isinstance(entry["shape"], list) and all(type(n) is int and n >= 0 for n in entry["shape"]):
            if isinstance(getattr(torch, str(entry["dtype"]), None), torch.dtype) and len(entry["shape"]) <= 8:
                continue
        elif isinstance(entry, dict) and set(entry) == {"value"} and (entry["value"] is None or isinstance(entry["value"], DDP_SCALARS)):
            continue
        raise ExportError(f"{PROGRAM_FILE}: an example described as {entry!r:.80}")


def _check_context(options: Any) -> None:
    """``context_parallel``: ``{"exchange", "load_balance"}``, as ``transform``'s keyword takes them (or absent)."""
    from dpcompile.analysis.context_exchange import parse_context_parallel

    if options is None:
        return
    try:
        if not isinstance(options, dict) or set(options) != {"exchange", "load_balance"}:
            raise ValueError
        parse_context_parallel(options)
    except Exception:  # noqa: BLE001 - whatever the value, the folder's section is refused
        raise ExportError(f"{PROGRAM_FILE}: context_parallel {options!r:.80}") from None


def _check_pipeline(keywords: dict[str, Any], mode: str) -> None:
    """``pipeline`` (a stage count or the module paths where stages start), ``micro_batches``, ``schedule``,
    ``batch_dim``: a pipeline's, or None, 1, "gpipe", None."""
    stages, micro, schedule, batch_dim = (keywords[k] for k in ("pipeline", "micro_batches", "schedule", "batch_dim"))
    if mode != "spmd_pipeline":
        if (stages, micro, schedule, batch_dim) != (None, 1, "gpipe", None):
            raise ExportError(f"{PROGRAM_FILE}: pipeline keywords of a {mode} program")
        return
    paths = isinstance(stages, list) and stages and all(isinstance(p, str) and p for p in stages)
    if not (paths or (type(stages) is int and stages >= 1)) or type(micro) is not int or micro < 1:
        raise ExportError(f"{PROGRAM_FILE}: pipeline {stages!r:.60}, micro_batches {micro!r:.20}")
    if schedule not in ("gpipe", "1f1b") or not (batch_dim is None or type(batch_dim) is int):
        raise ExportError(f"{PROGRAM_FILE}: schedule {schedule!r:.20}, batch_dim {batch_dim!r:.20}")
