"""``FingerprintExchange``: the SPMD input check's all-gather, its buffers kept between calls."""

from __future__ import annotations

from dpcompile.modules.spmd_exchange import FingerprintExchange


def test_each_exchange_reads_its_own_value_with_the_buffers_reused(world_of_one):
    """Calls one after another give each its own value, in the same buffers."""
    exchange = FingerprintExchange(world_of_one)
    seen = []
    for value in (5, -(2**62), 7):
        exchange.start(value).wait()
        seen.append(exchange.finish())
    assert seen == [[5], [-(2**62)], [7]]
    first = exchange._buffers
    exchange.start(1).wait()
    assert exchange._in_flight is first and exchange.finish() == [1]


def test_an_exchange_never_finished_leaves_its_buffers_to_it(world_of_one):
    """A start whose finish never came (a failed wait) is not overwritten: the next start takes fresh buffers."""
    exchange = FingerprintExchange(world_of_one)
    exchange.start(3).wait()
    exchange.finish()
    kept = exchange._buffers
    unfinished = exchange.start(4)  # its finish never comes
    exchange.start(9).wait()
    assert exchange._in_flight is not kept and exchange.finish() == [9]
    unfinished.wait()
    assert int(kept[1][0]) == 4  # the unfinished exchange's buffers, untouched by the next
