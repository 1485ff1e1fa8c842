"""``measure`` of a ``schedule="1f1b"`` pipeline's training step on virtual devices: the 1F1B step
itself (each micro-batch's backward as soon as its forward is through), not its GPipe program.

The step runs its nodes one at a time (``modules/pipeline_1f1b.py``); here each node's device slot is
named before it runs and stamped on the autograd nodes it makes, as ``measure``'s interpreter does
for every other program, so each device's allocations are counted apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from dpcompile.modules.executors import executor_of

__all__ = ["one_f_one_b_peaks", "runs_one_f_one_b", "stamp_slot"]


def stamp_slot(out: Any, slot_key: str, slot: int) -> list[Any]:
    """Name ``slot`` on every autograd node the running node made: those its outputs reach before
    the nodes an earlier node stamped (a parameter's ``AccumulateGrad``: the slot of its first user).
    Not only the outputs' own: a Linear's ``AddmmBackward0`` sits under its ``ViewBackward0``, and
    the gradients it makes in backward are this slot's (searched for from it, the nearest stamp was
    the previous stage's, on the other side of the boundary). Returns the autograd nodes stamped."""
    todo = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    stamped = []  # returned, not kept: saved tensors free
    while todo:
        node = todo.pop()
        if slot_key in node.metadata:
            continue
        node.metadata[slot_key] = slot
        stamped.append(node)
        todo += [f for f, _ in getattr(node, "next_functions", ()) if f is not None]
    return stamped


def runs_one_f_one_b(pm: Any, training: bool) -> bool:
    """A training call of ``pm`` runs the 1F1B step."""
    return training and executor_of(pm).steps_one_f_one_b


def one_f_one_b_peaks(
    pm: Any, args: tuple, kwargs: dict, ledger: Any, slot_key: str, slot_index: Callable[[Any], int],
    backward: Callable[..., None], gradients_preset_to_zero: bool = False,
) -> None:
    """Run one 1F1B step of ``pm`` (a fresh one: the program's own cached step is left alone), each
    node's allocations counted on its slot of ``ledger``, each micro-batch's backward run by ``backward``
    (``torch.autograd.backward``'s arguments); ``gradients_preset_to_zero``: the zeros ``measure`` set as the
    copies' one set of gradients stand for none (a step whose loss count is found with the activations cloned
    them all, to divide its share after it: every gradient counted again on one device, 42% over)."""
    step = pm.recipe.one_f_one_b_step(pm, pm.call_key(*args, **kwargs))
    step.run_backward = backward
    step.gradients_preset_to_zero = gradients_preset_to_zero
    runner = step.runner
    plain = runner.run_node

    def run_node(n: Any) -> Any:
        ledger.slot = slot_index(n)
        out = plain(n)
        stamp_slot(out, slot_key, ledger.slot)
        return out

    runner.run_node = run_node
    with torch.enable_grad():
        step(args, kwargs)  # the step runs every micro-batch's backward itself
