"""The placement of a value in a data-parallel program.

=====================  ==========================================================
``Split(dim)``         one chunk per device; concatenating along ``dim`` gives it
``REPLICATED``         the same value on every device; carries no batch (also the layout
                       of a whole tensor on every shard in :mod:`~dpcompile.analysis.sharding`)
``BatchSize``          a per-device Python value (``x.size(0)``) that differs by chunk
``Partial(kind)``      per-device partial results awaiting a reduction (``sum``/``mean``)
``Whole(batch)``       computed once, on the primary device (after a gather)
``Tuple(items)``       a tuple-valued node (an LSTM's ``out, (h, c)``): one placement each
``Packed(dim)``        a PackedSequence whose batch is split (``dim`` of the padded input)
``LocalOrder(...)``    split on dim 0, each device's rows in an order of its own (a sort
                       along the batch); never gathered (``batch_rules.local_order``)
=====================  ==========================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field


class Placement:
    """Base class; placements are small immutable values."""

    per_device = True


@dataclass(frozen=True)
class Split(Placement):
    dim: int
    origin: str | None = None  # the input placeholder it came from, while its dim is unchanged


@dataclass(frozen=True)
class LocalOrder(Split):
    """Split on dim 0, each device's chunk holding its own rows in an order of its own, made by
    ``root`` (a sort along the batch): the chunks exist per device only and are never gathered.
    ``kind`` says what the values are: ``rows``, ``keys`` (the sorted non-negative integer keys),
    ``positions`` (into the sorted dim's chunk, floor-divided by ``step``), ``blank`` (a fresh
    tensor shaped like positions), ``arange`` (``0..n-1`` of the chunk; ``root`` is the arange),
    ``inverse`` (the permutation undoing the order), ``counts``/``offsets`` (the rows per key)."""

    root: str = ""
    kind: str = "rows"
    step: int = 1


@dataclass(frozen=True)
class Replicated(Placement):
    pass


REPLICATED = Replicated()


@dataclass(frozen=True)
class BatchSize(Placement):
    """A Python value read from a chunk's shape along its split dim (or a shape holding one)."""

    shape_of_dim: int | None = None  # for ``x.shape``: where the batch size sits; None for an int
    rows: bool = False  # ``b * t``: the batch size times a per-sample size (the rows of ``(b, t, ...)``)


@dataclass(frozen=True)
class Partial(Placement):
    kind: str  # "sum" or "mean"


@dataclass(frozen=True)
class Whole(Placement):
    batch: bool = True
    reason: str | None = field(default=None, compare=False)  # why it cannot run split (explain's ``whole``)
    per_device = False


@dataclass(frozen=True)
class Tuple(Placement):
    items: tuple[Placement, ...]


@dataclass(frozen=True)
class Packed(Placement):
    dim: int


def carries_batch(p: Placement) -> bool:
    if isinstance(p, (Split, BatchSize, Packed, Partial)):
        return True
    if isinstance(p, Whole):
        return p.batch
    if isinstance(p, Tuple):
        return any(carries_batch(i) for i in p.items)
    return False

