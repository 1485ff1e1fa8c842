"""Pickling a :class:`~dpcompile.modules.base.ParallelModule`: ``torch.save(pm)``, ``copy.deepcopy(pm)``
and ``dpcompile.load`` rebuild a program from its modules, graphs and the programs it carries.

A copy whose model class can be imported traces what it needs where it is loaded; one that cannot
(a class defined in ``__main__``, a pickler that keeps only ``torch.nn`` classes) carries every
program it could be asked for: both modes, the optional arguments left None, flags, smaller batches.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.capture import ROOT_LEAF
from dpcompile.capture.inputs import InputSpec
from dpcompile.errors import DpCompileError
from dpcompile.fake import fake_copy_to_trace, meta_copy_to_pickle
from dpcompile.fx_utils import (
    PicklableGraph,
    adopt_state,
    attribute_at,
    example_shapes,
    graph_module,
    propagate_example_shapes,
)
from dpcompile.modules.carried import CarriedPrograms
from dpcompile.modules.executors import restore_executor
from dpcompile.modules.hooks import check_unchanged_since_transform
from dpcompile.modules.other_mode import both_modes
from dpcompile.modules.sharded_state import PICKLED, hold_shards
from dpcompile.modules.weights import refuse_copy_without_weights
from dpcompile.program_cache import CallKey, CallSignature, ModelGuard, Modes

log = logging.getLogger("dpcompile")

#: what transform records about a program (its layout and plan), carried by a pickled copy
DESCRIBED = ("layout", "strategies", "memory_options", "memory_plan", "candidates", "calibration")


class PicklesPrograms:
    """The pickling half of ``ParallelModule`` (a mixin: it reads the module's program cache, graph and state)."""

    def _reduce(self, *, carry_programs: bool):
        source = self._picklable_source()
        stale = self.model_changed_since_transform()  # the copy traces every call afresh
        if stale and self._shares_source:  # the model's submodules as they are now, as the next call holds them
            adopt_state(self, self.traced_model, follow_removals=True)
        if not self._shares_source and self.traced_model is not None:
            self._guard.fingerprint()  # read again: what a call would read
            check_unchanged_since_transform(self._guard, *self._hooks_traced)  # refused as a call is
        if stale and source is None and carry_programs:
            raise DpCompileError(
                f"the model changed since transform and its class {type(self.traced_model).__qualname__} cannot be "
                "imported to trace it again where this copy is loaded; call dpcompile.transform again before saving"
            )
        # carried for a copy that cannot trace them: no importable model, or a pickler that keeps
        # only torch.nn classes (export); a deep copy traces what it needs
        state = {
            "modules": dict(self._modules),
            "leaf_root": self.__dict__.get(ROOT_LEAF) if isinstance(self.__dict__.get(ROOT_LEAF), nn.Module) else None,
            "parameters": dict(self._parameters),
            "buffers": dict(self._buffers),
            "non_persistent": set(self._non_persistent_buffers_set),
            "training": self.training,
            "graph": PicklableGraph(self.graph),
            "captured_graph": PicklableGraph(self.captured.graph) if self.captured is not None else None,
            # fake values hold their fake mode (pickle cannot write them): the example shapes to
            # propagate them again, which lowering the captured program for a new call reads
            "captured_shapes": example_shapes(self.captured.graph) if self.captured is not None else None,
            "config": {
                "recipe": self.recipe,
                "devices": self.devices,
                "mode": self.mode,
                "input_dims": self.input_dims,
                "output_device": self.output_device,
                "plan": self.plan,
                "class_name": type(self).__name__,
                "shares_source": self._shares_source,
            },
            "main_key": self.program_cache.main_key.portable(),
            "programs": self._portable_programs() if carry_programs else [],
            "traces": [
                (key.portable(), None if gm is None else (PicklableGraph(gm.graph), example_shapes(gm.graph)))
                for key, gm in self.program_cache.traces.items()
            ],
            "extra": self._extra_state_for_pickle(),
            "source": source,
            "stale_main": stale,
            "described": {name: self.__dict__[name] for name in DESCRIBED if name in self.__dict__},
            "replicated": getattr(self.__dict__.get("call_signature"), "replicated", ()),
            "call_signature": _signature_state(self.__dict__.get("call_signature")),
            "root_hooks": None if source is not None else _root_hooks(self),
            "exported_inputs": exported_inputs(self),
        }
        return (restore_parallel_module, (_importable_class(self), state))

    def _portable_programs(self) -> list[tuple[CallKey, PicklableGraph | None]]:
        """The programs a copy without the model's class (a pickler that keeps only torch.nn
        classes, an unimportable class) could not trace: the other mode, and every variant met
        so far (optional arguments left None, flags, smaller batches); None: the main program."""
        if self.__dict__.get("traced_model") is None:
            built = [(key.portable(), None if p is None else PicklableGraph(p.graph)) for key, p in self.program_cache.items()]
            carried = getattr(self.program_cache.build, "programs", {})  # a restored program's own
            carried = [(key, None if g is None else PicklableGraph(g)) for key, g in carried.items()]
            return [*carried, *built]
        main = self.program_cache.main_key
        built = dict(self.program_cache.items())
        # both modes of every pattern met so far, and of the optional arguments left None
        # (none, each alone, all together), so that pm.eval() and a call without them hold
        optional = [name for _, name in self.call_signature.optional]
        none_patterns = {main.none_args, frozenset(), frozenset(optional), *(frozenset({name}) for name in optional[:2])}
        wanted = set(built)
        for key in [main, *built]:
            for nones in {key.none_args, *(none_patterns if key is main else ())}:
                for modes in (key.modes, Modes((path, not t) for path, t in key.modes)):
                    wanted.add(CallKey(key.devices, modes, nones, key.flags, key.guard))
        for name, value in main.flags:  # the other value of each bool flag
            if type(value) is bool:
                flipped = tuple((n, not v if n == name else v) for n, v in main.flags)
                for modes in (main.modes, Modes((path, not t) for path, t in main.modes)):
                    wanted.add(CallKey(main.devices, modes, main.none_args, flipped, main.guard))
        out = []
        for key in wanted:
            try:
                program = built[key] if key in built else self.program_cache.program(key, (), {})
            except Exception as e:  # noqa: BLE001 - a program not carried is refused at its call, never run wrong
                log.debug("no program carried for %s (%s)", key.describe(), e)
                continue
            out.append((key.portable(), None if program is None else PicklableGraph(program.graph)))
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """An independent copy (an EMA of the weights, a snapshot), built as unpickling builds
        one; ``GraphModule.__deepcopy__`` would drop everything but the graph and modules."""
        refuse_copy_without_weights(self)
        if (whole := both_modes(self)) is not self:
            return copy.deepcopy(whole, memo)
        traceable = self.__dict__.get("traced_model") is not None  # the copy traces what it needs
        restore, (cls, state) = self._reduce(carry_programs=not traceable)
        if state["source"] is None and self.__dict__.get("traced_model") is not None:  # no import needed
            state["source"] = self._source_state()
            state["root_hooks"] = None  # the model's, run from it (or adopted from it again)
        return restore(cls, copy.deepcopy(state, memo))

    def _picklable_source(self) -> dict[str, Any] | None:
        """The model (to trace variants after loading) where pickle can import its classes."""
        source = self.__dict__.get("traced_model")
        classes = [type(source), *getattr(self.recipe, "leaf_modules", ())]
        if source is None or any("<locals>" in c.__qualname__ or c.__module__ == "__main__" for c in classes):
            return None
        if not self._shares_source:  # a private fake copy (tensor parallel): carried on meta where the kind asks
            model = meta_copy_to_pickle(source) if self._executor.pickles_private_source(self) else None
            return None if model is None else {**self._source_state(), "model": model, "fake": True}
        return self._source_state()

    def _source_state(self) -> dict[str, Any]:
        main = self.program_cache.main_key
        return {"model": self.traced_model, "flags": self._flags, "none_args": main.none_args}

    def _extra_state_for_pickle(self) -> dict[str, Any]:
        """What a program needs, beyond modules and graph, to rebuild itself: its sharded state
        (:mod:`dpcompile.modules.sharded_state`) where it stores parameters as pieces, and what its
        executor holds (a pipeline's stages)."""
        sharded = {name: self.__dict__[name] for name in PICKLED} if "param_shards" in self.__dict__ else {}
        return {**sharded, **self._executor.pickled_state(self)}

    def _restore_extra_state(self, extra: dict[str, Any]) -> None:
        """The counterpart of :meth:`_extra_state_for_pickle`."""
        if "param_shards" in extra:
            hold_shards(self, **{name: extra[name] for name in PICKLED})
        restore_executor(self, extra)


def refuse_pickling_parametrized(pm: nn.Module) -> None:
    """``torch.save(pm)`` of a model with ``torch.nn.utils.parametrizations`` (``weight_norm``):
    torch refuses to pickle such modules (the model too), so say so by name, with the way out."""
    from torch.nn.utils import parametrize

    found = [path or "the model" for path, m in pm.named_modules() if parametrize.is_parametrized(m)]
    if found:
        raise DpCompileError(
            f"the program holds parametrized modules ({', '.join(found[:4])}: weight_norm, spectral_norm, ...), which "
            "torch does not pickle, the model itself neither; save the weights with dpcompile.save_checkpoint(pm, path) "
            "(or pm.state_dict()) and transform the model again where they are loaded, then load_checkpoint"
        )


_HOOK_DICTS = {
    "_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook", "_backward_pre_hooks": "backward pre-hook",
    "_backward_hooks": "backward hook", "_state_dict_pre_hooks": "state_dict pre-hook", "_state_dict_hooks": "state_dict hook",
    "_load_state_dict_pre_hooks": "load_state_dict pre-hook", "_load_state_dict_post_hooks": "load_state_dict post-hook",
}  # fmt: skip


def refuse_pickling_local_hooks(pm: nn.Module) -> None:
    """``torch.save(pm)`` of a model with a hook pickle cannot save by name (a lambda, a function defined
    inside another): pickle's bare ``AttributeError: Can't pickle local object``, said by name with the
    ways out. The program keeps the hooks (its guard checks them at each call), so they go with it."""
    for path, module in pm.named_modules():
        for attribute, kind in _HOOK_DICTS.items():
            for hook in getattr(module, attribute, {}).values():
                hook = getattr(hook, "hook", hook)  # load_state_dict pre-hooks are wrapped
                name = getattr(hook, "__qualname__", "")
                if isinstance(hook, types.FunctionType) and ("<lambda>" in name or "<locals>" in name):
                    raise DpCompileError(
                        f"'{path or 'the model'}' ({type(module).__name__}) has a {kind} {name} ({hook.__module__}), "
                        "which pickle cannot save: it saves a function by its importable name, and a lambda or a "
                        "function defined inside another has none. Define the hook at module level, or remove it "
                        "(handle.remove()) before torch.save(pm) and register it again after loading; or save the "
                        "weights with dpcompile.save_checkpoint(pm, path)"
                    )


def exported_inputs(pm: nn.Module) -> tuple[tuple[InputSpec, ...], str] | None:
    """The arguments an export-captured program fixed (each one's shape, its dynamic dims None, and dtype)
    and the model's class name, for the copy's call check; its model watch stays with the original."""
    check = pm.__dict__.get("_exported_check")
    if check is not None:
        return (tuple(check.inputs), type(check.guard.model).__name__) if check.inputs else None
    return pm.__dict__.get("_exported_inputs")  # a copy of a copy


def _importable_class(pm: Any) -> type:
    """The class of ``pm`` that pickle can import (GraphModule adds a throwaway subclass)."""
    return next(c for c in type(pm).__mro__ if "<locals>" not in c.__qualname__)


def refuses_corrupt_state(restore: Callable[..., Any]) -> Callable[..., Any]:
    """``restore`` (what ``torch.load`` calls with a pickled program's state) raising, for a state
    that is not what a save writes (a corrupt file, another dpcompile version), a ``DpCompileError``
    that says so, never a ``KeyError`` from inside a graph."""

    @functools.wraps(restore)
    def guarded(*args: Any) -> Any:
        try:
            return restore(*args)
        except DpCompileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise DpCompileError(
                f"the pickled program cannot be restored ({type(e).__name__}: {str(e)[:200]}): the file is corrupt, or "
                "was saved by another dpcompile version; save it again with torch.save(pm, f) where it works, or ship "
                "its weights with dpcompile.save_checkpoint and transform the model where you load them"
            ) from e

    return guarded


@refuses_corrupt_state
def restore_parallel_module(cls: type, state: dict[str, Any]) -> Any:
    """The program ``state`` describes, as class ``cls`` (unpickling; ``dpcompile.load`` restores a
    program read as data the same way)."""
    state = _with_graphs(state)
    if state.get("stale_main") and state.get("source"):  # traced again at its first call: what it ran is gone
        state["graph"] = _stale_graph_if_unbuildable(state["graph"], state)
        if state["captured_graph"] is not None:
            state["captured_graph"] = _stale_graph_if_unbuildable(state["captured_graph"], state)
    holder = nn.Module()
    holder._modules.update(state["modules"])
    if state.get("leaf_root") is not None:
        holder._modules[ROOT_LEAF] = state["leaf_root"]
    holder._parameters.update(state["parameters"])
    holder._buffers.update(state["buffers"])
    holder._non_persistent_buffers_set = set(state["non_persistent"])
    config = state["config"]
    source = dict(state.get("source") or {})
    if source.get("fake"):  # a private copy carried on meta: fake again, as transform made it
        source["model"] = fake_copy_to_trace(source["model"], _first_device(config["devices"]))
    captured = None
    if state["captured_graph"] is not None:
        captured = graph_module(holder, state["captured_graph"], "Captured")
        propagate_example_shapes(holder, captured.graph, state.get("captured_shapes"), _first_device(config["devices"]))
    pm = cls.__new__(cls)
    cls._init_parallel_module(
        pm,
        holder,
        state["graph"],
        recipe=config["recipe"],
        devices=config["devices"],
        mode=config["mode"],
        input_dims=config["input_dims"],
        output_device=config["output_device"],
        plan=config["plan"],
        captured=captured,
        share_all_of=holder,
        source=source.get("model"),
        flags=source.get("flags") or dict(state["main_key"].flags),
        none_args=source.get("none_args", state["main_key"].none_args),
        shares_source=config["shares_source"],
    )
    if state.get("leaf_root") is not None:
        pm._modules.pop(ROOT_LEAF, None)
    pm._restore_extra_state(state["extra"])
    pm.__dict__.update(state.get("described", {}))
    pm.training = state["training"]  # each submodule was pickled with its own mode
    if state.get("stale_main") and pm.traced_model is not None:  # pm.graph was traced for the model as it was
        pm.program_cache.main_key = pm.program_cache.main_key._replace(guard=-1)
    if pm.traced_model is not None:  # pm.graph runs the modes it was traced in, not those the model was pickled in
        pm.program_cache.main_key = pm.program_cache.main_key._replace(modes=state["main_key"].modes)
    if pm.traced_model is None:
        pm.call_signature = CallSignature.of(pm.graph, tuple(dict(state["main_key"].flags)))
        if state.get("call_signature") is not None:  # the original's: none for the export frontend's (its
            optional, flags = state["call_signature"]  # placeholders' None defaults are checked by value)
            pm.call_signature = dataclasses.replace(pm.call_signature, optional=tuple(optional), flags=tuple(flags))
        main = state["main_key"]
        main_key = CallKey(main.devices, main.modes, main.none_args, main.flags)
        object.__setattr__(pm, "_guard", ModelGuard(pm, pm._guard.is_leaf, paths=[path for path, _ in main.modes]))
        pm.program_cache.reset(main_key, CarriedPrograms(pm, state["programs"]))
        for key, trace in state["traces"]:  # what a data-parallel program lowers for fewer devices
            pm.program_cache.traces[key] = None if trace is None else _shaped_trace(pm, *trace, config["devices"])
    if state.get("exported_inputs") is not None:  # export fixed the arguments: a copy checks them as the original
        object.__setattr__(pm, "_exported_inputs", state["exported_inputs"])
    for name, hooks in (state.get("root_hooks") or {}).items():  # the model's own, without the model: pm's
        getattr(pm, name).update(hooks)
    if state.get("replicated"):  # the guard on inputs the examples gave without the batch
        pm.call_signature = dataclasses.replace(pm.call_signature, replicated=tuple(state["replicated"]))
    return pm


__all__ = ["DESCRIBED", "PicklesPrograms", "refuses_corrupt_state", "restore_parallel_module"]


_ROOT_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


def _root_hooks(pm: Any) -> dict[str, dict[int, Any]]:
    """The forward hooks of the model itself (tracing forward never records them: the program runs them
    around its call), for a copy that does not carry the model: it runs them as its own, as tensor
    parallelism's program does (they receive the copy)."""
    holder = pm.traced_model if pm.__dict__.get("_shares_source") else pm
    return {name: dict(hooks) for name in _ROOT_HOOKS if (hooks := getattr(holder, name, None))}


def _signature_state(signature: CallSignature | None) -> tuple[tuple, tuple] | None:
    """Where the program's calls depart (optional arguments, flags), as the original keys them: a copy
    that finds them again in its graph would key an export-frontend program's ``bias=None`` as left None,
    a call it cannot trace for."""
    return None if signature is None else (signature.optional, signature.flags)


def _reads_missing(graph: fx.Graph, state: dict[str, Any]) -> bool:
    """Whether ``graph`` calls or reads a module, parameter or buffer the pickled program no longer holds."""
    root = nn.Module()
    root._modules.update(state["modules"])
    root._parameters.update(state["parameters"])
    root._buffers.update(state["buffers"])
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr") and attribute_at(root, node.target) is None:
            return True
    return False


def _stale_graph_if_unbuildable(graph: fx.Graph, state: dict[str, Any]) -> fx.Graph:
    """The program traced before a submodule was replaced (``pm.layers[0] = new``) reads modules the
    copy does not hold: it never runs (the copy traces the model again at its first call), so its
    inputs are kept and its body dropped::

        before: layers_0_2 = self.layers.0.2(...)   # gone
        after:  return None                        # until the first call traces the model as it is
    """
    if not _reads_missing(graph, state):
        return graph
    stub = fx.Graph()
    for node in graph.nodes:
        if node.op == "placeholder":
            stub.node_copy(node)
    stub.output(None)
    return stub


def _with_graphs(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each :class:`PicklableGraph` (a pickled copy's) rebuilt as a graph."""

    def graph(g: Any) -> Any:
        return g.graph() if isinstance(g, PicklableGraph) else g

    return {
        **state,
        "graph": graph(state["graph"]),
        "captured_graph": graph(state["captured_graph"]),
        "programs": [(key, graph(g)) for key, g in state["programs"]],
        "traces": [(key, None if t is None else (graph(t[0]), t[1])) for key, t in state["traces"]],
    }


def _shaped_trace(pm: Any, graph: fx.Graph, shapes: Any, devices: Any) -> fx.GraphModule:
    trace = graph_module(pm, graph, "Captured")
    propagate_example_shapes(pm, trace.graph, shapes, _first_device(devices))
    return trace


def _first_device(devices: Any) -> Any:
    """The device fake examples of a restored program's shapes live on (its first device)."""
    first = devices[0] if isinstance(devices, (list, tuple)) and devices else "cpu"
    return first if isinstance(first, torch.device) else torch.device(str(first))
