"""See what a :class:`~dpcompile.ParallelModule` will run: ``explain``, ``draw`` and ``diff``.

``explain(pm, *args)`` propagates fake tensors through the generated program (no real compute,
no real memory; BatchNorm running statistics are never touched) and returns a
:class:`Report`: per node its device, output shape and dtype, the pass that made it and the
user's source line; per collective the elements each device sends under ring algorithms,
forward and backward; per device the parameter bytes, an activation-bytes estimate, a FLOPs
estimate and the imbalance between devices.

>>> import torch, dpcompile
>>> pm = dpcompile.transform(torch.nn.Linear(8, 4), ["cpu", "cpu"])
>>> report = dpcompile.explain(pm, torch.randn(16, 8))
>>> report.param_bytes
{'cpu#0': 144, 'cpu#1': 144}
>>> print(report)  # doctest: +SKIP

Device keys are ``Devices.labels()``: the device strings (``"cuda:0"``) when every device is
distinct, ``"<device>#<slot>"`` (``"cpu#0"``, ``"cpu#1"``) for virtual devices.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import operator
import re
import shutil
import subprocess
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.analysis.cost import RING_FACTOR, ring_elements
from dpcompile.errors import DpCompileError
from dpcompile.runtime.structures import tensor_leaves

log = logging.getLogger("dpcompile")

__all__ = ["CollectiveInfo", "NodeInfo", "Report", "diff", "draw", "explain"]

_SLOT = re.compile(r"_(?:dev|shard|rank)(\d+)$")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n(?P<code>[^\n]*)')
_TORCH_DIR = str(Path(torch.__file__).parent)
_OWN_DIRS = (str(Path(__file__).parent) + "/", str(Path(__file__).parent.parent / "passes") + "/")
ALL_DEVICES = "*"
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


# ----------------------------------------------------------------------------------- helpers
def _labels(pm: nn.Module) -> list[str]:
    devices = getattr(pm, "devices", None)
    if devices is None:
        return ["cpu"]
    if hasattr(devices, "labels"):
        return list(devices.labels())
    try:
        return [str(d) for d in devices]
    except TypeError:
        return [str(devices)]


def _device_list(pm: nn.Module) -> list[torch.device]:
    devices = getattr(pm, "devices", None)
    try:
        return [torch.device(d) for d in devices]  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - meshes and unknown layouts
        return [torch.device("cpu")]


def slot_of(node: fx.Node) -> int | None:
    """The device slot of a per-device node (``fc1_dev1`` → 1), else None."""
    slot = node.meta.get("dpcompile_slot")
    if isinstance(slot, int):
        return slot
    m = _SLOT.search(node.name)
    return int(m.group(1)) if m else None


def user_source(node: fx.Node) -> str | None:
    """``"model.py:42 in forward: h = self.fc1(x)"``: the user's frame in ``stack_trace``."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    for m in reversed(list(_FRAME.finditer(trace))):
        filename = m.group("file")
        own = filename.startswith(_OWN_DIRS) and not filename.endswith("demo.py")
        if own or filename.startswith(_TORCH_DIR + "/") or filename.startswith("<"):
            continue
        short = filename.rsplit("/", 1)[-1]
        return f"{short}:{m.group('line')} in {m.group('func')}: {m.group('code').strip()}"
    return None


def _target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None) or repr(target)
    if module.startswith("dpcompile.runtime"):
        return f"runtime.{name}"
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    if module.startswith("torch") or module == "":
        return f"torch.{name}" if not module.startswith("torch.nn.functional") else f"F.{name}"
    return f"{module}.{name}"


def _numel(value: Any) -> int:
    return sum(t.numel() for _, t in tensor_leaves(value))


def _param_elements(value: Any, grad_only: bool) -> int:
    """Elements of the parameters (and, forward, buffers) of the modules in ``value``."""
    seen: dict[int, int] = {}
    items = value.values() if isinstance(value, Mapping) else (value if isinstance(value, (list, tuple)) else [value])
    for item in items:
        if isinstance(item, nn.Module):
            tensors = list(item.parameters())
            if not grad_only:
                tensors += list(item.buffers())
            for t in tensors:
                if not grad_only or t.requires_grad:
                    seen[id(t)] = t.numel()
        elif isinstance(item, torch.Tensor):
            seen[id(item)] = item.numel()
    return sum(seen.values())


def _first_tensor(value: Any) -> torch.Tensor | None:
    leaves = tensor_leaves(value)
    return leaves[0][1] if leaves else None


def collective_sizes(node: fx.Node, args: tuple, kwargs: dict, result: Any) -> tuple[int, int]:
    """``(S forward, S backward)``: the full tensor's elements for a communication node.

    The rule of :mod:`dpcompile.analysis.cost`: a recorded ``dpcompile_comm_numel`` wins;
    else the node's own value for ``all_reduce``, ``all_gather``, ``gather``, ``reduce`` and
    its first argument for the other kinds (a list counts once when the kind copies or
    reduces, as the sum of its parts otherwise). Data-parallel specials: ``replicate``
    broadcasts parameters and buffers and reduces the parameters' gradients; the BatchNorm
    sync all-reduces a per-channel mean and variance.
    """
    from dpcompile import runtime

    comm = node.meta["dpcompile_comm"]
    if "dpcompile_comm_numel" in node.meta:
        size = int(node.meta["dpcompile_comm_numel"])
        return size, size
    if node.target is runtime.replicate:
        return _param_elements(args[0], False), _param_elements(args[0], True)
    if node.target is runtime.batch_norm:
        first = _first_tensor(result)
        channels = getattr(args[0], "num_features", None) or (first.size(1) if first is not None else 0)
        return 2 * channels, 2 * channels
    source = result if comm.kind in _OWN_VALUE_KINDS or not args else args[0]
    size = _numel_by_rule(source, comm.kind)
    return size, size


_OWN_VALUE_KINDS = ("all_reduce", "all_gather", "gather", "reduce")
_WHOLE_LIST_KINDS = ("identity", "broadcast", "all_reduce", "reduce")


def _numel_by_rule(value: Any, kind: str) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)) and value:
        parts = [_numel_by_rule(v, kind) for v in value]
        return parts[0] if kind in _WHOLE_LIST_KINDS else sum(parts)
    return _numel(value)


# ---------------------------------------------------------------------------- propagation
class _Recorder(fx.Interpreter):
    """Run the program once, recording a summary per node (not the values themselves)."""

    def __init__(self, gm: fx.GraphModule, flop_counter: Any | None):
        super().__init__(gm, garbage_collect_values=True)
        self.flop_counter = flop_counter
        self.summaries: dict[str, tuple[list[list[int]], list[str], int]] = {}
        self.flops: dict[str, int] = {}
        self.sizes: dict[str, tuple[int, int]] = {}
        self.devices: dict[str, list[str]] = {}
        self.current: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        before = self.flop_counter.get_total_flops() if self.flop_counter is not None else 0
        result = super().run_node(n)
        if self.flop_counter is not None:
            self.flops[n.name] = int(self.flop_counter.get_total_flops() - before)
        leaves = [t for _, t in tensor_leaves(result)] if n.op != "get_attr" else []
        self.summaries[n.name] = (
            [list(t.shape) for t in leaves],
            [str(t.dtype).replace("torch.", "") for t in leaves],
            sum(t.numel() * t.element_size() for t in leaves),
        )
        self.devices[n.name] = [str(t.device) for t in leaves]
        if "dpcompile_comm" in n.meta:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            try:
                self.sizes[n.name] = collective_sizes(n, args, kwargs, result)
            except Exception as e:  # noqa: BLE001 - a cost figure must not stop the explanation
                log.debug("cannot size collective %s: %s", n.name, e)
        return result


def _bind_inputs(gm: fx.GraphModule, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    values = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        name = str(node.target).lstrip("*")
        if i < len(args):
            values.append(args[i])
        elif name in kwargs:
            values.append(kwargs[name])
        elif node.args:
            values.append(node.args[0])
        else:
            raise TypeError(f"explain: missing argument '{name}' (the program takes {[str(p.target) for p in placeholders]})")
    return values


def _program(pm: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[fx.GraphModule, int | None]:
    """The program that a call with these arguments runs, and the call's batch size."""
    batch = pm.batch_size(tuple(args), dict(kwargs)) if getattr(pm, "_split_inputs", None) else None
    return pm.program_for_call(*args, **kwargs), batch


def _snapshot_buffers(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(b, b.detach().clone()) for b in module.buffers() if not _is_fake(b)]


def _restore_buffers(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buffer, value in saved:
            if not torch.equal(buffer, value):
                buffer.copy_(value)


def _is_fake(t: torch.Tensor) -> bool:
    return type(t).__name__ == "FakeTensor" or t.device.type == "meta"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _propagate(gm: fx.GraphModule, inputs: list[Any]) -> tuple[_Recorder | None, str]:
    from torch.utils.flop_counter import FlopCounterMode

    saved = _snapshot_buffers(gm)
    try:
        try:
            from torch._subclasses.fake_tensor import FakeTensorMode

            mode = FakeTensorMode(allow_non_fake_inputs=True)
            fake_inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
            with mode, FlopCounterMode(display=False) as counter:
                recorder = _Recorder(gm, counter)
                recorder.run(*fake_inputs)
            return recorder, "fake"
        except Exception as e:  # noqa: BLE001 - fall back to real (no-grad) propagation
            log.info("explain: fake-tensor propagation failed (%s: %s); running for real", type(e).__name__, _first_line(e))
        _restore_buffers(saved)
        try:
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                recorder = _Recorder(gm, counter)
                recorder.run(*inputs)
            return recorder, "real"
        except Exception as e:  # noqa: BLE001 - explain what can be explained without shapes
            log.warning("explain: shape propagation failed (%s: %s); reporting without shapes", type(e).__name__, _first_line(e))
            return None, "none"
    finally:
        _restore_buffers(saved)


# ---------------------------------------------------------------------------------- explain
def explain(pm: nn.Module, *args: Any, **kwargs: Any) -> Report:
    """Explain what ``pm(*args, **kwargs)`` runs, where, and what it moves between devices.

    Shapes come from fake tensors (no real compute); without arguments the report has no
    shapes, activation or communication figures, only placement and parameter bytes.

    >>> import torch, dpcompile
    >>> pm = dpcompile.transform(torch.nn.Linear(8, 4), ["cpu", "cpu"])
    >>> r = dpcompile.explain(pm, torch.randn(16, 8))
    >>> r.io_elements_forward  # the input scattered, the output gathered, each (N-1)/N*S
    96.0
    """
    labels = _labels(pm)
    n = len(labels)
    gm, batch = _program(pm, args, kwargs) if (args or kwargs) else (pm, None)
    if not isinstance(gm, fx.GraphModule):
        raise DpCompileError(f"explain needs a dpcompile.ParallelModule (a torch.fx.GraphModule), got {type(pm).__name__}")
    recorder, how = (None, "none")
    if args or kwargs:
        recorder, how = _propagate(gm, _bind_inputs(gm, args, kwargs))
    active = labels if batch is None or batch >= n else labels[:batch]
    n_active = len(active)

    nodes: list[NodeInfo] = []
    collectives: list[CollectiveInfo] = []
    activation = dict.fromkeys(labels, 0)
    flops = dict.fromkeys(labels, 0)
    from dpcompile import runtime

    for node in gm.graph.nodes:
        slot = slot_of(node)
        comm = node.meta.get("dpcompile_comm")
        if node.op in ("placeholder", "output"):
            device = "-"
        elif comm is not None:
            device = ALL_DEVICES
        elif slot is not None and slot < n:
            device = labels[slot]
        else:
            device = labels[0]
        summary = recorder.summaries.get(node.name) if recorder else None
        info = NodeInfo(
            name=node.name,
            op=node.op,
            target=_target_name(node),
            device=device,
            shape=summary[0] if summary else None,
            dtype=summary[1] if summary else None,
            bytes=summary[2] if summary else 0,
            flops=recorder.flops.get(node.name, 0) if recorder else 0,
            pass_name=node.meta.get("dpcompile_pass"),
            source=user_source(node),
            comm=comm.kind if comm is not None else None,
        )
        nodes.append(info)
        counts_as_activation = node.op in ("call_function", "call_method", "call_module") and node.target not in (
            operator.getitem,
            runtime.replicate,
            getattr,
        )
        if counts_as_activation and info.bytes:
            if device in activation:
                activation[device] += info.bytes
            elif comm is not None and comm.kind in ("gather", "reduce"):
                activation[labels[0]] += info.bytes
            else:
                for label in active:
                    activation[label] += info.bytes // n_active
        if info.flops:
            flops[device if device in flops else labels[0]] += info.flops
        if comm is not None:
            collectives.append(_collective(node, comm, recorder, n_active))

    ddp = _ddp_collective(pm)
    if ddp is not None:
        collectives.append(ddp)
    forward = sum(c.forward or 0.0 for c in collectives if not c.io)
    backward = sum(c.backward or 0.0 for c in collectives if not c.io)
    io_forward = sum(c.forward or 0.0 for c in collectives if c.io)
    io_backward = sum(c.backward or 0.0 for c in collectives if c.io)
    params = param_bytes(pm)
    return Report(
        mode=str(getattr(pm, "mode", "unknown")),
        devices=labels,
        shapes=how,
        nodes=nodes,
        collectives=collectives,
        comm_elements_forward=forward,
        comm_elements_backward=backward,
        io_elements=io_forward + io_backward,
        io_elements_forward=io_forward,
        io_elements_backward=io_backward,
        param_bytes=params,
        activation_bytes=activation,
        flops=flops,
        imbalance={
            "param_bytes": _imbalance(params),
            "activation_bytes": _imbalance(activation),
            "flops": _imbalance(flops),
        },
        plan=dict(getattr(pm, "plan", {}) or {}),
        plan_reasons={k: str(v) for k, v in (getattr(pm, "plan_reasons", {}) or {}).items()},
        batch=batch,
    )


def _collective(node: fx.Node, comm: Any, recorder: _Recorder | None, n: int) -> CollectiveInfo:
    n = node.meta.get("dpcompile_comm_world", n)  # SPMD: the size of this node's process group
    sizes = recorder.sizes.get(node.name) if recorder else None
    fwd = bwd = None
    if sizes is not None:
        fwd = ring_elements(comm.kind, sizes[0], n) if comm.kind in RING_FACTOR else 0.0
        bwd = ring_elements(comm.backward, sizes[1], n) if comm.backward in RING_FACTOR else 0.0
    return CollectiveInfo(
        name=node.name,
        kind=comm.kind,
        backward_kind=comm.backward,
        io=bool(comm.io),
        elements=sizes[0] if sizes else None,
        forward=fwd,
        backward=bwd,
        source=user_source(node),
    )


def _ddp_collective(pm: nn.Module) -> CollectiveInfo | None:
    """SPMD data parallel: DistributedDataParallel's gradient all-reduce, which runs in backward
    outside the generated code, over the parameters it does not ignore."""
    ddp = getattr(pm, "ddp", None)
    if ddp is None:
        return None
    from passes.collectives import group_size

    ignored = set(getattr(ddp, "parameters_to_ignore", ()))
    size = sum(p.numel() for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ignored)
    n = group_size(pm.mesh, pm.dp_dim) or 1
    return CollectiveInfo(
        name="ddp_gradients", kind="ddp", backward_kind="all_reduce", io=False, elements=size, forward=0.0,
        backward=ring_elements("all_reduce", size, n),
    )


def param_bytes(pm: nn.Module) -> dict[str, int]:
    """Parameter bytes each device holds, keyed by ``Devices.labels()``.

    Data parallel: every replica holds a full copy. Tensor parallel: each shard's bytes on its
    slot (``pm.shard_param_slots``), replicated parameters on every device.
    """
    labels = _labels(pm)
    out = dict.fromkeys(labels, 0)
    named = list(pm.named_parameters())
    if getattr(pm, "mode", None) == "data_parallel":
        total = sum(p.numel() * p.element_size() for _, p in named)
        return dict.fromkeys(labels, total)
    slots = getattr(pm, "shard_param_slots", None)
    devices = _device_list(pm)
    for name, p in named:
        size = p.numel() * p.element_size()
        if isinstance(slots, Mapping) and name in slots:
            slot = slots[name]
            targets = labels if slot is None else [labels[slot]]
        else:
            matching = [label for label, d in zip(labels, devices) if d == p.device]
            targets = matching[:1] or labels[:1]
        for label in targets:
            out[label] += size
    return out


def _imbalance(values: Mapping[str, float]) -> float:
    """``max / mean`` over devices: 1.0 is balanced, 2.0 means one device does twice the mean."""
    numbers = list(values.values())
    if not numbers or sum(numbers) == 0:
        return 1.0
    return round(max(numbers) / (sum(numbers) / len(numbers)), 4)


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


def _render(r: Report) -> str:
    title = (
        f"dpcompile explain: {r.mode} on {len(r.devices)} devices ({', '.join(r.devices)})"
        + (f", batch {r.batch}" if r.batch is not None else "")
        + f"; shapes from {'fake tensors' if r.shapes == 'fake' else 'a real no-grad run' if r.shapes == 'real' else 'nowhere (no inputs)'}"
    )
    out = [*textwrap.wrap(title, WIDTH, subsequent_indent="  ", break_on_hyphens=False), "", "Per device"]
    rows = [
        [label, _human_bytes(r.param_bytes.get(label, 0)), _human_bytes(r.activation_bytes.get(label, 0)),
         f"{r.flops.get(label, 0) / 1e6:,.2f}"]
        for label in r.devices
    ]
    rows.append(["max/mean", f"{r.imbalance['param_bytes']:.2f}", f"{r.imbalance['activation_bytes']:.2f}",
                 f"{r.imbalance['flops']:.2f}"])
    out += _table(["device", "parameters", "activations (est.)", "MFLOPs (fwd)"], rows, [12, 12, 18, 14])
    out += ["", "Communication (elements each device sends, ring algorithms)"]
    rows = [
        [c.name, c.kind + (" (io)" if c.io else ""), _human_count(c.elements), _human_count(c.forward),
         c.backward_kind or "-", _human_count(c.backward), _where(c.source)]
        for c in r.collectives
    ]
    out += _table(["node", "kind", "S", "forward", "backward kind", "backward", "from"], rows,
                  [26, 15, 11, 11, 13, 11, 19])
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
        [i.name, i.op.replace("call_", ""), i.target, i.device, _shape_text(i), ",".join(sorted(set(i.dtype or []))) or "-",
         _where(i.source)]
        for i in r.nodes
    ]
    out += _table(["node", "op", "target", "device", "shape", "dtype", "source"], rows, [26, 11, 19, 8, 16, 7, 19])
    return "\n".join(out)


# ------------------------------------------------------------------------------------ draw
_PALETTE = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5"]
_COMM_COLOR = "#e41a1c"


def _device_color(slot: int) -> str:
    return _PALETTE[slot % len(_PALETTE)]


def to_dot(pm: fx.GraphModule) -> str:
    """Graphviz source: one cluster per device, nodes coloured by device, collectives in red."""
    labels = _labels(pm)
    clusters: dict[int, list[str]] = {k: [] for k in range(len(labels))}
    loose: list[str] = []
    edges: list[str] = []

    def quote(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    for node in pm.graph.nodes:
        comm = node.meta.get("dpcompile_comm")
        slot = slot_of(node)
        label = f"{node.name}\\n{_target_name(node)}"
        if comm is not None:
            kind = comm.kind + (" (io)" if comm.io else "")
            attrs = (f'label="{node.name}\\n{kind}" shape=box style="filled,bold" fillcolor="#fde0dd" '
                     f'color="{_COMM_COLOR}" penwidth=2.5')
            loose.append(f"  {quote(node.name)} [{attrs}];")
        elif node.op in ("placeholder", "output"):
            loose.append(f'  {quote(node.name)} [label="{node.name}" shape=oval style=filled fillcolor="#f0f0f0"];')
        else:
            slot = slot if slot is not None and slot < len(labels) else 0  # whole values live on devices[0]
            clusters[slot].append(
                f'    {quote(node.name)} [label="{label}" style=filled fillcolor="{_device_color(slot)}"];'
            )
        for inp in node.all_input_nodes:
            edges.append(f"  {quote(inp.name)} -> {quote(node.name)};")
    lines = [
        "digraph dpcompile {",
        '  rankdir=TB; node [shape=box fontname="Helvetica" fontsize=10]; edge [color="#555555"];',
        f'  label="{getattr(pm, "mode", "")} on {", ".join(labels)}"; labelloc=t;',
    ]
    for slot, body in clusters.items():
        if not body:
            continue
        lines += [f"  subgraph cluster_{slot} {{",
                  f'    label="{labels[slot]}"; style="rounded,filled"; fillcolor="{_device_color(slot)}30";',
                  *body, "  }"]
    lines += loose + edges + ["}"]
    return "\n".join(lines) + "\n"


def draw(pm: fx.GraphModule, path: str | Path) -> Path:
    """Write a picture of ``pm``: SVG (or PNG, by suffix) via graphviz ``dot``, else PNG via matplotlib.

    One cluster per device, nodes coloured by device, collectives highlighted in red. Returns
    the path written (``.png`` replaces the suffix when matplotlib draws it); a ``.dot`` path
    writes the graphviz source only.

    >>> import torch, dpcompile
    >>> pm = dpcompile.transform(torch.nn.Linear(8, 4), ["cpu", "cpu"])
    >>> dpcompile.draw(pm, "/tmp/graph.svg")  # doctest: +SKIP
    PosixPath('/tmp/graph.svg')
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    source = to_dot(pm)
    if path.suffix == ".dot":
        path.write_text(source)
        return path
    dot = shutil.which("dot")
    if dot is not None:
        fmt = path.suffix.lstrip(".") or "svg"
        done = subprocess.run([dot, f"-T{fmt}", "-o", str(path)], input=source, text=True, capture_output=True)
        if done.returncode == 0:
            return path
        log.warning("dot failed (%s); drawing with matplotlib instead", done.stderr.strip()[:200])
    return _draw_matplotlib(pm, path.with_suffix(".png"))


def _draw_matplotlib(pm: fx.GraphModule, path: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        raise DpCompileError(
            "draw needs graphviz's 'dot' (apt-get install graphviz) or matplotlib "
            "(pip install 'dpcompile[pictures]'); neither is installed"
        ) from None
    labels = _labels(pm)
    columns = len(labels) + 1  # one per device, the last for collectives and whole values
    nodes = list(pm.graph.nodes)
    where: dict[str, tuple[float, float]] = {}
    for row, node in enumerate(nodes):
        slot = slot_of(node)
        if "dpcompile_comm" in node.meta or node.op in ("placeholder", "output"):
            column = len(labels)
        else:
            column = slot if slot is not None and slot < len(labels) else 0  # whole values live on devices[0]
        where[node.name] = (column, -row)
    fig, ax = plt.subplots(figsize=(3 + 2.2 * columns, max(4, 0.32 * len(nodes))))
    for node in nodes:
        x, y = where[node.name]
        for inp in node.all_input_nodes:
            x0, y0 = where[inp.name]
            ax.annotate("", xy=(x, y), xytext=(x0, y0), arrowprops={"arrowstyle": "->", "color": "#888888", "lw": 0.6})
    for node in nodes:
        x, y = where[node.name]
        comm = node.meta.get("dpcompile_comm")
        face = "#fde0dd" if comm else (_device_color(int(x)) if x < len(labels) else "#f0f0f0")
        edge = _COMM_COLOR if comm else "#333333"
        ax.text(x, y, node.name, ha="center", va="center", fontsize=7,
                bbox={"boxstyle": "round", "facecolor": face, "edgecolor": edge, "linewidth": 2 if comm else 0.8})
    for k, label in enumerate([*labels, "collectives / whole"]):
        ax.text(k, 1, label, ha="center", va="bottom", fontsize=9, weight="bold")
    ax.set_xlim(-0.8, columns - 0.2)
    ax.set_ylim(-len(nodes), 2)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------ diff
def diff(model: nn.Module | None, pm: fx.GraphModule) -> str:
    """The code before (the model as traced) and after (``pm.code``), as a unified diff.

    >>> import torch, dpcompile
    >>> model = torch.nn.Linear(8, 4)
    >>> pm = dpcompile.transform(model, ["cpu", "cpu"])
    >>> [line for line in dpcompile.diff(model, pm).splitlines() if "scatter(" in line][0][:40]
    '+    input_1_scatter = dpcompile_runtime'
    """
    if model is None:
        captured = getattr(pm, "captured", None)
        if captured is None:
            raise ValueError("diff(None, pm) needs a pm that kept its captured graph; pass the model")
        before = captured.code
    else:
        from dpcompile.capture import capture

        before = capture(model).code
    after = pm.code
    lines = difflib.unified_diff(
        before.strip("\n").splitlines(),
        after.strip("\n").splitlines(),
        fromfile=f"{type(model).__name__ if model is not None else 'captured'} (traced)",
        tofile=f"{type(pm).__name__} ({getattr(pm, 'mode', '')})",
        lineterm="",
    )
    return "\n".join(lines) + "\n"
