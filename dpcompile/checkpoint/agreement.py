"""Over a mesh, every rank of a save or a load agrees on its outcome: all succeed, or all raise.

A save over processes is a collective (each rank writes its own slices, rank 0 switches the
checkpoint over); a load is not (each rank reads its own slices). Without agreement a rank that fails alone
(rank 0's disk, a file one rank cannot read) leaves the others waiting in an exchange, or running a
program whose ranks hold different weights. Here each rank reports its outcome once: a failing
rank at the next status exchange (:func:`~dpcompile.checkpoint.dtensors.check_peers`, at each
step of a save) or at the end; then every rank raises, the others with a
:class:`~dpcompile.checkpoint.files.CheckpointError` naming the rank and its error. A load that
failed elsewhere leaves this rank's program waiting for a load again (``pm.needs_weights``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpcompile.checkpoint import load, save
from dpcompile.checkpoint.dtensors import PeerFailed, ranks_of, signal
from dpcompile.checkpoint.files import CheckpointError
from dpcompile.modules.weights import NEEDS_WEIGHTS

__all__ = ["load_checkpoint", "save_checkpoint"]


def agreed(what: str, pm: Any, action: Callable[[], Any]) -> Any:
    """``action()`` on every rank, its outcome agreed: a failure anywhere raises everywhere."""
    over, group = ranks_of(pm)
    if not over:
        return action()
    try:
        result = action()
    except BaseException as e:
        _settle(what, pm, e, group)
        raise
    _settle(what, pm, None, group)
    return result


def _settle(what: str, pm: Any, error: BaseException | None, group: Any) -> None:
    """Report this rank's outcome; where any rank failed, raise on this one too."""
    import torch.distributed as dist

    # a rank stopped by PeerFailed already heard the failure (in place of a gather): no second report
    if not isinstance(error, PeerFailed) and not signal(error is not None, group):
        return
    messages: list[Any] = [None] * dist.get_world_size(group)
    own = None if error is None or isinstance(error, PeerFailed) else f"{type(error).__name__}: {error}"
    dist.all_gather_object(messages, own, group=group)
    if what == "load_checkpoint":
        pm.__dict__[NEEDS_WEIGHTS] = True  # the ranks may hold different weights: none runs on them
    if error is not None and not isinstance(error, PeerFailed):
        return  # the caller re-raises this rank's own error
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(messages))
    failed = "; ".join(f"rank {r}: {m}" for r, m in zip(ranks, messages) if m is not None)
    raise CheckpointError(
        f"{what} failed on another rank, so it fails on every rank ({failed})"
        + ("; the program waits for a load again" if what == "load_checkpoint" else "")
    ) from error


@functools.wraps(save.save_checkpoint)
def save_checkpoint(pm: Any, path: str | Path, *args: Any, **kwargs: Any) -> Path:
    return agreed("save_checkpoint", pm, lambda: save.save_checkpoint(pm, path, *args, **kwargs))


@functools.wraps(load.load_checkpoint)
def load_checkpoint(pm: Any, path: str | Path, *args: Any, **kwargs: Any) -> Any:
    return agreed("load_checkpoint", pm, lambda: load.load_checkpoint(pm, path, *args, **kwargs))
