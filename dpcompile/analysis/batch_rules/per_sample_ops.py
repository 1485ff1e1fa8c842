"""Ops that treat dim 0 as the batch which the layer families do not list: antialiased
upsampling (``aten._upsample_bilinear2d_aa``, what ``F.interpolate(antialias=True)`` calls),
3-D grid sampling, ``F.softmin``, ``frexp`` (element-wise, two outputs) (``softmax`` of the negation, along one dim), and
``Tensor.__getitem__`` called as a function (fx records ``x[i]`` as ``operator.getitem``)."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from dpcompile.analysis.batch_rules.context import tuple_of
from dpcompile.analysis.batch_rules.modules import per_sample_all_dim0, per_sample_dim0
from dpcompile.analysis.batch_rules.over_dims import register_unclaimed
from dpcompile.analysis.batch_rules.pointwise import pointwise
from dpcompile.analysis.batch_rules.reductions import softmax_like
from dpcompile.analysis.batch_rules.registry import BATCH_RULES


def register() -> None:
    register_unclaimed(per_sample_dim0, ["aten._upsample_bilinear2d_aa", "aten._upsample_bicubic2d_aa"])
    register_unclaimed(per_sample_all_dim0, [torch.grid_sampler_3d, "aten.grid_sampler_3d"])
    register_unclaimed(softmax_like, [F.softmin])
    register_unclaimed(tuple_of(pointwise, 2), [torch.frexp, "frexp", "aten.frexp"])  # mantissa and exponent
    getitem = BATCH_RULES.function_rule(operator.getitem)
    if getitem is not None:
        register_unclaimed(getitem, [torch.Tensor.__getitem__])


register()
