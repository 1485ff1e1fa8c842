"""``balance_causal_attention``: context parallel's causal attention, its work balanced over the devices.

Split into ``N`` contiguous shards, causal attention gives the device holding the last tokens about
``2N - 1`` times the first one's work (its queries see every earlier key). On the lowered program
(after ``regather_keys_values``), each user attention call's ``N`` causal ``attention_regathered``
calls become zig-zag calls: device ``r`` computes the query chunks ``r`` and ``2N - 1 - r`` of
``2N`` (``runtime.balanced_attention``, which takes the query rows it needs from their devices),
then each device takes its own rows back (``runtime.balanced_rows_back``). Nothing outside
attention moves: positions, masks, labels and every other op stay on the device's own tokens.

Before (two devices)::

    sdpa_dev0 = dpcompile_runtime_attention_regathered(q_dev0, [k_dev0, k_dev1], [v_dev0, v_dev1], 2, 'cpu', positions_dev0)
    sdpa_dev1 = dpcompile_runtime_attention_regathered(q_dev1, [k_dev0, k_dev1], [v_dev0, v_dev1], 2, 'cpu', positions_dev1)

After::

    sdpa_balanced_dev0 = dpcompile_runtime_balanced_attention([q_dev0, q_dev1], [k_dev0, k_dev1], [v_dev0, v_dev1], 2, 0)
    sdpa_balanced_dev1 = dpcompile_runtime_balanced_attention([q_dev0, q_dev1], [k_dev0, k_dev1], [v_dev0, v_dev1], 2, 1)
    sdpa_dev0 = dpcompile_runtime_balanced_rows_back([sdpa_balanced_dev0, sdpa_balanced_dev1], 2, 0)
    sdpa_dev1 = dpcompile_runtime_balanced_rows_back([sdpa_balanced_dev0, sdpa_balanced_dev1], 2, 1)

An attention with a mask split by query rows (transformers' causal mask) moves its mask rows with the
queries (``masks=``); a chunk whose rows let a query see a later key attends every key (exact, not
balanced: checked at run time; under ``required``, a ``DpCompileError`` naming it). An attention that is not causal (no mask, or one mask row for every
query: every query sees every key already), or that was not regathered (dropout), is left as it is, its reason in ``node.meta["dpcompile_balance"]`` for
``explain``; where balancing was asked for by name (``required``) it is a ``DpCompileError``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.fx as fx

from dpcompile import runtime
from dpcompile.errors import DpCompileError
from dpcompile.infra import PassResult, stamp
from passes.context_parallel import SDPA_TARGETS

PASS = "balance_causal_attention"
#: where a node of the lowered program says why its attention is not balanced
SKIPPED = "dpcompile_balance"
_DEVICE = re.compile(r"_dev(\d+)(?:_\d+)?$")


@dataclass(frozen=True)
class BalanceSite:
    """One user attention call: every device's causal ``attention_regathered`` call, in device order."""

    calls: tuple[fx.Node, ...]


@dataclass
class BalanceSites:
    sites: list[BalanceSite]
    skipped: list[tuple[fx.Node, str]]  # (attention call, why it is not balanced)


def _device(node: fx.Node) -> int | None:
    match = _DEVICE.search(node.name)
    return int(match.group(1)) if match else None


def _mask_rows(node: fx.Node) -> fx.Node | None:
    """The device's own rows of an attention mask (split with the queries, ``mask_rows``), else None."""
    mask = node.kwargs.get("attn_mask")
    return mask if isinstance(mask, fx.Node) and _device(mask) == _device(node) else None


def _skip_reason(node: fx.Node) -> str | None:
    """Why an attention call of the lowered program cannot be balanced; None where it can: causal
    (``is_causal``) or a mask split by query rows (transformers' causal mask; checked per chunk at run
    time, a chunk whose rows see a later key attending every key)."""
    if node.target is runtime.attention_regathered:
        if node.args[5] is None and "attn_mask" not in node.kwargs:
            return "it is not causal (no mask): every device's queries already see every key"
        if node.args[5] is None and _mask_rows(node) is None:
            return "it is not causal (one mask row for every query): every device's queries see every kept key"
        if _device(node) is None:
            return "its device is not named in the program"
        return None
    if node.target is runtime.causal_attention:
        return "it has dropout, so its keys and values are not regathered (dropout is not built on sequence shards)"
    return "it is not causal (a mask, or none): every device's queries already see every key"


def find_balance_sites(gm: fx.GraphModule) -> BalanceSites:
    """Each user attention call's causal ``attention_regathered`` calls, and every other attention call of
    the lowered program (its reason)."""
    groups: dict[tuple[fx.Node, ...], list[fx.Node]] = {}
    skipped = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (runtime.attention_regathered, runtime.causal_attention,
                                                             *SDPA_TARGETS):  # fmt: skip
            continue
        reason = _skip_reason(node)
        if reason is not None:
            skipped.append((node, reason))
        else:
            groups.setdefault(tuple(node.args[1]), []).append(node)
    sites, order = [], {n: i for i, n in enumerate(gm.graph.nodes)}
    for keys, calls in groups.items():
        calls.sort(key=_device)  # type: ignore[arg-type, return-value]
        if [_device(c) for c in calls] != list(range(len(keys))):
            skipped += [(c, "its devices' calls are not one per key shard") for c in calls]
            continue
        if max(order[n] for c in calls for n in c.all_input_nodes) > min(order[c] for c in calls):
            skipped += [(c, "a device's queries are computed after another device's attention") for c in calls]
            continue
        sites.append(BalanceSite(tuple(calls)))
    return BalanceSites(sites, skipped)


def balance_causal_attention(gm: fx.GraphModule, *, required: bool = False, min_length: int = 0) -> PassResult:
    """Each site's calls rewritten to zig-zag chunks (see the module's docstring). ``required``
    (``load_balance=True``): an attention call that cannot be balanced is a ``DpCompileError``.
    ``min_length``: a call over a shorter sequence runs unbalanced (decided per call, at run time)."""
    found = find_balance_sites(gm)
    if required and found.skipped:
        node, reason = found.skipped[0]
        raise DpCompileError(
            f"context_parallel={{'load_balance': True}}: attention '{node.meta.get('dpcompile_source', node.name)}' "
            f"('{node.name}') cannot be balanced: {reason}. Pass load_balance='auto' (balances the causal calls it "
            "can, leaves the others) or False"
        )
    if required and not found.sites:
        raise DpCompileError(
            "context_parallel={'load_balance': True}: the program has no causal attention over the sequence to "
            "balance; pass load_balance='auto' or False"
        )
    for node, reason in found.skipped:
        node.meta[SKIPPED] = reason
    for site in found.sites:
        _rewrite(gm, site, min_length, required)
    return PassResult(gm, bool(found.sites), {"balanced": [s.calls[0].meta.get("dpcompile_source", s.calls[0].name)
                                                           for s in found.sites]})  # fmt: skip


def _rewrite(gm: fx.GraphModule, site: BalanceSite, min_length: int, required: bool) -> None:
    """The balanced calls before the first device's attention; each device's call becomes its rows back."""
    calls = site.calls
    first = calls[0]
    queries = [c.args[0] for c in calls]
    keys, values, dim = list(first.args[1]), list(first.args[2]), first.args[3]
    options = {k: v for k, v in first.kwargs.items() if k != "attn_mask"}
    if "attn_mask" in first.kwargs:
        options["masks"] = [c.kwargs["attn_mask"] for c in calls]
        if required:  # a mask may not be causal (BERT's): load_balance=True refuses it by name when it runs
            options["must_balance"] = str(first.meta.get("dpcompile_source", first.name))
    shortest = {"min_length": min_length} if min_length else {}
    base = _DEVICE.sub("", first.name)
    balanced = []
    with gm.graph.inserting_before(first):
        for r, call in enumerate(calls):
            node = gm.graph.call_function(runtime.balanced_attention, (queries, keys, values, dim, r),
                                          {**shortest, **options})  # fmt: skip
            node._rename(f"{base}_balanced_dev{r}")
            balanced.append(stamp(node, PASS, call))
    for r, call in enumerate(calls):
        call.target, call.args, call.kwargs = runtime.balanced_rows_back, (balanced, dim, r), shortest
        stamp(call, PASS)


__all__ = ["SKIPPED", "BalanceSite", "BalanceSites", "balance_causal_attention", "find_balance_sites"]
