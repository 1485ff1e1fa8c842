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
nothing on the virtual devices of one process (they run one after another). A value or a pair of
options that is not built is refused by name, never ignored.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from dpcompile.errors import ArgumentError, DpCompileError

EXCHANGES = ("all-gather", "ring", "all-to-all")  # in this order the cost model breaks ties
#: what ``pm.strategies`` and ``explain`` call each exchange
EXCHANGE_NAMES = {
    "all-gather": "all-gather keys/values",
    "ring": "ring exchange of keys/values",
    "all-to-all": "head-to-sequence all-to-all",
}


@dataclass(frozen=True)
class ContextParallelOptions:
    """``context_parallel=`` checked: the exchange asked for (``"auto"``: chosen) and load balancing;
    ``memory_headroom``: the bytes each device has left under ``memory_per_device=`` beyond the
    planner's prediction, which holds the all-gather's keys and values (None: no budget given)."""

    exchange: str = "auto"
    load_balance: bool | str = "auto"
    memory_headroom: int | None = None


DEFAULT_OPTIONS = ContextParallelOptions()


def parse_context_parallel(value: Any) -> ContextParallelOptions:
    """``context_parallel=`` (None, or a dict with ``"exchange"`` and/or ``"load_balance"``) checked.

    >>> parse_context_parallel({"exchange": "all-gather"})
    ContextParallelOptions(exchange='all-gather', load_balance='auto', memory_headroom=None)
    """
    if value is None:
        return DEFAULT_OPTIONS
    if not isinstance(value, Mapping):
        raise ArgumentError(
            f"context_parallel={value!r}: expected a dict such as {{'exchange': 'auto', 'load_balance': 'auto'}} "
            "(mesh={'cp': N} turns context parallelism on; this keyword only says how)"
        )
    unknown = sorted(set(value) - {"exchange", "load_balance"})
    if unknown:
        raise ArgumentError(f"context_parallel= has no option {unknown[0]!r}: the options are 'exchange' and 'load_balance'")
    exchange = value.get("exchange", "auto")
    if exchange not in ("auto", *EXCHANGES):
        raise ArgumentError(
            f"context_parallel={{'exchange': {exchange!r}}}: expected 'auto' or one of {', '.join(map(repr, EXCHANGES))}"
        )
    balance = value.get("load_balance", "auto")
    if balance not in ("auto", True, False):
        raise ArgumentError(f"context_parallel={{'load_balance': {balance!r}}}: expected 'auto', True or False")
    if balance is True and exchange in ("ring", "all-to-all"):
        why = ("the ring's blocks are not balanced yet" if exchange == "ring" else
               "the all-to-all is balanced as it is: each device attends the whole sequence for its share of the heads")
        raise DpCompileError(
            f"context_parallel={{'exchange': {exchange!r}, 'load_balance': True}}: load balancing moves the all-gather's "
            f"causal query rows, and {why}; leave 'load_balance' out, or ask for 'all-gather'"
        )
    return ContextParallelOptions(exchange, balance)


def chosen_exchange(options: ContextParallelOptions) -> str:
    """The exchange an attention call the cost model did not see runs (no shapes): the one asked
    for, or under ``"auto"`` the all-gather, which serves every call.

    >>> chosen_exchange(DEFAULT_OPTIONS)
    'all-gather'
    """
    return options.exchange if options.exchange != "auto" else "all-gather"


# ------------------------------------------------------------------ the cost model


@dataclass(frozen=True)
class AttentionShape:
    """One attention call over the whole sequence: what the cost model reads."""

    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    value_dim: int
    itemsize: int

    @property
    def kv_bytes(self) -> int:
        """The whole sequence's keys and values."""
        return self.batch * self.kv_heads * self.seq * (self.head_dim + self.value_dim) * self.itemsize

    @property
    def qo_bytes(self) -> int:
        """The whole sequence's queries and output."""
        return self.batch * self.heads * self.seq * (self.head_dim + self.value_dim) * self.itemsize


@dataclass(frozen=True)
class ExchangeCost:
    """One exchange of one attention call, per device, forward and backward: the bytes it sends,
    its messages (collectives or point-to-point steps), the bytes it holds at once beyond its own
    shards in forward (backward holds as much again in gradients) and the time the calibration
    gives them (``messages x latency + bytes / bandwidth``, nothing overlapped)."""

    exchange: str
    bytes_moved: int
    messages: int
    transient_bytes: int
    seconds: float


@dataclass(frozen=True)
class ExchangeChoice:
    """The exchange chosen for one attention call, every exchange's cost, and why each other lost."""

    exchange: str
    costs: dict[str, ExchangeCost]
    why_not: dict[str, str]


def exchange_costs(shape: AttentionShape, world: int, calibration: Any = None) -> dict[str, ExchangeCost]:
    """Each exchange's :class:`ExchangeCost` for ``shape`` over ``world`` devices (``calibration``:
    a :class:`dpcompile.analysis.calibration.Calibration`; None: the reference gloo figures;
    ``choose_context_exchanges`` passes the machine's cached mesh calibration).

    - all-gather: ``(N-1)/N`` of the keys and values, gathered in forward, again in backward, and
      their gradients reduce-scattered (3 collectives); it holds every shard of the keys and values.
    - ring: the same bytes in ``N-1`` point-to-point steps of one block forward; backward sends each
      block with its gradients ``N-1`` times and the gradients once more to their owner (``2N-1``
      messages); it holds two blocks (the one it attends, the one arriving).
    - all-to-all: ``(N-1)/N**2`` of the queries, keys, values and output, each way, forward and
      backward (8 collectives); it holds the whole sequence of ``H/N`` heads.
    """
    from dpcompile.analysis.calibration import reference_mesh

    c = calibration if calibration is not None else reference_mesh(world)
    latency = c.collective_latency_s
    bandwidth = c.collective_bytes_per_s or c.copy_bytes_per_s
    n, kv = world, shape.kv_bytes
    found = {
        "all-gather": (3 * (n - 1) * kv // n, 3, kv),
        "ring": ((n - 1) * kv // n + ((n - 1) * 2 * kv + kv) // n, 2 * n - 1, 2 * kv // n),
        "all-to-all": (2 * (n - 1) * (kv + shape.qo_bytes) // (n * n), 8, (kv + shape.qo_bytes) // n),
    }
    if n < 2:
        found = {name: (0, 0, 0) for name in found}
    return {
        name: ExchangeCost(name, moved, messages, transient, messages * latency + moved / bandwidth)
        for name, (moved, messages, transient) in found.items()
    }


def choose_exchange(options: ContextParallelOptions, shape: AttentionShape, world: int, *, calibration: Any = None,
                    memory_bytes: int | None = None, cannot: Mapping[str, str] | None = None) -> ExchangeChoice:  # fmt: skip
    """The exchange for one attention call: the one asked for; under ``"auto"`` the fastest
    exchange that can serve the call (``cannot``: exchange -> why not) and whose transient fits
    ``memory_bytes`` (None: no limit), the all-gather first where times tie; where none fits, the
    one with the smallest transient. The all-gather serves every call.

    >>> s = AttentionShape(batch=1, heads=4, kv_heads=2, seq=4096, head_dim=16, value_dim=16, itemsize=4)
    >>> choose_exchange(DEFAULT_OPTIONS, s, 4).exchange
    'all-gather'
    >>> choose_exchange(DEFAULT_OPTIONS, s, 4, memory_bytes=1 << 19).why_not["all-gather"]
    'its transient 1,048,576 B is over the 524,288 B left for it'
    """
    costs = exchange_costs(shape, world, calibration)
    refused = dict(cannot or {})
    if shape.heads % world or shape.kv_heads % world:
        refused.setdefault("all-to-all", f"the heads ({shape.heads}, key/value heads {shape.kv_heads}) do not divide "
                                         f"by {world} devices")  # fmt: skip
    if options.exchange != "auto":
        return ExchangeChoice(options.exchange, costs, {e: "not asked for" for e in EXCHANGES if e != options.exchange})
    why_not: dict[str, str] = {}
    fits = []
    for name in EXCHANGES:  # the all-gather first: it wins a tie
        if name in refused:
            why_not[name] = f"cannot serve this call: {refused[name]}"
        elif memory_bytes is not None and costs[name].transient_bytes > memory_bytes:
            why_not[name] = f"its transient {costs[name].transient_bytes:,} B is over the {memory_bytes:,} B left for it"
        else:
            fits.append(name)
    if not fits:  # nothing fits: the smallest transient the call can run
        servable = [e for e in EXCHANGES if e not in refused] or ["all-gather"]
        best = min(servable, key=lambda e: costs[e].transient_bytes)
        why_not.pop(best, None)
        return ExchangeChoice(best, costs, why_not)
    best = min(fits, key=lambda e: costs[e].seconds)
    for name in fits:
        if name != best:
            why_not[name] = f"slower: {costs[name].seconds * 1e3:.3g} ms against {costs[best].seconds * 1e3:.3g} ms"
    return ExchangeChoice(best, costs, why_not)


#: ``node.meta`` key where each lowered attention call carries its :class:`ExchangeChoice`
CHOICE_META = "dpcompile_exchange"
#: ``gm.meta`` key where the program keeps every attention call's :class:`ExchangeChoice`, by the call's name
CHOICES_META = "dpcompile_exchanges"
#: mesh dimensions beside ``cp`` whose lowering runs only the all-gather today
_ALL_GATHER_ONLY = ("tp", "pp")


def check_exchange_composes(options: ContextParallelOptions, dims: Collection[str]) -> None:
    """Refuse, by name, an exchange or load balancing asked for with mesh dimensions whose lowering
    does not build them (beside ``tp`` or ``pp`` the keys and values are all-gathered, unbalanced).

    >>> check_exchange_composes(ContextParallelOptions(load_balance=True), ("cp", "tp"))
    Traceback (most recent call last):
    ...
    dpcompile.errors.DpCompileError: context_parallel={'load_balance': True} is built for 'cp' alone or with 'dp', not beside 'tp' yet: pass load_balance='auto' or False
    """
    others = [d for d in _ALL_GATHER_ONLY if d in dims]
    if options.exchange not in ("auto", "all-gather") and "cp" in dims and others:
        raise DpCompileError(
            f"context_parallel={{'exchange': {options.exchange!r}}} with {others[0]!r} in the mesh is not built yet: "
            "beside 'tp' or 'pp' the keys and values are all-gathered; leave 'exchange' out or ask for 'all-gather'"
        )
    beside = [d for d in dims if d not in ("dp", "cp")]
    if options.load_balance is True and beside:
        raise DpCompileError(
            f"context_parallel={{'load_balance': True}} is built for 'cp' alone or with 'dp', not beside "
            f"{', '.join(map(repr, beside))} yet: pass load_balance='auto' or False"
        )


def exchange_strategy(nodes: Any) -> str | None:
    """``pm.strategies["cp"]`` from the choices the attention calls among ``nodes`` carry (None where
    none carries one): the exchange, or each exchange with its share of the calls."""
    by_call = {}
    for node in nodes:
        choice = node.meta.get(CHOICE_META)
        if choice is not None:
            by_call[str(node.meta.get("dpcompile_source", node.name))] = choice.exchange
    if not by_call:
        return None
    counts = Counter(by_call.values())
    if len(counts) == 1:
        return f"context parallel ({EXCHANGE_NAMES[next(iter(counts))]})"
    shares = ", ".join(f"{EXCHANGE_NAMES[e]} at {n} of {len(by_call)} attention calls" for e, n in sorted(counts.items()))
    return f"context parallel ({shares})"


__all__ = [
    "CHOICE_META", "CHOICES_META", "DEFAULT_OPTIONS", "EXCHANGES", "EXCHANGE_NAMES", "AttentionShape",
    "ContextParallelOptions", "ExchangeChoice", "ExchangeCost", "check_exchange_composes", "choose_exchange",
    "chosen_exchange", "exchange_costs", "exchange_strategy", "parse_context_parallel",
]  # fmt: skip
