"""``replicate_borrowed_modules``: weights tied across pipeline stages, in one process.

A module a later stage calls whose tensors an earlier stage on another device already holds (a
language model's head tied to its embedding, a module called in two stages) stays where the
earlier stage holds it, and the later stage calls a replica of it made on its own device once per
call: a differentiable broadcast, so autograd sums the replica's gradient into the one parameter
(the gradient eager computes, as a ``("pp",)`` mesh sums the stages' copies)::

    # before (stage 1 on cpu:1 calls the head whose weight is stage 0's embedding)
    head = self.head(tanh_mb0_to_stage1)
    # after
    head_src = self.head
    head_replicas_stage1 = dpcompile_runtime_replicate({'head': head_src}, ['cpu:1'])
    head_replica_stage1 = head_replicas_stage1[0]
    head = head_replica_stage1.head(tanh_mb0_to_stage1)

:func:`find_module_homes` decides where each called module's tensors live (the first stage that
reads them, in program order); ``place_stages`` moves them there and this pass rewrites the calls.
:func:`send_borrowed_reads` does the same for a parameter read (``get_attr``) another device
holds: a tensor-parallel shard of a weight tied across stages (``pipeline=`` with ``tensor_parallel=``).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from dpcompile import runtime
from dpcompile.errors import DpCompileError
from dpcompile.infra import PassResult, stamp, stamp_comm
from passes.split_stages import STAGE

PASS = "replicate_borrowed_modules"


def node_tensors(gm: fx.GraphModule, node: fx.Node) -> list[tuple[nn.Module | None, str, torch.Tensor]]:
    """The parameters and buffers a ``call_module`` or ``get_attr`` node reads, with their owners."""
    if node.op == "call_module":
        value: object = gm.get_submodule(str(node.target))
        parent, name = None, ""
    else:
        parent_path, _, name = str(node.target).rpartition(".")
        parent = gm.get_submodule(parent_path)
        value = getattr(parent, name)
    if isinstance(value, nn.Module):
        return [(m, n, t) for m in value.modules() for n, t in [*m._parameters.items(), *m._buffers.items()]
                if t is not None]  # fmt: skip
    return [(parent, name, value)] if isinstance(value, torch.Tensor) else []


def find_module_homes(gm: fx.GraphModule, devices: Sequence[object]) -> dict[fx.Node, int]:
    """``{node: stage}`` for every staged ``call_module`` / ``get_attr``: the stage whose device its
    tensors live on. That is the node's own stage, except where an earlier stage on another device
    already reads one of them: then that stage's (a borrowed module). A module whose tensors two
    stages on distinct devices hold apart cannot be called whole on either: refused."""
    home: dict[int, int] = {}
    first: dict[int, str] = {}
    placed: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "get_attr") or STAGE not in node.meta:
            continue
        s = node.meta[STAGE]
        tensors = node_tensors(gm, node)
        held = {str(devices[home[id(t)]]): home[id(t)] for _, _, t in tensors if id(t) in home}
        if len(held) > 1:
            where = ", ".join(f"{d} (stage {h})" for d, h in held.items())
            raise DpCompileError(
                f"'{node.target}' (stage {s}) holds tensors that stages on distinct devices already hold ({where}: "
                f"tied weights with '{first[next(id(t) for _, _, t in tensors if id(t) in home)]}'); a module is "
                "called whole on one device. Name stage boundaries (pipeline=[...module paths...]) that keep them "
                "in one stage"
            )
        place = next(iter(held.values())) if held else s
        if str(devices[place]) == str(devices[s]):
            place = s
        for _, _, t in tensors:
            home.setdefault(id(t), place)
            first.setdefault(id(t), str(node.target))
        placed[node] = place
    return placed


def replicate_borrowed_modules(gm: fx.GraphModule, *, devices: Sequence[object]) -> PassResult:
    """Each call of a borrowed module (:func:`find_module_homes`) runs on a replica made on its stage's device."""
    homes = find_module_homes(gm, devices)
    borrowed = [n for n, place in homes.items() if n.op == "call_module" and place != n.meta[STAGE]]
    replicas: dict[tuple[str, int], fx.Node] = {}
    for node in borrowed:
        s, path = node.meta[STAGE], str(node.target)
        key = path.replace(".", "_")
        if (path, s) not in replicas:
            with gm.graph.inserting_before(node):
                source = gm.graph.get_attr(path)
                made = gm.graph.call_function(runtime.replicate, ({key: source}, [str(devices[s])]))
                root = gm.graph.call_function(operator.getitem, (made, 0))
            for new, name in ((source, f"{key}_src"), (made, f"{key}_replicas_stage{s}"), (root, f"{key}_replica_stage{s}")):
                new._rename(name)
                stamp(new, PASS, node)
                new.meta[STAGE] = s
            stamp_comm(made, "broadcast", io=False, backward="reduce")
            replicas[(path, s)] = root
        node.op, node.target, node.args = "call_method", key, (replicas[(path, s)], *node.args)
    if borrowed:
        gm.graph.lint()
    return PassResult(gm, bool(borrowed), {"borrowed": [n.name for n in borrowed]})


def send_borrowed_reads(gm: fx.GraphModule, borrowed: Mapping[fx.Node, str]) -> PassResult:
    """Each parameter read in ``borrowed`` (``{get_attr node: its readers' device}``: the tensor lives on
    another device, where an earlier stage reads it) reaches its readers by ``runtime.send``, the
    stages' differentiable copy, once per call; autograd sums the readers' gradients into the one
    parameter, as for a borrowed module's replica::

        # before (stage 1's shard 0 on cpu:2 reads the head's shard, tied to the embedding's on cpu:0)
        head_mb0_dev0 = torch._C._nn.linear(add_3_copy_mb0_dev0, head_weight_shard0)
        # after
        head_weight_shard0_to_stage1 = dpcompile_runtime_send(head_weight_shard0, 'cpu:2')
        head_mb0_dev0 = torch._C._nn.linear(add_3_copy_mb0_dev0, head_weight_shard0_to_stage1)
    """
    for node, device in borrowed.items():
        users = list(node.users)
        with gm.graph.inserting_after(node):
            sent = gm.graph.call_function(runtime.send, (node, device))
        sent._rename(f"{node.name}_to_stage{node.meta[STAGE]}")
        stamp(sent, PASS, node)
        stamp_comm(sent, "send", io=False, backward="send")
        sent.meta.update({k: node.meta[k] for k in (STAGE, "dpcompile_slot") if k in node.meta})
        for user in users:
            user.replace_input_with(node, sent)
    if borrowed:
        gm.graph.lint()
    return PassResult(gm, bool(borrowed), {"borrowed": [n.name for n in borrowed]})


__all__ = ["find_module_homes", "node_tensors", "replicate_borrowed_modules", "send_borrowed_reads"]
