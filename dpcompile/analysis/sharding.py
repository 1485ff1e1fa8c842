"""The sharding analysis: which ``nn.Linear`` layers a plan can split, and how every value is laid out.

Everything the tensor-parallel planner (:mod:`dpcompile.planning`) and the
``shard_linear`` pass need to know before anything is rewritten:

- :func:`find_linear_sites` finds the Linear calls (and what blocks one: a shared layer,
  tied weights); :func:`linear_paths`, :func:`check_plan` and :func:`check_divisible` check
  a plan against a model, with the arithmetic;
- :func:`analyze_sharding` gives every value its layout (:class:`Sharded`, replicated,
  :class:`Copied`, :class:`NotTensor`) under given styles, with the conversions (*f*, *g*,
  gathers, splits) they need and what those cost, using the per-op rules of
  :mod:`dpcompile.analysis.sharding_rules`;
- :func:`resolve_plan` settles which layers really split: a view whose sharded constant cannot
  be proven to split keeps the column layers feeding it whole, with the reason.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from dpcompile.analysis import ops
from dpcompile.analysis.cost import CommEstimate
from dpcompile.analysis.placement import REPLICATED, Replicated
from dpcompile.analysis.sharding_rules import (
    COPIED,
    NOT_TENSOR,
    Copied,
    Layout,
    NeedsWhole,
    NotTensor,
    Sharded,
    apply_rule,
    describe_op,
    flat_nodes,
    is_shard_transparent,
    may_need_grad,
    node_arg,
    node_val,
)
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


def linear_like_types() -> tuple[type[nn.Module], ...]:
    """The module types sharded as Linear layers: ``nn.Linear`` and, where transformers is
    imported, its ``Conv1D`` (GPT-2's layers: weight ``(in, out)``, ``addmm``)."""
    found: list[type[nn.Module]] = [nn.Linear]
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
    rows, one parameter); any other sharing of a sharded layer's weight blocks it."""
    owners: dict[int, list[str]] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    for path, site in sites.items():
        weight = f"{path}.{site.weight_name}" if path else site.weight_name
        try:
            p = gm.get_parameter(weight)
        except AttributeError:
            continue
        others = [o.rsplit(".", 1)[0] if "." in o else "" for o in owners.get(id(p), []) if o != weight]
        if not others:
            continue
        partners = [o for o in others if o in sites and sites[o].kind != site.kind]
        plain = not site.transposed and all(not sites[o].transposed for o in partners)
        if len(others) == 1 and len(partners) == 1 and plain and site.blocker is None:
            site.tied_to = partners[0]
        elif site.blocker is None:
            shown = ", ".join(f"'{o}'" for o in others)
            site.blocker = (
                f"the weight of '{path}' is shared with {shown} (tied weights); only an embedding tied to one "
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
    """Raise ``ValueError`` for a plan naming a missing module, a non-Linear or an unknown style."""
    modules = dict(root.named_modules())
    windows = [p for p, site in extra_linears.items() if site.kind == "window_attention"] if isinstance(extra_linears, Mapping) else []
    valid = linear_paths(root) + windows + [p for p in extra_linears if p not in modules or p == ""]
    shown = ", ".join(repr(p) for p in valid) or "(none)"
    for path, style in plan.items():
        if path in modules and isinstance(modules[path], nn.MultiheadAttention):
            if style not in ("column", "replicate"):
                raise ValueError(f"the nn.MultiheadAttention {path!r} is split by heads ('column') or kept whole ('replicate'), not {style!r}")
            continue
        if path in modules and isinstance(modules[path], nn.Embedding):
            if style not in EMBEDDING_STYLES:
                raise ValueError(f"unknown style {style!r} for the nn.Embedding {path!r}; valid: {', '.join(map(repr, EMBEDDING_STYLES))}")
            continue
        if path in valid:
            pass
        elif path not in modules:
            raise ValueError(
                f"tensor_parallel plan names {path!r}, which is not a module of {type(root).__name__}; "
                f"its nn.Linear layers are: {shown}"
            )
        elif not isinstance(modules[path], linear_like_types()):
            raise ValueError(
                f"tensor_parallel plan names {path!r}, a {type(modules[path]).__name__}, not an nn.Linear; "
                f"its nn.Linear layers are: {shown}"
            )
        if style not in STYLES:
            raise ValueError(f"unknown split style {style!r} for {path!r}; valid styles: {', '.join(map(repr, STYLES))}")


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


# ---------------------------------------------------------------------- analysis
@dataclass(frozen=True)
class Problem:
    """A sharded value the pass could not carry through an op it should have (a view)."""

    origins: frozenset[str]
    reason: str
    granularity: int | None = None
    sections: int | None = None  # shard the origin layers as this many fused blocks (q, k, v)


@dataclass
class ShardingAnalysis:
    """What ``shard_linear`` will do for given styles: every value's layout, every conversion."""

    layouts: dict[fx.Node, Layout]
    needs: dict[tuple[fx.Node, fx.Node], str]  # (consumer, producer) -> copy | gather | split | gather_copy | gather_split
    column_sizes: dict[str, tuple[int, ...]]
    row_sizes: dict[str, tuple[int, ...]]
    view_rewrites: dict[fx.Node, tuple[int, tuple[int, ...]]]  # view -> (shape position, local sizes)
    problems: list[Problem]
    comms: list[CommEstimate] = field(default_factory=list)
    gathered: dict[str, list[str]] = field(default_factory=dict)  # column path -> ops its output is gathered for
    pairs: dict[str, frozenset[str]] = field(default_factory=dict)  # row path -> column layers feeding it sharded
    vocab_sizes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # embedding path -> rows per shard
    window_heads: dict[str, tuple[int, ...]] = field(default_factory=dict)  # Swin window attention -> heads per shard
    vocab_losses: dict[fx.Node, tuple[int, ...]] = field(default_factory=dict)  # vocab-parallel cross-entropies
    tuples: set[fx.Node] = field(default_factory=set)  # splits / unbinds of a sharded value (their parts alike)
    column_sections: dict[str, int] = field(default_factory=dict)  # fused column layers: blocks per output


class _Analyzer:
    """One walk over the graph in order, applying :mod:`~dpcompile.analysis.sharding_rules`."""

    def __init__(
        self,
        gm: fx.GraphModule,
        sites: Mapping[str, LinearSite],
        styles: Mapping[str, str],
        n: int,
        granularity: Mapping[str, int],
        sections: Mapping[str, int] | None = None,
    ):
        self.sections = sections or {}
        self.gm = gm
        self.modules = dict(gm.named_modules())
        self.site_of = {s.node: s for s in sites.values()}
        self.styles = styles
        self.n = n
        self.granularity = granularity
        self.result = ShardingAnalysis({}, {}, {}, {}, {}, [])
        self._estimates: dict[fx.Node, int] = {}
        self._seen_comms: set[tuple[fx.Node, str]] = set()
        self._sharded_sizes: set[fx.Node] = set()

    def layout(self, node: Any) -> Layout:
        if not isinstance(node, fx.Node):
            return NOT_TENSOR
        return self.result.layouts.get(node, REPLICATED)

    def rewrite_view(self, node: fx.Node, position: int, sizes: tuple[int, ...]) -> None:
        self.result.view_rewrites[node] = (position, sizes)

    def mark_tuple(self, node: fx.Node) -> None:
        self.result.tuples.add(node)

    def is_tuple(self, node: Any) -> bool:
        return node in self.result.tuples

    def mark_sharded_size(self, node: fx.Node) -> None:
        self._sharded_sizes.add(node)

    def is_sharded_size(self, node: Any) -> bool:
        return node in self._sharded_sizes

    def rewritten_at(self, node: fx.Node) -> int | None:
        return self.result.view_rewrites.get(node, (None, ()))[0]

    def mark_vocab_loss(self, node: fx.Node, sizes: tuple[int, ...]) -> None:
        self.result.vocab_losses[node] = sizes
        rows = max(1, self.numel(node.args[0]) // max(1, sum(sizes)))
        self.result.comms.append(CommEstimate("all_gather", None, rows * self.n, f"{node.name} logsumexp all-gather"))
        self.result.comms.append(CommEstimate("all_reduce", None, rows, f"{node.name} target logit all-reduce"))

    # -- sizes for the cost model: exact from shapes, else features per token
    def numel(self, node: fx.Node) -> int:
        v = node_val(node)
        if isinstance(v, torch.Tensor):
            return int(v.numel())
        if node in self._estimates:
            return self._estimates[node]
        estimate = 1
        site = self.site_of.get(node)
        if site is not None:
            estimate = site.out_features
        elif node.op == "placeholder":
            estimate = next((s.in_features for s in self.site_of.values() if s.input is node), 1)
        else:
            firsts = [a for a in flat_nodes((node.args, node.kwargs)) if not isinstance(self.layout(a), NotTensor)]
            if firsts:
                estimate = self.numel(firsts[0])
        self._estimates[node] = estimate
        return estimate

    def need(self, consumer: fx.Node, producer: fx.Node, kind: str, sizes: tuple[int, ...] | None = None,
             *, explained: bool = False) -> None:  # fmt: skip
        self.result.needs[(consumer, producer)] = kind
        numel = self.numel(producer)
        steps = {"gather_copy": ("gather", "copy"), "gather_split": ("gather", "split")}.get(kind, (kind,))
        for step in steps:
            key = (producer, step if step != "split" else f"split{sizes}")
            if key in self._seen_comms:
                continue
            self._seen_comms.add(key)
            if step == "copy":
                backward = "all_reduce" if may_need_grad(producer) else None
                self.result.comms.append(CommEstimate("identity", backward, numel, f"{producer.name} -> f"))
            elif step == "gather":
                layout = self.layout(producer)
                if isinstance(layout, Sharded) and layout.sections > 1 and not explained:
                    self.result.problems.append(Problem(
                        layout.origins,
                        f"{describe_op(consumer)} needs the whole fused output (q, k, v sections); "
                        "split it into its sections (.split / .chunk / .view(.., 3, heads, d).unbind) before other ops",
                    ))  # fmt: skip
                self.result.comms.append(CommEstimate("all_gather", None, numel, f"{producer.name} all-gather"))
                layout = self.layout(producer)
                if isinstance(layout, Sharded):
                    for origin in layout.origins:
                        self.result.gathered.setdefault(origin, []).append(describe_op(consumer))
            else:
                self.result.comms.append(CommEstimate("split", "all_gather", numel, f"{producer.name} split"))

    def run(self) -> ShardingAnalysis:
        for node in self.gm.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                self.result.layouts[node] = self._plain_layout(node)
            elif node.op == "output":
                for a in flat_nodes(node.args):
                    if isinstance(self.layout(a), Sharded):
                        self.need(node, a, "gather")
            elif node in self.site_of and self.site_of[node].kind == "window_attention" and self.styles.get(self.site_of[node].path) == "column":
                self._window_attention(node, self.site_of[node])
            elif node in self.site_of and self.site_of[node].kind == "embedding" and self.styles.get(self.site_of[node].path) == "vocab":
                self._embedding(node, self.site_of[node])
            elif node in self.site_of and self.styles.get(self.site_of[node].path, "replicate") != "replicate":
                self._linear(node, self.site_of[node])
            else:
                self._generic(node)
        return self.result

    def _plain_layout(self, node: fx.Node) -> Layout:
        v = node_val(node)
        if v is not None and not isinstance(v, torch.Tensor):
            return NOT_TENSOR
        if v is not None:
            return REPLICATED
        if node.op == "call_method" and node.target in ("size", "dim"):
            return NOT_TENSOR
        if node.op == "call_function" and node.target is getattr and len(node.args) > 1 and node.args[1] in ops.SHARD_METADATA_ATTRIBUTES:
            return NOT_TENSOR
        if node.op == "call_function" and node.target is operator.getitem and isinstance(self.layout(node.args[0]), NotTensor):
            return NOT_TENSOR
        args = flat_nodes((node.args, node.kwargs))
        if node.op == "call_function" and ops.PYTHON_ARITHMETIC.matches(node) and args and all(
            isinstance(self.layout(a), NotTensor) for a in args
        ):
            return NOT_TENSOR
        return REPLICATED

    def vocab_split(self, site: LinearSite) -> tuple[int, ...]:
        """Rows per shard of an embedding and of the LM head tied to it (the same split)."""
        head = site.tied_to if site.kind == "embedding" else site.path
        return aligned_split(site.in_features if site.kind == "embedding" else site.out_features, self.n,
                             self.granularity.get(head or site.path, 1))  # fmt: skip

    def _window_attention(self, node: fx.Node, site: LinearSite) -> None:
        x = site.input
        self.need(node, x, "gather_copy" if isinstance(self.layout(x), Sharded) else "copy")
        self.result.window_heads[site.path] = aligned_split(site.heads, self.n)
        self.result.comms.append(CommEstimate("all_reduce", None, self.numel(node), f"{node.name} all-reduce"))
        self.result.layouts[node] = REPLICATED

    def _embedding(self, node: fx.Node, site: LinearSite) -> None:
        sizes = self.vocab_split(site)
        self.result.vocab_sizes[site.path] = sizes
        self.result.comms.append(CommEstimate("all_reduce", None, self.numel(node), f"{node.name} all-reduce"))
        self.result.layouts[node] = REPLICATED

    def _linear(self, node: fx.Node, site: LinearSite) -> None:
        style = self.styles[site.path]
        x = site.input
        lx = self.layout(x)
        numel_out = self.numel(node)
        if style == "column":
            self.need(node, x, "gather_copy" if isinstance(lx, Sharded) else "copy")
            s = self.sections.get(site.path, 1)
            if site.tied_to is not None:  # the LM head of a vocab-parallel embedding: its rows, one parameter
                sizes = self.vocab_split(site)
                self.result.column_sizes[site.path] = sizes
                self.result.layouts[node] = Sharded(-1, sizes, frozenset({site.path}))
                return
            sizes = tuple(s * size for size in aligned_split(site.out_features // s, self.n, self.granularity.get(site.path, 1)))
            self.result.column_sizes[site.path] = sizes
            if s > 1:
                self.result.column_sections[site.path] = s
            self.result.layouts[node] = Sharded(-1, sizes, frozenset({site.path}), sections=s)
            return
        if isinstance(lx, Sharded) and lx.dim == -1 and lx.sections == 1 and sum(lx.sizes) == site.in_features:
            sizes = lx.sizes
            self.result.pairs[site.path] = lx.origins
        else:
            sizes = aligned_split(site.in_features, self.n)
            self.need(node, x, "gather_split" if isinstance(lx, Sharded) else "split", sizes)
        self.result.row_sizes[site.path] = sizes
        self.result.comms.append(CommEstimate("all_reduce", None, numel_out, f"{node.name} all-reduce"))
        self.result.layouts[node] = REPLICATED

    def _generic(self, node: fx.Node) -> None:
        args = flat_nodes((node.args, node.kwargs))
        sharded = [a for a in args if isinstance(self.layout(a), Sharded)]
        if not sharded:
            self.result.layouts[node] = self._plain_layout(node)
            return
        try:
            layout, copies = apply_rule(self, node, self.modules)
        except NeedsWhole as fb:
            origins = frozenset().union(*(self.layout(a).origins for a in sharded))  # type: ignore[union-attr]
            if fb.problem:
                self.result.problems.append(Problem(origins, f"{describe_op(node)}: {fb.reason}", fb.granularity, fb.sections))
            for a in sharded:
                self.need(node, a, "gather", explained=fb.problem)
            self.result.layouts[node] = self._plain_layout(node)
            return
        for a in copies:
            self.need(node, a, "copy")
        self.result.layouts[node] = layout

    # -- rules: (layout of the result, replicated tensor args that need f) or _Fallback


def analyze_sharding(
    gm: fx.GraphModule,
    *,
    styles: Mapping[str, str],
    n: int,
    sites: Mapping[str, LinearSite] | None = None,
    granularity: Mapping[str, int] | None = None,
    sections: Mapping[str, int] | None = None,
) -> ShardingAnalysis:
    """Find the layout of every value and the collectives ``styles`` need, without rewriting.

    ``sections``: column layers whose output is a fused projection (``{"attn.qkv": 3}``),
    sharded block by block so each shard holds whole heads of q, k and v."""
    sites = find_linear_sites(gm) if sites is None else sites
    return _Analyzer(gm, sites, styles, n, granularity or {}, sections).run()


@dataclass
class ResolvedPlan:
    """The styles that will be applied, why any layer was kept whole, and the analysis."""

    styles: dict[str, str]
    reasons: dict[str, str]
    granularity: dict[str, int]
    analysis: ShardingAnalysis
    sections: dict[str, int] = field(default_factory=dict)


def resolve_plan(gm: fx.GraphModule, *, plan: Mapping[str, str], n: int, strict: bool = True) -> ResolvedPlan:
    """Apply blockers and view checks to ``plan``: which layers can really be split, and how.

    ``strict`` raises ``ValueError`` for a layer too narrow for ``n`` devices; otherwise it
    stays whole with the reason.
    """
    sites = find_linear_sites(gm)
    styles = {path: "replicate" for path in [*linear_paths(gm), *embedding_paths(gm), *sites]}
    reasons: dict[str, str] = {}
    for path, style in plan.items():
        styles[path] = style
        if style == "replicate":
            continue
        site = sites.get(path)
        why = (
            f"'{path}' is not called in forward (or only inside a leaf module)" if site is None
            else site.blocker or check_divisible(site, style, n)
        )  # fmt: skip
        if why is not None and site is not None and site.blocker is None and strict:
            raise ValueError(why)
        if why is not None:
            styles[path], reasons[path] = "replicate", why
    granularity: dict[str, int] = {}
    sections: dict[str, int] = {}
    for _ in range(3 * len(styles) + 3):
        analysis = analyze_sharding(gm, styles=styles, n=n, sites=sites, granularity=granularity, sections=sections)
        if not analysis.problems and not _untie(sites, styles, reasons):
            return ResolvedPlan(styles, reasons, granularity, analysis, sections)
        changed: set[str] = set()  # settled in this round: later problems of the same layers wait for the next
        for problem in analysis.problems:
            columns = [o for o in problem.origins if styles.get(o) == "column"]
            if changed & set(columns):
                continue
            s = problem.sections
            if s and all(o not in sections for o in columns) and all(
                sites[o].out_features % s == 0 and _fits(sites[o].out_features // s, n, granularity.get(o, 1)) for o in columns
            ):
                for o in columns:
                    sections[o] = s
                changed.update(columns)
                continue
            g = problem.granularity
            if g and all(_fits(sites[o].out_features // sections.get(o, 1), n, math.lcm(granularity.get(o, 1), g)) for o in columns) and any(
                granularity.get(o, 1) % g for o in columns
            ):
                for o in columns:
                    granularity[o] = math.lcm(granularity.get(o, 1), g)
                changed.update(columns)
                continue
            for o in columns:
                styles[o] = "replicate"
                reasons[o] = f"kept whole: {problem.reason}"
    raise AssertionError("resolve_plan did not converge")  # pragma: no cover


def _untie(sites: Mapping[str, LinearSite], styles: dict[str, str], reasons: dict[str, str]) -> bool:
    """Keep an embedding and its tied LM head split alike (vocab / column) or both whole; True if changed."""
    changed = False
    for path, site in sites.items():
        if site.kind != "embedding" or site.tied_to is None:
            continue
        head = site.tied_to
        emb_on, head_on = styles.get(path) == "vocab", styles.get(head) == "column"
        if emb_on and not head_on:
            styles[path] = "replicate"
            reasons[path] = f"its weight is tied to the LM head '{head}', which stays whole ({reasons.get(head, 'replicate')})"
            changed = True
        elif head_on and not emb_on:
            styles[head] = "replicate"
            reasons[head] = f"its weight is tied to the embedding '{path}', which stays whole ({reasons.get(path, 'replicate')})"
            changed = True
    return changed


def _fits(total: int, n: int, g: int) -> bool:
    return total % g == 0 and total // g >= n


__all__ = [
    "STYLES",
    "EMBEDDING_STYLES",
    "embedding_paths",
    "COPIED",
    "NOT_TENSOR",
    "REPLICATED",
    "Copied",
    "Layout",
    "NotTensor",
    "Replicated",
    "Sharded",
    "LinearSite",
    "Problem",
    "ResolvedPlan",
    "ShardingAnalysis",
    "aligned_split",
    "analyze_sharding",
    "check_divisible",
    "check_plan",
    "find_linear_sites",
    "is_shard_transparent",
    "is_transposed_linear",
    "linear_like_leaves",
    "linear_like_types",
    "linear_paths",
    "window_attention_args",
    "resolve_plan",
]
