"""Building a loaded module from checked parts: the module tree, the graphs, the settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.export.common import MODULE_FILE, PROGRAM_FILE, ExportError, _strings
from dpcompile.export.source import program_source

__all__ = ["build", "place"]


def _expected_class(kind: str) -> type:
    from dpcompile.module import ParallelModule
    from dpcompile.tensor_parallel import TensorParallelModule

    return TensorParallelModule if kind == "tensor_parallel" else ParallelModule


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


def build(folder: Path, program: dict[str, Any], tensors: dict[str, torch.Tensor], target: Any) -> nn.Module:
    from dpcompile.export.loaded import LoadedParallelModule, LoadedTensorParallelModule, VariantTable, sibling
    from dpcompile.export.serialize import decode_graph, decode_tree

    config = program["config"]
    recorded = list(config["devices"])
    trees = program["modules"]
    if not isinstance(trees, list):
        raise ExportError(f"{folder / PROGRAM_FILE}: no module tree")
    paths = {e["path"] for e in trees if isinstance(e, dict) and isinstance(e.get("path"), str)}
    entries = program["programs"]
    if not isinstance(entries, list) or not entries:
        raise ExportError(f"{folder / PROGRAM_FILE}: no programs")
    graphs: list[tuple[str, fx.Graph, fx.Graph | None]] = []
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"label", "graph", "captured"} or not str(entry["label"]).isidentifier():
            raise ExportError(f"{folder / PROGRAM_FILE}: a program entry it cannot read")
        captured = decode_graph(entry["captured"], paths) if entry["captured"] is not None else None
        graphs.append((entry["label"], decode_graph(entry["graph"], paths), captured))
    source = program_source(
        [(label, graph) for label, graph, _ in graphs], class_name=program["class_name"], mode=program["kind"], devices=recorded
    )
    if source.encode() != (folder / MODULE_FILE).read_bytes():
        raise ExportError(
            f"{folder / MODULE_FILE} is not the program in {PROGRAM_FILE} (regenerated, it differs); "
            "the folder was edited: re-export"
        )
    # only now, with every file and the program checked, is anything built
    holder, modules, outside = decode_tree(trees, tensors)
    table = VariantTable.from_json(program["variants"], len(graphs))
    input_dims = _checked_dims(config["input_dims"])
    plan = config["plan"]
    if not isinstance(plan, dict) or not all(isinstance(k, str) and v in ("column", "row", "replicate") for k, v in plan.items()):
        raise ExportError(f"{folder / PROGRAM_FILE}: plan {plan!r:.60}")
    old_out = str(config["output_device"])
    output_device = target[recorded.index(old_out)] if old_out in recorded and recorded.index(old_out) < len(target) else target.primary
    moved = _strings(target) != recorded
    for path in outside:
        holder._modules[path] = outside[path]
    if program["kind"] == "data_parallel":
        from dpcompile.api import data_parallel_lowering

        lower = data_parallel_lowering(input_dims, output_device)
        built = []
        for _, graph, captured in graphs:
            root: nn.Module = holder
            if moved:
                if captured is None:
                    raise ExportError(f"{folder} holds no captured program to regenerate for {_strings(target)}")
                root = lower(fx.GraphModule(holder, _copy(captured), "Retargeted"), target)
                graph = root.graph
            built.append((root, graph, captured))
        root, graph, captured = built[0]
        pm = LoadedParallelModule(
            root, graph, devices=target, mode="data_parallel", input_dims=input_dims, output_device=output_device,
            plan=plan, captured_graph=captured, lower=lower if captured is not None else None,
            class_name=program["class_name"], share_all_of=holder,
        )  # fmt: skip
        siblings = {i: sibling(pm, _own(g, r, holder), c) for i, (r, g, c) in enumerate(built) if i}
    else:
        tp = config["tensor_parallel"]
        mapping = _device_mapping(recorded, target) if moved else {}
        for _, graph, _ in graphs:
            _map_devices(graph, mapping)
        pm = LoadedTensorParallelModule(
            holder, graphs[0][1], devices=target, mode="tensor_parallel", output_device=output_device, plan=plan,
            class_name=program["class_name"], share_all_of=holder,
        )  # fmt: skip
        _init_tp(pm, tp)
        siblings = {i: sibling(pm, graph, None) for i, (_, graph, _) in enumerate(graphs) if i}
    for path in outside:
        pm._modules.pop(path, None)
        object.__setattr__(pm, path, outside[path])
    pm._attach_variants(table, siblings)
    pm.training = bool(program["training"])
    return pm


def _own(graph: fx.Graph, root: nn.Module, holder: nn.Module) -> fx.Graph:
    return graph if root is holder else _copy(graph)


def _copy(graph: fx.Graph) -> fx.Graph:
    from dpcompile.module import copy_graph

    return copy_graph(graph)


def _checked_dims(dims: Any) -> dict[str, int | None]:
    if not isinstance(dims, dict) or not all(isinstance(k, str) and (v is None or type(v) is int) for k, v in dims.items()):
        raise ExportError(f"{PROGRAM_FILE}: input_dims {dims!r:.60}")
    return dict(dims)


def _init_tp(pm: nn.Module, tp: Any) -> None:
    from dpcompile.analysis.cost import CommCost
    from dpcompile.runtime.tensor_parallel import ShardSpec

    try:
        shards = {
            str(k): (ShardSpec(int(v["dim"]), tuple(int(s) for s in v["sizes"])), [str(n) for n in v["names"]])
            for k, v in tp["param_shards"].items()
        }
        cost = None if tp["comm_cost"] is None else CommCost(float(tp["comm_cost"][0]), float(tp["comm_cost"][1]))
        state_keys = [str(k) for k in tp["state_keys"]]
        reasons = {str(k): str(v) for k, v in tp["plan_reasons"].items()}
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{PROGRAM_FILE}: tensor-parallel settings it cannot read ({e!r:.60})") from None
    own = dict(pm.named_parameters())
    for key, (spec, names) in shards.items():
        if len(names) != len(spec.sizes) or any(n not in own for n in names):
            raise ExportError(f"{PROGRAM_FILE}: shards of {key!r} name parameters the module lacks")
    pm._init_tensor_parallel(state_keys=state_keys, param_shards=shards, plan_reasons=reasons, comm_cost=cost)
    attach = getattr(pm, "_attach_source", None)
    if callable(attach):
        attach(None, ())


def _device_mapping(recorded: list[str], target: Any) -> dict[str, str]:
    new = _strings(target)
    if len(set(recorded)) != len(recorded) and len(set(new)) != len(new):
        return {}
    if len(set(recorded)) != len(recorded):
        raise ExportError(
            f"a tensor-parallel program exported for virtual devices {recorded} cannot be moved to {new}; "
            "transform the model again for those devices"
        )
    return dict(zip(recorded, new))


def _map_devices(graph: fx.Graph, mapping: dict[str, str]) -> None:
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
