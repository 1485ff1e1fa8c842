"""Which checkpointed regions may run in token tiles (``activation_checkpointing={..., "tiles": k}``).

A region runs in tiles when it acts on each token alone (an MLP: Linear -> activation -> Linear,
a norm over the features): the rewriter then cuts its inputs into ``k`` slices along a token dim,
checkpoints the region on each and concatenates the outputs, so its backward holds one slice's
recomputed activations at a time. A region that mixes tokens (attention, a view across them, a
batch statistic) or draws random numbers (dropout: a tile would draw other values than the whole)
is left whole, with the reason.

Before (``"tiles": 4`` on ``layers.11.mlp``)::

    layers_11_mlp = dpcompile_runtime_checkpoint(layers_11_mlp_region, ln2, layers_11_mlp_module)

After::

    layers_11_mlp_tiles = dpcompile_runtime_token_tiles(ln2, 4)
    layers_11_mlp_tile0 = dpcompile_runtime_checkpoint(layers_11_mlp_region, layers_11_mlp_tiles[0], ...)
    ...
    layers_11_mlp = dpcompile_runtime_join_tiles([layers_11_mlp_tile0, ..., layers_11_mlp_tile3], ln2)
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from passes.checkpoint_saves import is_attention, is_matmul_module, module_called

_aten = torch.ops.aten
_ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.tanh, torch.sigmoid, torch.exp,
    torch.erf, torch.relu, torch.square, torch.sqrt, torch.rsqrt,
    F.gelu, F.relu, F.silu, F.tanh, F.sigmoid, F.mish, F.elu, F.leaky_relu, F.softplus, F.linear,
    _aten.add.Tensor, _aten.sub.Tensor, _aten.mul.Tensor, _aten.div.Tensor, _aten.mul.Scalar, _aten.add.Scalar,
    _aten.pow.Tensor_Scalar, _aten.tanh.default, _aten.sigmoid.default, _aten.gelu.default, _aten.relu.default,
    _aten.silu.default, _aten.linear.default,
}  # fmt: skip
_ELEMENTWISE_METHODS = {"add", "sub", "mul", "div", "pow", "neg", "tanh", "sigmoid", "relu", "exp", "sqrt",
                        "rsqrt", "square", "__add__", "__mul__", "__sub__", "__truediv__"}  # fmt: skip
_ROW_MODULES = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.ELU, nn.LeakyReLU, nn.Softplus,
                nn.Identity)  # fmt: skip
_RANDOM = (nn.Dropout, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _module_reason(module: nn.Module, node: fx.Node) -> str | None:
    if is_matmul_module(module) and not isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Bilinear)):
        return None
    if isinstance(module, _ROW_MODULES) or type(module).__name__.endswith("GELUActivation"):
        return None
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and len(module.normalized_shape) == 1:
        return None  # normalizes each token over its features
    if isinstance(module, _RANDOM):
        if module.p == 0:
            return None
        return f"{node.name} ({type(module).__name__}, p={module.p}) draws random numbers: a tile would draw others"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return f"{node.name} ({type(module).__name__}) uses the statistics of the whole batch"
    return f"{node.name} ({type(module).__name__}) is not known to act on each token alone"


def _receiver_only(gm: fx.GraphModule, value: fx.Node, nodes: set[fx.Node]) -> bool:
    """``value`` is only the module a region calls through (a data-parallel replica)."""
    users = [u for u in value.users if u in nodes]
    return bool(users) and all(u.op == "call_method" and u.args[:1] == (value,) and module_called(gm, u) for u in users)


def tiled_input(gm: fx.GraphModule, inputs: list[fx.Node], nodes: list[fx.Node]) -> list[fx.Node]:
    """The values a region reads that its tiles cut: all but the attributes (weights) and the
    modules (replicas) it reads."""
    inside = set(nodes)
    return [v for v in inputs if v.op != "get_attr" and not _receiver_only(gm, v, inside)]


def _whole_tensor_operand(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """An elementwise op on an attribute of more than one dim (a table of positions) would pair a
    slice of tokens with the whole table; a weight of ``F.linear`` or a bias vector is fine."""
    operands = node.args[:1] if node.target in (F.linear, _aten.linear.default) else node.args
    for arg in operands:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            value: object = gm
            for part in str(arg.target).split("."):
                value = getattr(value, part, None)
            if not isinstance(value, torch.Tensor) or value.dim() > 1:
                return f"{node.name} reads {arg.name}, not a vector over the features, with the tokens"
    return None


def why_not_per_token(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node]) -> str | None:
    """Why the region of ``nodes`` reading ``inputs`` cannot run in token tiles, or ``None`` where it
    reads one value of tokens and every node acts on each token alone (a matmul over the features,
    an activation, a norm over the last dim, an elementwise op)."""
    for node in nodes:
        target = str(getattr(node.target, "__name__", node.target))
        if "dropout" in target.lower() and node.op == "call_function":
            return f"{node.name} ({target}) draws random numbers: a tile would draw others"
        if is_attention(node):
            return f"{node.name} (attention) mixes the tokens"
    values = tiled_input(gm, inputs, nodes)
    if len(values) != 1:
        names = ", ".join(v.name for v in values) or "nothing"
        return f"it reads {len(values)} values from outside ({names}); tiles cut one value of tokens"
    for node in nodes:
        module = module_called(gm, node)
        if module is not None:
            if (reason := _module_reason(module, node)) is not None:
                return reason
            continue
        if node.op == "call_function" and node.target in _ELEMENTWISE_FUNCTIONS:
            if (reason := _whole_tensor_operand(gm, node)) is not None:
                return reason
            continue
        if node.op == "call_method" and node.target in _ELEMENTWISE_METHODS:
            continue
        target = getattr(node.target, "__name__", node.target)
        return f"{node.name} ({target}) is not known to act on each token alone"
    return None


__all__ = ["tiled_input", "why_not_per_token"]
