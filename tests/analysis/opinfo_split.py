"""Run PyTorch's OpInfo samples split by their batch rules, as DTensor's ``test_dtensor_ops.py`` runs
them sharded: each sample becomes a one-op fx graph (the op's torch-function spelling), the
data-parallel pass (``insert_scatter_gather``: the real rule lookup, scatter, gather and partial
combines) rewrites it for 2 and 3 virtual CPU devices, after the write functionalisation every
program gets (``functionalize_mutations``), and the split program must equal the op.

    PYTHONPATH=. python -m tests.analysis.opinfo_split [--all] [--aten]   # prints ops x samples

``--max=N`` takes N samples per op (2 by default; ``--all`` every sample). With ``--all`` or
``--write`` it also writes the figures to ``benchmarks/results/opinfo_split[_aten].json``.

``--refresh-reasons=FILE`` rewrites a results file's reasons from the table (not its counts).

``--aten`` runs the core ATen spelling instead: the sample captured with ``make_fx`` and the core
decompositions (what ``torch.export`` gives), so the table's ATen rules are the ones asked.
"""

from __future__ import annotations

import collections
import copy
import functools
import json
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpcompile.analysis.batch_rules.reasons import WHOLE_REASONS, reason_for
from dpcompile.analysis.placement import Whole
from dpcompile.devices import parse_devices
from passes.data_parallel import insert_scatter_gather
from passes.functionalize import functionalize_mutations

# random ops (a draw per device is not the whole's draw) and ops whose values are not comparable
SKIP_OPS = {
    "bernoulli", "normal", "rand_like", "randn_like", "randint_like", "randint", "randn", "rand", "uniform",
    "multinomial", "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout", "nn.functional.rrelu",
    "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d", "cauchy", "exponential",
    "geometric", "log_normal", "torch._scaled_mm", "svd_lowrank", "pca_lowrank", "randperm", "poisson",
}  # fmt: skip


# why an op's rule keeps a sample whole though the oracle joins its chunks: the one table of reasons
KNOWN_WHOLE = WHOLE_REASONS


@dataclass
class Tally:
    """Ops x samples: split (run split and equal), whole (the rule kept it whole; equal), skipped, failed."""

    split: int = 0
    whole: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)
    failed: list[str] = field(default_factory=list)
    ops: set[str] = field(default_factory=set)
    # samples whose op has a split on the sample's dim 0 (the oracle: :func:`splittable`), by op
    # family, and how many of them the rule split: {family: [split, splittable]}
    families: dict[str, list[int]] = field(default_factory=dict)
    # ops whose rule kept a splittable sample whole: {op: (family, reason)}
    missed: dict[str, tuple[str, str]] = field(default_factory=dict)
    by_op: dict[str, list[int]] = field(default_factory=dict)  # {op: [split, splittable]}

    def count(self, family: str, outcome: str, op: str, reason: str | None) -> None:
        entry = self.families.setdefault(family, [0, 0])
        per_op = self.by_op.setdefault(op, [0, 0])
        entry[1] += 1
        per_op[1] += 1
        if outcome == "split":
            entry[0] += 1
            per_op[0] += 1
        elif op not in self.missed:
            self.missed[op] = (family, reason or "")

    def without_reason(self) -> dict[str, str]:
        """Ops that kept a splittable sample whole with no written reason (in
        :data:`~dpcompile.analysis.batch_rules.reasons.WHOLE_REASONS`): {op: family}."""
        return {op: family for op, (family, _) in sorted(self.missed.items()) if reason_for(op) is None}

    def split_line(self) -> str:
        done = sum(v[0] for v in self.families.values())
        total = sum(v[1] for v in self.families.values())
        return f"splittable samples (a split on dim 0 exists): {done} of {total} split"

    def line(self) -> str:
        skipped = sum(self.skipped.values())
        return (
            f"{len(self.ops)} ops, {self.split + self.whole + skipped + len(self.failed)} runs (sample x 2 or 3 devices): "
            f"{self.split + self.whole} passed ({self.split} split, {self.whole} whole), "
            f"{skipped} skipped, {len(self.failed)} failed"
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "ops": len(self.ops),
            "runs": self.split + self.whole + sum(self.skipped.values()) + len(self.failed),
            "passed": self.split + self.whole,
            "split": self.split,
            "whole": self.whole,
            "skipped": sum(self.skipped.values()),
            "skipped_by_reason": dict(self.skipped.most_common()),
            "failed": self.failed,
            "splittable": sum(v[1] for v in self.families.values()),
            "splittable_split": sum(v[0] for v in self.families.values()),
            "by_family": {f: {"split": v[0], "splittable": v[1]} for f, v in sorted(self.families.items())},
            "whole_where_a_split_exists": {
                op: {"family": f, "reason": reason_for(op) or reason, "written": reason_for(op) is not None}
                for op, (f, reason) in sorted(self.missed.items())
            },
            "without_written_reason": sorted(self.without_reason()),
            "by_op": {op: {"split": v[0], "splittable": v[1]} for op, v in sorted(self.by_op.items())},
        }


class _Recorder(fx.Interpreter):
    """Runs the graph once on the real inputs and keeps each value as the node's example."""

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        n.meta["val"] = out
        return out


def _batch_input(sample: Any) -> torch.Tensor | None:
    x = sample.input
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1 or x.size(0) < 3:
        return None
    return x


_PRINTABLE = (torch.Tensor, int, float, bool, str, type(None), complex, torch.dtype, torch.device, torch.memory_format,
              torch.layout, slice, type(Ellipsis))  # fmt: skip


def _graph_for(fn: Any, sample: Any) -> tuple[fx.GraphModule, list[Any], dict[str, int | None]] | None:
    """A graph calling ``fn(input, *args, **kwargs)`` with every tensor a placeholder: the input and
    tensors of its shape on dim 0 split, the others replicated."""
    x = sample.input
    leaves, spec = tree_flatten((sample.args, sample.kwargs))
    if any(not isinstance(leaf, _PRINTABLE) for leaf in leaves):
        return None  # an argument generated code cannot spell (an options object, a module)
    graph = fx.Graph()
    inputs: list[Any] = [x]
    dims: dict[str, int | None] = {"x": 0}
    head = graph.placeholder("x")
    nodes: list[Any] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            name = f"t{i}"
            nodes.append(graph.placeholder(name))
            inputs.append(leaf)
            batched = leaf.dim() == x.dim() and leaf.dim() > 0 and leaf.size(0) == x.size(0)
            dims[name] = 0 if batched else None
        else:
            nodes.append(leaf)
    args, kwargs = tree_unflatten(nodes, spec)
    out = graph.call_function(fn, (head, *args), kwargs)
    graph.output(out)
    return fx.GraphModule(torch.nn.Module(), graph), inputs, dims


@functools.cache
def _core_aten_table() -> dict[Any, Any]:
    """The core decompositions as a plain dict, read once: ``core_aten_decompositions()`` is a lazy
    table that make_fx copies, and each copy walks every CompositeImplicitAutograd op the dispatcher
    has (about half of a capture's time)."""
    from torch._decomp import core_aten_decompositions

    return dict(core_aten_decompositions())


# the last sample's capture: the sweep runs a sample on 2 then on 3 devices (see _aten_graph)
_LAST_ATEN: list[tuple[Any, Any, fx.GraphModule, list[Any], dict[str, int | None]]] = []


def _aten_graph(fn: Any, sample: Any) -> tuple[fx.GraphModule, list[Any], dict[str, int | None]] | None:
    """The sample captured once (a symbolic make_fx), a copy of it per call: the passes rewrite the
    graph they are given in place."""
    from torch.fx.experimental.proxy_tensor import make_fx

    if not (_LAST_ATEN and _LAST_ATEN[0][0] is fn and _LAST_ATEN[0][1] is sample):
        built = _graph_for(fn, sample)
        if built is None:
            return None
        gm, inputs, dims = built
        traced = make_fx(gm, decomposition_table=_core_aten_table(), tracing_mode="symbolic")(*inputs)
        names = [n.target for n in traced.graph.nodes if n.op == "placeholder"]
        _LAST_ATEN[:] = [(fn, sample, traced, inputs, dict(zip(names, dims.values())))]
    _, _, traced, inputs, dims = _LAST_ATEN[0]
    return copy.deepcopy(traced), inputs, dict(dims)


def _split_placements(placements: dict[str, Any], inputs: set[str]) -> bool:
    return any(not isinstance(p, Whole) for name, p in placements.items() if name not in inputs)


def _batched(leaf: Any, x: torch.Tensor) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() == x.dim() and leaf.dim() > 0 and leaf.size(0) == x.size(0)


def _joins(parts: list[Any], whole: Any, rows: list[int]) -> bool:
    """Whether the outputs on chunks of the rows give the whole's: concatenated along some dim,
    summed (a partial sum) or averaged by rows (a partial mean); other values equal."""
    if isinstance(whole, (list, tuple)):
        return (
            all(isinstance(p, (list, tuple)) and len(p) == len(whole) for p in parts)
            and all(_joins([p[i] for p in parts], w, rows) for i, w in enumerate(whole))
        )
    if not isinstance(whole, torch.Tensor):
        return False  # a Python value (allclose, equal): a question about the whole tensor
    if not all(isinstance(p, torch.Tensor) for p in parts):
        return False

    def close(a: torch.Tensor) -> bool:
        return a.shape == whole.shape and bool(torch.allclose(a, whole, rtol=1e-4, atol=1e-5, equal_nan=True))

    for d in range(whole.dim()):
        try:
            if close(torch.cat(parts, d)):
                return True
        except RuntimeError:
            continue
    if whole.is_floating_point() and all(p.shape == whole.shape for p in parts):
        total = sum(parts[1:], parts[0])
        mean = sum((p * n for p, n in zip(parts[1:], rows[1:])), parts[0] * rows[0]) / sum(rows)
        return close(total) or close(mean)
    return False


def splittable(fn: Any, sample: Any) -> bool:
    """The oracle: the op run on chunks of the sample's dim 0 (the input and every argument of
    its rows), its outputs joined, equals the op on the whole; so a split on dim 0 exists. A sample
    with an empty output is not counted (any join of empty chunks matches it)."""
    x = sample.input
    leaves, spec = tree_flatten((sample.args, sample.kwargs))
    cut = x.size(0) // 2
    if any(isinstance(leaf, torch.Tensor) and not leaf.is_floating_point() and not leaf.is_complex()
           and leaf.numel() and (leaf.dtype == torch.bool or int(leaf.max()) >= cut) for leaf in leaves):  # fmt: skip
        return False  # indices (or a mask) that may name rows a chunk lacks: some kernels do not check them
    outs = []
    try:
        for rows in (slice(0, cut), slice(cut, None)):
            args, kwargs = tree_unflatten([leaf[rows] if _batched(leaf, x) else leaf for leaf in leaves], spec)
            outs.append(fn(x[rows], *args, **kwargs))
        whole = fn(x, *sample.args, **sample.kwargs)
        if any(isinstance(t, torch.Tensor) and t.numel() == 0 for t in tree_flatten(whole)[0]):
            return False  # an empty output (a dim of size 0): any join matches, there is nothing to split
        return _joins(outs, whole, [cut, x.size(0) - cut])
    except Exception:  # noqa: BLE001 - the op refuses a chunk: no split on dim 0
        return False


def run_sample(fn: Any, sample: Any, devices: int, *, aten: bool = False) -> str:
    """``"split"``/``"whole"`` where the split program equals the op; ``"skip: why"``; raises on a mismatch."""
    return run_sample_detail(fn, sample, devices, aten=aten)[0]


def run_sample_detail(fn: Any, sample: Any, devices: int, *, aten: bool = False) -> tuple[str, str | None]:
    """:func:`run_sample`'s outcome, and for ``"whole"`` the reason the propagation gave."""
    if _batch_input(sample) is None:
        return "skip: no float input with 3+ rows", None
    if getattr(fn, "__name__", "<lambda>") == "<lambda>" or not callable(fn):
        return "skip: the OpInfo op is a lambda, not an fx spelling", None
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            expected = fn(sample.input, *sample.args, **sample.kwargs)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            again = fn(sample.input, *sample.args, **sample.kwargs)
        torch.testing.assert_close(again, expected, equal_nan=True, atol=0, rtol=0)
    except Exception:  # noqa: BLE001 - the op itself refuses or is not deterministic
        return "skip: the op is not deterministic or not callable on the sample", None
    try:
        built = _aten_graph(fn, sample) if aten else _graph_for(fn, sample)
    except Exception:  # noqa: BLE001
        return "skip: cannot capture the sample", None
    if built is None:
        return "skip: an argument generated code cannot spell", None
    gm, inputs, dims = built
    try:
        _Recorder(gm).run(*inputs)
    except Exception:  # noqa: BLE001
        return "skip: the captured graph does not run", None
    functionalize_mutations(gm)  # as transform's frontend pipeline does: writes into views become values
    result = insert_scatter_gather(gm, devices=parse_devices(["cpu"] * devices), input_dims=dims)
    gm.recompile()
    got = gm(*inputs)
    if aten and isinstance(got, (list, tuple)) and len(got) == 1 and not isinstance(expected, (list, tuple)):
        got = got[0]
    torch.testing.assert_close(got, expected, equal_nan=True, check_stride=False, atol=1e-5, rtol=1.3e-6)
    placements = result.info["placements"]
    if _split_placements(placements, set(dims)):
        return "split", None
    reasons = [p.reason for name, p in placements.items() if name not in dims and isinstance(p, Whole) and p.reason]
    return "whole", reasons[0] if reasons else None


def opinfo_samples(max_per_op: int | None, ops: set[str] | None = None) -> Iterator[tuple[str, Any, Any]]:
    from torch.testing._internal.common_methods_invocations import op_db

    for op in op_db:
        if (
            op.name in SKIP_OPS
            or op.variant_test_name.startswith("rand")
            or not op.supports_dtype(torch.float32, "cpu")
        ):
            continue
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        if ops is not None and name not in ops:
            continue
        if max_per_op is None:  # every sample: an op any of whose samples cannot be made is not swept
            try:
                samples: Any = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))
            except Exception:  # noqa: BLE001
                continue
        else:
            samples = _generated(op)
        taken = 0
        for sample in samples:
            if _batch_input(sample) is None:
                continue
            yield name, op.op, sample
            taken += 1
            if max_per_op is not None and taken >= max_per_op:
                break


@dataclass
class _Made:
    """The samples of one op generated so far in this process, and the generator that makes the next."""

    samples: list = field(default_factory=list)
    rest: Iterator[Any] | None = None
    ended: bool = False


#: each op's samples, made once per process: the sweeps of test_opinfo_batch_rules (as written and
#: in core ATen) and test_opinfo_shard_rules take the same first samples of the same ops, and making
#: one costs a stack walk of torch's (``extract_test_fn``) under pytest's deep stack
_MADE: dict[tuple[str, str], _Made] = {}


def _generated(op: Any) -> Iterator[Any]:
    """``op``'s float32 CPU samples, generated as they are taken (each is drawn from its own seed,
    so the first ones do not depend on how many follow; generating every sample of an op to take one
    was most of a one-sample sweep's time); they end at the first that cannot be generated. Those
    made once are given again (the same objects) to every later sweep in the process."""
    made = _MADE.setdefault((op.name, op.variant_test_name), _Made())
    taken = 0
    while True:
        if taken < len(made.samples):
            yield made.samples[taken]
            taken += 1
            continue
        if made.ended:
            return
        try:
            if made.rest is None:
                made.rest = iter(op.sample_inputs("cpu", torch.float32, requires_grad=False))
            made.samples.append(next(made.rest))
        except Exception:  # noqa: BLE001 - StopIteration, or the samples end at the first that cannot be made
            made.ended = True
            made.rest = None


def family_of(fn: Any) -> str:
    """The op family of ``fn``'s rule, as the table names it (``"pointwise"``, ``"view"``), or ``"no rule"``."""
    from dpcompile.analysis.batch_rules import BATCH_RULES
    from dpcompile.analysis.batch_rules.table import TABLE

    rule = BATCH_RULES.function_rule(fn)
    if rule is None:
        return "no rule"
    for entry in TABLE.values():
        if entry.rule is rule or getattr(rule, "__wrapped__", None) is entry.rule:
            return entry.family
    return getattr(rule, "__name__", "other").removeprefix("size_arithmetic_")


def sweep(max_per_op: int | None, *, aten: bool = False, ops: set[str] | None = None) -> Tally:
    tally = Tally()
    for name, fn, sample in opinfo_samples(max_per_op, ops):
        tally.ops.add(name)
        for devices in (2, 3):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    outcome, reason = run_sample_detail(fn, sample, devices, aten=aten)
            except Exception as e:  # noqa: BLE001 - the split program differs from the op: a rule bug
                tally.failed.append(f"{name} on {devices} devices: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            if devices == 2 and not outcome.startswith("skip") and splittable(fn, sample):
                tally.count(family_of(fn), outcome, name, reason)
            if outcome == "split":
                tally.split += 1
            elif outcome == "whole":
                tally.whole += 1
            else:
                tally.skipped[outcome] += 1
            if outcome.startswith("skip"):
                break  # the same on 3 devices
    return tally


def selected_ops(argv: list[str]) -> set[str] | None:
    """The OpInfo names ``--ops=cumprod,linalg.det`` names (``--ops-file=F``: one a line), and those
    starting with ``--prefix=linalg.``; None (every op) where none is given."""
    from torch.testing._internal.common_methods_invocations import op_db

    names = {n for a in argv if a.startswith("--ops=") for n in a.split("=", 1)[1].split(",") if n}
    for a in argv:
        if a.startswith("--ops-file="):
            names |= {line.strip() for line in Path(a.split("=", 1)[1]).read_text().splitlines() if line.strip()}
    prefixes = [a.split("=", 1)[1] for a in argv if a.startswith("--prefix=")]
    if not names and not prefixes:
        return None
    every = {op.name + (f".{op.variant_test_name}" if op.variant_test_name else "") for op in op_db}
    return names | {n for n in every if any(n.startswith(p) for p in prefixes)}


def main(argv: list[str]) -> Tally:
    """Run the sweep (``--aten``: the core ATen spelling; ``--max=N`` / ``--all``), print it, and
    with ``--all`` or ``--write`` write ``benchmarks/results/opinfo_split[_aten].json``."""
    start = time.time()
    aten = "--aten" in argv
    limit = next((int(a.split("=")[1]) for a in argv if a.startswith("--max=")), 2)
    limit_or_all = None if "--all" in argv else limit
    selected = selected_ops(argv)
    t = sweep(limit_or_all, aten=aten, ops=selected)
    print(t.line())
    print(t.split_line())
    for family, (done, total) in sorted(t.families.items()):
        print(f"  {family:60s} {done:5d} / {total:5d}")
    for op, (family, reason) in sorted(t.missed.items()):
        print(f"  WHOLE where a split exists: {op} ({family}): {reason_for(op) or reason}")
    for reason, count in t.skipped.most_common():
        print(f"  {count:5d} {reason}")
    for failure in t.failed:
        print("  FAILED", failure)
    if ("--all" in argv and selected is None) or "--write" in argv:  # a slice writes its own file
        name = f"opinfo_split{'_slice' if selected is not None else ''}{'_aten' if aten else ''}.json"
        out = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / name
        figures = {"command": "PYTHONPATH=. python -m benchmarks.opinfo_split " + " ".join(argv),
                   "torch": torch.__version__, "samples_per_op": limit_or_all or "all",
                   "seconds": round(time.time() - start), **t.as_json()}  # fmt: skip
        out.write_text(json.dumps(figures, indent=2) + "\n")
    for op, family in t.without_reason().items():
        print(f"  NO WRITTEN REASON: {op} ({family}) runs whole on a splittable sample; give it a rule, or its reason "
              "in dpcompile/analysis/batch_rules/reasons.py (WHOLE_REASONS)")  # fmt: skip
    return t


def refresh_reasons(path: Path) -> int:
    """Rewrite a results file's reasons from :data:`WHOLE_REASONS` (the counts stay as measured): the
    reasons written after a run; 1 where an op still has none."""
    data = json.loads(path.read_text())
    missed = data["whole_where_a_split_exists"]
    for op, entry in missed.items():
        written = reason_for(op)
        entry["reason"], entry["written"] = written or entry["reason"], written is not None
    data["without_written_reason"] = sorted(op for op, entry in missed.items() if not entry["written"])
    path.write_text(json.dumps(data, indent=2) + "\n")
    for op in data["without_written_reason"]:
        print(f"  NO WRITTEN REASON: {op} ({missed[op]['family']})")
    return 1 if data["without_written_reason"] else 0


def exit_status(t: Tally) -> int:
    """1 where a split program differed from the op, or an op kept a splittable sample whole
    without a written reason; else 0."""
    return 1 if t.failed or t.without_reason() else 0


if __name__ == "__main__":
    if sys.argv[1:2] and sys.argv[1].startswith("--refresh-reasons="):
        raise SystemExit(refresh_reasons(Path(sys.argv[1].split("=", 1)[1])))
    raise SystemExit(exit_status(main(sys.argv[1:])))
