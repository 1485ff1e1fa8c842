"""A one-process FSDP program copied, pickled or exported as the replicated program it was sharded
from, plus "dp is FSDP": whole tensors under the model's keys, sharded again where it is restored.

``shard_over_dp`` turns a replicated program into FSDP's pieces; :func:`replicated_state` is the
other way, on a copy: the state a pickle of the replicated program carries, each parameter whole
again (the gather of its pieces). Restoring it (``fsdp_one_process.restore_fsdp_program``) builds the replicated
program and shards it over ``dp``, so the copy stores pieces again, on the devices it is restored
on (``dpcompile.load(path, devices=...)`` of a ``dp`` export: as many pieces as copies).

Before (``torch.save(pm)`` of ``data_parallel="fsdp"``)::

    DpCompileError: a data_parallel="fsdp" program in one process is not pickled yet

After::

    torch.save(pm, f)                            # the replicated program, fc1.weight whole (16, 8)
    loaded = torch.load(f, weights_only=False)   # fc1.parametrizations.weight.original0 (8, 8), ...
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from dpcompile.errors import DpCompileError
from dpcompile.fx_utils import PicklableGraph
from dpcompile.modules.fsdp_gather import GatherShards
from dpcompile.modules.sharded_state import PICKLED


def replicated_extra_state(pm: Any) -> dict[str, Any]:
    """What a pickled copy of the replicated program carries beyond modules and graphs: the
    tensor-parallel shards (none for ``dp`` alone) and the executor's state, each shard on its
    tensor-parallel slot (not FSDP's pieces)."""
    tp = pm.__dict__.get("_tp_param_shards") or {}
    sharded = {name: pm.__dict__[name] for name in PICKLED} | {"param_shards": dict(tp)} if tp else {}
    executor = dict(pm._executor.pickled_state(pm))
    if "stage_groups" in executor:
        groups = dict(executor["stage_groups"])
        groups["shard_param_slots"] = dict(pm.__dict__.get("_tp_shard_param_slots") or {})
        executor["stage_groups"] = groups
    return {**sharded, **executor}


def replicated_state(
    pm: Any, replicated: type, *, carry_programs: bool, in_memory: bool = False
) -> tuple[type, dict[str, Any]]:
    """``(class, state)``: what ``torch.save`` of the replicated program (of class ``replicated``)
    would write, made from a deep copy of ``pm``'s state whose parameters are gathered whole; ``pm``
    is not touched. ``in_memory`` (a deep copy): the model to trace again from even where pickle could
    not import its class, as ``ParallelModule.__deepcopy__`` carries it."""
    refuse_other_parametrizations(pm)
    _, (_, state) = pm._reduce(carry_programs=carry_programs)
    if in_memory and state["source"] is None and pm.__dict__.get("traced_model") is not None:
        state["source"] = pm._source_state()
    state = copy.deepcopy(state)
    state["config"] = {**state["config"], "class_name": replicated.__name__}
    keys = list(pm.__dict__.get("replicated_parameter_names") or pm.state_keys)
    wholes: dict[int, nn.Parameter] = {}
    root = nn.Module()  # the program's own parameters (a root parameter: ViT's pos_embed)
    root._modules.update(state["modules"])
    root._parameters.update(state["parameters"])
    if parametrize.is_parametrized(root):
        _gather_whole(root, "", keys, wholes)
        state["modules"] = dict(root._modules)
        state["parameters"] = dict(root._parameters)
    for path, module in _modules_of(state):
        if parametrize.is_parametrized(module):
            _gather_whole(module, path, keys, wholes)
    _unparametrized_graph_meta(state)
    return next(c for c in replicated.__mro__ if "<locals>" not in c.__qualname__), state


def _modules_of(state: Mapping[str, Any]) -> Iterator[tuple[str, nn.Module]]:
    """Every module the state holds, with its path: the program's (a pipeline's stages read the
    same), the model's it traces again from (its root's parameters are gathered as the program's)
    and a root fx kept as a leaf."""
    roots: list[nn.Module] = list(state["modules"].values())
    paths = list(state["modules"])
    source = (state.get("source") or {}).get("model")
    if isinstance(source, nn.Module):
        roots.append(source)
        paths.append("")
    if isinstance(state.get("leaf_root"), nn.Module):
        roots.append(state["leaf_root"])
        paths.append("")
    seen: set[int] = set()
    for prefix, top in zip(paths, roots, strict=True):
        for path, module in top.named_modules(remove_duplicate=False):
            if id(module) not in seen:
                seen.add(id(module))
                yield ".".join(p for p in (prefix, path) if p), module


def _gather_whole(module: nn.Module, path: str, keys: list[str], wholes: dict[int, nn.Parameter]) -> None:
    """``module``'s parametrized parameters as whole ``nn.Parameter``s again (tied ones: one
    tensor), its class the one it had before, its parameters in the replicated program's order.
    ``module`` is a copy: the parametrized class it shares with the original is not changed."""
    lists = module.parametrizations
    for leaf, pieces in lists.items():
        if id(pieces) not in wholes:
            gather = pieces[0]
            originals = [getattr(pieces, f"original{r}") for r in range(len(gather.piece_devices))]
            with torch.no_grad():  # a meta copy of a private model (tensor parallel's): its shape, no data
                meta = any(o.is_meta for o in originals)
                whole = torch.cat(originals, gather.spec.dim) if meta else gather(*originals)
            wholes[id(pieces)] = nn.Parameter(whole, requires_grad=originals[0].requires_grad)
        module._parameters[leaf] = wholes[id(pieces)]
    del module._modules["parametrizations"]
    if type(module).__module__ == parametrize.__name__:  # torch's injected Parametrized<class> over the module's own
        module.__class__ = type(module).__bases__[0]
    prefix = f"{path}." if path else ""
    order = {key: k for k, key in enumerate(keys)}
    ranked = sorted(module._parameters.items(), key=lambda item: order.get(prefix + item[0], len(order)))
    module._parameters.clear()
    module._parameters.update(ranked)


def _unparametrized_graph_meta(state: Any) -> None:
    """A program traced after sharding (the other mode, a variant) records the modules it entered
    as torch's ``Parametrized<Linear>`` classes (``nn_module_stack``), which pickle cannot name:
    each becomes the class it was made over, as the replicated program records it."""

    def plain(value: Any) -> Any:
        if isinstance(value, type) and value.__module__ == parametrize.__name__ and issubclass(value, nn.Module):
            return value.__bases__[0]
        if isinstance(value, (tuple, list)):
            return type(value)(plain(v) for v in value)
        if isinstance(value, dict):
            return type(value)((k, plain(v)) for k, v in value.items())
        return value

    if isinstance(state, PicklableGraph):
        state.nodes = [(*node[:6], {k: plain(v) for k, v in node[6].items()}) for node in state.nodes]
    elif isinstance(state, (tuple, list)):
        for value in state:
            _unparametrized_graph_meta(value)
    elif isinstance(state, dict):
        for value in state.values():
            _unparametrized_graph_meta(value)


def refuse_other_parametrizations(pm: nn.Module) -> None:
    """A parametrization of the user's (``weight_norm``) besides FSDP's gathers: torch does not
    pickle it (as for a replicated program), so neither is the FSDP program copied as data."""
    for path, module in pm.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        for leaf, pieces in module.parametrizations.items():
            if len(pieces) != 1 or not isinstance(pieces[0], GatherShards):
                raise DpCompileError(
                    f"{path or 'the model'}.{leaf} is parametrized by the model (weight_norm, spectral_norm, ...), "
                    "which torch does not pickle; save the weights with dpcompile.save_checkpoint(pm, path) (or "
                    "pm.state_dict()) and transform the model again where they are loaded, then load_checkpoint"
                )


__all__ = ["refuse_other_parametrizations", "replicated_extra_state", "replicated_state"]
