"""Communication cost under ring algorithms, in elements each device sends.

For a collective over ``n`` devices on a tensor of ``size`` elements (the full, unsharded
tensor):

=================  ===================
all_reduce         ``2 (n-1)/n * size``
all_gather         ``(n-1)/n * size``
reduce_scatter     ``(n-1)/n * size``
scatter, gather,   ``(n-1)/n * size``  (one device sends or receives all but its own share)
broadcast, reduce
=================  ===================
"""

from __future__ import annotations

RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "reduce": lambda n: (n - 1) / n,
}


def ring_elements(kind: str | None, size: int, n: int) -> float:
    """Elements each device sends for collective ``kind`` on a ``size``-element tensor.

    >>> ring_elements("all_reduce", 64_000, 2)
    64000.0
    """
    if kind is None or n <= 1:
        return 0.0
    try:
        return RING_FACTOR[kind](n) * size
    except KeyError:
        raise ValueError(f"unknown collective {kind!r}; known: {sorted(RING_FACTOR)}") from None
