"""The programs a loaded module carries: one per variant of a call, and the recipe, as data.

A loaded folder has no model class to trace again, so export builds, with the module's own
:class:`~dpcompile.program_cache.ProgramCache` machinery (``pm.recipe.build_program``), the
program for each call it may meet: training and eval mode, each pattern of optional
arguments left None, and both values of bool flags. Each is stored with its portable
:class:`~dpcompile.program_cache.CallKey`; the loaded module looks calls up by key and
refuses, with a ``DpCompileError``, a call it carries no program for (as an unpickled
program whose class cannot be imported does): it never runs the wrong program.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.export.common import ExportError, shards_stages
from dpcompile.export.serialize import NotData, decode_value, encode_value
from dpcompile.modules.executors import executor_of

log = logging.getLogger("dpcompile")

__all__ = ["MAX_PATTERNS", "collect", "decode_key", "decode_recipe", "decode_signature", "encode_key", "encode_recipe"]

MAX_PATTERNS = 8  # patterns of optional arguments (times flag values) traced ahead, per mode


# --------------------------------------------------------------------------- call keys
def encode_key(key: Any) -> dict[str, Any]:
    """A portable ``CallKey`` as JSON."""
    return {
        "devices": key.devices,
        "modes": [[path, training] for path, training in key.modes],
        "none_args": sorted(key.none_args),
        "flags": [[name, encode_value(value)] for name, value in key.flags],
    }


def decode_key(data: Any) -> Any:
    from dpcompile import program_cache
    from dpcompile.program_cache import CallKey

    modes_type = getattr(program_cache, "Modes", tuple)  # a tuple that hashes once
    try:
        if not isinstance(data, dict) or set(data) != {"devices", "modes", "none_args", "flags"} or type(data["devices"]) is not int:
            raise ValueError(data)
        modes = tuple((str(p), t) for p, t in data["modes"] if type(t) is bool)
        if len(modes) != len(data["modes"]):
            raise ValueError(data["modes"])
        none_args = frozenset(str(n) for n in data["none_args"])
        flags = tuple((str(n), decode_value(v)) for n, v in data["flags"])
        return CallKey(data["devices"], modes_type(modes), none_args, flags)
    except (TypeError, ValueError) as e:
        raise ExportError(f"program.json: a call key it cannot read ({e!r:.80})") from None


def encode_inputs(inputs: Any) -> dict[str, Any] | None:
    """What an export-captured program fixed of its arguments (``(InputSpec, ...), model name``), as data."""
    if inputs is None:
        return None
    specs, model_name = inputs
    return {
        "model": model_name,
        "args": [[s.name, None if s.shape is None else list(s.shape), None if s.dtype is None else str(s.dtype).removeprefix("torch.")]
                 for s in specs],
    }  # fmt: skip


def decode_inputs(data: Any) -> Any:
    """The counterpart of :func:`encode_inputs`: every field checked (a name, sizes or None, a torch dtype)."""
    from dpcompile.capture.inputs import InputSpec

    if data is None:
        return None
    try:
        if not isinstance(data, dict) or set(data) != {"model", "args"} or not isinstance(data["model"], str):
            raise ValueError(data)
        specs = []
        for name, shape, dtype in data["args"]:
            if not isinstance(name, str) or (shape is not None and not isinstance(shape, list)):
                raise ValueError(name)
            if shape is not None and not all(d is None or type(d) is int for d in shape):
                raise ValueError(shape)
            found = None if dtype is None else getattr(torch, str(dtype), None)
            if dtype is not None and not isinstance(found, torch.dtype):
                raise ValueError(dtype)
            specs.append(InputSpec(name, None if shape is None else tuple(shape), found))
        return tuple(specs), data["model"]
    except (TypeError, ValueError) as e:
        raise ExportError(f"program.json: the arguments' record it cannot read ({e!r:.80})") from None


def decode_signature(data: Any) -> Any:
    """Where a call's optional and flag arguments sit (``CallSignature``)."""
    from dpcompile.program_cache import CallSignature

    try:
        optional = tuple((int(p), str(n)) for p, n in data["optional"])
        flags = tuple((int(p), str(n), decode_value(d)) for p, n, d in data["flags"])
        if set(data) != {"optional", "flags"}:
            raise ValueError(sorted(data))
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"program.json: a call signature it cannot read ({e!r:.80})") from None
    return CallSignature(optional, flags)


# ------------------------------------------------------------------------------ recipes
def _recipe_classes() -> dict[str, type]:
    from dpcompile.recipes.data_parallel import DataParallelRecipe
    from dpcompile.recipes.pipeline import PipelineRecipe
    from dpcompile.recipes.tensor_parallel import TensorParallelRecipe

    return {"data_parallel": DataParallelRecipe, "tensor_parallel": TensorParallelRecipe,
            "pipeline": PipelineRecipe, "pipeline_tensor_parallel": PipelineRecipe}  # fmt: skip


def encode_recipe(recipe: Any) -> dict[str, Any]:
    """The recipe's fields as JSON (its class follows from the program's kind). Leaf module
    classes are stored by name and must be ``torch.nn`` or registered classes."""
    from dpcompile.devices import Devices
    from dpcompile.export.allowlist import can_rebuild, class_name

    out: dict[str, Any] = {}
    for f in dataclasses.fields(recipe):
        value = getattr(recipe, f.name)
        if f.name == "leaf_modules":
            bad = [class_name(c) for c in value if not can_rebuild(c)]
            if bad:
                raise NotData(f"leaf_modules= names {bad}, classes fx keeps as leaves (their forward is Python code)")
            out[f.name] = [class_name(c) for c in value]
        elif isinstance(value, Devices):
            out[f.name] = [str(d) for d in value]
        elif isinstance(value, frozenset):
            out[f.name] = sorted(value)
        elif isinstance(value, Mapping):
            out[f.name] = {"dict": [[k, encode_value(v)] for k, v in value.items()]}
        else:
            out[f.name] = encode_value(value)
    return out


def decode_recipe(kind: str, data: Any, devices: Any, output_device: torch.device) -> Any:
    """The recipe of a loaded program, for the devices it loads onto."""
    from dpcompile.export.allowlist import NotAllowed, resolve_class

    cls = _recipe_classes()[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(data, dict) or not set(data) <= names:
        raise ExportError(f"program.json: a {kind} recipe with fields {sorted(data) if isinstance(data, dict) else data!r:.80}")
    values: dict[str, Any] = {}
    try:
        for name, value in data.items():
            if name == "leaf_modules":
                values[name] = tuple(resolve_class(str(c)) for c in value)
            elif name in ("devices", "output_device"):
                continue
            elif name == "none_args":
                values[name] = frozenset(str(n) for n in value)
            else:
                values[name] = decode_value(value)
    except NotAllowed as e:
        raise ExportError(f"program.json: recipe: {e}") from None
    except (TypeError, ValueError) as e:
        raise ExportError(f"program.json: a recipe it cannot read ({e!r:.80})") from None
    try:
        return cls(**values, devices=devices, output_device=output_device)
    except (TypeError, ValueError) as e:
        raise ExportError(f"program.json: a recipe it cannot build ({e})") from None


# ------------------------------------------------------------------------- at export
def _patterns(optional: list[str]) -> list[frozenset[str]]:
    """Which optional arguments to trace as None: every subset where few, else none, all, each one."""
    subsets = [frozenset(c) for r in range(len(optional) + 1) for c in itertools.combinations(optional, r)]
    if len(subsets) <= MAX_PATTERNS:
        return subsets
    return [frozenset(), frozenset(optional), *(frozenset({o}) for o in optional)]


def _flag_choices(traced: tuple[tuple[str, Any], ...]) -> list[tuple[tuple[str, Any], ...]]:
    """The flag values to trace: the traced ones, and where there are at most two bool flags,
    every combination of them."""
    if not traced or sum(type(v) is bool for _, v in traced) > 2:
        return [traced]
    options = [[v, not v] if type(v) is bool else [v] for _, v in traced]
    return [tuple(zip([n for n, _ in traced], combo)) for combo in itertools.product(*options)]


def _keys(pm: nn.Module) -> list[Any]:
    from dpcompile.program_cache import CallKey

    main = pm.program_cache.main_key
    optional = [name for _, name in pm.call_signature.optional]
    patterns, choices = _patterns(optional), _flag_choices(tuple(main.flags))
    if len(patterns) * len(choices) > MAX_PATTERNS:  # bound the traces: flags as traced only
        choices = [tuple(main.flags)]
    keys = [main]
    for training in (True, False):
        modes = tuple((path, training) for path, _ in main.modes)
        for nones, flags in itertools.product(patterns, choices):
            key = CallKey(main.devices, modes, nones, flags, main.guard)
            if key not in keys:
                keys.append(key)
    if shards_stages(pm):  # a batch below micro_batches: its shards cannot be lowered again
        keys += [key._replace(devices=m) for key in list(keys) for m in range(1, min(main.devices, MAX_PATTERNS + 1))]
    return keys


def steppable(pm: nn.Module, key: Any, program: fx.GraphModule | None) -> bool:
    """Whether a ``"1f1b"`` training call as ``key`` can run ``program`` as 1F1B units. Export
    builds a tensor-parallel pipeline's programs for fewer micro-batches without the call's inputs
    (it has none), and such a program may gather the micro-batches before the loss: 1F1B cannot
    step it, so it is not carried and the loaded module refuses that call, naming what it was
    traced for. GPipe and eval calls run it as it is."""
    from dpcompile.errors import DpCompileError
    from dpcompile.modules.pipeline_1f1b import OneFOneBStep

    if program is None or not executor_of(pm).steps_one_f_one_b or not dict(key.modes).get("", True):
        return True
    try:
        OneFOneBStep(program, len(pm.stages), key.devices)
    except DpCompileError:
        return False
    return True


def collect(pm: nn.Module) -> tuple[list[tuple[Any, fx.GraphModule | None]], list[tuple[Any, fx.GraphModule | None]]]:
    """``(programs, traces)``: each carried call key (portable) with its program (None: the
    main one), and the data-parallel traces they are lowered from (for fewer devices)."""
    cache = pm.program_cache
    if pm.__dict__.get("traced_model") is None:  # nothing to trace: what the module carries already
        carried = getattr(cache.build, "programs", {})  # a loaded or unpickled module's own variants
        programs = [(cache.main_key.portable(), None)]
        programs += [(key, None if graph is None else cache.build(key, (), {})) for key, graph in carried.items()]
        programs += [(key.portable(), program) for key, program in cache.items() if not key.batched and not key.unbatched]
    else:
        programs = []
        for key in _keys(pm):
            try:
                program = None if key == cache.main_key else pm.recipe.build_program(pm, key, (), {})
            except Exception as e:  # noqa: BLE001 - a call the loaded program then refuses
                log.info("export: no program for %s (%s)", key.describe(), e)
                continue
            if shards_stages(pm) and not steppable(pm, key, program):
                log.info("export: no 1F1B program for %s (built without the call's inputs)", key.describe())
                continue
            programs.append((key.portable(), program))
    traces = [(key.portable(), gm) for key, gm in cache.traces.items() if isinstance(gm, fx.GraphModule) or gm is None]
    unique: dict[Any, Any] = {}
    for key, program in programs:
        unique.setdefault(key, program)
    return list(unique.items()), traces
