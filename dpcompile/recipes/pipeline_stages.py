"""What every one-process pipeline does with its stages, sharded or not: weigh them (FLOPs, where
the cut goes), place them (each stage's tensors on its device, in place), and check that a
sequence pipeline (``cp`` over ``pp``) has the examples it finds the sequence from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.analysis.graph_view import find_linear_chains
from dpcompile.analysis.linear_sites import find_linear_sites
from dpcompile.analysis.sharding_rules import is_shard_transparent
from dpcompile.analysis.split_fraction import node_flops, node_flops_from_shapes
from dpcompile.devices import Devices
from dpcompile.errors import DpCompileError
from dpcompile.fx_utils import propagate_shapes
from dpcompile.progress import step_bar
from passes.borrowed_modules import find_module_homes, node_tensors
from passes.split_stages import STAGE, StagePlan


def unpair_across_cuts(
    gm: fx.GraphModule, styles: Mapping[str, str], plan: StagePlan
) -> tuple[dict[str, str], dict[str, str]]:
    """``(styles, reasons)``: an automatic tensor-parallel plan whose column → row pairs a stage
    boundary of ``plan`` cuts (no cut of ``Linear, ReLU, Linear`` into 2 stages keeps the pair
    whole; stages exchange whole values) planned unpaired instead::

        before: 0: column | 2: row              (cut before '2': '0''s shards read in stage 1)
        after:  0: column (gathered in stage 0) | 2: replicate

    The row layer stays whole where its input is computed before the cut (the column layer's
    output is gathered in its own stage); the column layer where all of its readers follow the
    cut (the row layer splits the whole value it receives); both where the cut falls between
    the ops that join them. A column layer whose output another column layer reads (gathered
    before it) stays whole where the cut falls between them (``l1, ReLU | l2, ReLU, l3``)."""
    sites = find_linear_sites(gm)
    modules = dict(gm.named_modules())
    by_name = {site.node.name: path for path, site in sites.items()}
    chains = find_linear_chains(gm, {s.node for s in sites.values()}, lambda n: is_shard_transparent(n, modules))
    nodes = {n.name: n for n in gm.graph.nodes}
    out, reasons = dict(styles), {}
    for a, b in chains:
        col, row = by_name[a], by_name[b]
        stage_a, stage_b = plan.stage_of.get(a), plan.stage_of.get(b)
        if styles.get(col) != "column" or stage_a == stage_b:
            continue
        fed = [n for n in nodes[b].all_input_nodes if n.op != "get_attr"]
        if styles.get(row) != "row":  # a layer reading whole values: the column layer's shards would cross the cut
            whole = [col]
        elif all(plan.stage_of.get(n.name) == stage_a for n in fed):
            whole = [row]
        elif all(plan.stage_of.get(u.name) == stage_b for u in nodes[a].users):
            whole = [col]
        else:
            whole = [col, row]
        for path in whole:
            out[path] = "replicate"
            reasons[path] = (
                f"replicate: the boundary before stage {stage_b} falls between column '{col}' (stage {stage_a}) "
                f"and {styles.get(row, 'replicate')} '{row}'; stages exchange whole values"
            )
    return out, reasons


def place_stages(
    program: fx.GraphModule, devices: Devices, *, borrow: bool = False, model: nn.Module | None = None
) -> None:
    """Move each stage's modules, parameters and buffers to its device, in place (as the PyTorch
    model-parallel tutorial does: ``self.seq1.to("cuda:0")``). A module whose tensors an earlier
    stage on another device holds (tied weights) stays there: with ``borrow`` the later stage calls
    a replica of it (``passes/borrowed_modules.py``), without it the call is refused, with the way out.

    A buffer is moved by replacing it where ``program`` holds it; ``model`` (whose state the program
    adopts) gets the moved buffer too, where it holds the old one: a buffer of the model's root that
    forward reads (``h + self.shift``) is the program's own copy, not a submodule they share."""
    homes = find_module_homes(program, devices)
    moves: list[tuple[nn.Module | None, str, torch.Tensor, int]] = []
    seen: set[int] = set()
    for node, s in homes.items():
        if not borrow and node.op == "call_module" and s != node.meta[STAGE]:
            raise DpCompileError(
                f"'{node.target}' (stage {node.meta[STAGE]}, {devices[node.meta[STAGE]]}) holds a tensor stage {s} "
                f"({devices[s]}) holds too (tied weights, or a module called in two stages); it cannot live on both "
                "devices. Name stage boundaries (pipeline=[...module paths...]) that keep both in one stage"
            )
        for module, name, tensor in node_tensors(program, node):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                moves.append((module, name, tensor, s))
    bar = step_bar("Placing weights", len(moves))  # transform(progress=): one step a tensor
    for module, name, tensor, s in moves:
        device = devices[s]
        bar.update()
        if tensor.device == device:
            continue
        fake_mode = getattr(tensor, "fake_mode", None)
        if fake_mode is not None and isinstance(tensor, nn.Parameter):  # a placement check on fake GPUs
            with fake_mode:  # in place, as below: every module tree holding the Parameter (an exported
                tensor.data = tensor.detach().to(device)  # program's and the model's) sees the move
            tensor.fake_device = torch.device(device)  # a FakeTensor keeps its device beside its data
        elif fake_mode is not None and module is not None:
            with fake_mode:
                store = module._parameters if name in module._parameters else module._buffers
                moved = tensor.detach().to(device)
                store[name] = (
                    nn.Parameter(moved, requires_grad=tensor.requires_grad) if store is module._parameters else moved
                )
        elif isinstance(tensor, nn.Parameter):
            tensor.data = tensor.data.to(device)  # the same Parameter: optimizers built on it still hold it
        elif module is not None:
            module._buffers[name] = tensor.to(device)
        held = module._buffers.get(name) if module is not None else None
        if model is not None and held is not None and held is not tensor:
            _replace_buffer(model, tensor, held)


def _replace_buffer(model: nn.Module, old: torch.Tensor, new: torch.Tensor) -> None:
    """Every slot of ``model`` holding the buffer ``old`` holds ``new`` instead."""
    for owner in model.modules():
        for key, value in owner._buffers.items():
            if value is old:
                owner._buffers[key] = new


def stage_weights(gm: fx.GraphModule, example_inputs: Sequence[Any] | None) -> dict[str, int] | None:
    """The examples' shapes propagated through ``gm`` and each node's FLOPs, which weigh where the
    stages are cut; None without examples."""
    if example_inputs is None:
        return None
    shaped = propagate_shapes(gm, list(example_inputs), check=True)
    # counted from the shapes just recorded: not a second fake run of the whole program (a second or more a rank)
    return (node_flops_from_shapes(gm) if shaped else None) or node_flops(gm, list(example_inputs))


def check_sequence_pipeline(example_inputs: Sequence[Any] | None) -> None:
    """A pipeline with ``cp`` (its micro-batches pieces of the sequence) finds them from examples
    (``schedule=`` is checked with the keywords: GPipe only, ``dpcompile.keywords``)."""
    if example_inputs is None:
        raise DpCompileError(
            "context parallel (a 'cp' dimension in mesh=) finds the sequence and attention's shapes from examples: "
            "pass example_inputs= or example_kwargs= (e.g. input_ids=, labels=)"
        )


__all__ = ["check_sequence_pipeline", "place_stages", "stage_weights"]
