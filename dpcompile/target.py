"""The target: named mesh dimensions over the devices, their arithmetic checked once.

A layout is a dict of dimension sizes, outermost first. ``mesh={"pp": 2, "tp": 2}`` over four
devices puts stage 0 on ``devices[0:2]`` and stage 1 on ``devices[2:4]``; the older keywords are
sugar for the same thing::

    transform(model, ["cpu"] * 4, pipeline=2, tensor_parallel=True)   # mesh={"pp": 2, "tp": 2}
    transform(model, ["cpu"] * 4, tensor_parallel=True)               # mesh={"tp": 4}
    transform(model, ["cpu"] * 4)                                     # mesh={"dp": 4}

>>> target = resolve_target(["cpu"] * 4, {"tp": 2, "pp": 2}, pipeline=None, tensor_parallel=False)
>>> target.layout, target.arguments()["pipeline"], target.arguments()["tensor_parallel"]
({'tp': 2, 'pp': 2}, 2, True)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dpcompile.devices import Devices, parse_devices
from dpcompile.errors import ArgumentError, DpCompileError
from dpcompile.mesh import is_device_mesh

#: the dimensions a layout may name, and the strategy each turns on
DIMENSIONS = {"pp": "pipeline", "dp": "data parallel", "cp": "context parallel", "tp": "tensor parallel"}
#: the order the compiler lays devices out in (stage-major, shards innermost)
CANONICAL_ORDER = ("pp", "dp", "cp", "tp")

#: layouts that are built, in one process and over a DeviceMesh (the sets of dims larger than 1);
#: in one process ``dp`` composes over any other program (:func:`replicate_over_dp`)
BUILT_ONE_PROCESS = ({"dp"}, {"tp"}, {"pp"}, {"pp", "tp"}, {"dp", "tp"}, {"pp", "dp"}, {"pp", "dp", "tp"}, {"cp"},
                     {"dp", "cp"}, {"cp", "tp"}, {"dp", "cp", "tp"}, {"pp", "cp"}, {"pp", "cp", "tp"})
BUILT_OVER_MESH = ({"dp"}, {"tp"}, {"dp", "tp"}, {"pp"}, {"pp", "dp"}, {"pp", "tp"}, {"pp", "dp", "tp"}, {"cp"}, {"dp", "cp"},
                   {"cp", "tp"})  # fmt: skip


@dataclass(frozen=True)
class Target:
    """Named dimensions over ``devices`` (one process) or a ``DeviceMesh`` (one process per rank).

    ``dims`` is in the order the devices are laid out, outermost first; a dimension of size 1
    turns nothing on and is kept only so ``layout`` echoes what the user wrote.
    """

    dims: tuple[tuple[str, int], ...]
    devices: Devices | None = None
    stage_paths: tuple[str, ...] | None = None  # pipeline=[paths]: where stages start
    plan: bool | dict[str, str] = False

    @property
    def layout(self) -> dict[str, int]:
        return dict(self.dims)

    def size(self, name: str) -> int:
        return self.layout.get(name, 1)

    @property
    def active(self) -> set[str]:
        """The dimensions that split something (size > 1)."""
        return {name for name, size in self.dims if size > 1}

    def canonical_devices(self) -> Devices:
        """The devices reordered so that the dimensions run in :data:`CANONICAL_ORDER` (pp outermost,
        tp innermost): the order the one-process builders group them in."""
        assert self.devices is not None
        names = [name for name, _ in self.dims]
        sizes = [size for _, size in self.dims]
        order = sorted(range(len(names)), key=lambda i: CANONICAL_ORDER.index(names[i]))
        strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]
        picked = []
        for index in _counting([sizes[i] for i in order]):
            flat = sum(index[j] * strides[order[j]] for j in range(len(order)))
            picked.append(self.devices[flat])
        return Devices(tuple(picked))

    def arguments(self) -> dict[str, Any]:
        """The layout as the builders' keywords: ``pipeline=`` (stages or cut paths), ``tensor_parallel=``
        and ``context_parallel`` (the sequence split)."""
        pipeline: int | tuple[str, ...] | None = None
        if "pp" in self.active:
            pipeline = self.stage_paths if self.stage_paths is not None else self.size("pp")
        plan = self.plan if "tp" in self.active else False
        if "tp" in self.active and plan is False:
            plan = True
        return {"pipeline": pipeline, "tensor_parallel": plan, "context_parallel": "cp" in self.active}


def dp_copies(target: Target, dimension: str = "dp") -> list[Devices]:
    """The devices of each ``dp`` index, in canonical order: copy ``r`` of the program the other
    dimensions build runs on ``dp_copies(target)[r]`` (one copy, all devices, without ``dp``);
    ``dimension="cp"``: the devices of each ``cp`` index (a pipeline's pieces of the sequence)."""
    devices = target.canonical_devices()
    order = [name for name in CANONICAL_ORDER if name in target.layout]
    copies = target.size(dimension)
    inner = math.prod(target.size(name) for name in order[order.index(dimension) + 1 :]) if dimension in order else 1
    return [
        Devices(tuple(d for i, d in enumerate(devices) if (i // inner) % copies == r)) for r in range(copies)
    ]


def replicate_over_dp(target: Target, micro_batches: int) -> dict[str, Any]:
    """The builders' keywords for ``dp`` composed over the program the other dimensions build (the
    pipeline, the tensor-parallel program, or both; or the context-parallel one): ``D`` copies of it, the batch split into
    ``D x micro_batches`` pieces by data parallelism's split (``insert_scatter_gather``: exact mean
    and sum losses, BatchNorm over the whole batch), piece ``j`` run by copy ``j // micro_batches``.
    A program without a pipeline is a pipeline of one stage. The program is built on copy 0's
    devices; ``dp_devices`` (each copy's devices, as strings) tells ``passes.place_dp_copies``
    where copy ``r`` runs. The context-parallel program is no pipeline: its recipe splits the batch
    into the copies itself (``passes.split_batch_into_copies``), then each copy's sequence.

    >>> t = resolve_target(["cpu"] * 8, {"pp": 2, "dp": 2, "tp": 2}, pipeline=None, tensor_parallel=False)
    >>> args = replicate_over_dp(t, micro_batches=2)
    >>> args["pipeline"], args["tensor_parallel"], args["micro_batches"], args["dp_copies"], len(args["devices"])
    (2, True, 4, 2, 4)
    """
    arguments = {**target.arguments(), "devices": target.canonical_devices(), "micro_batches": micro_batches}
    if "cp" in target.active and "pp" in target.active:
        return stages_over_cp(target, arguments, micro_batches)
    if {"cp", "tp"} <= target.active:
        return shards_over_cp(target, arguments)
    if "dp" not in target.active or target.active == {"dp"}:
        return {**arguments, "dp_copies": 1, "dp_devices": None}
    copies = dp_copies(target)
    dp_devices = tuple(tuple(copy.strings()) for copy in copies)
    check_copy_devices(dp_devices, layout=target.layout)
    if "cp" in target.active:
        check_virtual_copies(dp_devices, layout=target.layout)
        check_virtual_pieces(dp_devices[0], layout=target.layout)
        return {**arguments, "devices": copies[0], "dp_copies": len(copies), "dp_devices": dp_devices}
    pipeline = arguments["pipeline"] if arguments["pipeline"] is not None else 1
    return {**arguments, "devices": copies[0], "pipeline": pipeline, "micro_batches": micro_batches * len(copies),
            "dp_copies": len(copies), "dp_devices": dp_devices}  # fmt: skip


def shards_over_cp(target: Target, arguments: dict[str, Any]) -> dict[str, Any]:
    """``{"cp": C, "tp": T}``: the tensor-parallel program split into ``C`` pieces along the sequence,
    as dp splits it into copies along the batch (a pipeline of one stage, ``C`` micro-batches on the
    sequence dim, piece ``r`` on ``devices[r*T:(r+1)*T]``), attention's keys and values gathered
    across the pieces, each tensor-parallel shard gathering its own heads. With ``{"dp": D}`` beside
    them, ``D`` copies of that program (the batch split first, ``passes.split_batch_into_copies``):
    ``dp_devices`` lists every copy's pieces, copy ``d``'s piece ``c`` at ``d*C + c``."""
    devices, shards = arguments["devices"], target.size("tp")
    count = target.size("dp") * target.size("cp")  # with dp: copy d's piece c is piece d*C + c
    pieces = [Devices(tuple(devices[r * shards : (r + 1) * shards])) for r in range(count)]
    dp_devices = tuple(tuple(piece.strings()) for piece in pieces)
    check_copy_devices(dp_devices, layout=target.layout)
    check_virtual_copies(dp_devices, layout=target.layout)
    return {**arguments, "devices": pieces[0], "pipeline": 1, "micro_batches": target.size("cp"), "dp_copies": len(pieces),
            "dp_devices": dp_devices, "sequence_copies": target.size("dp")}  # fmt: skip


def stages_over_cp(target: Target, arguments: dict[str, Any], micro_batches: int) -> dict[str, Any]:
    """``{"pp": S, "cp": C}`` (and ``"tp"``): the pipeline split into ``C`` pieces along the sequence,
    its micro-batches (a pipeline of ``S`` stages, piece ``c`` on the devices of ``cp`` index ``c``:
    stage ``s``'s piece ``c`` on its own device, ``devices[s*C + c]`` without tp), each stage's
    attention gathering keys and values across that stage's pieces."""
    if micro_batches != 1:
        raise DpCompileError(
            f"mesh={target.layout} with micro_batches={micro_batches}: a pipeline with 'cp' runs the pieces of the "
            "sequence as its micro-batches (each stage's attention gathers every piece's keys and values), and "
            "micro-batches of the batch beside them are not built yet: leave micro_batches= out"
        )
    pieces = dp_copies(target, "cp")
    dp_devices = tuple(tuple(piece.strings()) for piece in pieces)
    check_copy_devices(dp_devices, layout=target.layout)
    check_virtual_copies(dp_devices, layout=target.layout)
    return {**arguments, "devices": pieces[0], "micro_batches": len(pieces), "dp_copies": len(pieces),
            "dp_devices": dp_devices}  # fmt: skip


def check_copy_devices(dp_devices: Sequence[Sequence[str]], *, layout: Mapping[str, int] | None = None) -> None:
    """Each copy's devices must follow from copy 0's: copy 0's device ``d`` is one device in copy
    ``r`` (a program addresses devices by name, so one name cannot stand for two)."""
    for r, copy in enumerate(dp_devices[1:], start=1):
        seen: dict[str, str] = {}
        for own, other in zip(dp_devices[0], copy):
            if seen.setdefault(own, other) != other:
                raise DpCompileError(
                    f"mesh={dict(layout or {})}: dp copy 0 runs on {list(dp_devices[0])} and copy {r} on {list(copy)}; "
                    f"copy 0 repeats {own!r} where copy {r} uses {seen[own]!r} and {other!r}, so the copies cannot be "
                    "placed by device name: give every dp copy the same pattern of devices (e.g. ['cpu'] * n, or "
                    "distinct devices throughout)"
                )


def check_virtual_copies(dp_devices: Sequence[Sequence[str]], *, layout: Mapping[str, int]) -> None:
    """dp copies of a context-parallel program (or cp's pieces of a tensor-parallel program or of a
    pipeline) run on the same devices as copy 0 (virtual devices, ``["cpu"] * n`` or one GPU repeated): copies on devices
    of their own are not placed yet."""
    for r, copy in enumerate(dp_devices[1:], start=1):
        if tuple(copy) != tuple(dp_devices[0]):
            raise DpCompileError(
                f"mesh={dict(layout)}: copy 0 runs on {list(dp_devices[0])} and copy {r} on {list(copy)}; cp composed "
                "with dp, tp or pp in one process runs every copy on the same devices for now (virtual devices: ['cpu'] * n, "
                "or one GPU repeated): repeat copy 0's devices, or use mesh={'cp': N} alone on distinct devices"
            )


def check_virtual_pieces(pieces: Sequence[str], *, layout: Mapping[str, int]) -> None:
    """dp copies of a context-parallel program keep every piece of the sequence on one device: the split
    into copies scatters each copy's rows onto its first device (pieces on devices of their own are not
    placed yet)."""
    if len(set(pieces)) > 1:
        raise DpCompileError(
            f"mesh={dict(layout)}: copy 0's pieces of the sequence run on {list(pieces)}; dp copies of a cp program "
            "are built on virtual devices only for now (['cpu'] * n, or one GPU repeated): repeat one device, or use "
            "mesh={'cp': N} alone on distinct devices"
        )


def _counting(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Every index of a grid of ``sizes``, last dimension fastest."""
    indices: list[tuple[int, ...]] = [()]
    for size in sizes:
        indices = [index + (k,) for index in indices for k in range(size)]
    return indices


def resolve_target(
    devices: Any, mesh: Mapping[str, int] | None, *, pipeline: Any, tensor_parallel: Any
) -> Target | None:
    """The target of ``transform(model, devices, mesh=...)``, checked: names, sizes, their product,
    and agreement with ``pipeline=`` / ``tensor_parallel=``. None when ``mesh=`` is not given (the
    older keywords then build the layout, see :func:`sugar_layout`)."""
    if mesh is None:
        return None
    if is_device_mesh(devices):
        raise ArgumentError(
            "mesh= names the dimensions of a device list; a DeviceMesh names its own (mesh_dim_names=('pp', 'dp', "
            "'tp')): pass one or the other"
        )
    if not isinstance(mesh, Mapping) or not mesh:
        raise ArgumentError(f"mesh= takes a dict of dimension sizes, outermost first, e.g. {{'dp': 2, 'tp': 2}}; got {mesh!r}")
    dims = []
    for name, size in mesh.items():
        if name not in DIMENSIONS:
            raise ArgumentError(f"mesh= dimension {name!r} is not one of {list(DIMENSIONS)} ({_spelled_dimensions()})")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ArgumentError(f"mesh= dimension {name!r} has size {size!r}; sizes are positive ints")
        dims.append((name, size))
    parsed = parse_devices(devices)
    product = math.prod(size for _, size in dims)
    if product != len(parsed):
        arithmetic = " x ".join(f"{name}({size})" for name, size in dims)
        raise ArgumentError(
            f"mesh={dict(mesh)} lays out {arithmetic} = {product} devices, but {len(parsed)} were given; "
            f"pass {product} devices or sizes whose product is {len(parsed)}"
        )
    target = Target(tuple(dims), parsed, _stage_paths(pipeline, dict(dims)), _plan(tensor_parallel, dict(dims)))
    check_built(target.active, over_mesh=False, layout=target.layout)
    return target


def _stage_paths(pipeline: Any, layout: dict[str, int]) -> tuple[str, ...] | None:
    if pipeline is None:
        return None
    stages = layout.get("pp", 1)
    if isinstance(pipeline, (list, tuple)) and len(pipeline) + 1 == stages:
        return tuple(pipeline)
    if isinstance(pipeline, int) and not isinstance(pipeline, bool) and pipeline == stages:
        return None
    count = len(pipeline) + 1 if isinstance(pipeline, (list, tuple)) else pipeline
    raise ArgumentError(
        f"pipeline={pipeline!r} makes {count} stages but mesh= has 'pp': {stages}; leave pipeline= out (the mesh "
        "says how many stages) or give it the module paths of the pp-1 cuts"
    )


def _plan(tensor_parallel: Any, layout: dict[str, int]) -> bool | dict[str, str]:
    wants = tensor_parallel is not None and tensor_parallel is not False
    if wants and layout.get("tp", 1) == 1:
        raise ArgumentError(
            f"tensor_parallel= shards layers over the mesh's 'tp' dimension, and mesh={layout} has none (or size 1); "
            "add one, e.g. mesh={'tp': 2}"
        )
    return tensor_parallel if wants else False


def sugar_layout(n_devices: int, *, pipeline: Any, tensor_parallel: Any) -> dict[str, int]:
    """The layout the older keywords spell: ``pipeline=S`` with ``tensor_parallel=`` on ``S*T``
    devices is ``{"pp": S, "tp": T}``; ``tensor_parallel=`` alone ``{"tp": n}``; neither ``{"dp": n}``."""
    wants_tp = tensor_parallel is not None and tensor_parallel is not False
    if pipeline is not None:
        stages = len(pipeline) + 1 if isinstance(pipeline, (list, tuple)) else int(pipeline)
        if wants_tp and stages and n_devices % stages == 0:
            return {"pp": stages, "tp": n_devices // stages}
        return {"pp": stages}
    return {"tp": n_devices} if wants_tp else {"dp": n_devices}


def mesh_layout(mesh: Any, *, pipeline: Any, tensor_parallel: Any) -> dict[str, int]:
    """The layout of a ``DeviceMesh``: its named dimensions, or for an unnamed 1-D mesh the role
    the keywords give it."""
    names = tuple(mesh.mesh_dim_names or ())
    shape = tuple(mesh.mesh.shape)
    if mesh.ndim == 1 and (not names or pipeline is None) and names != ("cp",):
        wants_tp = tensor_parallel is not None and tensor_parallel is not False
        role = "pp" if pipeline is not None else "tp" if wants_tp else "dp"
        return {role: shape[0]}
    return dict(zip(names, shape))


def check_built(active: set[str], *, over_mesh: bool, layout: Mapping[str, int]) -> None:
    """Refuse, by name, a layout that is not built yet, naming the nearest one that is."""
    built = BUILT_OVER_MESH if over_mesh else BUILT_ONE_PROCESS
    if not active or active in built:
        return
    where = "over a DeviceMesh" if over_mesh else "in one process"
    if over_mesh and (why := _not_built_over_mesh(active)) is not None:
        raise DpCompileError(f"the layout {dict(layout)} ({_describe(active)}) is not built {where} yet: {why}")
    if "cp" in active:
        nearest = (
            "mesh={'cp': N} in one process, with 'dp' or 'tp' or both beside it ({'dp': D, 'cp': N, 'tp': T}), or "
            "with 'pp' ({'pp': S, 'cp': N} or {'pp': S, 'cp': N, 'tp': T}: each stage's pieces of the sequence on its "
            "own devices; no 'dp' beside 'pp' and 'cp' yet), a ('cp',) or ('dp', 'cp') DeviceMesh (parameters "
            "replicated, or data_parallel='fsdp': sharded over every rank), a ('cp', 'tp') DeviceMesh with "
            "tensor_parallel=, or leave 'cp' out: the sequence then stays whole on each device"
        )
    else:
        nearest = (
            "a ('pp', 'dp') or ('pp', 'tp') DeviceMesh, ('dp', 'tp') without a pipeline, or the same layout over a "
            "device list in one process (mesh={'pp': ..., 'dp': ..., 'tp': ...})"
        )
    raise DpCompileError(f"the layout {dict(layout)} ({_describe(active)}) is not built {where} yet; use {nearest}")


def _not_built_over_mesh(active: set[str]) -> str | None:
    """Why a layout with ``cp`` is not built over a mesh, and the nearest layouts that are, or None."""
    if active == {"dp", "cp", "tp"}:
        return (
            "the ('cp', 'tp') rank program takes each rank's part of the sequence of the whole batch and DDP sums its "
            "gradients over 'cp' on each tp rank's shards; nothing yet cuts each dp rank's rows before its part of the "
            "sequence and averages over 'dp' and 'cp' together beside 'tp' (the ('dp', 'cp') program does, without "
            "shards). Use a ('cp', 'tp') DeviceMesh (without 'dp'), a ('dp', 'cp') one (without 'tp'), or "
            "mesh={'dp': D, 'cp': N, 'tp': T} over a device list in one process"
        )
    if {"pp", "cp"} <= active:
        return (
            "over a mesh each stage runs on its own ranks under torch.distributed.pipelining, one micro-batch at a "
            "time, and a stage's attention would exchange keys and values with the stage's other cp ranks inside "
            "each schedule step, which is not built. Use a ('pp',) DeviceMesh (the sequence whole on each stage), a "
            "('cp',) or ('cp', 'tp') one (no pipeline), or mesh={'pp': S, 'cp': N} (or with 'tp') over a device list "
            "in one process (GPipe)"
        )
    return None


def _describe(active: set[str]) -> str:
    return " x ".join(DIMENSIONS[name] for name in CANONICAL_ORDER if name in active)


def _spelled_dimensions() -> str:
    return ", ".join(f"{name}: {what}" for name, what in DIMENSIONS.items())


def strategies_of(layout: Mapping[str, int], *, data_parallel: str, schedule: str) -> dict[str, str]:
    """What each dimension of ``layout`` does: ``{"pp": "pipeline (gpipe)", "tp": "tensor parallel"}``."""
    named = {}
    for name, size in layout.items():
        if name == "pp":
            named[name] = f"pipeline ({schedule})"
        elif name == "cp":
            named[name] = "context parallel (all-gather keys/values)"
        elif name == "dp":
            named[name] = "data parallel (fsdp)" if data_parallel == "fsdp" else "data parallel (replicate)"
        else:
            named[name] = DIMENSIONS[name]
        if size == 1:
            named[name] += " (size 1: nothing split)"
    return named


__all__ = [
    "BUILT_ONE_PROCESS",
    "BUILT_OVER_MESH",
    "CANONICAL_ORDER",
    "DIMENSIONS",
    "Target",
    "check_built",
    "check_copy_devices",
    "check_virtual_copies",
    "check_virtual_pieces",
    "shards_over_cp",
    "stages_over_cp",
    "dp_copies",
    "mesh_layout",
    "replicate_over_dp",
    "resolve_target",
    "strategies_of",
    "sugar_layout",
]
