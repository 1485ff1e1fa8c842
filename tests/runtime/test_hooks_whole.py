"""``runtime.hooks.runs_user_forward_hooks``: which called modules run whole because their user hooked them."""

from __future__ import annotations

from torch import nn

from dpcompile.runtime.hooks import runs_user_forward_hooks


def test_a_module_reached_twice_or_in_a_cycle_is_looked_at_once():
    """A shared child, and a cycle (a loaded program may hold one: the export fuzzer's made forward loop for
    ever here), end the search; a hook anywhere in them is still found."""
    inner = nn.Linear(2, 2)
    outer = nn.Sequential(inner, inner)
    outer._modules["back"] = outer  # a cycle
    assert runs_user_forward_hooks(outer) is False
    inner.register_forward_hook(lambda m, i, o: None)
    assert runs_user_forward_hooks(outer) is True
