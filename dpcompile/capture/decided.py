"""Branches on data-dependent sizes, decided on the example's values and checked at every call.

``torch.export`` cannot trace ``if label_index.size(0) > 0`` after ``label_index = (labels >= 0).nonzero()``
(DeBERTa's classification loss): the count is known only when the values are. Where export
refuses such a branch, the frontend exports again with torch's real-tensor propagation, which
takes the branch the example takes and records it as a runtime assertion
(``_assert_scalar(0 < u0)``). The program keeps those assertions, so a call that would take
the other branch stops with an error instead of computing the wrong one::

    nonzero = aten.nonzero(ge)                   # u0 rows, known at run time
    size = aten.sym_size(nonzero, 0)
    positive = 0 < size
    aten._assert_scalar(positive, "Runtime assertion failed for expression 0 < u0 ...")

A decision that also reads a size that varies between calls (the batch size) is not kept: it
would be checked per device, where the sizes are the device's. Such a model stays refused.
"""

from __future__ import annotations

import contextlib
import logging
import re
import traceback
import warnings
from collections.abc import Iterator, Mapping
from typing import Any
from unittest import mock

import sympy
import torch
import torch.fx as fx
from torch import nn
from torch._subclasses import meta_utils
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_symbols, free_unbacked_symbols
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from dpcompile.capture.inputs import InputMismatch
from dpcompile.runtime.structures import is_fake

_PREFIX = "propagate_real_tensors"
_READS_DATA = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)


class Decisions(list):
    """The decided expressions, and ``lines``: for each data-dependent symbol (``u0``), the
    user's line of forward that decided on it."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: dict[str, str] = {}


@contextlib.contextmanager
def decided_on_examples() -> Iterator[Decisions]:
    """While export runs in it: each data-dependent branch is decided by the example's values;
    yields the list the decided expressions are appended to."""
    decisions = Decisions()
    defer = ShapeEnv.guard_or_defer_runtime_assert

    def record(self: ShapeEnv, orig_expr: Any, msg: str, *args: Any, **kwargs: Any) -> Any:
        if isinstance(msg, str) and msg.startswith(_PREFIX):
            decisions.append(orig_expr)
            line = _user_line()
            for symbol in free_unbacked_symbols(orig_expr):
                decisions.lines.setdefault(str(symbol), line)
        return defer(self, orig_expr, msg, *args, **kwargs)

    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    shapes_log.setLevel(logging.ERROR)  # each decision is logged as a warning; the program checks it
    try:
        with (
            torch._functorch.config.patch(fake_tensor_propagate_real_tensors=True),
            mock.patch.object(ShapeEnv, "guard_or_defer_runtime_assert", record),
            _parameters_propagate_their_values(),
        ):
            yield decisions
    finally:
        shapes_log.setLevel(level)


@contextlib.contextmanager
def _parameters_propagate_their_values() -> Iterator[None]:
    """Real-tensor propagation gives each parameter the values it holds, not uninitialised memory.

    torch 2.13 fakifies an input for propagation as ``real = torch.empty_strided(...)`` then
    ``meta_utils._safe_copy(real, t)``, which copies only a tensor whose type is exactly
    ``torch.Tensor``: an ``nn.Parameter``'s real value was whatever the allocator handed back, so a
    branch on ``nn.Linear``'s output was decided on garbage (``isfinite(h).all()`` false in a
    long-lived process, where freed memory holds old values; right in a fresh one)::

        before: _safe_copy(real, weight)            # Parameter: nothing copied
        after:  _safe_copy(real, weight.detach())   # the weight's values
    """
    copy, clone = meta_utils._safe_copy, meta_utils._safe_clone

    def plain(src: Any) -> Any:
        if isinstance(src, nn.Parameter) and not is_traceable_wrapper_subclass(src) and not is_fake(src):
            return src.detach()
        return src

    with (
        mock.patch.object(meta_utils, "_safe_copy", lambda dst, src: copy(dst, plain(src))),
        mock.patch.object(meta_utils, "_safe_clone", lambda src: clone(plain(src))),
    ):
        yield


def _user_line() -> str:
    """``'model.py:12 in forward: 'if x.sum() > 0:''``: the innermost frame under torch.export's
    call that is not torch's or dpcompile's (forward's own code), else ''."""
    stack = traceback.extract_stack()
    entered = next((i for i, f in enumerate(stack) if "/torch/export/" in f.filename), len(stack))
    for frame in reversed(stack[entered:]):
        if any(part in frame.filename for part in ("/torch/", "/dpcompile/", "/contextlib.py", "<string>")):
            continue
        return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()!r}"
    return ""


def name_branches(gm: fx.GraphModule, decisions: Decisions, model_name: str) -> None:
    """Each kept check's message names the line of forward that decided it (export's checks
    carry torch's own stack); a decision export kept no check of (seen for ``if x.max().item() > 1.0``
    decided false) is refused: the program would take that branch for every call."""
    from dpcompile.errors import TraceError

    checked: set[str] = set()
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten._assert_scalar.default and len(node.args) > 1 and isinstance(node.args[1], str):
            symbols = re.findall(r"\b(?:u|zuf)\d+\b", node.args[1])
            checked.update(symbols)
            line = next((decisions.lines[s] for s in symbols if decisions.lines.get(s)), "")
            if line:
                node.args = (node.args[0], f"{node.args[1]} [{line}]")
    unchecked = [s for s in decisions.lines if s not in checked]
    if unchecked:
        raise TraceError(
            f"torch.export could not capture {model_name}: forward branches on a value read from data at "
            f"{decisions.lines[unchecked[0]]}, and torch.export kept no check of the branch the example takes, so a "
            "call taking the other branch would compute the wrong one; make the branch traceable (torch.where), or "
            "transform with frontend='fx' marking the module as a leaf"
        )


def reads_only_data_sizes(expr: Any) -> bool:
    """Whether a decided expression reads data-dependent sizes only (no input size)."""
    return free_unbacked_symbols(expr) == free_symbols(expr)


def is_data_check(node: fx.Node) -> bool:
    """An ``_assert_scalar`` whose condition reads data-dependent sizes only (``0 < u0``, nonzero's
    count), or one of a branch of forward's own line on a value read out of a tensor
    (:func:`name_branches`) and no input size: true of the whole batch's values, which the program
    computes whole. The latter is read from the graph, not the condition's value: where the
    assertion itself decides it (``Eq(u2, 1)``), export simplifies that value to ``True``."""
    if node.op != "call_function" or node.target is not torch.ops.aten._assert_scalar.default or not node.args:
        return False
    condition = node.args[0]
    if not isinstance(condition, fx.Node):
        return False
    val = condition.meta.get("val")
    if isinstance(val, torch.SymBool) and free_unbacked_symbols(val) and reads_only_data_sizes(val):
        return True
    if not (len(node.args) > 1 and isinstance(node.args[1], str) and _NAMED.search(node.args[1])):
        return False
    reads_data, seen, todo = False, set(), [condition]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        val = n.meta.get("val")
        if n.target in _READS_DATA or (isinstance(val, (torch.SymInt, torch.SymBool, torch.SymFloat)) and free_unbacked_symbols(val)):
            reads_data = True
        if isinstance(val, (torch.SymInt, torch.SymBool, torch.SymFloat)) and not reads_only_data_sizes(val):
            return False
        if isinstance(val, torch.Tensor):
            continue  # the tensor an item or a size is read from: its own sizes are not what is decided
        todo.extend(n.all_input_nodes)
    return reads_data


_NAMED = re.compile(r" \[(.*)\]$")
_EXPRESSION = re.compile(r"Runtime assertion failed for expression (.*) on node")
#: how a kept check's message starts (:func:`data_check_message`): the call refuses with it
BRANCH_NOT_CAPTURED = "this call takes a branch of forward that the program does not have"


class BranchNotCaptured(InputMismatch, RuntimeError):
    """A call took a branch on data that the program, captured with one branch, does not have (a
    ``RuntimeError`` too: torch's check raises one, which code may already catch)."""


def branch_not_captured(exc: RuntimeError) -> BranchNotCaptured | None:
    """``exc`` from a kept check of a captured branch, as the :class:`BranchNotCaptured` it means; else None."""
    text = str(exc)
    at = text.find(BRANCH_NOT_CAPTURED)
    return None if at < 0 or isinstance(exc, InputMismatch) else BranchNotCaptured(text[at:])


def data_check_message(node: fx.Node) -> str:
    """What a kept check says when a call takes the branch the example did not: the expression
    export decided on the example and the line of forward that branches on it."""
    condition, message = node.args[0], node.args[1] if len(node.args) > 1 else ""
    found = _EXPRESSION.search(message) if isinstance(message, str) else None
    if found is not None:
        expression = found.group(1)
    else:
        expression = condition.meta["val"].node.expr if isinstance(condition, fx.Node) else condition
    line = _NAMED.search(message) if isinstance(message, str) else None
    where = f" (forward's {line.group(1)})" if line else ""
    return (
        f"{BRANCH_NOT_CAPTURED}{where}: the program was captured with "
        f"{expression} true, as the example made it (forward branches on a value read from data, e.g. "
        "'if x.sum() > 0:' or the count of nonzero's rows, and torch.export captures one branch); transform with "
        "an example that takes this branch"
    )


def check_decided_on_examples(ep: Any, names: Mapping[str, Any], model_name: str) -> None:
    """Run the program export decided on the examples: where one of its checks fails on the
    examples themselves, torch's real-value propagation decided a branch otherwise than the
    example takes it (as it did on a parameter's uninitialised values before
    :func:`_parameters_propagate_their_values`), and the program would compute another branch
    than eager: refuse, naming the branch."""
    from dpcompile.errors import TraceError

    module = ep.module()
    if any(is_fake(t) for t in (*module.state_dict().values(), *names.values())):
        return  # a model built on meta has no values to run (a batch norm's momentum=None reads its count)
    # buffers copied (a batch norm's running statistics are written); parameters are only read under no_grad
    # one copy per tensor: tied keys (an LM head sharing the embedding's weight) name the same one, as
    # functional_call requires of tied keys
    copies: dict[int, torch.Tensor] = {}
    state = {k: copies.setdefault(id(v), v.detach() if isinstance(v, nn.Parameter) else v.detach().clone())
             for k, v in module.state_dict(keep_vars=True).items()}  # fmt: skip
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.func.functional_call(module, state, (), dict(names))
    except RuntimeError as exc:
        if "Runtime assertion failed" not in str(exc):
            raise
        line = re.search(r"\[(.*)\]$", str(exc).splitlines()[0])
        where = f" at {line.group(1)}" if line else ""
        raise TraceError(
            f"torch.export could not capture {model_name}: forward branches on a value read from data{where}, and "
            "torch.export's propagation of the example's values decided that branch otherwise than the example takes "
            "it; make the branch traceable (torch.where), or transform with frontend='fx' marking the module as a leaf"
        ) from None


def lines_reading_numbers(decisions: Decisions) -> list[str]:
    """The lines of forward that turned a value read from data into a Python number (``float(t)``,
    ``int(t)``): export pinned it to the example's value (``Eq(zuf0, -0.912)``). A branch on such a
    value (``zuf0 > 0.1``) pins nothing."""
    pinned = [d for d in decisions if isinstance(d, sympy.Eq) and free_unbacked_symbols(d)]
    return [decisions.lines.get(str(s), "") or str(d) for d in pinned for s in sorted(free_unbacked_symbols(d), key=str)]


def refuse_numbers_read_from_data(gm: fx.GraphModule, model_name: str, lines_read: list[str]) -> None:
    """A program exported deciding on the examples returns a Python number where forward returns one read
    from a tensor (``float(t)``, ``int(t)``): export keeps the example's value, and its check did not hold
    every call (the float's returned unchecked beside an int that matched: silently the example's). Refused
    where forward turned a read into a number (``lines_read``, :func:`lines_reading_numbers`); a constant
    (``return out, 0.5``) is returned as written::

        return out, float(out.sum())   # the program: return (out, -0.912...)  (the example's sum)"""
    from dpcompile.errors import TraceError

    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    numbers = [v for v in torch.utils._pytree.tree_leaves(output.args) if type(v) in (int, float)]
    if numbers and lines_read:
        where = f" at {lines_read[0]}" if lines_read[0] else ""
        raise TraceError(
            f"{model_name}.forward returns a Python number read from a tensor (float(t) or int(t)){where}, which "
            f"torch.export keeps as the example's value ({numbers[0]!r}); return the tensor, or t.item(), "
            "which the program reads at each call"
        )
