"""Models on ``meta``: capture and plan on fake tensors, then give each device memory for what it holds.

A model built under ``torch.device("meta")`` (or accelerate's ``init_empty_weights``) has
shapes and no data. ``transform`` compiles it as it compiles any model, and at the end each
device allocates, uninitialised, only what it holds:

* data parallel (one process or over a mesh): the model's own tensors are given memory on
  the primary (or this rank's) device, in place (:func:`compile_meta_model`) — that is the
  replica; the program shares it, as data parallelism always does;
* tensor parallel (one process, or this rank's program over a mesh): the whole transform runs
  on a fake copy of the model with fake examples (:func:`compile_on_fake`); the program it gives
  holds fake shards, and :func:`~dpcompile.fake.materialize` then allocates each shard on its
  own device. No full tensor is ever allocated.

The program then waits for its weights (``pm.needs_weights``) until
``dpcompile.load_checkpoint`` fills it.

    with torch.device("meta"):
        model = MyModel(config)
    pm = dpcompile.transform(model, ["cpu"] * 4, tensor_parallel=True)   # shards on their devices
    dpcompile.load_checkpoint(pm, "ckpt/")                                # each reads its slices
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from dpcompile.fake import FakeCudaOnCpuTorch, fake_copy, has_meta_tensors, is_placeholder, materialize
from dpcompile.fx_utils import unalias
from dpcompile.modules.spmd import hold_mesh
from dpcompile.modules.weights import await_weights


def meta_buffers(model: nn.Module) -> list[str]:
    """The non-persistent buffers of ``model`` on ``meta``: no checkpoint holds them
    (rotary ``inv_freq``, ``position_ids``), so loading must compute them."""
    out = []
    for path, module in model.named_modules():
        for name, b in module._buffers.items():
            if b is not None and b.is_meta and name in module._non_persistent_buffers_set:
                out.append(f"{path}.{name}" if path else name)
    return out


def compile_on_fake(
    model: nn.Module,
    device: torch.device,
    example_inputs: Sequence[Any] | None,
    example_kwargs: Mapping[str, Any] | None,
    build: Callable[[nn.Module, Sequence[Any] | None, Mapping[str, Any] | None], nn.Module],
    *,
    allocate: bool = True,
) -> nn.Module:
    """``build(fake model, fake examples, fake kwargs)`` on a fake copy of the meta ``model``
    (on ``device``), then each fake parameter and buffer of the program it returns allocated on
    the device it claims. Values the model did hold (the buffers accelerate's
    ``init_empty_weights(include_buffers=False)`` keeps real) are copied in; the program
    waits for the rest (:func:`~dpcompile.modules.weights.await_weights`). ``allocate=False``
    keeps the program on fake tensors: the layout of devices this machine lacks (fake CUDA),
    whose bytes per device can be counted."""
    known = {name: t for name, t in (*model.named_parameters(), *model.named_buffers()) if not t.is_meta}
    unset = meta_buffers(model)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = fake_copy(model, mode, device)
    # autograd on fake CUDA tensors aborts a torch built without CUDA: no gradients for a layout
    with on_fake(mode), contextlib.nullcontext() if allocate else torch.no_grad():
        args, kwargs = tree_map(
            lambda x: mode.from_tensor(x.detach()).to(device) if isinstance(x, torch.Tensor) else x,
            (example_inputs, dict(example_kwargs or {})),
        )  # fmt: skip
        pm = build(fake, args, kwargs or None)
    if not allocate:
        return pm
    memo: dict[int, torch.Tensor] = {}  # {id(fake): its real tensor}
    materialize(pm, memo=memo)
    _share_materialized(pm.__dict__.get("traced_model"), memo)
    pm._executor.materialized(pm, memo)  # what it holds beside the program (a mesh stage's tied weights' copies)
    write_known_values(pm, known)
    read_exported_checks_again(pm)
    await_weights(pm, model, unset)
    return pm


def _share_materialized(model: nn.Module | None, memo: Mapping[int, torch.Tensor]) -> None:
    """The fake copy a pipeline shares its modules with holds the real tensors ``pm`` now holds in
    every slot, its root's too: a buffer forward rebinds on the model itself (``self.calls += 1``)
    is written back there, and would land on a fake tensor beside ``pm``'s real one."""
    for module in () if model is None else model.modules():
        for slots in (module._parameters, module._buffers):
            for name, t in list(slots.items()):
                # a real tensor is left alone: its id may be that of a fake one materialize freed
                if is_placeholder(t) and id(t) in memo and memo[id(t)].shape == t.shape:
                    slots[name] = memo[id(t)]


def read_exported_checks_again(pm: nn.Module) -> None:
    """The guard of each program ``torch.export`` captured in ``pm`` takes the model as it is now.

    A pipeline's stages hold modules of the fake copy the guard watches (a rotary embedding with
    its ``inv_freq``, a tied embedding): :func:`~dpcompile.fake.materialize` just put real tensors
    in their slots, a change dpcompile made itself, not one to refuse as ``ModelChanged``."""
    for module in pm.modules():
        exported = module.__dict__.get("_exported_check")
        if exported is not None:
            exported.read_again()


@contextlib.contextmanager
def on_fake(mode: FakeTensorMode) -> Iterator[None]:
    """``mode`` on, CPU-only torch taught fake CUDA, fake-tensor warnings quiet."""
    with mode, FakeCudaOnCpuTorch(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        yield


@torch.no_grad()
def write_known_values(pm: nn.Module, known: Mapping[str, torch.Tensor]) -> None:
    """Copy the model's real tensors (of a partly-meta model) into ``pm``'s, by name."""
    if not known:
        return
    own = {unalias(name): t for name, t in (*pm.named_parameters(), *pm.named_buffers())}
    for name, value in known.items():
        target = own.get(name)
        if type(target).__name__ == "DTensor":
            continue  # FSDP's rows of a parameter: load_checkpoint fills every one
        if target is not None and target.shape == value.shape:
            target.copy_(value)


def compile_meta_model(
    recipe: Any,
    model: nn.Module,
    example_inputs: Sequence[Any] | None,
    example_kwargs: Mapping[str, Any] | None,
    compile_one: Callable[[nn.Module, Sequence[Any] | None, Mapping[str, Any] | None], nn.Module],
) -> nn.Module:
    """``compile_one(model, examples, kwargs)`` (transform's frontend and compile) for a model
    on meta: a program that owns its tensors (tensor parallel, a pipeline) on a fake copy
    (:func:`compile_on_fake`); data parallel on the model's own tensors given uninitialised memory
    on its device, in place (the same tensor objects, so ties hold), the program then waiting for
    its weights."""
    device = recipe.home_device
    if recipe.replicates_model:
        unset = meta_buffers(model) if has_meta_tensors(model) else None
        if unset is not None:
            materialize(model, device)
        pm = compile_one(model, example_inputs, example_kwargs)
        if unset is not None:
            await_weights(pm, model, unset)
        return pm
    allocate = getattr(recipe, "check_available", True)  # False: fake devices (cuda:0..7 on a CPU), a layout to inspect
    pm = compile_on_fake(model, device, example_inputs, example_kwargs, compile_one, allocate=allocate)
    if getattr(recipe, "mesh", None) is not None and getattr(pm, "dp_dim", None) is not None:  # 2-D: DDP over dp
        hold_mesh(
            pm,
            mesh=recipe.mesh, dp_dim=pm.dp_dim, tp_dim=pm.tp_dim, shards=pm.shards, ddp_options=recipe.ddp_options,
            fsdp=recipe.fsdp_options(),
        )  # fmt: skip
    return pm


__all__ = [
    "compile_meta_model",
    "compile_on_fake",
    "meta_buffers",
    "on_fake",
    "read_exported_checks_again",
]
