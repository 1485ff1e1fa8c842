"""An optimizer's state in the model's own layout: keyed by the model's parameter names, each
state tensor whole, so that what one layout saved loads into any other.

* :func:`param_places`: for each parameter the optimizer holds, its model key and the piece of
  the whole tensor it is (a tensor-parallel shard, a fused-qkv shard by sections, a vocab shard
  of a tied embedding, a pipeline stage's parameter): the mapping the weights use
  (:func:`~dpcompile.checkpoint.targets.targets_of`);
* :func:`saved_state`: what a save writes: ``optimizer.state.<model key>.<state name>`` tensors
  (put together from the pieces one tensor at a time) and the JSON of the rest (hyper-parameters,
  param groups by model key, non-tensor state);
* :func:`loaded_state`: the ``state_dict`` this program's optimizer takes, each piece's state
  read as its slice of the file, every key, shape and dtype checked before anything is returned.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dpcompile.checkpoint.dtensors import RowsOf, gather_like, is_dtensor
from dpcompile.checkpoint.files import Runs
from dpcompile.checkpoint.headers import Checkpoint, CheckpointError
from dpcompile.checkpoint.rank_writes import Block, piece_blocks
from dpcompile.checkpoint.slices import read_blocks
from dpcompile.checkpoint.stages import stage_state
from dpcompile.checkpoint.targets import Piece, Target, shard_runs, targets_of, tie_groups
from dpcompile.fx_utils import unalias
from dpcompile.modules.executors import executor_of

STATE_PREFIX = "optimizer.state."
LIKE_PARAM = "param"  # a state tensor laid out as its parameter (exp_avg, momentum_buffer): sliced as it is
WHOLE = "whole"  # any other tensor (step): the same on every piece, saved once


@dataclass
class Place:
    """Where an optimizer parameter lies in the model: ``key``'s ``piece`` (of ``target``)."""

    key: str
    target: Target
    piece: Piece


@dataclass
class SavedState:
    """What a save writes of an optimizer: ``tensors`` (file key -> shape, dtype and a maker that
    puts the whole tensor together) and ``meta`` (JSON-able: kind, groups, the kind of each state)."""

    tensors: dict[str, tuple[tuple[int, ...], torch.dtype, Callable[[], torch.Tensor | Runs]]] = field(
        default_factory=dict
    )
    meta: dict[str, Any] = field(default_factory=dict)
    local: dict[str, Callable[[], list[Block]]] = field(default_factory=dict)  # over a mesh: this rank's blocks


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def param_places(pm: Any, optimizer: torch.optim.Optimizer) -> dict[int, Place]:
    """``{id(parameter): Place}`` for every parameter of ``optimizer``; a parameter that is not one
    of ``pm``'s raises, naming it."""
    targets = targets_of(pm)
    ties = tie_groups(targets)
    by_tensor: dict[int, Place] = {}
    for key, target in targets.items():
        if ties[key][0] != key:
            continue  # a tied key (an LM head tied to the embedding): its tensors are the first key's
        for piece in target.pieces:
            by_tensor.setdefault(id(piece.tensor), Place(key, target, piece))
    own = stage_state(pm) if executor_of(pm).runs_one_stage_per_rank else pm.stored_state_dict(keep_vars=True)
    for name, tensor in own.items():
        key = unalias(name)  # over a mesh FSDP's pieces are the DTensors' local parts: the DTensor is the parameter
        key = ties[key][0] if key in ties else key  # a pipeline stage's tied name: the first key's
        if key in targets and targets[key].pieces:
            by_tensor.setdefault(id(tensor), Place(key, targets[key], targets[key].pieces[0]))
    names = {id(p): n for n, p in pm.named_parameters(remove_duplicate=False)}
    out: dict[int, Place] = {}
    for g, group in enumerate(optimizer.param_groups):
        for k, param in enumerate(group["params"]):
            place = by_tensor.get(id(param))
            if place is None:
                what = f"'{names[id(param)]}'" if id(param) in names else f"{tuple(param.shape)}"
                raise CheckpointError(
                    f"the optimizer's parameter {k} of group {g} ({what}) is not a parameter of this program: build "
                    "the optimizer from pm.parameters() (the program's own tensors, not the model's)"
                )
            out[id(param)] = place
    return out


def saved_state(pm: Any, optimizer: torch.optim.Optimizer) -> SavedState:
    """The optimizer's state keyed by model keys, each state tensor in its parameter's whole layout.
    Everything is checked here, before a byte is written."""
    places = param_places(pm, optimizer)
    by_key: dict[str, list[tuple[Any, dict[str, Any]]]] = {}
    target_of: dict[str, Target] = {}
    for param, place in ((p, places[id(p)]) for group in optimizer.param_groups for p in group["params"]):
        by_key.setdefault(place.key, []).append(((param, place.piece), optimizer.state.get(param, {})))
        target_of[place.key] = place.target
    out = SavedState()
    kinds: dict[str, dict[str, Any]] = {}
    for key, pieces in by_key.items():
        target = target_of[key]
        names = [sorted(state) for _, state in pieces]
        if any(n != names[0] for n in names):
            raise CheckpointError(f"the optimizer's shards of '{key}' hold different state ({names}): step every shard")
        kinds[key] = {}
        for name in names[0]:
            values = [state[name] for _, state in pieces]
            kinds[key][name] = _save_one(pm, out, key, name, target, [p for p, _ in pieces], values)
    sd = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = []
    for group in sd["param_groups"]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({"hyper": hyper, "params": _unique([places[id(params[i])].key for i in group["params"]])})
    out.meta = {"kind": optimizer_kind(optimizer), "groups": groups, "state": kinds}
    return out


def _save_one(
    pm: Any, out: SavedState, key: str, name: str, target: Target, held: list[tuple[Any, Piece]], values: list[Any]
) -> Any:
    """Record one state value of ``key`` (``held``: each parameter holding it and its piece);
    returns its kind for the JSON (or the value itself)."""
    file_key = f"{STATE_PREFIX}{key}.{name}"
    if not all(isinstance(v, torch.Tensor) for v in values):
        if any(isinstance(v, torch.Tensor) for v in values) or any(v != values[0] for v in values):
            raise CheckpointError(f"the optimizer's state '{name}' of '{key}' differs between its shards")
        return {"value": values[0]}
    like_param = all(tuple(v.shape) == tuple(param.shape) for v, (param, _) in zip(values, held))
    pieces = [p for _, p in held]
    if like_param and not target.gathered:  # over a mesh: gathered from the ranks, one tensor at a time
        gather = gather_like(pm, values[0], (getattr(pm, "shards", None) or {}).get(key))
        out.tensors[file_key] = (tuple(target.shape), values[0].dtype, gather)
        out.local[file_key] = lambda v=values[0], p=pieces[0]: local_blocks(target, p, v)
        return LIKE_PARAM
    if is_dtensor(values[0]):
        raise CheckpointError(f"the optimizer's state '{name}' of '{key}' is a DTensor not laid out as its parameter")
    if like_param:
        if pieces[0].spec is None:
            out.tensors[file_key] = (tuple(values[0].shape), values[0].dtype, lambda v=values[0]: v.detach().to("cpu"))
        else:
            ordered = [v for _, v in sorted(zip((p.index for p in pieces), values), key=lambda x: x[0])]
            spec = pieces[0].spec
            runs = Runs(target.shape, values[0].dtype, lambda o=ordered, s=spec: shard_runs(o, s))
            out.tensors[file_key] = (tuple(target.shape), values[0].dtype, lambda r=runs: r)
            out.local[file_key] = lambda: [b for p, v in zip(pieces, values) for b in local_blocks(target, p, v)]
        return LIKE_PARAM
    if any(not torch.equal(v.detach().cpu(), values[0].detach().cpu()) for v in values[1:]):
        raise CheckpointError(
            f"the optimizer's state '{name}' of '{key}' ({tuple(values[0].shape)}) is neither laid out as the parameter "
            "nor the same on every shard: it cannot be saved in the whole layout"
        )
    out.tensors[file_key] = (tuple(values[0].shape), values[0].dtype, lambda v=values[0]: v.detach().to("cpu"))
    return WHOLE


def local_blocks(target: Target, piece: Piece, value: Any) -> list[Block]:
    """This rank's blocks of a state tensor laid out as its parameter's piece (over a mesh)."""
    if isinstance(piece.tensor, RowsOf):
        rows = piece.tensor
        return piece_blocks(target.shape, piece.spec, piece.index, value, (rows.dim, rows.start, rows.size))
    return piece_blocks(target.shape, piece.spec, piece.index, value)


def loaded_state(
    pm: Any,
    optimizer: torch.optim.Optimizer,
    meta: Mapping[str, Any],
    files: Checkpoint | None,
    strict: bool,
    *,
    source: Any = None,
) -> dict[str, Any]:
    """The ``state_dict`` for ``optimizer`` (this program's parameters) from what a save wrote;
    raises :class:`CheckpointError` naming the first disagreement before anything is read.
    ``source``: where the tensors come from where not ``files`` (safetensors): an object with
    ``entries`` (``{file key: Entry}``), ``path``, ``like(entry, place, param)`` and ``whole(entry)``
    (a ``torch.distributed.checkpoint`` folder, :mod:`dpcompile.checkpoint.dcp`). A ``meta`` without
    a ``kind`` (a checkpoint plain torch saved) is not checked against the optimizer's kind."""
    where = source.path if source is not None else files.path if files is not None else None
    if meta.get("kind") is not None and meta.get("kind") != optimizer_kind(optimizer):
        raise CheckpointError(
            f"the checkpoint {where} holds the state of a {str(meta.get('kind'))[:80]}, the optimizer is a {optimizer_kind(optimizer)}",
            file=where,
        )
    places = param_places(pm, optimizer)
    held = {key: bool(target.pieces) for key, target in targets_of(pm).items()}
    current = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_groups = meta["groups"]
    if len(saved_groups) != len(current["param_groups"]):
        raise CheckpointError(
            f"the checkpoint {where} has {len(saved_groups)} optimizer param group(s), this optimizer {len(current['param_groups'])}",
            file=where,
        )
    groups = []
    for g, (saved, group) in enumerate(zip(saved_groups, current["param_groups"])):
        keys = _unique([places[id(params[i])].key for i in group["params"]])
        extra, lacking = sorted(set(keys) - set(saved["params"])), sorted(set(saved["params"]) - set(keys))
        if executor_of(pm).runs_one_stage_per_rank:  # a stage's optimizer holds its own parameters: the others' are not lacking
            lacking = [k for k in lacking if held.get(k)]
        if extra or (lacking and strict):
            raise CheckpointError(
                f"param group {g} of the optimizer differs from the checkpoint {where}'s: here but not saved {extra[:5]}, "
                f"saved but not here {lacking[:5]}: build the param groups as the saving run did"
                + ("" if extra else " (or pass strict=False to load the state of the parameters this one holds)"),
                file=where, key=(extra or lacking)[0],
            )  # fmt: skip
        _check_hyper(saved["hyper"], group, optimizer.defaults, g, where)
        _check_constructor(optimizer, saved["hyper"], group, g, where)
        groups.append({**saved["hyper"], "params": group["params"]})
    kinds = meta["state"]
    entries = source.entries if source is not None else files.entries if files is not None else {}
    like = source.like if source is not None else _read_like
    whole = source.whole if source is not None else _read_whole
    state: dict[int, dict[str, Any]] = {}
    listed: set[str] = set()
    reads: list[tuple[int, str, Callable[[], torch.Tensor]]] = []
    for index, param in enumerate(params):
        place = places[id(param)]
        if place.key not in kinds:
            continue  # saved before its first step: no state, as here
        state[index] = {}
        for name, kind in kinds[place.key].items():
            if isinstance(kind, dict):
                state[index][name] = kind["value"]
                continue
            file_key = f"{STATE_PREFIX}{place.key}.{name}"
            listed.add(file_key)
            entry = entries.get(file_key)
            if entry is None:
                raise CheckpointError(
                    f"the checkpoint {where} lacks '{file_key}', which its training state lists (corrupt or edited: save "
                    "again, or load without optimizer=)", file=where, key=file_key,
                )  # fmt: skip
            _check_entry(entry, kind, place, file_key)
            if kind == WHOLE and name == "step" and optimizer_kind(optimizer).startswith("torch.optim."):
                _check_step(entry, file_key)
            if kind == LIKE_PARAM:
                reads.append((index, name, lambda e=entry, p=place, q=param: like(e, p, q)))
            else:
                reads.append((index, name, lambda e=entry: whole(e)))
    mine = {place.key for place in places.values()}
    unlisted = [
        k for k in entries
        if k.startswith(STATE_PREFIX) and k not in listed and k[len(STATE_PREFIX) :].rsplit(".", 1)[0] in mine
    ]  # fmt: skip
    if unlisted:
        raise CheckpointError(
            f"the checkpoint {where} holds optimizer state its training state does not list ({unlisted[:5]}): corrupt or "
            "edited (the optimizer would resume without it); save again, or load without optimizer=",
            file=where, key=unlisted[0],
        )  # fmt: skip
    for index, name, read in reads:  # everything checked: read each piece's slices
        state[index][name] = read()
    return {"state": state, "param_groups": groups}


def _read_whole(entry: Any) -> torch.Tensor:
    value = torch.empty(tuple(entry.shape), dtype=entry.torch_dtype)
    read_blocks(entry, piece_blocks(tuple(entry.shape), None, 0, value))
    return value


def _read_like(entry: Any, place: Place, param: Any) -> torch.Tensor:
    """This parameter's part of a state tensor laid out as the parameter, read as slices; over a
    mesh a DTensor parameter's is a DTensor of this rank's rows."""
    piece = place.piece
    local = piece.tensor.local if isinstance(piece.tensor, RowsOf) else piece.tensor  # FSDP's rows of a shard
    value = torch.empty(tuple(local.shape), dtype=entry.torch_dtype)  # read into it: the state's own memory
    read_blocks(entry, local_blocks(place.target, piece, value))
    if not is_dtensor(param):
        return value
    from torch.distributed.tensor import DTensor

    local = value.to(param.to_local().device).contiguous()
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())  # fmt: skip


def _check_entry(entry: Any, kind: str, place: Place, file_key: str) -> None:
    if kind == LIKE_PARAM:
        shape = place.target.shape
        if tuple(entry.shape) != tuple(shape):
            raise CheckpointError(
                f"'{file_key}' is {list(entry.shape)} in {entry.file.name}, the parameter '{place.key}' is {list(shape)}",
                file=entry.file, key=file_key,
            )  # fmt: skip
        if entry.torch_dtype.is_floating_point != place.target.dtype.is_floating_point:
            raise CheckpointError(
                f"'{file_key}' is {entry.torch_dtype} in {entry.file.name}, the parameter '{place.key}' {place.target.dtype}",
                file=entry.file, key=file_key,
            )  # fmt: skip
    elif kind != WHOLE:
        raise CheckpointError(
            f"'{file_key}' in {entry.file}: unknown kind of state {str(kind)[:80]!r} (corrupt or edited: save again)",
            file=entry.file, key=file_key,
        )  # fmt: skip


def _check_step(entry: Any, file_key: str) -> None:
    """A torch optimizer's ``step`` is one number (a 0-dim tensor): another shape loads, and the next
    ``optimizer.step()`` fails ("a Tensor with 2 elements cannot be converted to Scalar") or steps
    with it."""
    if tuple(entry.shape) != () or entry.torch_dtype == torch.bool:
        raise CheckpointError(
            f"'{file_key}' is {entry.torch_dtype} {list(entry.shape)} in {entry.file}, but a torch optimizer's step "
            "is one number (a 0-dim tensor): corrupt or edited; save again, or load without optimizer=",
            file=entry.file, key=file_key,
        )  # fmt: skip


def _check_hyper(hyper: Any, group: dict[str, Any], needed: Any, g: int, where: Any) -> None:
    """The saved hyper-parameters of param group ``g`` can stand for the optimizer's own (``group``):
    no key it lacks, each value of the kind it holds (a finite number for ``lr``, a bool for
    ``maximize``); of the optimizer's ``needed`` defaults a flag may be missing (its ``__setstate__``
    fills it), a number not; a key it lacks only as a plain scalar (a scheduler adds ``initial_lr``)."""
    mine = {k: v for k, v in group.items() if k not in ("params", "param_names")}
    if not isinstance(hyper, dict):
        raise CheckpointError(f"the checkpoint {where}: param group {g}'s hyper-parameters are not an object", file=where)
    unknown = sorted(str(k) for k in hyper if k not in mine and not _scalar(hyper[k]))  # a scheduler's initial_lr is one
    wrong = sorted(k for k in mine if k in hyper and not same_kind(hyper[k], mine[k]))
    missing = sorted(k for k in needed if k not in hyper and not (mine.get(k) is None or isinstance(mine.get(k), bool)))
    if unknown or wrong or missing:
        shown = {k: str(hyper[k])[:40] for k in wrong[:5]}
        raise CheckpointError(
            f"the checkpoint {where}: param group {g}'s hyper-parameters do not fit this optimizer: unknown {unknown[:5]}, "
            f"of another kind {shown}, missing {missing[:5]}; corrupt or edited (or another optimizer): save again, or "
            "load without optimizer=", file=where,
        )  # fmt: skip


def _check_constructor(optimizer: Any, hyper: dict[str, Any], group: dict[str, Any], g: int, where: Any) -> None:
    """The optimizer's own constructor accepts the saved hyper-parameters of group ``g`` where it accepts
    the group's own (``load_state_dict`` checks none: an ``eps`` of -1 or ``betas`` of (1.5, 0.999) would
    resume training on them); tried on a one-element parameter, the constructor's ``ValueError`` named."""

    def refusal(values: dict[str, Any]) -> str | None:
        try:
            params = inspect.signature(type(optimizer).__init__).parameters
            kwargs = {k: v for k, v in values.items() if k in params and k != "params"}
            type(optimizer)([torch.zeros(1, requires_grad=True)], **kwargs)
        except ValueError as e:
            return str(e)[:160]
        except Exception:  # noqa: BLE001 - a constructor that cannot be tried this way: not checked
            return None
        return None

    saved = refusal(hyper)
    if saved is not None and refusal({k: v for k, v in group.items() if k not in ("params", "param_names")}) is None:
        raise CheckpointError(
            f"the checkpoint {where}: param group {g}'s hyper-parameters are refused by {type(optimizer).__name__} "
            f"itself ({saved}); corrupt or edited: save again, or load without optimizer=", file=where,
        )  # fmt: skip


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, str)) or same_kind(value, 0.0)


def same_kind(saved: Any, current: Any, *, none_holds: tuple[type, ...] = (bool,)) -> bool:
    """``saved`` (read from a file) can stand where an optimizer or scheduler holds ``current``: a
    finite number for a number (not a bool), a bool or None for a bool, a sequence of the same
    length, None or one of ``none_holds`` where it holds None, the same type otherwise."""
    if current is None:  # an optimizer's unset flag (foreach, fused): None or a bool
        return saved is None or isinstance(saved, none_holds)
    if isinstance(current, bool):  # a flag: some are None-or-bool (foreach, fused)
        return saved is None or isinstance(saved, bool)
    if isinstance(saved, bool):
        return False
    if isinstance(current, (int, float)):  # an int too large for a float (10**400 in JSON) is no number here
        if isinstance(current, int) and isinstance(saved, float):  # a count (last_epoch): 1e30 is none either
            return math.isfinite(saved) and abs(saved) < 2**63
        return (isinstance(saved, int) and abs(saved) < 2**63) or (isinstance(saved, float) and math.isfinite(saved))
    if isinstance(current, (list, tuple)):
        return isinstance(saved, (list, tuple)) and len(saved) == len(current) and all(
            same_kind(a, b, none_holds=none_holds) for a, b in zip(saved, current)
        )  # fmt: skip
    return isinstance(saved, type(current))


def _unique(keys: list[str]) -> list[str]:
    return list(dict.fromkeys(keys))


__all__ = ["LIKE_PARAM", "local_blocks", "STATE_PREFIX", "WHOLE", "Place", "SavedState", "loaded_state", "optimizer_kind", "param_places", "saved_state"]
