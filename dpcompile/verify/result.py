"""What verify reports: tolerances per dtype, a mismatch, the result, and the tensor comparison."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from dpcompile.errors import first_line
from dpcompile.runtime.structures import map_structure, tensor_leaves

log = logging.getLogger("dpcompile")

__all__ = ["TOLERANCES", "Mismatch", "VerifyResult", "compare_structures", "compare_tensors", "default_tolerance", "first_line"]

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


def compare_structures(expected: Any, actual: Any, rtol: float | None, atol: float | None) -> tuple[list[Mismatch], int]:
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


