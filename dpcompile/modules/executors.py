"""What runs a call of a :class:`~dpcompile.modules.base.ParallelModule`: an executor the module
holds (``pm.executor`` is its name), not a subclass of its own.

* :data:`PLAIN` (``"plain"``): the program, run as the model's forward (its hooks, its writes);
* :class:`PipelineExecutor` (``"gpipe"`` / ``"1f1b"``): a pipeline in one process over
  ``pm.stages``; GPipe's order is the program's, and a training call of ``"1f1b"`` runs the
  1F1B step (``modules/pipeline_1f1b.py``); a call counts micro-batches, not devices;
* ``SpmdExecutor`` (``"plain"``, :mod:`dpcompile.modules.spmd`): one rank's program over a mesh.

Only the code that builds or loads a program picks one (``recipes/``, ``recipes/meta.py``,
``export/build.py``, and unpickling through :func:`restore_executor`)::

    pm = ParallelModule(lowered, ...)         # PLAIN
    hold_pipeline(pm, stages=..., micro_batches=4, schedule="1f1b", stage_plan=plan)
    pm.executor                               # "1f1b"
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.devices import Devices
from dpcompile.errors import ArgumentError
from dpcompile.modules.hooks import call_with_hooks, run_as_model, run_writing_to_model
from dpcompile.modules.sharded_state import load_pieces, warn_if_gradients_not_cleared, whole_state_dict
from dpcompile.modules.weights import NEEDS_WEIGHTS, LoadsWeights, weights_not_loaded
from dpcompile.runtime.structures import tensor_leaves


class PlainExecutor:
    """Runs the program a call looks up, as the model's forward would run."""

    name = "plain"
    #: a call like the last one reuses its program without building the key (``modules/last_call.py``)
    keeps_last_call = True

    # What tools ask of a program (explain, measure, verify, export, checkpoints), answered here so
    # that no tool dispatches on an executor's name and a new executor answers for itself:
    #: ``pm.stages`` are a pipeline's stages, run in this process (GPipe's order or 1F1B's)
    runs_stages_in_one_process = False
    #: a training call (gradients enabled) runs the 1F1B step the recipe builds, its loss's backward inside
    steps_one_f_one_b = False
    #: this process runs one stage of a pipeline over a mesh; the other ranks run the others
    runs_one_stage_per_rank = False

    def call_runs_under_dp(self, pm: Any) -> bool:
        """Whether DDP or FSDP2 runs a call over a mesh's dp dimension, averaging gradients over its ranks."""
        return False

    def call_runs_under_fsdp(self, pm: Any) -> bool:
        """Whether FSDP2's root (``pm.fsdp``) runs a call: its hooks gather the parameters' dp shards
        around it (run node by node, the program would meet DTensors) and leave DTensor gradients
        (:meth:`whole_tensors` gathers them)."""
        return False

    def __call__(self, pm: Any, *args: Any, **kwargs: Any) -> Any:
        if pm.__dict__.get(NEEDS_WEIGHTS):
            raise weights_not_loaded(pm)
        if "_stepped_gradient" in pm.__dict__ and torch.is_grad_enabled():  # not an evaluation under no_grad
            warn_if_gradients_not_cleared(pm)
        compiled = pm.__dict__.get("_compiled_call_impl")  # set by pm.compile()
        if torch.compiler.is_compiling():
            return self.run_program(pm, pm.program_for_call(*args, **kwargs), args, kwargs)
        program = pm._find_program(args, kwargs)  # program_for_call, inlined
        return self.run_program(pm, program, args, kwargs) if compiled is None else compiled(program, *args, **kwargs)

    def run_program(self, pm: Any, program: fx.GraphModule, args: tuple, kwargs: dict) -> Any:
        """Run ``program`` as the model would run (see :func:`run_as_model`); ``nn.Module.__call__``
        runs the hooks the user registered on ``pm``."""
        return run_as_model(pm, program, args, kwargs, nn.Module.__call__.__get__(pm))

    def devices_for(self, pm: Any, args: tuple, kwargs: dict) -> int:
        """How many devices a call runs on: fewer than all for a batch smaller than the count."""
        n = len(pm.devices)
        split = pm._split_inputs
        if not split:
            return n
        below = getattr(pm, "_unbatched_below", None)
        if len(split) == 1 and not kwargs:  # the common call: one batched tensor, read cheaply
            position, name, dim = split[0]
            value = args[position] if position < len(args) else None
            if type(value) is torch.Tensor and (rank := value.dim()) > dim and (not below or rank >= below.get(name, 0)):
                size = value.shape[dim]
                if size > 0:
                    return min(n, size)
        return split_count(pm, args, kwargs, n)

    def batch_size(self, pm: Any, args: tuple, kwargs: dict) -> int | None:
        """The batch size of a call, checking that every split argument agrees."""
        seen: tuple[str, int] | None = None
        forced = getattr(pm.recipe, "batch_dim", None)
        for position, name, dim in pm._split_inputs:
            if position < len(args):
                value = args[position]
            elif name in kwargs:
                value = kwargs[name]
            else:
                continue
            for path, tensor in tensor_leaves(value):
                if tensor.dim() <= dim:
                    if forced is not None and tensor.dim() > 0:
                        raise ArgumentError(
                            f"batch_dim={forced}, but argument '{name}{path}' has {tensor.dim()} dims "
                            f"(shape {tuple(tensor.shape)}); pass a batch_dim below {tensor.dim()}, or None to infer it"
                        )
                    continue
                size = tensor.size(dim)
                where = f"{name}{path}"
                if seen is None:
                    seen = (where, size)
                elif size != seen[1]:
                    raise ArgumentError(
                        f"argument '{where}' has batch size {size} on dim {dim}, but '{seen[0]}' has "
                        f"{seen[1]}; every split input must carry the same batch. If '{name}' has no batch "
                        f"(it broadcasts), pass example_inputs= that give '{name}' an example value, so that it "
                        "is replicated, not split; or batch_dim= to choose another dim"
                    )
        if seen is not None and seen[1] == 0:
            raise ArgumentError(f"argument '{seen[0]}' has an empty batch (size 0); there is nothing to split")
        return None if seen is None else seen[1]

    def check_supported(self, pm: Any, operation: str) -> None:
        """Raise where a program run this way cannot serve ``operation`` of ``pm`` (``"call_key"``,
        ``"program_for_call"``, ``"compile"``, ``"watch"``: ``model_changed_since_transform``)."""

    def train(self, pm: Any, mode: bool) -> None:
        """What ``pm.train(mode)`` switches beside the modules (a wrapper's flag over a mesh)."""

    def materialized(self, pm: Any, memo: dict[int, torch.Tensor]) -> None:
        """A program built on meta was given memory (``memo``: ``{id(fake): real}``): what the executor
        holds beside the program's own tensors follows."""

    def no_sync(self, pm: Any) -> contextlib.AbstractContextManager:
        """``pm.no_sync()``: nothing reduces gradients across processes here, so nothing to skip."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ state
    def state_dict(self, pm: Any, positional: tuple, destination: Any, prefix: str, keep_vars: bool) -> Any:
        """``pm.state_dict()``: the model's keys, whole tensors (``positional``: its positional arguments)."""
        if "param_shards" in pm.__dict__:
            own = pm.stored_state_dict(keep_vars=keep_vars)
            state = whole_state_dict(pm, own, positional[0] if positional else destination, prefix, keep_vars)
        else:
            state = pm.stored_state_dict(*positional, destination=destination, prefix=prefix, keep_vars=keep_vars)
        return self.whole_state(pm, state, prefix, positional)

    def load_state_dict(self, pm: Any, state_dict: Any, strict: bool, assign: bool) -> Any:
        """``pm.load_state_dict()``: whole tensors under the model's keys; each piece cut from them where
        parameters are stored as pieces (over a mesh this rank's shard, and FSDP's rows)."""
        state_dict = self.local_state(pm, state_dict)
        if "param_shards" in pm.__dict__:  # whole tensors, cut into the pieces
            return load_pieces(pm, pm.stored_state_dict(keep_vars=True), state_dict, strict)
        return LoadsWeights.load_state_dict(pm, state_dict, strict=strict, assign=assign)

    def whole_state(self, pm: Any, tensors: dict[str, Any], prefix: str, positional: tuple) -> dict[str, Any]:
        """``pm.state_dict()``'s tensors (``positional``: its positional arguments) made whole."""
        return tensors

    def whole_tensors(self, pm: Any, tensors: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        """This process's tensors under the model's keys (its state, or its parameters' gradients), whole."""
        return tensors

    def local_state(self, pm: Any, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
        """Whole tensors under the model's keys as this process holds them (before ``load_state_dict``)."""
        return state_dict

    def cut_on_load(self, pm: Any, state_dict: Any, prefix: str) -> None:
        """A parent's ``load_state_dict`` of ``pm``: whole tensors cut as this process holds them, in place."""

    # ------------------------------------------------------------------ pickling
    def check_picklable(self, pm: Any) -> None:
        """Raise where a program run this way cannot be pickled."""

    def pickled_state(self, pm: Any) -> dict[str, Any]:
        """What a pickled copy carries to hold this executor again (:func:`restore_executor`)."""
        return {}

    def pickles_private_source(self, pm: Any) -> bool:
        """Whether a copy traces again from a meta copy of the private model (made fake where it is
        loaded) instead of running only the programs it carries."""
        return False


def split_count(pm: Any, args: tuple, kwargs: dict, n: int) -> int:
    """A call's batch split ``n`` ways at most: one piece where no input carries a batch (0-d
    tensors) or one sample comes without a batch dim (nn.Linear on a 1-D input), since each piece
    would give the whole output."""
    batch = pm.batch_size(args, kwargs)
    if batch is None or pm._is_unbatched(args, kwargs):
        return 1
    return min(batch, n)


#: the executor of every program until a builder picks another
PLAIN = PlainExecutor()


class PipelineExecutor(PlainExecutor):
    """A pipeline in one process: ``"gpipe"`` (the program's order) or ``"1f1b"`` (a training call
    runs the 1F1B step the recipe builds, forward and backward; every other call the program)."""

    keeps_last_call = False  # a call's key counts micro-batches
    runs_stages_in_one_process = True

    def __init__(self, schedule: str):
        self.name = schedule
        self.steps_one_f_one_b = schedule == "1f1b"

    def run_program(self, pm: Any, program: fx.GraphModule, args: tuple, kwargs: dict) -> Any:
        if self.steps_one_f_one_b and pm.training and torch.is_grad_enabled():
            key = pm.call_key(*args, **kwargs)
            steps = pm.__dict__.setdefault("one_f_one_b_steps", {})
            if key not in steps:
                if len(steps) >= 8:  # keys that departed long ago (a changed model) are not kept forever
                    steps.pop(next(iter(steps)))
                steps[key] = pm.recipe.one_f_one_b_step(pm, key)
            step = steps[key]
            if pm._shares_source and pm._guard.root_hooks():  # the model's own forward hooks, as for GPipe
                return run_writing_to_model(
                    pm, program, lambda: call_with_hooks(pm.traced_model, lambda *a, **k: step(a, k), args, kwargs))
            return run_writing_to_model(pm, program, lambda: step(args, kwargs))
        return super().run_program(pm, program, args, kwargs)

    def devices_for(self, pm: Any, args: tuple, kwargs: dict) -> int:
        """How many micro-batches a call runs: ``micro_batches``, or the batch size if smaller."""
        n = pm.__dict__.get("micro_batches", 1)
        if not pm._split_inputs or n == 1:
            return n
        return split_count(pm, args, kwargs, n)

    def pickled_state(self, pm: Any) -> dict[str, Any]:
        """The stages, micro-batches, schedule and plan (names only), and a tensor-parallel pipeline's
        stage groups and parameter slots."""
        extra = {"pipeline": {name: pm.__dict__[name] for name in PIPELINE_FIELDS}}
        if "stage_groups" in pm.__dict__:
            extra["stage_groups"] = {name: pm.__dict__[name] for name in ("stage_groups", "shard_param_slots")}
        return extra

    def pickles_private_source(self, pm: Any) -> bool:
        """A tensor-parallel pipeline's copy builds the program of a smaller batch (fewer micro-batches)
        from a meta copy of its private model."""
        return "param_shards" in pm.__dict__


#: what a pipeline holds beside its program (``pm.stages``, ...)
PIPELINE_FIELDS = ("stages", "micro_batches", "schedule", "stage_plan")


def hold_pipeline(pm: Any, *, stages: list, micro_batches: int, schedule: str, stage_plan: Any) -> None:
    """Make ``pm`` a pipeline in one process: record the stages, hold a :class:`PipelineExecutor`
    and key the program cache by micro-batches (a batch of ``b`` below ``micro_batches`` runs ``b``
    micro-batches of one sample)."""
    object.__setattr__(pm, "stages", list(stages))
    object.__setattr__(pm, "micro_batches", micro_batches)
    object.__setattr__(pm, "schedule", schedule)
    object.__setattr__(pm, "stage_plan", stage_plan)
    object.__setattr__(pm, "_executor", PipelineExecutor(schedule))
    main = pm.program_cache.main_key
    pm.program_cache.reset(main._replace(devices=micro_batches), pm._build_program)


def hold_stage_groups(pm: Any, groups: Sequence[Devices]) -> None:
    """Record the devices of each stage, and the device slot (``s * T + k``) of every parameter:
    stage ``s``'s shard ``k``, or its replicated rest on ``k == 0`` (``explain``'s bytes per device)."""
    object.__setattr__(pm, "stage_groups", [tuple(g.strings()) for g in groups])
    slot_of: dict[int, int] = {}
    for node in pm.graph.nodes:
        slot = node.meta.get("dpcompile_slot")
        if slot is None or node.op not in ("get_attr", "call_module"):
            continue
        parent, _, name = str(node.target).rpartition(".")
        target = str(node.target)
        value = pm.get_submodule(target) if node.op == "call_module" else getattr(pm.get_submodule(parent), name)
        for t in value.parameters() if isinstance(value, nn.Module) else [value]:
            slot_of.setdefault(id(t), slot)
    pm.shard_param_slots = {name: slot_of.get(id(p), 0) for name, p in pm.named_parameters()}


def executor_of(module: Any) -> PlainExecutor:
    """What runs a call of ``module``, to ask it what tools need to know: a ``ParallelModule``'s
    executor, else :data:`PLAIN` (a tool handed a plain ``nn.Module``)."""
    executor = getattr(module, "_executor", None)
    return executor if isinstance(executor, PlainExecutor) else PLAIN


def restore_executor(pm: Any, extra: dict[str, Any]) -> None:
    """The executor a pickled or exported copy's state (``extra``, :meth:`PlainExecutor.pickled_state`'s) asks for."""
    if "pipeline" in extra:
        hold_pipeline(pm, **extra["pipeline"])
        for name, value in extra.get("stage_groups", {}).items():
            object.__setattr__(pm, name, value)


def bubble_fraction(pm: Any) -> float:
    """The bubble ``(S-1)/(M+S-1)`` of GPipe and of 1F1B: the share of a step each device waits (a
    mesh's stage holds only its own stage, and knows their count)."""
    s = pm.__dict__.get("num_stages") or len(pm.stages)
    m = pm.micro_batches
    return (s - 1) / (m + s - 1)


__all__ = [
    "PIPELINE_FIELDS", "PLAIN", "PipelineExecutor", "PlainExecutor", "bubble_fraction", "executor_of", "hold_pipeline",
    "hold_stage_groups", "restore_executor",
]
