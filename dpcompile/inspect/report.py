"""The :class:`Report` that ``explain`` returns: its data, ``to_dict`` / ``from_dict``, and the table ``str(report)`` prints."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dpcompile.analysis.context_exchange import EXCHANGE_NAMES

__all__ = ["WIDTH", "CollectiveInfo", "NodeInfo", "Report"]

WIDTH = 120  # str(report) is at most this many columns


# ---------------------------------------------------------------------------------------- data
@dataclass
class NodeInfo:
    """One node of the generated program, as ``explain`` sees it."""

    name: str
    op: str
    target: str
    device: str  # a device label, "*" for a collective spanning the devices, "-" for inputs/outputs
    shape: list[list[int]] | None = None  # one shape per tensor output; None when unknown
    dtype: list[str] | None = None
    bytes: int = 0
    flops: int = 0
    pass_name: str | None = None
    source: str | None = None  # "model.py:42 in forward: h = self.fc1(x)"
    comm: str | None = None


@dataclass
class CollectiveInfo:
    """A communication node: what it moves and what each device sends, forward and backward."""

    name: str
    kind: str
    backward_kind: str | None
    io: bool
    elements: int | None  # S, the full tensor's elements (forward)
    forward: float | None  # elements each device sends, forward
    backward: float | None  # elements each device sends, backward
    source: str | None = None


@dataclass
class Report:
    """What ``explain`` found. ``str(report)`` is a table; ``to_dict()`` is JSON-serialisable.

    >>> import json, torch, dpcompile
    >>> pm = dpcompile.transform(torch.nn.Linear(8, 4), ["cpu", "cpu"])
    >>> d = dpcompile.explain(pm, torch.randn(16, 8)).to_dict()
    >>> json.loads(json.dumps(d)) == d
    True
    """

    mode: str
    devices: list[str]
    shapes: str  # "fake" | "real" | "none": how shapes were found
    nodes: list[NodeInfo]
    collectives: list[CollectiveInfo]
    comm_elements_forward: float
    comm_elements_backward: float
    io_elements: float
    io_elements_forward: float
    io_elements_backward: float
    param_bytes: dict[str, int]
    activation_bytes: dict[str, int]
    flops: dict[str, int]
    imbalance: dict[str, float]
    plan: dict[str, str] = field(default_factory=dict)
    plan_reasons: dict[str, str] = field(default_factory=dict)
    batch: int | None = None
    # a program that splits the batch over devices itself (dp, cp; composed with tp or pp too): the
    # share of forward FLOPs that runs split (1.0 = all of it; None without inputs to count FLOPs
    # on), and each op that runs once on the gathered batch: {"node", "target", "reason", "flops", "source"}
    splits_batch: bool = False
    split_flop_fraction: float | None = None
    whole: list[dict[str, Any]] = field(default_factory=list)
    # pipeline: {"schedule", "micro_batches" (of each dp copy), "dp_copies", "bubble_fraction", "imbalance", "measure", "stages": [{"stage",
    # "device", "module_paths", "flops", "param_bytes", "activation_bytes", "sends_elements"}]}
    pipeline: dict[str, Any] | None = None
    # bytes each device needs, by kind: {device: {"parameters", "gradients", "optimizer", "activations"}}
    # (optimizer and training as given to transform; see docs/memory.md)
    memory_estimate: dict[str, dict[str, int]] = field(default_factory=dict)
    # what memory_estimate is: the planner's prediction, the program count (and why), or none (and why)
    memory_estimate_basis: str = ""
    # activation checkpointing: {region name in the code: module path}, recomputed in backward
    # (the memory estimate's activations count what is saved with them recomputed)
    checkpoint_regions: dict[str, str] = field(default_factory=dict)
    # random ops by the user's node: {"exact": [sites drawing the single-device values], "per_device":
    # [sites each device draws itself], "note": what the per-device draws mean, or None}
    random: dict[str, Any] = field(default_factory=dict)
    # context parallel: {"dimension": "cp", "size", "sequence_dim", "exchange", "not_chosen": [...],
    # "attention": [attention calls], "calls": [{"attention", "exchange", "costs": {exchange: {"bytes_moved",
    # "messages", "transient_bytes", "seconds"}}, "why_not": {exchange: why}}] (each call's exchange choice),
    # "activation_bytes": {device: bytes},
    # "load_balance": {"on", "why", "shares": {device: attention work fraction}}} (docs/context_parallel.md)
    context_parallel: dict[str, Any] | None = None
    # sequence parallel on "tp": {"dimension", "sequence_dim", "reduce_scatters", "all_gathers",
    # "activation_bytes", "activation_bytes_without": {device: bytes}} (docs/tensor_parallel.md)
    sequence_parallel: dict[str, Any] | None = None
    # what each mesh dimension does: {"pp": "2: pipeline (gpipe)", "dp": "2: data parallel (replicate)"}
    layout: dict[str, str] = field(default_factory=dict)
    # plan="auto": every layout the planner considered, {"layout", "schedule", "micro_batches", "checkpointing",
    # "predicted_peak_bytes", "predicted_peak_by_kind", "predicted_step_time", "fits", "rejected" (None: chosen)}
    candidates: list[dict[str, Any]] = field(default_factory=list)

    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if name == "memory_estimate" and callable(value):  # made at its first read: a fake run of the model
            value = value()
            object.__setattr__(self, name, value)
        elif name == "memory_estimate_basis" and callable(value):  # set as memory_estimate is made
            self.memory_estimate  # noqa: B018 - made first
            value = value()
            object.__setattr__(self, name, value)
        return value

    @property
    def comm_elements(self) -> float:
        """Forward plus backward collective elements per device."""
        return self.comm_elements_forward + self.comm_elements_backward

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (``Report.from_dict`` reads it back)."""
        out = dataclasses.asdict(self)
        out["comm_elements"] = self.comm_elements
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Report:
        """The inverse of :meth:`to_dict`."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["nodes"] = [NodeInfo(**n) for n in data.get("nodes", [])]
        values["collectives"] = [CollectiveInfo(**c) for c in data.get("collectives", [])]
        return cls(**values)

    def __str__(self) -> str:
        return _render(self)


# ----------------------------------------------------------------------------------- tables
def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _human_count(n: float | None) -> str:
    if n is None:
        return "?"
    return f"{n:,.0f}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], widths: Sequence[int]) -> list[str]:
    def cut(text: str, width: int) -> str:
        return text if len(text) <= width else text[: width - 1] + "…"

    lines = ["  " + "  ".join(cut(h, w).ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  " + "  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  " + "  ".join(cut(str(c), w).ljust(w) for c, w in zip(row, widths)).rstrip())
    return lines


def _candidate_row(c: Mapping[str, Any]) -> list[str]:
    dims = "x".join(f"{k}{v}" for k, v in c["layout"].items())
    pipe = f" {c['schedule']} mb{c['micro_batches']}" if c.get("schedule") else ""
    name = c.get("name") or f"{dims}{pipe}{' +ckpt' if c['checkpointing'] else ''}"
    peak = _human_bytes(c["predicted_peak_bytes"]) if c["predicted_peak_bytes"] else "-"
    step = f"{c['predicted_step_time'] * 1e3:.3f} ms" if c["predicted_peak_bytes"] and c["predicted_step_time"] else "-"
    return [name, peak, step, "chosen" if c["rejected"] is None else c["rejected"]]


def _shape_text(info: NodeInfo) -> str:
    if info.shape is None:
        return "?"
    if not info.shape:
        return "-"
    parts = ["x".join(str(s) for s in shape) or "scalar" for shape in info.shape]
    return parts[0] if len(parts) == 1 else f"({', '.join(parts)})"


def _where(source: str | None) -> str:
    """``"model.py:13"`` from ``"model.py:13 in forward: h = ..."``."""
    return (source or "").split(" in ", 1)[0]


def _render_pipeline(p: Mapping[str, Any]) -> list[str]:
    out = [
        "",
        f"Pipeline: {len(p['stages'])} stages, {p['micro_batches']} micro-batches{_per_copy(p)}, {p['schedule']}; bubble "
        f"(S-1)/(M+S-1) = {p['bubble_fraction']:.3f}; stage {p['measure']} max/mean = {p['imbalance']:.3f}",
    ]
    rows = [
        [str(st["stage"]), st["device"], f"{st['flops'] / 1e6:,.2f}", _human_bytes(st["param_bytes"]),
         _human_bytes(st["activation_bytes"]), _human_count(st["sends_elements"]), ", ".join(st["module_paths"])]
        for st in p["stages"]
    ]  # fmt: skip
    headers = ["stage", "device", "MFLOPs (fwd)", "parameters", "activations", "sends", "modules"]
    return out + _table(headers, rows, [6, 8, 13, 11, 12, 9, 40])


def _per_copy(p: Mapping[str, Any]) -> str:
    copies = p.get("dp_copies", 1)
    return f" in each of {copies} dp copies" if copies > 1 else ""


def _render(r: Report) -> str:
    title = (
        f"dpcompile explain: {r.mode} on {len(r.devices)} devices ({', '.join(r.devices)})"
        + (f", batch {r.batch}" if r.batch is not None else "")
        + f"; shapes from {'fake tensors' if r.shapes == 'fake' else 'a real no-grad run' if r.shapes == 'real' else 'nowhere (no inputs)'}"
    )
    out = [*textwrap.wrap(title, WIDTH, subsequent_indent="  ", break_on_hyphens=False)]
    if r.layout:
        spelled = "; ".join(f"{name}({what})" for name, what in r.layout.items())
        out += textwrap.wrap(f"Layout: {spelled}", WIDTH, subsequent_indent="  ", break_on_hyphens=False)
    out += ["", "Per device"]
    rows = [
        [
            label,
            _human_bytes(r.param_bytes.get(label, 0)),
            _human_bytes(r.activation_bytes.get(label, 0)),
            f"{r.flops.get(label, 0) / 1e6:,.2f}",
        ]
        for label in r.devices
    ]
    rows.append(
        [
            "max/mean",
            f"{r.imbalance['param_bytes']:.2f}",
            f"{r.imbalance['activation_bytes']:.2f}",
            f"{r.imbalance['flops']:.2f}",
        ]
    )
    out += _table(["device", "parameters", "activations (est.)", "MFLOPs (fwd)"], rows, [12, 12, 18, 14])
    out += ["", "Communication (elements each device sends, ring algorithms)"]
    rows = [
        [
            c.name,
            c.kind + (" (io)" if c.io else ""),
            _human_count(c.elements),
            _human_count(c.forward),
            c.backward_kind or "-",
            _human_count(c.backward),
            _where(c.source),
        ]
        for c in r.collectives
    ]
    out += _table(
        ["node", "kind", "S", "forward", "backward kind", "backward", "from"], rows, [26, 15, 11, 11, 13, 11, 19]
    )
    sized = all(c.forward is not None for c in r.collectives if not c.io)  # else the totals are unknown, not 0
    io_sized = all(c.forward is not None for c in r.collectives if c.io)
    out.append(
        f"  collectives: forward {_human_count(r.comm_elements_forward if sized else None)}, backward "
        f"{_human_count(r.comm_elements_backward if sized else None)}, total "
        f"{_human_count(r.comm_elements if sized else None)} elements per device"
    )
    out.append(
        f"  inputs on / outputs back (io): forward {_human_count(r.io_elements_forward if io_sized else None)}, backward "
        f"{_human_count(r.io_elements_backward if io_sized else None)}, total {_human_count(r.io_elements if io_sized else None)}"
    )
    if r.context_parallel:
        cp = r.context_parallel
        out += ["", f"Context parallel: '{cp['dimension']}' of size {cp['size']} splits the sequence (dim "
                    f"{cp['sequence_dim']}); exchange: {cp['exchange']} at {len(cp['attention'])} attention call(s)"]  # fmt: skip
        out.append(f"  not chosen: {', '.join(cp['not_chosen'])}")
        for call in cp.get("calls", []):
            out.append(f"  {call['attention']}: {EXCHANGE_NAMES[call['exchange']]}")
            for name, cost in call["costs"].items():
                why = call["why_not"].get(name, "chosen" if name == call["exchange"] else "")
                out.append(f"    {EXCHANGE_NAMES[name]}: {cost['bytes_moved']:,} B moved in {cost['messages']} messages, "
                           f"{cost['transient_bytes']:,} B transient, {cost['seconds'] * 1e3:.3g} ms: {why}")  # fmt: skip
        per_device = ", ".join(f"{d} {_human_bytes(b)}" for d, b in cp["activation_bytes"].items())
        out.append(f"  activations per device (est.): {per_device}")
        balance = cp.get("load_balance")
        if balance:
            shares = ", ".join(f"{d} {share:.0%}" for d, share in (balance["shares"] or {}).items())
            out.append(f"  causal load balancing: {'on' if balance['on'] else 'off'} ({balance['why']})"
                       + (f"; attention work per device: {shares}" if shares else ""))  # fmt: skip
    if r.sequence_parallel:
        sp = r.sequence_parallel
        out += ["", f"Sequence parallel on '{sp['dimension']}': the sequence (dim {sp['sequence_dim']}) split between the "
                    f"pairs; {len(sp['reduce_scatters'])} reduce-scatter(s), {len(sp['all_gathers'])} all-gather(s)"]  # fmt: skip
        per_device = ", ".join(
            f"{d} {_human_bytes(b)} (without {_human_bytes(sp['activation_bytes_without'][d])})"
            for d, b in sp["activation_bytes"].items()
        )
        out.append(f"  activations per device (est.): {per_device}")
        if sp.get("reduce_scatter") == "all_reduce_then_slice":
            out.append("  reduce-scatter as an all-reduce and each rank's slice: the gloo fallback (gloo's own "
                       "reduce-scatter measured slower; nccl runs a real one)")  # fmt: skip
    if r.splits_batch:
        fraction = "?" if r.split_flop_fraction is None else f"{100 * r.split_flop_fraction:.1f}%"
        out += ["", f"Split across devices: {fraction} of forward FLOPs"]
        if r.whole:
            out.append("  runs whole, on the gathered batch (teach an op with dpcompile.register_batch_rule):")
            rows = [[w["node"], _human_count(w.get("flops")), w["reason"], _where(w.get("source"))] for w in r.whole]
            out += _table(["node", "FLOPs", "reason", "source"], rows, [26, 13, 56, 19])
    if r.random.get("exact") or r.random.get("per_device"):
        out += ["", "Random ops"]
        if r.random.get("exact"):
            out += textwrap.wrap(f"single-device values (exact_random=True; each site draws its whole tensor once and "
                                 f"each device takes its slice): {', '.join(r.random['exact'])}", WIDTH,
                                 initial_indent="  ", subsequent_indent="    ")  # fmt: skip
        if r.random.get("note"):
            out += textwrap.wrap(r.random["note"], WIDTH, initial_indent="  ", subsequent_indent="    ")
    if r.pipeline:
        out += _render_pipeline(r.pipeline)
    if r.checkpoint_regions:
        paths = list(dict.fromkeys(r.checkpoint_regions.values()))
        out += ["", f"Recomputed in backward (activation checkpointing): {len(r.checkpoint_regions)} regions of "
                    f"{', '.join(paths)}"]  # fmt: skip
    if r.memory_estimate:
        out += ["", "Memory estimate (bytes each device needs)"]
        kinds = ("parameters", "gradients", "optimizer", "activations")
        rows = [
            [d, *(_human_bytes(m.get(k, 0)) for k in kinds), _human_bytes(sum(m.values()))]
            for d, m in r.memory_estimate.items()
        ]
        out += _table(["device", *kinds, "total"], rows, [12, 12, 12, 12, 12, 12])
    if r.candidates:
        out += ["", "Layouts considered (plan=\"auto\": the fastest predicted that fits; activation_checkpointing="
                "\"auto\" alone: the least recomputed; memory_per_device= alone: data parallel where it fits)"]
        out += _table(["layout", "peak/device", "step", "why not"], [_candidate_row(c) for c in r.candidates],
                      [40, 12, 12, 70])  # fmt: skip
        source = r.candidates[0].get("budget", "memory_per_device=")
        if source != "memory_per_device=":  # plan="auto" without a budget: what it planned for
            out += textwrap.wrap(f"Budget: {source}", WIDTH, initial_indent="  ", subsequent_indent="    ")
    if r.plan:
        out += ["", "Tensor-parallel plan"]
        rows = []
        for path, style in r.plan.items():
            reason = textwrap.wrap(r.plan_reasons.get(path, ""), 80) or [""]
            rows.append([path, style, reason[0]])
            rows += [["", "", more] for more in reason[1:]]
        out += _table(["module", "style", "reason"], rows, [24, 10, 80])
    out += ["", "Nodes"]
    rows = [
        [
            i.name,
            i.op.replace("call_", ""),
            i.target,
            i.device,
            _shape_text(i),
            ",".join(sorted(set(i.dtype or []))) or "-",
            _where(i.source),
        ]
        for i in r.nodes
    ]
    out += _table(["node", "op", "target", "device", "shape", "dtype", "source"], rows, [26, 11, 19, 8, 16, 7, 19])
    return "\n".join(out)
