"""Checkpoints of pipeline programs over a mesh (``pm.executor == "pipelining"``: each rank one stage).

A rank holds only its stage's tensors (its tensor-parallel shards on a ``("pp", "tp")`` mesh,
FSDP's rows with ``data_parallel="fsdp"``), so each rank's targets list *every* key of the
model, shaped as the whole program (``pm.whole``) says, with pieces only where this rank holds
the tensor: the save's plan of files is the same on every rank, and each rank writes (and reads)
only its own slices (:mod:`dpcompile.checkpoint.rank_save`). A weight tied across stages (an LM
head tied to the embedding) is one key whose pieces are on both stages; one of them writes it.

The optimizer's state of a rank covers its stage only: :func:`merge_stage_states` exchanges what
each rank would save (the keys, their state's shapes, dtypes and kinds, the param groups), so that
every rank plans the same files and ``training_state.json`` names every stage's parameters.
"""

from __future__ import annotations

from typing import Any

import torch

from dpcompile.checkpoint.files import CheckpointError
from dpcompile.fx_utils import unalias


def stage_state(pm: Any) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of this rank's stage program (its own names, aliases undone)."""
    return {unalias(k): v for k, v in pm.program.state_dict(keep_vars=True).items()}


def stage_targets(pm: Any, target_type: Any, piece_type: Any) -> dict[str, Any]:
    """``{model key: Target}`` of every persistent key of the model, in the model's order: full shape
    and dtype from the whole program, pieces this rank's (none where another stage holds the key)."""
    import torch.distributed as dist

    whole = {unalias(k): v for k, v in pm.whole.state_dict(keep_vars=True).items()}
    own = stage_state(pm)
    tp_rank = dist.get_rank(pm.tp_group) if pm.tp_group is not None else 0
    out = {}
    for key, names in pm.state_ties.items():
        shape_of = next((whole[n] for n in names if n in whole), None)
        if shape_of is None:
            raise CheckpointError(f"'{key}' is not in the whole program of this pipeline; this is a bug, please report it")
        held = next((n for n in names if n in own), None)
        pieces = []
        if held is not None:
            spec = pm.shards.get(held)
            pieces.append(piece_type(own[held], spec, tp_rank if spec is not None else 0))
        target = target_type(key, tuple(shape_of.shape), shape_of.dtype, pieces, gathered=False)
        target.tied = tuple(k for k in pm.state_ties if k in names)  # the model's order: the first is written
        out[key] = target
    return out


def merge_stage_states(saved: Any) -> None:
    """In place: ``saved`` (this rank's :class:`~dpcompile.checkpoint.optimizer_state.SavedState`)
    made the union of every rank's, the same on every rank: the tensors other stages hold are
    listed (this rank writes no block of them), the param groups and state kinds name every key.
    A collective over all ranks; a rank whose own state failed sends None, and every rank raises."""
    import torch.distributed as dist

    mine = None
    if saved is not None:
        mine = {
            "tensors": {k: (tuple(shape), dtype) for k, (shape, dtype, _) in saved.tensors.items()},
            "meta": saved.meta,
        }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if saved is None:
        return
    if any(other is None for other in everyone):
        raise CheckpointError("another rank of the pipeline could not prepare its optimizer state; see its error")
    tensors: dict[str, Any] = {}
    for other in everyone:
        for key, (shape, dtype) in other["tensors"].items():
            if key in saved.tensors:
                tensors[key] = saved.tensors[key]
            elif key not in tensors:
                tensors[key] = (shape, dtype, _held_elsewhere(key))
                saved.local[key] = list
    order = {key: i for i, key in enumerate(dict.fromkeys(k for other in everyone for k in other["tensors"]))}
    saved.tensors = dict(sorted(tensors.items(), key=lambda item: order[item[0]]))
    groups = [dict(g) for g in everyone[0]["meta"]["groups"]]
    state: dict[str, Any] = {}
    for other in everyone:
        if len(other["meta"]["groups"]) != len(groups):
            raise CheckpointError("the stages' optimizers have different numbers of param groups: build them alike")
        for g, group in enumerate(other["meta"]["groups"]):
            groups[g]["params"] = list(dict.fromkeys([*groups[g]["params"], *group["params"]]))
        for key, kinds in other["meta"]["state"].items():
            state.setdefault(key, kinds)
    saved.meta = {**saved.meta, "groups": groups, "state": state}


def _held_elsewhere(key: str) -> Any:
    def refuse() -> torch.Tensor:
        raise CheckpointError(f"'{key}' is held by another stage of the pipeline: this rank writes none of it")

    return refuse


__all__ = ["merge_stage_states", "stage_state", "stage_targets"]
