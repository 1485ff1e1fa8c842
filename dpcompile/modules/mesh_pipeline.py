"""This rank's pipeline stage over the ``"pp"`` dimension of a DeviceMesh, run by
``torch.distributed.pipelining`` (with ``"dp"`` and ``"tp"`` where the mesh has them): a
:class:`~dpcompile.modules.base.ParallelModule` holding a :class:`MeshPipelineExecutor`
(``pm.executor == "pipelining"``) and its stage (:func:`mesh_pipeline_module`).

A training call (gradients enabled) runs the schedule's ``step`` (``PipelineStage`` with
``ScheduleGPipe`` or ``Schedule1F1B``): forward *and* backward of the model's own mean loss, as the
pipelining schedules do; gradients land on this stage's parameters (the model's own) and equal the
single-device gradients of the whole batch (over every ``dp`` rank). Under ``torch.no_grad()`` or
in eval mode it runs forward only. The last stage returns the model's output (the loss is the whole
batch's mean, detached); other stages return None. ``pm.graph``/``pm.code`` are this rank's stage
program (``pm.program``), whose modules, parameters and buffers are ``pm``'s. On a ``("pp", "tp")``
mesh the program holds this tp rank's shards of the stage (``pm.shards``, ``pm.plan``:
:func:`attach_shards`); with ``data_parallel="fsdp"`` FSDP2 wraps the stage over ``"dp"``
(``pm.fsdp``: :func:`shard_over_dp`), with ``ddp_options=`` DDP does (``pm.ddp``: :func:`hold_ddp`).
``pm.state_dict()`` is the model's, whole (a collective);
``pm.load_state_dict()`` takes it back (each rank keeps its pieces).

Each stage's input and output shapes are worked out on fake tensors from the whole program
(``pm.whole``) for each micro-batch shape, and handed to ``PipelineStage`` (its static mode), so the
engine never runs a stage on uninitialised buffers (labels as indices would fail). A batch that does
not divide into ``micro_batches`` runs as two runs of equal micro-batches, one schedule step each
(:mod:`dpcompile.modules.mesh_stage`). The one-process pipeline is :mod:`dpcompile.modules.pipeline`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.devices import Devices
from dpcompile.errors import ArgumentError, DpCompileError
from dpcompile.fx_utils import copy_graph
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.executors import PlainExecutor
from dpcompile.modules.mesh_exported_inputs import check_exported_inputs_over_mesh
from dpcompile.modules.mesh_failure import all_fail_together
from dpcompile.modules.mesh_random import FakeRunDraws, StageRandomPlan
from dpcompile.modules.mesh_stage import (
    MESH_PIPELINE_INSPECTION,
    backward_done,
    batch_norm_dp_refusal,
    batch_norm_refusal,
    batch_statistics_sites,
    materialized_copy,
    micro_batch_runs,
    no_gradient_path,
    on_wire,
    split_into_steps,
    wiring,
)
from dpcompile.modules.mesh_stage_dp import (
    full_state_dict,
    load_whole_state,
    local,
    local_rows_shape,
    shard_stage_over_dp,
    stage_under_ddp,
    whole_parameters_on_fake,
)
from dpcompile.runtime.random_plan import drawing
from dpcompile.runtime.rank_device import group_device
from dpcompile.runtime.structures import is_fake

#: what a pipeline over a mesh cannot serve (:meth:`MeshPipelineExecutor.check_supported`)
REFUSALS = {
    "program_for_call": MESH_PIPELINE_INSPECTION,
    "call_key": (
        "a pipeline over a DeviceMesh keeps no programs by call key: each rank runs one stage program "
        "(pm.code), under a schedule built for each micro-batch shape at its first call. Read pm.stage_index, "
        "pm.micro_batches, pm.schedule_name and pm.batch_size(args, kwargs) for what a call runs"
    ),
    "watch": (
        "a pipeline over a DeviceMesh does not watch the model after transform: its stage programs are cut "
        "once and never traced again, so a hook or submodule added to the model later is not followed. "
        "Call dpcompile.transform(model, mesh, pipeline=...) again on every rank after changing the model"
    ),
    "compile": (
        "pm.compile() of a pipeline over a DeviceMesh is not built: torch.distributed.pipelining's schedule "
        "calls the stage program itself. Run it uncompiled, or compile the same pipeline in one process "
        "(dpcompile.transform(model, ['cpu'] * N, pipeline=N, ...))"
    ),
}


def mesh_pipeline_module(program: fx.GraphModule, *, recipe: Any, mesh: Any, whole: fx.GraphModule,
                         stage_index: int, num_stages: int, device: Any, pp_group: Any, dp_group: Any,
                         micro_batches: int, schedule: str, outputs: Any, live_in: list[str],
                         module_paths: tuple[str, ...], last_rank: int, has_loss: bool, count: str | None = None,
                         shared: list | None = None, writes_once: fx.GraphModule | None = None,
                         random_plan: StageRandomPlan | None = None,
                         input_dims: tuple[int | None, ...] = ()) -> ParallelModule:  # fmt: skip
    """This rank's stage ``program`` (``cut_stage``'s, for one micro-batch) as a ``ParallelModule``
    run by :data:`MESH_PIPELINE`; ``whole``: the single-device program (shapes, every stage's modes)."""
    devices = Devices((device,))
    pm = ParallelModule(nn.Module(), fx.Graph(), recipe=recipe, devices=devices, mode="spmd_pipeline")
    hold_program(pm, program)
    pm.__dict__.update(
        mesh=mesh, whole=whole, stage_index=stage_index, num_stages=num_stages, micro_batches=micro_batches,
        schedule_name=schedule, outputs=outputs, live_in=live_in, device=torch.device(device),
        module_paths=module_paths, pp_group=pp_group, dp_group=dp_group, last_rank=last_rank, has_loss=has_loss,
        shared=list(shared or []),  # (parameter, stages reading it): tied weights, summed over those stages
        writes_once=writes_once,  # this stage's writes no input reads: once a call
        _schedules={}, _wirings={}, _loss_scale=1.0,
        _count_program=count_program(whole, count) if has_loss else None,
        _may_use_batch_statistics=bool(batch_statistics_sites(whole, training=True)),
        shape_program=program,
        random_plan=random_plan,  # every stage's random sites, drawn in order a call
        shards={}, plan_reasons={}, tp_group=None,
        input_dims=tuple(input_dims),  # each input's batch dim (0), None where it goes whole to every micro-batch
        _fsdp=None,  # the FSDP2 root PipelineStage runs (data_parallel="fsdp"): pm.fsdp
        _ddp=None, _ddp_options=None,  # the DDP PipelineStage runs (ddp_options=): pm.ddp; its options, until built
        state_ties={},  # the model's state_dict keys, each with its tied names
        _executor=MESH_PIPELINE,
    )  # fmt: skip
    return pm


def hold_program(pm: Any, program: fx.GraphModule) -> None:
    """``program`` (this rank's stage) as ``pm``'s graph and code; its submodules, parameters and
    buffers are ``pm``'s (the program's own stores, so FSDP's sharding of them shows in both)."""
    pm.__dict__["program"] = program
    for store in ("_modules", "_parameters", "_buffers"):
        object.__setattr__(pm, store, program.__dict__[store])
    pm.graph = copy_graph(program.graph)


def shard_over_dp(pm: Any, dp_mesh: Any, options: dict[str, Any]) -> None:
    """FSDP2 over ``dp_mesh`` on the stage's program (after its tensor-parallel sharding, as
    torchtitan orders them): see :mod:`dpcompile.modules.mesh_stage_dp`. Collective over ``dp``."""
    program = pm.program
    if any(is_fake(t) for t in (*program.parameters(), *program.buffers())):  # a meta model, compiled on fake:
        pm.__dict__["_fsdp_pending"] = (dp_mesh, options)  # sharded once the stage has memory (materialized)
        return
    owners = {id(p): (m, n) for m in program.modules() for n, p in m._parameters.items() if p is not None}
    pm.__dict__["_fsdp"] = shard_stage_over_dp(program, dp_mesh, options)
    dp_size, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    shared = []
    for p, stages in pm.shared:  # tied weights: this stage's FSDP shard, or zeros shaped as the peers' shards
        if id(p) in owners:
            module, name = owners[id(p)]
            shared.append((module._parameters[name], stages))
        else:
            rows = local_rows_shape(p.shape, dp_size, dp_rank)
            shared.append((torch.empty(rows, dtype=p.dtype, device=pm.device), stages))
    pm.shared = shared


def hold_ddp(pm: Any, options: dict[str, Any]) -> None:
    """DDP over ``"dp"`` with ``options`` on the stage's program (after its tensor-parallel sharding):
    :func:`~dpcompile.modules.mesh_stage_dp.stage_under_ddp`. A meta model's fake stage gets it once
    it has memory (:meth:`MeshPipelineExecutor.materialized`). Collective over ``dp``."""
    pm.__dict__["_ddp_options"] = dict(options)
    if not any(is_fake(t) for t in (*pm.program.parameters(), *pm.program.buffers())):
        _build_ddp(pm)


def _build_ddp(pm: Any) -> None:
    """DDP on the stage where it has a parameter to train (DDP refuses a module without one); every
    stage scales its loss alike either way (``_step``)."""
    if any(p.requires_grad for p in pm.program.parameters()):
        pm.__dict__["_ddp"] = stage_under_ddp(pm.program, pm.dp_group, pm.device, pm._ddp_options)


def attach_shards(pm: Any, program: fx.GraphModule, *, shards: dict[str, Any], plan: dict[str, str],
                  reasons: dict[str, str]) -> None:  # fmt: skip
    """Tensor parallel inside the stage (a ``("pp", "tp")`` mesh): ``program`` replaces the stage's,
    holding this tp rank's ``shards`` (``{param: ShardSpec}``, the model's names) under ``plan``. The
    unsharded program stays for shapes (it takes and returns the same values; it runs on fake tensors)."""
    pm.__dict__["shape_program"] = pm.program
    hold_program(pm, program)
    pm.shards, pm.plan, pm.plan_reasons = dict(shards), dict(plan), dict(reasons)


def example_stage_inputs(pm: Any, inputs: tuple) -> tuple:
    """Empty tensors shaped as the stage's inputs for the first micro-batch of ``inputs`` (the
    model's inputs, in forward's order); the stage itself is not run (its outputs are not wanted)."""
    return _stage_examples(pm, _first_micro_batch(pm, inputs, pm.micro_batches), False, outputs=False)[0]


class MeshPipelineExecutor(PlainExecutor):
    """Runs a call of this rank's stage under ``torch.distributed.pipelining`` (see the module's doc)."""

    name = "pipelining"
    keeps_last_call = False
    runs_one_stage_per_rank = True

    def __call__(self, pm: Any, *args: Any, **kwargs: Any) -> Any:
        check_exported_inputs_over_mesh(pm, args, kwargs)  # before any collective: every rank alike
        inputs = _shape_inputs(pm, args, kwargs)
        batch = self.batch_size(pm, args, kwargs)
        runs = micro_batch_runs(batch, pm.micro_batches) if batch else [(pm.micro_batches, 0)]
        dp_size = _dp_size(pm)
        if pm._may_use_batch_statistics and (sum(count for count, _ in runs) > 1 or dp_size > 1):
            sites = batch_statistics_sites(pm.whole)  # the whole program's: every rank decides alike
            if sites and dp_size > 1:
                raise batch_norm_dp_refusal(sites, dp_size)
            if sites:
                raise batch_norm_refusal(sites, pm.micro_batches)
        with all_fail_together(pm):  # a rank that raises inside the step: every rank raises at once
            return _step(pm, inputs, batch, _steps_alike_over_dp(pm, runs))

    def batch_size(self, pm: Any, args: tuple, kwargs: dict) -> int | None:
        """This rank's batch of a call: dim 0 of its first batched input (what the schedule splits)."""
        inputs = _shape_inputs(pm, args, kwargs)
        return next((t.size(0) for t, split in zip(inputs, _split(pm, inputs)) if split), None)

    def check_supported(self, pm: Any, operation: str) -> None:
        """No program per call: no call key, no program for a call's inputs (``explain(pm)`` without
        inputs reads this stage), no ``pm.compile()``, no watching the model (see :data:`REFUSALS`)."""
        if operation in REFUSALS:
            raise DpCompileError(REFUSALS[operation])

    def train(self, pm: Any, mode: bool) -> None:
        """The mode of every stage's modules, so that each rank sees where BatchNorm trains."""
        pm.program.train(mode)
        pm.whole.train(mode)
        if pm.random_plan is not None:
            pm.random_plan.train(mode)

    def state_dict(self, pm: Any, positional: tuple, destination: Any, prefix: str, keep_vars: bool) -> Any:
        """The model's keys with whole tensors, put together from every stage: a collective, call
        it on every rank (:func:`~dpcompile.modules.mesh_stage_dp.full_state_dict`)."""
        return full_state_dict(pm)

    def load_state_dict(self, pm: Any, state_dict: Any, strict: bool, assign: bool) -> Any:
        """The model's keys with whole tensors (``pm.state_dict()``, ``model.state_dict()``): this rank
        keeps its stage's pieces (:func:`~dpcompile.modules.mesh_stage_dp.load_whole_state`)."""
        return load_whole_state(pm, state_dict, strict)

    def check_picklable(self, pm: Any) -> None:
        raise TypeError(
            "a pipeline over a DeviceMesh holds process groups and cannot be pickled; save pm.state_dict() "
            "(full tensors, the original keys) and rebuild with dpcompile.transform(model, mesh, pipeline=...)"
        )

    def materialized(self, pm: Any, memo: dict[int, torch.Tensor]) -> None:
        """A meta model's fake stage was given memory (``memo``): the tied weights' copies follow it,
        and DDP or FSDP (``data_parallel="fsdp"``: it shards the stage it now holds) are built on it."""
        pm.shared = [(materialized_copy(p, memo, pm.device), stages) for p, stages in pm.shared]
        if pm._ddp_options is not None and pm.ddp is None:  # DDP broadcasts memory, not yet weights: load fills both
            _build_ddp(pm)
        pending = pm.__dict__.pop("_fsdp_pending", None)
        if pending is not None:  # FSDP2 shards the allocated stage (uninitialised): load_checkpoint fills the rows
            shard_over_dp(pm, *pending)


#: the executor of this rank's stage of a pipeline over a mesh
MESH_PIPELINE = MeshPipelineExecutor()


def _dp_size(pm: Any) -> int:
    import torch.distributed as dist

    return 1 if pm.dp_group is None else dist.get_world_size(pm.dp_group)


def _steps_alike_over_dp(pm: Any, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Under DDP or FSDP each schedule step ends in a collective over ``"dp"`` (DDP's all-reduce,
    FSDP's reduce-scatter), so every dp rank runs as many steps: a rank whose share of the batch
    splits into unequal micro-batches runs two, and the others split theirs alike (the same
    micro-batches, the same gradients). One all-reduce (max) over ``"dp"`` a call."""
    import torch.distributed as dist

    if pm.dp_group is None or (pm.fsdp is None and pm._ddp_options is None and "_fsdp_pending" not in pm.__dict__):
        return runs
    steps = torch.tensor([len(runs)], device=group_device(pm.dp_group))  # an NCCL group refuses CPU tensors
    dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=pm.dp_group)
    aligned = split_into_steps(runs, int(steps))
    if aligned is None:
        raise DpCompileError(
            f"this dp rank's share of the batch is {sum(c * r for c, r in runs)} sample(s), too few to run as the {int(steps)} "
            "schedule steps another dp rank's share needs (its micro-batches are unequal), and DDP or FSDP reduce "
            "over 'dp' once per step: give every dp rank at least micro_batches= samples (dpcompile.mesh.local_batch)"
        )
    return aligned


def _split(pm: Any, inputs: tuple) -> list[bool]:
    """Which of the call's ``inputs`` are split into micro-batches (along dim 0): the batched tensors;
    an input the batch does not run through (a table every row reads) goes whole to each."""
    dims = pm.input_dims
    return [isinstance(t, torch.Tensor) and t.dim() > 0 and (i >= len(dims) or dims[i] is not None)
            for i, t in enumerate(inputs)]  # fmt: skip


def _first_micro_batch(pm: Any, inputs: tuple, count: int) -> tuple:
    split = _split(pm, inputs)
    return tuple(torch.tensor_split(t, count)[0] if s else t for t, s in zip(inputs, split))


def _schedule_for(pm: Any, inputs: tuple, count: int, train: bool) -> Any:
    """The schedule for a run of ``count`` equal micro-batches shaped as ``inputs``' first one
    (built once per shape). Fewer micro-batches than stages run GPipe's order: torch's
    ``Schedule1F1B`` needs ``M >= S``, and with ``M < S`` its warm-up holds every forward anyway."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    firsts = _first_micro_batch(pm, inputs, count)
    key = (tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in firsts), count, train)
    schedules, root = pm._schedules, pm.fsdp if pm.fsdp is not None else pm.ddp
    wired = pm.fsdp if pm.ddp is None else pm.ddp.module  # the TensorsOnWire under FSDP or DDP
    if key not in schedules:
        stage_in, stage_out = _stage_examples(pm, firsts, train)
        first = pm.stage_index == 0
        if root is not None:  # one FSDP or DDP root for every shape: rewired before each run
            bound, sent = wiring(stage_in, stage_out, first=first, device=pm.device)
            pm._wirings[key] = (bound, len(stage_in), sent)
            module = root
            stage_in = tuple(v for i, v in enumerate(stage_in) if i not in bound)
            stage_out = tuple(stage_out[i] for i in sent)
        else:
            module, stage_in, stage_out = on_wire(pm.program, stage_in, stage_out, first=first, device=pm.device)
        stage = PipelineStage(module, pm.stage_index, pm.num_stages, pm.device, input_args=stage_in,
                              output_args=stage_out, group=pm.pp_group)  # fmt: skip
        loss_at = next((leaf[1] for leaf in pm.outputs.leaves if leaf[0] == "mean"), 0) if pm.outputs else 0
        kind = Schedule1F1B if pm.schedule_name == "1f1b" and count >= pm.num_stages else ScheduleGPipe
        # each micro-batch's loss *sum*; the step's gradients are divided by the whole batch's count after
        schedules[key] = kind(
            stage, count,
            loss_fn=(lambda out, _: out[loss_at].sum() * pm._loss_scale) if pm.has_loss else None,
            scale_grads=False,  # the first stage's inputs: batched ones split, the others whole to each micro-batch
            args_chunk_spec=tuple(TensorChunkSpec(0) if s else _Replicate() for s in _split(pm, inputs)),
        )  # fmt: skip
    if root is not None:
        wired.rewire(*pm._wirings[key])
    return schedules[key]


def _stage_examples(pm: Any, firsts: tuple, train: bool, *, outputs: bool = True) -> tuple[tuple, tuple]:
    """Empty tensors shaped as the stage's inputs and outputs for one micro-batch (``outputs=False``:
    the inputs alone, and no outputs: the stage's program is not run on them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    whole = pm.whole
    buffers = [(b, b.detach().clone()) for b in whole.buffers()]
    try:
        modules = [whole, pm.shape_program]
        with (
            FakeTensorMode(allow_non_fake_inputs=True) as mode,
            whole_parameters_on_fake(modules, pm.device),
            drawing(FakeRunDraws()),
        ):
            fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in firsts]
            values = _node_values(whole, fakes, pm.live_in)
            ins = [values[name] for name in pm.live_in]
            if pm.stage_index > 0:  # a value needs a gradient where it does in the whole program: then the
                ins = [  # stage before sends it and expects its gradient back (not rotary cos/sin, a float mask)
                    v.detach().requires_grad_(train and v.requires_grad) if isinstance(v, torch.Tensor) else v
                    for v in ins
                ]
            outs = ()
            if outputs:
                with torch.set_grad_enabled(train):
                    outs = pm.shape_program(*ins)
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)

    def empty(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        return torch.empty(v.shape, dtype=v.dtype, device=pm.device).requires_grad_(v.requires_grad)

    return tuple(empty(v) for v in ins), tuple(empty(v) for v in outs)


def _step(pm: Any, inputs: tuple, batch: int | None, runs: list[tuple[int, int]]) -> Any:
    """The call's communicating part: the loss's count, the schedule's runs, the dp and pp reductions."""
    import torch.distributed as dist

    first, last = pm.stage_index == 0, pm.stage_index == pm.num_stages - 1
    if pm.writes_once is not None:  # a step counter, an EMA of a parameter: once per call, as eager
        pm.writes_once()
    train = pm.training and torch.is_grad_enabled() and pm.has_loss
    # where the loss's count follows from the inputs alone (labels), every rank knows it before
    # the step: each micro-batch's loss is its sum over the whole count, and nothing is divided after
    known = train and pm._count_program is not None
    # DDP averages its all-reduce over dp: each rank's loss times dp's size makes that average the sum
    # (on every stage alike: the last stage's loss scales every stage's gradients)
    by_ddp = pm._ddp_options is not None
    pm._loss_scale = float(dist.get_world_size(pm.dp_group)) if by_ddp else 1.0
    if known:
        count = torch.as_tensor(pm._count_program(*inputs), dtype=torch.float64).reshape(1)
        if pm.dp_group is not None:  # a count the program returned as a number is on the CPU: NCCL refuses it
            count = count.to(group_device(pm.dp_group))
            dist.all_reduce(count, group=pm.dp_group)
        pm._loss_scale /= float(count)
    before = {p: p.grad.clone() for p in pm.program.parameters() if p.grad is not None} if train else {}
    draws = pm.random_plan.record(inputs, batch, runs, pm.dp_group) if pm.random_plan is not None else None
    pieces, start = [], 0  # each run of equal micro-batches is one step of its own schedule
    with drawing(draws) if draws is not None else contextlib.nullcontext():
        for micro, rows in runs:
            stop = start + micro * rows
            part = tuple(t[start:stop] if s and batch else t for t, s in zip(inputs, _split(pm, inputs)))
            schedule = _schedule_for(pm, part, micro, train)
            run = schedule.step if train else schedule.eval
            target = torch.zeros(stop - start if batch else micro) if last else None
            with _fsdp_gradients_kept(pm):
                pieces.append(run(*(part if first else ()), target=target))
            start = stop
    if draws is not None:
        draws.finish()  # the later stages' sites: the generator ends where eager's does
    if pm.fsdp is not None and not train:  # a forward alone keeps the gathered parameters: free them
        pm.fsdp.reshard()
    merged = _concatenated(pieces) if last else None
    totals = torch.zeros(2, dtype=torch.float64, device=group_device(pm.pp_group))  # the whole batch's loss sum and count
    if last and pm.has_loss:
        pair = next(leaf for leaf in pm.outputs.leaves if leaf[0] == "mean")
        totals = torch.stack([merged[pair[1]].detach().double().sum(), merged[pair[2]].detach().double().sum()])
    if last and pm.has_loss and pm.dp_group is not None:  # the whole global batch's sum and count
        dist.all_reduce(totals, group=pm.dp_group)  # the dp group of a last stage holds last stages only
    if train and not known:  # every stage divides by the count the last stage found
        dist.broadcast(totals, src=pm.last_rank, group=pm.pp_group)
    if train:
        _sum_shared_gradients(pm, before)
        _average_gradients(pm, before, 1.0 if known else float(totals[1]))
    return _rebuild(pm, merged, totals, train) if last else None


@contextlib.contextmanager
def _fsdp_gradients_kept(pm: Any) -> Iterator[None]:
    """Around a schedule's step on an FSDP stage: the gradients it holds are set aside and added back
    after. A schedule's first step (each micro-batch shape builds one) ends its set-up with torch's
    ``_post_metadata_inference_cleanup``, which sets every FSDP parameter's ``.grad`` to None: the
    step before it in the same call (unequal micro-batches) and earlier calls' accumulated gradients
    were dropped, silently."""
    if pm.fsdp is None:
        yield
        return
    kept = {p: p.grad for p in pm.program.parameters() if p.grad is not None}
    for p in kept:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in kept.items():
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)


def _shape_inputs(pm: Any, args: tuple, kwargs: dict) -> tuple:
    """The call's inputs in the whole program's order (every rank is called with them), bound as
    forward's arguments were traced (``pm.call_names``): those traced as None (``pm.left_none``) must
    be left None, and are not the program's."""
    names = [str(n.target) for n in pm.whole.graph.nodes if n.op == "placeholder"]
    traced = pm.__dict__.get("call_names") or names
    left_none = pm.__dict__.get("left_none") or frozenset()
    bound = dict(zip(traced, _positional(traced, args, kwargs, left_none)))
    given = sorted(name for name in left_none if bound[name] is not None)
    if given:
        raise ArgumentError(
            f"this pipeline over a mesh was built with {given[0]!r} left None, as its examples leave it, and its stages "
            f"are cut once, never traced again: leave {given[0]!r} None, or transform with example_inputs= (or "
            f"example_kwargs=) that pass it"
        )
    return tuple(bound[name] for name in names)


def _sum_shared_gradients(pm: Any, before: dict) -> None:
    """A parameter two stages read (tied weights) has a copy on each of their ranks: each copy
    gets the sum of this step's gradients over the pp ranks (every pp rank joins, in the same order)."""
    import torch.distributed as dist

    for p, stages in pm.shared:
        mine = pm.stage_index in stages
        old = before.get(p)
        step = torch.zeros_like(p) if not mine or p.grad is None else p.grad if old is None else p.grad - old
        step = step.clone() if step is p.grad else step
        dist.all_reduce(local(step), group=pm.pp_group)  # FSDP: every stage holds the same rows
        if mine:
            p.grad = step if old is None else old + step


def _average_gradients(pm: Any, before: dict, count: float) -> None:
    """The step summed each micro-batch's loss sum: divide this step's gradients by the whole
    batch's count (after adding them up over dp), keeping what was accumulated before."""
    import torch.distributed as dist

    for p in pm.program.parameters():
        if p.grad is None:
            continue
        old = before.get(p)
        step = p.grad if old is None else p.grad - old
        if pm.dp_group is not None and pm.fsdp is None and pm._ddp_options is None:  # FSDP, DDP reduced them in the step
            dist.all_reduce(step, group=pm.dp_group)
        if old is None:
            if count != 1.0:
                p.grad.div_(count)
        else:
            p.grad = old + step / count


def _rebuild(pm: Any, merged: Any, totals: torch.Tensor, train: bool) -> Any:
    flat = merged if isinstance(merged, (tuple, list)) else (merged,)
    values = []
    for leaf in pm.outputs.leaves:
        if leaf[0] == "mean":
            loss = (totals[0] / totals[1]).to(flat[leaf[1]].dtype)
            values.append(backward_done(loss) if train else loss)  # the step ran its backward
        else:  # detached by the schedule: a backward through it would be dropped, so it refuses
            values.append(no_gradient_path(flat[leaf[1]], f"output {len(values)}") if train else flat[leaf[1]])
    return pm.outputs.assemble(values)


def _concatenated(pieces: list) -> Any:
    """The last stage's merged outputs of each run, one batch (the schedule merges on dim 0)."""
    flat = [p if isinstance(p, (tuple, list)) else (p,) for p in pieces]
    if len(flat) == 1:
        return flat[0]
    return tuple(torch.cat([f[i] for f in flat]) for i in range(len(flat[0])))


def count_program(whole: fx.GraphModule, count: str | None) -> fx.GraphModule | None:
    """The loss's count (the node ``count``, e.g. ``target_weight(labels)``) computed from the
    inputs alone, where it reads no module or parameter (a count of activations' elements does: None)."""
    start = next((n for n in whole.graph.nodes if n.name == count), None)
    if start is None:
        return None
    needed: set[fx.Node] = set()
    stack = [start]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        if node.op in ("call_module", "get_attr"):
            return None
        needed.add(node)
        stack.extend(node.all_input_nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in whole.graph.nodes:
        if node.op == "placeholder" or node in needed:
            env[node] = graph.node_copy(node, lambda v: env[v])
    graph.output(env[start])
    return fx.GraphModule(nn.Module(), graph, "LossCount")


class _Enough(Exception):
    pass


def _node_values(gm: fx.GraphModule, inputs: list, wanted: list[str]) -> dict[str, Any]:
    """The values of the nodes ``wanted`` when ``gm`` runs on ``inputs`` (it stops there: what
    follows may read values fake tensors do not have, such as a loss's count)."""
    values: dict[str, Any] = {}
    missing = set(wanted)

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            values[n.name] = result = super().run_node(n)
            missing.discard(n.name)
            if not missing:
                raise _Enough
            return result

    try:
        Recorder(gm).run(*inputs)
    except _Enough:
        pass
    return values


def _positional(names: list[str], args: tuple, kwargs: dict, optional: frozenset[str] = frozenset()) -> tuple:
    """The call's arguments in the program's placeholder order (those in ``optional`` None where left out)."""
    if len(args) > len(names):
        raise ArgumentError(f"forward takes {len(names)} arguments ({', '.join(names)}), but {len(args)} were given")
    unknown = [k for k in kwargs if k not in names[len(args) :]]
    if unknown:
        raise ArgumentError(f"unexpected argument '{unknown[0]}': forward takes ({', '.join(names)})")
    values = list(args)
    for name in names[len(args) :]:
        if name not in kwargs and name not in optional:
            raise ArgumentError(f"missing argument '{name}': forward takes ({', '.join(names)})")
        values.append(kwargs.get(name))
    return tuple(values)


__all__ = [
    "MESH_PIPELINE", "MeshPipelineExecutor", "attach_shards", "count_program", "example_stage_inputs", "hold_ddp",
    "hold_program",
    "mesh_pipeline_module", "shard_over_dp",
]
