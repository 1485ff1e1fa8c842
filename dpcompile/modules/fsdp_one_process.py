"""FSDP in one process: each parameter stored as ``D`` shards, one per ``dp`` copy, gathered where it is read.

``transform(model, ["cpu"] * 2, data_parallel="fsdp")`` (and ``mesh={"dp": 2, "tp": 2}`` with it)
builds the program as for replication, then :func:`shard_over_dp` stores each parameter (a whole
one, or a tensor-parallel shard) as ``D`` pieces, piece ``r`` on copy ``r``'s device: ZeRO-3 on
the dp devices. The pieces are the only stored copy; reading the parameter gathers them (``cat``
of the pieces moved to the parameter's device), and autograd of that gather sums every copy's
gradient into each piece (a reduce-scatter), so the optimizer steps on the pieces and its state
is sharded too.

Before (``mesh={"dp": 2}``)::

    pm.named_parameters()   # fc1.weight (16, 8) on cpu

After::

    pm.named_parameters()   # fc1.parametrizations.weight.original0 (8, 8) on copy 0's device
                            # fc1.parametrizations.weight.original1 (8, 8) on copy 1's device
    pm.state_dict()         # {"fc1.weight": the whole (16, 8) tensor, ...}: the model's keys

A whole parameter splits along dim 0; a tensor-parallel shard along its own split dim (by
sections for a fused qkv), so each key is one :class:`ShardSpec` of ``T x D`` pieces and the
checkpoint code reads and writes the pieces as it does tensor-parallel shards. Uneven sizes are
balanced as ``tensor_split`` balances them (no padding). A 0-dim parameter stays whole on copy 0, and so
does one that forward writes in place (``nn.Embedding(max_norm=...)`` renormalises the rows it looks up;
``with torch.no_grad(): w.mul_(0.9)``): a write into the gathered whole would be lost with it; and
the weight of a ``sparse=True`` embedding, whose sparse gradient cannot flow back through the gather.

``torch.save(pm)``, ``copy.deepcopy(pm)`` and ``dpcompile.export(pm, folder)`` write the replicated
program (whole tensors) and shard it again where it is restored (:mod:`dpcompile.modules.fsdp_portable`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from dpcompile.errors import DpCompileError
from dpcompile.modules.carried import CarriedPrograms
from dpcompile.modules.fsdp_gather import GATHERED, GatherShards, gathered_once_per_device, regathered
from dpcompile.modules.fsdp_portable import replicated_extra_state, replicated_state
from dpcompile.modules.pickling import refuses_corrupt_state, restore_parallel_module
from dpcompile.modules.weights import refuse_copy_without_weights
from dpcompile.program_cache import ProgramCache
from dpcompile.runtime.tensor_parallel import ShardSpec


class FsdpProgram:
    """A program sharded over ``dp`` in one process (its state: ``pm.param_shards``, the model's keys
    whole, as :mod:`dpcompile.modules.sharded_state` gives them): one gather a parameter a call."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.call_context():
            return super().__call__(*args, **kwargs)  # type: ignore[misc]

    @contextlib.contextmanager
    def call_context(self) -> Iterator[None]:
        """What a call's forward runs in (``dpcompile.measure`` runs the program node by node inside it
        too): one gather a parameter a call, however many copies and micro-batches read it, held until
        the call returns; what autograd saves of a gathered parameter gathered again in backward."""
        with regathered(), gathered_once_per_device():
            yield

    def _build_program(self, key: Any, args: tuple, kwargs: dict) -> Any:
        """The program for another call (a batch smaller than the dp copies, the other mode), reading
        the pieces at each call as the main program does (:func:`read_pieces_live`)."""
        program = super()._build_program(key, args, kwargs)  # type: ignore[misc]
        if program is not None:
            read_pieces_live(self, program)  # type: ignore[arg-type]
        return program

    def _adopt_model_state(self) -> None:
        """A submodule or parameter replaced after transform holds no pieces: refused, not run on the old ones."""
        super()._adopt_model_state()  # type: ignore[misc]
        held = {name for name, _ in self.named_parameters(remove_duplicate=False)}  # type: ignore[attr-defined]
        lost = [piece for piece in self.__dict__.get("fsdp_pieces", {}) if piece not in held]
        if lost:
            raise DpCompileError(
                f"a submodule or parameter of this data_parallel='fsdp' program was replaced or removed after transform "
                f"({lost[0].split('.parametrizations.')[0]!r}): its parameters are stored as pieces, made at transform; "
                "change the model and call dpcompile.transform again"
            )

    @property
    def code(self) -> str:
        """The program as Python, headed by the gathers: which pieces make each parameter, where."""
        return f"{gathers_note(self)}\n{super().code}"  # type: ignore[misc]

    def __reduce__(self) -> Any:
        """Pickled as the replicated program it was sharded from, sharded again where it is loaded
        (:mod:`dpcompile.modules.fsdp_portable`)."""
        refuse_copy_without_weights(self)  # type: ignore[arg-type]
        self._executor.check_picklable(self)  # type: ignore[attr-defined]
        return restore_fsdp_program, replicated_state(self, replicated_class(self), carry_programs=True)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """An independent copy, made as unpickling makes one (its own pieces)."""
        refuse_copy_without_weights(self)  # type: ignore[arg-type]
        traceable = self.__dict__.get("traced_model") is not None  # the copy traces what it needs
        state = replicated_state(self, replicated_class(self), carry_programs=not traceable, in_memory=True)
        return restore_fsdp_program(*state)

    def _extra_state_for_pickle(self) -> dict[str, Any]:
        """The replicated program's: its tensor-parallel shards, not the pieces (sharded again when restored)."""
        return replicated_extra_state(self)


def replicated_class(pm: Any) -> type:
    """The class of the program ``pm`` was before sharding (``ParallelModule``'s fx subclass; not
    torch's ``Parametrized<class>`` a parameter of the root itself made it)."""
    return next(c for c in type(pm).__mro__ if not issubclass(c, FsdpProgram) and c.__module__ != parametrize.__name__)


def replicated_program(pm: Any) -> Any:
    """A copy of the replicated program ``pm`` was sharded from: whole parameters (what export writes)."""
    return restore_parallel_module(*replicated_state(pm, replicated_class(pm), carry_programs=True))


@refuses_corrupt_state
def restore_fsdp_program(cls: type, state: dict[str, Any]) -> Any:
    """The replicated program ``state`` describes (unpickling), sharded over ``dp`` again."""
    pm = restore_parallel_module(cls, state)
    shard_over_dp(pm)
    if state.get("stale_main") and pm.traced_model is not None:  # keyed again by sharding: pm.graph is still stale
        pm.program_cache.main_key = pm.program_cache.main_key._replace(guard=-1)
    return pm


def gathers_note(pm: nn.Module) -> str:
    """One comment line per gathered parameter::

        # fc1.weight = gather(original0 on cpu:0, original1 on cpu:1, dim 0) on cpu:0
    """
    lines = ['# data_parallel="fsdp": each parameter is stored as pieces, gathered where the code reads it']
    for path, module in pm.named_modules():
        if isinstance(module, GatherShards):
            owner, _, leaf = path.rpartition(".")[0].partition(".parametrizations.")
            pieces = ", ".join(f"original{r} on {d}" for r, d in enumerate(module.piece_devices))
            lines.append(f"# {owner}.{leaf} = gather({pieces}, dim {module.spec.dim}) on {module.device}")
    return "\n".join(lines)


def balanced(size: int, parts: int) -> tuple[int, ...]:
    """``size`` in ``parts`` as ``tensor_split`` cuts it: the first ``size % parts`` one larger.

    >>> balanced(10, 4)
    (3, 3, 2, 2)
    """
    return tuple(size // parts + (1 if r < size % parts else 0) for r in range(parts))


def dp_spec(shape: Sequence[int], copies: int, outer: ShardSpec | None) -> ShardSpec:
    """How a parameter of ``shape`` (a tensor-parallel shard under ``outer``, or whole) splits
    over ``copies``: along ``outer``'s dim and by its sections, else along dim 0."""
    dim, sections = (outer.dim, outer.sections) if outer is not None else (0, 1)
    return ShardSpec(dim, tuple(n * sections for n in balanced(shape[dim] // sections, copies)), sections)


def copy_devices(pm: nn.Module) -> list[dict[str, str]]:
    """For each dp copy ``r``: ``{device of copy 0: device of copy r}``."""
    dp_devices = getattr(pm.recipe, "dp_devices", None)
    if dp_devices is None:  # dp alone: each device is a copy, the program's parameters on the first
        first = str(pm.devices.primary)
        return [{first: str(d)} for d in pm.devices]
    return [dict(zip(dp_devices[0], copy)) for copy in dp_devices]


def program_device(pm: Any, name: str, p: torch.Tensor) -> str:
    """The device the program places parameter ``name`` on (``cpu:1`` where ``p.device`` says only
    ``cpu``): its tensor-parallel slot, else its pipeline stage's first device, else the first device."""
    slot = (getattr(pm, "shard_param_slots", None) or {}).get(name)
    if slot is not None:
        return str(pm.devices[slot])
    # the program's own attributes, not a submodule the model names ``stages`` (timm's MetaFormer)
    groups = pm.__dict__.get("stage_groups")
    stages = list(pm.__dict__.get("stages") or ())
    k = stage_holding(name, [stage.module_paths for stage in stages])
    if k is not None:
        stage = stages[k]
        return groups[stage.index][0] if groups else stage.device
    return str(pm.devices.primary) if p.device.type == pm.devices.primary.type else str(p.device)


def stage_holding(name: str, module_paths: Sequence[Sequence[str]]) -> int | None:
    """The index of the stage whose module paths hold parameter ``name``: the one of the longest path
    that owns it (torchvision's ViT: stage 0 runs ``encoder``, whose own ``pos_embedding`` it holds, and
    stage 1 ``encoder.layers.encoder_layer_2``...: the first match put every encoder layer on stage 0);
    None where none does."""
    best, found = -1, None
    for k, paths in enumerate(module_paths):
        for path in paths:
            if name.startswith(f"{path}.") and len(path) > best:
                best, found = len(path), k
    return found


def own_parametrized_class(module: nn.Module) -> None:
    """Give a module the user parametrized (``weight_norm``) a class of its own before a gather is
    registered on it: its class is shared with the model's module it was copied from (deepcopy
    keeps it), and registering adds a property to the class, which the model's module would then
    read without the parametrization behind it (``KeyError: 'bias'`` in the user's own model)."""
    if parametrize.is_parametrized(module):
        cls = type(module)
        namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
        module.__class__ = type(cls.__name__, cls.__bases__, namespace)


def shard_over_dp(pm: nn.Module) -> None:
    """Store every parameter of ``pm`` as one piece per dp copy (see the module docstring)."""
    copies = copy_devices(pm)
    tp_shards: Mapping[str, tuple[ShardSpec, list[str]]] = dict(getattr(pm, "param_shards", None) or {})
    state_keys = list(pm.state_keys) if hasattr(pm, "state_keys") else list(pm.state_dict().keys())
    outer_of = {name: spec for spec, names in tp_shards.values() for name in names}
    # the order a copy of the replicated program holds them in (dpcompile.modules.fsdp_portable)
    pm.__dict__["replicated_parameter_names"] = [name for name, _ in pm.named_parameters(remove_duplicate=False)]
    by_tensor: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in pm.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
        params[id(p)] = p
    pieces_of: dict[str, tuple[ShardSpec, list[str]]] = {}
    # a sparse embedding's gradient cannot flow back through the gather (no as_strided for sparse)
    written = written_in_forward(pm) | {id(m.weight) for m in pm.modules() if getattr(m, "sparse", False) is True}
    for key, names in by_tensor.items():
        p = params[key]
        if p.dim() == 0 or key in written:
            continue
        spec = dp_spec(p.shape, len(copies), outer_of.get(names[0]))
        device = program_device(pm, names[0], p)
        gather = GatherShards(spec, [copy.get(device, device) for copy in copies], device)
        shared = None
        for name in names:
            path, _, leaf = name.rpartition(".")
            module = pm.get_submodule(path)
            own_parametrized_class(module)
            parametrize.register_parametrization(module, leaf, gather, unsafe=True)
            if shared is None:
                shared = module.parametrizations[leaf]
            else:  # a tied parameter: every module reads the same pieces
                module.parametrizations[leaf] = shared
            if not path:
                _read_pieces_in_traced_root(pm, leaf, gather, shared)
            prefix = f"{path}." if path else ""
            pieces_of[name] = (spec, [f"{prefix}parametrizations.{leaf}.original{r}" for r in range(len(copies))])
    param_shards: dict[str, tuple[ShardSpec, list[str]]] = {}
    for key in state_keys:
        if key in tp_shards:
            param_shards[key] = combined(tp_shards[key], pieces_of)
        elif key in pieces_of:
            param_shards[key] = pieces_of[key]
    if not isinstance(pm, FsdpProgram):
        pm.__class__ = type(f"Fsdp{type(pm).__name__}", (FsdpProgram, type(pm)), {})
    pm.state_keys = state_keys
    pm.param_shards = param_shards
    if isinstance(getattr(pm, "shard_param_slots", None), dict):  # each piece on its parameter's slot
        slot_of = dict(pm.shard_param_slots)
        pm.__dict__["_tp_shard_param_slots"] = slot_of  # what a copy of the replicated program holds
        piece_slots = {piece: slot_of.get(n) for n, (_, pieces) in pieces_of.items() for piece in pieces}
        pm.shard_param_slots = {n: piece_slots.get(n, slot_of.get(n)) for n, _ in pm.named_parameters()}
    pm.__dict__["fsdp_pieces"] = {
        piece: (r, name) for name, (_, names) in pieces_of.items() for r, piece in enumerate(names)
    }  # how explain counts what each copy holds (analysis.program_memory.held_parameter_bytes)
    pm.__dict__["_tp_param_shards"] = dict(tp_shards)  # what a variant traced again must shard as
    _key_again(pm)


def read_pieces_live(pm: nn.Module, program: nn.Module) -> None:
    """``fx.GraphModule(pm, graph)`` copies each ``get_attr`` target's value: a parameter stored as
    pieces would be copied as the tensor gathered at that moment (a buffer, stale after the first
    optimizer step). The program reads the module that holds the pieces instead, gathering them at
    each call.

    Before::  program.b.weight_shard0      # a buffer: the whole of b.weight_shard0 when it was built
    After::   program.b is pm.b            # the gather of b's pieces, every call
    """
    for node in program.graph.nodes:  # type: ignore[union-attr]
        if node.op != "get_attr" or not isinstance(node.target, str):
            continue
        path, _, leaf = node.target.rpartition(".")
        try:
            owner = pm.get_submodule(path)
        except AttributeError:
            continue
        if not parametrize.is_parametrized(owner, leaf):
            continue
        if path:
            program.set_submodule(path, owner)
        elif not parametrize.is_parametrized(program, leaf):  # the root's own parameter (ViT's pos_embed)
            own_parametrized_class(program)
            parametrize.register_parametrization(program, leaf, nn.Identity(), unsafe=True)
            program.parametrizations[leaf] = owner.parametrizations[leaf]


def written_in_forward(pm: nn.Module) -> set[int]:
    """The ids of the parameters ``pm``'s forward writes in place: the weight of an embedding with
    ``max_norm`` (torch renormalises the rows it looks up, under ``no_grad``) and each parameter an
    ``in_place_without_grad`` write of the program (or of a pipeline's stage programs) lands on."""
    from torch import fx

    from dpcompile.runtime.side_effects import in_place_without_grad

    written = {id(m.weight) for m in pm.modules()
               if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None}  # fmt: skip
    programs = [m for m in (pm, *pm.modules(), *(pm.__dict__.get("stages") or ())) if isinstance(m, fx.GraphModule)]
    for gm in programs:
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target is not in_place_without_grad:
                continue
            while getattr(node, "op", None) == "call_function" and node.target is in_place_without_grad:
                node = node.args[0]
            if getattr(node, "op", None) == "get_attr":
                try:
                    written.add(id(gm.get_parameter(str(node.target))))
                except AttributeError:
                    pass  # a buffer or a constant: not a parameter FSDP splits
    return written


def _read_pieces_in_traced_root(pm: Any, leaf: str, gather: GatherShards, pieces: nn.Module) -> None:
    """A parameter of the model's root (ViT's ``pos_embed``): the private copy of the root that a
    program for another call is traced from (``pm.traced_model``, the other mode) reads the same
    pieces, not the whole parameter it held before the pieces were made (stale after a step)."""
    traced = pm.__dict__.get("traced_model")
    if isinstance(traced, nn.Module) and traced is not pm and leaf in traced._parameters:
        own_parametrized_class(traced)
        parametrize.register_parametrization(traced, leaf, gather, unsafe=True)
        traced.parametrizations[leaf] = pieces


def _key_again(pm: Any) -> None:
    """The guard and the main program's key read again: the pieces changed the modules it watches."""
    if isinstance(pm.program_cache.build, CarriedPrograms):  # a restored program runs what it carries, as keyed,
        pm.program_cache.build.finish = functools.partial(read_pieces_live, pm)  # each reading the pieces
    else:
        main = pm.program_cache.main_key
        pm._attach_cache(pm.traced_model, dict(pm._flags), main.none_args, pm._shares_source)
        key = pm._key(main.devices, main.none_args, main.flags, main.batched)
        object.__setattr__(pm, "program_cache", ProgramCache(key, pm._build_program))
    if (exported := pm.__dict__.get("_exported_check")) is not None:  # a program export captured: its check too
        exported.read_again()


def tensor_parallel_shards(pm: Any) -> dict[str, tuple[ShardSpec, list[str]]]:
    """``pm``'s tensor-parallel shards as its program reads them (before FSDP split them into pieces)."""
    return pm.__dict__.get("_tp_param_shards", pm.param_shards)


def combined(
    tp: tuple[ShardSpec, list[str]], pieces_of: Mapping[str, tuple[ShardSpec, list[str]]]
) -> tuple[ShardSpec, list[str]]:
    """A tensor-parallel key whose shards are each split over dp: one spec of ``T x D`` pieces,
    shard-major (each piece still its part of every section of a fused qkv)."""
    spec, names = tp
    if not all(name in pieces_of for name in names):
        return tp
    sizes = tuple(size for name in names for size in pieces_of[name][0].sizes)
    return ShardSpec(spec.dim, sizes, spec.sections), [piece for name in names for piece in pieces_of[name][1]]


__all__ = [
    "GATHERED", "FsdpProgram", "GatherShards", "balanced", "combined", "copy_devices", "dp_spec", "gathers_note", "program_device",
    "regathered", "replicated_class", "replicated_program", "restore_fsdp_program", "shard_over_dp", "stage_holding",
    "tensor_parallel_shards",
]  # fmt: skip
