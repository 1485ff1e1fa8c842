"""``export`` and ``load`` of a program over a ``DeviceMesh``: the whole single-device program as data,
plus the layout (``program.json`` → ``config.mesh``), lowered over a mesh again where it is loaded.

Before (every rank of a ``("dp", "tp")`` mesh)::

    dpcompile.export(pm, "exported/")
    ExportError: export writes one-process programs ...; a spmd_2d program (over a mesh) is rebuilt by
    running transform in each process: save its weights with pm.state_dict()

After::

    dpcompile.export(pm, "exported/")                      # every rank: whole tensors gathered, rank 0 writes
    pm2 = dpcompile.load("exported/", mesh=device_mesh)     # every rank: the program lowered over the mesh again
    one = dpcompile.load("exported/")                       # the single-device program, in one process

Layouts: ``("dp",)``, ``("tp",)``, ``("dp", "tp")``, context parallel over ``("cp",)``, ``("dp", "cp")``,
``("cp", "tp")`` (``context_parallel=`` recorded), and pipelines over ``("pp",)``, ``("pp", "dp")``,
``("pp", "tp")``, ``("pp", "dp", "tp")``; ``"dp"`` as DDP or FSDP2 (``data_parallel="fsdp"``: recorded, applied
again on load; its model's repeated blocks, called whole, stay calls in the exported program, so their class
must be torch.nn's or registered); either frontend (the export frontend's program: its copy on meta, taken
before lowering, is what rank 0 transforms for one device). Export is collective. Every
rank checks what it can record (the same answer on each) before any exchange; then ``pm.state_dict()``
gathers whole tensors under the model's keys, each rank's program text is hashed (``rank_code``), and
rank 0 copies the model (its structure on ``meta``, then the gathered values and every stage's
non-persistent buffers), transforms it for one device and writes that program as any export, with
``config.mesh``: the mesh's dimension names and sizes, the keywords that shaped the program
(``tensor_parallel``, ``data_parallel``, ``ddp_options``, ``exact_random``, ``pipeline``,
``micro_batches``, ``schedule``, ``batch_dim``) and each rank's examples' shapes. Rank 0's outcome is
broadcast: every rank returns the folder or raises. A keyword that cannot be recorded is refused by
name before anything is written.

Load over a mesh is collective too: each rank loads the single-device program, the ranks agree that
they did, then ``transform`` lowers its captured program over the mesh with the recorded keywords
and zeros of the rank's example shapes. A mesh of other dimension names is refused; other sizes are
lowered as ``transform`` lowers for them (refused where examples were recorded: they are the exported
ranks'); on the recorded sizes, each rank's program text must hash to the exported one's (else every
rank raises): the loaded program is the exported program.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.errors import DpCompileError
from dpcompile.export.common import ExportError
from dpcompile.export.mesh_section import CONTEXT_MODES, DDP_SCALARS, MESH_MODES

__all__ = ["export_over_mesh", "is_mesh_program", "load_over_mesh", "portable_code", "recorded_layout"]

_RECORDED = ("plan", "data_parallel", "ddp_options", "exact_random", "frontend", "mesh")  # SpmdRecipe's fields
_PIPELINE = ("stages", "micro_batches", "schedule", "batch_dim")  # MeshPipelineRecipe's, recorded too
_CONTEXT_ONLY = ("context_exchange", "context_load_balance", "context_memory_headroom")  # read by cp programs alone
_KEYWORD_OF = {  # the transform keyword behind each other field of SpmdRecipe, for the refusal
    "checkpointed": "activation_checkpointing", "checkpoint_save": "activation_checkpointing",
}  # fmt: skip


def is_mesh_program(pm: Any) -> bool:
    """One rank's program over a DeviceMesh (``transform(model, mesh)``)."""
    return str(getattr(pm, "mode", "")).startswith("spmd")


# ---------------------------------------------------------------------------------- export
def recorded_layout(pm: Any) -> dict[str, Any]:
    """``config.mesh`` but ``rank_code``: the mesh and the keywords, refusing by name what cannot be
    recorded. The same answer on every rank (no exchange)."""
    from dpcompile.recipes.pipeline_mesh import MeshPipelineRecipe
    from dpcompile.recipes.spmd import SpmdRecipe

    if pm.mode not in MESH_MODES:
        raise ExportError(
            "export over a DeviceMesh writes ('dp',), ('tp',), ('dp', 'tp'), context parallel over ('cp',), ('dp', "
            f"'cp'), ('cp', 'tp') and pipelines over ('pp',) with 'dp' and 'tp' beside it; a {pm.mode} program is not "
            "exported yet. The nearest that works: export the same layout in one process (dpcompile.transform(model, "
            "devices, mesh={...}) then dpcompile.export), or save_checkpoint(pm, path) and transform the model again"
        )
    _check_blocks_rebuild(getattr(pm.recipe, "fsdp_blocks", ()))
    recipe = _as_transformed(pm.recipe)
    pipeline = isinstance(recipe, MeshPipelineRecipe)
    context = pm.mode in CONTEXT_MODES
    if context and recipe.context_memory_headroom is not None:
        raise ExportError(
            "export over a DeviceMesh cannot record memory_per_device= yet (it sized context parallel's exchange), "
            "and a program loaded without it could differ: transform without it to export, or save_checkpoint(pm, path)"
        )
    default = MeshPipelineRecipe() if pipeline else SpmdRecipe()
    recorded = _RECORDED + _CONTEXT_ONLY + (_PIPELINE if pipeline else ())
    for f in dataclasses.fields(recipe):
        if f.name not in recorded and getattr(recipe, f.name) != getattr(default, f.name):
            keyword = _KEYWORD_OF.get(f.name, f.name)
            raise ExportError(
                f"export over a DeviceMesh cannot record {keyword}= yet ({f.name}={getattr(recipe, f.name)!r:.80}), and "
                f"a program loaded without it would differ: transform without {keyword}= to export, or "
                "save_checkpoint(pm, path) and transform the model again where it is loaded"
            )
    odd = {k: v for k, v in (recipe.ddp_options or {}).items() if not isinstance(v, DDP_SCALARS)}
    if odd:
        key = next(iter(odd))
        raise ExportError(
            f"ddp_options={{{key!r}: {odd[key]!r:.60}}} is not plain data (a number, string or bool), so an export "
            "cannot record it; leave it out to export, or save_checkpoint(pm, path)"
        )
    if _source(pm) is None:  # a GraphModule of the user's or a loaded program's: no model to copy
        raise ExportError(
            "this program over a mesh holds no model to copy: it was transformed from an fx.GraphModule or loaded "
            "from an export. Transform the model itself (frontend=\"fx\", or \"export\" with example_kwargs=) and "
            "export that, copy the folder it was loaded from, or save_checkpoint(pm, path)"
        )
    mesh = recipe.mesh
    plan = recipe.plan if isinstance(recipe.plan, bool) else dict(recipe.plan)
    return {
        "dims": list(mesh.mesh_dim_names or ()),
        "sizes": [int(s) for s in mesh.mesh.shape],
        "mode": pm.mode,
        "keywords": {"tensor_parallel": plan, "data_parallel": recipe.data_parallel,
                     "ddp_options": dict(recipe.ddp_options or {}), "exact_random": bool(recipe.exact_random),
                     "frontend": recipe.frontend,
                     "pipeline": (recipe.stages if isinstance(recipe.stages, int) else list(recipe.stages)) if pipeline else None,
                     "micro_batches": recipe.micro_batches if pipeline else 1,
                     "schedule": recipe.schedule if pipeline else "gpipe",
                     "batch_dim": recipe.batch_dim if pipeline else None,
                     **({"context_parallel": {"exchange": recipe.context_exchange,
                                              "load_balance": recipe.context_load_balance}} if context else {})},  # fmt: skip
        "examples": _example_specs(pm),
    }


def _check_blocks_rebuild(blocks: tuple[type[nn.Module], ...]) -> None:
    """FSDP2 over a mesh calls the model's repeated blocks whole (``fully_shard`` hooks their forward), so
    the exported program does too: each block's class must be one a folder can hold."""
    from dpcompile.export.allowlist import can_rebuild

    for cls in blocks:
        if not can_rebuild(cls):
            raise ExportError(
                f'data_parallel="fsdp" over a mesh calls the model\'s repeated blocks ({cls.__qualname__}) whole, so '
                "its export holds them as modules, and a folder holds a module class only from torch.nn or "
                f"registered: register_module_class({cls.__qualname__}) (from dpcompile.export) where you export "
                "and where you load, or export the same layout with data_parallel=\"ddp\""
            )


def _as_transformed(recipe: Any) -> Any:
    """``recipe`` with the keywords ``transform`` was given: ``data_parallel="fsdp"`` over a mesh adds the
    model's repeated block classes to ``leaf_modules`` (``fsdp_blocks``), which load derives again."""
    blocks = getattr(recipe, "fsdp_blocks", ())
    if not blocks or recipe.leaf_modules[len(recipe.leaf_modules) - len(blocks) :] != blocks:
        return recipe
    return dataclasses.replace(recipe, leaf_modules=recipe.leaf_modules[: -len(blocks)], fsdp_blocks=())


def _source(pm: Any) -> nn.Module | None:
    """The model the program was lowered from: its copy on meta taken before FSDP2 rewrote its classes (a
    pipeline's, ``data_parallel="fsdp"``'s, or the export frontend's program: a GraphModule over the model's
    modules, which rank 0 transforms for one device as one process transforms it), or fx's (``traced_model``)."""
    return pm.__dict__.get("model_on_meta") or pm.__dict__.get("traced_model")


def _example_specs(pm: Any) -> list[dict[str, Any]] | None:
    """This rank's examples as data (a tensor's shape and dtype, or a plain value), which load feeds
    ``transform`` again (zeros of those shapes): the program's shapes follow them."""
    from dpcompile.export.common import dtype_name

    specs = pm.__dict__.get("example_specs")
    if specs is None:
        return None
    out: list[dict[str, Any]] = []
    for k, spec in enumerate(specs):
        if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], torch.dtype):
            out.append({"shape": [int(n) for n in spec[0]], "dtype": dtype_name(spec[1])})
        elif spec is None or isinstance(spec, DDP_SCALARS):
            out.append({"value": spec})
        else:
            raise ExportError(
                f"example input {k} is a {type(spec).__name__}, which an export cannot record (tensors, numbers, "
                "strings, bools and None): pass tensors as examples, or save_checkpoint(pm, path)"
            )
    return out


def single_device_model(pm: Any, state: dict[str, torch.Tensor], held: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of the model on the CPU holding ``state`` (whole tensors under the model's keys) and the
    program's non-persistent buffers (``held``, every rank's); ``pm`` and the model are not touched."""
    from dpcompile.fake import materialize, meta_copy_to_pickle

    copied = meta_copy_to_pickle(_source(pm))
    if copied is None:
        raise ExportError("the model cannot be copied (copy.deepcopy fails on it), so the program over the mesh cannot be exported")
    materialize(copied, "cpu")
    copied.load_state_dict({k: v.detach().to("cpu") for k, v in state.items()}, strict=True)
    with torch.no_grad():
        for path, module in copied.named_modules():
            for name in module._non_persistent_buffers_set:
                key = f"{path}.{name}" if path else name
                if module._buffers.get(name) is not None:
                    if key not in held:
                        raise ExportError(f"the program over the mesh holds no buffer {key!r}, which the model's forward reads")
                    module._buffers[name].copy_(held[key].detach().to("cpu"))
    return copied


def export_over_mesh(pm: Any, folder: Path, write: Callable[[nn.Module, Path, dict[str, Any]], None]) -> Path:
    """Every rank: check, gather the whole state and the ranks' program hashes; rank 0 builds the
    single-device program and ``write``s it with ``config.mesh``; every rank returns or raises alike."""
    import torch.distributed as dist

    from dpcompile.api import transform
    from dpcompile.modules.other_mode import both_modes

    layout = recorded_layout(pm)
    mesh = pm.recipe.mesh
    both_modes(pm)  # exported in one mode (every rank): the other one first, so the folder holds both
    if mesh.size() != dist.get_world_size():
        raise ExportError(
            f"export over a DeviceMesh of {mesh.size()} of the {dist.get_world_size()} processes is not built yet: "
            "export over a mesh of every process"
        )
    state = pm.state_dict()  # whole tensors: a collective over tp and pp (and the same on every rank)
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, (_code_hash(pm), layout["examples"], _non_persistent_buffers(pm)))
    order = mesh.mesh.flatten().tolist()
    layout["rank_code"] = [ranks[r][0] for r in order]
    layout["examples"] = None if layout["examples"] is None else [ranks[r][1] for r in order]
    held = {k: v for rank in ranks for k, v in rank[2].items()}  # a pipeline stage holds its own
    failure = None
    if dist.get_rank() == 0:
        try:
            one = transform(single_device_model(pm, state, held), ["cpu"], exact_random=layout["keywords"]["exact_random"],
                            leaf_modules=getattr(pm.recipe, "fsdp_blocks", ()))  # FSDP2's blocks stay calls, as here
            write(one, folder, layout)
        except DpCompileError as e:
            failure = e
        except Exception as e:  # noqa: BLE001 - reported to every rank, raised here with its cause
            failure = ExportError(f"export over the mesh failed on rank 0: {type(e).__name__}: {e}")
            failure.__cause__ = e
    message = [None if failure is None else str(failure)]
    dist.broadcast_object_list(message, src=0)
    if failure is not None:
        raise failure
    if message[0] is not None:
        raise ExportError(f"export over the mesh failed on rank 0, which writes the folder: {message[0]}")
    return folder


def _non_persistent_buffers(pm: Any) -> dict[str, torch.Tensor]:
    """This rank's values of the model's non-persistent buffers (not in ``state_dict()``), by the model's names."""
    from dpcompile.fx_utils import unalias

    wanted = {f"{path}.{name}" if path else name for path, module in _source(pm).named_modules()
              for name in module._non_persistent_buffers_set}  # fmt: skip
    return {unalias(k): b.detach().to("cpu") for k, b in pm.named_buffers() if unalias(k) in wanted}


def _code_hash(pm: Any) -> str:
    return hashlib.sha256(portable_code(pm).encode()).hexdigest()


def portable_code(pm: Any) -> str:
    """``pm.code`` as the program reads once loaded from a folder: a transformers ``ModelOutput`` it builds
    (the export frontend's GPT-2: ``CausalLMOutputWithCrossAttentions(loss=..., logits=...)``) written as
    the record a folder holds instead (``dpcompile.runtime.exported.model_output(name, fields, ...)``), the
    rest as it is. A loaded program's code is its own: it builds no class.

    Before: ``out = transformers_modeling_outputs_CausalLMOutputWithCrossAttentions(loss = div, logits = lm_head)``
    After:  ``out = dpcompile_runtime_exported_model_output('transformers...CausalLMOutputWithCrossAttentions',
    ('loss', 'logits', ...), loss = div, logits = lm_head)``"""
    from dpcompile.export.allowlist import class_name, qualified_name
    from dpcompile.export.serialize import model_output_fields
    from dpcompile.fx_utils import copy_graph
    from dpcompile.runtime.exported import model_output

    def fields(node: fx.Node) -> tuple[str, ...] | None:  # as encode_graph writes it: a registered type stays
        unnamed = node.op == "call_function" and qualified_name(node.target) is None
        return model_output_fields(node.target) if unnamed else None

    if all(fields(n) is None for n in pm.graph.nodes):
        return pm.code
    graph = copy_graph(pm.graph)
    for node in graph.nodes:
        if (record := fields(node)) is not None:
            node.target, node.args = model_output, (class_name(node.target), record, *node.args)
    fx_code = pm.graph.python_code(root_module="self").src  # pm.code: this, below a note (random draws) if any
    if fx_code not in pm.code:
        raise ExportError("the program's code is not its graph's: it cannot be written with its output records")
    return pm.code.replace(fx_code, graph.python_code(root_module="self").src)


# ------------------------------------------------------------------------------------ load
def load_over_mesh(folder: Path, mesh: Any, load_one: Callable[[list[Any]], tuple[nn.Module, dict]]) -> nn.Module:
    """Every rank: load the single-device program (``load_one(devices)``: the module and its checked
    ``program.json``), agree that every rank did,
    lower its captured program over ``mesh`` with the recorded keywords, check each rank's program."""
    import torch.distributed as dist

    from dpcompile.api import transform
    from dpcompile.mesh import local_device
    from dpcompile.modules.mesh_exported_inputs import hold_input_specs
    from dpcompile.modules.pickling import exported_inputs

    failure: BaseException | None = None
    try:
        one, section = _loaded_single(folder, mesh, load_one, local_device(mesh))
    except Exception as e:  # noqa: BLE001 - every rank hears it before any rank lowers
        failure = e
    _agree(failure, "load over the mesh")
    sizes = [int(s) for s in mesh.mesh.shape]
    same = sizes == section["sizes"]  # the names are the recorded ones
    position = mesh.mesh.flatten().tolist().index(dist.get_rank()) if same else 0
    keywords = section["keywords"]
    pipeline = {} if keywords["pipeline"] is None else {
        "pipeline": keywords["pipeline"], "micro_batches": keywords["micro_batches"], "schedule": keywords["schedule"],
        "batch_dim": keywords["batch_dim"]}  # fmt: skip
    pm = transform(
        _captured_module(one), mesh, tensor_parallel=keywords["tensor_parallel"],
        exact_random=keywords["exact_random"], example_inputs=_examples(section["examples"], position, local_device(mesh)),
        **({"ddp_options": keywords["ddp_options"]} if keywords["ddp_options"] else {}), **pipeline,
        **({"data_parallel": "fsdp"} if keywords["data_parallel"] == "fsdp" else {}),
        **({"context_parallel": keywords["context_parallel"]} if "context_parallel" in keywords else {}),
    )  # fmt: skip
    hold_input_specs(pm, exported_inputs(one))  # the export frontend's argument check, as the original's
    failure = None
    if same:
        if _code_hash(pm) != section["rank_code"][position]:
            failure = ExportError(
                f"the program lowered over the mesh again on rank {dist.get_rank()} is not the exported one (its "
                "code differs: it was shaped by what the folder does not record, such as example_inputs=); "
                "transform the model over the mesh instead, then load_state_dict"
            )
    _agree(failure, "the check of the program lowered again")
    return pm


def _examples(examples: list[list[dict[str, Any]]] | None, position: int, device: Any) -> tuple | None:
    """The recorded examples of the rank at ``position`` as values: zeros of each tensor's shape and dtype."""
    if examples is None:
        return None
    return tuple(
        torch.zeros(e["shape"], dtype=getattr(torch, e["dtype"]), device=device) if "shape" in e else e["value"]
        for e in examples[position]
    )


def _loaded_single(folder: Path, mesh: Any, load_one: Callable[[list[Any]], tuple[nn.Module, dict]],
                   device: Any) -> tuple[nn.Module, dict]:  # fmt: skip
    without_a_mesh = ExportError(
        f"{folder} holds a one-process program (exported without a mesh): load it without mesh= "
        "(dpcompile.load(path) or devices=), or export the program transformed over a mesh"
    )
    try:
        one, program = load_one([device])  # every check first (expected_hash= before anything is read)
    except ExportError:
        from dpcompile.export.integrity import read_manifest

        if read_manifest(folder)["program"].get("kind") != "data_parallel":  # over a mesh: always the single-device one
            raise without_a_mesh from None
        raise
    section = program["config"].get("mesh")
    if section is None:
        raise without_a_mesh
    names, sizes = tuple(mesh.mesh_dim_names or ()), [int(s) for s in mesh.mesh.shape]
    if names != tuple(section["dims"]):
        raise ExportError(
            f"{folder} was exported over a mesh with dims {tuple(section['dims'])} (sizes {section['sizes']}), and "
            f"this mesh has dims {names} (sizes {sizes}): load it over a mesh of the same dimension names "
            "(its sizes may differ where it was transformed without examples: it is lowered for them as transform lowers it)"
        )
    if sizes != section["sizes"] and section["examples"] is not None:
        raise ExportError(
            f"{folder} was exported over a {tuple(section['dims'])} mesh of sizes {section['sizes']} from examples of "
            f"each rank's shapes there, which a mesh of sizes {sizes} does not feed: load it over sizes "
            f"{section['sizes']}, or transform the model over this mesh"
        )
    return one, section


def _captured_module(one: nn.Module) -> fx.GraphModule:
    """The single-device program before lowering, over the loaded module tree: every submodule,
    parameter and buffer of it, in the model's order, also those forward never reads (``fx.GraphModule``
    alone copies only the graph's paths, into plain modules, in the order the graph reads them: so
    ``state_dict()`` lost an unread ``steps`` counter, its keys followed forward's order, and a
    ``ModuleList`` of blocks, which ``data_parallel="fsdp"`` wraps one by one, was not one); its
    non-persistent buffers stay non-persistent (``state_dict()`` has the model's keys, in its order)."""
    from dpcompile.fx_utils import copy_graph

    gm = fx.GraphModule(one, copy_graph(one.captured.graph), class_name="Loaded")
    for table in ("_modules", "_parameters", "_buffers"):  # the loaded tree's own, in its order, then fx's extras
        mine, copied = getattr(one, table), getattr(gm, table)
        held = {**mine, **{k: v for k, v in copied.items() if k not in mine}}
        copied.clear()
        copied.update(held)
    for path, module in one.named_modules():
        for name in module._non_persistent_buffers_set:
            try:
                owner = gm.get_submodule(path) if path else gm
            except AttributeError:
                continue
            if name in owner._buffers:
                owner._non_persistent_buffers_set.add(name)
    return gm


def _agree(failure: BaseException | None, what: str) -> None:
    """Every rank raises where any failed: its own error, or an ``ExportError`` naming the rank that failed."""
    from dpcompile.modules.mesh_failure import raise_where_any_failed

    def refusal(failed: list[tuple[int, str]]) -> ExportError:
        shown = "; ".join(f"rank {r}: {m}" for r, m in failed)
        return ExportError(f"{what} failed on another rank, so it fails on every rank ({shown})")

    raise_where_any_failed(failure, None, refusal)
