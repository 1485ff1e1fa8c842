"""One rank's program over a DeviceMesh (``transform(model, mesh)``): a ``ParallelModule`` holding
an :class:`SpmdExecutor` and the mesh (:func:`hold_mesh`).

Built by :class:`~dpcompile.recipes.spmd.SpmdRecipe`. Where the mesh has a data-parallel
dimension the program runs under ``DistributedDataParallel`` (``pm.ddp``), which averages
gradients across processes, or FSDP2 (``pm.fsdp``); with tensor parallelism ``state_dict()``
all-gathers full tensors under the original keys (a collective: call it on every rank) and
``load_state_dict()`` keeps this rank's shard.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from dpcompile.analysis.random_ops import scoped_module_paths
from dpcompile.errors import ArgumentError, first_line
from dpcompile.fx_utils import placeholders, unalias
from dpcompile.mesh import local_device
from dpcompile.modules.executors import PlainExecutor
from dpcompile.modules.mesh_exported_inputs import check_exported_inputs_over_mesh
from dpcompile.modules.spmd_exchange import start_exchange
from dpcompile.modules.weights import NEEDS_WEIGHTS, weights_not_loaded
from dpcompile.runtime.distributed import (
    CollectiveError,
    MeshGroup,
    all_gather,
    collective_failure,
    defer_to_next_collective,
    settle_deferred_check,
)
from dpcompile.runtime.dtensor_gather import full_tensors
from dpcompile.runtime.structures import is_fake, tensor_leaves
from dpcompile.runtime.tensor_parallel import ShardSpec, regroup_sections, shard_of

log = logging.getLogger("dpcompile")


class _LocalProgram(nn.Module):
    """What DDP wraps: runs the program of ``pm`` a call takes (not ``pm.__call__``, which is DDP's)."""

    def __init__(self, program: Any):
        super().__init__()
        self.program = program

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        pm = self.program
        return pm.run_program(pm.program_for_call(*args, **kwargs), args, kwargs)


def hold_mesh(
    pm: Any,
    *,
    mesh: Any,
    dp_dim: str | int | None,
    tp_dim: str | int | None,
    shards: Mapping[str, ShardSpec] | None = None,
    ddp_options: Mapping[str, Any] | None = None,
    fsdp: Mapping[str, Any] | None = None,
) -> None:
    """Make ``pm`` one rank's program over ``mesh``: hold the mesh and this rank's shards (``pm.shards``
    ``{state key: ShardSpec}``) and an :class:`SpmdExecutor`; build DDP where there is a data-parallel
    dim (``pm.ddp``), or FSDP2 (``fsdp``: ``fully_shard``'s keyword arguments; ``pm.fsdp``) where asked.

    ``pm.mode`` is ``"spmd_data_parallel"``, ``"spmd_tensor_parallel"``, ``"spmd_2d"`` or
    ``"spmd_context_parallel"`` (DDP over ``"cp"``, or over ``"dp_cp"``, the flattened ``("dp", "cp")`` mesh)
    or ``"spmd_context_tensor_parallel"`` (a ``("cp", "tp")`` mesh, DDP over ``"cp"``).

    >>> pm = dpcompile.transform(model, mesh)   # doctest: +SKIP
    >>> with pm.no_sync():                      # accumulate without all-reducing  # doctest: +SKIP
    ...     pm(x).sum().backward()
    """
    pm.__dict__["mesh"] = mesh
    pm.dp_dim = dp_dim
    pm.tp_dim = tp_dim
    pm.shards = dict(shards or {})
    pm.__dict__["_executor"] = SPMD
    pm.__dict__["_ddp"] = None
    fake = any(is_fake(p) for p in pm.parameters())  # a meta model's: DDP/FSDP are built once they have memory
    pm.__dict__["_fsdp"] = None
    if dp_dim is not None and not fake and fsdp is not None:
        pm.__dict__["_fsdp"] = build_fsdp(pm, mesh, dp_dim, fsdp)
    elif dp_dim is not None and not fake and any(p.requires_grad for p in pm.parameters()):
        pm.__dict__["_ddp"] = build_ddp(pm, mesh, dp_dim, ddp_options or {})


def _dp_wrapper(pm: Any) -> nn.Module | None:
    """The DDP or FSDP2 root that runs a call over the mesh's dp dimension (None without one)."""
    return pm.__dict__.get("_ddp") or pm.__dict__.get("_fsdp")


class SpmdExecutor(PlainExecutor):
    """One rank's program over a DeviceMesh (``transform(model, mesh)``), run under
    ``DistributedDataParallel`` (``pm.ddp``) or FSDP2 (``pm.fsdp``) where the mesh has a data-parallel
    dimension; every call first checks that the ranks of a group call alike (``pm.check_inputs``).
    With tensor parallelism ``state_dict()`` all-gathers full tensors under the original keys (a
    collective: call it on every rank) and ``load_state_dict()`` keeps this rank's shard."""

    def __call__(self, pm: Any, *args: Any, **kwargs: Any) -> Any:
        if pm.__dict__.get(NEEDS_WEIGHTS):  # before DDP, which calls the program directly
            raise weights_not_loaded(pm)
        check_exported_inputs_over_mesh(pm, args, kwargs)  # before any collective: every rank alike
        ddp = _dp_wrapper(pm)
        if pm.check_inputs:
            if pm.__dict__.get("tp_dim") is not None:
                # tensor parallel alone: the check's all-gather runs while the program computes up to its
                # first collective, which waits for it (so mismatched shapes never reach a collective)
                deferred = ddp is None and pm.__dict__.get("_compiled_call_impl") is None
                check_inputs_agree(pm, args, kwargs, defer=deferred)
                if deferred:
                    return self._call_with_deferred_check(pm, args, kwargs)
            elif ddp is not None:
                check_calls_agree(pm, args, kwargs)
        if ddp is None:
            return super().__call__(pm, *args, **kwargs)
        try:
            return ddp(*args, **kwargs)
        except CollectiveError:
            raise
        except (RuntimeError, dist.DistError) as e:
            if not is_communication_failure(e):
                raise
            raise CollectiveError(
                f"DistributedDataParallel's communication failed on global rank {dist.get_rank()}: another "
                "rank most likely raised, exited or timed out first — see its log for the first error. Pass "
                f"timeout= to torch.distributed.init_process_group to fail sooner. ({first_line(e)})"
            ) from e

    def _call_with_deferred_check(self, pm: Any, args: tuple, kwargs: dict) -> Any:
        """Run the program; the input check deferred to its first collective is settled by the end,
        and where the program failed first (one rank's shapes broke its local work), the check's
        ``ValueError`` is what every rank raises."""
        try:
            out = super().__call__(pm, *args, **kwargs)
        except BaseException as failure:
            try:
                settle_deferred_check()
            except ValueError as disagreement:
                raise disagreement from failure
            raise
        settle_deferred_check()
        return out

    def call_runs_under_dp(self, pm: Any) -> bool:
        return _dp_wrapper(pm) is not None

    def call_runs_under_fsdp(self, pm: Any) -> bool:
        return pm.__dict__.get("_fsdp") is not None

    @contextlib.contextmanager
    def no_sync(self, pm: Any) -> Iterator[None]:
        ddp, fsdp = pm.__dict__.get("_ddp"), pm.__dict__.get("_fsdp")
        if fsdp is not None:
            fsdp.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                fsdp.set_requires_gradient_sync(True)
            return
        if ddp is None:
            yield
            return
        with ddp.no_sync():
            yield

    def train(self, pm: Any, mode: bool) -> None:
        ddp = pm.__dict__.get("_ddp")
        if ddp is not None:  # not through ddp.train(): it would come back here
            ddp.training = mode
            ddp.module.training = mode

    # ------------------------------------------------------------------ checkpoints
    def whole_state(self, pm: Any, tensors: dict[str, Any], prefix: str, positional: tuple) -> dict[str, Any]:
        """The original model's keys with full tensors; sharded ones are all-gathered (a collective)."""
        if positional:
            raise TypeError("state_dict() takes keyword arguments only (destination=, prefix=, keep_vars=)")
        return self.whole_tensors(pm, tensors, prefix)

    def whole_tensors(self, pm: Any, tensors: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        if pm.__dict__.get("_fsdp") is not None:  # FSDP's DTensor shards over dp, all-gathered (one flat buffer a dtype)
            tensors.update(full_tensors(tensors))
        if not pm.shards:
            return tensors
        group = tp_group_of(pm).group
        for key, spec in pm.shards.items():
            full_key = prefix + key
            if full_key in tensors:
                tensors[full_key] = gathered_whole(tensors[full_key], spec, group)
        return tensors

    def local_state(self, pm: Any, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
        """Full tensors under the original keys: sharded ones sliced to this rank's shard (and, under
        FSDP, cut into its DTensor shards over ``dp``)."""
        if not pm.shards:
            return _onto_fsdp_shards(pm, state_dict)
        rank = tp_group_of(pm).rank()
        local = dict(state_dict)
        for key, spec in pm.shards.items():
            if key not in local:
                continue
            full = local[key]
            if full.size(spec.dim) != sum(spec.sizes):
                raise ValueError(
                    f"'{key}' has {full.size(spec.dim)} entries along dim {spec.dim}, but its shards "
                    f"{list(spec.sizes)} add up to {sum(spec.sizes)}; load a state_dict of the same model "
                    "(pm.state_dict() or model.state_dict())"
                )
            local[key] = shard_of(full, spec, rank).clone()
        return _onto_fsdp_shards(pm, local)

    def cut_on_load(self, pm: Any, state_dict: Any, prefix: str) -> None:
        """``parent.load_state_dict(...)`` of a module holding ``pm``: full tensors under the
        sharded keys are cut to this rank's shard before the submodules load them."""
        if pm.shards:
            rank = tp_group_of(pm).rank()
            for key, spec in pm.shards.items():
                full = state_dict.get(prefix + key)
                if isinstance(full, torch.Tensor) and full.dim() > spec.dim and full.size(spec.dim) == sum(spec.sizes):
                    state_dict[prefix + key] = shard_of(full, spec, rank)

    def check_picklable(self, pm: Any) -> None:
        raise TypeError(
            "an SPMD ParallelModule holds process groups and cannot be pickled; save pm.state_dict() "
            "(full tensors, the original keys) and rebuild with dpcompile.transform(model, mesh)"
        )


#: the executor of one rank's program over a mesh
SPMD = SpmdExecutor()


def gathered_whole(shard: torch.Tensor, spec: ShardSpec, group: Any) -> torch.Tensor:
    """A tensor-parallel shard made whole: all-gathered over ``group`` (uneven shards padded, then
    trimmed) and, for a fused qkv, its q, k, v blocks put back in order. A collective."""
    with torch.no_grad():
        return regroup_sections(all_gather(shard.detach(), group, dim=spec.dim, sizes=list(spec.sizes)), spec)


def _onto_fsdp_shards(pm: Any, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """Whole tensors (``pm.state_dict()``'s) as the DTensors FSDP holds: each rank keeps its rows."""
    if pm.__dict__.get("_fsdp") is None:
        return state_dict
    from torch.distributed.tensor import DTensor, distribute_tensor

    held = nn.Module.state_dict(pm, keep_vars=True)
    local = dict(state_dict)
    for key, value in local.items():
        own = held.get(key)
        if not isinstance(own, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            continue
        if tuple(value.shape) != tuple(own.shape):
            raise ArgumentError(
                f"'{key}' has shape {tuple(value.shape)}, but the model's is {tuple(own.shape)}; load a state_dict "
                "of the same model (pm.state_dict() or model.state_dict())"
            )
        with torch.no_grad():
            local[key] = distribute_tensor(value.detach().to(own.device, own.dtype), own.device_mesh, own.placements)
    return local


def tp_group_of(pm: Any) -> MeshGroup:
    """The tp group of one rank's program over a mesh."""
    group = getattr(pm, "tp_group", None)
    if isinstance(group, MeshGroup):
        return group
    return MeshGroup(pm.mesh, pm.tp_dim)


def check_inputs_agree(pm: Any, args: tuple, kwargs: dict, *, defer: bool = False) -> None:
    """Raise ``ValueError`` on every rank of the tp group where ranks feed inputs of different
    shapes (or leave different arguments None): tensor parallelism needs the same input on
    every rank, and mismatched collectives would abort inside the backend instead.

    One all-gather of an 8-byte fingerprint of the call's shapes; the shapes themselves are
    exchanged only where fingerprints differ, to name the input and the sizes. A rank that
    does not call forward within ``pm.check_inputs_timeout`` seconds fails the others.
    ``defer``: start the all-gather now and finish the check before this thread's next
    collective of :mod:`dpcompile.runtime.distributed` (or at ``settle_deferred_check()``).
    """
    group = tp_group_of(pm)
    finish = start_exchange(pm, group, _input_signature(pm, args, kwargs), "tensor-parallel")

    def settle() -> None:
        signatures = finish()
        if signatures is not None:
            ranks = [dist.get_global_rank(group.group, r) for r in range(group.size())]
            raise ValueError(describe_disagreement(signatures, ranks))

    if defer:
        defer_to_next_collective(settle)
    else:
        settle()


def check_calls_agree(pm: Any, args: tuple, kwargs: dict) -> None:
    """Data parallel over a mesh: raise ``ValueError`` on every rank of the dp group where
    ranks call with different arguments (one passes ``mask=``, another leaves it None), dtypes
    or ranks of tensors; batch sizes may differ. They would run different programs, whose
    collectives (DDP's, sync BatchNorm's) never match: a hang until the process group's
    timeout, or a crash on one rank only. A rank that does not call forward within
    ``pm.check_inputs_timeout`` seconds fails the others."""
    group = MeshGroup(pm.mesh, pm.dp_dim)
    signature = input_signature(pm, args, kwargs, batch_free=True)
    signatures = start_exchange(pm, group, signature, "data-parallel")()
    if signatures is not None:
        ranks = [dist.get_global_rank(group.group, r) for r in range(group.size())]
        raise ValueError(describe_disagreement(signatures, ranks, data_parallel=True))


def _input_signature(pm: Any, args: tuple, kwargs: dict) -> list[tuple[str, str]]:
    """:func:`input_signature` of a call, kept by shapes and dtypes where every argument is a tensor."""
    if kwargs or not all(type(a) is torch.Tensor for a in args):
        return input_signature(pm, args, kwargs)
    key = tuple((a.shape, a.dtype) for a in args)
    kept = pm.__dict__.setdefault("_input_signatures", {})
    signature = kept.get(key)
    if signature is None:
        if len(kept) >= 16:  # a few shapes in turn (the last batch of an epoch), never an unbounded pile
            kept.clear()
        signature = kept[key] = input_signature(pm, args, kwargs)
    return signature


def input_signature(
    pm: Any, args: tuple, kwargs: dict, *, batch_free: bool = False
) -> list[tuple[str, str]]:
    """Per input (by the name forward gives it): its tensors' shapes and dtypes (``batch_free``:
    their number of dims, not the sizes), or the value of a plain Python argument (None, a
    flag), as text every rank can compare."""
    names = [str(n.target).lstrip("*") for n in placeholders(pm.graph)]
    named = [(names[i] if i < len(names) else f"args[{i}]", value) for i, value in enumerate(args)]
    named += sorted(kwargs.items())
    out = []
    for name, value in named:
        leaves = list(tensor_leaves(value))
        if leaves:
            for path, t in leaves:
                shape = f"{t.dim()}-d" if batch_free else f"shape {tuple(t.shape)}"
                out.append((f"{name}{path}", f"{shape} {str(t.dtype).replace('torch.', '')}"))
        elif value is None or isinstance(value, (bool, int, float, str)):
            out.append((name, repr(value)))
    return out


def describe_disagreement(
    signatures: list[list[tuple[str, str]]], ranks: list[int], *, data_parallel: bool = False
) -> str:
    """The first input on which ranks disagree, with each rank's value."""
    per_rank = [dict(s) for s in signatures]
    names = list(dict.fromkeys(name for s in signatures for name, _ in s))
    for name in names:
        values = [found.get(name, "not passed") for found in per_rank]
        if len(set(values)) > 1:
            shown = "; ".join(f"global rank {rank}: {value}" for rank, value in zip(ranks, values))
            if data_parallel:
                return (
                    f"data parallel over a mesh needs every rank of a dp group to call forward alike (batch sizes "
                    f"may differ), but input '{name}' differs ({shown}); pass the same arguments, dtypes and "
                    "number of dims on every rank"
                )
            return (
                f"tensor parallel over a mesh needs the same input on every rank of a tp group, but input "
                f"'{name}' differs ({shown}). Feed every rank of the group the same batch (e.g. the same "
                "sampler seed, drop_last=True so no rank gets a short last batch)"
            )
    return "tensor parallel over a mesh needs the same inputs on every rank of a tp group, but they differ"


def is_communication_failure(e: BaseException) -> bool:
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "socket"))


def unused_parameters(gm: fx.GraphModule) -> list[str]:
    """Parameters of ``gm`` that its forward never reads: known statically, from the graph.

    DDP must not wait for their gradients (it would fail on the next step with "Expected to
    have finished reduction"); single-device training leaves their ``.grad`` None too.

    >>> unused_parameters(capture(model_with_an_unused_head))  # doctest: +SKIP
    ['head.weight', 'head.bias']
    """
    used_prefixes: list[str] = []
    for node in gm.graph.nodes:
        if node.op in ("call_module", "get_attr") and isinstance(node.target, str):
            used_prefixes.append(unalias(node.target))  # the model's name of `user:devices`

    def used(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") or p == "" for p in used_prefixes)

    return [name for name, _ in gm.named_parameters() if not used(name)]


def build_ddp(
    pm: Any, mesh: Any, dp_dim: str | int, options: Mapping[str, Any]
) -> nn.parallel.DistributedDataParallel:
    group = mesh.get_group(dp_dim)
    device = local_device(mesh)
    kwargs: dict[str, Any] = {"process_group": group}
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    kwargs.update(options)
    wrapper = _LocalProgram(pm)
    unused = unused_parameters(pm)
    if unused and not kwargs.get("find_unused_parameters"):
        log.debug("DDP ignores parameters forward never reads: %s", unused)
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            wrapper, [f"program.{name}" for name in unused]
        )
    try:  # DDP broadcasts rank 0's parameters and buffers: a collective
        return nn.parallel.DistributedDataParallel(wrapper, **kwargs)
    except (RuntimeError, dist.DistError) as e:
        if not is_communication_failure(e):
            raise
        raise collective_failure("DistributedDataParallel's broadcast of rank 0's parameters", group, e) from e


def repeated_blocks(model: nn.Module) -> list[str]:
    """Paths of the model's repeated blocks: the children of a ``ModuleList`` or ``Sequential``
    of two or more modules of one class (a transformer's layers), outermost lists first.

    >>> repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.ModuleList([Block(), Block()])))  # doctest: +SKIP
    ['1.0', '1.1']
    """
    found: list[str] = []
    for path, module in model.named_modules():
        if any(path == p or path.startswith(p + ".") for p in found):
            continue
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2:
            classes = {type(child) for child in module}
            if len(classes) == 1 and all(next(child.children(), None) is not None for child in module):
                found += [f"{path}.{name}" if path else name for name in module._modules]
    return found


def build_fsdp(pm: Any, mesh: Any, dp_dim: str | int, options: Mapping[str, Any]) -> nn.Module:
    """FSDP2 over the ``dp_dim`` of ``mesh``, as torchtitan applies it: ``fully_shard`` on each
    repeated block the program calls as a module, then on a root that runs the program (which
    holds the rest: embeddings, final norm, head). ``options`` go to every ``fully_shard``
    (``mp_policy=``, ``reshard_after_forward=``)."""
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh[dp_dim] if isinstance(dp_dim, str) and mesh.ndim > 1 else mesh
    called = {str(n.target) for n in pm.graph.nodes if n.op == "call_module"} | scoped_module_paths(pm)
    blocks = [path for path in repeated_blocks(pm) if path in called]
    group = dp_mesh.get_group()
    try:
        for path in blocks:
            fully_shard(pm.get_submodule(path), mesh=dp_mesh, **options)
        root = _LocalProgram(pm)
        fully_shard(root, mesh=dp_mesh, **options)
    except (RuntimeError, dist.DistError) as e:
        if not is_communication_failure(e):
            raise
        raise collective_failure("fully_shard's setup", group, e) from e
    pm.__dict__["_fsdp_blocks"] = blocks
    return root


def full_tensor(value: Any) -> Any:
    """A DTensor's full value (a collective over its mesh); anything else as it is."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


__all__ = [
    "SPMD", "SpmdExecutor", "build_ddp", "build_fsdp", "check_calls_agree", "check_inputs_agree", "describe_disagreement",
    "full_tensor", "gathered_whole", "hold_mesh", "input_signature", "is_communication_failure", "repeated_blocks", "tp_group_of",
    "unused_parameters",
]
