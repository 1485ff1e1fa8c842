"""Tensor-parallel plans: the automatic choice and explicit plans, each resolved in one place.

* :func:`resolve_explicit_plan`: a user's ``{path: style}`` checked against the model, with a
  reason for each layer forward never calls;
* :func:`choose_plan`: the automatic plan (``tensor_parallel=True``) that minimises the
  elements each device sends (:func:`dpcompile.analysis.cost.plan_cost`).

The automatic plan gives every ``nn.Linear`` whose shapes allow it a ``column`` or ``row``
style, choosing, group by group of interacting layers (see
:func:`dpcompile.analysis.graph_view.linear_groups`), the assignment with the fewest elements
sent per device. With ``example_inputs=`` the sizes are exact; without, a tensor is costed by
its features per token.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping

import torch.fx as fx
from torch import nn

from dpcompile.analysis.cost import plan_cost
from dpcompile.analysis.graph_view import find_linear_chains, linear_groups
from dpcompile.analysis.memory import (
    KINDS,
    MemoryEstimate,
    format_bytes,
    parameter_kinds,
    shardable_parameters,
    smallest_device_count,
)
from dpcompile.analysis.sharding import (
    check_divisible,
    check_plan,
    find_linear_sites,
    is_shard_transparent,
    resolve_plan,
)
from dpcompile.errors import DpCompileError

log = logging.getLogger("dpcompile")

_UNSHARDED_PENALTY = 1e15  # the automatic plan shards every layer it can before it saves elements

NOT_CALLED = "'{path}' is not called in forward (or only inside a leaf module); it stays whole"


def why_whole(gm: fx.GraphModule, path: str) -> str:
    """Why the layer at ``path`` was not sharded although forward may use it, in words a user can act on."""
    modules = dict(gm.named_modules())
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
            reasons[path] = "replicate: " + NOT_CALLED.format(path=path)
    return styles, reasons


def plan_for(gm: fx.GraphModule, plan: object, n: int, model: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """``(styles, reasons)``: the explicit plan resolved, or the automatic one for ``True``."""
    if isinstance(plan, Mapping):
        return resolve_explicit_plan(gm, plan, model)
    if plan is not True:
        raise ValueError(f"tensor_parallel={plan!r}: expected False, True (automatic plan) or a dict {{path: style}}")
    return choose_plan(gm, n)


def plan_total(gm: fx.GraphModule, styles: Mapping[str, str], n: int) -> tuple[float, dict[str, str], dict[str, str]]:
    """What a plan costs once ``shard_linear`` has checked it: (score, styles applied, reasons).

    The score is the elements per device (forward + backward), plus a large penalty for each
    layer the plan wanted sharded that had to stay whole.
    """
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
    sites = find_linear_sites(gm)
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


# ----------------------------------------------------------------------------- memory-aware plans
def memory_candidates(
    model: nn.Module,
    labels: list[str],
    *,
    optimizer: str | None,
    training: bool,
    activations: int,
    batch: int | None,
    tensor_parallel: object = False,
) -> dict[str, MemoryEstimate]:
    """Per-device estimates of the programs ``transform`` can choose for ``labels``, in the order
    that moves the fewest bytes: data parallel (a full replica each, the batch split) unless a
    tensor-parallel plan was asked for, then tensor parallel (each ``nn.Linear`` whose output
    features divide split over the devices, the rest replicated, activations counted whole)."""
    n = len(labels)
    params = list(model.parameters())
    out: dict[str, MemoryEstimate] = {}
    if tensor_parallel is False:
        share = activations if not batch else activations * -(-batch // n) // batch
        kinds = {**parameter_kinds(params, optimizer, training), "activations": share}
        out["data_parallel"] = MemoryEstimate({d: dict(kinds) for d in labels}, optimizer, training)
    kinds = tensor_parallel_kinds(model, n, optimizer, training, activations)
    out["tensor_parallel"] = MemoryEstimate({d: dict(kinds) for d in labels}, optimizer, training)
    return out


def tensor_parallel_kinds(model: nn.Module, n: int, optimizer: str | None, training: bool, activations: int) -> dict[str, int]:
    """Bytes each of ``n`` devices holds under tensor parallelism, by kind."""
    sharded = shardable_parameters(model, n)
    ids = {id(p) for p in sharded}
    split = parameter_kinds(sharded, optimizer, training)
    whole = parameter_kinds([p for p in model.parameters() if id(p) not in ids], optimizer, training)
    return {**{k: -(-split[k] // n) + whole[k] for k in split}, "activations": activations}


def no_fit_error(
    model: nn.Module, candidates: Mapping[str, MemoryEstimate], budgets: Mapping[str, int], *,
    optimizer: str | None, training: bool, activations: int,
) -> DpCompileError:  # fmt: skip
    """Where no program fits: the smallest device count that would (tensor parallel), or the
    smallest budget, with the arithmetic."""
    budget = min(budgets.values())
    n = len(budgets)
    lines = []
    for name, estimate in candidates.items():
        device = max(estimate.per_device, key=estimate.total)
        kinds = estimate.per_device[device]
        terms = " + ".join(f"{format_bytes(kinds[k])} {k}" for k in KINDS)
        lines.append(f"{name}: {terms} = {format_bytes(estimate.total(device))} per device")
    count = smallest_device_count(lambda k: sum(tensor_parallel_kinds(model, k, optimizer, training, activations).values()), budget, n + 1)
    least = min(c.peak for c in candidates.values())
    way_out = (
        f"tensor parallel over {count} devices would fit (needs {format_bytes(sum(tensor_parallel_kinds(model, count, optimizer, training, activations).values()))} each)"
        if count is not None
        else "no device count fits: what stays whole (activations, layers that do not split) alone exceeds it"
    )
    return DpCompileError(
        f"no program fits memory_per_device={format_bytes(budget)} on {n} devices: "
        + "; ".join(lines)
        + f". The way out: {way_out}, or a budget of at least {format_bytes(least)} per device on {n} devices"
        + ("" if optimizer is None else f", or a lighter optimizer than {optimizer!r}")
        + " (or training=False for inference)."
    )
