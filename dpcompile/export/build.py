"""Building a loaded module from checked parts: the module tree, the graphs, the settings."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.export.common import MODULE_FILE, PROGRAM_FILE, ExportError, device_strings, readable_mode, runs_stages
from dpcompile.export.pipeline import (
    PIPELINE_KINDS,
    attach_steps,
    checked_section,
    pipeline_extra,
    stage_graphs,
    stamp_stages,
    step_graphs,
)
from dpcompile.export.source import program_source
from dpcompile.fx_utils import copy_graph, propagate_example_shapes

__all__ = ["SHARDED_KINDS", "build", "is_recorded_kind", "place", "readable_programs"]

_STYLES = ("column", "row", "replicate", "vocab")  # tensor-parallel styles a plan records


#: the kinds whose program stores parameters as pieces (its sharded state, ``pm.param_shards``)
SHARDED_KINDS = ("tensor_parallel", "pipeline_tensor_parallel")


def is_recorded_kind(pm: Any, kind: str) -> bool:
    """Whether ``pm`` is a program of ``kind``: a ``ParallelModule`` of that mode, run by a pipeline's
    schedule exactly where the kind is a pipeline, holding a sharded state exactly where the kind shards."""
    from dpcompile.modules.base import ParallelModule

    if not isinstance(pm, ParallelModule) or pm.mode != kind:
        return False
    return runs_stages(pm) == (kind in PIPELINE_KINDS) and ("param_shards" in pm.__dict__) == (kind in SHARDED_KINDS)


def place(weights: dict[str, torch.Tensor], info: dict[str, dict[str, Any]], target: Any) -> dict[str, torch.Tensor]:
    """Each saved tensor on its device among ``target`` (slot k → ``target[k]``), a Parameter where it was one."""
    placed: dict[str, torch.Tensor] = {}
    for key, tensor in weights.items():
        meta = info[key]
        slot = meta["slot"]
        device = target[slot] if isinstance(slot, int) and slot < len(target) else target.primary
        t = tensor.to(device)
        placed[key] = nn.Parameter(t, requires_grad=meta["requires_grad"]) if meta["parameter"] else t
    return placed


def readable_programs(data: Any, tree: Any) -> list[tuple[str, fx.Graph]]:
    """The graphs ``module.py`` shows, decoded (every target checked): every graph of the
    program section. ``forward`` (the main program), one ``forward_<variant>`` per other program
    carried, and, data parallel, ``captured`` (the main one before lowering) and one
    ``traced_<variant>`` per variant before lowering: what a smaller batch or other devices
    lower again. A graph of ``program.json`` that is not here could run unread."""
    from dpcompile.export.serialize import decode_graph
    from dpcompile.export.source import CAPTURED, TRACED, call_label
    from dpcompile.export.variants import decode_key

    fields = {"recipe", "main_key", "signature", "graph", "captured", "variants", "traces"}
    if not isinstance(data, dict) or set(data) - {"inputs"} != fields:  # inputs: since round 4 (export frontend)
        raise ExportError(f"{PROGRAM_FILE}: a program section it cannot read")
    if not isinstance(data["variants"], list) or not isinstance(data["traces"], list):
        raise ExportError(f"{PROGRAM_FILE}: variants and traces must be lists")
    out = [("forward", decode_graph(data["graph"], tree))]
    for entry in data["variants"]:
        if not isinstance(entry, dict) or set(entry) != {"label", "key", "graph"}:
            raise ExportError(f"{PROGRAM_FILE}: a variant entry it cannot read")
        if entry["graph"] is not None:
            if not isinstance(entry["label"], str) or not entry["label"].isidentifier() or not entry["label"].startswith("forward_"):
                raise ExportError(f"{PROGRAM_FILE}: a variant labelled {entry['label']!r:.40}")
            out.append((entry["label"], decode_graph(entry["graph"], tree)))
    if data["captured"] is not None:
        out.append((CAPTURED, decode_graph(data["captured"], tree)))
    for entry in data["traces"]:
        if not isinstance(entry, dict) or set(entry) != {"key", "graph"}:
            raise ExportError(f"{PROGRAM_FILE}: a trace entry it cannot read")
        if entry["graph"] is not None:
            label = call_label(TRACED, decode_key(entry["key"]))
            taken = {name for name, _ in out}
            label = label if label not in taken else f"{label}_{len(out)}"
            out.append((label, decode_graph(entry["graph"], tree)))
    labels = [name for name, _ in out]
    if len(set(labels)) != len(labels):
        raise ExportError(f"{PROGRAM_FILE}: two programs share a method name in {MODULE_FILE}")
    return out


def build(folder: Path, program: dict[str, Any], tensors: dict[str, torch.Tensor], target: Any) -> nn.Module:
    """The module of a checked folder: graphs decoded and ``module.py`` compared first, then
    the module tree, then the module, restored as unpickling restores one whose model class
    is not at hand (``dpcompile.modules.pickling.restore_parallel_module``), carrying its programs."""
    from dpcompile.export.kinds import TreeIndex
    from dpcompile.export.serialize import decode_graph, decode_tree
    from dpcompile.export.variants import decode_inputs, decode_key, decode_recipe, decode_signature
    from dpcompile.modules.base import ParallelModule
    from dpcompile.modules.pickling import restore_parallel_module
    from dpcompile.program_cache import CallKey

    config, data, kind = program["config"], program["data"], program["kind"]
    recorded = list(config["devices"])
    trees = program["modules"]
    if not isinstance(trees, list):
        raise ExportError(f"{folder / PROGRAM_FILE}: no module tree")
    paths = TreeIndex(trees)
    section = checked_section(config.get("pipeline"), kind)
    readable = readable_programs(data, paths)
    stages = stage_graphs(section, paths)
    steps = step_graphs(section, paths)
    readable += stages + [(label, graph) for _, label, graph in steps]
    source = program_source(readable, class_name=program["class_name"], mode=readable_mode(kind, config), devices=recorded)
    if source.encode() != (folder / MODULE_FILE).read_bytes():
        raise ExportError(
            f"{folder / MODULE_FILE} is not the program in {PROGRAM_FILE} (regenerated, it differs); "
            "the folder was edited: re-export"
        )
    main_key = decode_key(data["main_key"])
    if section and section["micro_batches"] != main_key.devices:  # a pipeline keys its calls by micro-batches
        raise ExportError(f"{folder / PROGRAM_FILE}: micro_batches {section['micro_batches']} is not the main program's")
    signature = decode_signature(data["signature"])
    captured = decode_graph(data["captured"], paths) if data["captured"] is not None else None
    variants = [(decode_key(e["key"]), None if e["graph"] is None else decode_graph(e["graph"], paths)) for e in data["variants"]]
    traces = [(decode_key(e["key"]), None if e["graph"] is None else decode_graph(e["graph"], paths)) for e in data["traces"]]
    input_dims = _checked_dims(config["input_dims"])
    plan = config["plan"]
    if not isinstance(plan, dict) or not all(isinstance(k, str) and v in _STYLES for k, v in plan.items()):
        raise ExportError(f"{folder / PROGRAM_FILE}: plan {plan!r:.60}")
    old_out = str(config["output_device"])
    output_device = target[recorded.index(old_out)] if old_out in recorded and recorded.index(old_out) < len(target) else target.primary
    recipe = decode_recipe(kind, data["recipe"], target, output_device)
    graph = readable[0][1]
    extra: dict[str, Any] = {}
    moved = device_strings(target) != recorded
    # only now, with every file and the program checked, is anything built
    holder, _, outside = decode_tree(trees, tensors)
    if captured is not None:
        propagate_example_shapes(holder, captured, data["captured"].get("inputs"), target.primary)
    for (_, trace), entry in zip(traces, data["traces"]):
        if trace is not None:
            propagate_example_shapes(holder, trace, entry["graph"].get("inputs"), target.primary)
    if kind == "data_parallel" and moved:
        if captured is None:
            raise ExportError(f"{folder} holds no captured program to regenerate for {device_strings(target)}")
        lowered = {None: recipe.lower(fx.GraphModule(holder, copy_graph(captured), "Retargeted"), target, input_dims).graph}
        for key, trace in traces:
            if trace is not None:
                lowered[key] = recipe.lower(fx.GraphModule(holder, copy_graph(trace), "Retargeted"), target, input_dims).graph
        graph = lowered[None]
        n = len(target)
        main_key = CallKey(n, main_key.modes, main_key.none_args, main_key.flags)
        variants = [
            (CallKey(n, k.modes, k.none_args, k.flags), lowered.get(CallKey(0, k.modes, k.none_args, k.flags)))
            for k, _ in variants
            if CallKey(0, k.modes, k.none_args, k.flags) in lowered or CallKey(0, k.modes, k.none_args, k.flags) in dict(traces)
        ]  # a key whose trace is the main one runs the main program (None)
    elif kind in PIPELINE_KINDS:
        if moved:
            raise ExportError(
                f"a {kind} export loads on the devices it was exported for ({recorded}), not {device_strings(target)}: "
                "its stages and copies are placed on those; transform the model again for other devices"
            )
        labels = ["forward", *(e["label"] for e in data["variants"])]
        stamp_stages(section, list(zip(labels, [graph, *(g for _, g in variants)])))
        extra = pipeline_extra(section, holder, stages, target)
        if kind == "pipeline_tensor_parallel":
            extra |= _tp_extra(config["tensor_parallel"])
    elif kind == "tensor_parallel":
        mapping = device_mapping(recorded, target) if moved else {}
        for g in [graph] + [g for _, g in variants if g is not None]:
            map_devices(g, mapping)
        extra = _tp_extra(config["tensor_parallel"])
    state = {
        "modules": dict(holder._modules),
        "leaf_root": outside.get("root"),
        "parameters": dict(holder._parameters),
        "buffers": dict(holder._buffers),
        "non_persistent": set(holder._non_persistent_buffers_set),
        "training": bool(program["training"]),
        "graph": graph,
        "captured_graph": captured,
        "config": {
            "recipe": recipe,
            "devices": target,
            "mode": kind,
            "input_dims": input_dims,
            "output_device": output_device,
            "plan": plan,
            "class_name": program["class_name"],
            "shares_source": False,
        },
        "main_key": main_key,
        "programs": variants,
        "traces": [(key, None if trace is None else (trace, None)) for key, trace in traces],  # shaped above
        "extra": extra,
        "source": None,
        "exported_inputs": decode_inputs(data.get("inputs")),  # the export frontend's argument check
    }
    pm = restore_parallel_module(ParallelModule, state)
    pm.call_signature = signature  # where calls depart (none where the module never traced again)
    if kind in SHARDED_KINDS:
        _check_shards(pm)
    if steps:
        attach_steps(pm, section, steps)
    if "layout" in config:  # checked by check_program; a data-parallel program loaded on other devices: over those
        layout, loaded_on = {str(k): int(n) for k, n in config["layout"]}, len(device_strings(target))
        moved_dp = kind == "data_parallel" and loaded_on != math.prod(layout.values())
        pm.layout = {"dp": loaded_on} if moved_dp else layout
        pm.strategies = {k: v for k, v in config["strategies"].items() if k in pm.layout or not moved_dp}
    return pm


def _checked_dims(dims: Any) -> dict[str, int | None]:
    if not isinstance(dims, dict) or not all(isinstance(k, str) and (v is None or type(v) is int) for k, v in dims.items()):
        raise ExportError(f"{PROGRAM_FILE}: input_dims {dims!r:.60}")
    return dict(dims)


def _tp_extra(tp: Any) -> dict[str, Any]:
    from dpcompile.analysis.cost import CommCost
    from dpcompile.runtime.tensor_parallel import ShardSpec

    try:
        shards = {
            # a fused qkv's sections (q, k, v), without which its shards read as one block: 1 in older exports
            str(k): (ShardSpec(int(v["dim"]), tuple(int(s) for s in v["sizes"]), int(v.get("sections", 1))),
                     [str(n) for n in v["names"]])
            for k, v in tp["param_shards"].items()
        }
        cost = None if tp["comm_cost"] is None else CommCost(float(tp["comm_cost"][0]), float(tp["comm_cost"][1]))
        return {
            "state_keys": [str(k) for k in tp["state_keys"]],
            "param_shards": shards,
            "plan_reasons": {str(k): str(v) for k, v in tp["plan_reasons"].items()},
            "comm_cost": cost,
            "captured_code": str(tp["captured_code"]),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{PROGRAM_FILE}: tensor-parallel settings it cannot read ({e!r:.60})") from None


def _check_shards(pm: nn.Module) -> None:
    own = dict(pm.named_parameters(remove_duplicate=False))  # a tied shard is named at both paths
    for key, (spec, names) in pm.param_shards.items():
        if len(names) != len(spec.sizes) or any(n not in own for n in names):
            raise ExportError(f"{PROGRAM_FILE}: shards of {key!r} name parameters the module lacks")
        for k, name in enumerate(names):
            if own[name].size(spec.dim) != spec.sizes[k]:
                raise ExportError(f"{PROGRAM_FILE}: shard {k} of {key!r} is not {spec.sizes[k]} along dim {spec.dim}")


def device_mapping(recorded: list[str], target: Any) -> dict[str, str]:
    new = device_strings(target)
    if len(set(recorded)) != len(recorded) and len(set(new)) != len(new):
        return {}
    if len(set(recorded)) != len(recorded):
        raise ExportError(
            f"a tensor-parallel program exported for virtual devices {recorded} cannot be moved to {new}; "
            "transform the model again for those devices"
        )
    return dict(zip(recorded, new))


def map_devices(graph: fx.Graph, mapping: dict[str, str]) -> None:
    if not mapping:
        return

    def swap(leaf: Any) -> Any:
        if isinstance(leaf, str) and leaf in mapping:
            return mapping[leaf]
        if isinstance(leaf, torch.device) and str(leaf) in mapping:
            return torch.device(mapping[str(leaf)])
        return leaf

    for node in graph.nodes:
        node.args = fx.node.map_aggregate(node.args, swap)
        node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
