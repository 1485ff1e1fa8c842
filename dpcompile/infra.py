"""The pass infrastructure: ``PassResult``, provenance stamps and the pipeline runner.

A pass is a function ``GraphModule -> PassResult`` with keyword-only options (bind them with
``functools.partial``). The runner, not the pass, lints the graph, recompiles, times each
pass and wraps a failure as ``while running 'shard_linear' after [...]``.

``DPCOMPILE_DEBUG=1`` logs each pass with its timing; ``=2`` also logs the code after it.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from dpcompile.errors import DpCompileError, PassError
from dpcompile.fx_utils import unalias
from dpcompile.progress import step_bar

log = logging.getLogger("dpcompile")


@dataclass
class PassResult:
    """What a pass returns: the (possibly same) module, whether it changed, and findings."""

    graph_module: fx.GraphModule
    modified: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class PassRecord:
    name: str
    seconds: float
    modified: bool
    info: dict[str, Any]


Pass = Callable[[fx.GraphModule], PassResult]


def pass_name(p: Pass) -> str:
    while isinstance(p, functools.partial):
        p = p.func
    return getattr(p, "__name__", type(p).__name__)


@dataclass(frozen=True)
class Comm:
    """What a communication node moves, for ``explain`` and the cost model.

    ``kind`` is one of ``scatter``, ``gather``, ``broadcast``, ``reduce``, ``all_reduce``,
    ``all_gather``, ``reduce_scatter``, and for tensor parallelism ``identity`` (Megatron's f
    forward: nothing moves) and ``split`` (a shard keeps its slice; backward all-gathers);
    ``io`` marks the moves of the user's inputs onto the
    devices and of the outputs back to ``output_device`` (counted apart from collectives).
    ``backward`` is the kind of the collective that autograd runs for it, or None.
    """

    kind: str
    io: bool = False
    backward: str | None = None


def stamp_comm(node: fx.Node, kind: str, *, io: bool = False, backward: str | None = None) -> fx.Node:
    node.meta["dpcompile_comm"] = Comm(kind, io, backward)
    return node


def stamp(node: fx.Node, pass_name: str, source: fx.Node | None = None) -> fx.Node:
    """Mark ``node`` as made by ``pass_name``, carrying ``source``'s user stack trace."""
    node.meta["dpcompile_pass"] = pass_name
    if source is not None:
        if source.meta.get("stack_trace"):
            node.meta["stack_trace"] = source.meta["stack_trace"]
        node.meta.setdefault("dpcompile_source", source.meta.get("dpcompile_source", source.name))
        module = module_path_of(source)
        if module is not None:
            node.meta.setdefault("dpcompile_module", module)
    return node


def module_path_of(node: fx.Node) -> str | None:
    """The path of the innermost module whose forward made ``node`` (``"layers.0.mlp"``), or None
    at the top level; lowered nodes carry their user node's as ``meta["dpcompile_module"]``. The model's
    own name: a ``call_module`` of ``user:stages.0`` (timm's ConvNeXt, its ``stages`` aliased) is in
    ``stages.0`` (as its ``nn_module_stack`` says: a checkpointed block was cut into regions around
    its convolutions, each module call seen as another module's)."""
    if "dpcompile_module" in node.meta:
        return node.meta["dpcompile_module"]
    if node.op == "call_module":
        return unalias(str(node.target))
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return path or None


def _debug_level() -> int:
    try:
        return int(os.environ.get("DPCOMPILE_DEBUG", "0"))
    except ValueError:
        return 0


def replace_graph(gm: fx.GraphModule, graph: fx.Graph) -> None:
    """Give ``gm`` a new graph without recompiling: the runner recompiles once, after the pass."""
    graph.owning_module = gm
    gm._graph = graph


def run_passes(
    gm: fx.GraphModule, passes: Sequence[Pass], *, recompile: bool = True
) -> tuple[fx.GraphModule, list[PassRecord]]:
    """Run ``passes`` in order, linting after each; recompile after each pass that changed the
    graph (``recompile=False`` leaves the last recompile to the caller, who builds a module
    from the graph anyway). Returns the module and a record per pass."""
    records: list[PassRecord] = []
    level = _debug_level()
    bar = step_bar("Running passes", len(passes))  # transform(progress=): one step a pass
    for p in passes:
        name = pass_name(p)
        start = time.perf_counter()
        done = [r.name for r in records]
        last = p is passes[-1]
        try:
            result = p(gm)
            result.graph_module.graph.lint()
            if result.modified and (recompile or not last):
                result.graph_module.recompile()
        except (DpCompileError, ValueError) as e:  # the user's to fix: keep the type, add where
            e.add_note(f"while running '{name}' after {done}")
            raise
        except Exception as e:
            raise PassError(f"while running '{name}' after {done}: {type(e).__name__}: {e}") from e
        gm = result.graph_module
        seconds = time.perf_counter() - start
        records.append(PassRecord(name, seconds, result.modified, result.info))
        bar.update()
        if level >= 1:
            log.info("pass %s: %.1f ms, modified=%s", name, seconds * 1e3, result.modified)
        if level >= 2:
            log.info("code after %s:\n%s", name, gm.code)
    return gm, records


def info_of(records: Sequence[PassRecord], name: str) -> dict[str, Any]:
    """The findings of pass ``name`` in a pipeline's records (empty where it did not run)."""
    return next((r.info for r in records if r.name == name), {})
