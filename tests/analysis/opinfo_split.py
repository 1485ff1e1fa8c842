"""Run PyTorch's OpInfo samples split by their batch rules, as DTensor's ``test_dtensor_ops.py`` runs
them sharded: each sample becomes a one-op fx graph (the op's torch-function spelling), the
data-parallel pass (``insert_scatter_gather``: the real rule lookup, scatter, gather and partial
combines) rewrites it for 2 and 3 virtual CPU devices, after the write functionalisation every
program gets (``functionalize_mutations``), and the split program must equal the op.

    PYTHONPATH=. python -m tests.analysis.opinfo_split [--all] [--aten]   # prints ops x samples

``--max=N`` takes N samples per op (2 by default; ``--all`` every sample). With ``--all`` or
``--write`` it also writes the figures to ``benchmarks/results/opinfo_split[_aten].json``.

``--aten`` runs the core ATen spelling instead: the sample captured with ``make_fx`` and the core
decompositions (what ``torch.export`` gives), so the table's ATen rules are the ones asked.
"""

from __future__ import annotations

import collections
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
    "geometric", "log_normal", "torch._scaled_mm", "svd_lowrank", "pca_lowrank", "randperm",
}  # fmt: skip


@dataclass
class Tally:
    """Ops x samples: split (run split and equal), whole (the rule kept it whole; equal), skipped, failed."""

    split: int = 0
    whole: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)
    failed: list[str] = field(default_factory=list)
    ops: set[str] = field(default_factory=set)

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


def _aten_graph(fn: Any, sample: Any) -> tuple[fx.GraphModule, list[Any], dict[str, int | None]] | None:
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    built = _graph_for(fn, sample)
    if built is None:
        return None
    gm, inputs, dims = built
    traced = make_fx(gm, decomposition_table=core_aten_decompositions(), tracing_mode="symbolic")(*inputs)
    names = [n.target for n in traced.graph.nodes if n.op == "placeholder"]
    return traced, inputs, dict(zip(names, dims.values()))


def _split_placements(placements: dict[str, Any], inputs: set[str]) -> bool:
    return any(not isinstance(p, Whole) for name, p in placements.items() if name not in inputs)


def run_sample(fn: Any, sample: Any, devices: int, *, aten: bool = False) -> str:
    """``"split"``/``"whole"`` where the split program equals the op; ``"skip: why"``; raises on a mismatch."""
    if _batch_input(sample) is None:
        return "skip: no float input with 3+ rows"
    if getattr(fn, "__name__", "<lambda>") == "<lambda>" or not callable(fn):
        return "skip: the OpInfo op is a lambda, not an fx spelling"
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            expected = fn(sample.input, *sample.args, **sample.kwargs)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            again = fn(sample.input, *sample.args, **sample.kwargs)
        torch.testing.assert_close(again, expected, equal_nan=True, atol=0, rtol=0)
    except Exception:  # noqa: BLE001 - the op itself refuses or is not deterministic
        return "skip: the op is not deterministic or not callable on the sample"
    try:
        built = _aten_graph(fn, sample) if aten else _graph_for(fn, sample)
    except Exception:  # noqa: BLE001
        return "skip: cannot capture the sample"
    if built is None:
        return "skip: an argument generated code cannot spell"
    gm, inputs, dims = built
    try:
        _Recorder(gm).run(*inputs)
    except Exception:  # noqa: BLE001
        return "skip: the captured graph does not run"
    functionalize_mutations(gm)  # as transform's frontend pipeline does: writes into views become values
    result = insert_scatter_gather(gm, devices=parse_devices(["cpu"] * devices), input_dims=dims)
    gm.recompile()
    got = gm(*inputs)
    if aten and isinstance(got, (list, tuple)) and len(got) == 1 and not isinstance(expected, (list, tuple)):
        got = got[0]
    torch.testing.assert_close(got, expected, equal_nan=True, check_stride=False, atol=1e-5, rtol=1.3e-6)
    return "split" if _split_placements(result.info["placements"], set(dims)) else "whole"


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
        try:
            samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))
        except Exception:  # noqa: BLE001
            continue
        taken = 0
        for sample in samples:
            if _batch_input(sample) is None:
                continue
            yield name, op.op, sample
            taken += 1
            if max_per_op is not None and taken >= max_per_op:
                break


def sweep(max_per_op: int | None, *, aten: bool = False, ops: set[str] | None = None) -> Tally:
    tally = Tally()
    for name, fn, sample in opinfo_samples(max_per_op, ops):
        tally.ops.add(name)
        for devices in (2, 3):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    outcome = run_sample(fn, sample, devices, aten=aten)
            except Exception as e:  # noqa: BLE001 - the split program differs from the op: a rule bug
                tally.failed.append(f"{name} on {devices} devices: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            if outcome == "split":
                tally.split += 1
            elif outcome == "whole":
                tally.whole += 1
            else:
                tally.skipped[outcome] += 1
            if outcome.startswith("skip"):
                break  # the same on 3 devices
    return tally


if __name__ == "__main__":
    start = time.time()
    aten = "--aten" in sys.argv
    limit = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--max=")), 2)
    limit_or_all = None if "--all" in sys.argv else limit
    t = sweep(limit_or_all, aten=aten)
    print(t.line())
    for reason, count in t.skipped.most_common():
        print(f"  {count:5d} {reason}")
    for failure in t.failed:
        print("  FAILED", failure)
    if "--all" in sys.argv or "--write" in sys.argv:
        name = f"opinfo_split{'_aten' if aten else ''}.json"
        out = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / name
        figures = {"command": "PYTHONPATH=. python -m tests.analysis.opinfo_split " + " ".join(sys.argv[1:]),
                   "torch": torch.__version__, "samples_per_op": limit_or_all or "all",
                   "seconds": round(time.time() - start), **t.as_json()}  # fmt: skip
        out.write_text(json.dumps(figures, indent=2) + "\n")
