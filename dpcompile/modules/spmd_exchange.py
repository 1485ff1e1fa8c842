"""The per-call exchange of an input fingerprint that the input check of a program over a mesh runs (``modules/spmd.py``).

Every call of an SPMD program all-gathers an 8-byte fingerprint of its inputs over a group, so its
cost is per call: :class:`FingerprintExchange` keeps the buffers between calls and posts the
all-gather on the process group itself (what ``dist.all_gather`` posts, less its per-call argument
checks), about 30 µs a call on a gloo group instead of 80.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_device(group: dist.ProcessGroup) -> torch.device:
    """Where a group's collectives take their tensors: the current GPU for NCCL, else the CPU."""
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
