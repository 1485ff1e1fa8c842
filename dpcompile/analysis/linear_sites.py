"""Finding the layers tensor parallelism can split: Linear-like calls and embeddings, what blocks one
(a shared layer, a tie, a leaf), and checking a plan against a model, with the arithmetic.

:func:`find_linear_sites` finds the sites; :func:`linear_paths`, :func:`embedding_paths`,
:func:`check_plan` and :func:`check_divisible` check a plan; :mod:`dpcompile.analysis.sharding`
lays every value out under the styles chosen.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from dpcompile.analysis.sharding_rules import (
    node_arg,
)
from dpcompile.errors import ArgumentError
from dpcompile.runtime.comm import split_sizes

STYLES = ("column", "row", "replicate")
EMBEDDING_STYLES = ("vocab", "replicate")  # an nn.Embedding: rows (the vocabulary) split, or whole


# ---------------------------------------------------------------------- finding
@dataclass
class LinearSite:
    """One call of an ``nn.Linear`` in the graph, and why it cannot be sharded (if so)."""

    path: str
    node: fx.Node
    input: fx.Node
    in_features: int
    out_features: int
    bias: bool
    blocker: str | None = None
    transposed: bool = False  # weight stored (in, out), as transformers' Conv1D
    kind: str = "linear"  # or "embedding" (in_features: the vocabulary, out_features: embedding_dim)
    tied_to: str | None = None  # the embedding whose weight this LM head shares (or the head of an embedding)
    padding_idx: int | None = None
    heads: int = 0  # attention heads of a "window_attention" site (torchvision Swin), sharded whole
    weight_name: str = "weight"  # "in_proj_weight" for the fused in-projection of an nn.MultiheadAttention
    bias_name: str = "bias"
    bias_shared_with: tuple[str, ...] = ()  # other called layers holding the same bias: split alike or all whole


def linear_like_types() -> tuple[type[nn.Module], ...]:
    """The module types sharded as Linear layers: ``nn.Linear``, ``Conv1D``'s stand-in in a program loaded
    from a folder (``TransposedLinear``: the same attributes and arithmetic, so it is planned and sharded
    alike) and, where transformers is imported, its ``Conv1D`` (GPT-2's layers: weight ``(in, out)``, ``addmm``)."""
    from dpcompile.runtime.exported import TransposedLinear

    found: list[type[nn.Module]] = [nn.Linear, TransposedLinear]
    utils = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(utils, "Conv1D", None)
    if isinstance(conv1d, type) and issubclass(conv1d, nn.Module):
        found.append(conv1d)
    return tuple(found)


def linear_like_leaves() -> tuple[type[nn.Module], ...]:
    """Linear-like types the tracer must keep as calls (their forward reshapes around ``addmm``)."""
    return tuple(t for t in linear_like_types() if t is not nn.Linear)


def is_transposed_linear(module: nn.Module) -> bool:
    """True for a linear-like module whose weight is stored ``(in, out)`` (transformers' Conv1D)."""
    return isinstance(module, linear_like_leaves())


def linear_paths(root: nn.Module) -> list[str]:
    """Every ``nn.Linear`` (or other linear-like layer, see :func:`linear_like_types`) of ``root``
    by module path (``""`` is ``root`` itself)."""
    kinds = linear_like_types()
    return [name for name, m in root.named_modules() if isinstance(m, kinds)]


def embedding_paths(root: nn.Module) -> list[str]:
    """Every ``nn.Embedding`` and ``nn.MultiheadAttention`` (its fused in-projection) of ``root`` by
    module path: the layers besides the Linear-like ones that tensor parallelism may shard."""
    return [name for name, m in root.named_modules() if isinstance(m, (nn.Embedding, nn.MultiheadAttention))]


def _hooks_of(module: nn.Module | None) -> str | None:
    """What hooks ``module`` has (``"a forward hook"``), or None: a sharded call would not run them."""
    if module is None:
        return None
    kinds = [kind for kind, hooks in (("a forward pre-hook", module._forward_pre_hooks), ("a forward hook", module._forward_hooks),
                                      ("a backward hook", module._backward_hooks), ("a backward pre-hook", module._backward_pre_hooks))
             if hooks]  # fmt: skip
    return " and ".join(kinds) or None


def find_linear_sites(gm: fx.GraphModule) -> dict[str, LinearSite]:
    """The Linear layers called in ``gm``'s forward, by module path.

    A call of an ``nn.Linear`` module, or ``F.linear`` on a ``weight`` parameter of one
    (``""``, the root, when the model itself is a Linear). A layer called more than once, or
    whose weight is also read directly (tied weights), gets a ``blocker`` and stays whole.
    """
    modules = dict(gm.named_modules())
    sites: dict[str, LinearSite] = {}
    calls: dict[str, int] = {}
    attr_reads: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            attr_reads[node.target] = attr_reads.get(node.target, 0) + len(node.users)
    for node in gm.graph.nodes:
        path = _linear_path(node, modules)
        if path is None:
            continue
        calls[path] = calls.get(path, 0) + 1
        x = node.args[0] if node.args else node.kwargs.get("input")
        if path in sites or not isinstance(x, fx.Node):
            continue
        prefix = f"{path}." if path else ""
        in_proj = isinstance(modules.get(path), nn.MultiheadAttention)
        weight_name, bias_name = ("in_proj_weight", "in_proj_bias") if in_proj else ("weight", "bias")
        if modules.get(path, gm)._parameters.get(weight_name) is None:
            continue  # weight_norm, spectral_norm: its weight is computed per call, not a parameter to shard
        out_features, in_features = gm.get_parameter(f"{prefix}{weight_name}").shape
        transposed = node.op == "call_module" and is_transposed_linear(modules[path])
        if transposed:
            in_features, out_features = out_features, in_features
        if node.op == "call_module":
            has_bias, own_reads = modules[path].bias is not None, 0
        else:
            bias = node_arg(node, 2, "bias")
            has_bias = isinstance(bias, fx.Node)
            own_reads = 1 + int(has_bias)
        sites[path] = LinearSite(path, node, x, int(in_features), int(out_features), has_bias, transposed=transposed,
                                 weight_name=weight_name, bias_name=bias_name)  # fmt: skip
        if attr_reads.get(f"{prefix}{weight_name}", 0) + attr_reads.get(f"{prefix}{bias_name}", 0) > own_reads:
            sites[path].blocker = f"the weight of '{path}' is also read directly (tied weights); it stays whole"
    for node in gm.graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(node.target), nn.Embedding):
            continue
        path, emb = node.target, modules[node.target]
        calls[path] = calls.get(path, 0) + 1
        x = node.args[0] if node.args else node.kwargs.get("input")
        if path in sites or not isinstance(x, fx.Node):
            continue
        site = LinearSite(path, node, x, emb.num_embeddings, emb.embedding_dim, False, kind="embedding", padding_idx=emb.padding_idx)
        if emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
            site.blocker = f"'{path}' uses max_norm, scale_grad_by_freq or sparse gradients, which a vocab-parallel lookup does not support; it stays whole"
        elif attr_reads.get(f"{path}.weight" if path else "weight", 0):  # `h @ self.emb.weight.T`: a tied head written out
            site.blocker = (
                f"the weight of '{path}' is also read directly in forward (a tied LM head written as "
                f"F.linear(h, {path}.weight) or h @ {path}.weight.T); it stays whole. An nn.Linear head sharing the "
                "weight (lm_head.weight = emb.weight) is split with it"
            )
        sites[path] = site
    for node in gm.graph.nodes:
        window = _window_attention(node)
        if window is None or window["path"] in sites:
            continue
        path = window["path"]
        calls[path] = calls.get(path, 0) + 1
        qkv_w = gm.get_parameter(f"{path}.qkv.weight")
        site = LinearSite(path, node, window["input"], int(qkv_w.shape[1]), int(qkv_w.shape[1]), window["qkv_bias"],
                          kind="window_attention")  # fmt: skip
        site.heads = window["num_heads"]
        if window["dropout"] and window["training"]:
            site.blocker = f"'{path}' applies dropout after its projection in training, which partial sums cannot; it stays whole"
        elif window["logit_scale"]:
            site.blocker = f"'{path}' uses cosine attention (Swin V2's logit_scale), not sharded yet; it stays whole"
        sites[path] = site
    for path, site in sites.items():
        if calls[path] > 1:
            site.blocker = f"'{path}' is called {calls[path]} times in forward; a shared layer stays whole"
        elif (hooked := _hooks_of(modules.get(path))) is not None:
            site.blocker = (
                f"'{path}' has {hooked}, which would see one shard's values instead of the layer's; it stays whole "
                "(remove the hook, or hook a module around the layer)"
            )
    _find_ties(gm, sites)
    return sites


def _window_attention(node: fx.Node) -> dict[str, Any] | None:
    """torchvision Swin's ``shifted_window_attention(x, self.qkv.weight, self.proj.weight, ...)``
    call (kept as one call, ``fx.wrap``), with its arguments by name; None for any other node."""
    target = node.target
    if node.op != "call_function" or getattr(target, "__name__", "") != "shifted_window_attention":
        return None
    if not str(getattr(target, "__module__", "")).startswith("torchvision.models.swin_transformer"):
        return None
    names = ("input", "qkv_weight", "proj_weight", "relative_position_bias", "window_size", "num_heads", "shift_size",
             "attention_dropout", "dropout", "qkv_bias", "proj_bias", "logit_scale", "training")  # fmt: skip
    args = dict(zip(names, node.args))
    args.update(node.kwargs)
    qkv, proj = args.get("qkv_weight"), args.get("proj_weight")
    if not (isinstance(qkv, fx.Node) and qkv.op == "get_attr" and str(qkv.target).endswith(".qkv.weight")):
        return None
    path = str(qkv.target)[: -len(".qkv.weight")]
    if not (isinstance(proj, fx.Node) and proj.op == "get_attr" and proj.target == f"{path}.proj.weight"):
        return None
    bias = args.get("qkv_bias")
    pbias = args.get("proj_bias")
    if bias is not None and not (isinstance(bias, fx.Node) and bias.target == f"{path}.qkv.bias"):
        return None
    if pbias is not None and not (isinstance(pbias, fx.Node) and pbias.target == f"{path}.proj.bias"):
        return None
    if not isinstance(args.get("num_heads"), int) or not isinstance(args.get("input"), fx.Node):
        return None
    return {
        "path": path, "input": args["input"], "num_heads": args["num_heads"], "qkv_bias": bias is not None,
        "proj_bias": pbias is not None, "dropout": args.get("dropout", 0.0), "training": args.get("training", True),
        "logit_scale": args.get("logit_scale") is not None, "args": args,
    }  # fmt: skip


def window_attention_args(node: fx.Node) -> dict[str, Any]:
    """The arguments by name of a ``shifted_window_attention`` call (see :func:`find_linear_sites`)."""
    found = _window_attention(node)
    assert found is not None
    return found


def _find_ties(gm: fx.GraphModule, sites: Mapping[str, LinearSite]) -> None:
    """Mark an LM head that shares its weight with an embedding (both sharded by vocabulary
    rows, one parameter); any other sharing that forward reads of a sharded layer's weight, or
    of its bias with anything but another layer, blocks it. A partner forward never reads (an
    unused head, the second name of a tied bias) is no obstacle: its key names the same shards."""
    owners: dict[int, list[str]] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    attrs = {n.target for n in gm.graph.nodes if n.op == "get_attr"}

    def read(name: str) -> bool:
        return name in attrs or "" in called or any(name.startswith(f"{m}.") for m in called)

    for path, site in sites.items():
        prefix = f"{path}." if path else ""
        for attr in (site.weight_name, site.bias_name):
            try:
                p = gm.get_parameter(prefix + attr)
            except AttributeError:
                continue
            others = [o.rsplit(".", 1)[0] if "." in o else "" for o in owners.get(id(p), []) if o != prefix + attr and read(o)]
            if attr == site.bias_name and all(o in sites for o in others):
                site.bias_shared_with = tuple(others)  # split alike, they share the shards (expand_shards)
                others = []
            if not others or site.blocker is not None:
                continue
            partners = [o for o in others if o in sites and sites[o].kind != site.kind]
            plain = not site.transposed and all(not sites[o].transposed for o in partners)
            if attr == site.weight_name and len(others) == 1 and len(partners) == 1 and plain:
                site.tied_to = partners[0]
            else:
                shown = ", ".join(f"'{o}'" for o in others)
                site.blocker = (
                    f"the {attr} of '{path}' is shared with {shown} (tied weights); only an embedding tied to one "
                    "LM head is sharded (by vocabulary rows), so it stays whole"
                )


def _linear_path(node: fx.Node, modules: Mapping[str, nn.Module]) -> str | None:
    if node.op == "call_module" and isinstance(modules.get(node.target), linear_like_types()):
        return node.target
    if node.op == "call_function" and node.target is F.linear and len(node.args) >= 2:
        w = node.args[1]
        if isinstance(w, fx.Node) and w.op == "get_attr" and "dpcompile_shard" not in w.meta:
            path, _, name = w.target.rpartition(".")
            if name == "weight" and (path == "" or isinstance(modules.get(path), nn.Linear)):
                return path
            if name == "in_proj_weight" and isinstance(modules.get(path), nn.MultiheadAttention):
                return path  # the fused in-projection of a decomposed nn.MultiheadAttention
    return None


def aligned_split(total: int, n: int, granularity: int = 1) -> tuple[int, ...]:
    """Balanced shard sizes that are multiples of ``granularity``: ``aligned_split(12, 2, 8) == (8, 4)``."""
    units, rest = divmod(total, granularity)
    if rest or units < n:
        raise ValueError(f"{total} cannot be split into {n} shards of whole {granularity}s")
    return tuple(granularity * s for s in split_sizes(units, n))


def check_plan(root: nn.Module, plan: Mapping[str, str], *, extra_linears: Iterable[str] = ()) -> None:
    """Raise ``ArgumentError`` (a ``ValueError``) for a plan naming a missing module, a non-Linear or an unknown style."""
    modules = dict(root.named_modules())
    windows = [p for p, site in extra_linears.items() if site.kind == "window_attention"] if isinstance(extra_linears, Mapping) else []
    valid = linear_paths(root) + windows + [p for p in extra_linears if p not in modules or p == ""]
    shown = ", ".join(repr(p) for p in valid) or "(none)"
    for path, style in plan.items():
        if path in modules and isinstance(modules[path], nn.MultiheadAttention):
            if style not in ("column", "replicate"):
                raise ArgumentError(f"tensor_parallel plan: the nn.MultiheadAttention {path!r} is split by heads ('column') or kept whole ('replicate'), not {style!r}")
            continue
        if path in modules and isinstance(modules[path], nn.Embedding):
            if style not in EMBEDDING_STYLES:
                raise ArgumentError(f"tensor_parallel plan: unknown style {style!r} for the nn.Embedding {path!r}; valid: {', '.join(map(repr, EMBEDDING_STYLES))}")
            continue
        if path in valid:
            pass
        elif path not in modules:
            raise ArgumentError(
                f"tensor_parallel plan names {path!r}, which is not a module of {type(root).__name__}; "
                f"its nn.Linear layers are: {shown}"
            )
        elif not isinstance(modules[path], linear_like_types()):
            raise ArgumentError(
                f"tensor_parallel plan names {path!r}, a {type(modules[path]).__name__}, not an nn.Linear; "
                f"its nn.Linear layers are: {shown}"
            )
        if style not in STYLES:
            raise ArgumentError(f"tensor_parallel plan: unknown split style {style!r} for {path!r}; valid styles: {', '.join(map(repr, STYLES))}")


def check_divisible(site: LinearSite, style: str, n: int) -> str | None:
    """Why ``site`` cannot be split ``style``-wise over ``n`` devices, with the arithmetic; or None."""
    if site.kind == "window_attention":
        if style != "column":
            return f"'{site.path}' (window attention) is split by heads ('column') or kept whole ('replicate')"
        if site.heads < n:
            return f"num_heads({site.heads}) of '{site.path}' cannot be split over {n} devices"
        return None
    if site.kind == "embedding":
        if style != "vocab":
            return f"'{site.path}' is an nn.Embedding: its styles are 'vocab' (rows split) or 'replicate'"
        if site.in_features < n:
            return f"num_embeddings({site.in_features}) of '{site.path}' cannot be split over {n} devices"
        return None
    if style == "vocab":
        return f"'vocab' is the style of an nn.Embedding; '{site.path}' is a Linear (column, row or replicate)"
    if site.tied_to is not None and style != "column":
        return (
            f"'{site.path}' shares its weight with the embedding '{site.tied_to}', so it is split like it, by "
            "vocabulary rows (column); a row split would untie them"
        )
    if style == "column" and site.out_features < n:
        return f"out_features({site.out_features}) of '{site.path}' cannot be split over {n} devices"
    if style == "row" and site.in_features < n:
        return f"in_features({site.in_features}) of '{site.path}' cannot be split over {n} devices"
    return None
