"""``MeshPipelineModule``: this rank's pipeline stage over the ``"pp"`` dimension of a DeviceMesh,
run by ``torch.distributed.pipelining`` (with ``"dp"`` and ``"tp"`` where the mesh has them).

The one-process pipeline is :mod:`dpcompile.modules.pipeline`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.devices import Devices
from dpcompile.errors import DpCompileError
from dpcompile.fx_utils import copy_graph
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.mesh_failure import all_fail_together
from dpcompile.modules.mesh_random import FakeRunDraws, StageRandomPlan
from dpcompile.modules.mesh_stage import (
    MESH_PIPELINE_INSPECTION,
    backward_done,
    batch_norm_refusal,
    batch_statistics_sites,
    materialized_copy,
    micro_batch_runs,
    no_gradient_path,
    on_wire,
    wiring,
)
from dpcompile.modules.mesh_stage_dp import (
    full_state_dict,
    load_whole_state,
    local,
    local_rows_shape,
    shard_stage_over_dp,
    whole_parameters_on_fake,
)
from dpcompile.runtime.random_plan import drawing


class MeshPipelineModule(ParallelModule):
    """This rank's pipeline stage under ``torch.distributed.pipelining`` (``PipelineStage`` with
    ``ScheduleGPipe`` or ``Schedule1F1B``), over the ``"pp"`` dimension of a mesh (and ``"dp"``).

    A :class:`~dpcompile.modules.base.ParallelModule` whose graph and code are this rank's stage
    program (``pm.program``; ``pm.code``), holding its modules, parameters and buffers (the model's
    own, or this tp rank's shards). In training mode with gradients enabled a call runs the
    schedule's ``step``: forward *and*
    backward of the model's own mean loss, as the pipelining schedules do; gradients land on this
    stage's parameters (the model's own), and equal the single-device gradients of the whole
    batch (over every ``dp`` rank). Under ``torch.no_grad()`` or in eval mode it runs forward only.
    The last stage returns the model's output (the loss is the whole batch's mean, detached);
    other stages return None. On a ``("pp", "tp")`` mesh the
    program holds this tp rank's shards of the stage (``pm.shards``, ``pm.plan``; see
    :meth:`attach_shards`); with ``data_parallel="fsdp"`` FSDP2 wraps the stage over ``"dp"``
    (``pm.fsdp``, :meth:`shard_over_dp`). ``pm.state_dict()`` is the model's, whole (a collective);
    ``pm.load_state_dict()`` takes it back (each rank keeps its pieces).

    Each stage's input and output shapes are worked out on fake tensors from the whole program
    (``whole``) for each micro-batch shape, and handed to ``PipelineStage`` (its static mode), so
    the engine never runs a stage on uninitialised buffers (labels as indices would fail). A batch
    that does not divide into ``micro_batches`` runs as two runs of equal micro-batches, one
    schedule step each (:mod:`dpcompile.modules.mesh_stage`).
    """

    executor = "pipelining"
    fsdp = None  # its own: the FSDP2 root of the stage (not ParallelModule's property over a mesh's program)

    def __init__(self, program: fx.GraphModule, *, recipe: Any, mesh: Any, whole: fx.GraphModule, stage_index: int,
                 num_stages: int, device: Any, pp_group: Any, dp_group: Any, micro_batches: int, schedule: str,
                 outputs: Any, live_in: list[str], module_paths: tuple[str, ...], last_rank: int,
                 has_loss: bool, count: str | None = None, shared: list | None = None,
                 writes_once: fx.GraphModule | None = None, random_plan: StageRandomPlan | None = None):  # fmt: skip
        fx.GraphModule.__init__(self, nn.Module(), fx.Graph(), "MeshPipelineModule")
        self.hold_program(program)
        self.recipe, self.mesh, self.mode, self.records, self.captured = recipe, mesh, "spmd_pipeline", [], None
        self.devices = Devices((device,))
        self.output_device, self.input_dims = self.devices.primary, {}
        self.whole = whole  # the single-device program: shapes, every stage's modes
        self.stage_index, self.num_stages, self.micro_batches = stage_index, num_stages, micro_batches
        self.schedule_name, self.outputs = schedule, outputs
        self.live_in, self.device = live_in, torch.device(device)
        self.module_paths, self.pp_group, self.dp_group, self.last_rank = module_paths, pp_group, dp_group, last_rank
        self.has_loss = has_loss
        self.shared = list(shared or [])  # (parameter, stages reading it): tied weights, summed over those stages
        self.writes_once = writes_once  # this stage's writes no input reads: once a call
        self._schedules: dict[Any, Any] = {}
        self._wirings: dict[Any, Any] = {}
        self._loss_scale = 1.0
        self._count_program = count_program(whole, count) if has_loss else None
        self._may_use_batch_statistics = bool(batch_statistics_sites(whole, training=True))
        self.shape_program = program
        self.random_plan = random_plan  # every stage's random sites, drawn in order a call
        self.shards: dict[str, Any] = {}
        self.plan: dict[str, str] = {}
        self.plan_reasons: dict[str, str] = {}
        self.tp_group: Any = None
        self.fsdp: nn.Module | None = None  # the FSDP2 root PipelineStage runs (data_parallel="fsdp")
        self.state_ties: dict[str, tuple[str, ...]] = {}  # the model's state_dict keys, each with its tied names

    def __setattr__(self, name: str, value: Any) -> None:
        """Every attribute is the module's own (in its ``__dict__``): the stage's modules and tensors
        are the program's, held in the program's own stores."""
        object.__setattr__(self, name, value)

    def hold_program(self, program: fx.GraphModule) -> None:
        """``program`` (this rank's stage) as ``pm``'s graph and code; its submodules, parameters and
        buffers are ``pm``'s (the program's own stores, so FSDP's sharding of them shows in both)."""
        self.program = program
        for store in ("_modules", "_parameters", "_buffers"):
            object.__setattr__(self, store, program.__dict__[store])
        self.graph = copy_graph(program.graph)

    def shard_over_dp(self, dp_mesh: Any, options: dict[str, Any]) -> None:
        """FSDP2 over ``dp_mesh`` on this stage's program (after its tensor-parallel sharding, as
        torchtitan orders them): see :mod:`dpcompile.modules.mesh_stage_dp`. Collective over ``dp``."""
        owners = {id(p): (m, n) for m in self.program.modules() for n, p in m._parameters.items() if p is not None}
        self.fsdp = shard_stage_over_dp(self.program, dp_mesh, options)
        dp_size, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
        shared = []
        for p, stages in self.shared:  # tied weights: this stage's FSDP shard, or zeros shaped as the peers' shards
            if id(p) in owners:
                module, name = owners[id(p)]
                shared.append((module._parameters[name], stages))
            else:
                rows = local_rows_shape(p.shape, dp_size, dp_rank)
                shared.append((torch.empty(rows, dtype=p.dtype, device=self.device), stages))
        self.shared = shared

    def follow_materialized(self, memo: dict[int, torch.Tensor]) -> None:
        """A meta model's fake stage was given memory (``memo``): the tied weights' copies follow it."""
        self.shared = [(materialized_copy(p, memo, self.device), stages) for p, stages in self.shared]

    def attach_shards(self, program: fx.GraphModule, *, shards: dict[str, Any], plan: dict[str, str],
                      reasons: dict[str, str]) -> None:  # fmt: skip
        """Tensor parallel inside the stage (a ``("pp", "tp")`` mesh): ``program`` replaces the stage's,
        holding this tp rank's ``shards`` (``{param: ShardSpec}``, the model's names) under ``plan``. The
        unsharded program stays for shapes (it takes and returns the same values; it runs on fake tensors)."""
        self.shape_program = self.program
        self.hold_program(program)
        self.shards, self.plan, self.plan_reasons = dict(shards), dict(plan), dict(reasons)

    def example_stage_inputs(self, inputs: tuple) -> tuple:
        """Empty tensors shaped as this stage's inputs for the first micro-batch of ``inputs``
        (the model's inputs, in forward's order)."""
        return self._stage_examples(self._first_micro_batch(inputs, self.micro_batches), False)[0]

    @staticmethod
    def _first_micro_batch(inputs: tuple, count: int) -> tuple:
        return tuple(torch.tensor_split(t, count)[0] if isinstance(t, torch.Tensor) and t.dim() else t for t in inputs)

    def _schedule_for(self, inputs: tuple, count: int, train: bool) -> Any:
        """The schedule for a run of ``count`` equal micro-batches shaped as ``inputs``' first one
        (built once per shape). Fewer micro-batches than stages run GPipe's order: torch's
        ``Schedule1F1B`` needs ``M >= S``, and with ``M < S`` its warm-up holds every forward anyway."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        firsts = self._first_micro_batch(inputs, count)
        key = (tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in firsts), count, train)
        if key not in self._schedules:
            stage_in, stage_out = self._stage_examples(firsts, train)
            if self.fsdp is not None:  # one FSDP root for every shape: rewired before each run
                bound, sent = wiring(stage_in, stage_out, first=self.stage_index == 0, device=self.device)
                self._wirings[key] = (bound, len(stage_in), sent)
                module = self.fsdp
                stage_in = tuple(v for i, v in enumerate(stage_in) if i not in bound)
                stage_out = tuple(stage_out[i] for i in sent)
            else:
                module, stage_in, stage_out = on_wire(
                    self.program, stage_in, stage_out, first=self.stage_index == 0, device=self.device
                )
            stage = PipelineStage(module, self.stage_index, self.num_stages, self.device, input_args=stage_in,
                                  output_args=stage_out, group=self.pp_group)  # fmt: skip
            loss_at = next((leaf[1] for leaf in self.outputs.leaves if leaf[0] == "mean"), 0) if self.outputs else 0
            kind = Schedule1F1B if self.schedule_name == "1f1b" and count >= self.num_stages else ScheduleGPipe
            # each micro-batch's loss *sum*; the step's gradients are divided by the whole batch's count after
            self._schedules[key] = kind(
                stage, count,
                loss_fn=(lambda out, _: out[loss_at].sum() * self._loss_scale) if self.has_loss else None,
                scale_grads=False,
            )  # fmt: skip
        if self.fsdp is not None:
            self.fsdp.rewire(*self._wirings[key])
        return self._schedules[key]

    def _stage_examples(self, firsts: tuple, train: bool) -> tuple[tuple, tuple]:
        """Empty tensors shaped as this stage's inputs and outputs for one micro-batch."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        buffers = [(b, b.detach().clone()) for b in self.whole.buffers()]
        try:
            modules = [self.whole, self.shape_program]
            with (
                FakeTensorMode(allow_non_fake_inputs=True) as mode,
                whole_parameters_on_fake(modules, self.device),
                drawing(FakeRunDraws()),
            ):
                fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in firsts]
                values = _node_values(self.whole, fakes, self.live_in)
                ins = [values[name] for name in self.live_in]
                if self.stage_index > 0:  # a value needs a gradient where it does in the whole program: then the
                    ins = [  # stage before sends it and expects its gradient back (not rotary cos/sin, a float mask)
                        v.detach().requires_grad_(train and v.requires_grad) if isinstance(v, torch.Tensor) else v
                        for v in ins
                    ]
                with torch.set_grad_enabled(train):
                    outs = self.shape_program(*ins)
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)

        def empty(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            return torch.empty(v.shape, dtype=v.dtype, device=self.device).requires_grad_(v.requires_grad)

        return tuple(empty(v) for v in ins), tuple(empty(v) for v in outs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The model's keys with whole tensors, put together from every stage: a collective, call
        it on every rank (:func:`~dpcompile.modules.mesh_stage_dp.full_state_dict`)."""
        return full_state_dict(self)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """The model's keys with whole tensors (``pm.state_dict()``, ``model.state_dict()``): this rank
        keeps its stage's pieces (:func:`~dpcompile.modules.mesh_stage_dp.load_whole_state`)."""
        return load_whole_state(self, state_dict, strict)

    def train(self, mode: bool = True) -> MeshPipelineModule:
        """The mode of every stage's modules, so that each rank sees where BatchNorm trains."""
        super().train(mode)
        self.program.train(mode)
        self.whole.train(mode)
        if self.random_plan is not None:
            self.random_plan.train(mode)
        return self

    def program_for_call(self, *args: Any, **kwargs: Any) -> fx.GraphModule:
        """This rank's stage reads what the stage before sends, not the model's inputs: no program
        answers a call's inputs alone (``explain(pm)`` without inputs reads this stage)."""
        raise DpCompileError(MESH_PIPELINE_INSPECTION)

    def batch_size(self, args: tuple, kwargs: dict) -> int | None:
        """This rank's batch of a call: dim 0 of its first batched input (what the schedule splits)."""
        inputs = self._shape_inputs(args, kwargs)
        return next((t.size(0) for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0), None)

    def call_key(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: no program is chosen per call here (see the error)."""
        raise DpCompileError(
            "a pipeline over a DeviceMesh keeps no programs by call key: each rank runs one stage program "
            "(pm.code), under a schedule built for each micro-batch shape at its first call. Read pm.stage_index, "
            "pm.micro_batches, pm.schedule_name and pm.batch_size(args, kwargs) for what a call runs"
        )

    def model_changed_since_transform(self) -> bool:
        """Refused: the stage is never traced again, so a change to the model is not watched (see the error)."""
        raise DpCompileError(
            "a pipeline over a DeviceMesh does not watch the model after transform: its stage programs are cut "
            "once and never traced again, so a hook or submodule added to the model later is not followed. "
            "Call dpcompile.transform(model, mesh, pipeline=...) again on every rank after changing the model"
        )

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Refused: torch.distributed.pipelining runs the stage (see the error)."""
        raise DpCompileError(
            "pm.compile() of a pipeline over a DeviceMesh is not built: torch.distributed.pipelining's schedule "
            "calls the stage program itself. Run it uncompiled, or compile the same pipeline in one process "
            "(dpcompile.transform(model, ['cpu'] * N, pipeline=N, ...))"
        )

    def __reduce__(self) -> Any:
        raise TypeError(
            "a pipeline over a DeviceMesh holds process groups and cannot be pickled; save pm.state_dict() "
            "(full tensors, the original keys) and rebuild with dpcompile.transform(model, mesh, pipeline=...)"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inputs = self._shape_inputs(args, kwargs)
        batch = next((t.size(0) for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        runs = micro_batch_runs(batch, self.micro_batches) if batch else [(self.micro_batches, 0)]
        if self._may_use_batch_statistics and sum(count for count, _ in runs) > 1:
            sites = batch_statistics_sites(self.whole)  # the whole program's: every rank decides alike
            if sites:
                raise batch_norm_refusal(sites, self.micro_batches)
        with all_fail_together(self):  # a rank that raises inside the step: every rank raises at once
            return self._step(inputs, batch, runs)

    def _step(self, inputs: tuple, batch: int | None, runs: list[tuple[int, int]]) -> Any:
        """The call's communicating part: the loss's count, the schedule's runs, the dp and pp reductions."""
        import torch.distributed as dist

        first, last = self.stage_index == 0, self.stage_index == self.num_stages - 1
        if self.writes_once is not None:  # a step counter, an EMA of a parameter: once per call, as eager
            self.writes_once()
        train = self.training and torch.is_grad_enabled() and self.has_loss
        # where the loss's count follows from the inputs alone (labels), every rank knows it before
        # the step: each micro-batch's loss is its sum over the whole count, and nothing is divided after
        known = train and self._count_program is not None
        self._loss_scale = 1.0
        if known:
            count = torch.as_tensor(self._count_program(*inputs), dtype=torch.float64).reshape(1)
            if self.dp_group is not None:
                dist.all_reduce(count, group=self.dp_group)
            self._loss_scale = 1.0 / float(count)
        before = {p: p.grad.clone() for p in self.program.parameters() if p.grad is not None} if train else {}
        draws = self.random_plan.record(inputs, batch, runs, self.dp_group) if self.random_plan is not None else None
        pieces, start = [], 0  # each run of equal micro-batches is one step of its own schedule
        with drawing(draws) if draws is not None else contextlib.nullcontext():
            for micro, rows in runs:
                stop = start + micro * rows
                part = tuple(t[start:stop] if isinstance(t, torch.Tensor) and t.dim() and batch else t for t in inputs)
                schedule = self._schedule_for(part, micro, train)
                run = schedule.step if train else schedule.eval
                target = torch.zeros(stop - start if batch else micro) if last else None
                pieces.append(run(*(part if first else ()), target=target))
                start = stop
        if draws is not None:
            draws.finish()  # the later stages' sites: the generator ends where eager's does
        if self.fsdp is not None and not train:  # a forward alone keeps the gathered parameters: free them
            self.fsdp.reshard()
        merged = _concatenated(pieces) if last else None
        totals = torch.zeros(2, dtype=torch.float64)  # the whole batch's loss sum and count
        if last and self.has_loss:
            pair = next(leaf for leaf in self.outputs.leaves if leaf[0] == "mean")
            totals = torch.stack([merged[pair[1]].detach().double().sum(), merged[pair[2]].detach().double().sum()])
        if last and self.has_loss and self.dp_group is not None:  # the whole global batch's sum and count
            dist.all_reduce(totals, group=self.dp_group)  # the dp group of a last stage holds last stages only
        if train and not known:  # every stage divides by the count the last stage found
            dist.broadcast(totals, src=self.last_rank, group=self.pp_group)
        if train:
            self._sum_shared_gradients(before)
            self._average_gradients(before, 1.0 if known else float(totals[1]))
        return self._rebuild(merged, totals, train) if last else None

    def _shape_inputs(self, args: tuple, kwargs: dict) -> tuple:
        """The call's inputs in the whole program's order (every rank is called with them)."""
        names = [str(n.target) for n in self.whole.graph.nodes if n.op == "placeholder"]
        return _positional(names, args, kwargs)

    def _sum_shared_gradients(self, before: dict) -> None:
        """A parameter two stages read (tied weights) has a copy on each of their ranks: each copy
        gets the sum of this step's gradients over the pp ranks (every pp rank joins, in the same order)."""
        import torch.distributed as dist

        for p, stages in self.shared:
            mine = self.stage_index in stages
            old = before.get(p)
            step = torch.zeros_like(p) if not mine or p.grad is None else p.grad if old is None else p.grad - old
            step = step.clone() if step is p.grad else step
            dist.all_reduce(local(step), group=self.pp_group)  # FSDP: every stage holds the same rows
            if mine:
                p.grad = step if old is None else old + step

    def _average_gradients(self, before: dict, count: float) -> None:
        """The step summed each micro-batch's loss sum: divide this step's gradients by the whole
        batch's count (after adding them up over dp), keeping what was accumulated before."""
        import torch.distributed as dist

        for p in self.program.parameters():
            if p.grad is None:
                continue
            old = before.get(p)
            step = p.grad if old is None else p.grad - old
            if self.dp_group is not None and self.fsdp is None:  # FSDP reduce-scattered them in the step
                dist.all_reduce(step, group=self.dp_group)
            if old is None:
                if count != 1.0:
                    p.grad.div_(count)
            else:
                p.grad = old + step / count

    def _rebuild(self, merged: Any, totals: torch.Tensor, train: bool) -> Any:
        flat = merged if isinstance(merged, (tuple, list)) else (merged,)
        values = []
        for leaf in self.outputs.leaves:
            if leaf[0] == "mean":
                loss = (totals[0] / totals[1]).to(flat[leaf[1]].dtype)
                values.append(backward_done(loss) if train else loss)  # the step ran its backward
            else:  # detached by the schedule: a backward through it would be dropped, so it refuses
                values.append(no_gradient_path(flat[leaf[1]], f"output {len(values)}") if train else flat[leaf[1]])
        return self.outputs.assemble(values)


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


def _positional(names: list[str], args: tuple, kwargs: dict) -> tuple:
    """The call's arguments in the program's placeholder order."""
    values = list(args)
    for name in names[len(args) :]:
        if name not in kwargs:
            raise TypeError(f"missing argument '{name}'")
        values.append(kwargs[name])
    return tuple(values)
