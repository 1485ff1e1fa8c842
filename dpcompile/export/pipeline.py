"""A one-process pipeline as data: the stages, the schedule, the stage plan, each node's stage.

A pipeline program (a ``ParallelModule`` run by a pipeline's executor, its stages sharded too: pp x tp, dp x tp)
is written as a data-parallel one is (the main program, its variants, the captured program,
the module tree, the weights by the model's keys), plus ``config.pipeline``::

    micro_batches, schedule ("gpipe" | "1f1b")
    stage_plan    {stages, stage_of {node: stage}, starts, weights, param_bytes, module_paths,
                   measure, sent}: what the captured program's nodes run on (1F1B lowers it again)
    stages        [{index, device, module_paths, flops, param_bytes, graph, meta}]: each stage's
                   program for one micro-batch (``pm.stages[i].code``), shown in module.py as
                   ``stage<i>``; ``meta`` (tensor-parallel stages): the unsharded weights it reads,
                   {path: {shape, dtype, parameter, requires_grad}}, rebuilt on the meta device
    steps         [{key, graph}]: ``"1f1b"`` without tensor-parallel stages, the training step's
                   program for each micro-batch count (``one_f_one_b_<m>`` in module.py), as
                   ``transform`` lowered it (a loaded module holds no model classes to lower again:
                   GPT-2's ``Conv1D`` is rebuilt as another class); tensor-parallel stages step
                   their carried programs
    node_stages   {method: {node: stage}}: the stage of each node of each lowered program (what a
                   1F1B step groups into units; ``explain``'s stages)
    stage_groups  tensor-parallel stages: each stage's devices; null otherwise
    shard_slots   tensor-parallel stages: each parameter's device slot; null otherwise

Nothing here runs: a stage's program is shown (``module.py``) and rebuilt (``pm.stages``), and
the module runs its main program (GPipe's order) or builds its 1F1B step with dpcompile's passes
from the captured program and the stage plan, as ``transform`` does.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.export.common import PROGRAM_FILE, ExportError, shards_stages
from dpcompile.modules.executors import executor_of
from passes.split_stages import STAGE as _STAGE

__all__ = ["PIPELINE_KINDS", "attach_steps", "checked_section", "describe_pipeline", "step_graphs", "pipeline_extra", "stage_graphs", "stage_label", "stamp_stages"]

log = logging.getLogger("dpcompile")

PIPELINE_KINDS = ("pipeline", "pipeline_tensor_parallel")
_SECTION = {"micro_batches", "schedule", "stage_plan", "stages", "steps", "node_stages", "stage_groups", "shard_slots"}
_PLAN = {"stages", "stage_of", "starts", "weights", "param_bytes", "module_paths", "measure", "sent"}
_STAGE_FIELDS = {"index", "device", "module_paths", "flops", "param_bytes", "graph", "meta"}


def stage_label(index: int) -> str:
    """The method of ``module.py`` showing stage ``index``'s program."""
    return f"stage{index}"


# ------------------------------------------------------------------------------ export
def describe_pipeline(pm: nn.Module, programs: Sequence[tuple[str, fx.Graph]]) -> dict[str, Any]:
    """``config.pipeline`` of ``pm``; ``programs``: the lowered programs by their method name in
    module.py (``forward``, ``forward_eval``, ...), whose nodes' stages are recorded."""
    from dpcompile.export.serialize import encode_graph
    from dpcompile.export.variants import encode_key

    plan = pm.stage_plan
    steps = one_f_one_b_programs(pm)
    programs = [*programs, *((_step_label(key), gm.graph) for key, gm in steps)]
    groups = pm.__dict__.get("stage_groups")
    slots = pm.__dict__.get("shard_param_slots") if groups is not None else None
    return {
        "micro_batches": int(pm.micro_batches),
        "schedule": str(pm.schedule),
        "stage_plan": {
            "stages": int(plan.stages),
            "stage_of": {str(k): int(v) for k, v in plan.stage_of.items()},
            "starts": [str(s) for s in plan.starts],
            "weights": [int(w) for w in plan.weights],
            "param_bytes": [int(b) for b in plan.param_bytes],
            "module_paths": [[str(p) for p in paths] for paths in plan.module_paths],
            "measure": str(plan.measure),
            "sent": [[str(v) for v in values] for values in plan.sent],
        },
        "stages": [
            {
                "index": int(s.index),
                "device": str(s.device),
                "module_paths": [str(p) for p in s.module_paths],
                "flops": int(s.flops),
                "param_bytes": int(s.param_bytes),
                "graph": encode_graph(s.program.graph),
                "meta": _meta_tensors(s.program) if groups is not None else None,
            }
            for s in pm.stages
        ],
        "steps": [{"key": encode_key(key), "graph": encode_graph(gm.graph)} for key, gm in steps],
        "node_stages": {
            label: {n.name: int(n.meta[_STAGE]) for n in graph.nodes if _STAGE in n.meta} for label, graph in programs
        },
        "stage_groups": None if groups is None else [[str(d) for d in g] for g in groups],
        "shard_slots": None if slots is None else {str(k): int(v) for k, v in slots.items()},
    }


def _step_label(key: Any) -> str:
    from dpcompile.export.source import STEP

    return f"{STEP}{key.devices}"


def one_f_one_b_programs(pm: nn.Module) -> list[tuple[Any, fx.GraphModule]]:
    """The 1F1B training step's program for each micro-batch count (1 .. ``micro_batches``, at
    most 8), lowered as a call would (``pm.recipe.one_f_one_b_step``); none for GPipe or for
    tensor-parallel stages (their step runs the program carried for the call)."""
    from dpcompile.program_cache import CallKey

    if not executor_of(pm).steps_one_f_one_b or shards_stages(pm):
        return []
    main = pm.program_cache.main_key.portable()
    modes = tuple((path, True) for path, _ in main.modes)
    out = []
    for m in range(1, min(pm.micro_batches, 8) + 1):
        key = CallKey(m, type(main.modes)(modes), main.none_args, main.flags)
        try:
            out.append((key, pm.recipe.one_f_one_b_step(pm, key).program))
        except Exception as e:  # noqa: BLE001 - the loaded module then refuses that call as the original does
            log.info("export: no 1F1B step for %s (%s)", key.describe(), e)
    return out


def _meta_tensors(program: fx.GraphModule) -> dict[str, dict[str, Any]]:
    """The tensors a tensor-parallel stage's program reads (meta tensors, unsharded: for reading)."""
    from dpcompile.export.common import dtype_name

    out = {}
    for node in program.graph.nodes:
        if node.op == "get_attr":
            t = _attr(program, str(node.target))
            if not isinstance(t, torch.Tensor):  # a module the program reads (an RNN to flatten_parameters)
                continue
            out[str(node.target)] = {"shape": list(t.shape), "dtype": dtype_name(t.dtype),
                                     "parameter": isinstance(t, nn.Parameter), "requires_grad": bool(t.requires_grad)}  # fmt: skip
    return out


# -------------------------------------------------------------------------------- load
def checked_section(section: Any, kind: str) -> dict[str, Any]:
    """``config.pipeline`` of a folder, its shape checked (values are checked where used)."""
    if kind not in PIPELINE_KINDS:
        if section is not None:
            raise ExportError(f"{PROGRAM_FILE}: a {kind} program with a pipeline section")
        return {}
    if not isinstance(section, dict) or set(section) != _SECTION:
        raise ExportError(f"{PROGRAM_FILE}: a pipeline section it cannot read")
    micro, plan, stages = section["micro_batches"], section["stage_plan"], section["stages"]
    if type(micro) is not int or micro < 1 or section["schedule"] not in ("gpipe", "1f1b"):
        raise ExportError(f"{PROGRAM_FILE}: micro_batches {micro!r:.20}, schedule {section['schedule']!r:.20}")
    if not isinstance(plan, dict) or set(plan) != _PLAN or type(plan["stages"]) is not int or plan["stages"] < 1:
        raise ExportError(f"{PROGRAM_FILE}: a stage plan it cannot read")
    if not isinstance(stages, list) or len(stages) != plan["stages"]:
        raise ExportError(f"{PROGRAM_FILE}: {plan['stages']} stages planned, {len(stages) if isinstance(stages, list) else stages!r:.20} described")
    if not _plan_fields_fit(plan):
        raise ExportError(f"{PROGRAM_FILE}: a stage plan whose starts, weights, sizes or module paths do not fit its {plan['stages']} stages")
    for i, stage in enumerate(stages):
        if not isinstance(stage, dict) or set(stage) != _STAGE_FIELDS or stage["index"] != i or not _stage_fields_fit(stage):
            raise ExportError(f"{PROGRAM_FILE}: stage {i} is described as {stage!r:.80}")
    stage_of = plan["stage_of"]
    if not isinstance(stage_of, dict) or not all(type(v) is int and 0 <= v < plan["stages"] for v in stage_of.values()):
        raise ExportError(f"{PROGRAM_FILE}: the stage plan names a stage that is not there")
    node_stages = section["node_stages"]
    if not isinstance(node_stages, dict) or not all(
        isinstance(m, dict) and all(type(v) is int and 0 <= v < plan["stages"] for v in m.values()) for m in node_stages.values()
    ):
        raise ExportError(f"{PROGRAM_FILE}: node stages it cannot read")
    groups, slots = section["stage_groups"], section["shard_slots"]
    if (groups is None) is not (kind == "pipeline") or (slots is None) is not (kind == "pipeline"):
        raise ExportError(f"{PROGRAM_FILE}: a {kind} program's stage groups and shard slots")
    return section


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is str for v in value)


def _counts(value: Any, length: int) -> bool:
    return isinstance(value, list) and len(value) == length and all(type(v) is int and v >= 0 for v in value)


def _plan_fields_fit(plan: dict[str, Any]) -> bool:
    """The stage plan's fields as ``describe_pipeline`` writes them: one entry per stage."""
    stages = plan["stages"]
    return (
        _strings(plan["starts"]) and len(plan["starts"]) == stages
        and _counts(plan["weights"], stages) and _counts(plan["param_bytes"], stages)
        and isinstance(plan["module_paths"], list) and len(plan["module_paths"]) == stages
        and all(_strings(paths) for paths in plan["module_paths"])
        and type(plan["measure"]) is str and isinstance(plan["sent"], list) and all(_strings(v) for v in plan["sent"])
    )  # fmt: skip


def _stage_fields_fit(stage: dict[str, Any]) -> bool:
    return type(stage["device"]) is str and _strings(stage["module_paths"]) and _counts([stage["flops"], stage["param_bytes"]], 2)


def stage_graphs(section: dict[str, Any], tree: Any) -> list[tuple[str, fx.Graph]]:
    """Each stage's program decoded (every target checked), by its method in module.py."""
    from dpcompile.export.serialize import decode_graph

    out = []
    for i, stage in enumerate(section.get("stages", ())):
        index = tree
        if stage["meta"] is not None:  # a tensor-parallel stage reads the unsharded weights, on meta
            if not isinstance(stage["meta"], dict):
                raise ExportError(f"{PROGRAM_FILE}: stage {i}'s meta tensors")
            index = copy.copy(tree)
            index.tensors = set(tree.tensors) | {str(p) for p in stage["meta"]}
        out.append((stage_label(i), decode_graph(stage["graph"], index)))
    return out


def step_graphs(section: dict[str, Any], tree: Any) -> list[tuple[Any, str, fx.Graph]]:
    """Each carried 1F1B step's ``(call key, method in module.py, program)``, decoded (checked)."""
    from dpcompile.export.serialize import decode_graph
    from dpcompile.export.variants import decode_key

    steps = section.get("steps", [])
    if not isinstance(steps, list) or not all(isinstance(e, dict) and set(e) == {"key", "graph"} for e in steps):
        raise ExportError(f"{PROGRAM_FILE}: 1F1B steps it cannot read")
    out = [(decode_key(e["key"]), e["graph"]) for e in steps]
    labels = [_step_label(key) for key, _ in out]
    if len(set(labels)) != len(labels):
        raise ExportError(f"{PROGRAM_FILE}: two 1F1B steps for one micro-batch count")
    return [(key, label, decode_graph(graph, tree)) for (key, graph), label in zip(out, labels)]


def attach_steps(pm: nn.Module, section: dict[str, Any], steps: Sequence[tuple[Any, str, fx.Graph]]) -> None:
    """The carried 1F1B steps, ready for the calls they serve (what ``run_program`` would build)."""
    from dpcompile.modules.pipeline_1f1b import OneFOneBStep

    stamp_stages(section, [(label, graph) for _, label, graph in steps])
    built = pm.__dict__.setdefault("one_f_one_b_steps", {})
    for key, _, graph in steps:
        program = fx.GraphModule(pm, graph, f"OneFOneB{key.devices}")
        built[key] = OneFOneBStep(program, len(pm.stages), key.devices)


def _stage_root(stage: dict[str, Any], holder: nn.Module, graph: fx.Graph) -> dict[str, Any]:
    """What a stage's program reads: the loaded modules it calls, and (tensor-parallel stages)
    its unsharded weights as meta tensors of the recorded shapes."""
    import torch

    meta = stage["meta"] or {}
    root: dict[str, Any] = {}
    for node in graph.nodes:
        target = str(node.target)
        if node.op == "call_module" or (node.op == "get_attr" and target not in meta):
            root[target] = holder.get_submodule(target) if node.op == "call_module" else _attr(holder, target)
        elif node.op == "get_attr":
            info = meta[target]
            dtype = getattr(torch, str(info["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ExportError(f"{PROGRAM_FILE}: stage meta tensor {target!r:.60} of dtype {info['dtype']!r:.20}")
            shape = tuple(int(d) for d in info["shape"])
            held = _held_tensor(holder, target)
            if held is not None and tuple(held.shape) == shape and held.dtype == dtype:
                # the loaded module's own (a whole weight read beside its module's call, `emb.weight.dtype`): a meta
                # stand-in would be set on that module, which the stage shares with the program that runs
                root[target] = held
                continue
            t = torch.empty(shape, dtype=dtype, device="meta")
            root[target] = nn.Parameter(t, requires_grad=bool(info["requires_grad"])) if info["parameter"] else t
    return root


def _held_tensor(holder: nn.Module, path: str) -> Any:
    try:
        t = _attr(holder, path)
    except AttributeError:
        return None
    return t if isinstance(t, torch.Tensor) else None


def _attr(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def stamp_stages(section: dict[str, Any], programs: Sequence[tuple[str, fx.Graph | None]]) -> None:
    """Each lowered program's nodes stamped with their stage, as ``transform`` left them."""
    recorded = section["node_stages"]
    for label, graph in programs:
        if graph is None:
            continue
        stages = recorded.get(label, {})
        names = {n.name: n for n in graph.nodes}
        if not set(stages) <= set(names):
            raise ExportError(f"{PROGRAM_FILE}: node stages of {label} name nodes the program lacks")
        for name, stage in stages.items():
            names[name].meta[_STAGE] = stage


def pipeline_extra(
    section: dict[str, Any], holder: nn.Module, stages: Sequence[tuple[str, fx.Graph]], target: Any
) -> dict[str, Any]:
    """What ``modules/executors.py: restore_executor`` reads: the stages (their programs over the
    loaded modules), micro-batches, schedule and plan (and tensor-parallel stages' groups)."""
    from dpcompile.modules.pipeline import Stage
    from passes.split_stages import StagePlan

    plan = section["stage_plan"]
    placed = {str(d) for d in target}  # a tensor-parallel stage's device names its group: "cpu,cpu"
    placed |= {",".join(map(str, g)) for g in section["stage_groups"] or () if isinstance(g, list)}
    if any(s["device"] not in placed for s in section["stages"]):
        raise ExportError(f"{PROGRAM_FILE}: stages on {[s['device'] for s in section['stages']]!r:.80}, not on the program's devices")
    try:
        stage_plan = StagePlan(
            stages=plan["stages"],
            stage_of={str(k): int(v) for k, v in plan["stage_of"].items()},
            starts=tuple(str(s) for s in plan["starts"]),
            weights=tuple(int(w) for w in plan["weights"]),
            param_bytes=tuple(int(b) for b in plan["param_bytes"]),
            module_paths=tuple(tuple(str(p) for p in paths) for paths in plan["module_paths"]),
            measure=str(plan["measure"]),
            sent=tuple(tuple(str(v) for v in values) for values in plan["sent"]),
        )
        built = [
            Stage(
                s["index"],
                str(s["device"]),
                tuple(str(p) for p in s["module_paths"]),
                int(s["flops"]),
                int(s["param_bytes"]),
                fx.GraphModule(_stage_root(s, holder, graph), graph, f"Stage{s['index']}"),
            )
            for s, (_, graph) in zip(section["stages"], stages, strict=True)
        ]
    except (TypeError, ValueError, AttributeError) as e:
        raise ExportError(f"{PROGRAM_FILE}: a pipeline it cannot rebuild ({e!r:.80})") from None
    extra: dict[str, Any] = {
        "pipeline": {
            "stages": built,
            "micro_batches": section["micro_batches"],
            "schedule": section["schedule"],
            "stage_plan": stage_plan,
        }
    }
    if section["stage_groups"] is not None:
        groups = [tuple(str(d) for d in g) for g in section["stage_groups"]]
        if sum(len(g) for g in groups) != len(target):
            raise ExportError(f"{PROGRAM_FILE}: stage groups {section['stage_groups']!r:.60} are not the program's devices")
        slots = {str(k): int(v) for k, v in section["shard_slots"].items()}
        if not all(0 <= v < len(target) for v in slots.values()):
            raise ExportError(f"{PROGRAM_FILE}: a shard slot outside the devices")
        extra["stage_groups"] = {"stage_groups": groups, "shard_param_slots": slots}
    return extra
