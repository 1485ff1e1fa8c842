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
# random ops the runtime cannot make exact: they draw per device, and explain names them
OTHER_RANDOM = {torch.multinomial, torch.normal, torch.poisson, F.dropout1d, F.dropout2d, F.dropout3d,
                F.alpha_dropout, F.feature_alpha_dropout}  # fmt: skip
OTHER_RANDOM_MODULES = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
EXACT_RUNTIME = {runtime.exact_dropout, runtime.exact_dropout_module, runtime.exact_native_dropout, runtime.exact_attention,
                 runtime.exact_random_like, runtime.exact_bernoulli, runtime.exact_fill_random,
                 runtime.exact_random_scope}  # fmt: skip


def random_kind(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The kind of random op ``node`` runs: ``"dropout"``, ``"dropout_module"``, ``"native_dropout"``,
    ``"attention"`` (with ``dropout_p``), ``"like"``, ``"bernoulli"``, ``"fill"``, or ``"other"`` for
    one that cannot draw the single-device values; None for a node that draws nothing."""
    if node.op == "call_function":
        target = node.target
        if target in DROPOUT_FUNCTIONS:
            return None if _draws_nothing(node) else "dropout"
        if target is aten.native_dropout.default:
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
        return "other" if target in OTHER_RANDOM else None
    if node.op in ("call_module", "call_method"):
        module = called_module(gm, node)
        if module is not None:
            if type(module) is nn.Dropout:
                return "dropout_module"
            return "other" if isinstance(module, OTHER_RANDOM_MODULES) else None
    if node.op == "call_method":
        if node.target in FILL_METHODS:
            return "fill"
        if node.target == "bernoulli":
            return "like" if len(node.args) > 1 or "p" in node.kwargs else "bernoulli"
    return None


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


def _is_replicas(value: Any) -> bool:
    return isinstance(value, fx.Node) and value.op == "call_function" and value.target is runtime.replicate


__all__ = ["called_module", "called_module_path", "per_device_note", "random_draws_of", "random_kind"]
