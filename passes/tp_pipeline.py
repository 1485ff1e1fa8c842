"""The tensor-parallel pipeline: ``shard_linear`` (one shard's program) then ``expand_shards``.

    capture ─► hoist_flatten_parameters ─► shard_linear ─► expand_shards

``options.plan`` is the ``{module path: style}`` dict to apply (already chosen by
``dpcompile.tensor_parallel`` for ``tensor_parallel=True``). The SPMD lowering stops after
``shard_linear`` and lowers its collectives to ``torch.distributed`` instead.
"""

from __future__ import annotations

import functools

from dpcompile.infra import Pass
from passes.tensor_parallel import expand_shards, shard_linear


def spmd_tensor_parallel_pipeline(options) -> list[Pass]:
    """``shard_linear`` alone: the program of one shard, collectives explicit."""
    return [functools.partial(shard_linear, plan=dict(options.plan), devices=options.devices)]


def tensor_parallel_pipeline(options) -> list[Pass]:
    """Lower a tidied graph to single-process tensor-parallel code over ``options.devices``."""
    return [
        *spmd_tensor_parallel_pipeline(options),
        functools.partial(expand_shards, devices=options.devices, output_device=options.output_device),
    ]


__all__ = ["spmd_tensor_parallel_pipeline", "tensor_parallel_pipeline"]
