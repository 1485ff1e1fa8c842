"""Which operations of a recomputed region keep their outputs for backward (selective checkpointing).

``activation_checkpointing={"regions": ..., "save": rule}`` names a rule:

- ``"nothing"``: the whole region runs again in backward (the default);
- ``"matmuls"``: every matmul and attention (Linear, Conv, ``matmul``/``mm``/``bmm``, ``F.linear``,
  SDPA) whose output backward reads, directly or through the cheap ops recomputed from it (a residual
  add, a view), keeps its output; norms, activations, elementwise ops and views are recomputed. A
  matmul whose output only feeds an add that nothing in the region reads (a block's last projection)
  keeps nothing: it is not run again either, since the recompute stops once backward has what it needs;
- ``"every_second_matmul"``: torchtitan's selective rule: attention keeps its output, and of the
  region's matmuls in graph order the first, third, fifth, ... do; the rest is recomputed;
- ``"auto:<budget>"``: of what ``"matmuls"`` keeps, the outputs that spare the most FLOPs within
  ``budget`` (a fraction) of its values per row, attention first: ``passes.checkpoint_budget``, whose
  ``kept_for_rule`` takes every rule.

The finder reads the program only; ``passes.checkpoint_activations`` writes the markers.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from dpcompile.analysis.checkpoint_regions import SAVE_RULES
from dpcompile.runtime import gather

_aten = torch.ops.aten
_MATMUL_FUNCTIONS = {
    F.linear, F.bilinear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.einsum,
    operator.matmul, F.conv1d, F.conv2d, F.conv3d, _aten.mm.default, _aten.addmm.default, _aten.bmm.default,
    _aten.baddbmm.default, _aten.linear.default, _aten.matmul.default, _aten.convolution.default,
}  # fmt: skip
_ATTENTION_FUNCTIONS = {
    F.scaled_dot_product_attention, _aten.scaled_dot_product_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
}  # fmt: skip
_MATMUL_METHODS = {"matmul", "mm", "bmm", "__matmul__"}
_MATMUL_MODULES = (nn.Linear, nn.Bilinear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
# ops whose backward reads none of their inputs: a value that only feeds them is needed in backward
# only where their own output is
_PASS_THROUGH_FUNCTIONS = {
    operator.add, operator.sub, operator.neg, operator.getitem, torch.add, torch.sub, torch.cat, torch.flatten,
    torch.reshape, torch.transpose, torch.permute, _aten.add.Tensor, _aten.sub.Tensor, _aten.neg.default,
    _aten.view.default, _aten.reshape.default, _aten.t.default, _aten.transpose.int, _aten.permute.default,
    _aten._unsafe_view.default, _aten.clone.default, _aten.cat.default,
    gather,  # the outputs onto output_device: concatenated (a copy), its backward splits the gradient
}  # fmt: skip
_PASS_THROUGH_METHODS = {"add", "sub", "view", "reshape", "transpose", "permute", "contiguous", "flatten",
                         "unsqueeze", "squeeze", "chunk", "split", "expand", "__getitem__"}  # fmt: skip


def module_called(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """The module ``node`` calls: a ``call_module``, or a replica's ``call_method`` of the module's path."""
    if node.op not in ("call_module", "call_method") or not isinstance(node.target, str):
        return None
    try:
        return gm.get_submodule(str(node.target))
    except AttributeError:
        return None


def is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _ATTENTION_FUNCTIONS


def is_matmul(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A matmul-like node: its FLOPs grow with its inner dimension, its output with the outer ones."""
    if node.op == "call_function":
        return node.target in _MATMUL_FUNCTIONS
    if node.op == "call_method" and node.target in _MATMUL_METHODS:
        return True
    # a module call: call_module, or a replica's call_method of the module's path
    return node.op in ("call_module", "call_method") and is_matmul_module(module_called(gm, node))


def is_matmul_module(module: nn.Module | None) -> bool:
    """Linear, Bilinear, Conv, or transformers' ``Conv1D`` (GPT-2's projections: ``x @ weight + bias``)."""
    return isinstance(module, _MATMUL_MODULES) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def passes_through(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _PASS_THROUGH_FUNCTIONS
    return node.op == "call_method" and node.target in _PASS_THROUGH_METHODS


def read_in_backward(nodes: list[fx.Node]) -> set[fx.Node]:
    """The nodes of a region whose value its backward needs: read by a node whose backward reads
    its inputs, or by a pass-through node whose own value is needed (values leaving the region are
    saved by their readers outside)."""
    inside = set(nodes)
    needed: set[fx.Node] = set()
    for node in reversed(nodes):
        users = [u for u in node.users if u in inside]
        if any(not passes_through(u) or u in needed for u in users):
            needed.add(node)
    return needed


def kept_nodes(gm: fx.GraphModule, nodes: list[fx.Node], rule: str) -> list[fx.Node]:
    """The nodes of a region (in graph order) that keep their outputs under ``rule``."""
    if rule == "nothing":
        return []
    if rule == "matmuls":
        needed = read_in_backward(nodes)
        return [n for n in nodes if (is_matmul(gm, n) or is_attention(n)) and n in needed]
    if rule == "every_second_matmul":
        matmuls = [n for n in nodes if is_matmul(gm, n)]
        kept = set(matmuls[::2]) | {n for n in nodes if is_attention(n)}
        return [n for n in nodes if n in kept]
    raise ValueError(f"unknown save rule {rule!r}: one of {SAVE_RULES}")


__all__ = [
    "SAVE_RULES",
    "is_attention",
    "is_matmul",
    "is_matmul_module",
    "kept_nodes",
    "module_called",
    "passes_through",
    "read_in_backward",
]
