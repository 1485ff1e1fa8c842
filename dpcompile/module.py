"""``ParallelModule``: the executable multi-device program that ``transform`` returns.

It is a ``torch.fx.GraphModule`` (``pm.graph``, ``pm.code``, ``pm.print_readable()``) whose
generated forward holds every cross-device step as a named call. In data-parallel mode it
holds the user's own submodules, parameters and buffers, so ``pm.parameters()`` *are* the
model's parameters and ``pm.state_dict()`` has the model's keys.

A call checks the batch first: arguments that disagree on the batch size, or an empty batch,
raise ``ValueError``; a batch smaller than the number of devices runs on that many devices
(a program for them is generated on first use).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.devices import Devices
from dpcompile.runtime.structures import tensor_leaves

# a call's departure from the traced one: (model's mode, arguments left None, flag values)
Variant = tuple[bool, frozenset[str], tuple[tuple[str, Any], ...]]


class ParallelModule(fx.GraphModule):
    """A generated multi-device module. Build it with :func:`dpcompile.transform`.

    >>> import torch, dpcompile
    >>> pm = dpcompile.transform(torch.nn.Linear(4, 2), ["cpu", "cpu"])
    >>> pm(torch.randn(5, 4)).shape
    torch.Size([5, 2])
    """

    def __init__(
        self,
        root: nn.Module,
        graph: fx.Graph,
        *,
        devices: Devices,
        mode: str,
        input_dims: dict[str, int | None] | None = None,
        output_device: torch.device | None = None,
        plan: dict[str, str] | None = None,
        captured_graph: fx.Graph | None = None,
        lower: Callable[[fx.GraphModule, Devices], fx.GraphModule] | None = None,
        records: list | None = None,
        class_name: str = "ParallelModule",
        share_all_of: nn.Module | None = None,
        source: nn.Module | None = None,
        leaf_modules: tuple[type[nn.Module], ...] = (),
        flags: dict[str, Any] | None = None,
    ):
        super().__init__(root, graph, class_name)
        if share_all_of is not None:
            self._share_state_of(share_all_of)
        self.devices = devices
        self.mode = mode
        self.input_dims = dict(input_dims or {})
        self.output_device = output_device or devices.primary
        self.plan = dict(plan or {})
        self._captured_graph = captured_graph
        self._lower = lower
        self.records = list(records or [])
        self._smaller_programs: dict[int, fx.GraphModule] = {}
        self._split_inputs = self._find_split_inputs()
        # the model, to trace again for a call that takes another path through its forward
        # (not a stand-in without forward, such as an exported program's plain modules)
        if source is not None and type(source).forward is nn.Module.forward:
            source = None
        object.__setattr__(self, "_source", source)
        self._leaf_modules = tuple(leaf_modules)
        self._traced_training = None if source is None else source.training
        self._optional_inputs = self._find_optional_inputs() if source is not None else []
        self._flags = dict(flags or {})  # flag arguments the program was traced for, and their values
        self._flag_inputs = self._find_flag_inputs() if source is not None else []
        self._variants: dict[Variant, fx.GraphModule | None] = {}
        self._variant_programs: dict[tuple[int, Variant], fx.GraphModule] = {}

    def _share_state_of(self, model: nn.Module) -> None:
        """Hold all of ``model``'s submodules, parameters and buffers (not just the used ones)."""
        from dpcompile.capture import ROOT_LEAF

        leaf_root = self._modules.pop(ROOT_LEAF, None)
        if leaf_root is not None:  # called by the program, but not part of the state
            object.__setattr__(self, ROOT_LEAF, leaf_root)
        adopt_state(self, model)

    # ------------------------------------------------------------------ calling
    def _find_split_inputs(self) -> list[tuple[int, str, int]]:
        out = []
        for position, node in enumerate(n for n in self.graph.nodes if n.op == "placeholder"):
            dim = self.input_dims.get(node.target)
            if dim is not None:
                out.append((position, str(node.target).lstrip("*"), dim))
        return out

    def _find_optional_inputs(self) -> list[tuple[int, str]]:
        """``(position, name)`` of the arguments that default to None."""
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        return [(i, str(n.target)) for i, n in enumerate(placeholders) if n.args and n.args[0] is None]

    def _find_flag_inputs(self) -> list[tuple[int, str, Any]]:
        """``(position, name, default)`` of the flag arguments the program was traced for."""
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        return [
            (i, str(n.target), n.args[0] if n.args else None)
            for i, n in enumerate(placeholders)
            if n.target in self._flags
        ]

    def batch_size(self, args: tuple, kwargs: dict) -> int | None:
        """The batch size of a call, checking that every split argument agrees."""
        seen: tuple[str, int] | None = None
        for position, name, dim in self._split_inputs:
            if position < len(args):
                value = args[position]
            elif name in kwargs:
                value = kwargs[name]
            else:
                continue
            for path, tensor in tensor_leaves(value):
                if tensor.dim() <= dim:
                    continue
                size = tensor.size(dim)
                where = f"{name}{path}"
                if seen is None:
                    seen = (where, size)
                elif size != seen[1]:
                    raise ValueError(
                        f"argument '{where}' has batch size {size} on dim {dim}, but '{seen[0]}' has "
                        f"{seen[1]}; every split input must carry the same batch (pass batch_dim= to "
                        "choose another dim, or example_inputs= so inputs without a batch are replicated)"
                    )
        if seen is not None and seen[1] == 0:
            raise ValueError(f"argument '{seen[0]}' has an empty batch (size 0); there is nothing to split")
        return None if seen is None else seen[1]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        batch = self.batch_size(args, kwargs) if self._split_inputs else None
        n = batch if batch is not None and batch < len(self.devices) else len(self.devices)
        variant = self._variant(args, kwargs) if self._lower is not None else None
        if variant is not None and (captured := self._captured_variant(variant)) is not None:
            return self._variant_program(n, variant, captured)(*args, **kwargs)
        if n < len(self.devices) and self._lower is not None:
            return self._program_for(n)(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    # ------------------------------------------------------------------ variants
    def _variant(self, args: tuple, kwargs: dict) -> Variant | None:
        """How this call differs from the one ``self.graph`` was traced for, where forward may
        branch on it: the model's mode (``self.training``), the optional arguments that are
        None (``if mask is not None``) and the values of flag arguments (``if return_hidden``).
        None when it differs in none of them."""
        source = self._source
        if source is None:
            return None
        nones = frozenset(
            name
            for position, name in self._optional_inputs
            if (args[position] if position < len(args) else kwargs.get(name)) is None
        )
        flags = tuple(
            (name, args[position] if position < len(args) else kwargs.get(name, default))
            for position, name, default in self._flag_inputs
        )
        if not nones and source.training == self._traced_training and flags == tuple(self._flags.items()):
            return None
        return source.training, nones, flags

    def _captured_variant(self, variant: Variant) -> fx.GraphModule | None:
        """The model traced again for ``variant``; None where that gives the same program."""
        if variant not in self._variants:
            from dpcompile.api import recapture

            assert self._captured_graph is not None
            gm = recapture(self._source, self.devices, self._leaf_modules, variant[1], dict(variant[2]))
            same = gm.graph.python_code("self").src == self._captured_graph.python_code("self").src
            self._variants[variant] = None if same else gm
        return self._variants[variant]

    def _variant_program(self, n: int, variant: Variant, captured: fx.GraphModule) -> fx.GraphModule:
        """The program of a variant for the first ``n`` devices."""
        key = (n, variant)
        if key not in self._variant_programs:
            assert self._lower is not None
            gm = fx.GraphModule(captured, copy_graph(captured.graph), f"ParallelModule{n}")
            self._variant_programs[key] = self._lower(gm, self.devices.prefix(n))
        program = self._variant_programs[key]
        program.training = self.training
        return program

    def _program_for(self, n: int) -> fx.GraphModule:
        """The same program generated for the first ``n`` devices only."""
        if n not in self._smaller_programs:
            assert self._captured_graph is not None and self._lower is not None
            graph = copy_graph(self._captured_graph)
            gm = fx.GraphModule(self, graph, f"ParallelModule{n}")
            self._smaller_programs[n] = self._lower(gm, self.devices.prefix(n))
        program = self._smaller_programs[n]
        program.training = self.training  # its submodules are ours: their own modes stand
        return program

    def train(self, mode: bool = True) -> ParallelModule:
        super().train(mode)
        if self.__dict__.get("_source") is not None:
            self._source.training = mode  # the model's own flag (its submodules are ours)
        from dpcompile.capture import ROOT_LEAF

        if isinstance(self.__dict__.get(ROOT_LEAF), nn.Module):
            self.__dict__[ROOT_LEAF].train(mode)
        for program in self._smaller_programs.values():
            program.train(mode)
        return self

    # ------------------------------------------------------------------ pickling
    def __reduce__(self):
        state = {
            "modules": dict(self._modules),
            "leaf_root": self.__dict__.get("root") if isinstance(self.__dict__.get("root"), nn.Module) else None,
            "parameters": dict(self._parameters),
            "buffers": dict(self._buffers),
            "non_persistent": set(self._non_persistent_buffers_set),
            "training": self.training,
            "graph": copy_graph(self.graph),
            "captured_graph": copy_graph(self._captured_graph) if self._captured_graph is not None else None,
            "config": {
                "devices": self.devices,
                "mode": self.mode,
                "input_dims": self.input_dims,
                "output_device": self.output_device,
                "plan": self.plan,
                "class_name": type(self).__name__,
            },
            "extra": self._extra_state_for_pickle(),
            "source": self._picklable_source(),
        }
        return (_restore_parallel_module, (_importable_class(self), state))

    def __deepcopy__(self, memo: dict[int, Any]) -> ParallelModule:
        """An independent copy (an EMA of the weights, a snapshot), built as unpickling builds
        one; ``GraphModule.__deepcopy__`` would drop everything but the graph and modules."""
        restore, (cls, state) = self.__reduce__()
        if state["source"] is None and self.__dict__.get("_source") is not None:  # no import needed
            state["source"] = self._source_state()
        return restore(cls, copy.deepcopy(state, memo))

    def _picklable_source(self) -> dict[str, Any] | None:
        """The model (to trace variants after loading) where pickle can import its classes."""
        source = self.__dict__.get("_source")
        classes = [type(source), *self._leaf_modules]
        if source is None or any("<locals>" in c.__qualname__ for c in classes):
            return None
        return self._source_state()

    def _source_state(self) -> dict[str, Any]:
        return {
            "model": self._source,
            "leaf_modules": self._leaf_modules,
            "traced_training": self._traced_training,
            "flags": self._flags,
        }

    def _extra_state_for_pickle(self) -> dict[str, Any]:
        """What a subclass (tensor parallel) needs, beyond modules and graph, to rebuild itself."""
        return {}

    def _restore_extra_state(self, extra: dict[str, Any]) -> None:
        """The counterpart of :meth:`_extra_state_for_pickle`."""


def adopt_state(holder: nn.Module, model: nn.Module) -> None:
    """Make ``holder`` hold ``model``'s own submodules, parameters and buffers (the same
    objects) and training mode, so their state dicts have the same keys.

    ``fx.GraphModule`` keeps only what its graph reads, with empty stand-ins for the modules
    on the way; this restores the rest. Buffers the program holds beyond the model's (the
    tracer's ``_tensor_constant0`` for a tensor made in forward) stay out of ``state_dict``.
    """
    program_only = {key for key in holder._buffers if key not in model._buffers}
    for name in ("_modules", "_parameters", "_buffers"):
        ours, theirs = getattr(holder, name), getattr(model, name)
        merged = dict(theirs)  # the model's order, so state_dict keys come in the same order
        merged.update((key, value) for key, value in ours.items() if key not in theirs)
        ours.clear()
        ours.update(merged)
    holder._non_persistent_buffers_set = set(model._non_persistent_buffers_set) | program_only
    holder.training = model.training


def _importable_class(pm: ParallelModule) -> type:
    """The class of ``pm`` that pickle can import (GraphModule adds a throwaway subclass)."""
    return next(c for c in type(pm).__mro__ if "<locals>" not in c.__qualname__)


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` that belongs to no module (linear time, unlike ``copy.deepcopy``)."""
    clone = fx.Graph()
    clone._codegen = graph._codegen
    remap: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        remap[node] = clone.node_copy(node, lambda n: remap[n])
    return clone


def _restore_parallel_module(cls: type, state: dict[str, Any]) -> ParallelModule:
    holder = nn.Module()
    holder._modules.update(state["modules"])
    if state.get("leaf_root") is not None:
        holder._modules["root"] = state["leaf_root"]
    holder._parameters.update(state["parameters"])
    holder._buffers.update(state["buffers"])
    holder._non_persistent_buffers_set = set(state["non_persistent"])
    config = state["config"]
    pm = cls.__new__(cls)
    lower = None
    if config["mode"] == "data_parallel" and state["captured_graph"] is not None:
        from dpcompile.api import data_parallel_lowering

        lower = data_parallel_lowering(config["input_dims"], config["output_device"])
    ParallelModule.__init__(
        pm,
        holder,
        state["graph"],
        devices=config["devices"],
        mode=config["mode"],
        input_dims=config["input_dims"],
        output_device=config["output_device"],
        plan=config["plan"],
        captured_graph=state["captured_graph"],
        lower=lower,
        share_all_of=holder,
        source=(state.get("source") or {}).get("model"),
        leaf_modules=(state.get("source") or {}).get("leaf_modules", ()),
        flags=(state.get("source") or {}).get("flags"),
    )
    if state.get("source"):
        pm._traced_training = state["source"]["traced_training"]
    if state.get("leaf_root") is not None:
        pm._modules.pop("root", None)
    pm._restore_extra_state(state["extra"])
    pm.training = state["training"]  # each submodule was pickled with its own mode
    return pm

