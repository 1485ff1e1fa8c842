"""The random ops: which calls of a program draw from a generator, and of what kind.

``draw_random_whole`` (``passes/exact_random.py``) rewrites the kinds it knows so that each draws
the single-device values; ``explain`` and ``pm.code`` name what still draws per device.

>>> import torch, torch.fx as fx
>>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)))
>>> [random_kind(gm, n) for n in gm.graph.nodes]
[None, None, 'dropout_module', None]
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from dpcompile import runtime

aten = torch.ops.aten
DROPOUT_FUNCTIONS = {F.dropout, torch.dropout, aten.dropout.default}
ATTENTION_FUNCTIONS = {F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default}
# draws whose values ignore the input's (only its shape, dtype and device count): by runtime name
LIKE_FUNCTIONS = {torch.rand_like: "rand_like", torch.randn_like: "randn_like", torch.randint_like: "randint_like",
                  aten.rand_like.default: "rand_like", aten.randn_like.default: "randn_like",
                  aten.randint_like.default: "randint_like", aten.randint_like.low_dtype: "randint_like",
                  aten.bernoulli.p: "bernoulli"}  # fmt: skip
FILL_METHODS = {"normal_", "uniform_", "bernoulli_", "exponential_", "random_"}
FILL_ATEN = {aten.normal_.default: "normal_", aten.uniform_.default: "uniform_", aten.bernoulli_.float: "bernoulli_"}
# channel and alpha dropouts: the variant of runtime.exact_special_dropout, by function and by module
SPECIAL_DROPOUT_FUNCTIONS = {F.dropout1d: "dropout1d", F.dropout2d: "dropout2d", F.dropout3d: "dropout3d",
                             F.alpha_dropout: "alpha", F.feature_alpha_dropout: "feature_alpha"}  # fmt: skip
SPECIAL_DROPOUT_MODULES = {nn.Dropout1d: "dropout1d", nn.Dropout2d: "dropout2d", nn.Dropout3d: "dropout3d",
                           nn.AlphaDropout: "alpha", nn.FeatureAlphaDropout: "feature_alpha"}  # fmt: skip
STOCHASTIC_DEPTH = "torchvision.ops.stochastic_depth.stochastic_depth"  # a call fx keeps (ConvNeXt, EfficientNet)
# random ops with no exact rule when called otherwise (a generator, ``out=``): per device, named by explain
OTHER_RANDOM = {torch.multinomial, torch.normal, torch.poisson}
EXACT_RUNTIME = {runtime.exact_dropout, runtime.exact_dropout_module, runtime.exact_native_dropout, runtime.exact_attention,
                 runtime.exact_random_like, runtime.exact_bernoulli, runtime.exact_fill_random,
                 runtime.exact_random_scope, runtime.exact_special_dropout, runtime.exact_special_dropout_module,
                 runtime.exact_stochastic_depth,
                 runtime.exact_normal, runtime.exact_multinomial, runtime.exact_normal_size,
                 runtime.exact_poisson, runtime.exact_written_fill}  # fmt: skip


def random_kind(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The kind of random op ``node`` runs: ``"dropout"``, ``"dropout_module"``, ``"native_dropout"``,
    ``"attention"`` (with ``dropout_p``), ``"like"``, ``"bernoulli"``, ``"fill"``, ``"special_dropout"``
    (``_module``: channel and alpha dropouts), ``"normal"``, ``"normal_size"``, ``"multinomial"``,
    ``"poisson"``, ``"written_fill"`` (a functionalized ``y.normal_()``), or ``"other"`` for one that cannot draw the single-device values; None for a node
    that draws nothing."""
    if node.op == "call_function":
        target = node.target
        if target in DROPOUT_FUNCTIONS:
            return None if _draws_nothing(node) else "dropout"
        if target in (aten.native_dropout.default, torch.native_dropout):
            return "native_dropout"
        if target in ATTENTION_FUNCTIONS or getattr(target, "__name__", "") == "scaled_dot_product_attention":
            p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
            return None if p == 0 else "attention"
        if target in LIKE_FUNCTIONS:
            return "like"
        if target in (torch.bernoulli, aten.bernoulli.default):
            return "like" if len(node.args) > 1 or "p" in node.kwargs else "bernoulli"
        if target in FILL_ATEN:
            return "fill"
        if target is runtime.written and written_fill_method(node) is not None:
            return "written_fill"
        if target in SPECIAL_DROPOUT_FUNCTIONS:
            return "special_dropout"
        if target is torch.normal and _tensor_mean_and_std(node):
            return "normal"
        if target is torch.normal and _float_mean_and_std_with_size(node):
            return "normal_size"
        if target is torch.multinomial and _no_generator(node, ("input", "num_samples", "replacement")):
            return "multinomial"
        if target is torch.poisson and _no_generator(node, ("input",)):
            return "poisson"
        if target is runtime.stochastic_depth or f"{getattr(target, '__module__', '')}.{getattr(target, '__name__', '')}" == STOCHASTIC_DEPTH:
            return "stochastic_depth"
        return "other" if target in OTHER_RANDOM else None
    if node.op in ("call_module", "call_method"):
        module = called_module(gm, node)
        if module is not None:
            if type(module) is nn.Dropout:
                return "dropout_module"
            if type(module) in SPECIAL_DROPOUT_MODULES:
                return "special_dropout_module"
            if isinstance(module, nn.RNNBase) and module.dropout and module.num_layers > 1:
                return "other"  # its dropout between layers draws inside the RNN kernel: no exact rule
            return None
    if node.op == "call_method":
        if node.target in FILL_METHODS:
            return "fill"
        if node.target == "bernoulli":
            return "like" if len(node.args) > 1 or "p" in node.kwargs else "bernoulli"
    return None


def written_fill_method(node: fx.Node) -> str | None:
    """The random fill a ``written(base, steps, op, ...)`` node runs (``y.normal_()`` functionalized:
    ``"normal_"``), or None."""
    op = node.args[2] if len(node.args) > 2 else None
    name = op if isinstance(op, str) else FILL_ATEN.get(op)
    return name if name in FILL_METHODS else None


def called_module_path(node: fx.Node) -> str | None:
    """The module a call runs: ``self.drop(x)``, or a data-parallel replica's ``replica_dev1.drop(x)``."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "call_method" and isinstance(node.args[0], fx.Node):
        root = node.args[0]
        if root.op == "call_function" and root.target is operator.getitem and _is_replicas(root.args[0]):
            return str(node.target)
    return None


def called_module(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    path = called_module_path(node)
    if path is None:
        return None
    try:
        return gm.get_submodule(path)
    except AttributeError:
        return None


def scoped_module_paths(gm: fx.GraphModule) -> set[str]:
    """The modules ``gm`` calls whole through ``exact_random_scope`` (FSDP's blocks, their random ops exact)."""
    return {
        str(n.args[3].target) for n in gm.graph.nodes
        if n.op == "call_function" and n.target is runtime.exact_random_scope and n.args[3].op == "get_attr"
    }  # fmt: skip


def random_draws_of(gm: fx.GraphModule) -> dict[str, list[str]]:
    """The random sites of a lowered program by the user's node: ``"exact"`` (each draws the
    single-device values) and ``"per_device"`` (each device draws its own)."""
    exact: dict[str, None] = {}
    per_device: dict[str, None] = {}
    for node in gm.graph.nodes:
        source = node.meta.get("dpcompile_source", node.name)
        if node.op == "call_function" and node.target in EXACT_RUNTIME:
            exact[source] = None
        elif random_kind(gm, node) is not None:
            per_device[source] = None
    return {"exact": list(exact), "per_device": list(per_device)}


def per_device_note(gm: fx.GraphModule) -> str | None:
    """What ``pm.code`` and ``explain`` say where random sites of a multi-device program draw per
    device (``exact_random=False``, or an op with no exact rule); None where none does."""
    pieces = any("dpcompile_rows" in n.meta or "dpcompile_cols" in n.meta for n in gm.graph.nodes)
    sites = random_draws_of(gm)["per_device"] if pieces else []
    if not sites:
        return None
    return (
        f"random ops {', '.join(sites)} draw per device (exact_random=False, or no exact rule for the op): "
        "each device draws its own piece, so the values differ from a single-device run with the same seed"
    )


def _draws_nothing(node: fx.Node) -> bool:
    """A dropout call written with ``training=False`` or ``p=0`` (an eval-mode program) draws nothing."""
    names = ("input", "p", "training", "inplace") if node.target is F.dropout else ("input", "p", "train")
    bound = {**dict(zip(names, node.args)), **node.kwargs}
    return bound.get("training", bound.get("train", True)) is False or bound.get("p", 0.5) == 0


def _tensor_mean_and_std(node: fx.Node) -> bool:
    """``torch.normal(mean, std)`` with both tensors (values of the graph), no generator or ``out``."""
    names = ("mean", "std")
    bound = {**dict(zip(names, node.args)), **node.kwargs}
    return set(bound) == set(names) and all(isinstance(bound[n], fx.Node) for n in names)


def _no_generator(node: fx.Node, names: tuple[str, ...]) -> bool:
    """A call of ``names`` alone (``torch.multinomial``, ``torch.poisson``): no ``generator`` or ``out``."""
    bound = {**dict(zip(names, node.args)), **node.kwargs}
    return not set(bound) - set(names)


def _float_mean_and_std_with_size(node: fx.Node) -> bool:
    """``torch.normal(mean, std, size)`` with numbers, and only ``dtype``/``device``/``layout``/
    ``requires_grad`` beside (no generator or ``out``)."""
    bound = {**dict(zip(("mean", "std", "size"), node.args)), **node.kwargs}
    numbers = all(isinstance(bound.get(n), (int, float)) for n in ("mean", "std"))
    return numbers and "size" in bound and not set(bound) - {"mean", "std", "size", "dtype", "device", "layout",
                                                               "requires_grad"}  # fmt: skip


def _is_replicas(value: Any) -> bool:
    return isinstance(value, fx.Node) and value.op == "call_function" and value.target is runtime.replicate


__all__ = ["called_module", "called_module_path", "per_device_note", "random_draws_of", "random_kind",
           "scoped_module_paths", "written_fill_method"]
