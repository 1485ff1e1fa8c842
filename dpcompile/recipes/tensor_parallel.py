"""Tensor parallelism in one process: ``transform(model, devices, tensor_parallel=True | {path: style})``.

    owned = copy.deepcopy(model)                        # the user's model is never touched
    gm = capture(owned)                                 # owning all its state
    styles, reasons = plan_for(gm, plan, n, model)      # automatic, or the user's plan checked
    gm = frontend_pipeline + tensor_parallel_pipeline   # shard_linear, then expand_shards
    ParallelModule(gm, ...) + hold_shards(pm, ...)      # owns the shards

>>> import torch, dpcompile
>>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
>>> pm = dpcompile.transform(mlp, ["cpu", "cpu"], tensor_parallel=True, example_inputs=(torch.randn(4, 8),))
>>> pm.plan
{'0': 'column', '2': 'row'}
>>> torch.allclose(pm(torch.ones(3, 8)), mlp(torch.ones(3, 8)), atol=1e-6)
True

A call that departs from the first one (the other mode, an optional argument left None)
runs a program traced on a fake-tensor copy of the model (no memory) with ``pm``'s plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_map

import passes
from dpcompile.analysis.cost import plan_cost
from dpcompile.analysis.sharding import embedding_paths, linear_like_leaves, linear_paths
from dpcompile.capture import EXPORTED_FROM, capture
from dpcompile.devices import Devices
from dpcompile.errors import DpCompileError
from dpcompile.fake import FakeCudaOnCpuTorch, fake_copy, fake_copy_to_trace, is_fake
from dpcompile.fx_utils import adopt_state, alias_of, bind_inputs, copy_graph, graph_module, propagate_shapes, unalias
from dpcompile.infra import info_of, run_passes
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.carried import modes_applied
from dpcompile.modules.other_mode import swap_graph
from dpcompile.modules.sharded_state import hold_shards
from dpcompile.modules.tensor_parallel import watch_source_parameters
from dpcompile.planning import plan_for, why_whole
from dpcompile.program_cache import CallKey
from dpcompile.recipes.base import Recipe, capture_with_flags
from dpcompile.recipes.constants import RealConstants, deepcopy_on_fake

log = logging.getLogger("dpcompile")


@dataclass(frozen=True)
class TensorParallelRecipe(Recipe):
    """Shards of every planned ``nn.Linear`` over ``devices``; ``plan``: True (automatic) or
    ``{path: "column" | "row" | "replicate"}``. ``check_available=False`` lets ``devices``
    name devices this machine lacks (fake ``cuda:0..7`` programs for placement checks)."""

    devices: Devices = Devices((torch.device("cpu"),))
    output_device: torch.device = torch.device("cpu")
    plan: bool | Mapping[str, str] = True
    check_available: bool = True
    sequence_parallel: bool = False  # activations between the pairs on sequence shards (passes.shard_sequence)

    strategy: ClassVar[str] = "tensor_parallel"

    def compile(
        self,
        model: nn.Module,
        example_inputs: Sequence[Any] | None,
        *,
        none_args: frozenset[str] = frozenset(),
        flags: Mapping[str, Any] | None = None,
    ) -> ParallelModule:
        """``none_args``/``flags``: trace those arguments as None / as these values (a program for
        a call that departs from the first one); by default flags forward branches on are traced
        as the example's (else their default) values."""
        state_keys = list(model.state_dict().keys())
        state_aliases = tied_state_keys(model)
        ties = tied_groups(model)
        gm, flags, none_args, kept_whole = capture_to_shard(model, self.leaf_modules, example_inputs, none_args, flags)
        captured_code = gm.code  # after decompose_attention: its dropout_p follows the mode
        if example_inputs is not None:
            propagate_shapes(gm, list(example_inputs), check=True)
        styles, reasons = plan_for(gm, aliased_plan(self.plan), len(self.devices), model)
        reasons = {unalias(p): why for p, why in reasons.items()}
        whole = {p: why_whole(gm, p) for p in [*linear_paths(model), *embedding_paths(model)]}  # before the rewrite
        reasons.update({p: f"kept whole: {why}" for p, why in kept_whole.items()})
        if self.sequence_parallel and example_inputs is None:
            raise DpCompileError(
                "sequence_parallel=True finds the sequence dim from the example's shapes: pass example_inputs= "
                "(or example_kwargs=)"
            )
        options = passes.PipelineOptions(
            devices=self.devices, output_device=self.output_device, plan=styles, exact_random=self.exact_random,
            sequence_parallel=self.sequence_parallel,
        )
        lowering = passes.tensor_parallel_pipeline(options) + passes.checkpoint_pipeline(self.checkpointed, self.checkpoint_save)
        gm, records = run_passes(gm, passes.frontend_pipeline(options) + lowering)
        shard_info = unaliased_findings(info_of(records, "shard_linear"))
        expand_info = info_of(records, "expand_shards")
        expand_info = {**expand_info, "param_shards": share_tied_shards(gm, ties, expand_info["param_shards"])}
        applied = {path: "replicate" for path in [*linear_paths(model), *embedding_paths(model)]}
        applied.update(shard_info["plan"])
        windowed = {}  # torchvision Swin: qkv / proj sharded by heads inside the window-attention call
        for p, style in shard_info["plan"].items():
            if style == "column" and f"{p}.qkv.weight" in expand_info["param_shards"] and applied.get(f"{p}.qkv") == "replicate":
                windowed[f"{p}.qkv"], windowed[f"{p}.proj"] = "column", "row"
                windowed[p] = "column"
        applied.update(windowed)
        described = describe_choices(applied, shard_info)
        for p, style in windowed.items():
            owner = p.rpartition(".")[0] if p.endswith((".qkv", ".proj")) else p
            described[p] = (
                f"{style}: sharded by heads inside '{owner}' (torchvision's shifted_window_attention, run on each "
                "shard with its heads); the projection's partial sums all-reduced"
            )
        reasons = {
            p: f"{described[p]} ({reasons[p]})" if p in reasons and p in described and not reasons[p].startswith("replicate:")
            else reasons.get(p, described.get(p, ""))
            for p in {**described, **reasons}
        }  # fmt: skip
        reasons.update({p: f"replicate: {why}" for p, why in shard_info["reasons"].items()})
        for p, style in applied.items():
            if style == "replicate" and reasons.get(p, "replicate: left whole") == "replicate: left whole":
                reasons[p] = "replicate: " + whole.get(p, "left whole")
        sequence_info = info_of(records, "shard_sequence")
        for p in sequence_info.get("reduce_scattered", ()):
            if unalias(p) in reasons:
                reasons[unalias(p)] += "; sequence parallel: reduce-scattered on the sequence instead"
        for p, why in sequence_info.get("all_reduces", {}).items():
            if unalias(p) in reasons:  # a row layer the sequence region stops before: tensor parallel alone there
                reasons[unalias(p)] += f"; not on sequence shards: {why}"
        cost = plan_cost(shard_info["comms"], len(self.devices))
        fake_source = fake_copy_to_trace(model, self.devices.primary) if self.check_available else None  # not for a fake layout check
        gm.train(model.training)  # the modules the passes made too, before the main program is keyed by their modes
        pm = ParallelModule(
            gm,
            gm.graph,
            recipe=self,
            devices=self.devices,
            mode="tensor_parallel",
            output_device=self.output_device,
            plan=applied,
            records=records,
            class_name=type(model).__name__,
            share_all_of=gm,
            source=fake_source,
            none_args=none_args,
            flags=flags,
            shares_source=False,
            # the model a torch.export capture came from: calls are checked against what export fixed
            exported_from=model.meta.get(EXPORTED_FROM) if isinstance(model, fx.GraphModule) else None,
        )
        hold_shards(
            pm,
            state_keys=state_keys,
            param_shards=expand_info["param_shards"],
            plan_reasons=reasons,
            comm_cost=cost,
            captured_code=captured_code,
            state_aliases=state_aliases,
        )
        pm.train(model.training)
        if self.check_available:  # the user's model (not a fake copy for a variant)
            watch_source_parameters(model)  # an optimizer over model.parameters() would train nothing: make it loud
        log.debug("tensor-parallel plan %s: %s per device", applied, cost)
        return pm

    def fake_layout_fields(self, pm: ParallelModule) -> dict[str, Any]:
        return {"plan": dict(pm.plan) or True, "check_available": False}

    @property
    def completes_other_mode(self) -> bool:  # type: ignore[override]
        return self.check_available  # a program with a fake copy to build on (not a fake layout check's)

    def complete_other_mode(self, pm: ParallelModule, merged: fx.GraphModule, examples: Sequence[Any] | None) -> Any:
        """The main program built again from ``merged`` on a fake copy with ``pm``'s plan (as a call in
        another mode builds its own, :meth:`build_program`), to run on ``pm``'s shards."""
        source = fake_copy(merged, FakeTensorMode(allow_non_fake_inputs=True), self.devices.primary)
        key = pm.program_cache.main_key
        built = self._built_on_fake(pm, source, key, tuple(examples or ()), {})
        constants = _constants_of_the_call(pm, built, capture(merged))
        return functools.partial(swap_graph, pm, copy_graph(built.graph), constants)

    def build_program(self, pm: ParallelModule, key: CallKey, args: tuple, kwargs: dict) -> fx.GraphModule | None:
        """The program for a call in another mode or with other arguments left None, built on
        the fake copy with ``pm``'s plan and run on its shards; None where it is the same."""
        source = pm.traced_model
        if source is None:
            raise pm.cannot_trace_again(key)
        with modes_applied(source, key.modes):
            leaves = self.leaf_modules + linear_like_leaves()
            traced = capture(source, leaf_modules=leaves, none_args=key.none_args, flags=dict(key.flags) or None)
            if passes.decompose_attention(traced).modified:  # as compile does: the attention dropout follows the mode
                traced.recompile()
            if traced.code == pm.captured_code:
                return None  # forward takes the same path: the main program (a cheap check)
            built = self._built_on_fake(pm, source, key, args, kwargs)
        if built.code == pm.code:
            return None
        constants = _constants_of_the_call(pm, built, traced)
        return graph_module(pm, copy_graph(built.graph), "TensorParallelVariant", constants)

    def _built_on_fake(self, pm: ParallelModule, source: nn.Module, key: CallKey, args: tuple, kwargs: dict) -> ParallelModule:
        """``source`` (a fake copy) compiled with ``pm``'s plan for a call as ``key``; refused where its layers
        shard otherwise than ``pm``'s."""
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        values = bind_inputs(pm, args, kwargs) if args or kwargs else None
        with mode, FakeCudaOnCpuTorch(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
            example = None if values is None else tree_map(
                lambda v: mode.from_tensor(v.detach()).to(self.devices.primary) if isinstance(v, torch.Tensor) else v,
                values,
            )  # fmt: skip
            # what pm shards; a layer kept whole stays whole unnamed (in an exported source it is no Linear,
            # Embedding or MultiheadAttention, so a plan naming it would be refused)
            sharded = {path: style for path, style in pm.plan.items() if style != "replicate"}
            variant = dataclasses.replace(self, plan=sharded, check_available=False)
            built = variant.compile(source, example, none_args=key.none_args, flags=dict(key.flags))
            held = pm.__dict__.get("_tp_param_shards", pm.param_shards)  # FSDP's pieces: of these shards
            if built.param_shards != held and example is not None:
                # pm built without examples: a layer the call's shapes would shard otherwise (an nn.MultiheadAttention
                # with batch_first=False split by heads) is built as pm was, without them
                built = variant.compile(source, None, none_args=key.none_args, flags=dict(key.flags))
        if built.param_shards != held:
            raise DpCompileError(
                f"the call ({key.describe()}) takes another path through forward, whose layers shard "
                "differently; transform the model for that call (example_inputs= of it)"
            )
        return built


def _constants_of_the_call(pm: nn.Module, built: fx.GraphModule, traced: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Tensors made in forward that the call's program reads: the call's trace numbers them anew
    (a mask path's ``_tensor_constant0`` makes ``torch.tensor(3)`` ``_tensor_constant1``), so
    each is the call's own value, never ``pm``'s of the same name. One made under the fake mode
    takes its value from the plain trace."""
    constants = {}
    for node in built.graph.nodes:
        if node.op != "get_attr" or not node.target.startswith("_tensor_constant"):
            continue
        value = _attribute(built, node.target)
        if isinstance(value, FakeTensor):
            plain = _attribute(traced, node.target)
            value = plain.to(value.device) if isinstance(plain, torch.Tensor) and plain.shape == value.shape else None
        if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor):
            raise DpCompileError(
                f"the call's program reads {node.target!r}, a tensor made in forward whose value its trace does not "
                "hold; transform the model for that call (example_inputs= of it)"
            )
        constants[node.target] = value.detach()
    return constants


def _attribute(module: nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def capture_to_shard(
    model: nn.Module,
    leaf_modules: tuple[type[nn.Module], ...],
    example_inputs: Sequence[Any] | None,
    none_args: frozenset[str],
    flags: Mapping[str, Any] | None,
) -> tuple[fx.GraphModule, dict[str, Any], frozenset[str], dict[str, str]]:
    """A copy of ``model`` (the user's is never touched; an exported one may hold real constants)
    captured owning all its state (:func:`capture_owning_everything`), Conv1D-like layers kept as
    calls (sharded as Linears), ``nn.MultiheadAttention`` written out so heads can be sharded.
    Returns the graph, its flags, the arguments traced as None and ``{attention path: why kept whole}``."""
    owned = deepcopy_on_fake(model)
    on_fake = any(is_fake(t) for t in (*owned.parameters(), *owned.buffers()))  # a meta model's fake copy
    with RealConstants() if on_fake else contextlib.nullcontext():  # `torch.tensor([...])` in forward: a real constant
        gm, flags, none_args = capture_owning_everything(
            owned, leaf_modules + linear_like_leaves(), example_inputs, none_args, flags
        )
    attention = passes.decompose_attention(gm)
    if attention.modified:
        gm.recompile()
    return gm, flags, none_args, attention.info["kept"]


def capture_owning_everything(
    owned: nn.Module,
    leaf_modules: tuple[type[nn.Module], ...],
    example_inputs: Sequence[Any] | None,
    none_args: frozenset[str],
    flags: Mapping[str, Any] | None,
) -> tuple[fx.GraphModule, dict[str, Any], frozenset[str]]:
    """Capture ``owned`` and give the GraphModule all its state, used in forward or not;
    return it with the flags and the optional arguments left None it was traced for.

    ``fx.GraphModule`` keeps only what the graph reads (with empty stand-ins for the modules
    on the way); the state dict must keep every key, and passes must replace modules in the
    real hierarchy.
    """
    if flags is None and not none_args:
        gm, flags, none_args = capture_with_flags(owned, leaf_modules, example_inputs)
    else:
        gm = capture(owned, leaf_modules=leaf_modules, none_args=none_args, flags=dict(flags or {}) or None)
    if not list(owned.children()) and not owned._parameters and not owned._buffers:
        return gm, dict(flags or {}), frozenset(none_args)
    adopt_state(gm, owned, aliased=True)  # the model's `graph` or `meta` is not the GraphModule's
    gm.train(owned.training)
    return gm, dict(flags or {}), frozenset(none_args)


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The model's state keys that name one tensor, in groups of two or more (each in state order)."""
    by_tensor: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(value), []).append(key)
    return [keys for keys in by_tensor.values() if len(keys) > 1]


def tied_state_keys(model: nn.Module) -> dict[str, str]:
    """``{key: another key of the same tensor}`` for every tied state key (the program may lack
    the module of one of them: T5's ``shared`` is never called)."""
    return {key: group[1] if key == group[0] else group[0] for group in tied_groups(model) for key in group}


def share_tied_shards(
    gm: fx.GraphModule, groups: Sequence[Sequence[str]], param_shards: Mapping[str, tuple[Any, list[str]]]
) -> dict[str, tuple[Any, list[str]]]:
    """``param_shards`` with every key tied to a sharded parameter naming the same shards.

    Where forward never reads another name of a sharded parameter (an unused head, the second
    name of a tied bias; :func:`~dpcompile.analysis.linear_sites.find_linear_sites` keeps a
    layer whole where forward reads a shared weight), its module's stale full copy is dropped
    (set to None: the program holds one parameter) and the key reads and loads the shards.
    """
    out = dict(param_shards)
    read = {n.target for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
    for keys in groups:
        sharded = next((alias_of(k) for k in keys if alias_of(k) in param_shards), None)
        if sharded is None:
            continue
        for key in map(alias_of, keys):
            if key in out:
                continue
            path, _, name = key.rpartition(".")
            if key in read or any(key.startswith(f"{m}.") for m in read if isinstance(m, str)):
                continue  # forward reads it whole (a bias shared with a layer split otherwise): left as it is
            owner = gm.get_submodule(path) if path else gm
            if name in owner._parameters:
                owner._parameters[name] = None
            out[key] = param_shards[sharded]
    return out


def share_tied_shard(
    own: nn.Module, gm: fx.GraphModule, groups: Sequence[Sequence[str]], specs: Mapping[str, Any]
) -> dict[str, Any]:
    """Over a mesh: ``specs`` (``{key: ShardSpec}``) with every key tied to a sharded parameter
    that ``gm``'s forward never reads holding this rank's same shard (one parameter, as in one
    process :func:`share_tied_shards`)."""
    out = dict(specs)
    read = {unalias(n.target) for n in gm.graph.nodes if n.op in ("get_attr", "call_module") and isinstance(n.target, str)}
    for keys in groups:
        sharded = next((k for k in keys if k in specs), None)
        if sharded is None:
            continue
        shard = own.get_parameter(sharded)
        for key in keys:
            if key not in out and not (key in read or any(key.startswith(f"{m}.") for m in read)):
                path, _, name = key.rpartition(".")
                owner = own.get_submodule(path) if path else own
                if name in owner._parameters:
                    owner._parameters[name] = shard
                    out[key] = specs[sharded]
    return out


def aliased_plan(plan: bool | Mapping[str, str]) -> bool | dict[str, str]:
    """A user's ``{path: style}`` in the paths of the captured graph (``devices`` → ``user:devices``)."""
    return {alias_of(path): style for path, style in plan.items()} if isinstance(plan, Mapping) else plan


def unaliased_findings(info: Mapping[str, Any]) -> dict[str, Any]:
    """``shard_linear``'s findings keyed by the model's paths (``user:devices`` → ``devices``)."""
    out = dict(info)
    for name in ("plan", "reasons", "gathered"):
        if isinstance(info.get(name), Mapping):
            out[name] = {unalias(path): value for path, value in info[name].items()}
    if isinstance(info.get("pairs"), Mapping):
        out["pairs"] = {unalias(row): frozenset(map(unalias, cols)) for row, cols in info["pairs"].items()}
    return out


def describe_choices(applied: Mapping[str, str], info: Mapping[str, Any]) -> dict[str, str]:
    """A reason for each layer's style, from what ``shard_linear`` found."""
    pairs: dict[str, frozenset[str]] = info.get("pairs", {})
    gathered: dict[str, list[str]] = info.get("gathered", {})
    feeds: dict[str, list[str]] = {}
    for row, columns in pairs.items():
        for column in columns:
            feeds.setdefault(column, []).append(row)
    out = {}
    for path, style in applied.items():
        if style == "column":
            parts = []
            if path in feeds:
                parts.append(f"stays sharded into row layer(s) {', '.join(map(repr, sorted(feeds[path])))} (no collective between)")
            if path in gathered:
                parts.append(f"all-gathered for {', '.join(sorted(set(gathered[path])))}")
            out[path] = "column: output " + ("; ".join(parts) if parts else "sharded")
        elif style == "row":
            if path in pairs:
                out[path] = f"row: takes the sharded output of {', '.join(map(repr, sorted(pairs[path])))}; partial sums all-reduced"
            else:
                out[path] = "row: replicated input split; partial sums all-reduced"
        elif style == "vocab":
            out[path] = "vocab: each shard holds a slice of the rows (masked lookup, one all-reduce)"
        else:
            out[path] = "replicate: left whole"
    return out
