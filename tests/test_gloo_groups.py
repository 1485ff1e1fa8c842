"""tests/gloo_groups.py itself: ranks forked from the import server report each check, and
``assert_group_passed`` fails on a missing rank, a failed setup, a failed check or one not run."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tests.gloo_groups import CAPTURED, assert_group_passed, run_spawned


def _entry(rank: int, world: int, port: int, crash_rank: int, results) -> None:
    """Rank ``crash_rank`` dies without reporting; the others report their pid and the server's."""
    if rank == crash_rank:
        os._exit(3)
    results.put((rank, {"pids": (os.getpid(), os.getppid()), "passed": None}))


@pytest.mark.distributed
def test_ranks_are_separate_processes_and_a_crashed_rank_is_missing():
    outcomes = run_spawned(_entry, 3, 1, timeout=60.0)
    assert sorted(outcomes) == [0, 2]
    pids = {outcomes[r]["pids"][0] for r in outcomes}
    assert len(pids) == 2 and os.getpid() not in pids
    with pytest.raises(AssertionError, match=r"ranks \[1\] of 3 reported nothing within 60.0 s"):
        assert_group_passed(outcomes, 3, "passed", timeout=60.0)


_MARK = ("test_gloo_groups", "prepared")


def prepare_mark() -> None:
    """Called by the fork server before it forks a group that asks (``run_spawned(prepare=)``)."""
    CAPTURED[_MARK] = (os.getpid(), CAPTURED.get(_MARK, (None, 0))[1] + 1)


def _report_mark(rank: int, world: int, port: int, results) -> None:
    results.put((rank, {"mark": CAPTURED.get(_MARK), "server": os.getppid()}))


@pytest.mark.distributed
def test_the_fork_server_prepares_what_a_group_asks_for_in_itself_once():
    """Nothing is prepared for a group that does not ask; asked twice, the server calls it once, in
    itself (the ranks' parent), before it forks the ranks, and every later rank sees it."""
    mark = ["tests.test_gloo_groups:prepare_mark"]
    before = run_spawned(_report_mark, 2, timeout=60.0)
    asked = run_spawned(_report_mark, 2, timeout=60.0, prepare=mark)
    again = run_spawned(_report_mark, 2, timeout=60.0, prepare=mark)
    later = run_spawned(_report_mark, 2, timeout=60.0)
    assert [before[r]["mark"] for r in range(2)] == [None, None]
    for outcomes in (asked, again, later):
        assert [outcomes[r]["mark"] for r in range(2)] == [(outcomes[r]["server"], 1) for r in range(2)]
    assert not any(Path(p).name.startswith(f"dpcompile-fork-server-{os.getpid()}") for p in Path(tempfile.gettempdir()).iterdir())


def test_assert_group_passed_names_each_rank_that_failed():
    ok = {0: {"a": None, "b": None}, 1: {"a": None, "b": None}}
    assert_group_passed(ok, 2, "a", "b")
    with pytest.raises(AssertionError, match="rank 1, b:\nTraceback b"):
        assert_group_passed({0: ok[0], 1: {"a": None, "b": "Traceback b"}}, 2, "b")
    with pytest.raises(AssertionError, match="rank 0: c did not run"):
        assert_group_passed(ok, 2, "c")
    with pytest.raises(AssertionError, match="rank 0, setup:\nboom"):
        assert_group_passed({0: {"<setup>": "boom"}, 1: ok[1]}, 2, "a")
