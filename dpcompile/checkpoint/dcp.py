"""``format="dcp"``: training checkpoints as ``torch.distributed.checkpoint`` folders.

The keys are those plain torch saves with ``dcp.save({"model": model.state_dict(), "optimizer":
get_optimizer_state_dict(model, opt)})``: ``model.<key>`` (every key, tied ones too),
``optimizer.state.<model key>.<state name>`` (each state tensor in its parameter's whole layout),
``optimizer.param_groups.<g>.<hyper-parameter>`` and ``.params`` (the model keys), and
``dpcompile_training_state`` (the JSON of ``training_state.json``: the optimizer's kind, the
scheduler, the RNG, ``extra``). Each process writes and reads only the blocks it holds
(:mod:`dpcompile.checkpoint.dcp_planners`; a pipeline's stage over a mesh: its stage's, every key
listed, :mod:`dpcompile.checkpoint.stages`); a load reads a checkpoint of plain torch too (the
model's keys under ``model.`` or at the top, the optimizer's by model key), into any layout.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from dpcompile.checkpoint import dcp_planners
from dpcompile.checkpoint.buffers import compute_buffers
from dpcompile.checkpoint.dcp_reader import METADATA, CheckedReader, read_dcp_metadata
from dpcompile.checkpoint.dtensors import check_peers, is_dtensor, ranks_of
from dpcompile.checkpoint.files import StagedFiles
from dpcompile.checkpoint.headers import DTYPES, CheckpointError, Entry, parse_json
from dpcompile.checkpoint.optimizer_state import LIKE_PARAM, STATE_PREFIX, WHOLE, Place, local_blocks
from dpcompile.checkpoint.rank_writes import Block, piece_blocks, target_blocks
from dpcompile.checkpoint.targets import targets_of, tie_groups, unset_buffers
from dpcompile.checkpoint.training import TrainingLoad, TrainingSave, encode, training_from_document
from dpcompile.errors import ArgumentError
from dpcompile.modules.weights import NEEDS_WEIGHTS, UNSET_BUFFERS, WEIGHTS_SOURCE, unset_keys, weights_partly_loaded

TRAINING_KEY = "dpcompile_training_state"
GROUPS = "optimizer.param_groups."


def is_dcp(path: Path) -> bool:
    """A folder holding a ``torch.distributed.checkpoint`` (its ``.metadata``)."""
    return path.is_dir() and (path / METADATA).is_file()


def check_dcp_target(path: Path) -> None:
    """Refuse, before anything is written, a ``path`` a DCP save would replace but that is not one."""
    if path.suffix == ".safetensors":
        raise ArgumentError(f"{path}: format='dcp' writes a folder; pass a folder path")
    if path.exists() and not is_dcp(path) and (not path.is_dir() or any(path.iterdir())):
        raise ArgumentError(
            f"{path} exists and is not a torch.distributed.checkpoint folder: format='dcp' replaces the whole folder, "
            "so pass a new folder (or one a format='dcp' save wrote)"
        )


def save_dcp(pm: Any, path: Path, training: TrainingSave | None) -> None:
    """Write ``pm``'s weights (and the training state) as a DCP checkpoint at ``path``: staged in a
    folder beside it and switched in once every rank has written."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    over, group = ranks_of(pm)
    flat, paths = _flat_state(pm, training)
    token = [StagedFiles().token]
    if over:
        check_peers(pm)
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    leader = not over or dist.get_rank(group) == 0
    staging = path.parent / f".{path.name}.{token[0]}.tmp"
    try:
        if leader:
            staging.mkdir(parents=True)
        if over:
            check_peers(pm)
        writer = dcp.FileSystemWriter(str(staging), thread_count=1)
        dcp.save(flat, storage_writer=writer, planner=dcp_planners.PiecesSavePlanner(paths), process_group=group, no_dist=not over)
        if leader:
            _switch_folder(staging, path, token[0])
    except BaseException:
        if leader:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _switch_folder(staging: Path, path: Path, token: str) -> None:
    """``staging`` becomes ``path``; a previous checkpoint there is moved aside first and removed after."""
    old = path.parent / f".{path.name}.{token}.old"
    moved = path.exists()
    if moved:
        os.replace(path, old)
    try:
        os.replace(staging, path)
    except BaseException:
        if moved:  # the previous checkpoint back in place, never left aside
            os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _flat_state(pm: Any, training: TrainingSave | None) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """``({fqn: Pieces or value}, {fqn: its place in the nested state dict})`` as plain torch flattens it."""
    targets = targets_of(pm)
    flat: dict[str, Any] = {}
    paths: dict[str, tuple[Any, ...]] = {}
    for key, target in targets.items():
        flat[f"model.{key}"] = dcp_planners.Pieces(target.shape, target.dtype, lambda t=target: target_blocks(t))
        paths[f"model.{key}"] = ("model", key)
    if training is None:
        return flat, paths
    if training.optimizer is not None:
        saved = training.optimizer
        for fqn, (shape, dtype, make) in saved.tensors.items():
            key, name = fqn[len(STATE_PREFIX) :].rsplit(".", 1)
            blocks = saved.local.get(fqn) or (lambda s=shape, m=make: piece_blocks(s, None, 0, m()))
            flat[fqn], paths[fqn] = dcp_planners.Pieces(tuple(shape), dtype, blocks), ("optimizer", "state", key, name)
        for key, kinds in saved.meta["state"].items():
            for name, kind in kinds.items():
                if isinstance(kind, dict):
                    flat[f"{STATE_PREFIX}{key}.{name}"] = kind["value"]
                    paths[f"{STATE_PREFIX}{key}.{name}"] = ("optimizer", "state", key, name)
        order = {k: i for i, k in enumerate(targets)}
        for g, group in enumerate(saved.meta["groups"]):
            for hyper, value in [*group["hyper"].items(), ("params", sorted(group["params"], key=order.__getitem__))]:
                flat[f"{GROUPS}{g}.{hyper}"], paths[f"{GROUPS}{g}.{hyper}"] = value, ("optimizer", "param_groups", g, hyper)
    flat[TRAINING_KEY], paths[TRAINING_KEY] = json.dumps(training.document), (TRAINING_KEY,)
    return flat, paths


def load_dcp(pm: Any, path: Path, optimizer: Any, lr_scheduler: Any, strict: bool) -> Any:
    """Fill ``pm`` (and ``optimizer``, ``lr_scheduler``) from the DCP checkpoint at ``path``; each
    process reads only the chunks overlapping its blocks. Everything is checked first."""
    import torch.distributed.checkpoint as dcp

    try:
        stored = read_dcp_metadata(path).state_dict_metadata  # unpickled from DCP's own classes only, checked
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - torch's own errors name no file
        raise CheckpointError(f"{path} cannot be read as a torch.distributed.checkpoint ({type(e).__name__}: {e})",
                              file=path) from None  # fmt: skip
    targets = targets_of(pm)
    ties = tie_groups(targets)
    prefix = "model." if any(k.startswith("model.") for k in stored) else ""
    placed, missing = {}, []
    for key in (k for k in targets if ties[k][0] == k):
        fqn = next((prefix + t for t in ties[key] if prefix + t in stored), None)
        if fqn is None:
            missing.append(key)
        else:
            placed[key] = fqn
    theirs = [k[len(prefix) :] for k in stored if k.startswith(prefix) and not _other(k)]
    unexpected = [k for k in theirs if k not in targets]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"the checkpoint {path} does not match the model (nothing was loaded): missing {missing[:10]}, "
            f"unexpected {unexpected[:10]}; keys are the model's state_dict keys (under 'model.' or at the top); "
            "pass strict=False to load the keys both have",
            file=path, key=(missing or unexpected)[0],
        )  # fmt: skip
    still_unset = unset_keys(pm, missing)  # built on meta: what neither this load nor an earlier one filled
    for key, fqn in placed.items():
        _check_tensor(path, fqn, stored[fqn], targets[key].shape, targets[key].dtype)
    for key in placed:  # tied keys held twice (torch's dcp.save of a state_dict writes both): the same values
        _check_tie(path, [prefix + t for t in ties[key] if prefix + t in stored], stored, targets[key].dtype)
    requests: dict[str, Any] = {
        fqn: dcp_planners.Pieces(targets[key].shape, targets[key].dtype, lambda t=targets[key]: target_blocks(t))
        for key, fqn in placed.items()
    }
    buffers = unset_buffers(pm, list(pm.__dict__.get(UNSET_BUFFERS, [])))
    for name, buffer in buffers.items():
        if prefix + name in stored:
            _check_tensor(path, prefix + name, stored[prefix + name], tuple(buffer.shape), buffer.dtype)
            requests[prefix + name] = dcp_planners.Pieces(tuple(buffer.shape), buffer.dtype, lambda b=buffer: piece_blocks(b.shape, None, 0, b))
    to_compute = [n for n in buffers if prefix + n not in stored]
    computed = compute_buffers(pm.__dict__[WEIGHTS_SOURCE], to_compute) if to_compute else {}
    training = _training(pm, path, stored, optimizer, lr_scheduler, strict, requests)
    reader = CheckedReader(path)
    try:  # everything checked: from here on, write (each item read is checked whole first)
        dcp.load(requests, storage_reader=reader, planner=dcp_planners.PiecesLoadPlanner(), no_dist=True)
        with torch.no_grad():
            for name, value in computed.items():
                buffers[name].copy_(value)
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        if reader.refused is not None:  # refused before the first write: nothing changed
            raise reader.refused from None
        pm.__dict__[NEEDS_WEIGHTS] = True  # partly written: the program must not run on it
        raise CheckpointError(
            f"reading {path} failed after its metadata was checked ({type(e).__name__}: {e}); the program is partly "
            "written and waits for a load again", file=path,
        ) from e  # fmt: skip
    training.finish(pm)
    if still_unset:  # strict=False on a program built on meta: it waits for them (pm.needs_weights)
        weights_partly_loaded(pm, still_unset)
    return pm


def _check_tie(path: Path, fqns: list[str], stored: Any, dtype: torch.dtype) -> None:
    """Refuse tied keys (one tensor in the model) that the checkpoint holds with different values: only
    one could be loaded (each read whole, once, before anything is written)."""
    import torch.distributed.checkpoint as dcp

    if len(fqns) < 2:
        return
    for fqn in fqns:
        _check_tensor(path, fqn, stored[fqn], tuple(stored[fqns[0]].size), dtype)
    values = {fqn: torch.empty(tuple(stored[fqn].size), dtype=dtype) for fqn in fqns}
    dcp.load(values, storage_reader=CheckedReader(path), no_dist=True)
    for fqn in fqns[1:]:
        if not torch.equal(values[fqns[0]], values[fqn]):
            raise CheckpointError(
                f"{path}: '{fqns[0]}' and '{fqn}' fill keys the model ties (one tensor), but hold different values "
                "(nothing was loaded): remove one of them, or make them equal", file=path, key=fqn,
            )  # fmt: skip


def _other(fqn: str) -> bool:
    return fqn.startswith(("optimizer.", TRAINING_KEY))


def _check_tensor(path: Path, fqn: str, md: Any, shape: Any, dtype: torch.dtype) -> None:
    size = getattr(md, "size", None)
    if size is None:
        raise CheckpointError(f"'{fqn}' of {path} is not a tensor", file=path, key=fqn)
    if tuple(size) != tuple(shape):
        raise CheckpointError(f"'{fqn}': checkpoint {list(size)}, model {list(shape)} (nothing was loaded)",
                              file=path, key=fqn)  # fmt: skip
    saved = md.properties.dtype
    if saved.is_floating_point != dtype.is_floating_point or (saved == torch.bool) != (dtype == torch.bool):
        raise CheckpointError(f"'{fqn}': checkpoint {saved}, model {dtype} (nothing was loaded)", file=path, key=fqn)


def _training(pm: Any, path: Path, stored: Any, optimizer: Any, lr_scheduler: Any, strict: bool,
              requests: dict[str, Any]) -> TrainingLoad:  # fmt: skip
    """The training state to set, checked; the optimizer's tensors join ``requests``."""
    if optimizer is None and lr_scheduler is None:
        return TrainingLoad(None, None, lambda: None, None)
    small = [k for k in stored if k == TRAINING_KEY or (k.startswith(("optimizer.", GROUPS)) and _is_bytes(stored[k]))]
    values = _read_values(path, small)
    file = path / METADATA
    source = _Source(path, stored, requests)
    document = _document(file, values[TRAINING_KEY]) if TRAINING_KEY in values else _plain_document(stored, values, {k: t.shape for k, t in targets_of(pm).items()})
    return training_from_document(pm, document, file, optimizer, lr_scheduler,
                                  lambda meta: _loaded(pm, optimizer, meta, strict, source))  # fmt: skip


def _document(file: Path, text: Any) -> dict[str, Any]:
    """The training state's JSON a DCP save stored beside the tensors, checked as ``training_state.json`` is."""
    document = parse_json(text, file, f"its '{TRAINING_KEY}' item") if isinstance(text, str) else None
    if not isinstance(document, dict):
        raise CheckpointError(f"{file}: its '{TRAINING_KEY}' item is not the JSON object of a training state", file=file)
    return document


def _loaded(pm: Any, optimizer: Any, meta: dict[str, Any], strict: bool, source: Any) -> dict[str, Any]:
    from dpcompile.checkpoint.optimizer_state import loaded_state

    return loaded_state(pm, optimizer, meta, None, strict, source=source)


def _plain_document(stored: Any, values: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The training state of a checkpoint plain torch saved: the optimizer's groups and the kind of
    each state (laid out as its parameter where it has the parameter's shape; the optimizer's
    kind is not saved, so not checked); no scheduler, no RNG."""
    groups: dict[int, dict[str, Any]] = {}
    for fqn, value in values.items():
        if fqn.startswith(GROUPS):
            g, hyper = fqn[len(GROUPS) :].split(".", 1)
            groups.setdefault(int(g), {"hyper": {}, "params": []})
            if hyper == "params":
                groups[int(g)]["params"] = list(value)
            else:
                groups[int(g)]["hyper"][hyper] = value
    state: dict[str, dict[str, Any]] = {}
    for fqn, md in stored.items():
        if fqn.startswith(STATE_PREFIX):
            key, name = fqn[len(STATE_PREFIX) :].rsplit(".", 1)
            if _is_bytes(md):
                kind: Any = {"value": values[fqn]}
            else:
                kind = LIKE_PARAM if tuple(md.size) == shapes.get(key) and name != "step" else WHOLE
            state.setdefault(key, {})[name] = kind
    optimizer = {"kind": None, "groups": [groups[g] for g in sorted(groups)], "state": state} if groups else None
    return {"optimizer": None if optimizer is None else encode(optimizer), "lr_scheduler": None, "rng": {}, "extra": None}


class _Source:
    """The optimizer's tensors of a DCP checkpoint for ``loaded_state``: each piece's destination
    allocated in its parameter's local layout, its blocks added to the one read of the load."""

    def __init__(self, path: Path, stored: Any, requests: dict[str, Any]):
        self.path, self.requests = path, requests
        self.entries = {
            fqn: Entry(fqn, path / METADATA, DTYPES.get(md.properties.dtype, "F32"), tuple(md.size), 0, 0)
            for fqn, md in stored.items()
            if fqn.startswith(STATE_PREFIX) and not _is_bytes(md)
        }
        self.blocks: dict[str, list[Block]] = {}

    def like(self, entry: Entry, place: Place, param: Any) -> torch.Tensor:
        local = param.to_local() if is_dtensor(param) else param
        dest = torch.empty_like(local.detach(), dtype=entry.torch_dtype)  # the state's dtype: a 0-dim parameter's step is float32
        self._add(entry, local_blocks(place.target, place.piece, dest))
        if not is_dtensor(param):
            return dest
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(dest, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())  # fmt: skip

    def whole(self, entry: Entry) -> torch.Tensor:
        dest = torch.empty(entry.shape, dtype=entry.torch_dtype)
        self._add(entry, piece_blocks(entry.shape, None, 0, dest))
        return dest

    def _add(self, entry: Entry, blocks: list[Block]) -> None:
        self.blocks.setdefault(entry.key, []).extend(blocks)
        made = self.blocks[entry.key]
        self.requests[entry.key] = dcp_planners.Pieces(entry.shape, entry.torch_dtype, lambda: made)


def _is_bytes(md: Any) -> bool:
    return getattr(md, "size", None) is None


def _read_values(path: Path, fqns: list[str]) -> dict[str, Any]:
    """The byte items ``fqns`` of the checkpoint (hyper-parameters, the training state's JSON)."""
    import torch.distributed.checkpoint as dcp

    if not fqns:
        return {}
    planner = dcp_planners.PiecesLoadPlanner()
    try:
        dcp.load(dict.fromkeys(fqns), storage_reader=CheckedReader(path), planner=planner, no_dist=True)
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        raise CheckpointError(f"{path}: its training state cannot be read ({type(e).__name__}: {e}); nothing was loaded",
                              file=path) from None  # fmt: skip
    return planner.values


__all__ = ["check_dcp_target", "is_dcp", "load_dcp", "save_dcp"]
