"""Tensor parallelism: ``transform(model, devices, tensor_parallel=True | {path: style})``.

:func:`transform_tensor_parallel` copies the model (the user's is never touched), captures
it, chooses or checks the plan, runs ``passes.tp_pipeline.tensor_parallel_pipeline``
(``shard_linear`` then ``expand_shards``) and returns a :class:`TensorParallelModule`
that owns the shards.

>>> import torch, dpcompile
>>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
>>> pm = dpcompile.transform(mlp, ["cpu", "cpu"], tensor_parallel=True, example_inputs=(torch.randn(4, 8),))
>>> pm.plan
{'0': 'column', '2': 'row'}
>>> torch.allclose(pm(torch.ones(3, 8)), mlp(torch.ones(3, 8)), atol=1e-6)
True

The automatic plan (``tensor_parallel=True``) gives every ``nn.Linear`` whose shapes allow
it a ``column`` or ``row`` style, choosing, group by group of interacting layers (see
:func:`dpcompile.analysis.graph_view.linear_groups`), the assignment with the fewest
elements sent per device (:func:`dpcompile.analysis.cost.plan_cost` over the collectives
``shard_linear`` would insert). With ``example_inputs=`` the sizes are exact; without, a
tensor is costed by its features per token.
"""

from __future__ import annotations

import copy
import itertools
import logging
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from dpcompile.analysis.cost import CommCost, plan_cost
from dpcompile.capture import capture
from dpcompile.devices import parse_device, parse_devices
from dpcompile.infra import run_passes
from dpcompile.module import ParallelModule, adopt_state
from dpcompile.runtime.tensor_parallel import ShardSpec, shard_of, unshard

log = logging.getLogger("dpcompile")

_UNSHARDED_PENALTY = 1e15  # the automatic plan shards every layer it can before it saves elements


class TensorParallelModule(ParallelModule):
    """A tensor-parallel program. Build it with ``dpcompile.transform(..., tensor_parallel=...)``.

    * ``pm.plan``: ``{module path: "column" | "row" | "replicate"}`` as applied;
      ``pm.plan_reasons``: ``{module path: why}``.
    * ``pm.parameters()``: the shards (``fc1.weight_shard1`` on ``devices[1]``) and the
      replicated rest (on ``devices[0]``).
    * ``pm.param_shards``: ``{"fc1.weight": (ShardSpec(0, (5, 5)), ["fc1.weight_shard0", ...])}``.
    * ``pm.shard_param_slots``: ``{parameter name in pm: shard slot k, or None}``; None means
      replicated, i.e. held by every shard in SPMD form (here, once on ``devices[0]``). It is
      how ``explain`` attributes bytes to virtual devices that are all ``'cpu'``.
    * ``pm.comm_cost``: the plan's :class:`~dpcompile.analysis.cost.CommCost` per device.
    * ``state_dict()`` has the original model's keys with full tensors; ``load_state_dict``
      re-shards.
    """

    plan_reasons: dict[str, str]
    param_shards: dict[str, tuple[ShardSpec, list[str]]]
    shard_param_slots: dict[str, int | None]

    def _init_tensor_parallel(
        self,
        *,
        state_keys: Sequence[str],
        param_shards: Mapping[str, tuple[ShardSpec, list[str]]],
        plan_reasons: Mapping[str, str],
        comm_cost: CommCost | None,
    ) -> None:
        self._state_keys = list(state_keys)
        self.param_shards = {k: (spec, list(names)) for k, (spec, names) in param_shards.items()}
        self.plan_reasons = dict(plan_reasons)
        self.comm_cost = comm_cost
        slot_of = {name: k for _, names in self.param_shards.values() for k, name in enumerate(names)}
        self.shard_param_slots = {name: slot_of.get(name) for name, _ in self.named_parameters()}

    # ------------------------------------------------------------------ variants
    def _attach_source(
        self, model: nn.Module | None, leaf_modules: tuple[type[nn.Module], ...], captured_code: str = ""
    ) -> None:
        """Keep a fake-tensor copy of ``model`` (no memory) to trace again for a call that takes
        another path through forward: an optional argument left None, or the other mode."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        from dpcompile.verify import _fake_copy

        source = None
        if model is not None and type(model).forward is not nn.Module.forward and not isinstance(model, fx.GraphModule):
            try:
                source = _fake_copy(model, FakeTensorMode(allow_non_fake_inputs=True), self.devices.primary)
            except Exception as e:  # noqa: BLE001 - variants are a refinement; the main program stands
                log.debug("no fake copy of the model for variants (%s)", e)
        object.__setattr__(self, "_tp_source", source)
        self._tp_leaf_modules = leaf_modules
        self._tp_traced_training = model is not None and model.training
        self._tp_captured_code = captured_code  # the trace the program was made from
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self._tp_optional = [(i, str(n.target)) for i, n in enumerate(placeholders) if n.args and n.args[0] is None]
        self._tp_variants: dict[tuple[bool, frozenset[str]], fx.GraphModule | None] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        program = self.program_for_call(args, kwargs)
        if program is not self:
            return program(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def program_for_call(self, args: tuple, kwargs: dict) -> fx.GraphModule:
        """The program a call with these arguments runs: ``self``, or the variant traced for it."""
        source = self.__dict__.get("_tp_source")
        if source is not None:
            nones = frozenset(
                name for i, name in self._tp_optional if (args[i] if i < len(args) else kwargs.get(name)) is None
            )
            if nones or self.training != self._tp_traced_training:
                program = self._variant_program((self.training, nones), args, kwargs)
                if program is not None:
                    return program
        return self

    def _variant_program(self, variant: tuple[bool, frozenset[str]], args: tuple, kwargs: dict) -> fx.GraphModule | None:
        """The program for a call in mode ``variant[0]`` with ``variant[1]`` left None, built on
        the fake copy with this module's plan and run on its shards; None where it is the same."""
        if variant not in self._tp_variants:
            from torch._subclasses.fake_tensor import FakeTensorMode
            from torch.utils._pytree import tree_map

            from dpcompile.errors import DpCompileError
            from dpcompile.inspect import _bind_inputs
            from dpcompile.module import copy_graph
            from dpcompile.verify import _FakeCudaOnCpuTorch

            source = self.__dict__["_tp_source"]
            source.train(variant[0])
            if capture(source, leaf_modules=self._tp_leaf_modules, none_args=variant[1]).code == self._tp_captured_code:
                self._tp_variants[variant] = None  # forward takes the same path: the main program (cheap check)
                return None
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            values = _bind_inputs(self, args, kwargs)
            with mode, _FakeCudaOnCpuTorch(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
                example = tree_map(
                    lambda v: mode.from_tensor(v.detach()).to(self.devices.primary) if isinstance(v, torch.Tensor) else v, values
                )
                built = transform_tensor_parallel(
                    source, self.devices, plan=self.plan, example_inputs=example, output_device=self.output_device,
                    leaf_modules=self._tp_leaf_modules, check_available=False, none_args=variant[1],
                )  # fmt: skip
            if built.param_shards != self.param_shards:
                raise DpCompileError(
                    f"the call with {sorted(variant[1]) or 'no'} optional argument(s) None in "
                    f"{'training' if variant[0] else 'eval'} mode takes another path through forward, whose "
                    "layers shard differently; transform the model for that call (example_inputs= of it)"
                )
            same = built.code == self.code
            program = None if same else fx.GraphModule(self, copy_graph(built.graph), "TensorParallelVariant")
            self._tp_variants[variant] = program
        program = self._tp_variants[variant]
        if program is not None:
            program.training = self.training
        return program

    def param_bytes_per_slot(self) -> dict[int, int]:
        """Bytes of parameters each shard slot holds: its shards plus the replicated rest."""
        n = len(self.devices)
        out = dict.fromkeys(range(n), 0)
        for name, p in self.named_parameters():
            size = p.numel() * p.element_size()
            slot = self.shard_param_slots.get(name)
            for k in range(n) if slot is None else (slot,):
                out[k] += size
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The original model's keys, each holding the full (gathered) tensor."""
        if args:  # the positional form nn.Module still accepts
            destination = args[0]
        own = super().state_dict(keep_vars=keep_vars)
        if destination is None:
            destination = OrderedDict()
        for key in self._state_keys:
            if key in self.param_shards:
                spec, names = self.param_shards[key]
                value = unshard([own[name] for name in names], spec, self.devices.primary)
                destination[prefix + key] = value if keep_vars else value.detach()
            elif key in own:
                destination[prefix + key] = own[key]
        return destination

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load full tensors under the original keys, cutting the shards out of them."""
        keys = set(self._state_keys)
        missing = [k for k in self._state_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in keys]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self).__name__}: missing keys {missing}, "
                f"unexpected keys {unexpected}"
            )
        own = super().state_dict(keep_vars=True)
        with torch.no_grad():
            for key in self._state_keys:
                if key not in state_dict:
                    continue
                value = state_dict[key]
                if key in self.param_shards:
                    spec, names = self.param_shards[key]
                    expected = sum(spec.sizes)
                    if value.dim() <= spec.dim or value.size(spec.dim) != expected:
                        raise RuntimeError(
                            f"size mismatch for {key}: got {tuple(value.shape)}, the sharded parameter has "
                            f"{expected} along dim {spec.dim} (shards {list(spec.sizes)})"
                        )
                    for k, name in enumerate(names):
                        own[name].copy_(shard_of(value, spec, k))
                elif key in own:
                    if own[key].shape != value.shape:
                        raise RuntimeError(f"size mismatch for {key}: got {tuple(value.shape)}, expected {tuple(own[key].shape)}")
                    own[key].copy_(value)
        return _IncompatibleKeys(missing, unexpected)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:  # fmt: skip
        """``parent.load_state_dict(...)`` of a module holding ``pm``: cut each full tensor under
        its original key into the shard keys the submodules load, before they load."""
        for key, (spec, names) in self.param_shards.items():
            value = state_dict.get(prefix + key)
            if not isinstance(value, torch.Tensor):
                continue
            del state_dict[prefix + key]
            if value.dim() <= spec.dim or value.size(spec.dim) != sum(spec.sizes):
                error_msgs.append(
                    f"size mismatch for {prefix + key}: got {tuple(value.shape)}, the sharded parameter has "
                    f"{sum(spec.sizes)} along dim {spec.dim} (shards {list(spec.sizes)})"
                )
                continue
            for k, name in enumerate(names):
                state_dict[prefix + name] = shard_of(value, spec, k)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    # ------------------------------------------------------------------ pickling
    def _extra_state_for_pickle(self) -> dict[str, Any]:
        return {
            "state_keys": self._state_keys,
            "param_shards": self.param_shards,
            "plan_reasons": self.plan_reasons,
            "comm_cost": self.comm_cost,
        }

    def _restore_extra_state(self, extra: dict[str, Any]) -> None:
        self._init_tensor_parallel(
            state_keys=extra["state_keys"],
            param_shards=extra["param_shards"],
            plan_reasons=extra["plan_reasons"],
            comm_cost=extra["comm_cost"],
        )


# ---------------------------------------------------------------------- transform
def transform_tensor_parallel(
    model: nn.Module,
    devices: Any,
    *,
    plan: bool | Mapping[str, str],
    example_inputs: Sequence[Any] | None = None,
    output_device: Any = None,
    leaf_modules: Iterable[type[nn.Module]] = (),
    check_available: bool = True,
    none_args: Iterable[str] = (),
) -> TensorParallelModule:
    """Shard ``model``'s ``nn.Linear`` layers over ``devices`` by ``plan`` (True: automatic).

    ``check_available=False`` lets device lists name devices this machine lacks (fake
    ``cuda:0..7`` tensors under ``FakeTensorMode`` check a program's placement).
    """
    import passes
    from dpcompile.analysis.sharding import check_plan, find_linear_sites, linear_paths
    from dpcompile.api import propagate_shapes
    from passes import tensor_parallel_pipeline

    devices = parse_devices(devices, check_available=check_available)
    if output_device is None:
        out_device = devices.primary
    elif check_available:
        out_device = parse_device(output_device)
    else:
        out_device = torch.device(output_device)
    state_keys = list(model.state_dict().keys())
    owned = copy.deepcopy(model)  # the user's model is never touched
    gm = _capture_owning_everything(owned, leaf_modules, none_args)
    captured_code = gm.code
    if example_inputs is not None:
        if not isinstance(example_inputs, (tuple, list)):
            example_inputs = (example_inputs,)
        propagate_shapes(gm, list(example_inputs))
    sites = find_linear_sites(gm)
    reasons: dict[str, str] = {}
    if plan is True:
        styles, reasons = choose_plan(gm, len(devices))
    elif isinstance(plan, Mapping):
        check_plan(model, plan, extra_linears=sites)
        styles = {}
        for path, style in plan.items():
            if path not in sites and style != "replicate":
                reasons[path] = f"'{path}' is not called in forward (or only inside a leaf module); it stays whole"
                continue
            styles[path] = style
    else:
        raise ValueError(f"tensor_parallel={plan!r}: expected False, True (automatic plan) or a dict {{path: style}}")
    options = passes.PipelineOptions(devices=devices, output_device=out_device, extra={"plan": styles})
    gm, records = run_passes(gm, passes.frontend_pipeline(options) + tensor_parallel_pipeline(options))
    shard_info = next(r.info for r in records if r.name == "shard_linear")
    expand_info = next(r.info for r in records if r.name == "expand_shards")
    applied = {path: "replicate" for path in linear_paths(model)}
    applied.update(shard_info["plan"])
    described = _describe_choices(applied, shard_info)
    reasons = {p: f"{described[p]} ({reasons[p]})" if p in reasons and p in described else reasons.get(p, described.get(p, "")) for p in {**described, **reasons}}
    reasons.update({p: f"replicate: {why}" for p, why in shard_info["reasons"].items()})
    cost = plan_cost(shard_info["comms"], len(devices))
    pm = TensorParallelModule(
        gm,
        gm.graph,
        devices=devices,
        mode="tensor_parallel",
        output_device=out_device,
        plan=applied,
        records=records,
        class_name=type(model).__name__,
        share_all_of=gm,
    )
    pm._init_tensor_parallel(
        state_keys=state_keys, param_shards=expand_info["param_shards"], plan_reasons=reasons, comm_cost=cost
    )
    pm._attach_source(model if check_available else None, tuple(leaf_modules), captured_code)  # not for a fake layout check
    pm.train(model.training)
    log.debug("tensor-parallel plan %s: %s per device", applied, cost)
    return pm


def _capture_owning_everything(
    owned: nn.Module, leaf_modules: Iterable[type[nn.Module]], none_args: Iterable[str] = ()
) -> fx.GraphModule:
    """Capture ``owned`` and give the GraphModule all its state, used in forward or not.

    ``fx.GraphModule`` keeps only what the graph reads (with empty stand-ins for the modules
    on the way); the state dict must keep every key, and passes must replace modules in the
    real hierarchy.
    """
    gm = capture(owned, leaf_modules=leaf_modules, none_args=none_args)
    if isinstance(owned, fx.GraphModule) or not list(owned.children()) and not owned._parameters and not owned._buffers:
        return gm
    adopt_state(gm, owned)
    gm.train(owned.training)
    return gm


def _describe_choices(applied: Mapping[str, str], info: Mapping[str, Any]) -> dict[str, str]:
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
        else:
            out[path] = "replicate: left whole"
    return out


# ---------------------------------------------------------------------- automatic plan
def plan_total(gm: fx.GraphModule, styles: Mapping[str, str], n: int) -> tuple[float, dict[str, str], dict[str, str]]:
    """What a plan costs once ``shard_linear`` has checked it: (score, styles applied, reasons).

    The score is the elements per device (forward + backward), plus a large penalty for each
    layer the plan wanted sharded that had to stay whole.
    """
    from dpcompile.analysis.sharding import resolve_plan

    resolved = resolve_plan(gm, plan=styles, n=n, strict=False)
    demoted = sum(1 for p, s in styles.items() if s != "replicate" and resolved.styles.get(p) == "replicate")
    total = plan_cost(resolved.analysis.comms, n).total
    return total + demoted * _UNSHARDED_PENALTY, resolved.styles, resolved.reasons


def choose_plan(gm: fx.GraphModule, n: int, *, exhaustive_limit: int = 256) -> tuple[dict[str, str], dict[str, str]]:
    """The automatic plan: ``(styles, reasons)`` minimising the cost model's total.

    Each group of interacting layers is searched exhaustively (up to ``exhaustive_limit``
    assignments), larger groups by coordinate descent from the Megatron pairing (column for
    a layer that feeds another through transparent ops, row for the one it feeds).
    """
    from dpcompile.analysis.graph_view import find_linear_chains, linear_groups
    from dpcompile.analysis.sharding import check_divisible, find_linear_sites, is_shard_transparent

    sites = find_linear_sites(gm)
    modules = dict(gm.named_modules())
    reasons: dict[str, str] = {}
    options: dict[str, list[str]] = {}
    for path, site in sites.items():
        allowed = [] if site.blocker else [s for s in ("column", "row") if check_divisible(site, s, n) is None]
        if allowed:
            options[path] = allowed
        else:
            reasons[path] = site.blocker or f"{check_divisible(site, 'column', n)}, nor its in_features({site.in_features})"
    by_name = {site.node.name: path for path, site in sites.items() if path in options}
    nodes = {sites[path].node for path in options}

    def transparent(node: fx.Node) -> bool:
        return is_shard_transparent(node, modules)

    styles: dict[str, str] = {path: opts[-1] if len(opts) == 1 else "row" for path, opts in options.items()}
    chains = find_linear_chains(gm, nodes, transparent)
    for a, _ in chains:
        if "column" in options[by_name[a]]:
            styles[by_name[a]] = "column"
    for a, b in chains:
        if styles[by_name[a]] == "column" and "row" in options[by_name[b]]:
            styles[by_name[b]] = "row"
    for group in linear_groups(gm, nodes, transparent):
        paths = [by_name[name] for name in group]
        combos = 1
        for p in paths:
            combos *= len(options[p])
        if combos <= exhaustive_limit:
            best = None
            for choice in itertools.product(*(options[p] for p in paths)):
                trial = {**styles, **dict(zip(paths, choice))}
                score = plan_total(gm, trial, n)[0]
                if best is None or score < best[0]:
                    best = (score, choice)
            assert best is not None
            styles.update(zip(paths, best[1]))
            for p in paths:
                reasons[p] = f"auto: cheapest of {combos} assignments of its group of {len(paths)}"
        else:
            styles = _descend(gm, styles, paths, options, n)
            for p in paths:
                reasons[p] = f"auto: coordinate descent over its group of {len(paths)}"
    score, applied, why = plan_total(gm, styles, n)
    reasons.update(why)
    log.debug("automatic plan %s costs %s elements per device", applied, score)
    return {p: s for p, s in applied.items() if p in sites}, reasons


def _descend(gm: fx.GraphModule, styles: dict[str, str], paths: list[str], options: Mapping[str, list[str]], n: int) -> dict[str, str]:
    best = plan_total(gm, styles, n)[0]
    for _ in range(3):
        improved = False
        for p in paths:
            for s in options[p]:
                if s == styles[p]:
                    continue
                trial = {**styles, p: s}
                score = plan_total(gm, trial, n)[0]
                if score < best:
                    best, styles, improved = score, trial, True
        if not improved:
            break
    return styles


__all__ = ["TensorParallelModule", "choose_plan", "plan_total", "transform_tensor_parallel"]
