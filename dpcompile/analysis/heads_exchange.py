"""Where context parallelism's head-to-sequence all-to-all can serve an attention call.

The all-to-all hands each of ``N`` devices the whole sequence for ``H/N`` of the heads, so the heads
(and the key/value heads under grouped-query attention) must divide by ``N``, and a mask must be
shared by every head or have one row per head. :func:`all_to_all_applies` says why not, or None;
the lowering (``passes/all_to_all_exchange.py``) and the cost model (``passes/choose_exchange.py``) read it.
"""

from __future__ import annotations

from collections.abc import Sequence

Shape = Sequence[int]


def all_to_all_applies(query: Shape | None, key: Shape | None, world: int, *, mask: Shape | None = None,
                       dim: int = 2, dropout: float | None = 0.0) -> str | None:  # fmt: skip
    """None where the all-to-all serves an attention of these shapes over ``world`` devices, else
    the reason it does not (a sentence that ends a message: "... because <reason>").

    ``query``, ``key``: ``(batch, heads, seq, head_dim)``; ``mask``: the attention mask's shape (or
    None); ``dim``: the sequence dim; ``dropout``: ``dropout_p``.

    >>> all_to_all_applies((2, 4, 8, 8), (2, 4, 8, 8), 2) is None
    True
    >>> all_to_all_applies((2, 4, 8, 8), (2, 2, 8, 8), 4)
    'its 2 key/value heads do not divide over 4 devices'
    """
    if query is None or key is None:
        return "the shapes of its queries and keys are not known (pass examples)"
    if len(query) != 4 or len(key) != 4:
        return f"its queries {tuple(query)} and keys {tuple(key)} are not (batch, heads, seq, head_dim)"
    if dim % 4 != 2:
        return f"its sequence is dim {dim}, not dim 2 after the heads"
    heads, kv_heads = query[1], key[1]
    if heads % world:
        return f"its {heads} query heads do not divide over {world} devices"
    if kv_heads % world:
        return f"its {kv_heads} key/value heads do not divide over {world} devices"
    if dropout not in (None, 0, 0.0):
        return f"it has dropout_p={dropout}"
    if mask is not None and (len(mask) > 4 or (len(mask) >= 3 and mask[-3] not in (1, heads))):
        return f"its mask {tuple(mask)} is neither shared by every head nor one per head ({heads})"
    return None


__all__ = ["all_to_all_applies"]
