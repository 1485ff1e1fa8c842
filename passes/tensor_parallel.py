"""``shard_linear`` and ``expand_shards``: tensor-parallel ``nn.Linear``, written down as code.

``shard_linear`` rewrites the captured graph into the program of *one* shard (SPMD form):
sharded layers read their slice of the weight, and every step that involves the other
shards is an explicit call of :mod:`dpcompile.runtime.collectives`. ``expand_shards`` then
lowers that program to single-process code over several devices.

Before (an MLP, plan ``{"fc1": "column", "fc2": "row"}``)::

    def forward(self, x):
        fc1 = self.fc1(x)
        relu = torch.relu(fc1)
        fc2 = self.fc2(relu)
        return fc2

After ``shard_linear`` (one shard's program; ``fc1.weight`` is this shard's rows)::

    def forward(self, x):
        x_copy = dpcompile_runtime_collectives_copy_to_shards(x)          # f
        fc1_weight = self.fc1.weight
        fc1_bias = self.fc1.bias
        fc1 = torch._C._nn.linear(x_copy, fc1_weight, fc1_bias)
        relu = torch.relu(fc1)                                             # stays sharded
        fc2_weight = self.fc2.weight
        fc2_partial = torch._C._nn.linear(relu, fc2_weight)
        fc2_all_reduce = dpcompile_runtime_collectives_reduce_from_shards(fc2_partial)   # g
        fc2_bias = self.fc2.bias
        fc2 = fc2_all_reduce + fc2_bias                                    # bias added once
        return fc2

After ``expand_shards`` on ``["cpu", "cpu"]``::

    def forward(self, x):
        x_on_device = dpcompile_runtime_to_device(x, 'cpu')
        x_copy = dpcompile_runtime_tensor_parallel_copy_to_devices(x_on_device, ['cpu', 'cpu'])
        x_copy_dev0 = x_copy[0]
        x_copy_dev1 = x_copy[1]
        fc1_weight_shard0 = self.fc1.weight_shard0
        ...
        fc1_dev0 = torch._C._nn.linear(x_copy_dev0, fc1_weight_shard0, fc1_bias_shard0)
        fc1_dev1 = torch._C._nn.linear(x_copy_dev1, fc1_weight_shard1, fc1_bias_shard1)
        relu_dev0 = torch.relu(fc1_dev0)
        relu_dev1 = torch.relu(fc1_dev1)
        ...
        fc2_all_reduce = dpcompile_runtime_tensor_parallel_reduce_to_device([fc2_partial_dev0, fc2_partial_dev1], 'cpu')
        fc2 = fc2_all_reduce + fc2_bias
        return fc2

Styles: ``column`` splits ``weight`` (and ``bias``) along ``out_features``; the output stays
sharded through element-wise ops, softmax, attention and shape ops (``view(b, t, heads, d)``
with its sharded constant rewritten as ``local_size([..])``) and is all-gathered only where a
whole tensor is needed (LayerNorm, an output, an op without a rule). ``row`` splits
``weight`` along ``in_features``; a sharded input of matching sizes is used as it is (the
Megatron pair, no communication between the layers), a replicated one is split; the partial
sums are all-reduced and the bias added once after. ``replicate`` leaves the layer whole.
A view whose sharded constant cannot be proven to split (heads that do not divide, shapes
unknown) keeps the column layers feeding it replicated, and the reason is recorded.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from dpcompile.analysis.cost import CommEstimate
from dpcompile.devices import Devices
from dpcompile.infra import PassResult, stamp, stamp_comm
from dpcompile.runtime import collectives, to_device
from dpcompile.runtime import tensor_parallel as tp_runtime
from dpcompile.runtime.comm import split_sizes
from dpcompile.runtime.tensor_parallel import ShardSpec

PASS = "shard_linear"
EXPAND = "expand_shards"
STYLES = ("column", "row", "replicate")


# ---------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Sharded:
    """A value split along ``dim`` (counted from the end, so broadcasting lines dims up)."""

    dim: int
    sizes: tuple[int, ...]
    origins: frozenset[str] = frozenset()  # the column layers whose outputs it carries
    unit: int = 1  # output features of the origin layers per unit of ``dim``


@dataclass(frozen=True)
class Replicated:
    """The same whole tensor on every shard."""


@dataclass(frozen=True)
class Copied:
    """A replicated value passed through *f* into a sharded region (one copy per shard)."""


@dataclass(frozen=True)
class NotTensor:
    """A Python value (a size, a dtype) that is the same on every shard."""


REPLICATED = Replicated()
COPIED = Copied()
NOT_TENSOR = NotTensor()
Layout = Sharded | Replicated | Copied | NotTensor


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


def linear_paths(root: nn.Module) -> list[str]:
    """Every ``nn.Linear`` of ``root`` by module path (``""`` is ``root`` itself)."""
    return [name for name, m in root.named_modules() if isinstance(m, nn.Linear)]


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
        out_features, in_features = gm.get_parameter(f"{prefix}weight").shape
        if node.op == "call_module":
            has_bias, own_reads = modules[path].bias is not None, 0
        else:
            bias = _arg(node, 2, "bias")
            has_bias = isinstance(bias, fx.Node)
            own_reads = 1 + int(has_bias)
        sites[path] = LinearSite(path, node, x, int(in_features), int(out_features), has_bias)
        if attr_reads.get(f"{prefix}weight", 0) + attr_reads.get(f"{prefix}bias", 0) > own_reads:
            sites[path].blocker = f"the weight of '{path}' is also read directly (tied weights); it stays whole"
    for path, site in sites.items():
        if calls[path] > 1:
            site.blocker = f"'{path}' is called {calls[path]} times in forward; a shared layer stays whole"
    return sites


def _linear_path(node: fx.Node, modules: Mapping[str, nn.Module]) -> str | None:
    if node.op == "call_module" and isinstance(modules.get(node.target), nn.Linear):
        return node.target
    if node.op == "call_function" and node.target is F.linear and len(node.args) >= 2:
        w = node.args[1]
        if isinstance(w, fx.Node) and w.op == "get_attr" and w.target.rsplit(".", 1)[-1] == "weight" and "dpcompile_shard" not in w.meta:
            path = w.target.rsplit(".", 1)[0] if "." in w.target else ""
            if path == "" or isinstance(modules.get(path), nn.Linear):
                return path
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
    valid = linear_paths(root) + [p for p in extra_linears if p not in modules or p == ""]
    shown = ", ".join(repr(p) for p in valid) or "(none)"
    for path, style in plan.items():
        if path in valid:
            pass
        elif path not in modules:
            raise ValueError(
                f"tensor_parallel plan names {path!r}, which is not a module of {type(root).__name__}; "
                f"its nn.Linear layers are: {shown}"
            )
        elif not isinstance(modules[path], nn.Linear):
            raise ValueError(
                f"tensor_parallel plan names {path!r}, a {type(modules[path]).__name__}, not an nn.Linear; "
                f"its nn.Linear layers are: {shown}"
            )
        if style not in STYLES:
            raise ValueError(f"unknown split style {style!r} for {path!r}; valid styles: {', '.join(map(repr, STYLES))}")


def check_divisible(site: LinearSite, style: str, n: int) -> str | None:
    """Why ``site`` cannot be split ``style``-wise over ``n`` devices, with the arithmetic; or None."""
    if style == "column" and site.out_features < n:
        return f"out_features({site.out_features}) of '{site.path}' cannot be split over {n} devices"
    if style == "row" and site.in_features < n:
        return f"in_features({site.in_features}) of '{site.path}' cannot be split over {n} devices"
    return None


# ---------------------------------------------------------------------- analysis
_UNARY_FUNCTIONS = {
    torch.relu, F.relu, F.relu6, F.gelu, F.silu, F.mish, F.hardswish, F.elu, F.leaky_relu, F.softplus,
    torch.tanh, torch.sigmoid, F.dropout, torch.exp, torch.neg, operator.neg, torch.erf, torch.abs,
    torch.square, torch.sqrt, torch.rsqrt,
}  # fmt: skip
_UNARY_METHODS = {
    "relu", "sigmoid", "tanh", "exp", "neg", "abs", "sqrt", "rsqrt", "square", "erf",
    "float", "half", "bfloat16", "double", "contiguous", "clone",
}  # fmt: skip
_UNARY_MODULES = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Hardswish, nn.ELU, nn.LeakyReLU, nn.Softplus,
    nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity,
)  # fmt: skip
_BINARY_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.pow, torch.add, torch.sub,
    torch.mul, torch.div, torch.where, torch.maximum, torch.minimum,
}  # fmt: skip
_BINARY_METHODS = {"add", "sub", "mul", "div", "pow", "masked_fill", "maximum", "minimum"}
_SOFTMAX_FUNCTIONS = {F.softmax, torch.softmax, F.log_softmax, torch.log_softmax}
_SOFTMAX_METHODS = {"softmax", "log_softmax"}
_MATMUL_FUNCTIONS = {operator.matmul, torch.matmul, torch.bmm}
_MATMUL_METHODS = {"matmul", "bmm"}
_VIEW_METHODS = {"view", "reshape"}
_SHAPE_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda"}


class _Fallback(Exception):
    """The op needs whole inputs; ``problem`` marks a view the pass should have kept sharded."""

    def __init__(self, reason: str, *, problem: bool = False, granularity: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.problem = problem
        self.granularity = granularity


@dataclass(frozen=True)
class Problem:
    """A sharded value the pass could not carry through an op it should have (a view)."""

    origins: frozenset[str]
    reason: str
    granularity: int | None = None


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


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _shape(node: Any) -> tuple[int, ...] | None:
    v = _val(node)
    if isinstance(v, torch.Tensor):
        try:
            return tuple(int(s) for s in v.shape)
        except (TypeError, ValueError):
            return None
    return None


def _may_need_grad(node: fx.Node) -> bool:
    """False for values that never carry a gradient (masks, integer tensors): f's backward is then free."""
    v = _val(node)
    return not (isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex()))


def _ndim(node: Any) -> int | None:
    s = _shape(node)
    return None if s is None else len(s)


def _from_end(dim: int, ndim: int | None) -> int:
    if dim < 0:
        return dim
    if ndim is None:
        raise _Fallback("dim counted from the front of a tensor of unknown rank; pass example_inputs=")
    return dim - ndim


def _describe_op(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{node.name} ({target})"


def _arg(node: fx.Node, pos: int, name: str, default: Any = None) -> Any:
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def _flat_nodes(value: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(value, lambda n: out.append(n) or n)
    return out


class _Analyzer:
    def __init__(
        self,
        gm: fx.GraphModule,
        sites: Mapping[str, LinearSite],
        styles: Mapping[str, str],
        n: int,
        granularity: Mapping[str, int],
    ):
        self.gm = gm
        self.modules = dict(gm.named_modules())
        self.site_of = {s.node: s for s in sites.values()}
        self.styles = styles
        self.n = n
        self.granularity = granularity
        self.result = ShardingAnalysis({}, {}, {}, {}, {}, [])
        self._estimates: dict[fx.Node, int] = {}
        self._seen_comms: set[tuple[fx.Node, str]] = set()

    def layout(self, node: Any) -> Layout:
        if not isinstance(node, fx.Node):
            return NOT_TENSOR
        return self.result.layouts.get(node, REPLICATED)

    # -- sizes for the cost model: exact from shapes, else features per token
    def numel(self, node: fx.Node) -> int:
        v = _val(node)
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
            firsts = [a for a in _flat_nodes((node.args, node.kwargs)) if not isinstance(self.layout(a), NotTensor)]
            if firsts:
                estimate = self.numel(firsts[0])
        self._estimates[node] = estimate
        return estimate

    def need(self, consumer: fx.Node, producer: fx.Node, kind: str, sizes: tuple[int, ...] | None = None) -> None:
        self.result.needs[(consumer, producer)] = kind
        numel = self.numel(producer)
        steps = {"gather_copy": ("gather", "copy"), "gather_split": ("gather", "split")}.get(kind, (kind,))
        for step in steps:
            key = (producer, step if step != "split" else f"split{sizes}")
            if key in self._seen_comms:
                continue
            self._seen_comms.add(key)
            if step == "copy":
                backward = "all_reduce" if _may_need_grad(producer) else None
                self.result.comms.append(CommEstimate("identity", backward, numel, f"{producer.name} -> f"))
            elif step == "gather":
                self.result.comms.append(CommEstimate("all_gather", None, numel, f"{producer.name} all-gather"))
                layout = self.layout(producer)
                if isinstance(layout, Sharded):
                    for origin in layout.origins:
                        self.result.gathered.setdefault(origin, []).append(_describe_op(consumer))
            else:
                self.result.comms.append(CommEstimate("split", "all_gather", numel, f"{producer.name} split"))

    def run(self) -> ShardingAnalysis:
        for node in self.gm.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                self.result.layouts[node] = self._plain_layout(node)
            elif node.op == "output":
                for a in _flat_nodes(node.args):
                    if isinstance(self.layout(a), Sharded):
                        self.need(node, a, "gather")
            elif node in self.site_of and self.styles.get(self.site_of[node].path, "replicate") != "replicate":
                self._linear(node, self.site_of[node])
            else:
                self._generic(node)
        return self.result

    def _plain_layout(self, node: fx.Node) -> Layout:
        v = _val(node)
        if v is not None and not isinstance(v, torch.Tensor):
            return NOT_TENSOR
        if v is not None:
            return REPLICATED
        if node.op == "call_method" and node.target in ("size", "dim"):
            return NOT_TENSOR
        if node.op == "call_function" and node.target is getattr and len(node.args) > 1 and node.args[1] in _SHAPE_ATTRS:
            return NOT_TENSOR
        if node.op == "call_function" and node.target is operator.getitem and isinstance(self.layout(node.args[0]), NotTensor):
            return NOT_TENSOR
        args = _flat_nodes((node.args, node.kwargs))
        if node.op == "call_function" and node.target in (operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.pow, operator.mod, operator.neg) and args and all(
            isinstance(self.layout(a), NotTensor) for a in args
        ):
            return NOT_TENSOR
        return REPLICATED

    def _linear(self, node: fx.Node, site: LinearSite) -> None:
        style = self.styles[site.path]
        x = site.input
        lx = self.layout(x)
        numel_out = self.numel(node)
        if style == "column":
            self.need(node, x, "gather_copy" if isinstance(lx, Sharded) else "copy")
            sizes = aligned_split(site.out_features, self.n, self.granularity.get(site.path, 1))
            self.result.column_sizes[site.path] = sizes
            self.result.layouts[node] = Sharded(-1, sizes, frozenset({site.path}))
            return
        if isinstance(lx, Sharded) and lx.dim == -1 and sum(lx.sizes) == site.in_features:
            sizes = lx.sizes
            self.result.pairs[site.path] = lx.origins
        else:
            sizes = aligned_split(site.in_features, self.n)
            self.need(node, x, "gather_split" if isinstance(lx, Sharded) else "split", sizes)
        self.result.row_sizes[site.path] = sizes
        self.result.comms.append(CommEstimate("all_reduce", None, numel_out, f"{node.name} all-reduce"))
        self.result.layouts[node] = REPLICATED

    def _generic(self, node: fx.Node) -> None:
        args = _flat_nodes((node.args, node.kwargs))
        sharded = [a for a in args if isinstance(self.layout(a), Sharded)]
        if not sharded:
            self.result.layouts[node] = self._plain_layout(node)
            return
        try:
            layout, copies = self._rule(node)
        except _Fallback as fb:
            origins = frozenset().union(*(self.layout(a).origins for a in sharded))  # type: ignore[union-attr]
            if fb.problem:
                self.result.problems.append(Problem(origins, f"{_describe_op(node)}: {fb.reason}", fb.granularity))
            for a in sharded:
                self.need(node, a, "gather")
            self.result.layouts[node] = self._plain_layout(node)
            return
        for a in copies:
            self.need(node, a, "copy")
        self.result.layouts[node] = layout

    # -- rules: (layout of the result, replicated tensor args that need f) or _Fallback
    def _rule(self, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
        op, target = node.op, node.target
        if op == "call_module":
            module = self.modules.get(target)
            if isinstance(module, _UNARY_MODULES):
                return self._unary(node)
            if isinstance(module, nn.Softmax):
                return self._softmax(node, module.dim)
            raise _Fallback(f"no sharding rule for {type(module).__name__}")
        if op == "call_function":
            if target in _UNARY_FUNCTIONS:
                return self._unary(node)
            if target in _BINARY_FUNCTIONS:
                return self._binary(node)
            if target in _SOFTMAX_FUNCTIONS:
                return self._softmax(node, _arg(node, 1, "dim"))
            if target in _MATMUL_FUNCTIONS:
                return self._matmul(node)
            if target is F.scaled_dot_product_attention:
                return self._attention(node)
            if target is torch.reshape:
                return self._view(node, 1)
            if target is torch.transpose:
                return self._transpose(node)
            if target is torch.permute:
                return self._permute(node)
            if target is getattr and len(node.args) > 1 and node.args[1] in ("dtype", "ndim"):
                return NOT_TENSOR, []
            if target is getattr and len(node.args) > 1 and node.args[1] == "shape":
                return self._shape(node)
        if op == "call_method":
            if target in _UNARY_METHODS:
                return self._unary(node)
            if target in _BINARY_METHODS:
                return self._binary(node)
            if target in _SOFTMAX_METHODS:
                return self._softmax(node, _arg(node, 1, "dim"))
            if target in _MATMUL_METHODS:
                return self._matmul(node)
            if target in _VIEW_METHODS:
                return self._view(node, 1)
            if target == "transpose":
                return self._transpose(node)
            if target == "permute":
                return self._permute(node)
            if target == "size":
                return self._size(node)
            if target == "dim":
                return NOT_TENSOR, []
        raise _Fallback("needs the whole tensor")

    def _unary(self, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
        x, *rest = _flat_nodes((node.args, node.kwargs))
        layout = self.layout(x)
        if not isinstance(layout, Sharded) or any(not isinstance(self.layout(a), NotTensor) for a in rest):
            raise _Fallback("an element-wise op with more than one tensor")
        return layout, []

    def _binary(self, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
        operands = _flat_nodes((node.args, node.kwargs))
        ref = next(self.layout(a) for a in operands if isinstance(self.layout(a), Sharded))
        assert isinstance(ref, Sharded)
        origins, copies = set(ref.origins), []
        for a in operands:
            la = self.layout(a)
            if isinstance(la, Sharded):
                if (la.dim, la.sizes) != (ref.dim, ref.sizes):
                    raise _Fallback("operands sharded differently")
                origins |= la.origins
            elif isinstance(la, (Replicated, Copied)):
                shape = _shape(a)
                if shape is None:
                    raise _Fallback("a replicated operand of unknown shape")
                if len(shape) >= -ref.dim and shape[len(shape) + ref.dim] != 1:
                    raise _Fallback("a replicated operand spans the sharded dim")
                copies.append(a)
        return Sharded(ref.dim, ref.sizes, frozenset(origins), ref.unit), copies

    def _softmax(self, node: fx.Node, dim: Any) -> tuple[Layout, list[fx.Node]]:
        x = node.args[0]
        layout = self.layout(x)
        if not isinstance(layout, Sharded) or not isinstance(dim, int):
            raise _Fallback("softmax over an unknown dim")
        if _from_end(dim, _ndim(x)) == layout.dim:
            raise _Fallback("softmax over the sharded dim")
        return layout, []

    def _matmul(self, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
        a, b = node.args[0], node.args[1]
        la, lb = self.layout(a), self.layout(b)
        if isinstance(la, Sharded) and isinstance(lb, Sharded) and (la.dim, la.sizes) == (lb.dim, lb.sizes) and la.dim <= -3:
            return Sharded(la.dim, la.sizes, la.origins | lb.origins, la.unit), []
        raise _Fallback("a matmul that contracts or mixes the sharded dim")

    def _attention(self, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
        q, k, v = node.args[:3]
        lq, lk, lv = self.layout(q), self.layout(k), self.layout(v)
        if not all(isinstance(layout, Sharded) for layout in (lq, lk, lv)):
            raise _Fallback("attention with q, k, v not all sharded")
        if len({(layout.dim, layout.sizes) for layout in (lq, lk, lv)}) != 1 or lq.dim > -3:  # type: ignore[union-attr]
            raise _Fallback("attention with q, k, v sharded differently or along a sequence/feature dim")
        copies = []
        mask = _arg(node, 3, "attn_mask")
        if isinstance(mask, fx.Node):
            lm = self.layout(mask)
            if isinstance(lm, Sharded):
                if (lm.dim, lm.sizes) != (lq.dim, lq.sizes):  # type: ignore[union-attr]
                    raise _Fallback("a mask sharded differently")
            else:
                shape = _shape(mask)
                if shape is None or (len(shape) >= -lq.dim and shape[len(shape) + lq.dim] != 1):  # type: ignore[union-attr]
                    raise _Fallback("a replicated mask that spans the sharded dim")
                copies.append(mask)
        origins = lq.origins | lk.origins | lv.origins  # type: ignore[union-attr]
        return Sharded(lq.dim, lq.sizes, origins, lq.unit), copies  # type: ignore[union-attr]

    def _transpose(self, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
        x = node.args[0]
        layout = self.layout(x)
        assert isinstance(layout, Sharded)
        a, b = _arg(node, 1, "dim0"), _arg(node, 2, "dim1")
        if not (isinstance(a, int) and isinstance(b, int)):
            raise _Fallback("transpose with computed dims")
        nd = _ndim(x)
        a, b = _from_end(a, nd), _from_end(b, nd)
        dim = b if layout.dim == a else a if layout.dim == b else layout.dim
        return Sharded(dim, layout.sizes, layout.origins, layout.unit), []

    def _permute(self, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
        x = node.args[0]
        layout = self.layout(x)
        assert isinstance(layout, Sharded)
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        nd = _ndim(x)
        if nd is None or not all(isinstance(d, int) for d in dims):
            raise _Fallback("permute of unknown rank; pass example_inputs=")
        normal = [d % nd for d in dims]
        return Sharded(normal.index(layout.dim + nd) - nd, layout.sizes, layout.origins, layout.unit), []

    def _size(self, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
        x = node.args[0]
        layout = self.layout(x)
        assert isinstance(layout, Sharded)
        dim = _arg(node, 1, "dim")
        if dim is None:  # x.size(): as x.shape
            return self._shape(node)
        if not isinstance(dim, int) or _from_end(dim, _ndim(x)) == layout.dim:
            raise _Fallback("reads the size of the sharded dim")
        return NOT_TENSOR, []

    def _shape(self, node: fx.Node) -> tuple[Layout, list[fx.Node]]:
        """``x.shape`` / ``x.size()`` of a sharded ``x``: the local shape, fine while every use
        reads one other dim (``k.shape[-1]``); anything else needs the whole tensor."""
        x = node.args[0]
        layout = self.layout(x)
        assert isinstance(layout, Sharded)
        for user in node.users:
            index = user.args[1] if user.op == "call_function" and user.target is operator.getitem and len(user.args) == 2 else None
            if user.args[0] is not node or not isinstance(index, int) or _from_end(index, _ndim(x)) == layout.dim:
                raise _Fallback("reads the size of the sharded dim")
        return NOT_TENSOR, []

    def _view(self, node: fx.Node, first: int) -> tuple[Layout, list[fx.Node]]:
        x = node.args[0]
        layout = self.layout(x)
        assert isinstance(layout, Sharded)
        shape_args = node.args[first:]
        if len(shape_args) == 1 and isinstance(shape_args[0], (list, tuple)):
            shape_args = tuple(shape_args[0])
        if not shape_args or any(isinstance(s, fx.Node) and not isinstance(self.layout(s), NotTensor) for s in shape_args):
            raise _Fallback("a view whose shape is a computed tensor", problem=True)
        in_shape, out_shape = _shape(x), _shape(node)
        if in_shape is None or out_shape is None or len(shape_args) != len(out_shape):
            raise _Fallback(
                "shapes are unknown (no example_inputs=, or fake-tensor shape propagation failed), so the "
                "sharded constant cannot be checked; pass example_inputs=",
                problem=True,
            )
        d = len(in_shape) + layout.dim
        before, full = math.prod(in_shape[:d]), in_shape[d]
        j = next((i for i in range(len(out_shape) + 1) if math.prod(out_shape[:i]) == before), None)
        while j is not None and j < len(out_shape) and out_shape[j] == 1 and full != 1:
            j += 1
        if j is None or j == len(out_shape):
            raise _Fallback("the view mixes the sharded dim with the dims before it", problem=True)
        if out_shape[j] == full:
            sizes, unit = layout.sizes, layout.unit
        elif out_shape[j] < full:
            k = next((i for i in range(j + 1, len(out_shape) + 1) if math.prod(out_shape[j:i]) == full), None)
            inner = full // out_shape[j]
            if k is None or full % out_shape[j]:
                raise _Fallback("the view splits the sharded dim unevenly", problem=True)
            if any(s % inner for s in layout.sizes):
                raise _Fallback(
                    f"shard sizes {list(layout.sizes)} of a dim of {full} do not split into {out_shape[j]} x {inner}",
                    problem=True,
                    granularity=inner * layout.unit,
                )
            sizes, unit = tuple(s // inner for s in layout.sizes), layout.unit * inner
        else:
            m = next((i for i in range(d + 1, len(in_shape) + 1) if math.prod(in_shape[d:i]) == out_shape[j]), None)
            if m is None:
                raise _Fallback("the view merges the sharded dim unevenly", problem=True)
            inner = out_shape[j] // full
            sizes, unit = tuple(s * inner for s in layout.sizes), max(1, layout.unit // inner)
        if shape_args[j] != -1:
            self.result.view_rewrites[node] = (j, sizes)
        return Sharded(j - len(out_shape), sizes, layout.origins, unit), []


def is_shard_transparent(node: fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    """True for ops a sharded value can pass through (given matching shapes): element-wise,
    softmax, matmul over batch dims, attention, views, transposes."""
    op, target = node.op, node.target
    if op == "call_module":
        return isinstance(modules.get(target), (*_UNARY_MODULES, nn.Softmax))
    if op == "call_function":
        return target in _UNARY_FUNCTIONS or target in _BINARY_FUNCTIONS or target in _SOFTMAX_FUNCTIONS or target in _MATMUL_FUNCTIONS or target in (
            F.scaled_dot_product_attention, torch.reshape, torch.transpose, torch.permute
        )
    if op == "call_method":
        return target in _UNARY_METHODS | _BINARY_METHODS | _SOFTMAX_METHODS | _MATMUL_METHODS | _VIEW_METHODS | {"transpose", "permute"}
    return False


def analyze_sharding(
    gm: fx.GraphModule,
    *,
    styles: Mapping[str, str],
    n: int,
    sites: Mapping[str, LinearSite] | None = None,
    granularity: Mapping[str, int] | None = None,
) -> ShardingAnalysis:
    """Find the layout of every value and the collectives ``styles`` need, without rewriting."""
    sites = find_linear_sites(gm) if sites is None else sites
    return _Analyzer(gm, sites, styles, n, granularity or {}).run()


@dataclass
class ResolvedPlan:
    """The styles that will be applied, why any layer was kept whole, and the analysis."""

    styles: dict[str, str]
    reasons: dict[str, str]
    granularity: dict[str, int]
    analysis: ShardingAnalysis


def resolve_plan(gm: fx.GraphModule, *, plan: Mapping[str, str], n: int, strict: bool = True) -> ResolvedPlan:
    """Apply blockers and view checks to ``plan``: which layers can really be split, and how.

    ``strict`` raises ``ValueError`` for a layer too narrow for ``n`` devices; otherwise it
    stays whole with the reason.
    """
    sites = find_linear_sites(gm)
    styles = {path: "replicate" for path in [*linear_paths(gm), *sites]}
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
    for _ in range(2 * len(styles) + 2):
        analysis = analyze_sharding(gm, styles=styles, n=n, sites=sites, granularity=granularity)
        if not analysis.problems:
            return ResolvedPlan(styles, reasons, granularity, analysis)
        for problem in analysis.problems:
            columns = [o for o in problem.origins if styles.get(o) == "column"]
            g = problem.granularity
            if g and all(_fits(sites[o].out_features, n, math.lcm(granularity.get(o, 1), g)) for o in columns) and any(
                granularity.get(o, 1) % g for o in columns
            ):
                for o in columns:
                    granularity[o] = math.lcm(granularity.get(o, 1), g)
                continue
            for o in columns:
                styles[o] = "replicate"
                reasons[o] = f"kept whole: {problem.reason}"
    raise AssertionError("resolve_plan did not converge")  # pragma: no cover


def _fits(total: int, n: int, g: int) -> bool:
    return total % g == 0 and total // g >= n


# ---------------------------------------------------------------------- rewriting
def shard_linear(gm: fx.GraphModule, *, plan: Mapping[str, str], devices: Devices) -> PassResult:
    """Rewrite ``gm`` into one shard's program for ``plan`` (``{path: style}``; others whole).

    The result's ``info`` holds ``plan`` (the styles applied), ``reasons`` (why a layer was
    kept whole), ``param_shards`` (``{"fc1.weight": ShardSpec(0, (5, 5))}``) and ``comms``
    (the :class:`~dpcompile.analysis.cost.CommEstimate` of every collective inserted).
    """
    check_plan(gm, plan, extra_linears=find_linear_sites(gm))
    n = len(devices)
    resolved = resolve_plan(gm, plan=plan, n=n)
    if all(style == "replicate" for style in resolved.styles.values()):
        info = {"plan": resolved.styles, "reasons": resolved.reasons, "param_shards": {}, "comms": [], "gathered": {}, "pairs": {}}
        return PassResult(gm, False, info)
    rewriter = _Rewriter(gm, find_linear_sites(gm), resolved)
    gm.graph = rewriter.build()
    info = {
        "plan": resolved.styles,
        "reasons": resolved.reasons,
        "param_shards": rewriter.param_shards,
        "comms": resolved.analysis.comms,
        "gathered": resolved.analysis.gathered,
        "pairs": resolved.analysis.pairs,
    }
    return PassResult(gm, True, info)


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, sites: Mapping[str, LinearSite], resolved: ResolvedPlan):
        self.gm = gm
        self.site_of = {s.node: s for s in sites.values() if resolved.styles.get(s.path) in ("column", "row")}
        self.styles = resolved.styles
        self.analysis = resolved.analysis
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.converted: dict[tuple[fx.Node, str], fx.Node] = {}
        self.param_shards: dict[str, ShardSpec] = {}

    def layout(self, node: fx.Node) -> Layout:
        return self.analysis.layouts.get(node, REPLICATED)

    def make(self, op: str, target: Any, args: tuple = (), kwargs: dict | None = None, *, name: str,
             source: fx.Node | None, layout: Layout) -> fx.Node:  # fmt: skip
        new = self.graph.create_node(op, target, args, kwargs or {}, name=name)
        stamp(new, PASS, source)
        new.meta["dpcompile_layout"] = layout
        return new

    def numel(self, node: fx.Node) -> int | None:
        v = _val(node)
        return int(v.numel()) if isinstance(v, torch.Tensor) else None

    def comm(self, node: fx.Node, kind: str, backward: str | None, source: fx.Node) -> fx.Node:
        stamp_comm(node, kind, backward=backward)
        if (numel := self.numel(source)) is not None:
            node.meta["dpcompile_comm_numel"] = numel
        return node

    # -- conversions, each made once per value
    def convert(self, producer: fx.Node, kind: str, sizes: tuple[int, ...] | None = None) -> fx.Node:
        key = (producer, kind if sizes is None else f"{kind}{sizes}")
        if key in self.converted:
            return self.converted[key]
        if kind == "gather":
            layout = self.layout(producer)
            assert isinstance(layout, Sharded)
            new = self.make("call_function", collectives.gather_from_shards, (self.env[producer], layout.dim, list(layout.sizes)),
                            name=f"{producer.name}_all_gather", source=producer, layout=REPLICATED)  # fmt: skip
            new = self.comm(new, "all_gather", None, producer)
        elif kind == "copy":
            new = self.make("call_function", collectives.copy_to_shards, (self.env[producer],),
                            name=f"{producer.name}_copy", source=producer, layout=COPIED)  # fmt: skip
            new = self.comm(new, "identity", "all_reduce" if _may_need_grad(producer) else None, producer)
        elif kind == "gather_copy":
            gathered = self.convert(producer, "gather")
            new = self.make("call_function", collectives.copy_to_shards, (gathered,),
                            name=f"{producer.name}_copy", source=producer, layout=COPIED)  # fmt: skip
            new = self.comm(new, "identity", "all_reduce", producer)
        elif kind in ("split", "gather_split"):
            assert sizes is not None
            whole = self.convert(producer, "gather") if kind == "gather_split" else self.env[producer]
            new = self.make("call_function", collectives.split_to_shards, (whole, -1, list(sizes)),
                            name=f"{producer.name}_split", source=producer, layout=Sharded(-1, sizes))  # fmt: skip
            new = self.comm(new, "split", "all_gather", producer)
        else:  # pragma: no cover
            raise AssertionError(kind)
        self.converted[key] = new
        return new

    def arg_for(self, consumer: fx.Node, producer: fx.Node, sizes: tuple[int, ...] | None = None) -> fx.Node:
        kind = self.analysis.needs.get((consumer, producer))
        return self.env[producer] if kind is None else self.convert(producer, kind, sizes)

    def param(self, path: str, name: str, spec: ShardSpec | None, source: fx.Node) -> fx.Node:
        target = f"{path}.{name}" if path else name
        layout: Layout = REPLICATED if spec is None else Sharded(spec.dim - 2 if name == "weight" else -1, spec.sizes)
        new = self.make("get_attr", target, name=target.replace(".", "_"), source=source, layout=layout)
        if spec is not None:
            new.meta["dpcompile_shard"] = spec
            self.param_shards[target] = spec
        return new

    # -- the graph
    def build(self) -> fx.Graph:
        for node in self.gm.graph.nodes:
            if node in self.site_of:
                self.env[node] = self._linear(node, self.site_of[node])
            elif node.op == "output":
                self.graph.output(fx.node.map_arg(node.args[0], lambda a, out=node: self.arg_for(out, a)), type_expr=node.type)
            else:
                self.env[node] = self._copy(node)
        for node in list(self.graph.nodes):
            if node.op == "get_attr" and not node.users:
                self.graph.erase_node(node)
        return self.graph

    def _copy(self, node: fx.Node) -> fx.Node:
        args = fx.node.map_arg(node.args, lambda a: self.arg_for(node, a))
        kwargs = fx.node.map_arg(node.kwargs, lambda a: self.arg_for(node, a))
        layout = self.layout(node)
        if node in self.analysis.view_rewrites:
            position, sizes = self.analysis.view_rewrites[node]
            args = self._rewrite_shape(node, args, position, sizes)
        new = self.graph.create_node(node.op, node.target, args, kwargs, name=node.name, type_expr=node.type)
        new.meta = {k: v for k, v in node.meta.items() if not (k == "val" and isinstance(layout, Sharded))}
        new.meta["dpcompile_layout"] = layout
        if node in self.analysis.view_rewrites:
            stamp(new, PASS, node)
        return new

    def _rewrite_shape(self, node: fx.Node, args: tuple, position: int, sizes: tuple[int, ...]) -> tuple:
        size = self.make("call_function", collectives.local_size, (list(sizes),), name=f"{node.name}_size",
                         source=node, layout=NOT_TENSOR)  # fmt: skip
        first = 1
        if len(args) == first + 1 and isinstance(args[first], (list, tuple)):
            shape = list(args[first])
            shape[position] = size
            return (*args[:first], type(args[first])(shape))
        args = list(args)
        args[first + position] = size
        return tuple(args)

    def _linear(self, node: fx.Node, site: LinearSite) -> fx.Node:
        style = self.styles[site.path]
        if style == "column":
            sizes = self.analysis.column_sizes[site.path]
            x = self.arg_for(node, site.input)
            spec = ShardSpec(0, sizes)
            w = self.param(site.path, "weight", spec, node)
            args = (x, w, self.param(site.path, "bias", spec, node)) if site.bias else (x, w)
            return self.make("call_function", F.linear, args, name=node.name, source=node, layout=self.layout(node))
        sizes = self.analysis.row_sizes[site.path]
        x = self.arg_for(node, site.input, sizes)
        w = self.param(site.path, "weight", ShardSpec(1, sizes), node)
        partial = self.make("call_function", F.linear, (x, w), name=f"{node.name}_partial", source=node,
                            layout=Sharded(-1, (0,) * len(sizes)))  # fmt: skip
        reduced = self.make("call_function", collectives.reduce_from_shards, (partial,), name=f"{node.name}_all_reduce",
                            source=node, layout=REPLICATED)  # fmt: skip
        self.comm(reduced, "all_reduce", None, node)
        if not site.bias:
            return reduced
        bias = self.param(site.path, "bias", None, node)
        return self.make("call_function", operator.add, (reduced, bias), name=node.name, source=node, layout=REPLICATED)


# ---------------------------------------------------------------------- expanding
class LinearShards(nn.Module):
    """What replaces a sharded ``nn.Linear``: its shards (``weight_shard0``, ...) and any whole rest.

    ``specs`` maps each sharded parameter name (``"weight"``) to its :class:`ShardSpec`.
    """

    def __init__(self, linear: nn.Linear, specs: Mapping[str, ShardSpec], devices: Devices):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.specs = dict(specs)
        for name, p in linear.named_parameters(recurse=False):
            if name in self.specs:
                for k, shard in enumerate(_make_shards(p, self.specs[name], devices)):
                    self.register_parameter(f"{name}_shard{k}", shard)
            else:
                self.register_parameter(name, p)

    def extra_repr(self) -> str:
        specs = ", ".join(f"{name}: dim {s.dim} sizes {list(s.sizes)}" for name, s in self.specs.items())
        return f"in_features={self.in_features}, out_features={self.out_features}, {specs}"


def _make_shards(full: torch.Tensor, spec: ShardSpec, devices: Devices) -> list[nn.Parameter]:
    with torch.no_grad():
        return [
            nn.Parameter(tp_runtime.shard_of(full.detach(), spec, k).to(devices[k], copy=True), requires_grad=full.requires_grad)
            for k in range(len(devices))
        ]


def expand_shards(gm: fx.GraphModule, *, devices: Devices, output_device: torch.device | None = None) -> PassResult:
    """Lower a ``shard_linear`` program to one process driving ``devices`` (one shard each).

    Sharded values become one node per device (``fc1_dev1``), collectives become calls of
    :mod:`dpcompile.runtime.tensor_parallel`, replicated values are computed once on
    ``devices[0]``. The sharded parameters are cut from the full ones, put on their devices
    and each sharded ``nn.Linear`` of ``gm`` is replaced by a :class:`LinearShards`.
    ``info["param_shards"]`` maps each original parameter name to ``(spec, shard names)``.
    """
    specs = {n.target: n.meta["dpcompile_shard"] for n in gm.graph.nodes if n.op == "get_attr" and "dpcompile_shard" in n.meta}
    if not specs and not any(_is_collective(n) for n in gm.graph.nodes):
        return PassResult(gm, False, {"param_shards": {}})
    primary = devices.primary
    _move_whole_state(gm, primary, skip=set(specs))
    _materialize_shards(gm, specs, devices)
    builder = _Expander(gm, devices, output_device or primary)
    gm.graph = builder.build()
    param_shards = {t: (s, [f"{t}_shard{k}" for k in range(len(devices))]) for t, s in specs.items()}
    return PassResult(gm, True, {"param_shards": param_shards})


def _move_whole_state(gm: fx.GraphModule, device: torch.device, *, skip: set[str]) -> None:
    """Put every parameter and buffer not in ``skip`` on ``device`` (new tensors, not in place)."""
    for path, module in gm.named_modules():
        prefix = f"{path}." if path else ""
        for name, p in list(module._parameters.items()):
            if p is not None and p.device != device and prefix + name not in skip:
                with torch.no_grad():
                    module._parameters[name] = nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)


def _is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in collectives.COLLECTIVES or node.target is collectives.local_size)


def _materialize_shards(gm: fx.GraphModule, specs: Mapping[str, ShardSpec], devices: Devices) -> None:
    by_module: dict[str, dict[str, ShardSpec]] = {}
    for target, spec in specs.items():
        path, _, name = target.rpartition(".")
        by_module.setdefault(path, {})[name] = spec
    for path, module_specs in by_module.items():
        linear = gm.get_submodule(path)
        if path == "":  # the root is the Linear: shard its own parameters
            for name, spec in module_specs.items():
                full = gm._parameters.pop(name)
                for k, shard in enumerate(_make_shards(full, spec, devices)):
                    gm.register_parameter(f"{name}_shard{k}", shard)
            continue
        parent_path, _, child = path.rpartition(".")
        parent = gm.get_submodule(parent_path)
        setattr(parent, child, LinearShards(linear, module_specs, devices))


class _Expander:
    def __init__(self, gm: fx.GraphModule, devices: Devices, output_device: torch.device):
        self.gm = gm
        self.devices = devices
        self.n = len(devices)
        self.primary = str(devices.primary)
        self.output_device = str(output_device)
        self.graph = fx.Graph()
        self.whole: dict[fx.Node, Any] = {}
        self.per_device: dict[fx.Node, list[fx.Node]] = {}
        self.local_sizes: dict[fx.Node, list[int]] = {}

    def make(self, op: str, target: Any, args: tuple = (), kwargs: dict | None = None, *, name: str, source: fx.Node) -> fx.Node:
        new = self.graph.create_node(op, target, args, kwargs or {}, name=name)
        stamp(new, EXPAND, source)
        return new

    def comm(self, new: fx.Node, source: fx.Node) -> fx.Node:
        for key in ("dpcompile_comm", "dpcompile_comm_numel"):
            if key in source.meta:
                new.meta[key] = source.meta[key]
        return new

    def on_device(self, value: Any, k: int) -> Any:
        def pick(a: fx.Node) -> Any:
            if a in self.local_sizes:
                return self.local_sizes[a][k]
            if a in self.per_device:
                return self.per_device[a][k]
            return self.whole[a]

        return fx.node.map_arg(value, pick)

    def whole_of(self, value: Any) -> Any:
        def pick(a: fx.Node) -> Any:
            if a not in self.whole:
                raise AssertionError(f"'{a.name}' is per-shard where a whole value is needed")
            return self.whole[a]

        return fx.node.map_arg(value, pick)

    def split(self, new: fx.Node, source: fx.Node) -> list[fx.Node]:
        return [self.make("call_function", operator.getitem, (new, k), name=f"{source.name}_dev{k}", source=source) for k in range(self.n)]

    def build(self) -> fx.Graph:
        for node in self.gm_nodes():
            layout = node.meta.get("dpcompile_layout", REPLICATED)
            target = node.target
            if node.op == "placeholder":
                placeholder = self.graph.node_copy(node)
                if node.users:
                    moved = self.make("call_function", to_device, (placeholder, self.primary), name=f"{node.name}_on_device", source=node)
                    stamp_comm(moved, "broadcast", io=True)
                    self.whole[node] = moved
                else:
                    self.whole[node] = placeholder
            elif node.op == "output":
                out = self.whole_of(node.args[0])
                if self.output_device != self.primary:
                    out = stamp_comm(self.make("call_function", to_device, (out, self.output_device), name="output_moved", source=node), "gather", io=True)
                self.graph.output(out, type_expr=node.type)
            elif node.op == "get_attr" and "dpcompile_shard" in node.meta:
                self.per_device[node] = [
                    self.make("get_attr", f"{target}_shard{k}", name=f"{node.name}_shard{k}", source=node) for k in range(self.n)
                ]
            elif target is collectives.local_size:
                self.local_sizes[node] = list(node.args[0])
            elif target is collectives.copy_to_shards:
                new = self.make("call_function", tp_runtime.copy_to_devices, (self.whole_of(node.args[0]), self.devices.strings()), name=node.name, source=node)
                self.per_device[node] = self.split(self.comm(new, node), node)
            elif target is collectives.split_to_shards:
                x, dim, sizes = node.args[:3]
                new = self.make("call_function", tp_runtime.split_to_devices, (self.whole_of(x), dim, list(sizes), self.devices.strings()), name=node.name, source=node)
                self.per_device[node] = self.split(self.comm(new, node), node)
            elif target is collectives.reduce_from_shards:
                new = self.make("call_function", tp_runtime.reduce_to_device, (list(self.per_device[node.args[0]]), self.primary), name=node.name, source=node)
                self.whole[node] = self.comm(new, node)
            elif target is collectives.gather_from_shards:
                x, dim = node.args[:2]
                new = self.make("call_function", tp_runtime.gather_to_device, (list(self.per_device[x]), dim, self.primary), name=node.name, source=node)
                self.whole[node] = self.comm(new, node)
            elif isinstance(layout, (Sharded, Copied)):
                self.per_device[node] = [
                    self.make(node.op, target, self.on_device(node.args, k), self.on_device(node.kwargs, k), name=f"{node.name}_dev{k}", source=node)
                    for k in range(self.n)
                ]
            elif any(a in self.per_device for a in _flat_nodes((node.args, node.kwargs))):
                self.whole[node] = self.make(node.op, target, self.on_device(node.args, 0), self.on_device(node.kwargs, 0), name=node.name, source=node)
            else:
                new = self.graph.create_node(node.op, target, self.whole_of(node.args), self.whole_of(node.kwargs), name=node.name, type_expr=node.type)
                new.meta = dict(node.meta)
                self.whole[node] = new
        for new in self.graph.nodes:  # fake tensors of the captured shapes: stale here, and unpicklable
            new.meta.pop("val", None)
            new.meta.pop("tensor_meta", None)
        return self.graph

    def gm_nodes(self) -> Iterable[fx.Node]:
        return list(self.gm.graph.nodes)
