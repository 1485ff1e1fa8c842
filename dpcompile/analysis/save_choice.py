"""The ``"auto"`` save rule's choice, apart from any graph: which candidates (a node's output a
recomputed region may keep, or a unit's in the planner's profile) to keep within a capacity, to
recompute the fewest FLOPs. Attention first, then an exact 0/1 knapsack over the matmuls.

    choose_saves([q(1, 2), k(1, 2), attention(1, 4, True), fc1(4, 8)], budget=6 / 7)
    → attention, fc1, q: 6 of 7 values kept, 14 of 16 FLOPs spared
"""

from __future__ import annotations

from dataclasses import dataclass

_MAX_STATES = 200_000  # the knapsack's reachable widths; past this a greedy choice by FLOPs per value


@dataclass(frozen=True)
class SaveCandidate:
    """A node whose output a region may keep: ``width`` values kept, ``flops`` spared (per row, or
    in all where the capture recorded its tensors); ``attention`` ones are kept first."""

    node: object  # the fx.Node (or any key) whose output is kept
    width: float
    flops: float
    attention: bool


def choose_saves(candidates: list[SaveCandidate], budget: float) -> list[SaveCandidate]:
    """The candidates to keep: attention first, then the matmuls sparing the most FLOPs, within
    ``budget`` (a fraction, 0 to 1) of the width of all candidates; ties keep fewer values, then
    earlier nodes. In graph order."""
    return choose_within(candidates, budget * sum(c.width for c in candidates))


def choose_within(candidates: list[SaveCandidate], capacity: float) -> list[SaveCandidate]:
    """:func:`choose_saves` within ``capacity`` values (a byte budget over the bytes of one value)."""
    capacity += 1e-9
    kept: list[SaveCandidate] = []
    for c in candidates:
        if c.attention and c.width <= capacity:
            kept.append(c)
            capacity -= c.width
    rest = [c for c in candidates if not c.attention]
    best = _knapsack(rest, capacity)
    kept += [rest[i] for i in best]
    order = {c.node: i for i, c in enumerate(candidates)}
    return sorted(kept, key=lambda c: order[c.node])


def _knapsack(items: list[SaveCandidate], capacity: float) -> tuple[int, ...]:
    """Indices of ``items`` of the most FLOPs with widths summing to at most ``capacity`` (exact)."""
    states: dict[float, tuple[float, tuple[int, ...]]] = {0.0: (0.0, ())}  # width used -> (flops, chosen)
    for i, item in enumerate(items):
        for used, (flops, chosen) in list(states.items()):
            total = used + item.width
            if total > capacity:
                continue
            candidate = (flops + item.flops, (*chosen, i))
            if total not in states or candidate[0] > states[total][0]:
                states[total] = candidate
        if len(states) > _MAX_STATES:
            return _greedy(items, capacity)
    return max(states.items(), key=lambda s: (s[1][0], -s[0], [-i for i in s[1][1]]))[1][1]


def _greedy(items: list[SaveCandidate], capacity: float) -> tuple[int, ...]:
    chosen: list[int] = []
    for i in sorted(range(len(items)), key=lambda i: -items[i].flops / items[i].width):
        if items[i].width <= capacity:
            chosen.append(i)
            capacity -= items[i].width
    return tuple(sorted(chosen))



def kept_width(candidates: list[SaveCandidate], capacity: float) -> tuple[float, float]:
    """``(values kept, FLOPs spared)`` of :func:`choose_within`."""
    kept = choose_within(candidates, capacity)
    return sum(c.width for c in kept), sum(c.flops for c in kept)


__all__ = ["SaveCandidate", "choose_saves", "choose_within", "kept_width"]
