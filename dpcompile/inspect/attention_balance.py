"""``explain``'s word on context parallel's causal load balancing: on or off (why), each device's share.

A device's attention work is counted as the (query row, key) pairs it computes: under causal attention
row ``i`` of the whole sequence sees ``i + 1`` keys, so contiguous shards give the last device the most;
balanced (``passes.balance_causal_attention``: zig-zag chunks), every device about ``1/N``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.fx as fx

from dpcompile import runtime
from dpcompile.runtime.sequence_balance import causal_rows_keys

#: the pass's mark on an attention call it left unbalanced (``passes.balance_causal_attention.SKIPPED``)
SKIPPED = "dpcompile_balance"


def _rows(summaries: Mapping[str, Any] | None, node: fx.Node) -> int | None:
    summary = summaries.get(node.name) if summaries is not None else None
    return summary[0][0][-2] if summary and summary[0] and len(summary[0][0]) >= 2 else None


def attention_balance(gm: fx.GraphModule, load_balance: Any, size: int, labels: Sequence[str],
                      summaries: Mapping[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    """``{"on": bool, "why": str, "shares": {device: fraction of the attention work} or None}``
    for the program's first attention call (``summaries``: the recorder's, for the sequence's length)."""
    balanced = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is runtime.balanced_rows_back]
    regathered = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is runtime.attention_regathered]
    skipped = [n.meta[SKIPPED] for n in gm.graph.nodes if SKIPPED in n.meta]
    if balanced:
        why = "zig-zag chunks: each device computes query chunks r and 2N-1-r of 2N"
        if any(n.target is runtime.balanced_attention and "masks" in n.kwargs for n in gm.graph.nodes):
            why += "; the mask's rows move with the queries, keys cut at a chunk's end where the mask is causal"
        if balanced[0].kwargs.get("min_length"):
            why += f" (sequences of {balanced[0].kwargs['min_length']} tokens or more)"
    elif load_balance is False:
        why = "load_balance=False"
    elif skipped:
        why = skipped[0]
    else:
        why = ("'auto' balances over a DeviceMesh only: the virtual devices of one process run one after another, "
               "so the last device's extra work is no one's wait; pass load_balance=True to balance here")  # fmt: skip
    calls = balanced[:size] if balanced else regathered[:size]
    rows = [_rows(summaries, n) for n in calls]
    shares = None
    if len(rows) == size and all(r is not None for r in rows):
        length = sum(rows)  # type: ignore[arg-type]
        causal = bool(balanced) or (bool(regathered) and regathered[0].args[5] is not None)
        work = causal_rows_keys(length, size, bool(balanced)) if causal else [r * length for r in rows]  # type: ignore[operator]
        total = sum(work) or 1
        names = list(labels) if len(labels) == size else [f"device {r}" for r in range(size)]
        shares = {names[r]: round(w / total, 4) for r, w in enumerate(work)}
    return {"on": bool(balanced), "why": why, "shares": shares}


__all__ = ["attention_balance"]
