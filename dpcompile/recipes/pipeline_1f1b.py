"""The program a ``schedule="1f1b"`` pipeline's training call runs, in one process.

    gm = the captured graph for the call (the main trace, or the model traced again for its modes)
    program = split_stages → insert_scatter_gather (over the call's micro-batches, also one)
              → insert_stage_transfers                   # the GPipe program's passes
    OneFOneBStep(program, stages)                        # run as units of one stage and micro-batch

``insert_scatter_gather`` runs even for one micro-batch, so a mean loss is always a partial sum
and a count per micro-batch: the step back-propagates each sum over the whole batch's count.
"""

from __future__ import annotations

import functools
from typing import Any

import passes
from dpcompile.devices import Devices
from dpcompile.fx_utils import copy_graph, graph_module
from dpcompile.infra import run_passes
from dpcompile.modules.pipeline_1f1b import OneFOneBStep
from dpcompile.program_cache import CallKey
from dpcompile.recipes.base import departing_trace
from passes.split_stages import STAGE, follow_plan


def one_f_one_b_step(recipe: Any, pm: Any, key: CallKey) -> OneFOneBStep:
    """The 1F1B step for a call as ``key`` (micro-batches, modes, None arguments, flags)."""
    captured = departing_trace(recipe, pm, key)  # None: the main trace
    owner, graph = (pm, pm.captured.graph) if captured is None else (captured, captured.graph)
    gm = graph_module(owner, copy_graph(graph), f"OneFOneB{key.devices}")
    plan = pm.stage_plan if captured is None else follow_plan(gm, pm.stage_plan)
    primary = recipe.devices.primary
    lowering = [
        passes.number_random_sites,
        functools.partial(passes.split_stages, plan=plan),
        functools.partial(passes.insert_scatter_gather, devices=Devices((primary,) * key.devices),
                          input_dims=pm.input_dims, output_device=primary),
        functools.partial(passes.insert_stage_transfers, plan=plan, devices=recipe.devices,
                          micro_batches=key.devices, output_device=recipe.output_device),
        *passes.exact_random_pipeline(passes.PipelineOptions(devices=recipe.devices, exact_random=recipe.exact_random)),
        functools.partial(passes.replicate_borrowed_modules, devices=recipe.devices),
    ]  # fmt: skip
    finishing = passes.checkpoint_pipeline(recipe.checkpointed, recipe.checkpoint_save) + passes.dp_copies_pipeline(recipe.dp_micro_batches, recipe.dp_devices)
    program, _ = run_passes(gm, lowering + finishing)
    stage_of = {n: n.meta[STAGE] for n in program.graph.nodes if STAGE in n.meta}
    return OneFOneBStep(program, stage_of, plan.stages, key.devices)


__all__ = ["one_f_one_b_step"]
