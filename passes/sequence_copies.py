"""``split_batch_into_copies``: dp copies of a context-parallel program, the batch split first.

``mesh={"dp": D, "cp": C}`` in one process is ``D`` copies of the context-parallel program, as
``{"dp", "tp"}`` is ``D`` copies of the tensor-parallel one (``dpcompile.target.replicate_over_dp``).
This pass splits the batch into ``D`` pieces with data parallelism's lowering
(``insert_scatter_gather`` over ``D`` virtual devices: exact mean and sum losses, the copies' outputs
joined again), every piece on the model's own modules, and names piece ``j`` ``_mb<j>`` (as a
pipeline's micro-batches, which ``name_dp_copies`` spells ``_dp<j>`` at the end). The sequence
split then lowers this program as it lowers the model: ``insert_sequence_exchange`` marks each
piece's attention, ``insert_scatter_gather`` on the sequence dim runs every piece over the ``C``
devices (the batch's scatter and the copies' gather act on every position alone:
``dpcompile.analysis.batch_rules.dp_copies``).

Before (``D = 2``)::

    lm_head = self.lm_head(h)
    loss = cross_entropy(lm_head, labels)

After::

    h_scatter = dpcompile_runtime_scatter(h, ['cpu', 'cpu'], 0)
    h_mb0 = h_scatter[0]
    lm_head_mb0 = self.lm_head(h_mb0)
    ...
    lm_head = dpcompile_runtime_gather([lm_head_mb0, lm_head_mb1], 0, 'cpu')
    loss = cross_entropy_loss_sum / cross_entropy_count        # over both pieces' tokens
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from dpcompile import runtime
from dpcompile.analysis.batch_dims import infer_input_dims
from dpcompile.devices import Devices
from dpcompile.fx_utils import example_shapes, propagate_example_shapes
from dpcompile.infra import PassResult
from passes.data_parallel import insert_scatter_gather
from passes.stage_shards import borrow_shapes, name_own_sources, restore_shard_layouts, shard_findings
from passes.stage_transfers import run_on_own_modules

PASS = "split_batch_into_copies"
_DEVICE = re.compile(r"_dev(\d+)(?=_|$)")


def split_batch_into_copies(
    gm: fx.GraphModule, *, copies: int, batch_dims: Mapping[str, int | None], device: torch.device, label: str = "mb",
    propagate: bool = True,
) -> PassResult:
    """The batch (``batch_dims``: each input's batch dim) split into ``copies`` pieces on ``device``,
    piece ``j`` named ``_<label><j>`` (``"dp"`` where the pipeline's micro-batches are named ``_mb`` after);
    ``propagate``: the pieces' shapes propagated again on fake tensors."""
    shapes = example_shapes(gm.graph) if propagate else None
    insert_scatter_gather(gm, devices=Devices((device,) * copies), input_dims=batch_dims, output_device=device)
    run_on_own_modules(gm)
    for node in gm.graph.nodes:
        name = node.name
        if not _DEVICE.search(name) and _DEVICE.search(str(node.meta.get("dpcompile_name", ""))):
            name = node.meta.pop("dpcompile_name")  # a call on the model's own module, named as the piece's was
        if _DEVICE.search(name):
            node._rename(_DEVICE.sub(lambda m: f"_{label}{m.group(1)}", name))
    gm.recompile()
    propagate_example_shapes(gm, gm.graph, shapes, device)  # the sequence's rules read shapes (views)
    return PassResult(gm, True, {"copies": copies, "batch_dims": dict(batch_dims)})


def split_one_shard_batch(
    gm: fx.GraphModule, *, copies: int, device: torch.device, shapes: Mapping[str, Mapping[str, Any]]
) -> PassResult:
    """:func:`split_batch_into_copies` on ``shard_linear``'s one-shard program (``{"dp", "cp", "tp"}``:
    dp copies of the cp x tp program, before attention is marked). A one-shard program does not run on
    fake tensors, so each copy's node reads the whole batch's shape record of the node it was made from
    (``shapes``, by the captured node's name, as a pipeline's micro-batches do) and its shard layout.

    Before (``copies=2``): ``qkv = linear(x_copy, qkv_weight)`` (a column shard). After:
    ``x_dp0 = x_scatter[0]`` ... ``qkv_dp0 = linear(x_dp0_copy, qkv_weight)``, ``qkv_dp1 = ...``, each
    with ``qkv``'s layout; the copies' outputs gathered along the batch."""
    found, specs = shard_findings(gm)
    captured = {n.name: n.meta.get("dpcompile_source", n.name) for n in gm.graph.nodes}  # what shapes are keyed by
    name_own_sources(gm)
    batch_dims = infer_input_dims(gm, batch_dim=0)
    split_batch_into_copies(gm, copies=copies, batch_dims=batch_dims, device=device, label="dp", propagate=False)
    restore_shard_layouts(gm, found, specs)  # each copy's node: the layout of the one-shard node it was made from
    for node in gm.graph.nodes:
        own = node.meta.get("dpcompile_source", node.name)
        node.meta["dpcompile_source"] = captured.get(own, own)
    borrow_shapes(gm, shapes)
    for node in gm.graph.nodes:  # the batch's scatter: one (whole-shaped) record per copy
        if node.op == "call_function" and node.target is runtime.scatter and isinstance(node.meta.get("val"), torch.Tensor):
            node.meta["val"] = (node.meta["val"],) * copies
    return PassResult(gm, True, {"copies": copies, "batch_dims": dict(batch_dims)})


__all__ = ["split_batch_into_copies", "split_one_shard_batch"]
