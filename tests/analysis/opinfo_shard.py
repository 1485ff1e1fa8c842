"""Run PyTorch's OpInfo samples sharded by the tensor-parallel sharding rules, as
``opinfo_split`` runs them split by the batch rules: each sample becomes a one-op fx graph (the
op's torch function, or its Tensor method where the function is a lambda or has no rule), its
first tensor is marked :class:`~dpcompile.analysis.sharding_layout.Sharded` along a feature dim
(the last, and -2 / -3 where they exist) in uneven pieces over 2 and 3 shards, and the sharding
rules (``apply_rule``, with the analysis' own context) give the result's layout. Unless the rule
says ``NeedsWhole``, the op runs on each shard as the ``shard_linear`` pass would run it
(replicated operands whole, a view's rewritten extent, a sliced per-head bias, the vocab-parallel
loss), and the shards, joined by the result's layout, must equal the op run whole.

    PYTHONPATH=. python -m tests.analysis.opinfo_shard [--all] [--max=N] [--ops=a,b] [--write]

Each sample runs twice where it has other tensors of the first one's extent on the sharded dim:
with them replicated, and sharded alike (``co``). ``--write`` (or ``--all``) writes the tally to
``benchmarks/results/opinfo_shard.json`` (read by ``docs/sharding_rules_coverage.md``'s generator).
Exits 1 where a sharded run differed from the op (a rule bug). An op no sharding rule names is
answered by its batch rule (``apply_rule`` asks ``sharding_batch.from_batch_rule``): such runs count
as :data:`BY_BATCH_RULE`.
"""

from __future__ import annotations

import collections
import json
import operator
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpcompile.analysis import sharding_rules
from dpcompile.analysis.placement import Replicated
from dpcompile.analysis.sharding import _Analyzer
from dpcompile.analysis.sharding_layout import Copied, NeedsWhole, NotTensor, Sharded
from dpcompile.analysis.sharding_rules import apply_rule, names_a_sharding_rule
from dpcompile.runtime import tensor_parallel as tp_runtime
from tests.analysis.opinfo_split import _PRINTABLE, SKIP_OPS, _generated, _Recorder, selected_ops

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "opinfo_shard.json"
DIMS = (-1, -2, -3)
BY_BATCH_RULE = "sharded (batch rule)"  # an op no sharding rule names, sharded by its batch rule
SHARDS = (2, 3)


@dataclass
class Tally:
    """Runs (sample x sharded dim x shards x variant): sharded and equal, whole (``NeedsWhole``), skipped, failed."""

    sharded: int = 0
    whole: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)
    failed: list[str] = field(default_factory=list)
    # {op: {"sharded": n, "by_batch_rule": n of them, "whole": {reason: n}}}
    by_op: dict[str, dict[str, Any]] = field(default_factory=dict)

    def count(self, op: str, outcome: str) -> None:
        entry = self.by_op.setdefault(op, {"sharded": 0, "by_batch_rule": 0, "whole": {}})
        if outcome.startswith("sharded"):
            self.sharded += 1
            entry["sharded"] += 1
            entry["by_batch_rule"] += outcome == BY_BATCH_RULE
        elif outcome.startswith("whole: "):
            self.whole += 1
            reason = outcome.removeprefix("whole: ")
            entry["whole"][reason] = entry["whole"].get(reason, 0) + 1
        else:
            self.skipped[outcome] += 1

    def line(self) -> str:
        ruled = sum(1 for e in self.by_op.values() if e["sharded"])
        return (
            f"{len(self.by_op)} ops ({ruled} sharded on some sample), "
            f"{self.sharded + self.whole + sum(self.skipped.values()) + len(self.failed)} runs: "
            f"{self.sharded} sharded and equal, {self.whole} whole (NeedsWhole), "
            f"{sum(self.skipped.values())} skipped, {len(self.failed)} failed"
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "runs": self.sharded + self.whole + sum(self.skipped.values()) + len(self.failed),
            "sharded": self.sharded,
            "whole": self.whole,
            "skipped": dict(self.skipped.most_common()),
            "failed": self.failed,
            "by_op": {op: e for op, e in sorted(self.by_op.items()) if e["sharded"] or e["whole"]},
        }


# ---------------------------------------------------------------------- the one-op graph
# OpInfo ops whose ``op`` is a lambda around a torch function the rules know: the function, and
# where the lambda reorders its arguments, how (``where(self, cond, other)`` is ``torch.where(cond, self, other)``)
_LAMBDAS: dict[str, tuple[Any, Any]] = {
    "where": (torch.where, lambda x, args: (args[0], x, *args[1:])),
    "nn.functional.scaled_dot_product_attention": (F.scaled_dot_product_attention, None),
}


def _known(kind: str, target: Any) -> bool:
    """Whether a sharding rule's op family names ``target`` (so a second spelling is worth a run)."""
    families = [family for family, _ in sharding_rules.RULES]
    if kind == "call_method":
        return any(target in family.methods for family in families)
    return target is F.cross_entropy or any(target in family.functions for family in families)


def spellings(op: Any) -> list[tuple[str, Any, Any]]:
    """How a graph calls ``op``: ``("call_function", fn, reorder)`` for a named torch function, and
    ``("call_method", name, None)`` for its Tensor method where the function is a lambda or only the
    method has a rule (``torch.pow`` / ``x.pow``)."""
    if op.name in _LAMBDAS:
        return [("call_function", *_LAMBDAS[op.name])]
    if op.name == "__getitem__":
        return [("call_function", operator.getitem, None)]
    out: list[tuple[str, Any, Any]] = []
    fn = op.op
    if callable(fn) and getattr(fn, "__name__", "<lambda>") != "<lambda>":
        out.append(("call_function", fn, None))
    method = getattr(op.method_variant, "__name__", None)
    if method and (not out or (_known("call_method", method) and not _known("call_function", fn))):
        out.append(("call_method", method, None))
    return out


def _graph(
    kind: str, target: Any, sample: Any, reorder: Any = None
) -> tuple[fx.GraphModule, list[torch.Tensor]] | None:
    """``target(input, *args, **kwargs)`` with every tensor a placeholder, ``x`` the first (of a
    list input too: ``cat``'s tensors)."""
    leaves, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
    if any(not isinstance(leaf, _PRINTABLE) for leaf in leaves):
        return None
    graph = fx.Graph()
    inputs: list[torch.Tensor] = []
    nodes: list[Any] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            nodes.append(graph.placeholder("x" if not inputs else f"t{i}"))
            inputs.append(leaf)
        else:
            nodes.append(leaf)
    head, args, kwargs = tree_unflatten(nodes, spec)
    call_args = reorder(head, tuple(args)) if reorder else (head, *args)
    graph.output(graph.create_node(kind, target, call_args, kwargs))
    return fx.GraphModule(torch.nn.Module(), graph), inputs


def _read_by_parts(gm: fx.GraphModule) -> None:
    """A tuple result read a part at a time, as models read one (``q, k, v = qkv.split(..)``): the
    rules shard a tuple only so, its shards' tuples joined by no collective."""
    node = next(n for n in gm.graph.nodes if n.op not in ("placeholder", "output"))
    values, output = node.meta["val"], next(iter(node.users))
    if not isinstance(values, (list, tuple)) or output.op != "output":
        return
    with gm.graph.inserting_before(output):
        parts = [gm.graph.call_function(operator.getitem, (node, i)) for i in range(len(values))]
    for part, value in zip(parts, values):
        part.meta["val"] = value
    output.args = (tuple(parts),)
    gm.recompile()


def first_tensor(sample: Any) -> torch.Tensor | None:
    """The sample's first tensor (the input, or the first of a list input) where it is float, not a scalar."""
    x = next((t for t in tree_flatten(sample.input)[0] if isinstance(t, torch.Tensor)), None)
    return x if x is not None and x.is_floating_point() and x.dim() >= 1 else None


def uneven(extent: int, n: int) -> tuple[int, ...]:
    """``extent`` in ``n`` pieces, unequal where it can be (``7, 2 -> (4, 3)``, ``6, 2 -> (4, 2)``)."""
    base, rest = divmod(extent, n)
    sizes = [base + (1 if i < rest else 0) for i in range(n)]
    if rest == 0 and base >= 2:
        sizes[0], sizes[-1] = sizes[0] + 1, sizes[-1] - 1
    return tuple(sizes)


def _pieces(t: torch.Tensor, dim: int, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    return list(torch.split(t, list(sizes), dim))


# ---------------------------------------------------------------------- one run
def run_sharded(gm: fx.GraphModule, inputs: list[torch.Tensor], dim: int, n: int, *, co: bool) -> str:
    """``"sharded"`` where the shards, joined, equal the op (:data:`BY_BATCH_RULE` where its batch
    rule said so); ``"whole: reason"``; raises on a mismatch.

    ``x`` is sharded along ``dim`` (from the end) in :func:`uneven` pieces; with ``co`` every other
    tensor of ``x``'s rank and extent on ``dim`` is sharded alike, the rest are replicated."""
    placeholders = [p for p in gm.graph.nodes if p.op == "placeholder"]
    node = next(p for p in gm.graph.nodes if p.op not in ("placeholder", "output"))
    x = inputs[0]
    sizes = uneven(x.size(dim), n)
    ctx = _Analyzer(gm, {}, {}, n, {})
    sharded = {placeholders[0]}
    if co:
        sharded |= {
            p for p, t in zip(placeholders[1:], inputs[1:]) if t.dim() == x.dim() and t.size(dim) == x.size(dim)
        }
    for p in placeholders:
        ctx.result.layouts[p] = Sharded(dim, sizes) if p in sharded else ctx._plain_layout(p)
    try:
        layout, _copies = apply_rule(ctx, node, ctx.modules)
    except NeedsWhole as whole:
        return f"whole: {whole.reason}"
    analysis = ctx.result
    expected = node.meta["val"]
    outs = []
    for i in range(n):
        env = {}
        for p, t in zip(placeholders, inputs):
            split = analysis.arg_splits.get((node, p))
            if p in sharded:
                env[p] = _pieces(t, dim, sizes)[i]
            elif split is not None:
                env[p] = _pieces(t, split[0], split[1])[i]
            else:
                env[p] = t
        if node in analysis.vocab_losses:
            outs.append(("vocab", env))
            continue
        args = fx.node.map_arg(node.args, lambda a, env=env: env[a])
        kwargs = fx.node.map_arg(node.kwargs, lambda a, env=env: env[a])
        if node in analysis.view_rewrites:
            position, local = analysis.view_rewrites[node]
            args = _rewrite_shape(args, position, local[i])
        if node.op == "call_method":
            outs.append(getattr(args[0], node.target)(*args[1:], **kwargs))
        else:
            outs.append(node.target(*args, **kwargs))
    if node in analysis.vocab_losses:
        got = _vocab_loss(node, [env for _, env in outs], sizes)
        torch.testing.assert_close(got, expected, equal_nan=True, atol=1e-5, rtol=1e-5)
        return "sharded"
    _check_join(outs, expected, layout, node in analysis.tuples)
    return "sharded" if names_a_sharding_rule(node, ctx.modules) or node.target is F.cross_entropy else BY_BATCH_RULE


def _rewrite_shape(args: tuple, position: int, size: int) -> tuple:
    """The view's shape with this shard's extent at ``position``, as ``shard_linear`` rewrites it."""
    if len(args) == 2 and isinstance(args[1], (list, tuple)):
        shape = list(args[1])
        shape[position] = size
        return (args[0], type(args[1])(shape))
    args = list(args)
    args[1 + position] = size
    return tuple(args)


def _vocab_loss(node: fx.Node, envs: list[dict], sizes: tuple[int, ...]) -> torch.Tensor:
    """The vocab-parallel loss ``shard_linear`` builds: per-shard logsumexp gathered, target logits summed."""
    from dpcompile.analysis.sharding_rules import cross_entropy_options

    logits_node, target_node = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs["target"]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    lse = torch.cat([tp_runtime.shard_logsumexp(env[logits_node]) for env in envs], -1)
    picked = sum(tp_runtime.shard_target_logit(env[logits_node], env[target_node], o) for env, o in zip(envs, offsets))
    return tp_runtime.cross_entropy_from_parts(lse, picked, envs[0][target_node], **cross_entropy_options(node))


def _check_join(outs: list[Any], expected: Any, layout: Any, is_tuple: bool) -> None:
    if is_tuple or (isinstance(expected, (list, tuple)) and isinstance(layout, Sharded)):
        assert isinstance(expected, (list, tuple)) and all(len(o) == len(expected) for o in outs), (
            "a tuple of another length"
        )
        for j, part in enumerate(expected):
            _check_join([o[j] for o in outs], part, layout, False)
        return
    if isinstance(layout, Sharded):
        got_sizes = tuple(o.size(layout.dim) for o in outs)
        assert got_sizes == layout.sizes, (
            f"the rule says shards of {layout.sizes} on dim {layout.dim}, they hold {got_sizes}"
        )
        joined = torch.cat(outs, layout.dim)
        torch.testing.assert_close(joined, expected, equal_nan=True, check_stride=False, atol=1e-5, rtol=1.3e-6)
        return
    assert isinstance(layout, (Replicated, Copied, NotTensor)), layout
    for o in outs:  # the same whole value on every shard
        if isinstance(expected, torch.Tensor):
            torch.testing.assert_close(o, expected, equal_nan=True, check_stride=False, atol=1e-5, rtol=1.3e-6)
        else:
            assert o == expected, f"shard gives {o!r}, whole {expected!r}"


# ---------------------------------------------------------------------- the sweep
def run_sample(kind: str, target: Any, sample: Any, reorder: Any = None) -> Iterator[tuple[str, str]]:
    """``(label, outcome)`` for each sharded dim x shards x variant of one sample; a mismatch raises
    ``AssertionError`` naming the run (label ``dim=-1 n=2 co``)."""
    x = first_tensor(sample)
    if x is None:
        yield "", "skip: no float input"
        return
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            built = _graph(kind, target, sample, reorder)
            if built is None:
                yield "", "skip: an argument generated code cannot spell"
                return
            gm, inputs = built
            if inputs[0] is not x:
                yield "", "skip: no float input"
                return
            _Recorder(gm).run(*inputs)
            first = next(n for n in gm.graph.nodes if n.op not in ("placeholder", "output")).meta["val"]
            torch.manual_seed(0)
            again = _Recorder(gm).run(*inputs)
            torch.manual_seed(1)
            other_seed = _Recorder(gm).run(*inputs)
        torch.testing.assert_close(again, first, equal_nan=True, atol=0, rtol=0)
    except Exception:  # noqa: BLE001 - the op refuses the sample or is not deterministic
        yield "", "skip: the op is not deterministic or not callable on the sample"
        return
    try:
        torch.testing.assert_close(other_seed, first, equal_nan=True, atol=0, rtol=0)
    except AssertionError:  # dropout_p > 0: each shard draws its own, not the whole's (exact_random's job)
        yield "", "skip: a random draw (another seed, another value)"
        return
    _read_by_parts(gm)
    for dim in DIMS:
        if x.dim() < -dim:
            continue
        for n in SHARDS:
            if x.size(dim) < n:
                continue
            others = [t for t in inputs[1:] if t.dim() == x.dim() and t.size(dim) == x.size(dim)]
            for co in (False, True) if others else (False,):
                label = f"dim={dim} n={n}{' co' if co else ''}"
                try:
                    yield label, run_sharded(gm, inputs, dim, n, co=co)
                except Exception as e:  # noqa: BLE001 - a rule that crashes or is wrong: a bug, by its run
                    raise AssertionError(
                        f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    ) from e


def opinfo_ops(ops: set[str] | None) -> Iterator[tuple[str, Any]]:
    from torch.testing._internal.common_methods_invocations import op_db

    for op in op_db:
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        if op.name in SKIP_OPS or not op.supports_dtype(torch.float32, "cpu") or (ops is not None and name not in ops):
            continue
        yield name, op


def sweep(max_per_op: int | None, ops: set[str] | None = None) -> Tally:
    tally = Tally()
    for name, op in opinfo_ops(ops):
        forms = spellings(op)
        if not forms:
            tally.skipped["skip: a lambda with no Tensor method"] += 1
            continue
        taken = 0
        for sample in _generated(op):
            if max_per_op is not None and taken >= max_per_op:
                break
            if first_tensor(sample) is None:
                continue
            taken += 1
            for kind, target, reorder in forms:
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        for _, outcome in run_sample(kind, target, sample, reorder):
                            tally.count(name, outcome)
                except AssertionError as e:
                    tally.failed.append(f"{name} ({kind}) {e}")
    return tally


def main(argv: list[str]) -> Tally:
    start = time.time()
    limit = None if "--all" in argv else next((int(a.split("=")[1]) for a in argv if a.startswith("--max=")), 2)
    selected = selected_ops(argv)
    t = sweep(limit, selected)
    print(t.line())
    for op, e in sorted(t.by_op.items()):
        if e["sharded"] or e["whole"]:
            whole = "; ".join(f"{r} ({c})" for r, c in sorted(e["whole"].items()))
            print(f"  {op:40s} sharded {e['sharded']:4d}   whole {sum(e['whole'].values()):4d}  {whole[:150]}")
    for reason, count in t.skipped.most_common():
        print(f"  {count:5d} {reason}")
    for failure in t.failed:
        print("  FAILED", failure)
    if ("--all" in argv or "--write" in argv) and selected is None:
        figures = {"command": "PYTHONPATH=. python -m tests.analysis.opinfo_shard " + " ".join(argv),
                   "torch": torch.__version__, "samples_per_op": limit or "all",
                   "seconds": round(time.time() - start), **t.as_json()}  # fmt: skip
        RESULTS.write_text(json.dumps(figures, indent=2) + "\n")
    return t


if __name__ == "__main__":
    raise SystemExit(1 if main(sys.argv[1:]).failed else 0)
