"""A check deferred to the next collective (the SPMD input check, overlapped with the program's
local work) runs before that collective, once, and never after it was settled."""

from __future__ import annotations

import pytest
import torch

from dpcompile.runtime import distributed


def test_deferred_check_runs_once_when_settled():
    """settle_deferred_check runs the deferred check once; a second settle does nothing."""
    ran = []
    distributed.defer_to_next_collective(lambda: ran.append(1))
    distributed.settle_deferred_check()
    distributed.settle_deferred_check()
    assert ran == [1]


def test_deferring_again_settles_the_earlier_check_first():
    """A check deferred while another is pending runs the earlier one at once."""
    ran = []
    distributed.defer_to_next_collective(lambda: ran.append("first"))
    distributed.defer_to_next_collective(lambda: ran.append("second"))
    assert ran == ["first"]
    distributed.settle_deferred_check()
    assert ran == ["first", "second"]


def test_deferred_check_fails_the_next_collective_before_it_runs(world_of_one):
    """A failing deferred check raises from the next all_reduce, which then does not run; the
    collective after it runs normally."""
    x = torch.ones(3)

    def disagree():
        raise ValueError("inputs differ")

    distributed.defer_to_next_collective(disagree)
    with pytest.raises(ValueError, match="inputs differ"):
        distributed.all_reduce(x, world_of_one)
    torch.testing.assert_close(distributed.all_reduce(x, world_of_one), x)


def test_deferred_check_runs_before_an_all_gather(world_of_one):
    """all_gather settles the deferred check first, then gathers."""
    ran = []
    distributed.defer_to_next_collective(lambda: ran.append("checked"))
    out = distributed.all_gather(torch.arange(4.0), world_of_one, dim=0)
    assert ran == ["checked"]
    torch.testing.assert_close(out, torch.arange(4.0))
