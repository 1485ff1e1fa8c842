"""The per-call exchange of an input fingerprint that the input check of a program over a mesh runs (``modules/spmd.py``).

Every call of an SPMD program all-gathers an 8-byte fingerprint of its inputs over a group, so its
cost is per call: :class:`FingerprintExchange` keeps the buffers between calls and posts the
all-gather on the process group itself (what ``dist.all_gather`` posts, less its per-call argument
checks), about 30 µs a call on a gloo group instead of 80. :func:`start_exchange` runs one, bounded by
``pm.check_inputs_timeout``, for the checks of ``modules/spmd.py`` and ``modules/mesh_exported_inputs.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dpcompile.errors import first_line
from dpcompile.runtime.distributed import CollectiveError, MeshGroup, collective_failure
from dpcompile.runtime.rank_device import group_device


class FingerprintExchange:
    """One all-gather of an int64 over ``group`` per call, its buffers kept between calls.

    >>> exchange = FingerprintExchange(tp_group)          # doctest: +SKIP
    >>> work = exchange.start(fingerprint); work.wait()   # doctest: +SKIP
    >>> exchange.finish()                                 # every rank's fingerprint  # doctest: +SKIP
    [1234, 1234]
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.device = group_device(group)
        self._buffers: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self._in_flight: tuple[torch.Tensor, list[torch.Tensor]] | None = None

    def start(self, value: int) -> dist.Work:
        """Post the all-gather of ``value``; :meth:`finish` reads the result once it is waited for."""
        buffers = self._buffers
        if buffers is None:  # the first call, or the last exchange never finished (it failed): fresh ones
            mine = torch.empty(1, dtype=torch.int64, device=self.device)
            buffers = (mine, [torch.empty_like(mine) for _ in range(self.size)])
        self._buffers = None
        mine, gathered = buffers
        mine.fill_(value)
        self._in_flight = buffers
        if torch.compiler.is_compiling():
            return dist.all_gather(gathered, mine, group=self.group, async_op=True)
        return self.group.allgather([gathered], [mine])

    def finish(self) -> list[int]:
        """Every rank's value, in rank order, of the exchange :meth:`start` posted (waited for)."""
        buffers, self._in_flight = self._in_flight, None
        assert buffers is not None, "finish() without start()"
        values = [int(t) for t in buffers[1]]
        self._buffers = buffers  # free for the next call
        return values


def start_exchange(pm: Any, group: MeshGroup, signature: list[tuple[str, str]], kind: str) -> Callable[[], list[Any] | None]:
    """Start the exchange of every rank's signature: one all-gather of an 8-byte fingerprint, bounded
    by ``pm.check_inputs_timeout``; the function returned finishes it, giving every rank's signature
    where they differ (the signatures themselves only then), None where all agree."""
    mine_value = fingerprint(signature)
    exchanges = pm.__dict__.setdefault("_exchanges", {})
    exchange = exchanges.get(group.group)
    if exchange is None:
        exchange = exchanges[group.group] = FingerprintExchange(group.group)
    timeout = pm.check_inputs_timeout

    def failed(e: BaseException) -> CollectiveError:
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            return CollectiveError(
                f"global rank {dist.get_rank()} waited {timeout:g}s for the other ranks of its {kind} "
                "group to call forward: every rank must call pm(...) each step. Set "
                "pm.check_inputs_timeout (seconds; default DPCOMPILE_SPMD_TIMEOUT or 300) to wait longer or "
                "fail sooner, and pass timeout= to torch.distributed.init_process_group to bound the other "
                f"collectives. ({first_line(e)})"
            )
        return collective_failure("the check that every rank calls forward alike", group.group, e)

    try:
        work = exchange.start(mine_value)
    except (RuntimeError, dist.DistError) as e:
        raise failed(e) from e

    def finish() -> list[Any] | None:
        try:
            work.wait(timeout=timedelta(seconds=timeout))
        except (RuntimeError, dist.DistError) as e:
            raise failed(e) from e
        if all(value == mine_value for value in exchange.finish()):
            return None
        signatures: list[Any] = [None] * group.size()
        dist.all_gather_object(signatures, signature, group=group.group)
        return signatures

    return finish


def fingerprint(signature: list[tuple[str, str]], _kept: dict[str, int] = {}) -> int:  # noqa: B006 - a memo
    """An 8-byte fingerprint of a signature, the same on every rank (kept by its text)."""
    text = repr(signature)
    value = _kept.get(text)
    if value is None:
        if len(_kept) >= 256:
            _kept.clear()
        value = _kept[text] = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)
    return value
