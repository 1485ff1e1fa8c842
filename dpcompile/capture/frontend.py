"""``capture_model``: one entry point for both frontends (``frontend="fx" | "export" | "auto"``)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch.fx as fx
from torch import nn

from dpcompile.capture.dynamic_sizes import refuse_fixed_dynamic_dims, refuse_unserved_sizes
from dpcompile.capture.fx import bind_examples, capture_fx, forward_parameters
from dpcompile.capture.inputs import ExportedFrom, called_modules, input_specs
from dpcompile.capture.norms import refuse_spectral_norm_hooks
from dpcompile.capture.side_effects import SideEffectRefused
from dpcompile.errors import ArgumentError, TraceError

log = logging.getLogger("dpcompile")

FRONTENDS = ("auto", "fx", "export")
# gm.meta key of an exported program: the model it was captured from (its changes are watched)
# and what the program fixed (an ExportedFrom)
EXPORTED_FROM = "dpcompile_exported_from"


@dataclasses.dataclass
class CaptureInfo:
    """How a model was captured.

    ``frontend``: the one used (``"fx"`` or ``"export"``); ``example_inputs``: the examples in
    placeholder order (for shape propagation); ``flags``: Python arguments fx traced as their
    values; ``batch_dim``: the dim export kept dynamic (None for fx); ``fx_error``: why fx was
    not used, under ``"auto"``; ``export_seconds``: ``torch.export.export``'s own time.
    """

    frontend: str
    example_inputs: tuple[Any, ...] | None = None
    flags: dict[str, Any] = dataclasses.field(default_factory=dict)
    batch_dim: int | None = None
    dynamic_batch: bool = True
    fx_error: str | None = None
    export_seconds: float = 0.0


def check_frontend(frontend: object) -> str:
    if frontend not in FRONTENDS:
        raise ArgumentError(f"frontend={frontend!r}: expected one of {', '.join(map(repr, FRONTENDS))}")
    return str(frontend)


def positional_examples(
    model: nn.Module, example_inputs: Sequence[Any] | None, example_kwargs: Mapping[str, Any] | None
) -> tuple[Any, ...] | None:
    """The examples as positional values in forward's order (gaps filled with defaults), as fx's
    placeholders take them."""
    if not example_kwargs:
        return None if example_inputs is None else tuple(example_inputs)
    given = bind_examples(model, example_inputs, example_kwargs)
    out: list[Any] = []
    params = [p for p in forward_parameters(model) if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    last = max((i for i, p in enumerate(params) if p.name in given), default=-1)
    for param in params[: last + 1]:
        if param.name in given:
            out.append(given[param.name])
        elif param.default is not param.empty:
            out.append(param.default)
        else:
            raise ArgumentError(f"example_kwargs= gives no value for '{param.name}', which has no default")
    return tuple(out)


def capture_model(
    model: nn.Module,
    *,
    frontend: str = "auto",
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    leaf_modules: Iterable[type[nn.Module]] = (),
    batch_dim: int | None = None,
    dynamic_dims: Any = None,
    lazy_other_mode: bool = False,
) -> tuple[fx.GraphModule, CaptureInfo]:
    """Capture ``model`` with the chosen frontend.

    ``"fx"``: ``torch.fx`` tracing (optional arguments and flags specialised where needed);
    ``"export"``: ``torch.export`` on the examples, the batch dim dynamic (and ``dynamic_dims=``:
    ``{argument: [dims]}``, or dims of every tensor argument); ``"auto"``: fx, and
    export where fx fails and examples are given. ``lazy_other_mode``: see
    :func:`~dpcompile.capture.export.capture_export`.

    >>> gm, info = capture_model(model, frontend="auto", example_kwargs={"input_ids": ids})  # doctest: +SKIP
    >>> info.frontend  # doctest: +SKIP
    'export'
    """
    frontend = check_frontend(frontend)
    has_examples = example_inputs is not None or bool(example_kwargs)
    if dynamic_dims is not None and not isinstance(model, fx.GraphModule):
        from dpcompile.capture.export_inputs import check_dynamic_dims

        check_dynamic_dims(model, dynamic_dims, example_inputs, example_kwargs)
    fx_error: TraceError | None = None
    if isinstance(model, nn.Module) and not isinstance(model, fx.GraphModule):
        refuse_spectral_norm_hooks(model)  # either frontend would run its hook once per replica
    if frontend in ("fx", "auto") or isinstance(model, fx.GraphModule):
        try:
            gm, flags = capture_fx(
                model, leaf_modules=leaf_modules, example_inputs=example_inputs, example_kwargs=example_kwargs
            )
            return gm, CaptureInfo("fx", positional_examples(model, example_inputs, example_kwargs), flags)
        except TraceError as error:
            if frontend == "fx" or not has_examples:
                raise
            fx_error = error
            log.info("fx could not capture %s (%s); using torch.export", type(model).__name__, error)
    from dpcompile.capture.export import capture_export

    try:
        exported = capture_export(
            model, example_inputs, example_kwargs, batch_dim=batch_dim, dynamic_dims=dynamic_dims,
            lazy_other_mode=lazy_other_mode,
        )  # fmt: skip
    except SideEffectRefused as error:
        if fx_error is None:
            raise
        # its way out is the fx frontend: say why fx did not take the model either
        raise SideEffectRefused(f"{error}\n(the fx frontend failed first: {fx_error})") from None
    except TraceError as error:
        route = working_part(model, leaf_modules)
        message = str(error)
        if fx_error is not None:
            message += f"\n(the fx frontend failed first: {fx_error})"
        if route and not getattr(error, "names_the_way_out", False):
            message += f"\n{route}"
        raise TraceError(message) from None
    refuse_fixed_dynamic_dims(exported.gm, dynamic_dims, type(model).__name__)
    refuse_unserved_sizes(exported.gm, exported.example_inputs, dynamic_dims, type(model).__name__)
    info = CaptureInfo(
        "export",
        exported.example_inputs,
        {},
        exported.batch_dim,
        exported.dynamic_batch,
        None if fx_error is None else str(fx_error),
        exported.export_seconds,
    )
    exported.gm.meta[EXPORTED_FROM] = ExportedFrom(model, input_specs(exported.gm), called_modules(exported.gm))
    return exported.gm, info


def working_part(model: nn.Module, leaf_modules: Iterable[type[nn.Module]] = (), tries: int = 4) -> str | None:
    """A route that works where neither frontend captures ``model`` (a detector's list inputs
    and data-dependent control flow): its largest direct submodule that fx captures, to transform
    on its own while the rest runs as it is."""
    total = sum(p.numel() for p in model.parameters())
    children = sorted(model.named_children(), key=lambda c: -sum(p.numel() for p in c[1].parameters()))
    for name, child in children[:tries]:
        size = sum(p.numel() for p in child.parameters())
        if size == 0:
            break
        try:
            capture_fx(child, leaf_modules=leaf_modules)
        except Exception:  # noqa: BLE001 - only a candidate
            continue
        return (
            f"a route that works: transform the part that can be captured, "
            f"dpcompile.transform(model.{name}, devices) ({size:,} of the {total:,} parameters), and run "
            f"the rest of {type(model).__name__} as it is (assign the result back: model.{name} = pm)"
        )
    return None
