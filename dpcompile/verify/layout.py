"""``check_layout``: build a program for fake CUDA devices and check where every value lives."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dpcompile.devices import Devices
from dpcompile.errors import DpCompileError
from dpcompile.fake import FakeCudaOnCpuTorch, fake_copy
from dpcompile.fake import fake_devices as fake_devices_of
from dpcompile.fx_utils import bind_inputs, copy_graph, graph_module
from dpcompile.inspect import Recorder, slot_of, user_source
from dpcompile.modules.executors import executor_of
from dpcompile.recipes.base import departing_trace
from dpcompile.runtime.structures import tensor_leaves
from dpcompile.target import dp_copies, resolve_target
from dpcompile.verify.result import Mismatch, VerifyResult, first_line
from dpcompile.verify.sequence_layout import composed_sequence_layout, sequence_build_fields
from passes.name_dp_copies import COPY


# ------------------------------------------------------------------------ fake multi-GPU
def _count_free_batch_norms(fake_model: nn.Module) -> None:
    """A batch norm with ``momentum=None`` divides by its count (``1 / float(num_batches_tracked)``), a value
    a fake tensor does not hold: the fake copy (devices and shapes are checked, not values) takes a fixed
    momentum instead. The model's own modules are not touched."""
    for module in fake_model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None:
            module.momentum = 0.1


def _build_fake_program(
    pm: Any, fake_model: nn.Module, devices: Devices, example: tuple | None, sequence_fields: dict[str, Any],
    call: tuple[tuple, dict] | None = None,
) -> fx.GraphModule:
    """``pm``'s program rebuilt for ``devices`` (fake CUDA devices; copy 0's, with ``sequence_fields``,
    the ``dp_devices`` of cp composed in one process) on a fake copy of the model."""
    recipe = pm.recipe
    if recipe.lowers_capture and pm.captured is not None:
        trace = departing_trace(recipe, pm, pm.call_key(*call[0], **call[1]), *call) if call is not None else None
        graph = pm.captured.graph if trace is None else trace.graph  # the call's own trace (an optional argument given)
        gm = graph_module(fake_model, copy_graph(graph), "FakeLayout")
        lowering = dataclasses.replace(recipe, devices=devices, output_device=devices.primary, **sequence_fields)
        return lowering.lower(gm, devices, pm.input_dims)
    fields = recipe.fake_layout_fields(pm)
    if fields is not None:
        if sequence_fields:
            fields.update(sequence_fields)
        elif recipe.dp_devices is not None:  # dp copies (over a pipeline): copy 0 builds the program, each copy on its devices
            copies = dp_copies(resolve_target(devices, pm.layout, pipeline=None, tensor_parallel=False))
            fields["dp_devices"] = tuple(tuple(copy.strings()) for copy in copies)
            devices = copies[0]
        fake_recipe = dataclasses.replace(recipe, devices=devices, output_device=devices.primary, **fields)
        if call is not None and "none_args" in inspect.signature(fake_recipe.compile).parameters:
            key = pm.call_key(*call[0], **call[1])  # traced as the call departs (an optional argument given)
            return fake_recipe.compile(fake_model, example, none_args=key.none_args, flags=dict(key.flags))
        return fake_recipe.compile(fake_model, example)
    raise ValueError(
        f"fake_devices= checks programs of one process (data, tensor and pipeline parallel), not mode {pm.mode!r}: "
        "over a DeviceMesh each rank's placement is its own device"
    )


def _captured_like_pm(
    pm: Any, fake_model: nn.Module, mode: FakeTensorMode, device: torch.device, args: tuple, kwargs: dict
) -> tuple[nn.Module, tuple | None]:
    """The fake model captured as ``transform`` captured the real one for a call with keyword
    inputs (``input_ids=``, ``labels=``: the export frontend), and its examples in program order."""
    from dpcompile.api import apply_frontend

    def fake(x: Any) -> Any:
        return mode.from_tensor(x.detach()).to(device) if isinstance(x, torch.Tensor) else x

    recipe = pm.recipe
    frontend = recipe.frontend if recipe.frontend != "fx" else "auto"
    captured, examples, _ = apply_frontend(
        fake_model, frontend, tuple(fake(x) for x in args), {k: fake(v) for k, v in kwargs.items()},
        recipe.leaf_modules, None, flags_served=recipe.serves_flags,
        lazy_other_mode=True,  # the one call checked runs in the fake model's mode: the other is not exported
    )  # fmt: skip
    return captured, examples


_TRANSFERS = ("send", "to_device", "gather", "reduce_to", "copy_to", "to_stage")


def _moves_between_devices(node: fx.Node) -> bool:
    """A runtime call that moves values to another device (a send between stages, a gather)."""
    target = node.target
    module = getattr(target, "__module__", "") or ""
    name = getattr(target, "__name__", "") or ""
    return node.op == "call_function" and module.startswith("dpcompile.runtime") and any(w in name for w in _TRANSFERS)


def _copy_devices(program: fx.GraphModule, devices: Devices) -> list[list[torch.device]]:
    """Each dp copy's devices, where a node's slot is its place (one copy, ``devices``, without dp)."""
    recipe = getattr(program, "recipe", None)
    copies = getattr(recipe, "dp_devices", None)
    if not copies:
        return [list(devices)]
    return [[torch.device(d) for d in copy] for copy in copies]


def _check_pipeline_device_count(pm: Any, n: int) -> None:
    """A pipeline's layout fixes its device count (a stage per device, times its shards and copies):
    another count is a question verify cannot answer, so it says which count to ask for."""
    layout = dict(getattr(pm, "layout", None) or {})
    if not executor_of(pm).runs_stages_in_one_process or not layout:
        return
    needed = math.prod(layout.values())
    if n != needed:
        sizes = " x ".join(f"{name} {size}" for name, size in layout.items())
        raise DpCompileError(
            f"verify(fake_devices={n}): this program's layout ({sizes}) runs on {needed} devices, not {n}; pass "
            f"fake_devices={needed}, or check another layout by transforming it first (e.g. mesh={{'pp': ..., 'dp': ...}})"
        )


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
    _check_pipeline_device_count(pm, len(devices))
    label = f"fake {len(devices)}-device layout"
    checked = {"fake devices": len(devices)}
    sequence_fields: dict[str, Any] = {}
    sequence_notes: list[str] = []
    if (layout := composed_sequence_layout(pm)) is not None:  # cp with dp, tp or pp: each copy on copy 0's devices, as built
        devices, sequence_fields, note = sequence_build_fields(layout, devices)
        sequence_notes.append(note)
        pieces = pm._devices_for(tuple(args), dict(kwargs))
        if not pm.recipe.lowers_capture and pieces < pm.recipe.micro_batches:  # a sequence shorter than the pieces:
            sequence_fields["micro_batches"] = pieces  # the program pm builds for the call, with fewer
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    batch = pm.batch_size(tuple(args), dict(kwargs))
    # Autograd on fake CUDA tensors aborts the process on a torch built without CUDA, so the
    # backward pass is only checked where the devices really exist.
    backward = torch.cuda.is_available() and torch.cuda.device_count() >= len(devices)
    grad_mode = contextlib.nullcontext() if backward else torch.no_grad()
    try:
        fake_model = fake_copy(model, mode, devices.primary)
        _count_free_batch_norms(fake_model)
        with mode, grad_mode, FakeCudaOnCpuTorch(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
            # The call's own arguments as example inputs, so the plan's views are checked as pm's were
            example = None if kwargs else tuple(
                mode.from_tensor(x.detach()).to(devices.primary) if isinstance(x, torch.Tensor) else x for x in args
            )
            if batch is not None and batch < len(devices) and pm.recipe.lowers_capture:
                devices = devices.prefix(batch)
            if kwargs and not pm.recipe.lowers_capture:  # keyword inputs: export captured it
                fake_model, example = _captured_like_pm(pm, fake_model, mode, devices.primary, args, kwargs)
            program = _build_fake_program(pm, fake_model, devices, example, sequence_fields, (tuple(args), dict(kwargs)))
    except ImportError:
        raise
    except Exception as e:  # noqa: BLE001 - report, do not crash
        return VerifyResult(False, [Mismatch("layout", label, f"cannot build the program: {type(e).__name__}: {first_line(e)}")],
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
        return VerifyResult(False, [Mismatch("layout", label, f"{type(e).__name__}{where}: {first_line(e)}")], checked)
    copies = _copy_devices(program, devices)
    for node in program.graph.nodes:
        slot = slot_of(node)
        copy = node.meta.get(COPY) or 0
        own = copies[copy] if copy < len(copies) else copies[0]  # copies on repeated devices: copy 0's, nothing moved
        if slot is None or slot >= len(own):
            continue
        seen = recorder.devices.get(node.name, [])
        if len(set(seen)) > 1 or _moves_between_devices(node):  # a transfer lands where it is sent, not on its slot
            continue
        wrong = [d for d in seen if torch.device(d) != own[slot]]
        if wrong:
            mismatches.append(Mismatch("layout", node.name, f"is on {wrong[0]}, expected {own[slot]} (slot {slot})"))
    for path, t in tensor_leaves(output):
        if t.device != devices.primary:
            mismatches.append(Mismatch("layout", f"output{path}", f"is on {t.device}, expected {devices.primary}"))
    for name, p in program.named_parameters():
        if p.grad is not None and p.grad.device != p.device:
            mismatches.append(Mismatch("layout", name, f"gradient on {p.grad.device}, parameter on {p.device}"))
    checked["placed nodes"] = sum(1 for node in program.graph.nodes if slot_of(node) is not None)
    if len(copies) > 1:  # dp (or cp's pieces) composed over the program: each copy checked on its own devices
        checked["copies (dp, cp)" if sequence_fields else "dp copies"] = len(copies)
    notes = sequence_notes + ([] if backward else [
        f"{label}: forward checked; backward needs the devices (autograd cannot run on fake CUDA here)"])
    return VerifyResult(not mismatches, mismatches, checked, notes)
