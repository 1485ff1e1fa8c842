"""The base of every recipe: options validated once, and the capture they share."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx
from torch import nn
from torch.fx._symbolic_trace import _assert_is_none

import passes
from dpcompile.analysis.context_exchange import ContextParallelOptions
from dpcompile.capture import EXPORTED_FROM, ROOT_LEAF, capture, capture_fx
from dpcompile.fx_utils import bind_inputs, propagate_shapes
from dpcompile.infra import run_passes
from dpcompile.mesh import local_device
from dpcompile.modules.carried import modes_applied
from dpcompile.progress import QUIET, step_bar


@dataclass(frozen=True)
class Recipe:
    """How to compile a model, whatever the parallelism.

    ``leaf_modules``: module types the tracer must not enter; ``frontend``: ``"fx"``,
    ``"export"`` or ``"auto"``; ``checkpointed``: the module paths whose activations are
    recomputed in backward (``passes.checkpoint_activations``, last in every lowering); ``dp_micro_batches``:
    where a ``dp`` dimension composes over a pipeline's program, the micro-batches of each of its
    copies (``micro_batches // dp_micro_batches`` copies, pieces named by ``passes.name_dp_copies``). Subclasses add what their kind needs and implement
    :meth:`compile` and :meth:`build_program`.
    """

    leaf_modules: tuple[type[nn.Module], ...] = ()
    frontend: str = "auto"
    checkpointed: tuple[str, ...] = ()  # module paths recomputed in backward (activation_checkpointing=)
    checkpoint_save: str = "nothing"  # what a recomputed region keeps (passes.checkpoint_saves.SAVE_RULES)
    exact_random: bool = True  # random ops draw the single-device values (passes.draw_random_whole)
    dp_micro_batches: int | None = None  # each dp copy's micro-batches, where dp composes over a pipeline (target.replicate_over_dp)
    dp_devices: tuple[tuple[str, ...], ...] | None = None  # each dp copy's devices (passes.place_dp_copies)
    context_exchange: str = "auto"  # context_parallel={"exchange": ...}: how a cp dim exchanges keys and values
    context_load_balance: bool | str = "auto"  # context_parallel={"load_balance": ...}
    context_memory_headroom: int | None = None  # memory_per_device= less the prediction: the exchange's room

    #: what the recipe says of itself, so that no caller asks its class:
    #: ``serves_flags``: its program keeps fx's capture with Python flags as traced (checked per call,
    #: traced again for others) and takes the batch dim the frontend finds (data parallel, a pipeline)
    serves_flags: ClassVar[bool] = False
    #: ``lowers_capture``: its program is ``pm.captured`` lowered for the devices (data parallel): rebuilt
    #: for others from it, a batch below their count split over as many of them; exported in one mode,
    #: the other mode captured at its first call (:mod:`dpcompile.modules.other_mode`)
    lowers_capture: ClassVar[bool] = False
    #: ``replicates_model``: its program computes on the model's own tensors (data parallel): a model
    #: on meta is given memory in place, where other programs own their tensors (shards, placed stages)
    replicates_model: ClassVar[bool] = False
    #: ``strategy`` (``pm.strategy``): ``"pipeline"`` where the program has stages, else ``"tensor_parallel"``
    #: where it shards layers (dp x tp too, built as one stage), else ``"data_parallel"`` (cp too)
    strategy: ClassVar[str] = "data_parallel"

    @property
    def splits_batch(self) -> bool:
        """Its program splits the batch over devices itself (``dp``'s rows, ``cp``'s sequence, in one
        program: data parallel, or copies or pieces composed over another program), so an op without a batch
        rule runs whole on the gathered batch (``explain``'s ``split_flop_fraction`` and ``whole``)."""
        return self.dp_devices is not None

    @property
    def context_options(self) -> ContextParallelOptions:
        """``context_parallel=`` as the passes read it (kept as plain fields: a recipe exports as data)."""
        return ContextParallelOptions(self.context_exchange, self.context_load_balance, self.context_memory_headroom)

    @property
    def home_device(self) -> torch.device:
        """The device the program is built on: the first of ``devices``; over a mesh, this rank's."""
        mesh = getattr(self, "mesh", None)
        return local_device(mesh) if mesh is not None else self.devices.primary  # type: ignore[attr-defined]

    def compile(self, model: nn.Module, example_inputs: Sequence[Any] | None) -> nn.Module:
        """``model`` compiled into this recipe's kind of ``ParallelModule``."""
        raise NotImplementedError

    def build_program(self, pm: Any, key: Any, args: tuple, kwargs: dict) -> fx.GraphModule | None:
        """The program of ``pm`` for a call with ``key`` (a :class:`~dpcompile.program_cache.CallKey`);
        None where ``pm``'s main program serves it."""
        raise NotImplementedError

    @property
    def completes_other_mode(self) -> bool:
        """Whether a program exported in one mode is made to serve the other in place, at its first
        call in it (:meth:`complete_other_mode`), rather than exporting both modes at transform."""
        return False

    def complete_other_mode(self, pm: Any, merged: fx.GraphModule, examples: Sequence[Any] | None) -> Callable[[], None]:
        """``pm``'s program lowered again from ``merged`` (its capture, both modes merged), over
        ``pm``'s own modules and tensors; returns what swaps it in (which cannot fail). Nothing of
        ``pm`` changes before that (:class:`~dpcompile.modules.other_mode.OtherModeInPlace`)."""
        raise NotImplementedError

    def frontend_options(self, input_dims: Mapping[str, int | None]) -> Any:
        """The options the captured graph is tidied with (``passes.frontend_pipeline``), the main trace's
        and a trace made again for another call's alike."""
        raise NotImplementedError

    def fake_layout_fields(self, pm: Any) -> dict[str, Any] | None:
        """The fields, beside ``devices``, with which :meth:`compile` builds ``pm``'s program again for
        other devices (``verify.check_layout``'s fake CUDA ones); None where it is not built so."""
        return None


def departing_trace(recipe: Any, pm: Any, key: Any, args: tuple = (), kwargs: dict | None = None) -> fx.GraphModule | None:
    """The captured graph a call as ``key`` lowers: None for ``pm``'s main trace, else the model
    traced again for ``key``'s modes, None arguments and flags (:func:`trace_again`), once per such
    key (kept in ``pm.program_cache.traces``; None there too where it came out the same)."""
    trace_key = key.traced()
    if trace_key == pm.program_cache.main_key.traced():
        return None
    traces = pm.program_cache.traces
    if trace_key not in traces:
        if pm.traced_model is None:
            raise pm.cannot_trace_again(key)
        traced = trace_again(recipe, pm.traced_model, key, dict(getattr(pm, "input_dims", None) or {}), (args, kwargs or {}))
        traces[trace_key] = None if traced.code == pm.captured.code else traced
    return traces[trace_key]


def trace_again(recipe: Any, model: nn.Module, key: Any, input_dims: Mapping[str, int | None], call: tuple[tuple, dict]) -> fx.GraphModule:
    """``model`` traced again as ``key`` says (modes, None arguments, flags), tidied as the main trace
    was (``recipe.frontend_options``, with ``pm``'s input dims and, for context parallel, the call's
    shapes, so attention is marked as in the main trace)."""
    with modes_applied(model, key.modes):
        gm = capture(model, leaf_modules=recipe.leaf_modules, none_args=key.none_args, flags=dict(key.flags) or None)
    if recipe.context_parallel:  # attention's shapes mark what it needs of the sequence
        shapes_of_the_call(gm, call, recipe.devices.primary)
    gm, _ = run_passes(gm, passes.frontend_pipeline(recipe.frontend_options(input_dims)))
    return gm


def shapes_of_the_call(gm: fx.GraphModule, call: tuple[tuple, dict], device: torch.device) -> None:
    """Each node's shape from the call's arguments (fake copies on ``device``), as the main trace had
    them from the examples; nothing where the call gave no arguments."""
    args, kwargs = call
    if args or kwargs:
        values = bind_inputs(gm, args, kwargs)
        propagate_shapes(gm, [v.to(device) if isinstance(v, torch.Tensor) else v for v in values])


def capture_with_flags(
    model: nn.Module,
    leaf_modules: tuple[type[nn.Module], ...],
    example_inputs: Sequence[Any] | None,
    *,
    optional_as_none: bool = True,
) -> tuple[fx.GraphModule, dict[str, Any], frozenset[str]]:
    """Capture ``model`` with fx; trace a Python flag argument (``return_hidden``) and an optional
    argument the examples leave None (``mask=None``) as the example (else the default) gives them
    (:func:`dpcompile.capture.capture_fx`). Returns the graph, the flags and the optional
    arguments traced as None: the program serves calls with those, and the module traces again
    for others. ``optional_as_none=False``: only where forward branches on them (for a program
    that is never traced again)."""
    gm, flags = capture_fx(
        model, leaf_modules=leaf_modules, example_inputs=example_inputs, optional_as_none=optional_as_none
    )
    nones = frozenset(
        str(node.args[0].target)
        for node in gm.graph.nodes
        if node.target is _assert_is_none and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"
    )
    return gm, flags, nones


def sharing_model(model: nn.Module, gm: fx.GraphModule, flags: dict[str, Any], nones: frozenset[str]) -> dict[str, Any]:
    """The ``ParallelModule`` keywords of a program ``gm`` (captured from ``model``) that computes on
    ``model``'s own tensors: traced again where a call departs (unless ``model`` is a GraphModule
    or is called whole), checked against what torch.export fixed where it came from there."""
    retraceable = not isinstance(model, fx.GraphModule) and getattr(gm, ROOT_LEAF, None) is not model
    return {
        "class_name": type(model).__name__, "share_all_of": model, "source": model if retraceable else None,
        "flags": flags, "none_args": nones,
        "exported_from": model.meta.get(EXPORTED_FROM) if isinstance(model, fx.GraphModule) else None,
    }  # fmt: skip


def move_to(model: nn.Module, device: torch.device) -> None:
    """``model.to(device)`` in place, skipped when everything is there already. Under a progress
    bar (``transform(progress=)``) module by module, one step a tensor; else in one ``model.to``."""
    tensors = list(model.parameters()) + list(model.buffers())
    if not any(t.device != device for t in tensors):
        return
    bar = step_bar("Placing weights", len(tensors))
    modules = list(model.modules())
    if bar is QUIET or not all(_moves_one_at_a_time(kind) for kind in {type(m) for m in modules}):
        model.to(device)
        bar.update(len(tensors))
        return
    for module in modules:  # what model.to does, a module at a time
        module._apply(lambda t: t.to(device), recurse=False)
        bar.update(len(module._parameters) + len(module._buffers))


def _moves_one_at_a_time(kind: type[nn.Module]) -> bool:
    """Whether ``kind._apply`` takes ``recurse=`` (torch's own do; an override of another library may not)."""
    return "recurse" in inspect.signature(kind._apply).parameters
