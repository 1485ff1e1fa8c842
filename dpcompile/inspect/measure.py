"""``measure``: run one step of a program and report the peak bytes of each device and the step time,
beside ``explain``'s prediction.

On virtual devices (``["cpu"] * n``, a repeated ``"cuda:0"``) one allocator serves every device, so
each new storage is counted against the device of the node that made it: the program runs under an
``fx.Interpreter`` that names the running node's device (``label_slots``: its slot, and its dp copy's device), a ``TorchDispatchMode``
sees every storage an op creates, and a finalizer takes it off when it is freed. In backward the
slot is the one of the forward node whose autograd node is running, and the mode is on only while an
autograd node runs, so autograd sums gradients in place where a device does
(``dpcompile.inspect.measure_ledger``). On distinct CUDA devices the
allocator's own ``max_memory_allocated(d)`` is read instead.

>>> import torch, dpcompile
>>> pm = dpcompile.transform(torch.nn.Linear(8, 4), ["cpu", "cpu"])
>>> m = dpcompile.measure(pm, torch.randn(16, 8))
>>> sorted(m.peak_bytes)
['cpu#0', 'cpu#1']
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from dpcompile.errors import DpCompileError
from dpcompile.fx_utils import FreshArguments, bind_inputs
from dpcompile.inspect.explanation import explain, held_count, inspected_modules
from dpcompile.inspect.measure_1f1b import one_f_one_b_peaks, runs_one_f_one_b, stamp_slot
from dpcompile.inspect.measure_ledger import SLOT_KEY, SPREAD_KEY, BackwardWindows, Ledger, address
from dpcompile.inspect.nodes import copy_labels, device_list, label_slots, slot_of
from dpcompile.modules.call_errors import refused_call
from dpcompile.modules.executors import executor_of
from dpcompile.modules.fsdp_one_process import FsdpProgram
from dpcompile.modules.mesh_stage import MESH_PIPELINE_INSPECTION
from dpcompile.runtime import checkpoint
from dpcompile.runtime.kept import tensors_kept


@dataclass
class Measurement:
    """What one step measured, per device label (``"cpu#0"``, ``"cuda:1"``).

    ``peak_bytes``: the parameters the device holds (as ``explain`` counts them: ``held_bytes``) plus
    the peak of the bytes allocated on it during the step; ``step_allocated_peak``: that peak alone;
    ``step_time``: seconds of one uninstrumented step; ``predicted_peak_bytes``: ``explain``'s
    ``memory_estimate`` total (the planner's prediction); ``training``: forward and backward (else
    forward only).
    """

    peak_bytes: dict[str, int]
    step_time: float
    predicted_peak_bytes: dict[str, int]
    step_allocated_peak: dict[str, int] = field(default_factory=dict)
    memory_estimate: dict[str, dict[str, int]] = field(default_factory=dict)
    training: bool = True
    held_bytes: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        rows = [
            f"  {d:<10} measured {self.peak_bytes[d]:>14,} B   predicted {self.predicted_peak_bytes.get(d, 0):>14,} B"
            for d in self.peak_bytes
        ]
        kind = "training step" if self.training else "forward"
        return "\n".join([f"dpcompile measure: one {kind}, {self.step_time * 1e3:.2f} ms", *rows])


class _Allocations(TorchDispatchMode):
    """Counts every new storage an op returns against the running node's device slot."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        given = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = {address(t) for t in given}
        for t in tree_leaves(out):
            # a DTensor's local tensor is counted where the op on it runs; a view or an in-place result
            # shares its input's storage: not new
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and not is_traceable_wrapper_subclass(t):
                self.ledger.count(t, inputs, slot=self.ledger.spread_slot(t, given))
        return out


class _SlotInterpreter(FreshArguments):
    """Runs a program node by node, naming each node's device slot; regions recomputed in backward
    run through it too (forward and recompute alike)."""

    def __init__(self, module: fx.GraphModule, ledger: Ledger, slot_index: Callable[[fx.Node], int]) -> None:
        super().__init__(module)
        self.ledger = ledger
        self.slot_index = slot_index

    def run_node(self, n: fx.Node) -> Any:
        self.ledger.slot = self.slot_index(n)  # a node of no one device (a scatter, a gather, a whole op): the first
        # unless it computes per device (a BatchNorm over every copy's chunk): see Ledger.spread_slot
        self.ledger.spread = n.op == "call_function" and slot_of(n) is None
        if n.op == "call_function" and n.target is checkpoint:
            region, *rest = self.map_nodes_to_values(n.args, n)
            ledger = self.ledger
            slots = self.slot_index

            def run_region(*values: Any) -> Any:
                # again in backward (inside the autograd node that unpacked a saved value): each node's
                # allocations are its own slot's, not that autograd node's (a tensor-parallel block's
                # recompute was counted whole on the device of the op whose backward asked for it)
                again = torch._C._current_autograd_node() is not None
                ledger.recomputing += again
                try:
                    return _SlotInterpreter(region, ledger, slots).run(*values)
                finally:
                    ledger.recomputing -= again

            out = checkpoint(run_region, *rest, **n.kwargs)
        else:
            out = super().run_node(n)
        for node in stamp_slot(out, SLOT_KEY, self.ledger.slot):
            if self.ledger.spread:  # its backward too computes per device
                node.metadata[SPREAD_KEY] = True
        self.ledger.spread = False
        return out

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        if isinstance(target, str) and "." in target:  # a region's call of a submodule: block.attn.q(x)
            owner, *rest = args
            return functools.reduce(getattr, target.split("."), owner)(*rest, **kwargs)
        return super().call_method(target, args, kwargs)


def _loss_of(out: Any) -> torch.Tensor | None:
    """The model's own loss (``out.loss``, ``out["loss"]``), else the sum of every floating output."""
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    return sum(t.float().sum() for t in leaves) if leaves else None  # type: ignore[return-value]


@contextmanager
def _state_kept(pm: nn.Module) -> Any:
    """The step leaves gradients, buffers (running statistics) and the RNG as they were."""
    grads = {p: p.grad for p in pm.parameters()}
    buffers = {b: b.detach().clone() for b in pm.buffers()}
    rng = torch.get_rng_state()
    for p in grads:
        p.grad = None
    try:
        yield
    finally:
        for p, g in grads.items():
            p.grad = g
        with torch.no_grad():
            for b, value in buffers.items():
                b.copy_(value)
        torch.set_rng_state(rng)


def _step(
    run: Callable[[], Any], training: bool, backward: Callable[[torch.Tensor], None] | None = None, *,
    backward_in_call: bool = False,
) -> None:  # fmt: skip
    """``run()``, then (training) the backward of its loss, unless the call ran it (``backward_in_call``:
    a 1F1B step, whose other outputs have no gradient path: summed with the loss, backward was refused)."""
    with torch.enable_grad() if training else torch.no_grad():
        out = run()
        loss = _loss_of(out) if training and not backward_in_call else None
        if loss is not None:
            (backward or torch.autograd.backward)(loss)


def measure(pm: nn.Module, *args: Any, **kwargs: Any) -> Measurement:
    """One step of ``pm`` on ``args``/``kwargs``: the measured peak bytes per device, the step time,
    and ``explain``'s prediction beside them. In training mode the step is forward and backward of
    the model's loss (``out.loss``) or of the sum of its outputs; in eval mode, forward. Gradients,
    buffers, the RNG state and every parameter and buffer slot are left as they were."""
    if not isinstance(pm, fx.GraphModule) or not hasattr(pm, "program_for_call"):
        raise DpCompileError(f"measure needs a dpcompile.ParallelModule, got {type(pm).__name__}")
    if executor_of(pm).runs_one_stage_per_rank:  # a rank's stage waits on the others: refused before any run
        raise DpCompileError(MESH_PIPELINE_INSPECTION)
    with tensors_kept(*inspected_modules(pm)):
        try:
            return _measure(pm, args, kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError) as e:  # inputs the program cannot take: named
            refused = refused_call(pm.graph, e, args, kwargs)
            if refused is None:
                raise
            raise refused.with_traceback(e.__traceback__) from e


def _measure(pm: Any, args: tuple, kwargs: dict) -> Measurement:
    training = pm.training
    labels, slot_index = label_slots(pm)
    report = explain(pm, *args, **kwargs)
    estimate = report.memory_estimate
    predicted = {d: sum(kinds.values()) for d, kinds in estimate.items()}
    counted = held_count(pm, report.param_bytes)
    devices = device_list(pm)
    distinct_cuda = all(d.type == "cuda" for d in devices) and len(set(devices)) == len(devices)
    # dp copies on virtual devices share one set of parameters, so one set of gradients, made by
    # whichever copy's backward runs first: they are counted as explain counts them, as parameters are
    held_kinds = ("parameters", "gradients") if training and copy_labels(pm) and not distinct_cuda else ("parameters",)
    held = {d: sum(counted.get(d, {}).get(kind, 0) for kind in held_kinds) for d in labels}
    if distinct_cuda:
        allocated = _cuda_peaks(pm, args, kwargs, training, devices, labels)
    else:
        allocated = _virtual_peaks(pm, args, kwargs, training, labels, slot_index, "gradients" in held_kinds)
    with _state_kept(pm):
        _synchronize(devices)
        start = time.perf_counter()
        _step(lambda: pm(*args, **kwargs), training, backward_in_call=runs_one_f_one_b(pm, training))
        _synchronize(devices)
        seconds = time.perf_counter() - start
    return Measurement(
        peak_bytes={d: held[d] + allocated[d] for d in labels},
        step_time=seconds,
        predicted_peak_bytes=predicted,
        step_allocated_peak=allocated,
        memory_estimate=estimate,
        training=training,
        held_bytes=held,
    )


def _virtual_peaks(
    pm: Any,
    args: tuple,
    kwargs: dict,
    training: bool,
    labels: list[str],
    slot_index: Callable[[fx.Node], int],
    gradients_held: bool,
) -> dict[str, int]:
    """Each device's peak of the bytes the step allocates (``gradients_held``: the gradients exist
    before the step, zeros accumulated into, so they are not among them)."""
    ledger = Ledger(len(labels))
    mode = _Allocations(ledger)
    windows = BackwardWindows(mode, ledger)  # autograd's sums as on a real device: no mode while it makes them
    with _state_kept(pm):
        if gradients_held:
            for p in pm.parameters():
                p.grad = torch.zeros_like(p) if p.requires_grad else None
        try:
            with mode:
                if runs_one_f_one_b(pm, training):
                    with _call_context(pm):  # the call runs the whole step, backward too, in FSDP's context
                        one_f_one_b_peaks(pm, args, kwargs, ledger, SLOT_KEY, slot_index, windows.backward,
                                          gradients_preset_to_zero=gradients_held)
                elif _sharded_by_fsdp_hooks(pm, labels):
                    _step(lambda: pm(*args, **kwargs), training, windows.backward)
                else:
                    program = pm.program_for_call(*args, **kwargs)
                    values = bind_inputs(program, args, kwargs)

                    def forward() -> Any:
                        with _call_context(pm):  # forward as the program's call runs it (FSDP's gathers)
                            return _SlotInterpreter(program, ledger, slot_index).run(*values)

                    _step(forward, training, windows.backward)
        finally:
            windows.remove_hooks()
    return dict(zip(labels, ledger.peak, strict=True))


def _call_context(pm: Any) -> Any:
    """The context ``pm``'s own call runs its forward in (one-process FSDP's: its parameters gathered once
    a call and held until it returns, gathered again in backward); measured outside it, every gathered
    parameter a layer saves was kept through backward, on every copy (torchvision's ViT 11% over), and a
    1F1B step, whose call runs backward too, gathered each parameter at every read."""
    return pm.call_context() if isinstance(pm, FsdpProgram) else nullcontext()


def _sharded_by_fsdp_hooks(pm: Any, labels: list[str]) -> bool:
    """FSDP over a DeviceMesh: ``fully_shard``'s hooks gather the root's shards around ``pm``'s own
    call (a program run node by node would meet them as DTensors), so the step runs through ``pm``;
    this rank is one device, one slot."""
    return executor_of(pm).call_runs_under_fsdp(pm) and len(labels) == 1


def _cuda_peaks(
    pm: Any, args: tuple, kwargs: dict, training: bool, devices: list[torch.device], labels: list[str]
) -> dict[str, int]:
    before = {}
    for d in devices:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)
        before[d] = torch.cuda.memory_allocated(d)
    with _state_kept(pm):
        _step(lambda: pm(*args, **kwargs), training, backward_in_call=runs_one_f_one_b(pm, training))
    _synchronize(devices)
    return {label: torch.cuda.max_memory_allocated(d) - before[d] for label, d in zip(labels, devices, strict=True)}


def _synchronize(devices: list[torch.device]) -> None:
    for d in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(d)


__all__ = ["Measurement", "measure"]
