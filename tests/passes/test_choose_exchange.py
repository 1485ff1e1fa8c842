"""``choose_context_exchanges`` reads the machine's cached mesh calibration and the room
``memory_per_device=`` leaves (``ContextParallelOptions.memory_headroom``): one attention call of 2
heads of 32 over 2,048 tokens on 2 devices, where the reference figures take the all-to-all."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpcompile.analysis import calibration
from dpcompile.analysis.calibration import reference_mesh
from dpcompile.analysis.context_exchange import DEFAULT_OPTIONS, exchange_costs
from passes.choose_exchange import CHOICES, choose_context_exchanges, find_exchange_sites
from passes.context_parallel import insert_sequence_exchange
from tests.helpers import captured


class Attend(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


@pytest.fixture
def marked():
    """The call marked for context parallel, each time anew (the pass records on the module)."""

    def make():
        q, k, v = (torch.randn(1, 2, 2048, 32) for _ in range(3))
        gm = captured(Attend(), q, k, v)
        insert_sequence_exchange(gm, input_dims={"q": 2, "k": 2, "v": 2})
        return gm

    return make


def _chosen(gm, options=DEFAULT_OPTIONS):
    choose_context_exchanges(gm, options=options, world=2)
    (choice,) = gm.meta[CHOICES].values()
    return choice


def test_the_exchange_is_priced_with_the_cached_mesh_calibration(marked, monkeypatch, tmp_path):
    """No cache: the reference figures, under which the all-to-all's fewer bytes win; a cache of this machine's
    figures with a message latency 100x the reference's: its 5 more messages lose to the all-gather."""
    monkeypatch.setenv("DPCOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DPCOMPILE_CALIBRATION", raising=False)
    assert _chosen(marked()).exchange == "all-to-all"
    slow = dataclasses.replace(reference_mesh(2), collective_latency_s=1e-2, cores=calibration.available_cores())
    calibration._write_cache(calibration.cache_path("gloo2"), slow)
    choice = _chosen(marked())
    assert choice.exchange == "all-gather" and choice.why_not["all-to-all"].startswith("slower: ")
    assert choice.costs["all-gather"].seconds == pytest.approx(3 * 1e-2 + choice.costs["all-gather"].bytes_moved / 1e9)
    monkeypatch.setenv("DPCOMPILE_CALIBRATION", "off")  # off: the reference figures again, the cache unread
    assert _chosen(marked()).exchange == "all-to-all"


class AttendGrouped(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def test_the_budget_headroom_limits_the_transient_beyond_the_all_gathers():
    """16 query heads over 4 key/value heads on 4 devices, messages free: the all-to-all moves fewer bytes
    but holds the whole sequence of 4 heads' queries, keys, values and output, more than the all-gather's keys
    and values, which the prediction already holds. A headroom short of the difference: the all-gather runs
    (it always fits: the prediction was checked against the budget); as much as the difference: the all-to-all."""
    free = dataclasses.replace(reference_mesh(4), collective_latency_s=0.0)
    q, k, v = torch.randn(1, 16, 8, 8), torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8)

    def chosen(headroom):
        gm = captured(AttendGrouped(), q, k, v)
        insert_sequence_exchange(gm, input_dims={"q": 2, "k": 2, "v": 2})
        options = dataclasses.replace(DEFAULT_OPTIONS, memory_headroom=headroom)
        choose_context_exchanges(gm, options=options, world=4, calibration=free)
        ((choice,), (site,)) = gm.meta[CHOICES].values(), find_exchange_sites(gm)
        return choice, exchange_costs(site.shape, 4, free)

    unlimited, costs = chosen(None)
    assert unlimited.exchange == "all-to-all"
    beyond = costs["all-to-all"].transient_bytes - costs["all-gather"].transient_bytes
    assert beyond == (16 + 4) * 8 * 16 * 4 // 4 - 4 * 8 * 16 * 4  # (queries, output + keys, values) / 4, less the kv
    tight, _ = chosen(beyond - 1)
    assert tight.exchange == "all-gather"
    assert tight.why_not["all-to-all"] == (f"its transient {costs['all-to-all'].transient_bytes:,} B is over the "
                                           f"{costs['all-gather'].transient_bytes + beyond - 1:,} B left for it")
    assert chosen(beyond)[0].exchange == "all-to-all"
