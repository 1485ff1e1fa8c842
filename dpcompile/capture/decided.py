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
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_symbols, free_unbacked_symbols

_PREFIX = "propagate_real_tensors"


@contextlib.contextmanager
def decided_on_examples() -> Iterator[list[Any]]:
    """While export runs in it: each data-dependent branch is decided by the example's values;
    yields the list the decided expressions are appended to."""
    decisions: list[Any] = []
    defer = ShapeEnv.guard_or_defer_runtime_assert

    def record(self: ShapeEnv, orig_expr: Any, msg: str, *args: Any, **kwargs: Any) -> Any:
        if isinstance(msg, str) and msg.startswith(_PREFIX):
            decisions.append(orig_expr)
        return defer(self, orig_expr, msg, *args, **kwargs)

    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    shapes_log.setLevel(logging.ERROR)  # each decision is logged as a warning; the program checks it
    try:
        with (
            torch._functorch.config.patch(fake_tensor_propagate_real_tensors=True),
            mock.patch.object(ShapeEnv, "guard_or_defer_runtime_assert", record),
        ):
            yield decisions
    finally:
        shapes_log.setLevel(level)


def reads_only_data_sizes(expr: Any) -> bool:
    """Whether a decided expression reads data-dependent sizes only (no input size)."""
    return free_unbacked_symbols(expr) == free_symbols(expr)


def is_data_check(node: fx.Node) -> bool:
    """An ``_assert_scalar`` whose condition reads data-dependent sizes only: true of the whole
    batch's values, which the program computes whole (``nonzero`` has no batch rule)."""
    if node.op != "call_function" or node.target is not torch.ops.aten._assert_scalar.default or not node.args:
        return False
    condition = node.args[0]
    val = condition.meta.get("val") if isinstance(condition, fx.Node) else None
    if not isinstance(val, torch.SymBool):
        return False
    return bool(free_unbacked_symbols(val)) and reads_only_data_sizes(val)


def data_check_message(node: fx.Node) -> str:
    """What a kept check says when a call takes the branch the example did not."""
    condition = node.args[0]
    expression = condition.meta["val"].node.expr if isinstance(condition, fx.Node) else condition
    return (
        f"this call takes a branch of forward that the program does not have: the program was captured with "
        f"{expression} true, as the example made it (forward branches on a data-dependent size, e.g. the count of "
        "nonzero's rows, and torch.export captures one branch); transform with an example that takes this branch"
    )
