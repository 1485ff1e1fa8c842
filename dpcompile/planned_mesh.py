"""``plan="auto"`` over a ``DeviceMesh``: the layouts whose training loop is the user's plain one,
predicted with the mesh's calibration, the fastest that fits built over a mesh of the same ranks.

    transform(model, init_device_mesh("cpu", (4,)), plan="auto", memory_per_device="8GiB", example_inputs=(x, y))
    → candidates dp4, tp4, dp2xtp2 ranked (every rank alike), the first that fits built over
      DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp")) if it is dp2xtp2

Each layout is also a candidate with every repeated block recomputed (``activation_checkpointing=True``),
or, with ``activation_checkpointing="auto"``, with every choice of the one-process ladder
(``planner.checkpoint_ladder``), as in one process. Pipelines are not candidates: over a mesh their call
runs backward itself (``docs/pipeline.md``), so the user's loop would differ. FSDP is not one either: the
cost model does not predict it yet.
"""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dpcompile.analysis.device_memory import UNGIVEN_BUDGET_WORDS, memory_key, usable_memory_bytes
from dpcompile.analysis.layout_costs import LayoutSpec
from dpcompile.analysis.memory import format_bytes, parse_budget
from dpcompile.errors import ArgumentError, DpCompileError
from dpcompile.mesh import local_device
from dpcompile.planner import UNBUILT, chosen_words, default_budget_words, has_blocks, plan_mesh_layouts

__all__ = ["mesh_candidates", "mesh_shape", "planned_mesh_transform"]


def mesh_candidates(n: int, *, checkpointing: bool = False) -> list[LayoutSpec]:
    """The layouts of ``n`` ranks whose step is the plain ``loss.backward()`` loop: ``dp n``, ``tp n``
    and ``dp a x tp n/a`` for every ``a`` strictly between 1 and ``n`` that divides it; ``checkpointing``:
    each also with every repeated block recomputed (``activation_checkpointing=True``), as in one process."""
    layouts = [(("dp", n),)]
    if n > 1:
        layouts.append((("tp", n),))
        layouts += [(("dp", a), ("tp", n // a)) for a in range(2, n) if n % a == 0]
    return [LayoutSpec(layout, None, 1, ckpt) for layout in layouts for ckpt in ((False, True) if checkpointing else (False,))]


def mesh_shape(spec: LayoutSpec) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The shape and dimension names of the ``DeviceMesh`` that builds ``spec`` (outermost first)."""
    return tuple(size for _, size in spec.layout), tuple(name for name, _ in spec.layout)


def _keywords(spec: LayoutSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"activation_checkpointing": spec.checkpoint_keyword()}
    return {**out, "tensor_parallel": True} if spec.size("tp") > 1 else out


def _gathered(value: Any) -> list[Any]:
    """``value`` of every rank of the default group, in rank order (every rank calls it)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _check_mesh_for_planning(mesh: Any, arguments: Mapping[str, Any]) -> list[int]:
    """The mesh's ranks in order; the planner's collectives run over the default group, so the mesh must hold it all."""
    if not dist.is_available() or not dist.is_initialized():
        raise ArgumentError('plan="auto" over a DeviceMesh needs an initialised process group: call '
                         "torch.distributed.init_process_group() (torchrun sets the environment) first")  # fmt: skip
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if sorted(ranks) != list(range(dist.get_world_size())):
        raise DpCompileError(f'plan="auto" over a DeviceMesh plans over every rank of the process group: the mesh '
                             f"holds ranks {ranks} of {dist.get_world_size()}; pass a mesh of all of them, or name "
                             "the layout (data_parallel= / tensor_parallel=)")  # fmt: skip
    if arguments["data_parallel"] not in ("ddp", "replicate"):
        raise ArgumentError(f'plan="auto" over a DeviceMesh does not predict data_parallel={arguments["data_parallel"]!r} '
                         "yet: leave it out (replicated data parallel is a candidate), or name the layout yourself")  # fmt: skip
    if isinstance(arguments["memory_per_device"], Mapping):
        raise ArgumentError('plan="auto" over a DeviceMesh takes one memory_per_device= for every rank, e.g. "24GiB"')
    return ranks


def planned_mesh_transform(
    model: nn.Module, mesh: Any, arguments: dict[str, Any], example_tuple: tuple | None,
    build: Callable[..., nn.Module],
) -> Any:  # fmt: skip
    """The fastest candidate of :func:`mesh_candidates` that fits, built with ``build`` (``transform``)
    over a ``DeviceMesh`` of the mesh's ranks named as the candidate; every rank chooses the same one
    (checked) or every rank raises the same ``DpCompileError``."""
    ranks = _check_mesh_for_planning(mesh, arguments)
    labels = [f"rank{r}" for r in ranks]
    given = arguments["memory_per_device"]
    budget, source = (parse_budget(given), None) if given is not None else _ranks_own_memory(mesh)
    budgets = dict.fromkeys(labels, budget)
    optimizer, training = arguments["optimizer"], arguments["training"]
    auto = arguments.get("activation_checkpointing") == "auto"  # each layout with every choice of what to keep
    specs = mesh_candidates(len(ranks), checkpointing=not auto and training and has_blocks(model))
    planned = plan_mesh_layouts(model, labels, budgets, optimizer=optimizer, training=training,
                                example_inputs=example_tuple, example_kwargs=arguments["example_kwargs"],
                                specs=specs, auto_checkpointing=auto)  # fmt: skip
    if source is not None:
        planned.judged_against(source)
    ranked = [c.spec.name for c in planned.fitting]
    every = _gathered(ranked)
    if any(order != every[0] for order in every):
        firsts = ", ".join(f"rank {r}: {order[0] if order else 'none fits'}" for r, order in enumerate(every))
        raise DpCompileError(f'plan="auto" over a DeviceMesh: the ranks ranked the layouts differently ({firsts}); '
                             "give every rank the same model, examples, budget and optimizer, and the same "
                             "calibration (DPCOMPILE_CALIBRATION: rank 0's is broadcast unless it is off)")  # fmt: skip
    for candidate in planned.fitting:
        shape, names = mesh_shape(candidate.spec)
        # every rank reaches here with the same candidate: the sub-groups are created in the same order
        chosen_mesh = type(mesh)(mesh.device_type, torch.tensor(ranks).reshape(shape), mesh_dim_names=names)
        options = {**arguments, **_keywords(candidate.spec), "memory_per_device": None}
        pm, failure, unbuilt = None, None, True
        try:
            pm = build(model, chosen_mesh, **options)
        except Exception as e:  # noqa: BLE001 - told to every rank first, so that none waits on the others
            failure, unbuilt = e, isinstance(e, (DpCompileError, ValueError))
        told = _gathered(None if failure is None else (str(failure), unbuilt))
        errors = [(r, t) for r, t in enumerate(told) if t is not None]
        if errors and all(refused for _, (_, refused) in errors):  # every rank tries the next candidate
            candidate.rejected, candidate.fits = f"{UNBUILT}rank {errors[0][0]}: {errors[0][1][0]}", False
            continue
        if errors:  # a crash, not a refusal: its own rank raises it, every other rank says whose it was
            if failure is not None and not unbuilt:
                raise failure
            rank, (message, _) = next((r, t) for r, t in errors if not t[1])
            raise DpCompileError(f'plan="auto" over a DeviceMesh: rank {rank} failed building {candidate.spec.name}: '
                                 f"{message}")  # fmt: skip
        planned.choose(candidate)
        pm.memory_plan = planned.estimate(candidate, optimizer, training)
        pm.candidates = planned.candidates
        pm.calibration = planned.calibration
        if auto:
            pm.strategies["activation_checkpointing"] = chosen_words(pm, candidate, budgets, len(planned.candidates),
                                                                     "the fastest predicted")  # fmt: skip
        if source is not None:
            pm.strategies["memory_per_device"] = default_budget_words(budgets)
        return pm
    raise planned.no_fit_error(len(ranks))


def _ranks_own_memory(mesh: Any) -> tuple[int, str]:
    """The budget every rank plans for without ``memory_per_device=``: the least, over the ranks, of a
    rank's share of its device's memory (a GPU's total memory; the host's available memory shared by the
    ranks on that host), so that every rank ranks the layouts alike. Every rank calls it (a collective).
    Two ranks of one host on one GPU are refused: a rank that never called ``torch.cuda.set_device``."""
    try:
        device = local_device(mesh)
        mine: tuple[Any, ...] = (socket.gethostname(), memory_key(device), *usable_memory_bytes(device))
    except DpCompileError as e:  # told to every rank, so that none waits on the others
        mine = (None, None, str(e), None)
    every = _gathered(mine)
    failed = next((r for r, (host, *_) in enumerate(every) if host is None), None)
    if failed is not None:
        raise ArgumentError(f"rank {failed}: {every[failed][2]}")
    sharing = Counter((host, key) for host, key, _, _ in every)
    crowded = next(((host, key) for (host, key), n in sharing.items() if key != "cpu" and n > 1), None)
    if crowded is not None:
        ranks = [r for r, (host, key, _, _) in enumerate(every) if (host, key) == crowded]
        raise ArgumentError(
            f"ranks {ranks} all compute on {crowded[1]} of {crowded[0]}: each rank needs a GPU of its own; call "
            "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) at the start of the script, before any CUDA work "
            "and before building the DeviceMesh; nothing was changed"
        )
    rank = min(range(len(every)), key=lambda r: every[r][2] // sharing[every[r][:2]])
    host, key, size, where = every[rank]
    shared = f", shared by {sharing[(host, key)]} ranks" if sharing[(host, key)] > 1 else ""
    return size // sharing[(host, key)], (f"{UNGIVEN_BUDGET_WORDS}: the least of the ranks' shares, rank {rank}'s {key} "
                                          f"on {host}: {where} {format_bytes(size)}{shared}")  # fmt: skip
