"""SPMD mode: ``transform(model, mesh)`` with a ``torch.distributed`` ``DeviceMesh``.

One process per device, launched with ``torchrun``; every process runs ``transform`` on the
same model and gets the program of its own rank:

* **1-D mesh, data parallel** (``tensor_parallel=False``): each process feeds its own part
  of the batch. The program is the captured model (the ``flatten_parameters`` hoist applied)
  with every BatchNorm lowered to :func:`~dpcompile.runtime.distributed.sync_batch_norm`
  over the mesh, run under ``DistributedDataParallel`` — gradient bucketing, all-reduce
  overlapped with backward, ``no_sync()`` — which averages the gradients across processes.
  ``pm`` shares the model's parameters, as the single-process data-parallel mode does.
* **1-D mesh, tensor parallel** (``tensor_parallel=True`` or a plan): ``shard_linear``'s
  one-shard program with its collectives lowered to process-group collectives
  (``all_reduce``, ``all_gather``, Megatron's f) by ``passes.collectives.lower_to_collectives``.
  Each rank holds only its shards; every process feeds the same input and gets the full
  output; ``state_dict()`` gathers full tensors under the original keys (a collective: call
  it on every rank), ``load_state_dict()`` re-shards.
* **2-D mesh ("dp", "tp")**: tensor parallel within each ``tp`` group, data parallel (DDP
  over the ``dp`` groups) across them — the torchtitan layout.

>>> # torchrun --nproc-per-node 2 train.py                                # doctest: +SKIP
>>> import torch.distributed as dist                                      # doctest: +SKIP
>>> from torch.distributed.device_mesh import init_device_mesh            # doctest: +SKIP
>>> dist.init_process_group("gloo")                                       # doctest: +SKIP
>>> mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))          # doctest: +SKIP
>>> pm = dpcompile.transform(model, mesh)                                 # doctest: +SKIP
>>> loss = pm(x_local).mean(); loss.backward()   # gradients averaged     # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from dpcompile.capture import capture
from dpcompile.devices import Devices
from dpcompile.infra import run_passes
from dpcompile.module import ParallelModule
from dpcompile.runtime.distributed import CollectiveError, MeshGroup

log = logging.getLogger("dpcompile")

MODES = ("spmd_data_parallel", "spmd_tensor_parallel", "spmd_2d")


# ---------------------------------------------------------------------------- the mesh
def _check_mesh(mesh: Any, tensor_parallel: object) -> tuple[str, str | int | None, str | int | None]:
    """``(mode, dp_dim, tp_dim)`` for ``mesh`` and the ``tensor_parallel`` option."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "a DeviceMesh needs an initialised process group: call torch.distributed.init_process_group() "
            "(torchrun sets the environment) before transform(model, mesh)"
        )
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    wants_tp = tensor_parallel is not False and tensor_parallel is not None
    if mesh.ndim == 1:
        dim: str | int = names[0] if names else 0
        if wants_tp:
            return "spmd_tensor_parallel", None, dim
        return "spmd_data_parallel", dim, None
    if mesh.ndim == 2:
        if names != ("dp", "tp"):
            raise ValueError(
                f"a 2-D DeviceMesh must name its dimensions ('dp', 'tp'), got {names}; build it with "
                "init_device_mesh(device_type, (dp, tp), mesh_dim_names=('dp', 'tp'))"
            )
        if not wants_tp:
            raise ValueError(
                "a 2-D ('dp', 'tp') mesh needs tensor_parallel=True or a plan; for data parallel alone "
                "pass a 1-D mesh, e.g. init_device_mesh(device_type, (world_size,), mesh_dim_names=('dp',))"
            )
        return "spmd_2d", "dp", "tp"
    raise ValueError(f"DeviceMesh of {mesh.ndim} dimensions is not supported; pass a 1-D mesh or a 2-D ('dp', 'tp') mesh")


def local_device(mesh: Any) -> torch.device:
    """The device this process computes on: CPU, or its current CUDA device.

    >>> local_device(init_device_mesh("cpu", (2,)))  # doctest: +SKIP
    device(type='cpu')
    """
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind, None)
    if module is not None and hasattr(module, "current_device"):
        return torch.device(kind, module.current_device())
    return torch.device(kind)


def local_batch(value: Any, mesh: Any, dim: int = 0) -> Any:
    """This process's part of a global batch: every tensor of ``value`` split along ``dim``.

    Balanced ``tensor_split`` parts over the mesh's ``"dp"`` dimension (a 1-D mesh not named
    ``"tp"`` is all data parallel); tensor-parallel ranks of one dp group get the same part,
    and a ``("tp",)`` mesh gets the whole batch. Non-tensor leaves are passed through.

    >>> x_local, y_local = local_batch((x, y), mesh)  # doctest: +SKIP
    """
    from dpcompile.runtime.structures import map_structure

    names = tuple(mesh.mesh_dim_names or ())
    if "dp" in names:
        parts, rank = mesh.size(names.index("dp")), mesh.get_local_rank("dp")
    elif mesh.ndim == 1 and names != ("tp",):
        parts, rank = mesh.size(0), mesh.get_local_rank(0)
    else:
        return value
    return map_structure(
        lambda leaf: torch.tensor_split(leaf, parts, dim)[rank]
        if isinstance(leaf, torch.Tensor) and leaf.dim() > dim
        else leaf,
        value,
    )


# ---------------------------------------------------------------------------- the module
class _LocalProgram(nn.Module):
    """What DDP wraps: calls the generated forward of ``program`` (not its ``__call__``)."""

    def __init__(self, program: SpmdModule):
        super().__init__()
        self.program = program

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        variant = self.program._spmd_variant(args, kwargs)
        if variant is not None:
            return variant(*args, **kwargs)
        return ParallelModule.__call__(self.program, *args, **kwargs)


class SpmdModule(ParallelModule):
    """One rank's program of an SPMD ``ParallelModule``. Build it with ``dpcompile.transform(model, mesh)``.

    ``pm.mode`` is ``"spmd_data_parallel"``, ``"spmd_tensor_parallel"`` or ``"spmd_2d"``;
    ``pm.mesh`` the mesh; ``pm.ddp`` the ``DistributedDataParallel`` that runs it where there
    is a data-parallel dimension (None otherwise); with tensor parallelism ``pm.plan`` and
    ``pm.plan_reasons`` as in single-process mode, and ``pm.shards`` ``{state key: (dim,
    sizes)}`` for the parameters this rank holds a shard of.

    >>> pm = dpcompile.transform(model, mesh)   # doctest: +SKIP
    >>> with pm.no_sync():                      # accumulate without all-reducing  # doctest: +SKIP
    ...     pm(x).sum().backward()
    """

    mesh: Any
    shards: dict[str, tuple[int, list[int]]]

    def _attach(
        self,
        *,
        mesh: Any,
        dp_dim: str | int | None,
        tp_dim: str | int | None,
        shards: Mapping[str, tuple[int, Sequence[int]]] | None = None,
        ddp_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.__dict__["mesh"] = mesh
        self.dp_dim = dp_dim
        self.tp_dim = tp_dim
        self.shards = {k: (d, list(s)) for k, (d, s) in (shards or {}).items()}
        self.__dict__["_ddp"] = None
        if dp_dim is not None and any(p.requires_grad for p in self.parameters()):
            self.__dict__["_ddp"] = _build_ddp(self, mesh, dp_dim, ddp_options or {})

    @property
    def ddp(self) -> nn.parallel.DistributedDataParallel | None:
        return self.__dict__.get("_ddp")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ddp = self.__dict__.get("_ddp")
        if ddp is None:
            variant = self._spmd_variant(args, kwargs)
            if variant is not None:
                return variant(*args, **kwargs)
            return ParallelModule.__call__(self, *args, **kwargs)
        try:
            return ddp(*args, **kwargs)
        except CollectiveError:
            raise
        except (RuntimeError, dist.DistError) as e:
            if not _is_communication_failure(e):
                raise
            raise CollectiveError(
                f"DistributedDataParallel's communication failed on global rank {dist.get_rank()}: another "
                "rank most likely raised, exited or timed out first — see its log for the first error. Pass "
                f"timeout= to torch.distributed.init_process_group to fail sooner. ({_first_line(e)})"
            ) from e

    # ------------------------------------------------------------------ variants
    def _allow_variants(self, build: Any) -> None:
        """``build(none_args, args, kwargs) -> fx.Graph``: this rank's program traced with the
        optional arguments ``none_args`` left None (``if mask is not None`` takes the other path)."""
        object.__setattr__(self, "_variant_build", build)
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self._optional_args = [(i, str(n.target)) for i, n in enumerate(placeholders) if n.args and n.args[0] is None]
        self._variant_programs: dict[frozenset[str], fx.GraphModule | None] = {}

    def _spmd_variant(self, args: tuple, kwargs: dict) -> fx.GraphModule | None:
        """The program for a call that leaves optional arguments None; None for the main program."""
        build = self.__dict__.get("_variant_build")
        if build is None:
            return None
        nones = frozenset(name for i, name in self._optional_args if (args[i] if i < len(args) else kwargs.get(name)) is None)
        if not nones:
            return None
        if nones not in self._variant_programs:
            from dpcompile.module import copy_graph

            graph = build(nones, args, kwargs)
            same = graph.python_code("self").src == self.graph.python_code("self").src
            self._variant_programs[nones] = None if same else fx.GraphModule(self, copy_graph(graph), "SpmdVariant")
        program = self._variant_programs[nones]
        if program is not None:
            program.training = self.training
        return program

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the gradient all-reduce of the backward passes inside (gradient accumulation).

        As ``DistributedDataParallel.no_sync``: the first backward after the block all-reduces
        the accumulated gradients. A no-op without a data-parallel dimension.
        """
        ddp = self.__dict__.get("_ddp")
        if ddp is None:
            yield
            return
        with ddp.no_sync():
            yield

    def train(self, mode: bool = True) -> SpmdModule:
        super().train(mode)
        ddp = self.__dict__.get("_ddp")
        if ddp is not None:  # not through ddp.train(): it would come back here
            ddp.training = mode
            ddp.module.training = mode
        return self

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """The original model's keys with full tensors; sharded ones are all-gathered.

        With tensor parallelism this is a collective: call it on every rank of the mesh.
        """
        if args:
            raise TypeError("state_dict() takes keyword arguments only (destination=, prefix=, keep_vars=)")
        sd = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if not self.shards:
            return sd
        group = self._tp_group().group
        for key, (dim, sizes) in self.shards.items():
            full_key = prefix + key
            if full_key not in sd:
                continue
            local = sd[full_key].detach()
            sd[full_key] = _gather_full(local, dim, sizes, group)
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Load full tensors under the original keys; sharded ones are sliced to this rank's shard."""
        if not self.shards:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        tp = self._tp_group()
        rank = tp.rank()
        local = dict(state_dict)
        for key, (dim, sizes) in self.shards.items():
            if key not in local:
                continue
            full = local[key]
            if full.size(dim) != sum(sizes):
                raise ValueError(
                    f"'{key}' has {full.size(dim)} entries along dim {dim}, but its shards {sizes} add up to "
                    f"{sum(sizes)}; load a state_dict of the same model (pm.state_dict() or model.state_dict())"
                )
            local[key] = full.narrow(dim, sum(sizes[:rank]), sizes[rank]).clone()
        return super().load_state_dict(local, strict=strict, assign=assign)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:  # fmt: skip
        """``parent.load_state_dict(...)`` of a module holding ``pm``: full tensors under the
        sharded keys are cut to this rank's shard before the submodules load them."""
        if self.shards:
            rank = self._tp_group().rank()
            for key, (dim, sizes) in self.shards.items():
                full = state_dict.get(prefix + key)
                if isinstance(full, torch.Tensor) and full.dim() > dim and full.size(dim) == sum(sizes):
                    state_dict[prefix + key] = full.narrow(dim, sum(sizes[:rank]), sizes[rank])
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def _tp_group(self) -> MeshGroup:
        group = getattr(self, "tp_group", None)
        if isinstance(group, MeshGroup):
            return group
        return MeshGroup(self.mesh, self.tp_dim)

    def __reduce__(self):
        raise TypeError(
            "an SPMD ParallelModule holds process groups and cannot be pickled; save pm.state_dict() "
            "(full tensors, the original keys) and rebuild with dpcompile.transform(model, mesh)"
        )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _is_communication_failure(e: BaseException) -> bool:
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "socket"))


def _gather_full(local: torch.Tensor, dim: int, sizes: Sequence[int], group: dist.ProcessGroup) -> torch.Tensor:
    from dpcompile.runtime.distributed import all_gather

    with torch.no_grad():
        return all_gather(local, group, dim=dim, sizes=list(sizes))


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
            used_prefixes.append(node.target)

    def used(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") or p == "" for p in used_prefixes)

    return [name for name, _ in gm.named_parameters() if not used(name)]


def _build_ddp(
    pm: SpmdModule, mesh: Any, dp_dim: str | int, options: Mapping[str, Any]
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
        if not _is_communication_failure(e):
            raise
        from dpcompile.runtime.distributed import _failed

        raise _failed("DistributedDataParallel's broadcast of rank 0's parameters", group, e) from e


# ---------------------------------------------------------------------------- transform
def transform_spmd(
    model: nn.Module,
    mesh: Any,
    *,
    tensor_parallel: bool | Mapping[str, str] = False,
    example_inputs: Sequence[Any] | None = None,
    batch_dim: int | None = None,
    leaf_modules: Iterable[type[nn.Module]] = (),
    ddp_options: Mapping[str, Any] | None = None,
) -> SpmdModule:
    """This rank's program of ``model`` over ``mesh``; ``dpcompile.transform`` calls it for a mesh.

    ``ddp_options`` are passed to ``DistributedDataParallel`` (``bucket_cap_mb=``,
    ``gradient_as_bucket_view=``, ``static_graph=``...). Every rank must call it (it is
    collective: DDP broadcasts rank 0's parameters and buffers to the others).

    >>> mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))  # doctest: +SKIP
    >>> pm = transform_spmd(model, mesh)                               # doctest: +SKIP
    >>> pm.mode                                                        # doctest: +SKIP
    'spmd_data_parallel'
    """
    mode, dp_dim, tp_dim = _check_mesh(mesh, tensor_parallel)
    if batch_dim is not None:
        log.debug("batch_dim=%s ignored over a mesh: each process feeds its own part of the batch", batch_dim)
    device = local_device(mesh)
    if example_inputs is not None and not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    if mode == "spmd_data_parallel":
        return _transform_data_parallel(model, mesh, dp_dim, device, tuple(leaf_modules), ddp_options)
    return _transform_tensor_parallel(
        model, mesh, mode, dp_dim, tp_dim, device, tensor_parallel, example_inputs, tuple(leaf_modules), ddp_options
    )


def _transform_data_parallel(
    model: nn.Module,
    mesh: Any,
    dp_dim: str | int | None,
    device: torch.device,
    leaf_modules: tuple[type[nn.Module], ...],
    ddp_options: Mapping[str, Any] | None,
) -> SpmdModule:
    import passes
    from passes.collectives import lower_to_collectives

    model.to(device)
    gm = capture(model, leaf_modules=leaf_modules)
    options = passes.PipelineOptions(devices=Devices((device,)))
    pipeline = passes.frontend_pipeline(options) + [
        functools.partial(lower_to_collectives, mesh=mesh, dp_dim=dp_dim),
    ]
    gm, records = run_passes(gm, pipeline)
    pm = SpmdModule(
        gm,
        gm.graph,
        devices=Devices((device,)),
        mode="spmd_data_parallel",
        output_device=device,
        records=records,
        class_name=type(model).__name__,
        share_all_of=model,
    )
    pm._attach(mesh=mesh, dp_dim=dp_dim, tp_dim=None, ddp_options=ddp_options)

    def build(none_args: frozenset[str], args: tuple, kwargs: dict) -> fx.Graph:
        variant = capture(model, leaf_modules=leaf_modules, none_args=none_args)
        return run_passes(variant, pipeline)[0].graph

    pm._allow_variants(build)
    return pm


def _transform_tensor_parallel(
    model: nn.Module,
    mesh: Any,
    mode: str,
    dp_dim: str | int | None,
    tp_dim: str | int | None,
    device: torch.device,
    plan: bool | Mapping[str, str],
    example_inputs: Sequence[Any] | None,
    leaf_modules: tuple[type[nn.Module], ...],
    ddp_options: Mapping[str, Any] | None,
) -> SpmdModule:
    import passes
    from dpcompile.api import propagate_shapes
    from passes import spmd_tensor_parallel_pipeline
    from passes.collectives import lower_to_collectives

    tp_size = mesh.size(mesh.mesh_dim_names.index(tp_dim)) if isinstance(tp_dim, str) else mesh.size(0)
    tp_rank = mesh.get_local_rank(tp_dim) if isinstance(tp_dim, str) else mesh.get_local_rank(0)
    pristine = _fake_copy_or_none(model, device)  # to trace again for calls leaving optional arguments None
    own = copy.deepcopy(model).to(device)  # pm owns its shards; the user's model is left unchanged
    _broadcast_state(own, mesh.get_group(tp_dim))  # every shard cut from the same (tp rank 0's) model
    gm = capture(own, leaf_modules=leaf_modules)
    if example_inputs is not None:
        propagate_shapes(gm, [x.to(device) if isinstance(x, torch.Tensor) else x for x in example_inputs])
    styles, reasons = _plan_for(gm, plan, tp_size, model)
    devices = Devices((device,) * tp_size)  # shard_linear reads how many shards there are
    options = passes.PipelineOptions(devices=devices, extra={"plan": styles})
    pipeline = (
        passes.frontend_pipeline(options)
        + spmd_tensor_parallel_pipeline(options)
        + [functools.partial(lower_to_collectives, mesh=mesh, dp_dim=dp_dim, tp_dim=tp_dim)]
    )
    gm, records = run_passes(gm, pipeline)
    info = next((r.info for r in records if r.name == "shard_linear"), {})
    specs = dict(info.get("param_shards", {}))
    _keep_own_shards(gm, own, specs, tp_rank)
    pm = SpmdModule(
        gm,
        gm.graph,
        devices=Devices((device,)),
        mode=mode,
        output_device=device,
        plan=info.get("plan", styles),
        records=records,
        class_name=type(model).__name__,
        share_all_of=own,
    )
    pm.plan_reasons = {**reasons, **{p: f"replicate: {why}" for p, why in info.get("reasons", {}).items()}}
    pm._attach(
        mesh=mesh,
        dp_dim=dp_dim,
        tp_dim=tp_dim,
        shards={key: (spec.dim, spec.sizes) for key, spec in specs.items()},
        ddp_options=ddp_options,
    )

    def build(none_args: frozenset[str], args: tuple, kwargs: dict) -> fx.Graph:
        import warnings

        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils._pytree import tree_map

        from dpcompile.inspect import _bind_inputs
        from dpcompile.verify import _fake_copy

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake = _fake_copy(pristine, mode, device)
        options_v = passes.PipelineOptions(devices=devices, extra={"plan": dict(pm.plan)})
        with mode, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
            variant = capture(fake, leaf_modules=leaf_modules, none_args=none_args)
            example = tree_map(lambda v: mode.from_tensor(v.detach()) if isinstance(v, torch.Tensor) else v,
                               _bind_inputs(pm, args, kwargs))  # fmt: skip
            propagate_shapes(variant, list(example))
            variant, records_v = run_passes(
                variant,
                passes.frontend_pipeline(options_v)
                + spmd_tensor_parallel_pipeline(options_v)
                + [functools.partial(lower_to_collectives, mesh=mesh, dp_dim=dp_dim, tp_dim=tp_dim)],
            )
        info_v = next((r.info for r in records_v if r.name == "shard_linear"), {})
        if {k: (v.dim, list(v.sizes)) for k, v in info_v.get("param_shards", {}).items()} != pm.shards:
            from dpcompile.errors import DpCompileError

            raise DpCompileError(
                f"the call with {sorted(none_args)} None takes another path through forward, whose layers "
                "shard differently; transform the model for that call"
            )
        return variant.graph

    if pristine is not None:
        pm._allow_variants(build)
    return pm


def _fake_copy_or_none(model: nn.Module, device: torch.device) -> nn.Module | None:
    """A fake-tensor copy of ``model`` (no memory) to trace again, or None where that fails."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dpcompile.verify import _fake_copy

    try:
        return _fake_copy(model, FakeTensorMode(allow_non_fake_inputs=True), device)
    except Exception as e:  # noqa: BLE001 - variants are a refinement; the main program stands
        log.debug("no fake copy of the model for variants (%s)", e)
        return None


@torch.no_grad()
def _broadcast_state(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Give every rank of ``group`` the parameters and buffers of the group's first rank.

    As DDP does at construction: ranks that initialised the model differently (no common
    seed) still cut their shards from one model.
    """
    from dpcompile.runtime.distributed import _failed

    source = dist.get_global_rank(group, 0)
    try:
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=source, group=group)
    except (RuntimeError, dist.DistError) as e:
        raise _failed("transform's broadcast of the first tp rank's parameters", group, e) from e


def _plan_for(
    gm: fx.GraphModule, plan: bool | Mapping[str, str], n: int, model: nn.Module | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """``(styles, reasons)``: the explicit plan checked against ``model`` (as in single-process
    mode: a Linear forward never calls stays whole, with the reason), or the automatic plan."""
    if isinstance(plan, Mapping):
        from dpcompile.analysis.sharding import check_plan, find_linear_sites

        sites = find_linear_sites(gm)
        check_plan(model if model is not None else gm, plan, extra_linears=sites)
        styles, reasons = {}, {}
        for path, style in plan.items():
            if path in sites or style == "replicate":
                styles[path] = style
            else:
                reasons[path] = f"replicate: '{path}' is not called in forward (or only inside a leaf module); it stays whole"
        return styles, reasons
    if plan is not True:
        raise ValueError(f"tensor_parallel={plan!r}: expected False, True (automatic plan) or a dict {{path: style}}")
    from dpcompile.tensor_parallel import choose_plan

    styles, reasons = choose_plan(gm, n)
    return dict(styles), dict(reasons)


def _keep_own_shards(gm: fx.GraphModule, own: nn.Module, specs: Mapping[str, Any], rank: int) -> None:
    """Replace each sharded parameter by this rank's shard (a new parameter; the rest is dropped)."""
    from dpcompile.runtime.tensor_parallel import shard_of

    for target, spec in specs.items():
        path, _, name = target.rpartition(".")
        owner = gm.get_submodule(path) if path else gm
        full = getattr(owner, name)
        with torch.no_grad():
            shard = shard_of(full.detach(), spec, rank).clone()
        param = nn.Parameter(shard, requires_grad=full.requires_grad)
        setattr(owner, name, param)
        if not path:  # the model itself is a Linear: its own parameters are the root's
            setattr(own, name, param)

