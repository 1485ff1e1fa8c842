"""Context parallel over a ``("dp", "cp")`` DeviceMesh: the whole batch's mean, as one rank's
generated code calls it (``passes.lower_sequence_to_rank`` writes the calls).

Over ``("dp", "cp")`` every rank holds its dp rows' part of the sequence, and DDP (or FSDP) over
the flattened ``dp_cp`` ranks averages what each rank backwards. A mean over every token (a loss
with ``reduction="mean"``, ``labels=`` of a language model) is reduced over all ``dp x cp`` ranks,
not over the rank's ``cp`` group: its sum and its count (tokens not ignored) both, so it is the
single-device batch's mean even where the dp ranks count different numbers of tokens (``-100``
labels spread unevenly), where an average of each dp group's mean is not.
"""

from __future__ import annotations

from typing import Any

import torch

from dpcompile.runtime.distributed import GroupLike, mean_over_group, scale_gradient

__all__ = ["mean_over_batch"]


def mean_over_batch(partial_sum: torch.Tensor, count: Any, group: GroupLike, replicas: int) -> torch.Tensor:
    """``sum / count`` over every rank of ``group`` (the flattened ``dp x cp`` ranks): the whole
    batch's mean, the same value on every rank. Backward: this rank's share of its gradient, times
    ``replicas`` (the dp size): every dp rank backwards the same whole mean and DDP averages over dp,
    so the average of ``replicas`` times each rank's share is their sum, the single-device gradient.

    >>> loss = mean_over_batch(loss_sum_dev1, loss_count_dev1, dp_cp_group, 2)  # doctest: +SKIP
    """
    return scale_gradient(mean_over_group(partial_sum, count, group), float(replicas))
