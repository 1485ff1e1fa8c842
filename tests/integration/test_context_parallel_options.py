"""``context_parallel=``: how a ``cp`` dimension exchanges keys and values, checked once.

A bad value, a pair of options that does not compose, and the keyword without a ``cp`` dimension
are refused by name (no keyword silently ignored); an exchange asked for by name builds the program ``"auto"``
builds where it is the one chosen, equal to eager.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import dpcompile
from dpcompile import DpCompileError
from dpcompile.analysis import calibration
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


def test_auto_reads_the_cached_calibration_and_the_room_memory_per_device_leaves(monkeypatch, tmp_path):
    """16 query heads over 4 key/value heads on 4 devices, and a cached mesh calibration whose messages are
    free: ``"auto"`` takes the all-to-all (fewer bytes; its 8 messages cost nothing). With a
    ``memory_per_device=`` 1 byte short of the predicted peak plus what the all-to-all holds beyond the
    all-gather's keys and values, it runs the all-gather instead, equal to eager, explain saying why."""
    from tests.integration.test_context_parallel_all_to_all import GroupedQueryAttention

    monkeypatch.setenv("DPCOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DPCOMPILE_CALIBRATION", raising=False)
    free = dataclasses.replace(calibration.reference_mesh(4), collective_latency_s=0.0,
                               cores=calibration.available_cores())  # fmt: skip
    calibration._write_cache(calibration.cache_path("gloo4"), free)
    torch.manual_seed(0)
    model, x = GroupedQueryAttention(heads=16, kv_heads=4, head_dim=2), torch.randn(1, 8, 16)
    keywords = {"mesh": {"cp": 4}, "optimizer": "sgd", "training": True, "example_inputs": (x,)}
    roomy = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 4, memory_per_device=1 << 30, **keywords)
    assert roomy.strategies["cp"] == "context parallel (head-to-sequence all-to-all)"
    (call,) = dpcompile.explain(roomy, x).context_parallel["calls"]
    assert call["costs"]["all-to-all"]["seconds"] < call["costs"]["all-gather"]["seconds"]
    beyond = call["costs"]["all-to-all"]["transient_bytes"] - call["costs"]["all-gather"]["transient_bytes"]
    budget = roomy.candidates[0].peak + beyond - 1
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 4, memory_per_device=budget, **keywords)
    assert pm.strategies["cp"] == "context parallel (all-gather keys/values)"
    (call,) = dpcompile.explain(pm, x).context_parallel["calls"]
    left = call["costs"]["all-gather"]["transient_bytes"] + beyond - 1
    held = call["costs"]["all-to-all"]["transient_bytes"]
    assert call["why_not"]["all-to-all"] == f"its transient {held:,} B is over the {left:,} B left for it"
    torch.testing.assert_close(pm(x), model(x))
