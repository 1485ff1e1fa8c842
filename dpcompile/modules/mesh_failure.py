"""A rank that raises inside a pipeline step over a mesh: every rank raises the same error at once.

A step sends and receives between the stages (``torch.distributed.pipelining``'s schedule), and
``"dp"`` and ``"tp"`` add collectives. A rank that raises inside it (an input shaped unlike its
peers', an exception in the loss on the last stage) never joins them, so its peers would wait in
``recv`` until the process group's timeout (30 minutes by default). Instead :func:`all_fail_together`
makes the failing rank

1. write its error under a key of the default store (the first rank to fail wins: ``compare_set``);
2. shut down its groups of the mesh: on gloo, a receive that nothing sends, waited on for a
   millisecond, makes gloo close every connection of the group (its answer to a timeout), so each
   peer's pending send, receive or collective with this rank fails at once ("Connection closed by
   peer"); another backend's group is aborted.

A peer whose communication fails so does the same (ranks that never talk to the failing one hear of
it through their neighbours), then reads the key: every rank raises the same
:class:`~dpcompile.CollectiveError` (a ``DpCompileError``), naming the global rank that failed and
its error. The happy path runs nothing more than a ``try``. The groups are unusable afterwards, as
after any failure inside a collective: later calls of the pipeline refuse, naming the first failure.

    before: rank 1 raises in its stage -> rank 0 waits in recv for 30 minutes
    after:  rank 1 raises in its stage -> CollectiveError("...failed on global rank 1 (IndexError: ...)"), both
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch

from dpcompile.errors import DpCompileError, first_line
from dpcompile.runtime.distributed import CollectiveError


def raise_where_any_failed(failure: BaseException | None, group: Any,
                           refusal: Callable[[list[tuple[int, str]]], BaseException]) -> None:  # fmt: skip
    """Outside a step (building or exporting a program over a mesh): every rank of ``group`` (None: the
    world) tells the others whether it failed, in one exchange, and raises where any did: its own
    ``failure``, or ``refusal([(index in the group, "Type: message"), ...])`` of the ranks that failed."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    heard: list[Any] = [None] * dist.get_world_size(group)
    with unset_fake_temporarily():  # a meta model compiles under a fake mode: the messages are sent for real
        dist.all_gather_object(heard, None if failure is None else f"{type(failure).__name__}: {failure}", group=group)
    if failure is not None:
        raise failure
    failed = [(index, message) for index, message in enumerate(heard) if message is not None]
    if failed:
        raise refusal(failed)


def built_on_every_rank(build: Callable[[], Any], group: Any,
                        refusal: Callable[[list[tuple[int, str]]], BaseException],
                        caught: type[BaseException] | tuple[type[BaseException], ...] = Exception) -> Any:  # fmt: skip
    """``build()`` on every rank of ``group``, then :func:`raise_where_any_failed` of what it raised (of
    ``caught``): so that no rank runs on alone into the program's collectives and waits there for the others."""
    failure, built = None, None
    try:
        built = build()
    except caught as e:  # told to every rank, raised on this one
        failure = e
    raise_where_any_failed(failure, group, refusal)
    return built


#: a tag no send uses: the receive posted to shut a gloo group down never completes
SHUTDOWN_TAG = 0x5EED
#: how long a rank whose communication failed waits for the failing rank's error in the store
READ_FAILURE_S = 5.0
_handled: dict[str, int] = {}  # failures handled per mesh (its ranks): the same count on each of its ranks


@contextlib.contextmanager
def all_fail_together(pm: Any) -> Iterator[None]:
    """Around the communicating part of a call of ``pm`` (a pipeline stage over a mesh): an exception on
    any rank becomes the same :class:`CollectiveError` on every rank of the mesh, at once."""
    if "step_failure" in pm.__dict__:
        raise DpCompileError(
            f"{pm.step_failure}; its process groups were shut down then, so that no rank waited: build the mesh "
            "and the pipeline again (dpcompile.transform(model, mesh, pipeline=...)) after fixing the cause"
        )
    try:
        yield
    except Exception as e:
        message = _fail_everywhere(pm, e)
        pm.step_failure = message
        raise CollectiveError(message) from e


def _fail_everywhere(pm: Any, error: Exception) -> str:
    """Tell the store (where this rank is first to fail), shut this rank's groups down, and return
    the message every rank raises."""
    import torch.distributed as dist

    from dpcompile.modules.spmd import is_communication_failure

    while error.__cause__ is not None and isinstance(error.__cause__, Exception):  # the schedule wraps a stage's
        error = error.__cause__  # exception in "[Stage 1] failed to run forward": say the stage's own
    ranks = ",".join(str(r) for r in sorted(pm.mesh.mesh.flatten().tolist()))
    _handled[ranks] = _handled.get(ranks, 0) + 1
    key = f"dpcompile/pipeline_step_failed/{ranks}/{_handled[ranks]}"
    store = dist.distributed_c10d._get_default_store()
    origin = not is_communication_failure(error)
    own = (
        f"a pipeline step over the mesh failed on global rank {dist.get_rank()} ({type(error).__name__}: "
        f"{first_line(error)})"
    )
    found = None
    if origin:
        found = store.compare_set(key, "", own).decode()
    shut_down(pm)
    if not origin:
        try:
            store.wait([key], timedelta(seconds=READ_FAILURE_S))
            found = store.get(key).decode()
        except Exception:  # noqa: BLE001 - no rank said why (one crashed): say what this rank saw
            found = (
                f"a pipeline step over the mesh failed: global rank {dist.get_rank()}'s communication with a peer "
                f"failed ({first_line(error)}), and no rank reported an error (a process most likely crashed)"
            )
    return found or own


def shut_down(pm: Any) -> None:
    """Close this rank's groups of the mesh (pp, dp, tp), so that every peer's pending communication
    with this rank fails at once instead of waiting for the group's timeout."""
    import torch.distributed as dist

    groups = {id(g): g for g in (pm.pp_group, pm.dp_group, pm.tp_group) if g is not None}
    me = dist.get_rank()
    for group in groups.values():
        try:
            if dist.get_backend(group) != "gloo":
                dist.distributed_c10d._abort_process_group(group)
                continue
            peer = next((r for r in dist.get_process_group_ranks(group) if r != me), None)
            if peer is None:
                continue
            work = dist.irecv(torch.empty(1), src=peer, group=group, tag=SHUTDOWN_TAG)
            work.wait(timedelta(milliseconds=1))  # gloo closes the group's connections on this timeout
        except Exception:  # noqa: BLE001 - the group is closed (or was already)
            pass
