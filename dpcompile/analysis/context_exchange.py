"""How context parallelism's attention exchanges keys and values: the user's choice, checked once.

``transform(..., mesh={"cp": N}, context_parallel={"exchange": ..., "load_balance": ...})``:

==================  ========================================================================
``"all-gather"``    every device gathers every device's keys and values (again in backward)
``"ring"``          the key and value shards pass from device to device, one block at a time
``"all-to-all"``    heads to sequence: each device attends the whole sequence for its heads
``"auto"``          the default: the cost model chooses per attention call (``explain`` says why)
==================  ========================================================================

``load_balance``: ``"auto"`` (the default), ``True`` or ``False``: under causal attention a late
shard's queries see more keys than an early one's; balanced (zig-zag chunks inside each attention
call, ``passes.balance_causal_attention``), each device's attention does an equal share. ``"auto"``
balances over a DeviceMesh the causal calls of sequences of ``AUTO_MIN_LENGTH`` tokens or more, and
nothing on the virtual devices of one process (they run one after another). What is built is in :data:`BUILT_EXCHANGES` / :data:`LOAD_BALANCE_BUILT`; anything
else is refused by name, never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dpcompile.errors import DpCompileError

EXCHANGES = ("all-gather", "ring", "all-to-all")
#: the exchanges the lowering builds today (a name here and not in EXCHANGES is a bug)
BUILT_EXCHANGES: tuple[str, ...] = ("all-gather",)
LOAD_BALANCE_BUILT = True
#: what ``pm.strategies`` and ``explain`` call each exchange
EXCHANGE_NAMES = {
    "all-gather": "all-gather keys/values",
    "ring": "ring exchange of keys/values",
    "all-to-all": "head-to-sequence all-to-all",
}


@dataclass(frozen=True)
class ContextParallelOptions:
    """``context_parallel=`` checked: the exchange asked for (``"auto"``: chosen) and load balancing."""

    exchange: str = "auto"
    load_balance: bool | str = "auto"


DEFAULT_OPTIONS = ContextParallelOptions()


def parse_context_parallel(value: Any) -> ContextParallelOptions:
    """``context_parallel=`` (None, or a dict with ``"exchange"`` and/or ``"load_balance"``) checked.

    >>> parse_context_parallel({"exchange": "all-gather"})
    ContextParallelOptions(exchange='all-gather', load_balance='auto')
    """
    if value is None:
        return DEFAULT_OPTIONS
    if not isinstance(value, Mapping):
        raise ValueError(
            f"context_parallel={value!r}: expected a dict such as {{'exchange': 'auto', 'load_balance': 'auto'}} "
            "(mesh={'cp': N} turns context parallelism on; this keyword only says how)"
        )
    unknown = sorted(set(value) - {"exchange", "load_balance"})
    if unknown:
        raise ValueError(f"context_parallel= has no option {unknown[0]!r}: the options are 'exchange' and 'load_balance'")
    exchange = value.get("exchange", "auto")
    if exchange not in ("auto", *EXCHANGES):
        raise ValueError(
            f"context_parallel={{'exchange': {exchange!r}}}: expected 'auto' or one of {', '.join(map(repr, EXCHANGES))}"
        )
    if exchange != "auto" and exchange not in BUILT_EXCHANGES:
        raise DpCompileError(
            f"context_parallel={{'exchange': {exchange!r}}} is not built yet: the built exchanges are "
            f"{', '.join(map(repr, BUILT_EXCHANGES))}; leave 'exchange' out ('auto') or name a built one"
        )
    balance = value.get("load_balance", "auto")
    if balance not in ("auto", True, False):
        raise ValueError(f"context_parallel={{'load_balance': {balance!r}}}: expected 'auto', True or False")
    if balance is True and not LOAD_BALANCE_BUILT:
        raise DpCompileError(
            "context_parallel={'load_balance': True} is not built yet: leave it out ('auto') or pass False"
        )
    return ContextParallelOptions(exchange, balance)


__all__ = [
    "BUILT_EXCHANGES", "DEFAULT_OPTIONS", "EXCHANGES", "EXCHANGE_NAMES", "LOAD_BALANCE_BUILT",
    "ContextParallelOptions", "check_load_balance_layout", "chosen_exchange", "parse_context_parallel",
]  # fmt: skip


def check_load_balance_layout(options: ContextParallelOptions, dims: tuple[str, ...]) -> None:
    """``load_balance=True`` is built where context parallel regathers keys and values: ``cp`` alone or
    with ``dp`` (in one process or over a mesh); beside ``tp`` or ``pp`` it is refused by name.

    >>> check_load_balance_layout(ContextParallelOptions(load_balance=True), ("cp", "tp"))
    Traceback (most recent call last):
    ...
    dpcompile.errors.DpCompileError: context_parallel={'load_balance': True} is built for 'cp' alone or with 'dp', not beside 'tp' yet: pass load_balance='auto' or False
    """
    other = [d for d in dims if d not in ("dp", "cp")]
    if options.load_balance is True and other:
        raise DpCompileError(
            f"context_parallel={{'load_balance': True}} is built for 'cp' alone or with 'dp', not beside "
            f"{', '.join(map(repr, other))} yet: pass load_balance='auto' or False"
        )


def chosen_exchange(options: ContextParallelOptions, *, heads: int | None = None, world: int | None = None) -> str:
    """The exchange one attention call runs: the one asked for, or under ``"auto"`` the cost
    model's choice among :data:`BUILT_EXCHANGES` (today the all-gather; each lowering of another
    exchange rewrites the calls this names for it).

    >>> chosen_exchange(DEFAULT_OPTIONS)
    'all-gather'
    """
    return options.exchange if options.exchange != "auto" else "all-gather"
