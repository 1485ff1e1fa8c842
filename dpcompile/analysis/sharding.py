"""The sharding analysis: which ``nn.Linear`` layers a plan can split, and how every value is laid out.

Everything the tensor-parallel planner (:mod:`dpcompile.planning`) and the
``shard_linear`` pass need to know before anything is rewritten:

- :mod:`dpcompile.analysis.linear_sites` finds the Linear calls (and what blocks one: a shared
  layer, tied weights) and checks a plan against a model, with the arithmetic (its names are
  re-exported here);
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from dpcompile.analysis import ops
from dpcompile.analysis.cost import CommEstimate
from dpcompile.analysis.linear_sites import (  # noqa: F401 - what the planner and passes read here
    EMBEDDING_STYLES,
    STYLES,
    LinearSite,
    aligned_split,
    check_divisible,
    check_plan,
    embedding_paths,
    find_linear_sites,
    is_transposed_linear,
    linear_like_leaves,
    linear_like_types,
    linear_paths,
    window_attention_args,
)
from dpcompile.analysis.placement import REPLICATED, Replicated
from dpcompile.analysis.sharding_layout import refuse_tuple_read_whole
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
    node_val,
)
from dpcompile.errors import ArgumentError


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
    arg_splits: dict[tuple[fx.Node, fx.Node], tuple[int, tuple[int, ...]]] = field(default_factory=dict)  # (consumer, replicated arg) -> its slice


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
        refuse_tuple_read_whole(node)
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

    def split_arg(self, consumer: fx.Node, producer: fx.Node, dim: int, sizes: tuple[int, ...]) -> None:
        self.result.arg_splits[(consumer, producer)] = (dim, sizes)
        self.need(consumer, producer, "split", sizes)

    # -- sizes for the cost model: exact from shapes, else features per token
    def numel(self, node: fx.Node) -> int:
        v = node_val(node)
        if isinstance(v, torch.Tensor) and not _unbacked(v.numel()):
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


def resolve_plan(
    gm: fx.GraphModule, *, plan: Mapping[str, str], n: int, strict: bool = True,
    sites: Mapping[str, LinearSite] | None = None, layer_paths: Sequence[str] | None = None,
) -> ResolvedPlan:  # fmt: skip
    """Apply blockers and view checks to ``plan``: which layers can really be split, and how.

    ``strict`` raises ``ValueError`` for a layer too narrow for ``n`` devices; otherwise it
    stays whole with the reason. ``sites`` and ``layer_paths`` (:func:`find_linear_sites` and
    :func:`linear_paths` + :func:`embedding_paths` of ``gm``): what a caller that resolves many plans
    of one unchanged graph found once (``choose_plan``), instead of each call finding them again.
    """
    sites = find_linear_sites(gm) if sites is None else sites
    if layer_paths is None:
        layer_paths = [*linear_paths(gm), *embedding_paths(gm)]
    styles = {path: "replicate" for path in [*layer_paths, *sites]}
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
            raise ArgumentError(why)
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
    """Keep an embedding and its tied LM head split alike (vocab / column) or both whole, and so
    layers sharing one bias; True if changed."""
    changed = False
    for path, site in sites.items():
        group = [path, *site.bias_shared_with]
        if len({styles.get(p) for p in group}) > 1:
            for p in group:
                if styles.get(p) != "replicate":
                    styles[p] = "replicate"
                    reasons[p] = f"its bias is shared with {', '.join(repr(o) for o in group if o != p)}, split otherwise; all stay whole"
                    changed = True
    for site in sites.values():  # from either end: a blocked embedding (its weight read) never learns its head
        if site.tied_to is None or site.tied_to not in sites:
            continue
        path, head = (site.path, site.tied_to) if site.kind == "embedding" else (site.tied_to, site.path)
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


def _unbacked(size: Any) -> bool:
    """Whether ``size`` holds a data-dependent symbol (``u0``); an int never does."""
    if isinstance(size, int):
        return False
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols  # lazy: it imports sympy

    return bool(free_unbacked_symbols(size))
