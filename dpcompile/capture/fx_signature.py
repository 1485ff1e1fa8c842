"""The program's signature where fx would write it otherwise than forward's: ``forward(self, *inputs)``
given as many named placeholders as the examples pass (``inputs_0``, ``inputs_1``), and keyword-only
parameters kept after them::

    def forward(self, *xs, scale=2.0)   ->   def forward(self, xs_0, xs_1, scale = 2.0)
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Sequence
from typing import Any

import torch.fx as fx
from torch import nn

#: the instance attribute holding how many values ``forward(self, *inputs)`` was given by the
#: examples (a copy of the model, which tensor parallel traces, carries it)
VARARGS_COUNT = "_dpcompile_varargs_count"


def remember_varargs_count(model: nn.Module, example_inputs: Sequence[Any] | None, params: list[inspect.Parameter]) -> None:
    if example_inputs is None or not any(p.kind is p.VAR_POSITIONAL for p in params):
        return
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    model.__dict__[VARARGS_COUNT] = max(len(example_inputs) - len(named), 0)


def keyword_only_last(graph: fx.Graph, keyword_only: Collection[str]) -> None:
    """fx makes a keyword-only parameter (``forward(self, *xs, scale=2.0)``) a placeholder before
    the variadic ones, so the program's signature read ``forward(self, scale=2.0, *xs)`` (a call's first
    tensor bound to ``scale``) or, with examples, ``(self, scale=2.0, xs_0, xs_1)`` (a SyntaxError).
    Its placeholders go after them, as in forward."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    others = [i for i, n in enumerate(placeholders) if n.target not in keyword_only]
    if not keyword_only or not others:
        return
    anchor = placeholders[others[-1]]
    for i, node in enumerate(placeholders):
        if node.target in keyword_only and i < others[-1]:
            anchor.append(node)
            anchor = node
