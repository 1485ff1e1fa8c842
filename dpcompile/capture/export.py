"""The ``torch.export`` frontend: capture what fx cannot (shape and dtype branches, wrapped
forwards such as transformers 5.x) as an ATen-level graph the passes understand.

``torch.export.export(model, (), kwargs, strict=False)`` runs forward on fake tensors with the
batch dim dynamic (``Dim.AUTO``), so the program serves other batch sizes. Its unlifted graph
(``ep.module()``) is then made into a program like the fx frontend's:

* parameters and buffers are ``get_attr`` nodes of the model's own paths, held by the model's
  own modules (state_dict keys stay the model's; data parallel shares them, never copies);
* ops that are exactly one module's forward (``aten.linear`` with ``fc.weight``/``fc.bias``,
  conv, embedding, layer_norm, batch_norm, dropout) become calls of that module again, so the
  module-level rules apply (tensor parallel shards ``nn.Linear``; batch norm keeps
  whole-batch statistics; dropout and batch norm follow ``pm.train()``/``pm.eval()``);
* nodes are named after their module path (``encoder_layer_0_attn_q_proj`` rather than
  ``linear_17``) and keep export's ``stack_trace``, so errors and explain point at user code;
* a ``mean`` loss becomes ``sum / count`` (the same value), which data parallel reduces
  exactly over uneven chunks;
* the placeholders are forward's own argument names, so ``pm(input_ids=..., labels=...)`` works.

The rewrites live in :mod:`~dpcompile.capture.rewrite`, what the program calls at run time in
:mod:`~dpcompile.runtime.exported`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import logging
import warnings
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.capture.eager_paths import export_as_eager_runs
from dpcompile.capture.errors import user_source
from dpcompile.capture.export_inputs import (
    batch_dim_of,
    bind_names,
    dynamic_spec,
    varying_dims,
    without_cache,
)
from dpcompile.capture.export_modes import OTHER_MODE_PENDING, OtherModeExport, reads_mode, serve_both_modes
from dpcompile.capture.grad_blocks import (
    check_grad_mode,
    export_decides_on_grad_mode,
    grad_mode_reads,
    inference_mode_as_no_grad,
    inline_no_grad_blocks,
)
from dpcompile.capture.inputs import is_dynamic
from dpcompile.capture.modes import READS_MODE_ELSEWHERE, mode_reads_elsewhere
from dpcompile.capture.rewrite import rewrite
from dpcompile.capture.side_effects import (
    SideEffectRefused,
    check_export_effects,
    check_writes_without_grad,
    hooks_that_return_nothing,
    seeds_recorded,
)
from dpcompile.capture.state import SideEffects, python_state_kept, warn_lists_changed
from dpcompile.errors import ArgumentError, ExampleError, TraceError, first_line
from dpcompile.fx_utils import is_example_misfit, quiet_fake_tensor_log
from dpcompile.progress import step_bar
from dpcompile.runtime.exported import expect_value

log = logging.getLogger("dpcompile")
#: ``ep.graph_module.meta`` key: the lines of forward that turned a read of data into a Python number
NUMBERS_READ_AT = "dpcompile_numbers_read_at"
aten = torch.ops.aten


@dataclasses.dataclass
class Exported:
    """What :func:`capture_export` made: the program and how it was made."""

    gm: fx.GraphModule
    example_inputs: tuple[Any, ...]  # in placeholder order
    batch_dim: int
    dynamic_batch: bool
    export_seconds: float = 0.0


def capture_export(*args: Any, **kwargs: Any) -> Exported:
    """:func:`export_program`, where ``module.to(...)`` inside forward that changes nothing is a no-op
    (:mod:`~dpcompile.capture.module_to`) and ``torch.inference_mode()`` is a no-grad block."""
    from dpcompile.capture.module_to import unchanged_module_to

    with unchanged_module_to(), inference_mode_as_no_grad():
        return export_program(*args, **kwargs)


def export_program(
    model: nn.Module,
    example_inputs: Sequence[Any] | None,
    example_kwargs: Mapping[str, Any] | None,
    *,
    batch_dim: int | None = None,
    dynamic_dims: Any = None,
    lazy_other_mode: bool = False,
) -> Exported:
    """Export ``model`` on the examples and make the graph a program the passes understand.

    ``lazy_other_mode``: where forward may read ``self.training``, export only the mode the model
    is in and mark the program ``meta[OTHER_MODE_PENDING]``: an :class:`~dpcompile.capture.export_modes.OtherModeExport` that exports
    the other mode and merges it in at the first call that needs it, instead of exporting it now."""
    import time

    from torch.export import export

    if example_inputs is None and not example_kwargs:
        raise TraceError(
            f"the export frontend needs examples to run {type(model).__name__}.forward on: pass example_inputs= "
            "(a tuple of arguments) and/or example_kwargs= (a dict, e.g. input_ids=, attention_mask=)"
        )
    names = distinct_examples(bind_names(model, tuple(example_inputs or ()), dict(example_kwargs or {})))
    positional = tuple(names)[: len(example_inputs or ())]  # what a root pre-hook takes as its args
    injected = without_cache(model, names)
    for name, value in names.items():
        if isinstance(value, (list, tuple, dict)) and any(isinstance(v, torch.Tensor) for v in torch.utils._pytree.tree_leaves(value)):
            raise TraceError(
                f"the export frontend takes tensors and Python values as arguments; '{name}' is a "
                f"{type(value).__name__} of tensors: pass its tensors as separate arguments"
            )
    dim = batch_dim_of(model) if batch_dim is None else batch_dim
    if isinstance(dynamic_dims, Mapping) and (unknown := set(dynamic_dims) - set(names)):
        raise ArgumentError(f"dynamic_dims= names {sorted(unknown)}, which the examples do not give (they give {list(names)})")
    spec = {name: dynamic_spec(value, dim, varying_dims(dynamic_dims, name)) for name, value in names.items()}
    start = time.perf_counter()
    decided = False
    def export_again() -> Any:
        with export_as_eager_runs(model, positional), warnings.catch_warnings(), quiet_fake_tensor_log(), \
                python_state_kept(model), seeds_recorded():  # fmt: skip
            warnings.simplefilter("ignore")
            return export(model, (), dict(names), dynamic_shapes=spec, strict=False)

    effects, seeds = SideEffects(), []
    bar = step_bar("Capturing the model", 1)  # transform(progress=): one step an export
    try:
        with export_as_eager_runs(model, positional), warnings.catch_warnings(), quiet_fake_tensor_log(), \
                python_state_kept(model) as effects, seeds_recorded() as seeds, hooks_that_return_nothing(model) as recording, \
                grad_mode_reads() as grad_reads, mode_reads_elsewhere(model) as mode_reads:  # fmt: skip
            warnings.simplefilter("ignore")
            ep = export(model, (), dict(names), dynamic_shapes=spec, strict=False)
    except Exception as exc:  # noqa: BLE001 - every export failure becomes a TraceError (or examples that do not fit)
        if is_example_misfit(exc):
            raise misfit_error(exc, model) from None
        ep = None
        if _is_data_dependent(exc):
            with mode_reads_elsewhere(model) as past_the_branch:  # the first export stopped at the branch
                ep = _export_deciding_on_examples(model, names, spec, positional)
            mode_reads = [*mode_reads, *past_the_branch]
        if ep is None:
            raise export_error(exc, model, given=names) from exc
        decided = True
    seconds = time.perf_counter() - start
    bar.update()
    if not decided and recording:
        warnings.warn(
            f"forward hooks of {', '.join(repr(p) for p in recording)} return nothing (they record or check): the "
            "program captured with torch.export keeps their tensor ops, not what they do in Python, so it does not "
            "call them; transform with frontend='fx', which calls them at each call",
            stacklevel=3,
        )
    unlifted = ep.module()
    from dpcompile.program_cache import code_names  # it imports capture.state: not at import time

    check_export_effects(model, effects, seeds, unlifted, ep.graph_module.code, export_again, code_names)
    warn_lists_changed(model, effects)
    check_writes_without_grad(model, unlifted)
    gm, dynamic = _program(model, unlifted, names, dim, injected, keep_data_checks=decided)
    gm.meta[READS_MODE_ELSEWHERE] = bool(mode_reads)
    if decided:
        from dpcompile.capture.decided import refuse_numbers_read_from_data

        refuse_numbers_read_from_data(gm, type(model).__name__, ep.graph_module.meta.get(NUMBERS_READ_AT, []))
    if lazy_other_mode and reads_mode(model, gm):
        export_other = functools.partial(
            _export_in_other_mode, names=names, spec=spec, dim=dim, injected=injected, positional=positional
        )
        gm.meta[OTHER_MODE_PENDING] = OtherModeExport(model, export_other)
    else:
        other = _export_in_other_mode(model, gm, names, spec, dim, injected, positional)
        serve_both_modes(gm, None if other is gm else other, model, model.training, other is None)
    if grad_reads and export_decides_on_grad_mode(ep, export_again):
        check_grad_mode(gm.graph, grad_reads[0])
    gm.recompile()
    if not dynamic:
        warnings.warn(
            f"torch.export specialised the batch dim of {type(model).__name__} to the example's size; "
            "steps that depend on it run whole (correct, not parallel). Give an example batch of 2 or more.",
            stacklevel=3,
        )
    examples = tuple(names[n.target] for n in gm.graph.nodes if n.op == "placeholder")
    return Exported(gm, examples, dim, dynamic, seconds)


def distinct_examples(names: dict[str, Any]) -> dict[str, Any]:
    """``names`` with each tensor that shares memory with an earlier argument's (``pm(x, x)`` as the
    example) replaced by a copy: torch.export makes aliased inputs one input, so the program would
    read the first argument for both at every call, whatever the second is::

        before: transform(m, example_inputs=(x, x)); pm(x, y)  -> m(x, x)'s result
        after:                                        pm(x, y)  -> m(x, y)'s result"""
    seen: set[Any] = set()
    out = {}
    for name, value in names.items():
        if isinstance(value, torch.Tensor):
            key = _memory_of(value)
            if key in seen:
                value = value.detach().clone().requires_grad_(value.requires_grad)
            seen.add(key)
        out[name] = value
    return out


def _memory_of(t: torch.Tensor) -> Any:
    """What two aliasing tensors share: their storage's address, or the tensor itself where it has
    none to compare (meta and fake tensors)."""
    if t.is_meta or isinstance(t, torch._subclasses.fake_tensor.FakeTensor):
        return id(t)
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(t)
    return (t.device, ptr) if ptr else id(t)


def _is_data_dependent(exc: BaseException) -> bool:
    text = str(exc)
    return "data-dependent" in text or "GuardOnDataDependentSymNode" in type(exc).__name__ or "Could not guard" in text


def _export_deciding_on_examples(model: nn.Module, names: Mapping[str, Any], spec: Any, positional: Sequence[str]) -> Any:
    """Export again with each branch on a data-dependent size taken as the example takes it, and
    checked at run time (:mod:`~dpcompile.capture.decided`); None where that is not sound
    (a decision that reads an input size) or export still fails."""
    from torch.export import export

    from dpcompile.capture.decided import (
        check_decided_on_examples,
        decided_on_examples,
        lines_reading_numbers,
        name_branches,
        reads_only_data_sizes,
    )

    try:
        with export_as_eager_runs(model, positional), warnings.catch_warnings(), quiet_fake_tensor_log(), \
                python_state_kept(model), decided_on_examples() as decisions:  # fmt: skip
            warnings.simplefilter("ignore")
            ep = export(model, (), dict(names), dynamic_shapes=spec, strict=False)
    except Exception as exc:  # noqa: BLE001 - the first error is the one to report
        log.debug("export deciding data-dependent branches on the examples failed (%s)", exc)
        return None
    if not all(reads_only_data_sizes(d) for d in decisions):
        log.debug("a data-dependent branch also reads an input size (%s): not kept", decisions)
        return None
    if (line := _branch_on_a_random_draw(ep.graph)) is not None:
        raise TraceError(
            f"{type(model).__name__}.forward branches on a random draw ({line}): torch.export captures the branch the "
            "example drew, and each call draws anew; turn the draw off (transformers' LayerDrop: config.layerdrop = 0), "
            "or transform the model in eval mode"
        )
    name_branches(ep.graph_module, decisions, type(model).__name__)
    check_decided_on_examples(ep, names, type(model).__name__)
    ep.graph_module.meta[NUMBERS_READ_AT] = lines_reading_numbers(decisions)
    log.info("%s: %d data-dependent branch(es) taken as the example takes them, checked at every call", type(model).__name__, len(decisions))
    return ep


# dropout keeps or zeroes the data it is given: a branch on what went through it (DETR's
# ``if not torch.isfinite(hidden_states).all()`` in training) is a branch on that data, decided
# as any other (checked at every call), not a draw taken anew on each call
_DATA_THROUGH_DROPOUT = {
    aten.dropout.default, aten.native_dropout.default, aten.feature_dropout.default,
    aten.alpha_dropout.default, aten.feature_alpha_dropout.default,
}  # fmt: skip


def _branch_on_a_random_draw(graph: fx.Graph) -> str | None:
    """The source line of a Python value read from a random draw (``torch.rand([]) < p`` in an
    ``if``: wav2vec2's LayerDrop), where the exported program decided a branch on it; else None.
    Dropout is not such a draw (:data:`_DATA_THROUGH_DROPOUT`)."""
    scalar_reads = (aten.item.default, aten._local_scalar_dense.default)
    for read in (n for n in graph.nodes if n.op == "call_function" and n.target in scalar_reads):
        seen, stack = set(), [read]
        while stack:
            node = stack.pop()
            target = node.target
            seeded = isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags
            if seeded and target not in _DATA_THROUGH_DROPOUT:
                return user_source(read) or str(read)
            for arg in node.all_input_nodes:
                if arg not in seen:
                    seen.add(arg)
                    stack.append(arg)
    return None


def misfit_error(exc: BaseException, model: nn.Module) -> ExampleError:
    """The error for examples an op of ``model`` refuses while export runs it, naming the user's line."""
    from dpcompile.capture.errors import user_frame

    first = first_line(exc)
    found = user_frame(exc.__traceback__)
    where = f" at {found[0].filename.rsplit('/', 1)[-1]}:{found[0].lineno} in {found[0].name}" if found is not None else ""
    return ExampleError(
        f"example_inputs= do not fit {type(model).__name__}: {first}{where}; pass examples shaped as forward "
        "expects them"
    )


def export_error(exc: BaseException, model: nn.Module, given: Collection[str] = ()) -> TraceError:
    """A :class:`TraceError` for a failed export, naming the user's line where export says it."""
    from dpcompile.capture.errors import leaf_to_suggest, runs_a_packed_sequence, user_frame

    first = first_line(exc)
    found = user_frame(exc.__traceback__)
    where = line = ""
    if found is not None:
        frame, _ = found
        import linecache

        line = linecache.getline(frame.filename, frame.lineno).strip()
        where = f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}: {line!r}: "
    data_dependent = _is_data_dependent(exc)
    leaf = leaf_to_suggest(exc.__traceback__, model)
    if data_dependent:
        hint = "forward branches on tensor values (data-dependent control flow), which torch.export does not capture"
        if "labels" in line:  # transformers' loss checks (wav2vec2's CTC): the rest of forward captures
            hint += "; the branch is in the loss of `labels=`: leave labels out of the examples and calls, and compute the loss from the program's outputs"
        if leaf is not None:
            hint += f"; with the fx frontend, mark the module as a leaf (frontend='fx', leaf_modules=[{leaf.__name__}])"
    else:
        hint = "check that the examples are what forward accepts"
    returns_cache = "Cache'> in output" in first  # a transformers key/value cache returned: the cache was on
    if returns_cache:
        hint = f"{type(model).__name__} returns its key/value cache: turn it off with {_use_cache_setting(model)}"
    packed = runs_a_packed_sequence(exc.__traceback__)
    if packed:
        hint = (
            "torch.export cannot run an RNN on a PackedSequence (its batch_sizes are read from data): use "
            "frontend='fx', which keeps pack_padded_sequence and pad_packed_sequence as calls and splits the batch"
        )
    missing = _argument_left_none(exc, found, line, model, given)
    if missing is not None:
        example = f" (e.g. {missing}=torch.ones_like(input_ids))" if missing == "attention_mask" else ""
        hint = (
            f"'{missing}' is None there: the model builds it only outside torch.export (as transformers' models do), so "
            f"pass {missing}= in example_kwargs= and in each call{example}"
        )
    error = TraceError(f"torch.export could not capture {type(model).__name__}: {where}{type(exc).__name__}: {first}; {hint}")
    error.names_the_way_out = missing is not None or returns_cache or packed  # an argument, a setting or fx, not a part
    return error


def _use_cache_setting(model: nn.Module) -> str:
    """Where a transformers model's ``use_cache`` is set: its config, or its language model's (Llava's
    ``config.text_config``, which the frontend does not reach through forward's ``**kwargs``)."""
    config = getattr(model, "config", None)
    if config is None or hasattr(config, "use_cache"):
        return "model.config.use_cache = False before transform"
    for name in ("text_config", "language_config", "llm_config"):
        if hasattr(getattr(config, name, None), "use_cache"):
            return f"model.config.{name}.use_cache = False before transform"
    return "use_cache=False (in the examples and calls, or on the model's config) before transform"


def _argument_left_none(exc: BaseException, found: Any, line: str, model: nn.Module, given: Collection[str]) -> str | None:
    """The argument of forward, left out of the examples, that is None in the failing line's frame where
    the line fails on a None (Switch Transformers' ``attention_mask[:, None, None, :]``); else None."""
    import re

    from dpcompile.capture.fx import forward_parameters

    if found is None or "NoneType" not in str(exc):
        return None
    arguments = {p.name for p in forward_parameters(model)} - set(given)
    frame_locals = found[1].tb_frame.f_locals
    for name in sorted(arguments):
        if name in frame_locals and frame_locals[name] is None and re.search(rf"\b{name}\b", line):
            return name
    return None


# ----------------------------------------------------------------------------- the program

_DROPPED = {
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
    aten.sym_constrain_range.default,
}


def _program(
    model: nn.Module, unlifted: fx.GraphModule, names: Mapping[str, Any], batch_dim: int, injected: frozenset[str] = frozenset(),
    *, keep_data_checks: bool = False,
) -> tuple[fx.GraphModule, bool]:
    """The unlifted exported graph as a program over ``model``'s own modules and tensors;
    ``keep_data_checks``: the runtime assertions on data-dependent sizes stay (branches decided
    on the examples, :mod:`~dpcompile.capture.decided`)."""
    from dpcompile.capture.decided import data_check_message, is_data_check
    from dpcompile.fx_utils import adopt_state

    inline_no_grad_blocks(unlifted)
    source = unlifted.graph
    graph = fx.Graph()
    remap: dict[fx.Node, Any] = {}
    placeholders = [n for n in source.nodes if n.op == "placeholder"]
    if len(placeholders) != len(names):
        raise TraceError(f"torch.export flattened {len(names)} arguments into {len(placeholders)} inputs; pass tensors and Python values only")
    dynamic = False
    trailing_defaults = _trailing_python_values({k: v for k, v in names.items() if k not in injected})
    for node, (name, value) in zip(placeholders, names.items()):
        if name in injected:  # not an argument of the program: the value export ran with
            remap[node] = value
            continue
        default = (value,) if name in trailing_defaults else ()
        new = graph.placeholder(name, default_value=default[0] if default else inspect.Signature.empty)
        new.meta.update(node.meta)
        remap[node] = new
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and isinstance(value, torch.Tensor) and value.dim() > 0:
            dim = batch_dim if value.dim() > batch_dim else 0
            dynamic = dynamic or is_dynamic(val.shape[dim])
    for node, (name, value) in zip(placeholders, names.items()):
        if name not in injected and not isinstance(value, torch.Tensor) and _is_python_value(value):
            check = graph.call_function(expect_value, (remap[node], value, name))
            check.meta["stack_trace"] = f"  (argument '{name}' of {type(model).__name__}.forward)\n"
    roots: dict[str, Any] = {}
    for node in source.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "call_module":  # export's input guards; the program checks nothing at run time
            continue
        if node.op == "call_function" and node.target in _DROPPED and not (keep_data_checks and is_data_check(node)):
            continue
        if node.op == "get_attr":
            value = _resolve(model, unlifted, node.target)
            if not _owned_by(model, node.target):  # a constant export lifted (`torch.tensor(...)` in forward)
                flat = _constant_name(model, roots, node.target)
                roots[flat] = value
                remap[node] = graph.get_attr(flat)
                remap[node].meta.update(node.meta)
                continue
            roots[node.target] = value
        if node.op == "output":
            graph.output(_rebuild_output(graph, unlifted, [remap.get(a, a) if isinstance(a, fx.Node) else a for a in node.args[0]]))
            continue
        remap[node] = graph.node_copy(node, lambda n: remap[n])
        if keep_data_checks and is_data_check(node):
            remap[node].args = (remap[node].args[0], data_check_message(node))
    for node in graph.nodes:  # what export records for its own tools (NodeSource objects do not pickle)
        for key in _EXPORT_ONLY_META:
            node.meta.pop(key, None)
    gm = fx.GraphModule(roots, graph, class_name=type(model).__name__)
    adopt_state(gm, model)
    rewrite(gm, model)
    gm.recompile()
    return gm, dynamic


_EXPORT_ONLY_META = ("tensor_meta", "from_node", "torch_fn", "source_fn_stack", "seq_nr", "original_aten", "unbacked_bindings", "custom")


def _is_python_value(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _trailing_python_values(names: Mapping[str, Any]) -> set[str]:
    """Python-valued arguments after the last tensor: they keep their example value as default."""
    out: set[str] = set()
    for name, value in reversed(list(names.items())):
        if not _is_python_value(value):
            break
        out.add(name)
    return out


def _resolve(model: nn.Module, unlifted: fx.GraphModule, target: str) -> Any:
    """The model's own object at ``target`` (the same Parameter), else the exported one (a constant)."""
    obj: Any = model
    try:
        for atom in target.split("."):
            obj = getattr(obj, atom)
        return obj
    except AttributeError:
        obj = unlifted
        for atom in target.split("."):
            obj = getattr(obj, atom)
        return obj


def _owned_by(model: nn.Module, target: str) -> bool:
    obj: Any = model
    for atom in target.split("."):
        if not hasattr(obj, atom):
            return False
        obj = getattr(obj, atom)
    return True


def _constant_name(model: nn.Module, roots: Mapping[str, Any], target: str) -> str:
    """A root attribute for a constant export lifted inside a submodule (``encoder.lifted_tensor_0``):
    the model's own ``encoder`` is held in its place, which has no such attribute."""
    name, n = target.replace(".", "_"), 0
    while hasattr(model, name) or name in roots:
        n += 1
        name = f"{target.replace('.', '_')}_{n}"
    return name


def _rebuild_output(graph: fx.Graph, unlifted: fx.GraphModule, leaves: list[Any]) -> Any:
    """The flat outputs rebuilt into forward's structure (tuples, dicts, dataclasses such as
    transformers' ``ModelOutput``) by graph nodes."""
    spec = unlifted._out_spec if hasattr(unlifted, "_out_spec") else None
    if spec is None:
        return tuple(leaves)
    it = iter(leaves)
    return _build(graph, spec, it)


def _build(graph: fx.Graph, spec: Any, leaves: Any) -> Any:
    if spec.is_leaf():
        return next(leaves)
    children = [_build(graph, child, leaves) for child in (spec.children() if hasattr(spec, "children") else spec.children_specs)]
    kind = spec.type
    if kind is tuple:
        return tuple(children)
    if kind is list:
        return list(children)
    if kind is dict:
        return dict(zip(spec.context, children))
    if kind is type(None):
        return None
    if dataclasses.is_dataclass(kind):
        keys = spec.context if isinstance(spec.context, (list, tuple)) else [f.name for f in dataclasses.fields(kind)]
        if isinstance(spec.context, (list, tuple)) and len(spec.context) == 2 and isinstance(spec.context[0], (list, tuple)):
            keys = spec.context[0]
        return graph.call_function(kind, (), dict(zip(keys, children)))
    if isinstance(kind, type) and issubclass(kind, tuple) and hasattr(kind, "_fields"):
        return graph.call_function(kind, tuple(children))
    if kind is collections.namedtuple:  # pytree's node for every namedtuple: the class is the context
        return graph.call_function(spec.context, tuple(children))
    if isinstance(kind, type) and issubclass(kind, tuple) and hasattr(kind, "n_fields"):  # torch.return_types
        return graph.call_function(kind, (tuple(children),))
    if isinstance(kind, type) and issubclass(kind, dict):
        return graph.call_function(kind, (), dict(zip(spec.context, children)))
    raise TraceError(f"the export frontend cannot rebuild an output of type {kind.__name__}")


def _export_in_other_mode(
    model: nn.Module, gm: fx.GraphModule, names: Mapping[str, Any], spec: Any, dim: int, injected: frozenset[str],
    positional: Sequence[str] = (),
) -> fx.GraphModule | None:
    """The program exported in the other mode, where forward may read ``self.training`` beyond
    the modules the program calls (which read their own mode at run time); else None."""
    if not reads_mode(model, gm):
        return None
    from torch.export import export

    modes = {m: m.training for m in model.modules()}
    try:
        model.train(not model.training)
        decided = False
        try:
            with export_as_eager_runs(model, positional), warnings.catch_warnings(), python_state_kept(model), \
                    seeds_recorded() as effects, inference_mode_as_no_grad():  # fmt: skip
                warnings.simplefilter("ignore")
                other = export(model, (), dict(names), dynamic_shapes=spec, strict=False).module()
            if effects:  # a seed, a numpy draw, a Function this mode's program would not replay
                raise SideEffectRefused(f"forward in the other mode {effects[0]}")
        except Exception as exc:  # noqa: BLE001 - a branch on data may be decided on the examples, as in the first mode
            ep = _export_deciding_on_examples(model, names, spec, positional) if _is_data_dependent(exc) else None
            if ep is None:
                raise
            other, decided = ep.module(), True
        other_gm, _ = _program(model, other, names, dim, injected, keep_data_checks=decided)
    except Exception as exc:  # noqa: BLE001 - it cannot serve the other mode: check the mode
        log.debug("export in the other mode failed (%s)", exc)
        return gm  # compared with itself: nothing to merge, so the mode is checked
    finally:
        for m, training in modes.items():
            m.training = training
    return other_gm
