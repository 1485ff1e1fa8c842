"""Whether a checkpointed region, run again in backward, may write a tensor it did not make.

The runtime undoes such writes after each recompute (``dpcompile.runtime.recompute``: BatchNorm's
running statistics, a step counter), so the model's state moves once a call, as in eager; it does so
under a Python dispatch mode that sees every op of the recompute, a few microseconds an op (a checkpointed
step of the rank benchmark's Llama 1.63x its plain step with it, 1.43x without:
``benchmarks/bench_checkpoint_undo.py``). A region whose nodes are all known not to write outside
themselves runs its recompute without it::

    layers_0_dev0 = dpcompile_runtime_checkpoint(layers_0_dev0_region, replica_dev0, x_dev0, undo_writes = False)

Known: ATen ops whose schema writes nothing (batch norm's kernels write their running statistics
unmarked: not known), tensor methods and ``torch``/``operator``/``math`` functions that are not in
place and take no ``inplace=True``/``out=``, and modules of ``torch.nn`` (every module in them) without
buffers, hooks, parametrizations, in-place writes or ``max_norm`` (``nn.Embedding`` renormalises its
weight) other than recurrent ones, and transformers' ``Conv1D``. Anything else (a user function, a runtime
call, a module of the user's or holding one) may write: the region keeps the undo.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from dpcompile.fx_utils import writes
from dpcompile.runtime.recompute import writes_running_statistics

__all__ = ["may_write_outside"]

_KNOWN_MODULES = ("torch", "_operator", "operator", "math", "builtins")
#: modules outside torch.nn the frontends keep whole whose forward writes nothing (GPT-2's addmm and view)
_KNOWN_LEAVES = {"transformers.pytorch_utils.Conv1D"}
#: functions of torch that update a module's state through their arguments, unmarked
_STATE_UPDATING = {F.batch_norm, torch.batch_norm, F.instance_norm, torch.instance_norm, torch.native_batch_norm}
#: ATen ops that do so: batch norm's kernels, and instance norm's (it calls them)
_STATE_UPDATING_OPS = {torch.ops.aten.instance_norm}
#: functions that renormalise their weight in place where given ``max_norm`` (its position)
_RENORMING = {F.embedding: 3, F.embedding_bag: 3}


def may_write_outside(nodes: Iterable[fx.Node]) -> bool:
    """Whether running ``nodes`` again may write a tensor they did not make (see the module)."""
    return not all(_known_not_to_write(n) for n in nodes)


def _known_not_to_write(node: fx.Node) -> bool:
    if node.op in ("placeholder", "get_attr", "output"):
        return True
    if node.op == "call_module":
        return _stateless_module(_submodule(node, str(node.target)))
    target = node.target
    name = str(target) if node.op == "call_method" else getattr(target, "__name__", "")
    if writes(node) or "out" in node.kwargs or (name.endswith("_") and not name.endswith("__")):  # _foreach_add_
        return False
    if node.op == "call_method":  # a tensor's method, or a module's called on a replica: replica.layers.0.fc(x)
        module = _submodule(node, name)
        if module is not None:
            return _stateless_module(module)
        return not name.startswith("_") and hasattr(torch.Tensor, name)
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        packet = getattr(target, "overloadpacket", target)
        overloads = [target] if packet is not target else [getattr(packet, o) for o in packet.overloads()]
        return not (writes_running_statistics(packet) or packet in _STATE_UPDATING_OPS
                    or any(o._schema.is_mutable for o in overloads))  # fmt: skip
    if target in _STATE_UPDATING or (target in _RENORMING and _argument(node, _RENORMING[target], "max_norm") is not None):
        return False
    module = getattr(target, "__module__", None) or ""
    return module.split(".")[0] in _KNOWN_MODULES


def _submodule(node: fx.Node, path: str) -> nn.Module | None:
    try:
        return node.graph.owning_module.get_submodule(path)
    except AttributeError:
        return None


def _stateless_module(module: nn.Module | None) -> bool:
    """A module (and every module in it) of ``torch.nn`` or :data:`_KNOWN_LEAVES`, without buffers, hooks (its
    own or global: they run again in the recompute), parametrizations (their code is the user's), in-place
    options or ``max_norm``, not recurrent."""
    if module is None or _global_hooks():
        return False
    return all(_stateless_own(m) for m in module.modules())


def _stateless_own(module: nn.Module) -> bool:
    kind = type(module)
    known = kind.__module__.startswith("torch.nn.") and not kind.__module__.startswith("torch.nn.utils")
    return (
        (known or f"{kind.__module__}.{kind.__qualname__}" in _KNOWN_LEAVES)
        and not isinstance(module, nn.RNNBase)
        and not parametrize.is_parametrized(module)
        and not any(True for _ in module.buffers(recurse=False))
        and not (module._forward_hooks or module._forward_pre_hooks)
        and not getattr(module, "inplace", False)
        and getattr(module, "max_norm", None) is None
    )


def _global_hooks() -> bool:
    from torch.nn.modules import module as torch_module

    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


def _argument(node: fx.Node, index: int, name: str) -> object:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)
