"""``verify``: run the program and the eager model alike, compare, and judge low-precision
differences against a float64 run."""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dpcompile.analysis.random_ops import per_device_note, random_draws_of
from dpcompile.errors import ArgumentError, DpCompileError
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.executors import executor_of
from dpcompile.runtime.structures import map_structure, tensor_leaves
from dpcompile.verify.layout import check_layout
from dpcompile.verify.mesh_pipeline import (
    agree_before_schedule,
    agree_on_verdict,
    compare_held,
    input_fingerprint,
    loss_of,
    refuse_unsupported,
    run_stage,
    whole_gradients,
    whole_parameters,
)
from dpcompile.verify.over_dp import agree_on_inputs_over_dp, batch_norm_rows, running_variance_over_copies
from dpcompile.verify.result import (
    Mismatch,
    VerifyResult,
    compare_structures,
    compare_tensors,
    default_tolerance,
    first_line,
)

log = logging.getLogger("dpcompile")

# ------------------------------------------------------------------------ running cleanly
def _unique(tensors: Iterator[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


@contextlib.contextmanager
def _no_side_effects(*modules: nn.Module) -> Iterator[list[str]]:
    """Restore every parameter's ``.grad``, every buffer and every dropout's mode afterwards. Dropout
    stays on where the program draws the single-device values (``exact_random=True``); where it
    draws per device, dropout modules are switched to eval for the comparison."""
    notes: list[str] = []
    params = _unique(p for m in modules for p in m.parameters())
    grads = [(p, p.grad) for p in params]
    buffers = [(b, b.detach().clone()) for b in _unique(b for m in modules for b in m.buffers())]
    dropouts = [
        d for d in _unique_modules(modules)
        if isinstance(d, nn.modules.dropout._DropoutNd) and d.training and d.p > 0
    ]
    if dropouts and _draws_single_device_values(modules[-1]):
        notes.append(f"{len(dropouts)} dropout module(s) stayed in training: the program draws the single-device masks")
        dropouts = []
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


def _draws_single_device_values(pm: nn.Module) -> bool:
    """Whether every random op of ``pm``'s program draws the single-device values."""
    if not isinstance(pm, torch.fx.GraphModule):
        return False
    return bool(random_draws_of(pm)["exact"]) and per_device_note(pm) is None


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


def _leaf_inputs(
    value: Any, device: torch.device | None, grad: bool = True
) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """Copies of the inputs (float tensors as fresh leaves that collect gradients, unless ``grad``
    is False: then plain copies, for a forward that sets ``requires_grad`` on a view of its input)."""
    leaves: list[torch.Tensor] = []

    def copy_leaf(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        t = leaf.detach().to(device) if device is not None else leaf.detach()
        t = t.clone()
        if t.is_floating_point() and grad:
            t.requires_grad_(True)
            leaves.append(t)
            return t.clone()  # a non-leaf, so in-place ops in the model stay legal
        return t

    copied = map_structure(copy_leaf, value)
    return copied, [(f"input[{i}]", t) for i, t in enumerate(leaves)]


def _loss(
    output: Any, weights: dict[str, torch.Tensor | None] | None, loss_only: bool = False
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor | None]]:
    """A fixed random projection of every differentiable output (the weights are made once). With
    ``loss_only`` (a program that runs its loss's backward inside the call): the 0-dim outputs, each
    with weight 1, as a training loop's ``loss.backward()``; the other outputs are compared, not
    differentiated."""
    weights = {} if weights is None else weights
    total = None
    generator = torch.Generator().manual_seed(1234)
    for path, t in tensor_leaves(output):
        if not (t.requires_grad and (t.is_floating_point() or t.is_complex())):
            continue
        if path not in weights:
            if loss_only:
                weights[path] = torch.ones((), dtype=t.dtype) if t.dim() == 0 else None
            else:
                weights[path] = torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.dtype)
        if weights[path] is None:
            continue
        term = (t * weights[path].to(t.device)).sum().real.to(torch.float64)
        term = term.to("cpu")
        total = term if total is None else total + term
    return total, weights


def _run(module: nn.Module, args: tuple, kwargs: dict, device: torch.device | None, seed: int,
         weights: dict[str, torch.Tensor | None] | None, grad_inputs: bool = True,
         loss_only: bool = False) -> tuple[Any, list[tuple[str, torch.Tensor]], dict[str, torch.Tensor | None]]:
    torch.manual_seed(seed)
    (call_args, call_kwargs), inputs = _leaf_inputs((list(args), dict(kwargs)), device, grad_inputs)
    output = module(*call_args, **call_kwargs)
    loss, weights = _loss(output, weights, loss_only)
    if loss is not None:
        loss.backward()
    return output, inputs, weights


def _runs_backward_in_call(pm: nn.Module) -> bool:
    """A training call of ``pm`` runs its loss's backward itself (a 1F1B pipeline): only a plain
    ``loss.backward()`` may follow, so verify differentiates the loss alone, with weight 1."""
    return pm.training and executor_of(pm).steps_one_f_one_b


def _module_device(model: nn.Module) -> torch.device | None:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None


def _dense(grad: torch.Tensor) -> torch.Tensor:
    """A gradient to compare: ``nn.Embedding(sparse=True)``'s sparse one made dense."""
    return grad.to_dense() if grad.is_sparse else grad


def _pm_gradients(pm: nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor | None]:
    """Gradients of ``pm`` under the model's parameter names (full tensors, shards gathered)."""
    if executor_of(pm).call_runs_under_fsdp(pm):  # FSDP over a mesh: DTensor gradients, gathered over dp (and tp)
        own = dict(pm.named_parameters())
        grads = pm.whole_tensors({n: _dense(own[n].grad) for n in names if own.get(n) is not None and own[n].grad is not None})
        return {n: grads[n].detach().clone() if n in grads else None for n in names}
    replicated = getattr(getattr(pm, "recipe", None), "replicates_model", False)  # data parallel; FSDP: pieces
    if replicated and not getattr(pm, "param_shards", None):
        own = dict(pm.named_parameters())
        return {n: (None if own.get(n) is None or own[n].grad is None else _dense(own[n].grad).detach().clone()) for n in names}
    # Tensor parallel: swap each shard's data for its gradient and let state_dict gather them.
    swapped = []
    with torch.no_grad():
        for p in _unique(pm.parameters()):
            swapped.append((p, p.data))
            p.data = _dense(p.grad) if p.grad is not None else torch.zeros_like(p)
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
    _check_modules(pm, model)
    if executor_of(pm).runs_one_stage_per_rank:
        return _verify_mesh_pipeline(pm, model, args, kwargs, fake_devices, rtol, atol)
    over_dp = agree_on_inputs_over_dp(pm, args, kwargs)
    mismatches: list[Mismatch] = []
    checked = {"outputs": 0, "parameter gradients": 0, "input gradients": 0, "buffers": 0}
    seed = 0
    with _no_side_effects(model, pm) as notes:
        if over_dp:
            notes.append(over_dp.note)
        model_buffers = [(b, b.detach().clone()) for b in _unique(b for m in (model, pm) for b in m.buffers())]
        for p in _unique(p for m in (model, pm) for p in m.parameters()):
            p.grad = None
        loss_only = _runs_backward_in_call(pm)
        grad_inputs = not loss_only  # 1F1B divides gradients after its step: it takes inputs that need none
        if loss_only:
            notes.append("the program runs its loss's backward inside the call (1F1B): the gradients compared are "
                         "the 0-dim outputs' (the loss's, weight 1) and the parameters'; the other outputs' values")
        buffers_before = {n: b.detach().clone() for n, b in model.named_buffers()}
        try:
            with batch_norm_rows(model) as rows:
                expected, expected_inputs, weights = _run(model, args, kwargs, _module_device(model), seed, None,
                                                          loss_only=loss_only)  # fmt: skip
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            if not (isinstance(e, RuntimeError) and _sets_requires_grad_of_input(e)):
                if isinstance(e, DpCompileError):
                    raise
                raise ArgumentError(
                    f"verify(pm, model, *inputs): the model itself refuses these inputs ({type(e).__name__}: "
                    f"{first_line(e)}); pass the inputs its forward takes"
                ) from e
            _restore(model_buffers)  # the forward that failed may have begun a step
            for p in _unique(p for m in (model, pm) for p in m.parameters()):
                p.grad = None
            grad_inputs = False
            notes.append(f"the inputs do not require grad and their gradients are not compared: {_INPUT_FLAG_NOTE}")
            expected, expected_inputs, weights = _run(model, args, kwargs, _module_device(model), seed, None, False,
                                                      loss_only)  # fmt: skip
        param_names = [n for n, p in model.named_parameters() if p.requires_grad]
        own = dict(model.named_parameters())
        expected_grads = {n: None if own[n].grad is None else _dense(own[n].grad).detach().clone() for n in param_names}
        saved = model.state_dict(keep_vars=True)  # non-persistent buffers (rotary inv_freq) are not pm's state either
        expected_buffers = {n: b.detach().clone() for n, b in model.named_buffers() if n in saved}
        if over_dp and over_dp.ranks > 1 and rows:  # synchronised BatchNorm saw the batch once per dp rank
            expected_buffers.update(running_variance_over_copies(model, rows, buffers_before, expected_buffers,
                                                                 over_dp.ranks))  # fmt: skip
            notes.append("BatchNorm's running variance expected is the eager one of the batch seen once per dp rank "
                         "(synchronised statistics of every rank's rows: the unbiased variance of that many rows)")
        for p in _unique(p for m in (model, pm) for p in m.parameters()):
            p.grad = None
        _restore(model_buffers)

        actual, actual_inputs, _ = _run(pm, args, kwargs, None, seed, weights, grad_inputs, loss_only)
        actual_grads = _pm_gradients(pm, param_names)
        pm_state = pm.state_dict()
        # copies: in data parallel pm's buffers are the model's, restored below for the float64 run
        actual_buffers = {n: None if pm_state.get(n) is None else pm_state[n].detach().clone() for n in expected_buffers}

        problems, count = compare_structures(expected, actual, rtol, atol)
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
            reference = _float64_reference(model, args, kwargs, seed, weights, param_names, notes, grad_inputs)
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


def _verify_mesh_pipeline(pm: Any, model: nn.Module, args: tuple, kwargs: dict, fake_devices: Any,
                          rtol: float | None, atol: float | None) -> VerifyResult:  # fmt: skip
    """A pipeline over a DeviceMesh (any of its ``("pp", "dp", "tp")`` layouts): each rank compares what
    it holds, every rank returns the same verdict, and a failure raises on every rank
    (:mod:`dpcompile.verify.mesh_pipeline`)."""
    refuse_unsupported(pm, fake_devices)
    train = pm.training and torch.is_grad_enabled() and pm.has_loss  # what a call of pm runs: the schedule's step
    with _no_side_effects(pm.whole, pm, model) as notes:
        buffers = [(b, b.detach().clone()) for b in _unique(b for m in (model, pm, pm.whole) for b in m.buffers())]
        params = _unique(p for m in (model, pm) for p in m.parameters())
        for p in params:
            p.grad = None
        error, fingerprint, expected, expected_grads, expected_buffers = None, [], None, None, {}
        with whole_parameters(model):  # FSDP's shards of this stage, gathered over dp for eager
            try:  # nothing here is collective: a failure is told to the other ranks before the schedule
                fingerprint = input_fingerprint(args, kwargs)
                (call_args, call_kwargs), _ = _leaf_inputs((list(args), dict(kwargs)), None, grad=False)
                torch.manual_seed(0)
                expected = model(*call_args, **call_kwargs)
                if train:
                    loss_of(expected).backward()
                    expected_grads = {n: None if p.grad is None else _dense(p.grad).detach().clone()
                                      for n, p in model.named_parameters(remove_duplicate=False)}  # fmt: skip
                expected_buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
            except Exception as e:  # noqa: BLE001 - every rank raises it, after the exchange
                error = e
        agree_before_schedule(pm, error, fingerprint)
        for p in params:
            p.grad = None
        _restore(buffers)
        (call_args, call_kwargs), _ = _leaf_inputs((list(args), dict(kwargs)), None, grad=False)
        torch.manual_seed(0)
        actual = run_stage(pm, tuple(call_args), call_kwargs)
        actual_grads = whole_gradients(pm, model) if train else {}
        error, mismatches, checked = None, [], {}
        try:
            mismatches, checked = compare_held(pm, model, expected, actual, expected_grads, actual_grads,
                                               expected_buffers, rtol, atol)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - every rank raises it, after the exchange
            error = e
        notes.append(
            "over a mesh each rank compared what it holds, on its dp share of the batch: the last stage the "
            "outputs (the loss: the whole batch's mean), each stage the gradients of its own parameters (after dp's "
            "averaging; tp and FSDP shards gathered whole) and its buffers (input gradients are not compared); "
            "no float64 reference"
        )
        return agree_on_verdict(pm, error, mismatches, checked, list(notes))


_INPUT_FLAG_NOTE = (
    "forward sets requires_grad on a view of an input (Wav2Vec2's feature encoder), which torch "
    "allows only where the input itself does not require grad"
)


def _sets_requires_grad_of_input(error: RuntimeError) -> bool:
    """The model's forward set ``requires_grad`` on a tensor computed from an input that requires
    grad (torch refuses: only leaves' flags change), as it may where the input requires none."""
    return "you can only change requires_grad flags of leaf variables" in str(error)


def _check_modules(pm: object, model: object) -> None:
    """``verify(pm, model, *inputs)``: both modules first, then the inputs."""
    for name, value in (("pm", pm), ("model", model)):
        if name == "pm" and isinstance(model, ParallelModule) and not isinstance(value, ParallelModule):
            raise ArgumentError(
                f"verify(pm, model, *inputs): the ParallelModule came second, after a {type(value).__name__}; pass "
                "the ParallelModule transform returned first, then the model, then the inputs forward takes"
            )
        if not isinstance(value, nn.Module):
            raise ArgumentError(
                f"verify(pm, model, *inputs): {name} must be a module, got {type(value).__name__}; pass the "
                "ParallelModule and the model first, then the inputs forward takes"
            )


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
    param_names: Sequence[str], notes: list[str], grad_inputs: bool = True,
) -> dict[str, dict[str, torch.Tensor | None]] | None:
    """The eager model run in float64 (a copy), forward and backward, as the reference that
    judges low-precision differences; None (with a note) where it cannot run."""
    try:
        model64 = copy.deepcopy(model).to(torch.float64)
        (args64, kwargs64) = _as_float64((list(args), dict(kwargs)))
        output, inputs, _ = _run(model64, tuple(args64), kwargs64, _module_device(model64), seed, weights, grad_inputs)
    except Exception as e:  # noqa: BLE001 - the reference refines the verdict; without it the tolerances stand
        notes.append(f"no float64 reference run to judge rounding ({type(e).__name__}: {first_line(e)})")
        return None
    own = dict(model64.named_parameters())
    return {
        "output": dict(tensor_leaves(output)),
        "gradient": {n: None if own[n].grad is None else _dense(own[n].grad).detach() for n in param_names if n in own},
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


