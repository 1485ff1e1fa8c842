"""``transform``: check arguments → capture → pipeline → ``ParallelModule``."""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.capture import ROOT_LEAF, capture, capture_fx, capture_model, check_frontend, positional_examples
from dpcompile.devices import Devices, parse_device, parse_devices
from dpcompile.infra import run_passes
from dpcompile.module import ParallelModule, copy_graph

log = logging.getLogger("dpcompile")

TensorParallel = bool | Mapping[str, str]


def _is_device_mesh(devices: object) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(devices, DeviceMesh)


def propagate_shapes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Record each node's shape (``node.meta['val']``) from fake copies of the example inputs.

    Costs no real compute; returns False (and records nothing) where fake tensors cannot run
    the model.
    """
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    # inputs that are fake already (verify(..., fake_devices=)) run in their own mode
    mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    try:
        fake_inputs = [
            mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
            for x in example_inputs
        ]
        # fake mode still runs ops on real 0-dim buffers (batch norm's num_batches_tracked += 1)
        counters = [(b, b.clone()) for b in gm.buffers() if b.dim() == 0 and not isinstance(b, FakeTensor)]
        try:
            FakeTensorProp(gm, mode).propagate(*fake_inputs)
        finally:
            with torch.no_grad():
                for buffer, value in counters:
                    buffer.copy_(value)
        return True
    except Exception as e:  # noqa: BLE001 - shapes are a refinement, not a requirement
        log.debug("shape propagation on fake tensors failed (%s); continuing without shapes", e)
        for node in gm.graph.nodes:
            node.meta.pop("val", None)
        return False


def data_parallel_lowering(
    input_dims: Mapping[str, int | None], output_device: torch.device | None, copy_replicas: bool = False
) -> Callable[[fx.GraphModule, Devices], fx.GraphModule]:
    """The function that lowers a captured graph to data-parallel code for given devices."""
    import passes

    def lower(gm: fx.GraphModule, devices: Devices, *, recompile: bool = True) -> fx.GraphModule:
        options = passes.PipelineOptions(
            devices=devices,
            input_dims=dict(input_dims),
            output_device=output_device,
            copy_replicas=copy_replicas,
        )
        lowered, _ = run_passes(gm, passes.data_parallel_pipeline(options), recompile=recompile)
        return lowered

    return lower


def _move_to(model: nn.Module, device: torch.device) -> None:
    """``model.to(device)`` in place, skipped when everything is there already."""
    tensors = list(model.parameters()) + list(model.buffers())
    if any(t.device != device for t in tensors):
        model.to(device)


def _check_model(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module or a torch.fx.GraphModule, got {type(model).__name__}")
    return model


def _check_batch_dim(batch_dim: object) -> int | None:
    if batch_dim is None:
        return None
    if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
        raise ValueError(f"batch_dim={batch_dim!r} must be None (inferred) or a non-negative int")
    return batch_dim


def transform(
    model: nn.Module,
    devices: Any,
    *,
    tensor_parallel: TensorParallel = False,
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    frontend: str = "auto",
    batch_dim: int | None = None,
    output_device: Any = None,
    leaf_modules: Iterable[type[nn.Module]] = (),
    copy_replicas: bool = False,
) -> ParallelModule:
    """Turn a single-device ``model`` into a multi-device :class:`ParallelModule`.

    >>> import torch, dpcompile
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
    >>> pm = dpcompile.transform(model, ["cpu", "cpu"])
    >>> torch.allclose(pm(torch.ones(3, 8)), model(torch.ones(3, 8)))
    True

    ``copy_replicas=True`` gives virtual devices real replicas (as distinct GPUs get), so the
    multi-GPU code path runs and can be tested on one device.

    ``frontend=`` ``"fx"`` | ``"export"`` | ``"auto"`` and ``example_kwargs=`` (HF models:
    ``input_ids=``, ``attention_mask=``, ``labels=``): see ``docs/frontends.md``.
    """
    model = _check_model(model)
    flags_served = tensor_parallel in (False, None) and not _is_device_mesh(devices)  # only DP re-traces for flags
    model, example_inputs, batch_dim = _apply_frontend(
        model, frontend, example_inputs, example_kwargs, leaf_modules, batch_dim, flags_served
    )
    if _is_device_mesh(devices):
        from dpcompile.spmd import transform_spmd

        return transform_spmd(
            model,
            devices,
            tensor_parallel=tensor_parallel,
            example_inputs=example_inputs,
            batch_dim=batch_dim,
            leaf_modules=leaf_modules,
        )
    parsed = parse_devices(devices)
    out_device = parsed.primary if output_device is None else parse_device(output_device)
    batch_dim = _check_batch_dim(batch_dim)
    if example_inputs is not None and not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    if tensor_parallel is not False and tensor_parallel is not None:
        from dpcompile.tensor_parallel import transform_tensor_parallel

        return transform_tensor_parallel(
            model,
            parsed,
            plan=tensor_parallel,
            example_inputs=example_inputs,
            output_device=out_device,
            leaf_modules=leaf_modules,
        )
    with _gc_paused():
        return _transform_data_parallel(
            model, parsed, example_inputs, batch_dim, out_device, tuple(leaf_modules), copy_replicas
        )


def _apply_frontend(
    model: nn.Module,
    frontend: str,
    example_inputs: Sequence[Any] | None,
    example_kwargs: Mapping[str, Any] | None,
    leaf_modules: Iterable[type[nn.Module]],
    batch_dim: int | None,
    flags_served: bool = True,
) -> tuple[nn.Module, Sequence[Any] | None, int | None]:
    """The model as its frontend captures it (:func:`dpcompile.capture.capture_model`): the model
    itself where fx traces it (traced again below, with its variants), else the exported program
    (a GraphModule over the model's own modules and parameters); and the examples as positional
    values in the program's argument order."""
    check_frontend(frontend)
    if example_inputs is not None and not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    no_examples = example_inputs is None and not example_kwargs
    if isinstance(model, fx.GraphModule) or frontend == "fx" or (frontend == "auto" and no_examples):
        return model, positional_examples(model, example_inputs, example_kwargs), batch_dim
    gm, info = capture_model(
        model, frontend=frontend, example_inputs=example_inputs, example_kwargs=example_kwargs,
        leaf_modules=leaf_modules, batch_dim=batch_dim,
    )  # fmt: skip
    if info.frontend == "fx" and (flags_served or not info.flags or frontend == "fx"):
        return model, info.example_inputs, batch_dim
    if info.frontend == "fx":  # fx needs flags fixed, which only data parallel re-checks per call
        gm, info = capture_model(
            model, frontend="export", example_inputs=example_inputs, example_kwargs=example_kwargs, batch_dim=batch_dim
        )
    return gm, info.example_inputs, batch_dim if batch_dim is not None or not info.batch_dim else info.batch_dim


@contextlib.contextmanager
def _gc_paused():
    """Compiling allocates many small objects that all live on; collecting them midway only
    costs time (superlinear in the graph's size)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _transform_data_parallel(
    model: nn.Module,
    devices: Devices,
    example_inputs: Sequence[Any] | None,
    batch_dim: int | None,
    output_device: torch.device,
    leaf_modules: tuple[type[nn.Module], ...],
    copy_replicas: bool,
) -> ParallelModule:
    import passes
    from dpcompile.analysis.batch_dims import infer_input_dims

    gm, flags = capture_fx(model, leaf_modules=leaf_modules, example_inputs=example_inputs)
    _move_to(model, devices.primary)
    if example_inputs is not None:
        propagate_shapes(gm, [x.to(devices.primary) if isinstance(x, torch.Tensor) else x for x in example_inputs])
    input_dims = infer_input_dims(gm, batch_dim=batch_dim, example_inputs=example_inputs)
    options = passes.PipelineOptions(devices=devices, input_dims=input_dims, output_device=output_device)
    gm, front_records = run_passes(gm, passes.frontend_pipeline(options))
    captured_graph = copy_graph(gm.graph)
    # forward is Python: traced again where a call takes another path (see ParallelModule)
    retraceable = not isinstance(model, fx.GraphModule) and getattr(gm, ROOT_LEAF, None) is not model
    lower = data_parallel_lowering(input_dims, output_device, copy_replicas)
    lowered = lower(gm, devices, recompile=False)  # ParallelModule compiles the final code
    return ParallelModule(
        lowered,
        lowered.graph,
        devices=devices,
        mode="data_parallel",
        input_dims=input_dims,
        output_device=output_device,
        captured_graph=captured_graph,
        lower=lower,
        records=front_records,
        class_name=type(model).__name__,
        share_all_of=model,
        source=model if retraceable else None,
        leaf_modules=leaf_modules,
        flags=flags,
    )


def recapture(
    model: nn.Module,
    devices: Devices,
    leaf_modules: Sequence[type[nn.Module]],
    none_args: frozenset[str],
    flags: Mapping[str, Any] | None = None,
) -> fx.GraphModule:
    """``model`` traced again, as it is now (its modes) and with ``none_args`` traced as None
    (``flags`` as their values), through the passes that tidy a capture (what the
    data-parallel lowering starts from)."""
    import passes

    gm = capture(model, leaf_modules=leaf_modules, none_args=none_args, flags=flags)
    gm, _ = run_passes(gm, passes.frontend_pipeline(passes.PipelineOptions(devices=devices)))
    return gm
