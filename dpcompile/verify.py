"""Check a :class:`~dpcompile.ParallelModule` against the eager model it came from.

``verify(pm, model, *args)`` runs both, forward and backward, and compares outputs, parameter
gradients, input gradients and buffers (BatchNorm running statistics) with dtype-aware
tolerances. It leaves no trace: gradients, buffers, dropout modes and the RNG state are
restored afterwards. ``fake_devices=8`` also checks the layout of an 8-GPU program on a
machine without them, with fake CUDA tensors (``FakeTensorMode``): an op that mixes devices
raises, and every per-device value must sit on its own device.

>>> import torch, dpcompile
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
>>> pm = dpcompile.transform(model, ["cpu", "cpu"])
>>> result = dpcompile.verify(pm, model, torch.randn(6, 8))
>>> bool(result)
True
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dpcompile.devices import Devices
from dpcompile.fake import FakeCudaOnCpuTorch, fake_copy
from dpcompile.fake import fake_devices as fake_devices_of
from dpcompile.fx_utils import bind_inputs, copy_graph, graph_module
from dpcompile.inspect import Recorder, slot_of, user_source
from dpcompile.recipes import DataParallelRecipe, TensorParallelRecipe
from dpcompile.runtime.structures import map_structure, tensor_leaves

log = logging.getLogger("dpcompile")

__all__ = ["Mismatch", "VerifyResult", "check_layout", "default_tolerance", "verify"]

#: (rtol, atol) per dtype. Looser than ``torch.testing``'s defaults for low precision, because
#: a multi-device program sums partial results in another order.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
    torch.complex64: (1e-4, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` used for ``dtype``; exact (0, 0) for integer and bool tensors.

    >>> default_tolerance(torch.float16)
    (0.01, 0.001)
    """
    return TOLERANCES.get(dtype, (1e-4, 1e-5) if dtype.is_floating_point else (0.0, 0.0))


@dataclass
class Mismatch:
    """One difference: ``kind`` is output, gradient, input gradient, buffer, structure or layout.

    ``judgement``: where a float64 reference run judged a low-precision difference, "rounding"
    or "real", with the errors it compared (``error64``: pm's RMS error against float64,
    ``eager_error64``: the eager model's in the same precision)."""

    kind: str
    name: str
    detail: str
    max_abs: float | None = None
    max_rel: float | None = None
    judgement: str | None = None
    error64: float | None = None
    eager_error64: float | None = None

    def __str__(self) -> str:
        text = f"{self.kind} {self.name}: {self.detail}"
        if self.judgement is not None:
            text += (
                f" [{self.judgement}: RMS error against float64 {self.error64:.3g}, the eager model's "
                f"{self.eager_error64:.3g}]"
            )
        return text


@dataclass
class VerifyResult:
    """Truthy when everything matched; ``str()`` says what was checked, or what differs.

    >>> VerifyResult(ok=True, mismatches=[], checked={"outputs": 1})
    VerifyResult(ok=True, mismatches=[], checked={'outputs': 1}, notes=[])
    """

    ok: bool
    mismatches: list[Mismatch]
    checked: dict[str, int]
    notes: list[str] = field(default_factory=list)
    #: differences beyond the dtype's tolerance that a float64 reference run shows to be rounding
    #: (pm is no farther from float64 than the eager model in the same precision)
    rounding: list[Mismatch] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        counts = ", ".join(f"{v} {k}" for k, v in self.checked.items() if v)
        if self.ok:
            lines = [f"verify: OK ({counts or 'nothing to compare'} match)"]
        else:
            lines = [f"verify: MISMATCH in {len(self.mismatches)} of the compared values ({counts})"]
            lines += [f"  {m}" for m in self.mismatches]
        if self.rounding:
            lines.append(
                f"  rounding: {len(self.rounding)} value(s) differ beyond the dtype's tolerance, but no more "
                "from a float64 run than the eager model does (judged rounding, not a mismatch):"
            )
            lines += [f"    {m}" for m in self.rounding]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "mismatches": [vars(m) for m in self.mismatches],
            "checked": dict(self.checked),
            "notes": list(self.notes),
            "rounding": [vars(m) for m in self.rounding],
        }


# ------------------------------------------------------------------------------- comparing
def compare_tensors(
    kind: str, name: str, expected: torch.Tensor | None, actual: torch.Tensor | None,
    rtol: float | None = None, atol: float | None = None,
) -> Mismatch | None:
    """None when ``actual`` matches ``expected``, else a :class:`Mismatch` showing the numbers."""
    if expected is None and actual is None:
        return None
    if expected is None or actual is None:
        missing = "the parallel module" if actual is None else "the eager model"
        return Mismatch(kind, name, f"{missing} produced no value (None) where the other did")
    if tuple(expected.shape) != tuple(actual.shape):
        return Mismatch(kind, name, f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if expected.dtype != actual.dtype:
        return Mismatch(kind, name, f"dtype {actual.dtype}, expected {expected.dtype}")
    default_rtol, default_atol = default_tolerance(expected.dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    e = expected.detach().to("cpu")
    a = actual.detach().to("cpu")
    if not (e.is_floating_point() or e.is_complex()):
        bad = e != a
        if bad.any():
            index = tuple(int(i) for i in bad.nonzero()[0])
            return Mismatch(kind, name, f"{int(bad.sum())} of {e.numel()} elements differ; first at {index}: "
                            f"got {a[index].item()}, expected {e[index].item()}")
        return None
    e64, a64 = e.to(torch.complex128 if e.is_complex() else torch.float64), a.to(
        torch.complex128 if a.is_complex() else torch.float64
    )
    both_nan = torch.isnan(e64) & torch.isnan(a64)
    difference = torch.where(both_nan, torch.zeros_like(e64.real if e.is_complex() else e64), (a64 - e64).abs())
    bound = atol + rtol * e64.abs()
    bad = (difference > bound) | (torch.isnan(difference) & ~both_nan)
    if not bad.any():
        return None
    excess = torch.where(bad, torch.nan_to_num(difference - bound, nan=float("inf")), torch.full_like(bound, -1.0))
    flat = int(excess.reshape(-1).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), e.shape)) if e.dim() else ()
    max_abs = float(torch.nan_to_num(difference, nan=float("inf")).max())
    max_rel = float((difference / e64.abs().clamp_min(1e-12)).max())
    where = f" at {list(index)}" if index else ""
    return Mismatch(
        kind, name,
        f"max |diff| {max_abs:.3g}{where} (got {a64[index].item():.6g}, expected {e64[index].item():.6g}); "
        f"{int(bad.sum())} of {e.numel()} elements beyond rtol={rtol:g} atol={atol:g} ({e.dtype})",
        max_abs=max_abs, max_rel=max_rel,
    )


def _compare_structures(expected: Any, actual: Any, rtol: float | None, atol: float | None) -> tuple[list[Mismatch], int]:
    e_leaves = dict(tensor_leaves(expected))
    a_leaves = dict(tensor_leaves(actual))
    if set(e_leaves) != set(a_leaves):
        return [Mismatch("structure", "output", f"tensor leaves {sorted(a_leaves)}, expected {sorted(e_leaves)}")], 0
    problems = [
        m for path, t in e_leaves.items()
        if (m := compare_tensors("output", f"output{path}", t, a_leaves[path], rtol, atol)) is not None
    ]
    other = _non_tensor_leaves(expected), _non_tensor_leaves(actual)
    if other[0] != other[1]:
        problems.append(Mismatch("output", "non-tensor values", f"got {other[1]!r}, expected {other[0]!r}"))
    return problems, len(e_leaves)


def _non_tensor_leaves(value: Any) -> list[Any]:
    found: list[Any] = []

    def visit(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) and isinstance(leaf, (int, float, str, bool, type(None))):
            found.append(leaf)
        return leaf

    try:
        map_structure(visit, value)
    except Exception:  # noqa: BLE001 - exotic containers: compare tensors only
        return []
    return found


# ------------------------------------------------------------------------ running cleanly
def _unique(tensors: Iterator[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


@contextlib.contextmanager
def _no_side_effects(*modules: nn.Module) -> Iterator[list[str]]:
    """Restore every parameter's ``.grad``, every buffer and every dropout's mode afterwards."""
    notes: list[str] = []
    params = _unique(p for m in modules for p in m.parameters())
    grads = [(p, p.grad) for p in params]
    buffers = [(b, b.detach().clone()) for b in _unique(b for m in modules for b in m.buffers())]
    dropouts = [
        d for d in _unique_modules(modules)
        if isinstance(d, nn.modules.dropout._DropoutNd) and d.training and d.p > 0
    ]
    if dropouts:
        notes.append(f"{len(dropouts)} dropout module(s) were switched to eval for the comparison (random masks cannot match)")
    for d in dropouts:
        d.eval()
    try:
        with torch.random.fork_rng(devices=[]):
            yield notes
    finally:
        for p, g in grads:
            p.grad = g
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
        for d in dropouts:
            d.train()


def _unique_modules(modules: Sequence[nn.Module]) -> list[nn.Module]:
    seen: dict[int, nn.Module] = {}
    for m in modules:
        for sub in m.modules():
            seen.setdefault(id(sub), sub)
    return list(seen.values())


def _restore(buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for b, value in buffers:
            b.copy_(value)


def _leaf_inputs(value: Any, device: torch.device | None) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """Copies of the inputs (float tensors as fresh leaves that collect gradients)."""
    leaves: list[torch.Tensor] = []

    def copy_leaf(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        t = leaf.detach().to(device) if device is not None else leaf.detach()
        t = t.clone()
        if t.is_floating_point():
            t.requires_grad_(True)
            leaves.append(t)
            return t.clone()  # a non-leaf, so in-place ops in the model stay legal
        return t

    copied = map_structure(copy_leaf, value)
    return copied, [(f"input[{i}]", t) for i, t in enumerate(leaves)]


def _loss(output: Any, weights: dict[str, torch.Tensor] | None) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """A fixed random projection of every differentiable output (the weights are made once)."""
    weights = {} if weights is None else weights
    total = None
    generator = torch.Generator().manual_seed(1234)
    for path, t in tensor_leaves(output):
        if not (t.requires_grad and (t.is_floating_point() or t.is_complex())):
            continue
        if path not in weights:
            weights[path] = torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.dtype)
        term = (t * weights[path].to(t.device)).sum().real.to(torch.float64)
        term = term.to("cpu")
        total = term if total is None else total + term
    return total, weights


def _run(module: nn.Module, args: tuple, kwargs: dict, device: torch.device | None, seed: int,
         weights: dict[str, torch.Tensor] | None) -> tuple[Any, list[tuple[str, torch.Tensor]], dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    (call_args, call_kwargs), inputs = _leaf_inputs((list(args), dict(kwargs)), device)
    output = module(*call_args, **call_kwargs)
    loss, weights = _loss(output, weights)
    if loss is not None:
        loss.backward()
    return output, inputs, weights


def _module_device(model: nn.Module) -> torch.device | None:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None


def _pm_gradients(pm: nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor | None]:
    """Gradients of ``pm`` under the model's parameter names (full tensors, shards gathered)."""
    if getattr(pm, "mode", None) == "data_parallel":
        own = dict(pm.named_parameters())
        return {n: (None if own.get(n) is None or own[n].grad is None else own[n].grad.detach().clone()) for n in names}
    # Tensor parallel: swap each shard's data for its gradient and let state_dict gather them.
    swapped = []
    with torch.no_grad():
        for p in _unique(pm.parameters()):
            swapped.append((p, p.data))
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
        try:
            gathered = pm.state_dict()
        finally:
            for p, data in swapped:
                p.data = data
    return {n: (gathered[n].detach().clone() if n in gathered else None) for n in names}


# ----------------------------------------------------------------------------------- verify
def verify(
    pm: nn.Module,
    model: nn.Module,
    *args: Any,
    fake_devices: int | Sequence[Any] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    **kwargs: Any,
) -> VerifyResult:
    """Run ``model`` and ``pm`` on the same inputs, forward and backward, and compare.

    Compares every output, every parameter gradient, the gradients of floating-point inputs
    and the buffers after the step (running statistics). Tolerances follow the dtype
    (:data:`TOLERANCES`) unless ``rtol``/``atol`` are given. ``fake_devices=n`` (or a list of
    device strings) also builds the program for ``cuda:0..n-1`` on fake tensors and checks its
    layout (:func:`check_layout`).

    >>> import torch, dpcompile
    >>> model = torch.nn.Linear(4, 2)
    >>> pm = dpcompile.transform(model, ["cpu", "cpu"])
    >>> print(dpcompile.verify(pm, model, torch.randn(4, 4)))
    verify: OK (1 outputs, 2 parameter gradients, 1 input gradients match)
    """
    mismatches: list[Mismatch] = []
    checked = {"outputs": 0, "parameter gradients": 0, "input gradients": 0, "buffers": 0}
    seed = 0
    with _no_side_effects(model, pm) as notes:
        model_buffers = [(b, b.detach().clone()) for b in _unique(b for m in (model, pm) for b in m.buffers())]
        for p in _unique(p for m in (model, pm) for p in m.parameters()):
            p.grad = None
        expected, expected_inputs, weights = _run(model, args, kwargs, _module_device(model), seed, None)
        param_names = [n for n, p in model.named_parameters() if p.requires_grad]
        own = dict(model.named_parameters())
        expected_grads = {n: None if own[n].grad is None else own[n].grad.detach().clone() for n in param_names}
        expected_buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        for p in _unique(p for m in (model, pm) for p in m.parameters()):
            p.grad = None
        _restore(model_buffers)

        actual, actual_inputs, _ = _run(pm, args, kwargs, None, seed, weights)
        actual_grads = _pm_gradients(pm, param_names)
        pm_state = pm.state_dict()
        actual_buffers = {n: pm_state.get(n) for n in expected_buffers}

        problems, count = _compare_structures(expected, actual, rtol, atol)
        mismatches += problems
        checked["outputs"] = count
        for name in param_names:
            e, a = expected_grads[name], actual_grads[name]
            if e is None and a is not None and not a.any():
                a = None
            m = compare_tensors("gradient", name, e, a, rtol, atol)
            if m is not None:
                mismatches.append(m)
            checked["parameter gradients"] += 1
        for (name, e), (_, a) in zip(expected_inputs, actual_inputs):
            m = compare_tensors("input gradient", name, e.grad, a.grad, rtol, atol)
            if m is not None:
                mismatches.append(m)
            checked["input gradients"] += 1
        for name, e in expected_buffers.items():
            a = actual_buffers[name]
            if a is None:
                mismatches.append(Mismatch("buffer", name, "missing from pm.state_dict()"))
            elif (m := compare_tensors("buffer", name, e, a, rtol, atol)) is not None:
                mismatches.append(m)
            checked["buffers"] += 1
        rounding: list[Mismatch] = []
        if any(m.kind in _JUDGED and m.max_abs is not None for m in mismatches):
            _restore(model_buffers)
            reference = _float64_reference(model, args, kwargs, seed, weights, param_names, notes)
            if reference is not None:
                values = {"output": (dict(tensor_leaves(expected)), dict(tensor_leaves(actual)), "output"),
                          "gradient": (expected_grads, actual_grads, ""),
                          "input gradient": ({n: t.grad for n, t in expected_inputs}, {n: t.grad for n, t in actual_inputs}, ""),
                          "buffer": (expected_buffers, actual_buffers, "")}  # fmt: skip
                mismatches, rounding = _judge(mismatches, values, reference)
        result_notes = list(notes)
    if fake_devices is not None:
        layout = check_layout(pm, model, fake_devices, *args, **kwargs)
        mismatches += layout.mismatches
        result_notes += layout.notes
        checked.update({k: v for k, v in layout.checked.items() if v})
    return VerifyResult(ok=not mismatches, mismatches=mismatches, checked=checked, notes=result_notes, rounding=rounding)


# ---------------------------------------------------------------- rounding against float64
_JUDGED = ("output", "gradient", "input gradient", "buffer")
_LOW_PRECISION = (torch.float32, torch.float16, torch.bfloat16, torch.complex64)
#: pm may be this many times farther (RMS) from the float64 run than the eager model in the same
#: precision, as torch's own accuracy checks for compiled code allow
ROUNDING_MULTIPLIER = 2.0


def _as_float64(value: Any) -> Any:
    def convert(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.detach().to(torch.float64)
        if isinstance(leaf, torch.Tensor) and leaf.is_complex():
            return leaf.detach().to(torch.complex128)
        return leaf

    return map_structure(convert, value)


def _float64_reference(
    model: nn.Module, args: tuple, kwargs: dict, seed: int, weights: dict[str, torch.Tensor],
    param_names: Sequence[str], notes: list[str],
) -> dict[str, dict[str, torch.Tensor | None]] | None:
    """The eager model run in float64 (a copy), forward and backward, as the reference that
    judges low-precision differences; None (with a note) where it cannot run."""
    try:
        model64 = copy.deepcopy(model).to(torch.float64)
        (args64, kwargs64) = _as_float64((list(args), dict(kwargs)))
        output, inputs, _ = _run(model64, tuple(args64), kwargs64, _module_device(model64), seed, weights)
    except Exception as e:  # noqa: BLE001 - the reference refines the verdict; without it the tolerances stand
        notes.append(f"no float64 reference run to judge rounding ({type(e).__name__}: {_line(e)})")
        return None
    own = dict(model64.named_parameters())
    return {
        "output": dict(tensor_leaves(output)),
        "gradient": {n: None if own[n].grad is None else own[n].grad.detach() for n in param_names if n in own},
        "input gradient": {n: t.grad for n, t in inputs},
        "buffer": {n: b.detach() for n, b in model64.named_buffers()},
    }


def _rms(a: torch.Tensor, b: torch.Tensor) -> float:
    difference = (a.detach().cpu().to(torch.complex128 if a.is_complex() else torch.float64) - b.detach().cpu()).abs()
    return float(difference.pow(2).mean().sqrt()) if difference.numel() else 0.0


def _judge(
    mismatches: list[Mismatch],
    values: dict[str, tuple[dict[str, Any], dict[str, Any], str]],
    reference: dict[str, dict[str, torch.Tensor | None]],
) -> tuple[list[Mismatch], list[Mismatch]]:
    """Split low-precision mismatches into real ones and rounding: a difference is rounding
    where pm's RMS error against the float64 run is within :data:`ROUNDING_MULTIPLIER` times
    the eager model's own (plus a tenth of the dtype's atol)."""
    real: list[Mismatch] = []
    rounding: list[Mismatch] = []
    for m in mismatches:
        if m.kind not in values or m.max_abs is None:
            real.append(m)
            continue
        expected, actual, prefix = values[m.kind]
        key = m.name[len(prefix):] if prefix and m.name.startswith(prefix) else m.name
        e, a, r = expected.get(key), actual.get(key), reference[m.kind].get(key)
        if not all(isinstance(t, torch.Tensor) for t in (e, a, r)) or e.dtype not in _LOW_PRECISION or r.shape != e.shape:
            real.append(m)
            continue
        m.error64, m.eager_error64 = _rms(a, r), _rms(e, r)
        if not (math.isfinite(m.error64) and math.isfinite(m.eager_error64)):
            m.judgement = "real"
            real.append(m)
            continue
        allowed = ROUNDING_MULTIPLIER * m.eager_error64 + default_tolerance(e.dtype)[1] / 10
        m.judgement = "rounding" if m.error64 <= allowed else "real"
        (rounding if m.judgement == "rounding" else real).append(m)
    return real, rounding


# ------------------------------------------------------------------------ fake multi-GPU
def _build_fake_program(pm: Any, fake_model: nn.Module, devices: Devices, example: tuple | None) -> fx.GraphModule:
    """``pm``'s program rebuilt for ``devices`` (fake CUDA devices) on a fake copy of the model."""
    recipe = pm.recipe
    if isinstance(recipe, DataParallelRecipe) and pm.captured is not None:
        gm = graph_module(fake_model, copy_graph(pm.captured.graph), "FakeLayout")
        return dataclasses.replace(recipe, devices=devices, output_device=devices.primary).lower(gm, devices, pm.input_dims)
    if isinstance(recipe, TensorParallelRecipe):
        fake_recipe = dataclasses.replace(
            recipe, devices=devices, output_device=devices.primary, plan=dict(pm.plan) or True, check_available=False
        )
        return fake_recipe.compile(fake_model, example)
    raise ValueError(f"fake_devices= supports data-parallel and tensor-parallel modules, not mode {pm.mode!r}")


def check_layout(pm: nn.Module, model: nn.Module, fake_devices: int | Sequence[Any], *args: Any, **kwargs: Any) -> VerifyResult:
    """Build ``pm``'s program for fake CUDA devices and run it forward and backward on fake tensors.

    Fails when an op mixes devices, when a per-device value (``*_dev{k}``) is not on device
    ``k``, when the output is not on ``cuda:0`` or when a gradient lands on another device than
    its parameter. Needs no GPU.

    >>> import torch, dpcompile
    >>> model = torch.nn.Linear(4, 2)
    >>> pm = dpcompile.transform(model, ["cpu", "cpu"])
    >>> from dpcompile.verify import check_layout
    >>> bool(check_layout(pm, model, 8, torch.randn(16, 4)))
    True
    """
    devices = fake_devices_of(fake_devices)
    label = f"fake {len(devices)}-device layout"
    checked = {"fake devices": len(devices)}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    batch = pm.batch_size(tuple(args), dict(kwargs))
    # Autograd on fake CUDA tensors aborts the process on a torch built without CUDA, so the
    # backward pass is only checked where the devices really exist.
    backward = torch.cuda.is_available() and torch.cuda.device_count() >= len(devices)
    grad_mode = contextlib.nullcontext() if backward else torch.no_grad()
    try:
        fake_model = fake_copy(model, mode, devices.primary)
        with mode, grad_mode, FakeCudaOnCpuTorch(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
            # The call's own arguments as example inputs, so the plan's views are checked as pm's were
            example = None if kwargs else tuple(
                mode.from_tensor(x.detach()).to(devices.primary) if isinstance(x, torch.Tensor) else x for x in args
            )
            if batch is not None and batch < len(devices):
                devices = devices.prefix(batch)
            program = _build_fake_program(pm, fake_model, devices, example)
    except ImportError:
        raise
    except Exception as e:  # noqa: BLE001 - report, do not crash
        return VerifyResult(False, [Mismatch("layout", label, f"cannot build the program: {type(e).__name__}: {_line(e)}")],
                            checked)
    mismatches: list[Mismatch] = []
    try:
        with mode, grad_mode, FakeCudaOnCpuTorch():
            inputs = [
                mode.from_tensor(x.detach()).to(devices.primary) if isinstance(x, torch.Tensor) else x
                for x in bind_inputs(program, args, kwargs)
            ]
            recorder = Recorder(program, None)
            output = recorder.run(*inputs)
            loss = None
            for _, t in tensor_leaves(output) if backward else []:
                if t.requires_grad and t.is_floating_point():
                    term = t.sum()
                    loss = term if loss is None else loss + term.to(loss.device)
            if loss is not None:
                loss.backward()
    except Exception as e:  # noqa: BLE001 - a mixed-device op is exactly what this check is for
        node = recorder.current if "recorder" in locals() else None
        where = ""
        if node is not None:
            source = user_source(node)
            where = f" at node {node.name}" + (f" ({source})" if source else "")
        return VerifyResult(False, [Mismatch("layout", label, f"{type(e).__name__}{where}: {_line(e)}")], checked)
    n = len(devices)
    for node in program.graph.nodes:
        slot = slot_of(node)
        if slot is None or slot >= n:
            continue
        wrong = [d for d in recorder.devices.get(node.name, []) if torch.device(d) != devices[slot]]
        if wrong:
            mismatches.append(Mismatch("layout", node.name, f"is on {wrong[0]}, expected {devices[slot]} (slot {slot})"))
    for path, t in tensor_leaves(output):
        if t.device != devices.primary:
            mismatches.append(Mismatch("layout", f"output{path}", f"is on {t.device}, expected {devices.primary}"))
    for name, p in program.named_parameters():
        if p.grad is not None and p.grad.device != p.device:
            mismatches.append(Mismatch("layout", name, f"gradient on {p.grad.device}, parameter on {p.device}"))
    checked["placed nodes"] = sum(1 for node in program.graph.nodes if slot_of(node) is not None)
    notes = [] if backward else [f"{label}: forward checked; backward needs the devices (autograd cannot run on fake CUDA here)"]
    return VerifyResult(not mismatches, mismatches, checked, notes)


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
