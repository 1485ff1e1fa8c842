"""``context_parallel=``: how a ``cp`` dimension exchanges keys and values, checked once.

A bad value, a pair of options that does not compose, and the keyword without a ``cp`` dimension
are refused by name (no keyword silently ignored); an exchange asked for by name builds the program ``"auto"``
builds where it is the one chosen, equal to eager.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dpcompile
from dpcompile import DpCompileError
from dpcompile.analysis.context_exchange import EXCHANGES, chosen_exchange, parse_context_parallel
from tests.integration.test_context_parallel import CausalSelfAttention


@pytest.mark.parametrize(
    "value, error, words",
    [
        (3, ValueError, "expected a dict"),
        ({"exchange": "broadcast"}, ValueError, "expected 'auto' or one of"),
        ({"exchnage": "ring"}, ValueError, "no option 'exchnage'"),
        ({"load_balance": "yes"}, ValueError, "expected 'auto', True or False"),
    ],
)
def test_a_bad_value_is_refused_by_name(value, error, words):
    with pytest.raises(error, match=words):
        parse_context_parallel(value)


def test_an_exchange_asked_for_by_name_is_taken():
    for exchange in EXCHANGES:
        assert chosen_exchange(parse_context_parallel({"exchange": exchange})) == exchange
    assert chosen_exchange(parse_context_parallel(None)) in EXCHANGES


def test_the_keyword_without_a_cp_dimension_is_refused():
    model = CausalSelfAttention()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="there is none: add 'cp' to mesh="):
        dpcompile.transform(model, ["cpu"] * 2, mesh={"dp": 2}, context_parallel={"exchange": "all-gather"})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_all_gather_asked_for_by_name_equals_eager():
    torch.manual_seed(0)
    model = CausalSelfAttention().double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, mesh={"cp": 2}, example_inputs=(x,),
                             context_parallel={"exchange": "all-gather", "load_balance": False})  # fmt: skip
    torch.testing.assert_close(pm(x), model(x))


@pytest.mark.parametrize("exchange", ["ring", "all-to-all"])
def test_load_balancing_with_an_exchange_it_does_not_balance_is_refused_by_name(exchange):
    """Load balancing moves the all-gather's causal query rows: with the ring (not balanced) or the
    all-to-all (balanced as it is) asked for by name, the pair is refused, saying why."""
    with pytest.raises(DpCompileError, match=rf"'exchange': '{exchange}', 'load_balance': True}}: load balancing moves"):
        parse_context_parallel({"exchange": exchange, "load_balance": True})
