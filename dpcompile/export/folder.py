"""Writing and reading an export folder: files, manifest, integrity, then building.

See ``docs/export.md`` for the layout and what :func:`load` promises.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.checkpoint.headers import DTYPES
from dpcompile.errors import ArgumentError, DpCompileError
from dpcompile.export.build import build, is_recorded_kind, place
from dpcompile.export.common import (
    FORMAT,
    FORMAT_VERSION,
    KINDS,
    MANIFEST_FILE,
    MODULE_FILE,
    PICKLE_FILE,
    PROGRAM_FILE,
    PROGRAM_FORMAT,
    SUMMARY_FIELDS,
    WEIGHTS_FILE,
    ExportError,
    device_strings,
    dtype_name,
    readable_mode,
    runs_stages,
)
from dpcompile.export.integrity import (
    canonical_json,
    check_manifest_hash,
    read_manifest,
    read_program,
    read_weights,
    sha256_of,
)
from dpcompile.export.mesh import export_over_mesh, is_mesh_program, load_over_mesh, recorded_layout
from dpcompile.export.pipeline import PIPELINE_KINDS, describe_pipeline, stage_graphs, step_graphs
from dpcompile.export.source import call_label, class_name_of, generated_source, program_source
from dpcompile.fx_utils import unalias
from dpcompile.version import __version__

log = logging.getLogger("dpcompile")

# what an export (of this version or the last) writes: replaced or removed by the next one
_OURS = frozenset({MODULE_FILE, PROGRAM_FILE, WEIGHTS_FILE, PICKLE_FILE, MANIFEST_FILE, "weights.pt"})


# ---------------------------------------------------------------------- export: tensors
def _tensor_keys(pm: nn.Module, constants: Mapping[str, torch.Tensor] = {}) -> tuple[dict[int, str], dict[str, torch.Tensor], dict[str, str]]:
    """Every parameter and buffer once: ``id -> file key``, ``file key -> tensor``, and
    ``name in pm -> file key``. Data parallel: the module path (the state_dict key).
    Tensor parallel: shard k of ``fc1.weight`` is ``fc1.weight.shard<k>``."""
    rename: dict[str, str] = {}
    if pm.__dict__.get("param_shards") is not None:  # parameters stored as shards
        for key, (_, names) in pm.param_shards.items():
            rename.update({name: f"{key}.shard{k}" for k, name in enumerate(names)})
    keys: dict[int, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    named = list(pm.named_parameters(remove_duplicate=False)) + list(pm.named_buffers(remove_duplicate=False))
    outside = pm.__dict__.get("root")
    if isinstance(outside, nn.Module) and "root" not in pm._modules:
        named += [(f"root.{n}", t) for n, t in outside.named_parameters(remove_duplicate=False)]
        named += [(f"root.{n}", t) for n, t in outside.named_buffers(remove_duplicate=False)]
    named += list(constants.items())
    for name, t in named:
        if t is None:
            continue
        if id(t) not in keys:
            key = rename.get(name, name)
            keys[id(t)] = key
            tensors[key] = t
        names[name] = keys[id(t)]
    return keys, tensors, names


def _slots(pm: nn.Module, tensors: Mapping[str, torch.Tensor], names: Mapping[str, str]) -> dict[str, int | None]:
    """The device slot each tensor lives on (None: ``devices[0]``)."""
    slots: dict[str, int | None] = dict.fromkeys(tensors)
    shard_slots = getattr(pm, "shard_param_slots", None) or {}
    for name, key in names.items():
        if shard_slots.get(name) is not None:
            slots[key] = shard_slots[name]
    strings = device_strings(pm.devices)
    if len(set(strings)) == len(strings):
        for key, t in tensors.items():
            if slots[key] is None and str(t.device) in strings:
                slots[key] = strings.index(str(t.device))
    return slots


def _used_paths(pm: nn.Module, graphs: Sequence[fx.Graph]) -> set[str]:
    """Module paths whose class matters: what the program calls (directly, on a replica, or
    hands to anything but ``replicate``; reading its ``training`` flag needs no class, as in
    ``mode_value(module, 0.1, 0.0)``, attention's ``dropout_p`` by mode)."""
    from dpcompile.runtime import replicate
    from dpcompile.runtime.exported import expect_mode, mode_value

    def needs_class(user: fx.Node) -> bool:
        reads_flag = user.target is getattr and user.args[1:] == ("training",)
        reads_flag = reads_flag or user.target in (mode_value, expect_mode)
        return user.target is not replicate and not reads_flag

    modules = dict(pm.named_modules(remove_duplicate=False))
    used: set[str] = set()
    for graph in graphs:
        for node in graph.nodes:
            target = unalias(node.target) if isinstance(node.target, str) else node.target  # the model's name
            if node.op == "call_module" or (node.op == "call_method" and target in modules and target):
                used.add(target)
            elif node.op == "get_attr" and target in modules:
                if any(needs_class(u) for u in node.users):
                    used.add(target)
    return used


def _constants(pm: nn.Module, programs: Sequence[tuple[fx.GraphModule, fx.Graph]]) -> dict[str, torch.Tensor]:
    """Tensors a variant program holds beyond ``pm`` (the tracer's ``_tensor_constant0``):
    renamed in the variant's graph (a copy export owns) and returned, to be stored as
    non-persistent buffers of the root. ``pm`` itself is not touched."""
    from dpcompile.export.serialize import NotData

    extra: dict[str, torch.Tensor] = {}
    named: dict[int, str] = {}
    for index, (owner, graph) in enumerate(programs):
        for node in graph.nodes:
            if node.op != "get_attr":
                continue
            value = _attr(owner, node.target)
            try:
                # the model's state, or a constant made in forward that pm holds (a variant's trace may
                # number its own constants anew: one of the same name and another value is its own)
                held = _attr(pm, node.target)
                if held is value or not node.target.startswith("_tensor_constant"):
                    continue
            except AttributeError:
                pass
            if not isinstance(value, torch.Tensor):
                raise NotData(f"variant program {index} reads {node.target!r}, which is not in the module")
            if id(value) not in named:  # a program and its trace hold the same tensor: stored once
                named[id(value)] = f"_dpcompile_variant{index}_{node.target.replace('.', '_')}"
                extra[named[id(value)]] = value
            node.target = named[id(value)]
    return extra


def _attr(root: Any, path: str) -> Any:
    value = root
    for part in path.split("."):
        value = getattr(value, part)
    return value


# ------------------------------------------------------------------------------ export
def export(pm: nn.Module, path: str | Path) -> Path:
    """Write ``pm`` to the folder ``path`` (created if needed); returns the folder.

    ``module.py`` (the readable program), ``program.json`` (the program as data),
    ``weights.safetensors`` and ``manifest.json``; plus ``program.pkl`` only for a program
    that holds Python classes fx kept as leaves (loaded with ``trust_code=True`` only).

    >>> import torch, dpcompile
    >>> pm = dpcompile.transform(torch.nn.Linear(4, 2), ["cpu", "cpu"])
    >>> sorted(p.name for p in dpcompile.export(pm, "/tmp/dp_export").iterdir())  # doctest: +SKIP
    ['manifest.json', 'module.py', 'program.json', 'weights.safetensors']
    """
    from dpcompile.modules.base import ParallelModule
    from dpcompile.modules.other_mode import both_modes

    if not isinstance(pm, ParallelModule):
        raise ArgumentError(f"export needs a dpcompile.ParallelModule (from dpcompile.transform), got {type(pm).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentError(f"path={path!r}: expected a str or os.PathLike, the folder to write the export into")
    if is_mesh_program(pm):  # every rank calls it: whole tensors gathered, rank 0 writes the single-device program
        recorded_layout(pm)  # what cannot be recorded is refused on every rank before anything else
        _check_exportable(pm, watched=pm.mode != "spmd_pipeline")  # a pipeline's stages are cut once, from a copy
        return export_over_mesh(pm, Path(path), _export_single_of_mesh)
    pm = both_modes(pm)  # a program exported in one mode captures the other now: the folder serves both
    if pm.mode not in KINDS:
        raise ExportError(f"export writes one-process programs and programs over a DeviceMesh; not a {pm.mode} program")
    _check_exportable(pm)
    return _export_checked(pm, Path(path))


def _check_exportable(pm: nn.Module, *, watched: bool = True) -> None:
    """Refuse a program without weights, or (``watched``: it follows the model) whose model changed since transform."""
    from dpcompile.modules.weights import needs_weights

    if needs_weights(pm):  # its tensors hold uninitialised memory: a loaded copy would run on it
        raise ExportError(
            "this program was built on the meta device and holds no weights yet: load them first "
            "(dpcompile.load_checkpoint(pm, path)), then export"
        )
    if watched and pm.model_changed_since_transform():
        raise ExportError(
            "the model changed since transform (a hook, submodule, parameter or attribute forward reads): the "
            "program would be the one traced before; call dpcompile.transform again and export that"
        )


def _export_single_of_mesh(one: nn.Module, folder: Path, layout: dict[str, Any]) -> None:
    """Rank 0 of an export over a mesh: the single-device program ``one``, written with ``config.mesh``."""
    from dpcompile.modules.other_mode import both_modes

    one = both_modes(one)  # the folder serves both modes, as any export
    _check_exportable(one)
    _export_checked(one, folder, mesh=layout)


def _export_checked(pm: nn.Module, folder: Path, *, mesh: dict[str, Any] | None = None) -> Path:
    """Write the checked program ``pm`` (one process) to ``folder``; ``mesh``: the layout it was exported over."""
    from dpcompile.modules.fsdp_one_process import FsdpProgram, replicated_program

    if folder.exists() and not folder.is_dir():
        raise ExportError(f"{folder} exists and is not a folder")
    fsdp = isinstance(pm, FsdpProgram)
    if fsdp:  # written as the replicated program it was sharded from (whole tensors), sharded again at load
        try:
            pm = replicated_program(pm)
        except DpCompileError as e:  # a parametrization of the model's (weight_norm), as for replication
            raise ExportError(f"cannot serialise the program: {e}") from e
    program, files, tensors = _describe(pm, fsdp=fsdp, mesh=mesh)
    if unheld := {key: t.dtype for key, t in tensors.items() if t.dtype not in DTYPES}:
        key, dtype = next(iter(unheld.items()))
        raise ExportError(
            f"{len(unheld)} tensor(s) of the program have a dtype safetensors cannot hold, e.g. '{key}' ({dtype}); "
            "hold a complex tensor as torch.view_as_real(t) (a real one, a last dim of 2) and torch.view_as_complex "
            "it in forward, or save with torch.save(pm, f)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    strangers = sorted(p.name for p in folder.iterdir() if p.name not in _OURS and not p.name.startswith(".dpcompile-"))
    if strangers:
        raise ExportError(f"{folder} holds {strangers}, which are not part of an export; export into an empty folder")

    _write(folder, program, files, tensors)
    log.info("exported %s (%s on %s) to %s", program["class_name"], pm.mode, program["config"]["devices"], folder)
    return folder


def _as_data(pm: nn.Module) -> tuple[dict[str, Any], list[dict[str, Any]], dict[int, str], dict[str, torch.Tensor], dict[str, str], list]:
    """The program as data: ``(data section, module tree, tensor keys, tensors, names, lowered
    programs by method name)``; raises ``NotData`` where part of it is Python code."""
    from dpcompile.export.serialize import NotData, encode_graph, encode_tree, encode_value
    from dpcompile.export.variants import collect, encode_inputs, encode_key, encode_recipe
    from dpcompile.fx_utils import copy_graph, example_shapes
    from dpcompile.modules.pickling import exported_inputs

    model = pm.__dict__.get("traced_model")
    # the model's own hooks: run from the model it shares, or taken as the program's own (tensor parallel's)
    holder = model if getattr(pm, "_shares_source", False) and model is not None else pm
    if holder._forward_hooks or holder._forward_pre_hooks or holder._backward_hooks or holder._backward_pre_hooks:
        name = type(model).__name__ if model is not None else pm.__dict__.get("class_name", type(pm).__name__)
        raise NotData(f"the model ({name}) has forward hooks (or backward hooks) on itself, which run around the program (Python code)")
    captured = pm.captured.graph if getattr(pm, "captured", None) is not None else None
    programs, traces = collect(pm)
    # copies: renaming a variant's own tensors (below) must not touch the module's cached programs
    programs = [(key, None if p is None else (p, copy_graph(p.graph))) for key, p in programs]
    traces = [(key, None if gm is None else (gm, copy_graph(gm.graph))) for key, gm in traces]
    owned = [pair for _, pair in programs + traces if pair is not None]
    constants = _constants(pm, owned)
    stages = [s.program.graph for s in pm.__dict__.get("stages", ())]  # a pipeline's, shown in module.py
    used = _used_paths(pm, [pm.graph, *([captured] if captured is not None else []), *(g for _, g in owned), *stages])
    keys, tensors, names = _tensor_keys(pm, constants)
    root = pm.__dict__.get("root")
    outside = {"root": root} if isinstance(root, nn.Module) and "root" not in pm._modules else {}
    tree = encode_tree(pm, used, keys, outside, constants)
    main = pm.program_cache.main_key.portable()
    labels = _labels([key for key, pair in programs if pair is not None])
    data = {
        "recipe": encode_recipe(pm.recipe),
        "main_key": encode_key(main),
        "signature": {
            "optional": [[p, n] for p, n in pm.call_signature.optional],
            "flags": [[p, n, encode_value(d)] for p, n, d in pm.call_signature.flags],
        },
        "graph": encode_graph(pm.graph),
        "captured": None if captured is None else encode_graph(captured) | {"inputs": example_shapes(captured)},
        "variants": [
            {"label": labels.get(key), "key": encode_key(key), "graph": None if pair is None else encode_graph(pair[1])}
            for key, pair in programs
        ],
        "traces": [
            {"key": encode_key(key), "graph": None if pair is None else encode_graph(pair[1]) | {"inputs": example_shapes(pair[1])}}
            for key, pair in traces
        ],
        "inputs": encode_inputs(exported_inputs(pm)),  # what export fixed of the arguments: the call check
    }
    lowered = [("forward", pm.graph), *((labels[key], pair[1]) for key, pair in programs if pair is not None)]
    return data, tree, keys, tensors, names, lowered


def _describe(pm: nn.Module, *, fsdp: bool = False, mesh: dict[str, Any] | None = None,
              ) -> tuple[dict[str, Any], dict[str, bytes], dict[str, torch.Tensor]]:  # fmt: skip
    """``(program.json's content, files to write beside it, tensors by file key)``; ``fsdp``: ``pm``
    is the replicated program an FSDP one was sharded from (``config.data_parallel``: "fsdp");
    ``mesh``: ``config.mesh``, the layout a program over a mesh was exported from (``export/mesh.py``)."""
    from dpcompile.export.build import readable_programs
    from dpcompile.export.serialize import NotData

    strings = device_strings(pm.devices)
    class_name = class_name_of(pm)
    pickled_reason = None
    try:
        data, tree, keys, tensors, names, lowered = _as_data(pm)
    except NotData as e:
        if runs_stages(pm):
            raise ExportError(
                f"a pipeline whose program is not plain data ({e}) is not exported yet; the nearest that works: "
                "torch.save(pm, f), or register the class (from dpcompile.export import register_module_class)"
            ) from None
        if mesh is not None:
            raise ExportError(f"a program over a mesh whose program is not plain data ({e}) is not exported yet") from None
        pickled_reason = str(e)
        log.warning("export: %s; writing program.pkl, which dpcompile.load reads only with trust_code=True", e)
        keys, tensors, names = _tensor_keys(pm)
    slots = _slots(pm, tensors, names)
    config: dict[str, Any] = {
        "devices": strings,
        "output_device": str(pm.output_device),
        "input_dims": dict(pm.input_dims),
        "plan": dict(pm.plan),
        "tensor_parallel": None,
    }
    if getattr(pm, "layout", None):  # verify(fake_devices=) reads the dp copies off it, explain its words
        config.update(layout=[[k, n] for k, n in pm.layout.items()], strategies=dict(getattr(pm, "strategies", None) or {}))
    if fsdp:
        config["data_parallel"] = "fsdp"
    if getattr(pm, "memory_options", None):  # what explain's memory_estimate counts (optimizer=, training=)
        config["memory_options"] = {"optimizer": pm.memory_options["optimizer"], "training": pm.memory_options["training"]}
    if mesh is not None:
        config["mesh"] = mesh
    if runs_stages(pm):
        config["pipeline"] = describe_pipeline(pm, lowered)
    if pm.__dict__.get("param_shards") is not None:
        cost = getattr(pm, "comm_cost", None)
        config["tensor_parallel"] = {
            "state_keys": list(pm.state_keys),
            "param_shards": {k: {"dim": s.dim, "sizes": list(s.sizes), "sections": s.sections, "names": list(n)}
                             for k, (s, n) in pm.param_shards.items()},
            "plan_reasons": dict(pm.plan_reasons),
            "comm_cost": None if cost is None else [float(cost.forward), float(cost.backward)],
            "captured_code": str(getattr(pm, "captured_code", "")),
        }
    program: dict[str, Any] = {
        "format": PROGRAM_FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": pm.mode,
        "class_name": class_name,
        "dpcompile_version": __version__,
        "torch_version": torch.__version__,
        "trust_code": pickled_reason is not None,
        "pickled_because": pickled_reason,
        "config": config,
        "training": bool(pm.training),
        "tensors": {
            key: {
                "shape": list(t.shape),
                "dtype": dtype_name(t.dtype),
                "parameter": isinstance(t, nn.Parameter),
                "requires_grad": bool(t.requires_grad),
                "slot": slots[key],
            }
            for key, t in tensors.items()
        },
        "modules": None,
        "data": None,
    }
    if pickled_reason is None:
        program["modules"] = tree
        program["data"] = data
        # module.py is made from what load will read, so load can regenerate it exactly
        from dpcompile.export.kinds import TreeIndex

        index = TreeIndex(tree)
        section = config.get("pipeline") or {}
        steps = [(label, graph) for _, label, graph in step_graphs(section, index)]
        readable = readable_programs(data, index) + stage_graphs(section, index) + steps
        files: dict[str, bytes] = {}
    else:
        readable = [("forward", pm.graph)]
        files = {PICKLE_FILE: _pickle(pm, keys)}
    files[PROGRAM_FILE] = canonical_json(program)
    mode = readable_mode(pm.mode, config)
    files[MODULE_FILE] = program_source(readable, class_name=class_name, mode=mode, devices=strings).encode()
    return program, files, tensors


def _write(folder: Path, program: dict[str, Any], files: dict[str, bytes], tensors: dict[str, torch.Tensor]) -> None:
    """Write under temporary names, rename into place, drop what an earlier export left, and
    write the manifest last: an interrupted export leaves no folder that loads. Temporary files
    are created new (``O_EXCL | O_NOFOLLOW``): a link planted at one is never followed."""
    import safetensors.torch

    (folder / MANIFEST_FILE).unlink(missing_ok=True)
    _drop_temporaries(folder)
    weights = {}
    seen_storage: set[int] = set()
    for key, t in tensors.items():
        data = t.detach().to("cpu")
        ptr = data.untyped_storage().data_ptr() if data.numel() else None
        # safetensors shares nothing and writes row-major bytes (a channels_last weight's clone keeps its strides)
        data = data.clone(memory_format=torch.contiguous_format) if ptr in seen_storage or not data.is_contiguous() else data
        if ptr is not None:
            seen_storage.add(ptr)
        weights[key] = data
    contents = {**files, WEIGHTS_FILE: safetensors.torch.save(weights, metadata={"format": "pt"})}
    del weights
    for name, data in contents.items():
        _write_new(folder, _temporary(name), data)
    for name in contents:
        (folder / _temporary(name)).replace(folder / name)  # a rename replaces a link, never follows it
    for stale in _OURS - set(contents) - {MANIFEST_FILE}:
        (folder / stale).unlink(missing_ok=True)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "files": {name: {"sha256": sha256_of(folder / name), "size": (folder / name).stat().st_size} for name in sorted(contents)},
        "program": {k: program[k] for k in SUMMARY_FIELDS if k != "devices"} | {"devices": program["config"]["devices"]},
    }
    _write_new(folder, _temporary(MANIFEST_FILE), canonical_json(manifest))
    (folder / _temporary(MANIFEST_FILE)).replace(folder / MANIFEST_FILE)


def _temporary(name: str) -> str:
    return f".dpcompile-{name}.tmp"


def _drop_temporaries(folder: Path) -> None:
    """Remove what an interrupted export left (a link itself, never what it points to)."""
    for path in folder.iterdir():
        if path.name.startswith(".dpcompile-") and path.name.endswith(".tmp"):
            if path.is_dir() and not path.is_symlink():
                raise ExportError(f"{path} is a folder where export writes a temporary file; remove it and export again")
            path.unlink(missing_ok=True)


def _write_new(folder: Path, name: str, data: bytes) -> None:
    """Write ``data`` to the new file ``folder/name``: created, never opened if anything (a file,
    a link) is already there, so a link planted at the name is not followed."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(folder / name, flags, 0o666)
    except FileExistsError:
        raise ExportError(
            f"{folder / name} appeared while export was writing {folder} (another process writes there); "
            "export into a folder only you write"
        ) from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _labels(keys: list[Any]) -> dict[Any, str]:
    """A method name for each variant program in module.py: ``forward_eval_mask_none``."""
    labels: dict[Any, str] = {}
    for key in keys:
        label = call_label("forward_", key)
        labels[key] = label if label not in labels.values() else f"{label}_{len(labels)}"
    return labels


def _pickle(pm: nn.Module, keys: dict[int, str]) -> bytes:
    from dpcompile.export.pickled import dump

    try:
        return dump(pm, keys)
    except Exception as e:
        raise ExportError(f"cannot serialise the program: {type(e).__name__}: {e}") from e


def _target_devices(recorded: list[str], devices: Any) -> Any:
    from dpcompile.devices import parse_devices

    spec = recorded if devices is None else devices
    try:
        return parse_devices(spec)
    except ValueError as e:
        if devices is None:
            raise ExportError(
                f"the export was made for {recorded}, which this machine does not have ({e}); "
                f"pass devices=, e.g. load(path, devices={['cpu'] * len(recorded)!r})"
            ) from None
        raise


def load(path: str | Path, devices: Any = None, *, mesh: Any = None, trust_code: bool = False,
         expected_hash: str | None = None) -> nn.Module:  # fmt: skip
    """Load an export folder as a :class:`~dpcompile.ParallelModule` of the kind it records.

    Before anything is built: the manifest (every field), every file (listed, present, size
    and sha256, nothing unlisted), the program (every call target from the allowlist, every
    module class ``torch.nn`` or registered), the weights (names, shapes and dtypes as the
    program says) and ``module.py`` (regenerated from the program: it must be equal) are
    checked; a failure raises :class:`ExportError`. No pickle is read and no code from the
    folder runs, unless ``trust_code=True`` for a folder that needs it (a program holding
    Python classes fx kept as leaves). A data-parallel program is regenerated for any
    device list; a tensor-parallel one needs as many devices as it was exported for, and a
    pipeline (``config.pipeline``: :mod:`dpcompile.export.pipeline`) the very devices.

    ``mesh``: a ``DeviceMesh``; every process calls ``load`` (a collective) and gets its rank's program:
    the folder's single-device program lowered over the mesh with the keywords it was exported with
    (a folder ``export`` wrote over a mesh, ``dpcompile.export.mesh``). Without it, such a folder loads
    as the single-device program.

    ``expected_hash``: the sha256 of ``manifest.json`` (:func:`manifest_hash` where it was
    exported) from a channel you trust; the manifest lists every file's sha256, so a folder
    that loads with it is byte for byte the one exported. Without it, the checks detect
    corruption and inconsistent edits, not who wrote the folder (``docs/export.md``).

    >>> import dpcompile
    >>> pm = dpcompile.load("exported", devices=["cpu"] * 4)  # doctest: +SKIP
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentError(f"path={path!r}: expected a str or os.PathLike, the folder that dpcompile.export wrote")
    folder = Path(path)
    if mesh is not None:
        from dpcompile.mesh import is_device_mesh

        if not is_device_mesh(mesh) or devices is not None:
            raise ArgumentError(f"mesh={mesh!r:.60}: expected a torch.distributed DeviceMesh, and devices= left out")
        return load_over_mesh(folder, mesh, lambda target: _load(folder, target, trust_code, expected_hash))
    return _load(folder, devices, trust_code, expected_hash)[0]


def _load(folder: Path, devices: Any, trust_code: bool, expected_hash: str | None) -> tuple[nn.Module, dict[str, Any]]:
    """:func:`load`'s module and the checked ``program.json`` it was built from."""
    if expected_hash is not None:
        check_manifest_hash(folder, expected_hash)
    manifest = read_manifest(folder)
    program = read_program(folder, manifest)
    config = program["config"]
    recorded = list(config["devices"])
    if program["trust_code"] and not trust_code:
        raise ExportError(
            f"{folder} holds a program that is not plain data ({program['pickled_because']}), so it was exported "
            f"as a pickle ({PICKLE_FILE}), and unpickling runs code from the folder. Load it with "
            "dpcompile.load(path, trust_code=True) only if you trust who made it; or make the class a torch.nn "
            "class or register it in both processes (from dpcompile.export import register_module_class, or "
            "register_output_type for a namedtuple or dataclass the model returns), and export again"
        )
    target = _target_devices(recorded, devices)
    if program["kind"] != "data_parallel" and len(target) != len(recorded):
        what = "devices" if program["kind"] in PIPELINE_KINDS else "shards"
        raise ExportError(
            f"this {program['kind']} export has {len(recorded)} {what} ({recorded}); load it onto {len(recorded)} "
            f"devices, not {len(target)}"
        )
    weights = read_weights(folder, program)
    tensors = place(weights, program["tensors"], target)
    if program["trust_code"]:
        from dpcompile.export.pickled import restore

        pm = restore(folder / PICKLE_FILE, tensors, program, target)
        mode = readable_mode(program["kind"], config)
        source = program_source([("forward", pm.graph)], class_name=program["class_name"], mode=mode, devices=recorded)
        if device_strings(pm.devices) == recorded and source.encode() != (folder / MODULE_FILE).read_bytes():
            raise ExportError(f"{folder / MODULE_FILE} is not the program in {PICKLE_FILE}; the folder was edited: re-export")
    else:
        try:
            pm = build(folder, program, tensors, target)
        except RecursionError:
            raise ExportError(f"{folder / PROGRAM_FILE} nests values too deeply to be a program") from None
        except ExportError:
            raise
        except Exception as e:  # a program that passed every check and still cannot be built: the folder's fault
            raise ExportError(
                f"{folder / PROGRAM_FILE} cannot be rebuilt as a program ({type(e).__name__}: {e!s:.200}); re-export"
            ) from e
    if not is_recorded_kind(pm, program["kind"]):
        raise ExportError(f"{folder} did not rebuild as a {program['kind']} program")
    if "memory_options" in config:  # checked by read_program
        pm.memory_options = dict(config["memory_options"])
    if config.get("data_parallel") == "fsdp":  # the replicated program, sharded over dp as transform shards it
        from dpcompile.modules.fsdp_one_process import shard_over_dp

        shard_over_dp(pm)
    return pm, program


__all__ = ["FORMAT", "FORMAT_VERSION", "ExportError", "export", "generated_source", "load", "read_manifest"]
