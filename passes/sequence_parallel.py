"""``shard_sequence``: sequence parallelism on the tensor-parallel dimension (Megatron-LM's).

Between the tensor-parallel pairs (a row layer's output, through norms, dropout and the residual
adds, to the next column layer's input) ``shard_linear``'s program holds whole, replicated
activations. This pass, run on that one-shard program, splits them on the sequence (dim 1 of
batch-first ``(batch, seq, ...)`` values) instead: the row layer's all-reduce becomes a
reduce-scatter, the next column layer's copy an all-gather, and every op between runs on this
shard's tokens. The finder (:func:`find_sequence_region`) reads the batch rule table on the
sequence dim (the same rules context and data parallelism read): an op joins the region when its
rule splits its output on the sequence as its inputs are split, so what mixes positions (attention
by heads, a shift of the labels, a reshape) stays where it was.

Before (one shard's program of a post-norm block, ``{"fc1": "column", "fc2": "row"}``)::

    def forward(self, x):
        x_copy = dpcompile_runtime_collectives_copy_to_shards(x)
        fc1 = torch._C._nn.linear(x_copy, fc1_weight, fc1_bias)
        relu = torch.relu(fc1)
        fc2_partial = torch._C._nn.linear(relu, fc2_weight)
        fc2_all_reduce = dpcompile_runtime_collectives_reduce_from_shards(fc2_partial)
        fc2 = add_bias(fc2_all_reduce, fc2_bias)
        add = fc2 + x
        norm = self.norm(add)
        return norm

After ``shard_sequence``::

    def forward(self, x):
        x_all_gather = ... (x split on the sequence first where it feeds the region)
        fc2_reduce_scatter = dpcompile_runtime_collectives_reduce_scatter_to_shards(fc2_partial, 1, [4, 4])
        fc2_bias_copy = dpcompile_runtime_collectives_copy_to_shards(fc2_bias)
        fc2 = add_bias(fc2_reduce_scatter, fc2_bias_copy)          # this shard's tokens
        x_split = dpcompile_runtime_collectives_split_to_shards(x, 1, [4, 4])
        add = fc2 + x_split
        norm = self.norm(add)
        norm_all_gather = dpcompile_runtime_collectives_gather_from_shards(norm, 1, [4, 4])
        return norm_all_gather
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from dpcompile.analysis.batch_dims import decide
from dpcompile.analysis.batch_rules.context import node_shape
from dpcompile.analysis.placement import REPLICATED, Placement, Split
from dpcompile.analysis.sharding import COPIED, Sharded
from dpcompile.analysis.sharding import REPLICATED as WHOLE
from dpcompile.devices import Devices
from dpcompile.infra import PassResult, stamp, stamp_comm
from dpcompile.runtime import collectives
from dpcompile.runtime import tensor_parallel as tp_runtime
from passes.expand_shards import is_shard_collective

PASS = "shard_sequence"
SEQ = 1  # batch-first values: (batch, seq, ...)
SEQUENCE_MARK = "dpcompile_sequence"  # on the values this pass put on sequence shards (explain counts them)


@dataclass
class SequenceRegion:
    """What runs on sequence shards: the region's nodes, the all-reduces that become
    reduce-scatters (``seeds``), the sequence length and each shard's tokens."""

    length: int
    sizes: tuple[int, ...]
    nodes: list[fx.Node] = field(default_factory=list)
    seeds: list[fx.Node] = field(default_factory=list)
    sliced: dict[fx.Node, dict[fx.Node, int]] = field(default_factory=dict)  # replicated operands sliced, on which dim


def balanced_sizes(length: int, n: int) -> tuple[int, ...]:
    """``tensor_split``'s sizes: ``13`` over 4 shards is ``(4, 3, 3, 3)``."""
    return tuple(length // n + (1 if k < length % n else 0) for k in range(n))


def _seq_length(node: fx.Node) -> int | None:
    shape = node_shape(node)
    if shape is None or len(shape) < 3 or not all(isinstance(s, int) for s in shape):
        return None
    return int(shape[SEQ])


def _whole(node: fx.Node) -> bool:
    return node.meta.get("dpcompile_layout", WHOLE) == WHOLE


def _sequence_dims(node: fx.Node, out_ndim: int, length: int) -> list[int]:
    """The dims of a replicated input ``node`` that may hold the output's sequence: dim 1 of a
    batch-first ``(batch, seq, ...)`` value, or the dim broadcasting lines up with it."""
    shape = node_shape(node)
    if shape is None:
        return []
    dims = [SEQ] if len(shape) >= 2 and shape[SEQ] == length else []
    at = SEQ - (out_ndim - len(shape))
    if len(shape) < out_ndim and 0 <= at < len(shape) and shape[at] == length and at not in dims:
        dims.append(at)
    return dims


def _constants(node: fx.Node) -> list[Any]:
    out: list[Any] = []

    def walk(v: Any) -> None:
        if isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, int) and not isinstance(v, bool):
            out.append(v)

    walk((node.args, node.kwargs))
    return out


def _runs_on_shards(node: fx.Node, inputs: dict[fx.Node, Placement], modules: dict[str, Any], length: int) -> bool:
    """True when ``node`` run on each shard's tokens gives that shard's tokens of its output: its
    batch rule splits it on the sequence as its inputs are, and it names no sequence size."""
    if node.op not in ("call_function", "call_method", "call_module") or is_shard_collective(node) or not _whole(node):
        return False
    if _seq_length(node) != length or length in _constants(node) or node.target is operator.getitem:
        return False
    module = modules.get(node.target) if node.op == "call_module" else None
    try:
        placement = decide(node, inputs, module)
    except Exception:  # a rule's own check refused: not position-wise here
        return False
    return type(placement) is Split and placement.dim == SEQ


def find_sequence_region(gm: fx.GraphModule, *, n: int) -> SequenceRegion | None:
    """The values of ``shard_linear``'s program that can run on sequence shards, or None.

    Seeds are the row layers' all-reduces of ``(batch, seq, ...)`` values; the region grows forward
    from them, and backward from them and the column layers' inputs (the embeddings and the first
    norm), through ops whose batch rule splits the sequence; a replicated ``(batch, seq, ...)``
    operand there is sliced (no communication), a parameter copied.
    """
    seeds = [nd for nd in gm.graph.nodes if nd.op == "call_function" and nd.target is collectives.reduce_from_shards]
    lengths = {_seq_length(s) for s in seeds} - {None}
    if len(lengths) != 1:
        return None
    length = lengths.pop()
    seeds = [s for s in seeds if _seq_length(s) == length]
    modules = dict(gm.named_modules())
    candidates: dict[fx.Node, dict[fx.Node, int]] = {s: {} for s in seeds}  # node -> {replicated input: dim to slice}
    for node in gm.graph.nodes:
        if node in candidates or _seq_length(node) != length:
            continue
        out_ndim = len(node_shape(node) or ())
        view: dict[fx.Node, Placement] = {a: Split(SEQ) if a in candidates else REPLICATED for a in node.all_input_nodes}
        options = {a: _sequence_dims(a, out_ndim, length) for a in node.all_input_nodes if a not in candidates and _whole(a)}
        for pick in (0, -1):  # each replicated operand on its batch-first dim, or on the dim broadcasting lines up
            sliced = {a: dims[pick] for a, dims in options.items() if dims}
            trial = {**view, **{a: Split(d) for a, d in sliced.items()}}
            if any(isinstance(p, Split) for p in trial.values()) and _runs_on_shards(node, trial, modules, length):
                candidates[node] = sliced
                break
    region = _connected(gm, set(candidates), seeds)
    if not any(s in region for s in seeds):
        return None
    order = {nd: k for k, nd in enumerate(gm.graph.nodes)}
    return SequenceRegion(length, balanced_sizes(length, n), sorted(region, key=order.__getitem__),
                          [s for s in seeds if s in region], {nd: candidates[nd] for nd in region})  # fmt: skip


def _connected(gm: fx.GraphModule, candidates: set[fx.Node], seeds: list[fx.Node]) -> set[fx.Node]:
    """The candidates fed by a seed, and those whose value flows into the region or a column layer's
    copy (through candidates); a seed whose every user is outside stays an all-reduce."""
    forward: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node in candidates and (node in seeds or any(a in forward for a in node.all_input_nodes)):
            forward.add(node)
    region = set(forward)
    for node in reversed(list(gm.graph.nodes)):
        if node in candidates and node not in region and any(
            u in region or (u.op == "call_function" and u.target is collectives.copy_to_shards) for u in node.users
        ):
            region.add(node)
    for seed in seeds:
        if not any(u in region for u in seed.users):
            region.discard(seed)
    return region


def shard_sequence(gm: fx.GraphModule, *, devices: Devices) -> PassResult:
    """Run the activations between tensor-parallel pairs on sequence shards (see the module).

    ``info``: ``length`` and ``sizes`` of the sequence split, ``region`` (the nodes on shards),
    ``reduce_scatters`` (the row layers' all-reduces made reduce-scatters), ``all_gathers``, and
    ``all_reduces`` (those left all-reduces, and why: :func:`kept_all_reduces`), ``reduce_scattered``
    (the module paths of the reduce-scatters)."""
    region = find_sequence_region(gm, n=len(devices)) if len(devices) > 1 else None
    all_reduced = kept_all_reduces(gm, region) if len(devices) > 1 else {}
    if region is None:
        return PassResult(gm, False, {"region": [], "reduce_scatters": [], "all_gathers": [], "all_reduces": all_reduced})
    rewriter = _Rewriter(gm, region)
    rewriter.rewrite()
    info = {
        "length": region.length,
        "sizes": list(region.sizes),
        "region": [nd.name for nd in region.nodes],
        "reduce_scatters": [nd.name for nd in rewriter.reduce_scatters],
        "all_gathers": [nd.name for nd in rewriter.all_gathers],
        "all_reduces": all_reduced,
        "reduce_scattered": [nd.meta.get("dpcompile_module") or nd.name for nd in rewriter.reduce_scatters],
    }
    return PassResult(gm, True, info)


def kept_all_reduces(gm: fx.GraphModule, region: SequenceRegion | None) -> dict[str, str]:
    """``{module path (or node name): why}`` for each all-reduce the region leaves as it is: there
    the program is tensor parallel alone (a classifier on the CLS token: its output has no sequence)."""
    seeds = [nd for nd in gm.graph.nodes if nd.op == "call_function" and nd.target is collectives.reduce_from_shards]
    lengths = sorted({_seq_length(s) for s in seeds} - {None})
    kept: dict[str, str] = {}
    for node in seeds:
        if region is not None and node in region.seeds:
            continue
        length = _seq_length(node)
        if length is None:
            shape = node_shape(node)
            why = f"its output {tuple(shape) if shape is not None else ''} has no sequence dim (dim 1 of (batch, seq, ...))"
        elif region is None and len(lengths) > 1:
            why = f"the row layers' outputs differ on dim 1 ({', '.join(map(str, lengths))}): no one sequence to split"
        elif region is not None and length != region.length:
            why = f"its output's dim 1 ({length}) is not the sequence ({region.length})"
        else:
            why = "no op after it runs on each token alone before the values are needed whole"
        kept[node.meta.get("dpcompile_module") or node.name] = why
    return kept


def _column_call(node: fx.Node, gathered: fx.Node) -> bool:
    """``node`` is a sharded layer's call on ``gathered`` (``F.linear`` or a Conv1D's ``linear_in_out``)."""
    return (node.op == "call_function" and node.target in (torch.nn.functional.linear, tp_runtime.linear_in_out)
            and node.args[:1] == (gathered,) and gathered not in node.args[1:])  # fmt: skip


class _Rewriter:
    """Rewrites the region in place: seeds, the region's operands, and its exits."""

    def __init__(self, gm: fx.GraphModule, region: SequenceRegion):
        self.gm, self.region = gm, region
        self.inside = set(region.nodes)
        self.sizes = list(region.sizes)
        self.splits: dict[fx.Node, fx.Node] = {}
        self.copies: dict[fx.Node, fx.Node] = {}
        self.gathers: dict[fx.Node, fx.Node] = {}
        self.reduce_scatters: list[fx.Node] = []
        self.all_gathers: list[fx.Node] = []

    def layout(self, node: fx.Node) -> Sharded:
        ndim = len(node_shape(node) or (0, 0, 0))
        return Sharded(SEQ - ndim, self.region.sizes)  # counted from the end, as every Sharded dim

    def rewrite(self) -> None:
        for node in self.region.nodes:
            layout = self.layout(node)
            if node in self.region.seeds:
                node.target = collectives.reduce_scatter_to_shards
                node.args = (node.args[0], SEQ, self.sizes)
                node.name = node.name.replace("_all_reduce", "") + "_reduce_scatter"
                stamp(node, PASS, node)
                stamp_comm(node, "reduce_scatter", backward="all_gather")
                self.reduce_scatters.append(node)
            else:
                self._operands(node)
            node.meta["dpcompile_layout"] = layout
            node.meta[SEQUENCE_MARK] = True
        for node in self.region.nodes:
            self._exits(node)
        for gathered in [g for g in self.all_gathers if g.target is collectives.all_gather_to_shards]:
            self._save_slices(gathered)

    def _save_slices(self, gathered: fx.Node) -> None:
        """The column layers reading an all-gathered input keep this shard's slice for backward, not the
        whole (``linear_of_gathered``), where every user is one."""
        users = list(gathered.users)
        if not users or not all(_column_call(u, gathered) for u in users):
            return
        x = gathered.args[0]
        for user in users:
            weight = user.args[1] if len(user.args) > 1 else user.kwargs["weight"]
            bias = user.args[2] if len(user.args) > 2 else user.kwargs.get("bias")
            transposed = user.target is tp_runtime.linear_in_out
            user.target = collectives.linear_of_gathered
            user.args, user.kwargs = (gathered, x, weight, bias, SEQ, self.sizes, transposed), {}
            stamp(user, PASS, user)

    def _operands(self, node: fx.Node) -> None:
        sliced = self.region.sliced.get(node, {})
        for a in list(node.all_input_nodes):
            if a in self.inside:
                continue
            if a in sliced:
                node.replace_input_with(a, self._split(a, sliced[a]))
            elif isinstance(a.meta.get("val"), torch.Tensor) or a.op == "get_attr":
                node.replace_input_with(a, self._copy(a))

    def _split(self, a: fx.Node, dim: int) -> fx.Node:
        if a not in self.splits:
            with self.gm.graph.inserting_after(a):
                new = self.gm.graph.call_function(collectives.split_to_shards, (a, dim, self.sizes))
            new.name = f"{a.name}_split_sequence"
            stamp_comm(stamp(new, PASS, a), "split", backward="all_gather")
            new.meta["dpcompile_layout"] = Sharded(dim - len(node_shape(a) or ()), self.region.sizes)
            new.meta["dpcompile_sequence_split"] = True  # lowered with the call's own sequence length
            self.splits[a] = new
        return self.splits[a]

    def _copy(self, a: fx.Node) -> fx.Node:
        if a not in self.copies:
            with self.gm.graph.inserting_after(a):
                new = self.gm.graph.call_function(collectives.copy_to_shards, (a,))
            new.name = f"{a.name}_copy"
            stamp_comm(stamp(new, PASS, a), "identity", backward="all_reduce")
            new.meta["dpcompile_layout"] = COPIED
            self.copies[a] = new
        return self.copies[a]

    def _exits(self, node: fx.Node) -> None:
        for user in list(node.users):
            if user in self.inside:
                continue
            if user.op == "call_function" and user.target is collectives.copy_to_shards:
                user.target = collectives.all_gather_to_shards
                user.args = (node, SEQ, self.sizes)
                user.name = f"{node.name}_all_gather"
                stamp(user, PASS, node)
                stamp_comm(user, "all_gather", backward="reduce_scatter")
                self.all_gathers.append(user)
                continue
            if self._reads_shape(node, user):
                continue
            user.replace_input_with(node, self._gather(node))

    def _reads_shape(self, node: fx.Node, user: fx.Node) -> bool:
        """``node.shape`` / ``node.size(i)`` becomes the whole tensor's, read without gathering it."""
        if user.op == "call_function" and user.target is getattr and user.args[1:] == ("shape",):
            index = None
        elif user.op == "call_method" and user.target == "size" and len(user.args) <= 2 and not user.kwargs:
            index = user.args[1] if len(user.args) == 2 else None
        else:
            return False
        user.op, user.target = "call_function", collectives.whole_size
        user.args = (node, SEQ, self.sizes, index)
        stamp(user, PASS, node)
        return True

    def _gather(self, node: fx.Node) -> fx.Node:
        if node not in self.gathers:
            with self.gm.graph.inserting_after(node):
                new = self.gm.graph.call_function(collectives.gather_from_shards, (node, SEQ, self.sizes))
            new.name = f"{node.name}_gather_sequence"
            stamp_comm(stamp(new, PASS, node), "all_gather")
            new.meta["dpcompile_layout"] = WHOLE
            if "val" in node.meta:
                new.meta["val"] = node.meta["val"]
            self.gathers[node] = new
            self.all_gathers.append(new)
        return self.gathers[node]


__all__ = ["PASS", "SEQUENCE_MARK", "SequenceRegion", "balanced_sizes", "find_sequence_region", "kept_all_reduces",
           "shard_sequence"]
