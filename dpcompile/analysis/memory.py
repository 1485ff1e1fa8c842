"""What a program needs per device: parameters, gradients, optimizer state and activations.

:func:`activation_bytes` runs forward on fake tensors (no memory, no compute) and counts the
tensors autograd saves for backward (``training=True``) or the peak of the tensors alive at once
(``training=False``), without parameters or inputs. :func:`optimizer_bytes` is the state
``torch.optim`` keeps: ``"sgd"`` none (plain SGD, no momentum: pass ``"sgd_momentum"`` for one
buffer per parameter), ``"adamw"`` / ``"adam"`` two buffers per parameter in the parameter's own dtype (``exp_avg``,
``exp_avg_sq``: ``torch.zeros_like(p)``, so bf16 parameters keep bf16 state) and a float32
``step`` each.

:class:`MemoryEstimate` holds the four kinds per device; :func:`choose_strategy` picks the first
candidate (in the order that moves the fewest bytes: data parallel, then tensor parallel, then
pipeline stages where given) whose every device fits its budget; :func:`dpcompile.planning.no_fit_error`
says how many devices, or how large a budget, would fit.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dpcompile.errors import ArgumentError, DpCompileError
from dpcompile.runtime.kept import functional_call
from dpcompile.runtime.recompute import kept_now

__all__ = [
    "KINDS",
    "MemoryEstimate",
    "activation_bytes",
    "choose_strategy",
    "format_budget_up",
    "format_bytes",
    "optimizer_bytes",
    "parse_budget",
]

KINDS = ("parameters", "gradients", "optimizer", "activations")
_OPTIMIZER_BUFFERS = {None: 0, "sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


@dataclasses.dataclass
class MemoryEstimate:
    """Bytes per device by kind: ``{device label: {"parameters": b, "gradients": b, "optimizer": b,
    "activations": b}}``; ``what`` says how activations were counted."""

    per_device: dict[str, dict[str, int]]
    optimizer: str | None = None
    training: bool = True
    what: str = ""
    #: of the peak device's bytes (activations aside), those it holds whatever the device count
    #: (a tensor-parallel program's replicated parameters, with their gradients and state)
    whole: int = 0
    #: ``memory_per_device=`` without a layout: the planner's rows of what was weighed (explain's candidates)
    considered: list[Any] = dataclasses.field(default_factory=list, repr=False, compare=False)

    def total(self, device: str) -> int:
        return sum(self.per_device[device].values())

    @property
    def peak(self) -> int:
        """The most any device needs."""
        return max((self.total(d) for d in self.per_device), default=0)

    def to_dict(self) -> dict[str, Any]:
        return {"per_device": {d: {**kinds, "total": sum(kinds.values())} for d, kinds in self.per_device.items()},
                "optimizer": self.optimizer, "training": self.training, "activations_counted": self.what}  # fmt: skip

    def table(self) -> str:
        rows = [f"  {'device':<12}" + "".join(f"{k:>14}" for k in (*KINDS, "total"))]
        for device, kinds in self.per_device.items():
            cells = [format_bytes(kinds[k]) for k in KINDS] + [format_bytes(sum(kinds.values()))]
            rows.append(f"  {device:<12}" + "".join(f"{c:>14}" for c in cells))
        return "\n".join(rows)


def parse_budget(budget: Any) -> int:
    """``"24GiB"``, ``"1.5 GB"``, ``"512MiB"`` or an int of bytes, as bytes."""
    if isinstance(budget, bool):
        raise ArgumentError(f"memory_per_device={budget!r}: expected bytes (an int) or a size such as '24GiB'")
    if isinstance(budget, numbers.Real) and not isinstance(budget, str):  # 1e9, numpy's int64: bytes
        if not math.isfinite(budget) or budget < 1:
            raise ArgumentError(f"memory_per_device={budget}: a budget must be a positive, finite number of bytes")
        return int(budget)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?\s*", str(budget).lower())
    if not isinstance(budget, str) or match is None:
        raise ArgumentError(f"memory_per_device={budget!r}: expected bytes (an int) or a size such as '24GiB', '512MB'")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_budget_up(n: int) -> str:
    """``n`` bytes as a size that :func:`parse_budget` reads back as at least ``n`` (rounded up,
    never down: a budget suggested to a user must fit when passed back)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            hundredths = -(-n * 100 // size)
            while parse_budget(f"{hundredths / 100:.2f} {unit}") < n:
                hundredths += 1
            return f"{hundredths / 100:.2f} {unit}"
    return f"{int(n)} B"


def optimizer_bytes(params: Iterable[torch.Tensor], optimizer: str | None) -> int:
    """Bytes of the state ``optimizer`` keeps for ``params`` (those that require grad)."""
    if optimizer not in _OPTIMIZER_BUFFERS:
        raise ArgumentError(f"optimizer={optimizer!r}: expected None, 'sgd', 'sgd_momentum', 'adam' or 'adamw'")
    buffers = _OPTIMIZER_BUFFERS[optimizer]
    total = 0
    for p in params:
        if p.requires_grad and buffers:
            state = p.numel() * p.element_size()  # torch.zeros_like(p): the parameter's own dtype (bf16: 2 bytes)
            total += buffers * state + (4 if optimizer in ("adam", "adamw") else 0)  # `step`: a float32 scalar
    return total


def activation_bytes(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, *,
                     training: bool = True) -> int:  # fmt: skip
    """Bytes of activations of ``model(*args, **kwargs)`` on fake copies of its parameters,
    buffers and arguments (no memory, no compute).

    ``training``: the tensors autograd saves for backward (unique storages; parameters, buffers,
    inputs and their views left out), what a training step holds at the end of forward.
    Otherwise the peak of the bytes of op outputs alive at once during forward (no graph kept).
    """
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    tensors = [t for t in [*model.parameters(), *model.buffers(), *args, *(kwargs or {}).values()] if isinstance(t, torch.Tensor)]
    # already fake (a layout checked on fake CUDA devices): run in their mode, a second one would mix modes
    mode = detect_fake_mode(tensors) or FakeTensorMode(allow_non_fake_inputs=True)
    if training and not torch.cuda.is_available() and any(t.device.type == "cuda" for t in tensors):
        raise DpCompileError(  # autograd on fake CUDA tensors aborts a CPU-only build of PyTorch
            "the activations of a training step on CUDA tensors cannot be counted without CUDA: "
            "pass training=False, or count on CPU tensors of the same shapes"
        )

    # a model on meta (built under torch.device("meta")) runs on fake copies on its inputs' device
    target = next((t.device for t in [*args, *(kwargs or {}).values()] if isinstance(t, torch.Tensor) and not t.is_meta),
                  next((t.device for t in tensors if not t.is_meta), None))  # fmt: skip

    fake = faker(mode, target)
    state = {name: fake(t) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    fake_args = [fake(a) for a in args]
    fake_kwargs = {k: fake(v) for k, v in (kwargs or {}).items()}
    held = [*state.values(), *fake_args, *fake_kwargs.values()]
    excluded = {_storage_key(v) for v in held if isinstance(v, torch.Tensor)}
    saved: dict[int, int] = {}
    live = {"now": 0, "peak": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in excluded:
            saved[key] = max(saved.get(key, 0), t.untyped_storage().nbytes())
        return t

    class Live(TorchDispatchMode):
        seen: dict[int, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and _storage_key(t) not in self.seen and _storage_key(t) not in excluded:
                    size = t.untyped_storage().nbytes()
                    self.seen[_storage_key(t)] = size
                    live["now"] += size
                    live["peak"] = max(live["peak"], live["now"])
                    weakref.finalize(t, _release, live, size)
            return out

    class Kept(TorchDispatchMode):
        """What a selective checkpoint keeps for backward: its own store, not autograd's saved tensors."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if kept_now(func):
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        pack(t)
            return out

    grad = torch.enable_grad() if training else torch.no_grad()
    with mode, grad, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if training:
            with Kept():
                functional_call(model, state, tuple(fake_args), fake_kwargs)
        else:
            with Live():
                functional_call(model, state, tuple(fake_args), fake_kwargs)
    return sum(saved.values()) if training else live["peak"]


def faker(mode: Any, target: torch.device | None) -> Any:
    """``fake(v)``: a tensor as a fake tensor of ``mode`` (a meta one on ``target``, the inputs'
    device); fake tensors and other values as they are."""
    from torch._subclasses.fake_tensor import FakeTensor

    def fake(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or isinstance(v, FakeTensor):
            return v
        if v.is_meta and target is not None:
            with mode:
                return mode.from_tensor(v).to(target)
        if v.numel() == 1 and not v.is_meta and not v.requires_grad:
            # a one-value buffer forward reads as a number (BatchNorm's momentum=None factor is
            # 1 / num_batches_tracked): a fake holding a copy of its value, so .item() works and
            # the fake run's writes (the count's += 1) stay off the model
            return mode.fake_tensor_converter.from_real_tensor(mode, v.detach().clone(), make_constant=True)
        return mode.from_tensor(v)

    return fake


def _release(live: dict[str, int], size: int) -> None:
    live["now"] -= size


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def choose_strategy(candidates: Mapping[str, MemoryEstimate | None], budgets: Mapping[str, int]) -> str | None:
    """The first candidate (in the given order: fewest bytes moved first) where every device's
    total fits its budget; None where none does."""
    for name, estimate in candidates.items():
        if estimate is not None and all(estimate.total(d) <= budgets[d] for d in estimate.per_device):
            return name
    return None


def parameter_kinds(params: Sequence[torch.Tensor], optimizer: str | None, training: bool) -> dict[str, int]:
    """Parameters, gradients and optimizer state of ``params``, in bytes (no activations)."""
    unique = list({id(p): p for p in params}.values())
    return {
        "parameters": sum(p.numel() * p.element_size() for p in unique),
        "gradients": sum(p.numel() * p.element_size() for p in unique if p.requires_grad) if training else 0,
        "optimizer": optimizer_bytes(unique, optimizer) if training else 0,
    }
