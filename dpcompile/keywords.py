"""No keyword of :func:`dpcompile.transform` is silently ignored: each is honoured by the layout
it is given with, or refused here, by name, with the way out.

>>> check_keywords_honoured(["cpu"] * 2, micro_batches=4)  # doctest: +IGNORE_EXCEPTION_DETAIL
Traceback (most recent call last):
dpcompile.errors.ArgumentError: micro_batches=4 feeds a pipeline ...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dpcompile.analysis.context_exchange import parse_context_parallel
from dpcompile.devices import parse_devices
from dpcompile.errors import ArgumentError, DpCompileError
from dpcompile.mesh import is_device_mesh
from dpcompile.target import check_built, mesh_layout, sugar_layout


def check_keywords_honoured(
    devices: Any, *, mesh: Mapping[str, int] | None = None, tensor_parallel: Any = False, pipeline: Any = None,
    micro_batches: int = 1, schedule: str = "gpipe", data_parallel: str = "ddp", ddp_options: Any = None,
    copy_replicas: bool = False, batch_dim: Any = None, output_device: Any = None, sequence_parallel: Any = False,
    activation_checkpointing: Any = False, exact_random: Any = None, plan: Any = None, memory_per_device: Any = None,
    optimizer: Any = None, training: Any = True, context_parallel: Any = None,
) -> None:  # fmt: skip
    """Refuse every keyword the layout would not read (a keyword at its default is never refused), and
    values of the wrong kind before any of them is used."""
    _check_kinds(pipeline=pipeline, copy_replicas=copy_replicas, optimizer=optimizer, training=training)
    over_mesh = is_device_mesh(devices)
    pipelined = pipeline is not None or (isinstance(mesh, Mapping) and mesh.get("pp", 1) > 1)
    sharded = (tensor_parallel is not None and tensor_parallel is not False) or (
        isinstance(mesh, Mapping) and mesh.get("tp", 1) > 1
    )
    if not pipelined and micro_batches != 1:
        raise ArgumentError(
            f"micro_batches={micro_batches!r} feeds a pipeline, and there is none: add pipeline=N (or a 'pp' "
            "dimension to mesh=), or leave micro_batches= out"
        )
    if not pipelined and schedule != "gpipe":
        raise ArgumentError(f"schedule={schedule!r} orders a pipeline's micro-batches: add pipeline=N, or leave it out")
    if pipelined and schedule != "gpipe" and isinstance(mesh, Mapping) and mesh.get("cp", 1) > 1:
        raise DpCompileError(
            f"schedule={schedule!r} with 'pp' and 'cp' is not built yet: the pieces of the sequence are the "
            "pipeline's micro-batches, and each stage's attention reads every piece's keys and values, so no piece "
            "runs its backward before the others' forward; leave schedule= out (GPipe)"
        )
    if ddp_options and not over_mesh:
        raise ArgumentError(
            "ddp_options= configures DistributedDataParallel over a DeviceMesh; over a device list data "
            "parallelism is one process's program (see docs/data_parallel.md): leave ddp_options= out"
        )
    if copy_replicas and (over_mesh or pipelined or sharded):
        raise ArgumentError(
            "copy_replicas=True gives virtual devices real replicas under data parallelism in one process; "
            "with a pipeline, tensor parallelism or a DeviceMesh each device already holds its own modules"
        )
    if over_mesh and output_device is not None:
        raise ArgumentError(
            "output_device= names where a one-process program gathers its outputs; over a DeviceMesh every rank "
            "returns its outputs on its own device: leave output_device= out"
        )
    if over_mesh and ddp_options:
        _check_ddp_options(ddp_options, pipelined=pipelined)
    if over_mesh and ddp_options and data_parallel == "fsdp":
        raise ArgumentError(
            'ddp_options= configures DistributedDataParallel, and data_parallel="fsdp" runs FSDP2 instead (it takes '
            "mixed_precision=, no DDP options): leave ddp_options= out, or data_parallel= out (DDP with those options)"
        )
    if over_mesh and activation_checkpointing not in (None, False):
        _check_mesh_checkpointing(activation_checkpointing, tuple(devices.mesh_dim_names or ()))
    if over_mesh:
        check_built(
            {name for name, size in mesh_layout(devices, pipeline=pipeline, tensor_parallel=tensor_parallel).items()
             if size > 1}, over_mesh=True,
            layout=mesh_layout(devices, pipeline=pipeline, tensor_parallel=tensor_parallel),
        )  # fmt: skip
    if over_mesh:  # the mesh's own dimensions, as mesh= names them in one process
        mesh = mesh_layout(devices, pipeline=pipeline, tensor_parallel=tensor_parallel)
        if ddp_options and not {"dp", "cp"} & set(mesh):
            raise ArgumentError(
                f"ddp_options= configures DistributedDataParallel over the mesh's data-parallel dimension, and the "
                f"layout {mesh} has none ('dp', or 'cp', whose ranks average gradients as dp's do): add a 'dp' "
                "dimension to the DeviceMesh, or leave ddp_options= out"
            )
        sharded = sharded or mesh.get("tp", 1) > 1
    _check_sequence_parallel(sequence_parallel, sharded, over_mesh=over_mesh, pipelined=pipelined, mesh=mesh,
                             schedule=schedule)  # fmt: skip
    _check_new_strategies(sequence_parallel, activation_checkpointing, exact_random, plan, memory_per_device, sharded)
    _check_context_parallel(context_parallel, mesh)


def _check_mesh_checkpointing(activation_checkpointing: Any, dims: tuple[str, ...]) -> None:
    """Over a DeviceMesh each rank's program is checkpointed as one process's is, on the layouts built
    there but context parallel; ``"auto"`` is chosen by ``plan="auto"`` only."""
    if "cp" in dims:
        raise DpCompileError(
            f"activation_checkpointing= over a DeviceMesh with a 'cp' dimension (mesh_dim_names={dims}) is not built "
            "yet: a recomputed attention would all-gather its keys and values over 'cp' again in backward; leave it "
            "out, or use mesh={'cp': N} over a device list (one process), where it is built"
        )
    if activation_checkpointing == "auto":
        raise DpCompileError(
            'activation_checkpointing="auto" over a DeviceMesh is chosen with the layout: pass plan="auto" with '
            "memory_per_device= (it weighs each layout with and without recomputing the blocks), or name what to "
            "recompute (True: every repeated block; a list of module paths; a dict with 'save' and 'budget_bytes')"
        )


#: DistributedDataParallel's arguments dpcompile sets itself: the wrapped program, the mesh's dp group, this rank's device
DDP_ARGUMENTS_SET = ("module", "process_group", "device_mesh", "device_ids", "output_device")


def _check_ddp_options(ddp_options: Any, *, pipelined: bool) -> None:
    """``ddp_options=`` are ``DistributedDataParallel``'s keyword arguments: a name it does not take, or
    one dpcompile sets from the mesh, is refused by name before anything is built; so is
    ``static_graph=True`` on a pipeline (``PipelineStage`` drives DDP's reducer itself, which the
    static graph's first step does not expect: torch's internal assert mid-step)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_options, Mapping):
        raise ArgumentError(f"ddp_options={ddp_options!r}: expected a dict of DistributedDataParallel's keyword arguments")
    taken = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", *DDP_ARGUMENTS_SET}
    unknown = sorted(str(k) for k in ddp_options if k not in taken)
    if unknown:
        raise ArgumentError(
            f"ddp_options= names {unknown}, which DistributedDataParallel does not take from you (dpcompile sets "
            f"{', '.join(DDP_ARGUMENTS_SET)} from the mesh); it takes {sorted(taken)}"
        )
    delayed = sorted(k for k in ("delay_all_reduce_named_params", "param_to_hook_all_reduce") if k in ddp_options)
    if delayed:
        raise ArgumentError(
            f"ddp_options= {delayed}: DDP's delayed all-reduce is not supported. DDP wraps dpcompile's program, "
            "whose parameters it names otherwise than the model (the names given are not found, so those "
            "gradients would be reduced twice), its delayed buffer is float32 whatever the parameters' dtype, and "
            "it reduces when the hooked parameter's gradient is computed, before the others land (measured on a "
            "2-process gloo group: gradients 6x off). Leave both out: DDP buckets every gradient (bucket_cap_mb= "
            "sizes the buckets)"
        )
    if pipelined and ddp_options.get("static_graph"):
        raise ArgumentError(
            "ddp_options={'static_graph': True} with pipeline= over a DeviceMesh: torch.distributed.pipelining's "
            "PipelineStage runs DDP's reducer itself (no_sync for every micro-batch but the last backward), which "
            "DDP's static graph does not expect (its first step fails inside DDP): leave static_graph out"
        )


def _check_context_parallel(context_parallel: Any, mesh: Any) -> None:
    """``context_parallel=`` says how a ``cp`` dimension exchanges keys and values: checked, and refused
    where there is no ``cp`` dimension to read it."""
    if context_parallel is None:
        return
    parse_context_parallel(context_parallel)
    if not (isinstance(mesh, Mapping) and mesh.get("cp", 1) > 1):
        raise ArgumentError(
            f"context_parallel={context_parallel!r} says how a 'cp' dimension exchanges keys and values, and there "
            "is none: add 'cp' to mesh= (mesh={'cp': N}, or a DeviceMesh dimension named 'cp'), or leave it out"
        )


def _check_kinds(*, pipeline: Any, copy_replicas: Any, optimizer: Any, training: Any) -> None:
    """Keywords whose value is of a kind no layout reads (a string where a number of stages is due, a
    truthy string for a flag) are refused by name instead of being read as something else."""
    stages = isinstance(pipeline, int) and not isinstance(pipeline, bool)
    paths = isinstance(pipeline, (list, tuple)) and all(isinstance(p, str) for p in pipeline)
    if stages and pipeline < 1:
        raise ArgumentError(f"pipeline={pipeline}: the number of stages must be at least 1 (one stage per device)")
    if pipeline is not None and not (stages or paths):
        raise ArgumentError(
            f"pipeline={pipeline!r}: expected a number of stages, or a list of module paths where stages start "
            '(pipeline=["layers.4"] for one cut)'
        )
    for name, value in (("copy_replicas", copy_replicas), ("training", training)):
        if not isinstance(value, bool):
            raise ArgumentError(f"{name}={value!r}: expected True or False")
    if optimizer not in (None, "sgd", "sgd_momentum", "adam", "adamw"):
        raise ArgumentError(f"optimizer={optimizer!r}: expected None, 'sgd', 'sgd_momentum', 'adam' or 'adamw'")


def _check_sequence_parallel(
    sequence_parallel: Any, sharded: bool, *, over_mesh: bool, pipelined: bool, mesh: Any, schedule: str = "gpipe",
) -> None:  # fmt: skip
    """``sequence_parallel=True`` is built on ``tp``: in one process beside every other dimension
    (GPipe where there is a pipeline), over a ``("tp",)`` or ``("dp", "tp")`` DeviceMesh."""
    if not isinstance(sequence_parallel, bool):
        raise ArgumentError(f"sequence_parallel={sequence_parallel!r}: expected True or False")
    if not sequence_parallel:
        return
    if not sharded:
        raise ArgumentError("sequence_parallel=True shards the sequence over the 'tp' dimension: add tensor_parallel=")
    others = sorted(k for k, v in (mesh or {}).items() if k not in ("tp", "dp") and v > 1
                    ) if isinstance(mesh, Mapping) else []  # fmt: skip
    if over_mesh and (pipelined or others):
        where = f"with {', '.join(others) or 'pp'} over a DeviceMesh"
        raise DpCompileError(
            f"sequence_parallel=True {where} is not built yet: over a DeviceMesh it runs on 'tp', with or without "
            "'dp' (a ('tp',) or ('dp', 'tp') DeviceMesh; in one process, a device list, it composes with 'pp' and "
            "'cp' too); leave sequence_parallel= out for this layout"
        )
    if pipelined and schedule != "gpipe":
        raise DpCompileError(
            f"sequence_parallel=True with schedule={schedule!r} is not built yet (its micro-batches' sequence "
            "shards are not kept apart for 1F1B's order): leave schedule= out (GPipe), or sequence_parallel= out"
        )


def _check_new_strategies(
    sequence_parallel: Any, activation_checkpointing: Any, exact_random: Any, plan: Any, memory_per_device: Any,
    sharded: bool,
) -> None:  # fmt: skip
    _check_activation_checkpointing(activation_checkpointing, memory_per_device)
    if exact_random is not None and not isinstance(exact_random, bool):
        raise ArgumentError(f"exact_random={exact_random!r}: expected True or False")
    if plan is not None:
        if plan != "auto":  # without memory_per_device=, plan="auto" plans for the devices' own memory
            raise ArgumentError(f'plan={plan!r}: expected None or "auto"')


def _check_activation_checkpointing(value: Any, memory_per_device: Any) -> None:
    if isinstance(value, dict):  # {"regions": ..., "save": rule}: checked with the model (checkpoint_regions)
        return
    if value is None or isinstance(value, bool):
        return
    if value == "auto":
        if memory_per_device is None:
            raise ArgumentError(
                'activation_checkpointing="auto" recomputes what does not fit memory_per_device=: give a budget, '
                'e.g. memory_per_device="24GiB", or name the modules (True: every repeated block)'
            )
        return
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
        raise ArgumentError(
            f"activation_checkpointing={value!r}: expected False, True (every repeated block), a list of module "
            'paths (["layers.0", "layers.1"]) or "auto"'
        )


def layout_of_keywords(devices: Any, pipeline: Any, tensor_parallel: Any) -> dict[str, int]:
    """``pm.layout`` where the older keywords (not ``mesh=``) spelled it."""
    if is_device_mesh(devices):
        return mesh_layout(devices, pipeline=pipeline, tensor_parallel=tensor_parallel)
    return sugar_layout(len(parse_devices(devices)), pipeline=pipeline, tensor_parallel=tensor_parallel)


__all__ = ["check_keywords_honoured", "layout_of_keywords"]
