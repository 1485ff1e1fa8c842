"""Tensor-parallel plans: the automatic choice and explicit plans, each resolved in one place.

* :func:`resolve_explicit_plan`: a user's ``{path: style}`` checked against the model, with a
  reason for each layer forward never calls;
* :func:`choose_plan`: the automatic plan (``tensor_parallel=True``) that minimises the
  elements each device sends (:func:`dpcompile.analysis.cost.plan_cost`);
* :func:`plan_for_memory`: ``memory_per_device=``: data parallel where a replica fits, else the
  tensor-parallel program, costed as built (on fake tensors) by explain's rule.

The automatic plan gives every ``nn.Linear`` whose shapes allow it a ``column`` or ``row``
style, choosing, group by group of interacting layers (see
:func:`dpcompile.analysis.graph_view.linear_groups`), the assignment with the fewest elements
sent per device. With ``example_inputs=`` the sizes are exact; without, a tensor is costed by
its features per token.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch.fx as fx
from torch import nn

from dpcompile.analysis.calibration import REFERENCE
from dpcompile.analysis.cost import plan_cost
from dpcompile.analysis.graph_view import find_linear_chains, linear_groups
from dpcompile.analysis.layout_costs import LayoutSpec
from dpcompile.analysis.memory import (
    KINDS,
    MemoryEstimate,
    activation_bytes,
    choose_strategy,
    format_budget_up,
    format_bytes,
    optimizer_bytes,
    parameter_kinds,
    parse_budget,
)
from dpcompile.analysis.model_profile import profile_model
from dpcompile.analysis.program_memory import held_parameter_bytes, program_memory
from dpcompile.analysis.sequence_costs import predict_layout
from dpcompile.analysis.sharding import (
    check_divisible,
    check_plan,
    embedding_paths,
    find_linear_sites,
    is_shard_transparent,
    linear_paths,
    resolve_plan,
)
from dpcompile.devices import parse_device, parse_devices
from dpcompile.errors import ArgumentError, DpCompileError
from dpcompile.mesh import is_device_mesh

log = logging.getLogger("dpcompile")

_UNSHARDED_PENALTY = 1e15  # the automatic plan shards every layer it can before it saves elements

NOT_CALLED = "'{path}' is not called in forward (or only inside a leaf module); it stays whole"


def why_whole(gm: fx.GraphModule, path: str) -> str:
    """Why the layer at ``path`` was not sharded although forward may use it, in words a user can act on."""
    modules = dict(gm.named_modules())
    module = modules.get(path, gm)
    if isinstance(module, nn.Linear) and module._parameters.get("weight") is None:
        return (
            f"the weight of '{path}' is computed at each call (a parametrization or hook: weight_norm, spectral_norm), "
            "not a parameter to shard; it stays whole"
        )
    prefix = f"{path}." if path else ""
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not str(node.target).startswith(prefix) or "." in str(node.target)[len(prefix):]:
            continue
        for user in node.users:
            if user.op == "call_function":
                name = getattr(user.target, "__qualname__", getattr(user.target, "__name__", str(user.target)))
                return (
                    f"its weights are passed to {getattr(user.target, '__module__', '')}.{name}(), a function the tracer "
                    "keeps as one call (fx.wrap), so the layer runs whole inside it; tensor parallelism shards a layer "
                    "it sees called (self.layer(x) or F.linear(x, self.layer.weight))"
                )
    owner = path
    while owner:
        owner = owner.rpartition(".")[0]
        module = modules.get(owner)
        if module is not None and any(n.op == "call_module" and n.target == owner for n in gm.graph.nodes):
            return (
                f"it is called inside '{owner}' ({type(module).__name__}), which the tracer keeps as one call (a leaf "
                "module), so it runs whole; leave that type out of leaf_modules= to shard its layers"
            )
    return NOT_CALLED.format(path=path)


def resolve_explicit_plan(gm: fx.GraphModule, plan: Mapping[str, str], model: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """``(styles, reasons)`` for a user's plan: checked against ``model`` (``ValueError`` for a
    path that is no Linear or an unknown style); a Linear forward never calls stays whole."""
    sites = find_linear_sites(gm)
    check_plan(model, plan, extra_linears=sites)
    styles: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for path, style in plan.items():
        if path in sites or style == "replicate":
            styles[path] = style
        else:
            reasons[path] = "replicate: " + why_whole(gm, path)
    return styles, reasons


def plan_for(gm: fx.GraphModule, plan: object, n: int, model: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """``(styles, reasons)``: the explicit plan resolved, or the automatic one for ``True``."""
    if isinstance(plan, Mapping):
        return resolve_explicit_plan(gm, plan, model)
    if plan is not True:
        raise ArgumentError(f"tensor_parallel={plan!r}: expected False, True (automatic plan) or a dict {{path: style}}")
    return choose_plan(gm, n)


def plan_total(gm: fx.GraphModule, styles: Mapping[str, str], n: int, **found: Any) -> tuple[float, dict[str, str], dict[str, str]]:
    """What a plan costs once ``shard_linear`` has checked it: (score, styles applied, reasons).

    The score is the elements per device (forward + backward), plus a large penalty for each
    layer the plan wanted sharded that had to stay whole. ``found``: ``sites=`` and ``layer_paths=``
    of ``gm`` found once (see :func:`~dpcompile.analysis.sharding.resolve_plan`).
    """
    resolved = resolve_plan(gm, plan=styles, n=n, strict=False, **found)
    demoted = sum(1 for p, s in styles.items() if s != "replicate" and resolved.styles.get(p) == "replicate")
    total = plan_cost(resolved.analysis.comms, n).total
    return total + demoted * _UNSHARDED_PENALTY, resolved.styles, resolved.reasons


def choose_plan(gm: fx.GraphModule, n: int, *, exhaustive_limit: int = 256) -> tuple[dict[str, str], dict[str, str]]:
    """The automatic plan: ``(styles, reasons)`` minimising the cost model's total.

    Each group of interacting layers is searched exhaustively (up to ``exhaustive_limit``
    assignments), larger groups by coordinate descent from the Megatron pairing (column for
    a layer that feeds another through transparent ops, row for the one it feeds).
    """
    sites = find_linear_sites(gm)
    layer_paths = [*linear_paths(gm), *embedding_paths(gm)]
    totals: dict[tuple, tuple[float, dict[str, str], dict[str, str]]] = {}

    def total(trial: Mapping[str, str]) -> tuple[float, dict[str, str], dict[str, str]]:
        """``plan_total`` of ``trial``; the graph's layers found once, not once per trial (hundreds)."""
        key = tuple(sorted(trial.items()))
        if key not in totals:
            totals[key] = plan_total(gm, trial, n, sites=sites, layer_paths=layer_paths)
        return totals[key]

    modules = dict(gm.named_modules())
    reasons: dict[str, str] = {}
    options: dict[str, list[str]] = {}
    vocab: dict[str, str] = {}
    for path, site in sites.items():
        if site.kind in ("embedding", "window_attention"):  # no choice: vocab-parallel / by heads where it can be
            style = "vocab" if site.kind == "embedding" else "column"
            why = site.blocker or check_divisible(site, style, n)
            if why is None:
                vocab[path] = style
            else:
                reasons[path] = why
            continue
        allowed = [] if site.blocker else [s for s in ("column", "row") if check_divisible(site, s, n) is None]
        if allowed:
            options[path] = allowed
        else:
            reasons[path] = site.blocker or f"{check_divisible(site, 'column', n)}, nor its in_features({site.in_features})"
    by_name = {site.node.name: path for path, site in sites.items() if path in options}
    nodes = {sites[path].node for path in options}

    def transparent(node: fx.Node) -> bool:
        return is_shard_transparent(node, modules)

    styles: dict[str, str] = {**vocab, **{path: opts[-1] if len(opts) == 1 else "row" for path, opts in options.items()}}
    chains = find_linear_chains(gm, nodes, transparent)
    for a, _ in chains:
        if "column" in options[by_name[a]]:
            styles[by_name[a]] = "column"
    for a, b in chains:
        if styles[by_name[a]] == "column" and "row" in options[by_name[b]]:
            styles[by_name[b]] = "row"
    for group in linear_groups(gm, nodes, transparent):
        paths = [by_name[name] for name in group]
        combos = math.prod(len(options[p]) for p in paths)
        if combos <= exhaustive_limit:
            best = None
            for choice in itertools.product(*(options[p] for p in paths)):
                trial = {**styles, **dict(zip(paths, choice))}
                score = total(trial)[0]
                if best is None or score < best[0]:
                    best = (score, choice)
            assert best is not None
            styles.update(zip(paths, best[1]))
            for p in paths:
                reasons[p] = f"auto: cheapest of {combos} assignments of its group of {len(paths)}"
        else:
            styles = _descend(total, styles, paths, options)
            for p in paths:
                reasons[p] = f"auto: coordinate descent over its group of {len(paths)}"
    score, applied, why = total(styles)
    reasons.update(why)
    log.debug("automatic plan %s costs %s elements per device", applied, score)
    return {p: s for p, s in applied.items() if p in sites}, reasons


def _descend(total: Callable[[Mapping[str, str]], tuple], styles: dict[str, str], paths: list[str],
             options: Mapping[str, list[str]]) -> dict[str, str]:  # fmt: skip
    best = total(styles)[0]
    for _ in range(3):
        improved = False
        for p in paths:
            for s in options[p]:
                if s == styles[p]:
                    continue
                trial = {**styles, p: s}
                score = total(trial)[0]
                if score < best:
                    best, styles, improved = score, trial, True
        if not improved:
            break
    return styles


# ----------------------------------------------------------------------------- memory-aware plans
#: builds the tensor-parallel program over ``k`` devices on fake tensors (no memory), or None where it cannot
FakeProgram = Callable[[int], "nn.Module | None"]
#: the planner's estimate of ``"data_parallel"`` or ``"tensor_parallel"`` over these device labels (None: no prediction)
Predicted = Callable[[str, list[str]], "MemoryEstimate | None"]


def planner_estimates(
    model: nn.Module, example_inputs: tuple | None, example_kwargs: Mapping[str, Any] | None, *,
    optimizer: str | None, training: bool, tensor_parallel: object, leaf_modules: tuple = (),
) -> Predicted | None:  # fmt: skip
    """The planner's prediction (``docs/planner.md``, what ``explain`` reports for the program built)
    of data parallel and of the automatic tensor-parallel plan over any devices, from one fake run of
    the examples; None where it predicts neither as built (no examples, ``leaf_modules=``, an explicit
    plan, a fake run it cannot make): then each candidate is the program count."""
    if (example_inputs is None and not example_kwargs) or leaf_modules or isinstance(tensor_parallel, Mapping):
        return None
    try:
        profile = profile_model(model, example_inputs or (), example_kwargs, optimizer=optimizer, training=training)
    except Exception:  # noqa: BLE001 - the program count then
        return None
    what = "planner: saved for backward per device (fake run)" if training else "planner: fake run"

    def predicted(strategy: str, labels: list[str]) -> MemoryEstimate | None:
        dim = "dp" if strategy == "data_parallel" else "tp"
        prediction = predict_layout(profile, LayoutSpec(((dim, len(labels)),)), REFERENCE)
        if prediction.unbuildable or len(prediction.per_device) != len(labels):
            return None
        return MemoryEstimate(dict(zip(labels, prediction.per_device)), optimizer, training, what)

    return predicted


def data_parallel_estimate(
    model: nn.Module, labels: list[str], *, optimizer: str | None, training: bool, activations: int, batch: int | None
) -> MemoryEstimate:
    """Data parallel: a full replica on every device, and the device's share of the batch's activations."""
    n = len(labels)
    share = activations if not batch else activations * -(-batch // n) // batch
    kinds = {**parameter_kinds(list(model.parameters()), optimizer, training), "activations": share}
    return MemoryEstimate({d: dict(kinds) for d in labels}, optimizer, training)


def program_estimate(pm: nn.Module, *, optimizer: str | None, training: bool, activations: int) -> MemoryEstimate:
    """A built tensor-parallel program's own estimate (what ``explain`` reports for it): the
    parameters each device really holds under its plan, leaf modules and dtypes, with the
    gradients and optimizer state that go with them, and the activations counted whole."""
    labels, devices = pm.devices.labels(), list(pm.devices)
    held = held_parameter_bytes(pm, labels, devices)
    kinds = program_memory(pm, held, optimizer=optimizer, training=training, activations=activations, share=1.0)
    estimate = MemoryEstimate(kinds, optimizer, training)
    slots = getattr(pm, "shard_param_slots", {}) or {}
    replicated = sum(p.numel() * p.element_size() for name, p in pm.named_parameters() if slots.get(name, 0) is None)
    peak = max(held, key=estimate.total)
    if held[peak]:
        estimate.whole = round((estimate.total(peak) - activations) * min(1.0, replicated / held[peak]))
    return estimate


def memory_candidates(
    model: nn.Module,
    labels: list[str],
    *,
    optimizer: str | None,
    training: bool,
    activations: int,
    batch: int | None,
    tensor_parallel: object = False,
    fake_program: FakeProgram,
    budgets: Mapping[str, int] | None = None,
    predicted: Predicted | None = None,
) -> dict[str, MemoryEstimate | None]:
    """Per-device estimates of the programs ``transform`` can choose for ``labels``, in the order
    that moves the fewest bytes: data parallel (a full replica each, the batch split) unless a
    tensor-parallel plan was asked for, then the tensor-parallel program itself, built on fake
    tensors by ``fake_program(len(labels))`` (None where it cannot be built) unless data
    parallel already fits ``budgets``. Each is ``predicted``'s (the planner's) where given, else the
    program count."""
    out: dict[str, MemoryEstimate | None] = {}
    if tensor_parallel is False:
        out["data_parallel"] = (predicted("data_parallel", labels) if predicted is not None else None) or (
            data_parallel_estimate(model, labels, optimizer=optimizer, training=training, activations=activations,
                                   batch=batch))  # fmt: skip
        if budgets is not None and choose_strategy(out, budgets) is not None:
            return out  # the first choice fits: no tensor-parallel program to build
    pm = fake_program(len(labels))
    planned = predicted("tensor_parallel", labels) if predicted is not None and pm is not None else None
    out["tensor_parallel"] = planned or (
        None if pm is None else program_estimate(pm, optimizer=optimizer, training=training, activations=activations)
    )
    return out


def fewest_devices(
    model: nn.Module, n: int, budget: int, *, optimizer: str | None, training: bool, activations: int,
    batch: int | None, tensor_parallel: object, fake_program: FakeProgram, at_n: MemoryEstimate | None = None,
    max_builds: int = 3, limit: int | None = None, predicted: Predicted | None = None,
) -> tuple[int, str, MemoryEstimate] | None:  # fmt: skip
    """The fewest devices ``k > n`` on which a program fits ``budget``: ``(k, strategy, estimate)``.

    Data parallel is checked at every ``k`` (no build needed); a tensor-parallel program is built
    (on fake tensors) only where a lower bound (activations whole, everything else split ``k``
    ways) fits and the program over ``n`` devices (``at_n``), its replicated part kept whole and
    the rest split ``k`` ways, predicts a fit; at most ``max_builds`` times, up to ``limit``
    devices (:func:`search_limit`). Each answer is a program built and checked, so following it fits.
    With ``predicted`` (the planner's), each count is judged by its prediction, and a tensor-parallel
    program built only where it predicts a fit."""
    if predicted is not None:
        return _fewest_predicted(n, budget, tensor_parallel, fake_program, predicted, max_builds, limit)
    replica = sum(parameter_kinds(list(model.parameters()), optimizer, training).values())
    builds = 0

    def predicted(k: int) -> float:
        if at_n is None:
            return 0.0
        return activations + at_n.whole + (at_n.peak - activations - at_n.whole) * n / k
    for k in range(n + 1, search_limit(n, limit) + 1):
        labels = [f"device{i}" for i in range(k)]
        if tensor_parallel is False:
            dp = data_parallel_estimate(model, labels, optimizer=optimizer, training=training,
                                        activations=activations, batch=batch)  # fmt: skip
            if dp.peak <= budget:
                return k, "data_parallel", dp
        if activations + replica / k > budget or predicted(k) > budget:
            continue
        if builds >= max_builds:
            break
        builds += 1
        pm = fake_program(k)
        if pm is not None:
            estimate = program_estimate(pm, optimizer=optimizer, training=training, activations=activations)
            if estimate.peak <= budget:
                return k, "tensor_parallel", estimate
    return None


def _fewest_predicted(
    n: int, budget: int, tensor_parallel: object, fake_program: FakeProgram, predicted: Predicted, max_builds: int,
    limit: int | None,
) -> tuple[int, str, MemoryEstimate] | None:  # fmt: skip
    builds = 0
    for k in range(n + 1, search_limit(n, limit) + 1):
        labels = [f"device{i}" for i in range(k)]
        dp = predicted("data_parallel", labels) if tensor_parallel is False else None
        if dp is not None and dp.peak <= budget:
            return k, "data_parallel", dp
        tp = predicted("tensor_parallel", labels)
        if tp is None or tp.peak > budget:
            continue
        if builds >= max_builds:
            break
        builds += 1
        if fake_program(k) is not None:
            return k, "tensor_parallel", tp
    return None


def search_limit(n: int, limit: int | None = None) -> int:
    """The most devices :func:`fewest_devices` tries for a program over ``n``: 8 times as many, at least 16."""
    return limit if limit is not None else max(8 * n, 16)


def no_fit_error(
    candidates: Mapping[str, MemoryEstimate | None], budgets: Mapping[str, int], *,
    optimizer: str | None, more_devices: tuple[int, str, MemoryEstimate] | None,
) -> DpCompileError:  # fmt: skip
    """Where no program fits: the smallest device count that would (``more_devices``), and the
    smallest budget that would, rounded up so that passing it back fits, with the arithmetic."""
    budget = min(budgets.values())
    n = len(budgets)
    lines = []
    for name, estimate in candidates.items():
        if estimate is None:
            lines.append(f"{name}: no program could be built over {n} devices")
            continue
        device = max(estimate.per_device, key=estimate.total)
        kinds = estimate.per_device[device]
        terms = " + ".join(f"{format_bytes(kinds[k])} {k}" for k in KINDS)
        lines.append(f"{name}: {terms} = {format_bytes(estimate.total(device))} per device")
    if more_devices is not None:
        k, strategy, estimate = more_devices
        way_out = f"{strategy.replace('_', ' ')} over {k} devices would fit (needs {format_bytes(estimate.peak)} each)"
    else:
        way_out = (
            f"no device count up to {search_limit(n)} fits: what stays whole on every device (activations, layers "
            "that do not split) leaves too little room"
        )
    fitting = [c.peak for c in candidates.values() if c is not None]
    least = (
        f", or a budget of at least {format_budget_up(min(fitting))} ({min(fitting)} bytes) per device on {n} devices"
        if fitting
        else ""
    )
    return DpCompileError(
        f"no program fits memory_per_device={format_bytes(budget)} on {n} devices: "
        + "; ".join(lines)
        + f". The way out: {way_out}{least}"
        + ("" if optimizer is None else f", or a lighter optimizer than {optimizer!r}")
        + " (or training=False for inference); plan=\"auto\" also weighs pipeline stages and activation checkpointing."
    )


def device_budgets(devices: Any, budget: Any) -> dict[str, int]:
    """``memory_per_device=`` as bytes per device label (one budget for all, or ``{device: budget}``)."""
    parsed = parse_devices(devices)
    labels = parsed.labels()
    if not isinstance(budget, Mapping):
        return dict.fromkeys(labels, parse_budget(budget))
    # keyed by device ("cuda:1", torch.device, 1) or by explain's label of a virtual device ("cpu#1")
    given = {k if k in labels else str(parse_device(k)): parse_budget(v) for k, v in budget.items()}
    names = {str(d) for d in parsed.devices}
    unknown = sorted(k for k in given if k not in names and k not in labels)
    missing = [label for label, d in zip(labels, parsed.devices) if label not in given and str(d) not in given]
    if unknown or missing:
        raise ArgumentError(
            "memory_per_device= " + (f"names {unknown}, not among the devices; " if unknown else "")
            + (f"has no budget for {missing}; " if missing else "")
            + f"key it by device ({sorted(names)}) or by explain's device label ({labels}), or give one budget for all"
        )
    return {label: given.get(label, given.get(str(d))) for label, d in zip(labels, parsed.devices)}


def plan_for_memory(
    model: nn.Module, devices: Any, budget: Any, optimizer: str | None, training: bool,
    example_inputs: tuple | None, example_kwargs: Mapping[str, Any] | None, tensor_parallel: Any,
    build: Callable[[Any, Any], nn.Module], leaf_modules: tuple = (),
) -> tuple[Any, MemoryEstimate]:  # fmt: skip
    """``tensor_parallel=`` for the program that fits ``budget`` on every device, and its estimate
    (see ``docs/memory.md``); :class:`DpCompileError` with the arithmetic where none fits.

    ``build(devices, plan)`` builds the tensor-parallel program transform would build over those
    devices, on fake tensors: its estimate is that program's own (what ``explain`` reports)."""
    if is_device_mesh(devices):
        raise ArgumentError(
            "memory_per_device= plans over a list of devices; over a DeviceMesh choose data_parallel= / tensor_parallel="
        )
    parsed = parse_devices(devices)
    labels = parsed.labels()
    budgets = device_budgets(devices, budget)
    optimizer_bytes([], optimizer)  # an unknown optimizer fails here
    activations, batch = 0, None
    if example_inputs is not None or example_kwargs:
        activations = activation_bytes(model, example_inputs or (), example_kwargs, training=training)
        first = next(
            (x for x in [*(example_inputs or ()), *(example_kwargs or {}).values()] if hasattr(x, "dim") and x.dim()),
            None,
        )
        batch = None if first is None else int(first.shape[0])
    plan = tensor_parallel or True

    def fake_program(k: int) -> nn.Module | None:
        if k == len(labels) and tensor_parallel is not False:
            return build(devices, plan)  # the plan the user gave: where it cannot be built, say why
        try:  # another device count: virtual devices hold what distinct ones would
            return build(devices if k == len(labels) else [parsed.primary] * k, plan)
        except (DpCompileError, ValueError) as e:
            log.debug("no tensor-parallel program over %d devices: %s", k, e)
            return None

    predicted = planner_estimates(model, example_inputs, example_kwargs, optimizer=optimizer, training=training,
                                  tensor_parallel=tensor_parallel, leaf_modules=tuple(leaf_modules))  # fmt: skip
    options = {"optimizer": optimizer, "training": training, "activations": activations, "batch": batch,
               "tensor_parallel": tensor_parallel, "fake_program": fake_program, "predicted": predicted}  # fmt: skip
    candidates = memory_candidates(model, labels, budgets=budgets, **options)
    choice = choose_strategy(candidates, budgets)
    if choice is None:
        at_n = candidates.get("tensor_parallel")
        more = fewest_devices(model, len(labels), min(budgets.values()), at_n=at_n, **options)
        raise no_fit_error(candidates, budgets, optimizer=optimizer, more_devices=more)
    chosen = candidates[choice]
    assert chosen is not None
    if not chosen.what:
        chosen.what = "saved for backward (fake run of the examples)" if training else "peak live in forward (fake run)"
    chosen.considered = considered_layouts(candidates, choice, budgets, len(labels))
    return (False if choice == "data_parallel" else plan), chosen


def considered_layouts(
    candidates: Mapping[str, MemoryEstimate | None], choice: str, budgets: Mapping[str, int], n: int
) -> list[Any]:
    """``explain(pm, x).candidates`` of ``memory_per_device=`` without a layout: data parallel and
    tensor parallel over the ``n`` devices with their predicted bytes and fate (no step time: this
    choice is by memory, data parallel first; ``plan="auto"`` weighs every layout by step time)."""
    from dpcompile.planner import Candidate  # the planner's rows, as plan="auto" lists them

    rows = []
    for strategy, dim in (("data_parallel", "dp"), ("tensor_parallel", "tp")):
        estimate = candidates.get(strategy)
        fits = estimate is not None and all(estimate.total(d) <= budgets[d] for d in estimate.per_device)
        if strategy == choice:
            rejected = None
        elif strategy not in candidates:
            rejected = ("not weighed: data parallel fits, and memory_per_device= without plan= keeps a replica "
                        'where one fits (plan="auto" weighs every layout)') if choice == "data_parallel" else (
                        "not weighed: tensor_parallel= asks for tensor parallel")  # fmt: skip
        elif estimate is None:
            rejected = "cannot be built over these devices"
        else:
            peak = max(estimate.per_device, key=estimate.total)
            rejected = f"does not fit: {format_bytes(estimate.total(peak))} predicted on {peak} > {format_bytes(budgets[peak])}"
        per_device = dict(estimate.per_device) if estimate is not None else {}
        rows.append(Candidate(LayoutSpec(((dim, n),)), per_device, rejected=rejected, fits=fits))
    return rows
