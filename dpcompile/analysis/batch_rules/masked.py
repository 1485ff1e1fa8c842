"""``torch.masked`` reductions and normalisations (``masked.sum(x, dim, mask=m)``,
``masked.softmax(x, dim, mask=m)``): the op of the same name along the named dims, with a mask
split like the input (or carrying no batch). Per sample where the batch dim is none of the named
dims; without ``dim`` they reduce every dim, the batch dim among them, and run whole."""

from __future__ import annotations

import torch

from dpcompile.analysis.batch_rules.over_dims import along_dim, reduce_dims, register_unclaimed

_REDUCE = ("input", "dim")
masked = torch.masked

RULES = {
    **dict.fromkeys(
        [masked.mean, masked.prod, masked.amax, masked.amin, masked.logsumexp, masked.argmax, masked.argmin,
         ],
        reduce_dims(_REDUCE),
    ),
    masked.median: reduce_dims(_REDUCE, default=-1),
    masked.sum: reduce_dims(_REDUCE, partial="sum"),  # over the batch dim (or every dim): a partial sum
    masked.norm: reduce_dims(("input", "ord", "dim")),
    masked.var: reduce_dims(("input", "dim", "unbiased")),
    masked.std: reduce_dims(("input", "dim", "unbiased")),
    **dict.fromkeys([masked.softmax, masked.log_softmax, masked.softmin, masked.cumsum, masked.cumprod],
                    along_dim(_REDUCE)),
    masked.normalize: along_dim(("input", "ord", "dim")),
}  # fmt: skip


def register() -> None:
    for fn, rule in RULES.items():
        register_unclaimed(rule, [fn])


register()
