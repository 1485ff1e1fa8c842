"""``ParallelModule``: the executable multi-device program that ``transform`` returns.

It is a ``torch.fx.GraphModule`` (``pm.graph``, ``pm.code``, ``pm.print_readable()``) whose
generated forward holds every cross-device step as a named call. In data-parallel mode it
holds the user's own submodules, parameters and buffers, so ``pm.parameters()`` *are* the
model's parameters and ``pm.state_dict()`` has the model's keys.

A call checks the batch first (arguments that disagree on the batch size, or an empty
batch, raise ``ValueError``), then asks its :class:`~dpcompile.program_cache.ProgramCache`
for the program it runs: the main one, or one traced for what the call departs on (fewer
devices for a small batch, the other mode, an optional argument left None, a flag value,
a hook or a submodule added since). :meth:`ParallelModule.program_for_call` answers the same
question for tools (explain, verify, draw, export).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.analysis.random_ops import per_device_note
from dpcompile.capture import ROOT_LEAF, DpTracer
from dpcompile.capture.inputs import check_inputs
from dpcompile.devices import Devices
from dpcompile.errors import DpCompileError
from dpcompile.fx_utils import (
    ALIAS_PREFIX,
    RESERVED_NAMES,
    adopt_state,
    alias_of,
    alias_targets,
    aliased_root,
    own_attribute,
    placeholders,
    reserve_names,
    unalias,
)
from dpcompile.modules.call_errors import refused_call
from dpcompile.modules.executors import PLAIN, bubble_fraction
from dpcompile.modules.exported_check import ExportedModelCheck
from dpcompile.modules.hooks import (
    adopt_root_hooks,
    backward_hooks_error,
    check_unchanged_since_transform,
    load_pre_hooks,
    refuse_writes_of_a_private_copy,
    state_dict_with_hooks,
)
from dpcompile.modules.last_call import LastCall
from dpcompile.modules.other_mode import both_modes, program_in_other_mode
from dpcompile.modules.pickling import PicklesPrograms, refuse_pickling_local_hooks, refuse_pickling_parametrized
from dpcompile.modules.sharded_state import cut_pieces, param_bytes_per_slot
from dpcompile.modules.weights import LoadsWeights, needs_weights, refuse_copy_without_weights
from dpcompile.program_cache import CallKey, CallSignature, ModelGuard, ProgramCache

log = logging.getLogger("dpcompile")


class ParallelModule(PicklesPrograms, LoadsWeights, fx.GraphModule):
    """A generated multi-device module. Build it with :func:`dpcompile.transform`.

    >>> import torch, dpcompile
    >>> pm = dpcompile.transform(torch.nn.Linear(4, 2), ["cpu", "cpu"])
    >>> pm(torch.randn(5, 4)).shape
    torch.Size([5, 2])

    * ``pm.recipe``: how it was compiled (a picklable :class:`~dpcompile.recipes.base.Recipe`);
    * ``pm.devices``, ``pm.mode``, ``pm.input_dims``, ``pm.output_device``, ``pm.plan``;
    * ``pm.captured``: the traced program before lowering (data parallel), or None;
    * ``pm.records``: the passes that ran, with their timing and findings;
    * ``pm.executor``: what runs a call (:mod:`~dpcompile.modules.executors`): ``"plain"``, or a pipeline's
      schedule (``"gpipe"``, ``"1f1b"``) over ``pm.stages`` (``pm.micro_batches``, ``pm.bubble_fraction``);
    * where parameters are stored as pieces (tensor parallel, FSDP in one process, sharded pipeline
      stages; :mod:`~dpcompile.modules.sharded_state`): ``pm.param_shards``
      (``{"fc1.weight": (ShardSpec(0, (5, 5)), ["fc1.weight_shard0", ...])}``), ``pm.shard_param_slots``
      (``{parameter name: shard slot k, or None where replicated}``), ``pm.plan_reasons``, ``pm.comm_cost``;
      ``pm.parameters()`` are the pieces, ``state_dict()`` has the model's keys, whole.

    The model's names never collide with these: a submodule, parameter or buffer named
    ``devices``, ``mode``, ``graph`` or ``meta`` is held under its own name (``state_dict``
    keys stay the model's) and generated code reads it as ``getattr(self, "user:devices")``;
    ``pm.devices`` is the module's own attribute (kept in its ``__dict__``).
    """

    #: the instance attributes of the ParallelModule family (never a model's name in generated code)
    own_attributes = frozenset({
        "recipe", "devices", "mode", "input_dims", "output_device", "plan", "records", "captured",
        "traced_model", "program_cache", "captured_code", "plan_reasons", "param_shards",
        "shard_param_slots", "comm_cost", "mesh", "shards", "dp_dim", "tp_dim", "dp_group", "tp_group",
        "_guard", "_hooks_traced", "_exported_check", "_exported_inputs", "_other_mode", "_flags", "call_signature", "_split_inputs", "_shares_source", "_adopted", "state_keys", "_ddp",
        "state_aliases", "layout", "strategies", "_executor",
        "stages", "micro_batches", "schedule", "stage_plan", "one_f_one_b_steps", "stage_groups",
    })  # fmt: skip
    needs_weights = property(needs_weights, doc="True for a program built on meta until dpcompile.load_checkpoint fills it")

    def __init__(
        self,
        root: nn.Module,
        graph: fx.Graph,
        *,
        recipe: Any,
        devices: Devices,
        mode: str,
        input_dims: dict[str, int | None] | None = None,
        output_device: torch.device | None = None,
        plan: dict[str, str] | None = None,
        captured: fx.GraphModule | None = None,
        records: list | None = None,
        class_name: str = "ParallelModule",
        share_all_of: nn.Module | None = None,
        source: nn.Module | None = None,
        flags: dict[str, Any] | None = None,
        none_args: frozenset[str] = frozenset(),
        shares_source: bool = True,
        exported_from: nn.Module | None = None,
    ):
        aliased = alias_targets(graph)
        super().__init__(aliased_root(root) if aliased else root, graph, class_name)
        if share_all_of is not None:
            self._share_state_of(share_all_of)
        self._hold_under_own_names()
        self.recipe = recipe
        self.devices = devices
        self.mode = mode
        self.input_dims = dict(input_dims or {})
        self.output_device = output_device or devices.primary
        self.plan = dict(plan or {})
        self.records = list(records or [])
        object.__setattr__(self, "captured", captured)
        self._split_inputs = self._find_split_inputs()
        # the model, to trace again for a call that departs from the program (not a stand-in
        # without forward, such as a loaded program's plain modules)
        if source is not None and type(source).forward is nn.Module.forward:
            source = None
        self._attach_cache(source, dict(flags or {}), none_args, shares_source)
        watch = None if exported_from is None else ExportedModelCheck(exported_from)
        if watch is not None:
            watch.watch_program(self)
        object.__setattr__(self, "_exported_check", watch)

    def _attach_cache(
        self, source: nn.Module | None, flags: dict[str, Any], none_args: frozenset[str], shares_source: bool
    ) -> None:
        """The call signature, the guard and the cache, keyed from the main program.

        ``shares_source``: ``pm`` holds the model's own modules (data parallel), so the guard
        watches the model (its modes, hooks, submodules, attributes); otherwise ``source`` is a
        private copy to trace (tensor parallel) and the guard reads the modes of ``pm``'s modules.
        """
        object.__setattr__(self, "traced_model", source)
        self._shares_source = shares_source and source is not None
        if source is not None and not self._shares_source:
            refuse_writes_of_a_private_copy(self.graph, source)
            adopt_root_hooks(self, source)
        self._flags = flags  # flag arguments the main program was traced for, and their values
        self.call_signature = CallSignature.of(self.graph, tuple(flags)) if source is not None else CallSignature()
        is_leaf = DpTracer(getattr(self.recipe, "leaf_modules", ())).is_leaf_module
        # modes are read from the model where pm shares it, else from pm's own modules; a program
        # without a forward to trace (a GraphModule given or exported) is code fixed for every mode
        watched = None if source is not None else ()
        guarded = source if self._shares_source else self  # a program's root reads what the model's code read
        object.__setattr__(self, "_guard", ModelGuard(guarded, is_leaf, paths=watched, root_class=type(source)))
        main_key = self._key(len(self.devices), none_args, tuple(flags.items()))
        object.__setattr__(self, "program_cache", ProgramCache(main_key, self._build_program))
        # a private copy's hooks and attributes: checked, not followed
        object.__setattr__(self, "_hooks_traced", (self._guard.hooks, self._guard.attributes))
        self._adopted = main_key.guard

    def _share_state_of(self, model: nn.Module) -> None:
        """Hold all of ``model``'s submodules, parameters and buffers (not just the used ones)."""
        leaf_root = self._modules.pop(ROOT_LEAF, None)
        if leaf_root is not None:  # called by the program, but not part of the state
            object.__setattr__(self, ROOT_LEAF, leaf_root)
        adopt_state(self, model)

    def _hold_under_own_names(self) -> None:
        """Hold each aliased submodule, parameter or buffer (``user:devices``, copied from the
        program's root) under the model's own name only, so state dict keys stay the model's."""
        for store in (self._modules, self._parameters, self._buffers):
            for alias in [k for k in store if k.startswith(ALIAS_PREFIX)]:
                value = store.pop(alias)
                store.setdefault(unalias(alias), value)

    def __setattr__(self, name: str, value: Any) -> None:
        # the module's own attributes live in its __dict__, apart from the model's state
        if name in RESERVED_NAMES and not isinstance(value, (nn.Module, torch.Tensor)):
            object.__setattr__(self, name, value)
            return
        super().__setattr__(name, value)
        model = self.__dict__.get("traced_model")
        if self.__dict__.get("_shares_source") and name not in RESERVED_NAMES and (
            name in model._modules or name in model._parameters or name in model.__dict__
        ):  # pm holds the model's own state: `pm.block = new` is `model.block = new`, which the guard follows
            setattr(model, name, value)

    def _adopt_model_state(self) -> None:
        """Hold the model's submodules, parameters and buffers as they are now."""
        adopt_state(self, self.traced_model, follow_removals=True)

    def __getattr__(self, name: str) -> Any:
        if name in self.__dict__.get("_modules", ()):  # generated code's `self.fc1`: one lookup
            return self.__dict__["_modules"][name]
        if name.startswith(ALIAS_PREFIX):  # generated code reading the model's `devices`
            try:
                return own_attribute(self, name)
            except AttributeError:
                pass
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "module":
                raise
        raise AttributeError(  # DataParallel's and DDP's wrapped model
            f"'{type(self).__name__}' object has no attribute 'module': a ParallelModule is no wrapper "
            "(as DataParallel's pm.module is); it holds the model's own submodules, parameters and state "
            "dict keys, so use pm itself (pm.state_dict(), pm.fc1), or the model you transformed"
        )

    def get_submodule(self, target: str) -> nn.Module:
        """The model's submodule ``target`` (``"devices"`` is the model's, not ``pm.devices``)."""
        return super().get_submodule(alias_of(target) if target else target)

    def get_parameter(self, target: str) -> nn.Parameter:
        if target in self._parameters:  # the model's `mode`, not pm.mode
            return self._parameters[target]
        return super().get_parameter(target)

    def get_buffer(self, target: str) -> torch.Tensor:
        if target in self._buffers:
            return self._buffers[target]
        return super().get_buffer(target)

    # ------------------------------------------------------------------ calling
    def _find_split_inputs(self) -> list[tuple[int, str, int]]:
        out = []
        self._unbatched_below: dict[str, int] = {}  # rank under which an input is one unbatched sample
        for position, node in enumerate(placeholders(self.graph)):
            dim = self.input_dims.get(node.target)
            if dim is not None:
                out.append((position, str(node.target).lstrip("*"), dim))
                if "dpcompile_min_rank" in node.meta:
                    self._unbatched_below[str(node.target).lstrip("*")] = node.meta["dpcompile_min_rank"]
        return out

    def batch_size(self, args: tuple, kwargs: dict) -> int | None:
        """The batch size of a call, checking that every split argument agrees (its executor reads it)."""
        return self._executor.batch_size(self, args, kwargs)

    def _is_unbatched(self, args: tuple, kwargs: dict) -> bool:
        """Whether an input has fewer dims than the batch rules assumed of it (the batch analysis
        records ``dpcompile_min_rank`` where a rule took dim 0 of an input of unknown rank for the
        batch, as a Linear does: a 1-D input there is one unbatched sample)."""
        below = getattr(self, "_unbatched_below", None)
        if not below:
            return False
        for position, name, _ in self._split_inputs:
            value = args[position] if position < len(args) else kwargs.get(name)
            if name in below and isinstance(value, torch.Tensor) and value.dim() < below[name]:
                return True
        return False

    def _devices_for(self, args: tuple, kwargs: dict) -> int:
        """How many devices (a pipeline: micro-batches) a call runs on: its executor counts them."""
        return self._executor.devices_for(self, args, kwargs)

    def _key(self, n: int, none_args: frozenset[str], flags: tuple, batched: frozenset[str] = frozenset(),
             unbatched: frozenset[str] = frozenset()) -> CallKey:  # fmt: skip
        if self._shares_source:
            modes, fingerprint = self._guard.state()
            return CallKey(n, modes, none_args, flags, fingerprint, batched, unbatched)
        return CallKey(n, self._guard.modes(), none_args, flags, None, batched, unbatched)

    def _unbatched_inputs(self, args: tuple, kwargs: dict) -> frozenset[str]:
        """Split inputs this call gives without their batch dim (a 0-dim tensor) beside one that
        has it: replicated for this call, as eager broadcasts them."""
        split = self._split_inputs
        if len(split) < 2:
            return frozenset()
        out = []
        for position, name, dim in split:
            value = args[position] if position < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor) and value.dim() <= dim:
                out.append(name)
        return frozenset(out) if len(out) < len(split) else frozenset()

    def call_key(self, *args: Any, **kwargs: Any) -> CallKey:
        """What the program for this call is specialised on (see :class:`CallKey`)."""
        self._executor.check_supported(self, "call_key")
        signature = self.call_signature
        nones, flags = signature.departures(args, kwargs) if signature.optional or signature.flags else (frozenset(), ())
        batched = signature.batched(args, kwargs, self.batch_size) if signature.replicated else frozenset()
        return self._key(self._devices_for(args, kwargs), nones, flags, batched, self._unbatched_inputs(args, kwargs))

    #: what runs a call (:mod:`dpcompile.modules.executors`): the program, or a pipeline's schedule
    _executor = PLAIN
    #: its name: ``"plain"`` (the program), ``"gpipe"`` / ``"1f1b"`` (a one-process pipeline's schedule
    #: over ``pm.stages``), ``"pipelining"`` (``torch.distributed.pipelining``: this rank's stage)
    executor = property(lambda self: self._executor.name)
    #: a pipeline's bubble ``(S-1)/(M+S-1)``, GPipe's and 1F1B's: the share of a step each device waits
    bubble_fraction = property(bubble_fraction)
    #: ``"data_parallel"``, ``"tensor_parallel"`` or ``"pipeline"``: what its recipe says it is
    strategy = property(lambda self: self.recipe.strategy)

    def program_for_call(self, *args: Any, **kwargs: Any) -> fx.GraphModule:
        """The program a call with these arguments runs: ``self`` or one traced for the call.

        >>> pm.eval()                                  # doctest: +SKIP
        >>> print(pm.program_for_call(x).code)         # the eval-mode program  # doctest: +SKIP
        """
        self._executor.check_supported(self, "program_for_call")
        if not torch.compiler.is_compiling():
            return self._find_program(args, kwargs)
        # torch.compile(pm): the lookup runs eagerly at each call (a graph break), and the code after
        # it is guarded on the program it returns, so a change to the model is followed, never stale
        return self._lookup(args, kwargs)

    def _find_program(self, args: tuple, kwargs: dict) -> fx.GraphModule:
        cache = self.program_cache
        last = cache.last
        if last is not None and last.serves(args, kwargs):  # the last call's key, checked cheaply
            program = last.program
            if program is not self:
                program.training = self.training
            return program
        key = self.call_key(*args, **kwargs)
        if self.__dict__.get("_exported_check") is not None:
            self._exported_check.check(args, kwargs)
        elif (exported_inputs := self.__dict__.get("_exported_inputs")) is not None:  # a copy's (torch.load)
            check_inputs(exported_inputs[0], args, kwargs, exported_inputs[1])
        if "_other_mode" in self.__dict__ and (other := program_in_other_mode(self)) is not None:
            return other  # exported in one mode: the program of both (or pm made to serve both in place)
        if self._shares_source and self._guard.backward_hooked:
            raise backward_hooks_error(self.traced_model, self._guard.backward_hooked)
        if not self._shares_source and self.traced_model is not None:
            check_unchanged_since_transform(self._guard, *self._hooks_traced)
        if key.guard != self._adopted and self._shares_source:
            self._adopt_model_state()  # the model's submodules changed
            self._adopted = key.guard
        program = cache.program(key, args, kwargs) or self
        if self._executor.keeps_last_call:  # not a pipeline, which counts micro-batches its own way
            cache.last = LastCall.of(self, key, program, args, kwargs)
        if program is not self:
            program.training = self.training  # its submodules are ours: their own modes stand
        return program

    # under torch.compile: the cache, run eagerly. torch's lazy spelling of torch.compiler.disable: it
    # imports torch._dynamo at the first such call, not when dpcompile is imported (a fifth of a fresh
    # process's start: ~1-2 CPU-s in `python -c "import dpcompile"`, the CLI, a program loaded elsewhere)
    _lookup = torch._disable_dynamo(_find_program)

    @property
    def code(self) -> str:
        """The program as Python, headed by a comment where random ops draw per device."""
        code = fx.GraphModule.code.fget(self)  # type: ignore[attr-defined]
        note = per_device_note(self)
        return f"# {note}\n{code}" if note else code

    def recompile(self) -> Any:
        code = super().recompile()
        # fx wraps __call__ to print the code around an error (tracebacks show it): µs per call, skipped
        cls = type(self)
        if cls is not ParallelModule and "<locals>" in cls.__qualname__:
            cls.__call__ = next(c.__dict__["__call__"] for c in cls.__mro__[1:] if "__call__" in c.__dict__)
        return code

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._executor(self, *args, **kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError) as exc:
            # torch's error from deep inside (or a kept branch check): a DpCompileError naming the call
            refused = refused_call(self.graph, exc, args, kwargs)
            if refused is None:
                raise
            raise refused.with_traceback(exc.__traceback__) from exc  # still ending at the generated line that raised

    def _run_compiled(self, program: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """What pm.compile() compiles: ``program`` is an argument, so its guards follow the lookup's answer."""
        return self.run_program(program, args, kwargs)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``torch.compile`` pm's calls in place (``pm.compile(); pm(x)``); inductor options default to COMPILE_OPTIONS."""
        self._executor.check_supported(self, "compile")
        if kwargs.get("backend", "inductor") == "inductor" and kwargs.get("mode") is None:
            cpu = all(getattr(d, "type", None) == "cpu" for d in self.devices)
            kwargs["options"] = {**COMPILE_OPTIONS, **(CPU_COMPILE_OPTIONS if cpu else {}), **(kwargs.get("options") or {})}
        self._compiled_call_impl = torch.compile(self._run_compiled, *args, **kwargs)

    def run_program(self, program: fx.GraphModule, args: tuple, kwargs: dict) -> Any:
        """Run ``program`` (from :meth:`program_for_call`) as its executor runs it."""
        return self._executor.run_program(self, program, args, kwargs)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The model's keys and tensors, with the model's own ``state_dict`` hooks run as it runs them;
        where parameters are stored as pieces (``pm.param_shards``), each key's whole tensor; over a
        mesh, shards all-gathered (a collective: call it on every rank; keyword arguments only)."""
        return self._executor.state_dict(self, args, destination, prefix, keep_vars)

    def whole_tensors(self, tensors: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        """``tensors`` (this process's, under the model's keys: its state, or its parameters' gradients)
        made whole in place: over a mesh FSDP's DTensor shards all-gathered over dp, then the tp shards
        (a collective: call it on every rank)."""
        return self._executor.whole_tensors(self, tensors, prefix)

    def stored_state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The state as the module stores it: the model's keys, but pieces under their own names where
        parameters are stored as pieces (``fc1.weight_shard1``); over a mesh this rank's (checkpoints read it)."""
        model = self.__dict__.get("traced_model")
        save = super().state_dict
        if not getattr(self, "_shares_source", False) or not (model._state_dict_pre_hooks or model._state_dict_hooks):
            return save(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        return state_dict_with_hooks(
            model, lambda: save(*args, destination=destination, prefix=prefix, keep_vars=keep_vars), prefix, keep_vars
        )

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Whole tensors under the model's keys; each piece cut from them where parameters are stored as
        pieces (over a mesh this rank's shard, and FSDP's rows)."""
        return self._executor.load_state_dict(self, state_dict, strict, assign)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *rest: Any) -> None:
        self._executor.cut_on_load(self, state_dict, prefix)
        if "param_shards" in self.__dict__:
            cut_pieces(self, state_dict, prefix, rest[-1])  # rest[-1]: error_msgs
        if getattr(self, "_shares_source", False):
            load_pre_hooks(self.traced_model, state_dict, prefix, *rest)  # the model's own, not pm's
        super()._load_from_state_dict(state_dict, prefix, *rest)

    def _build_program(self, key: CallKey, args: tuple, kwargs: dict) -> fx.GraphModule | None:
        """The program for ``key``; None where the main program serves it."""
        return self.recipe.build_program(self, key, args, kwargs)

    def cannot_trace_again(self, key: CallKey) -> DpCompileError:
        """The error for a call that needs a program only the model's forward could give."""
        return DpCompileError(
            f"this call needs a program traced for {key.describe()}, but the program was traced for "
            f"{self.program_cache.main_key.describe()} and the model's class is not available to trace again (a "
            "program loaded or unpickled where its class cannot be imported). Define the model class in an "
            "importable module, or call with what the program was traced for."
        )

    def train(self, mode: bool = True) -> ParallelModule:
        super().train(mode)
        source, exported = self.__dict__.get("traced_model"), self.__dict__.get("_exported_check")
        source = exported.guard.model if source is None and exported is not None else source
        if source is not None:
            source.training = mode  # the model's own flag (its submodules are ours)
        if isinstance(self.__dict__.get(ROOT_LEAF), nn.Module):
            self.__dict__[ROOT_LEAF].train(mode)
        self._executor.train(self, mode)
        return self

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Skip the gradient all-reduce of the backward passes inside (gradient accumulation over a
        mesh, as ``DistributedDataParallel.no_sync``; FSDP2's reduce-scatter too): the first backward
        after the block reduces the accumulated gradients. A no-op without a data-parallel dimension
        over a mesh (in one process nothing reduces across processes)."""
        return self._executor.no_sync(self)

    ddp = property(lambda self: self.__dict__.get("_ddp"), doc="The ``DistributedDataParallel`` that runs the program over a mesh's dp dimension (else None)")
    fsdp = property(lambda self: self.__dict__.get("_fsdp"), doc="The ``fully_shard`` root that runs the program over a mesh with ``data_parallel=\"fsdp\"`` (else None)")
    fsdp_blocks = property(lambda self: list(self.__dict__.get("_fsdp_blocks", ())), doc="The module paths FSDP2 wraps with ``fully_shard`` of their own")
    #: over a mesh every call first checks (one all-gather of an 8-byte fingerprint) that every rank of the tp
    #: group feeds inputs of the same shapes, or, data parallel, that every rank of the dp group calls with the
    #: same arguments, dtypes and ranks; False skips the check
    check_inputs: bool = True
    #: seconds that check waits for the other ranks of the group to call forward: a rank that never calls
    #: fails the others this soon, not after the process group's 30 minutes
    check_inputs_timeout: float = float(os.environ.get("DPCOMPILE_SPMD_TIMEOUT", "300"))

    # ------------------------------------------------------------------ pickling
    def __reduce__(self):
        refuse_copy_without_weights(self)
        self._executor.check_picklable(self)
        refuse_pickling_parametrized(self)
        refuse_pickling_local_hooks(self)
        return both_modes(self)._reduce(carry_programs=True)

    def model_changed_since_transform(self) -> bool:
        """Whether the model's hooks, submodules, parameters or attributes forward reads (or, for an
        exported program, dtypes) departed from those the main program (``pm.graph``) was traced with."""
        self._executor.check_supported(self, "watch")
        if (exported := self.__dict__.get("_exported_check")) is not None and exported.changed():
            return True
        return self._shares_source and self._guard.fingerprint() != self.program_cache.main_key.guard

    #: bytes of parameters each shard slot holds: its shards plus the replicated rest (a sharded state's)
    param_bytes_per_slot = param_bytes_per_slot

    #: ``ParallelModule.__init__`` itself, whatever a subclass's own takes (unpickling calls it)
    _init_parallel_module = __init__


#: inductor options of ``pm.compile()``: no per-call size/stride asserts on the inputs (the parameters),
#: which dynamo's guards check; on CPU also a C++ wrapper (a longer compile, no Python per kernel call)
COMPILE_OPTIONS: dict[str, Any] = {"size_asserts": False}
CPU_COMPILE_OPTIONS: dict[str, Any] = {"cpp_wrapper": True}


reserve_names(dir(ParallelModule))
reserve_names(ParallelModule.own_attributes)
