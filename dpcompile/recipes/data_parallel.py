"""Data parallelism in one process: capture → hoist → insert_scatter_gather → ParallelModule.

    gm, flags, nones = capture_with_flags(model, ...)   # the model as a graph
    input_dims = infer_input_dims(gm, ...)              # which inputs split on which dim
    gm = frontend_pipeline(gm)                          # hoist_flatten_parameters
    program = data_parallel_pipeline(gm)                # scatter / replicate / gather

The module shares the model's parameters; a call that departs from the first one (a small
batch, the other mode, an argument left None, a flag value, a changed model) runs the
program :meth:`DataParallelRecipe.build_program` makes for it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx
from torch import nn

import passes
from dpcompile.analysis.batch_dims import infer_input_dims, propagate
from dpcompile.analysis.placement import Whole
from dpcompile.analysis.split_fraction import (
    node_flops,
    node_flops_from_shapes,
    parameter_weights,
    split_fraction,
    whole_ops,
)
from dpcompile.devices import Devices
from dpcompile.errors import ArgumentError, DpCompileError
from dpcompile.fx_utils import copy_graph, graph_module, propagate_shapes
from dpcompile.infra import run_passes
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.other_mode import swap_program
from dpcompile.program_cache import CallKey
from dpcompile.recipes.base import (
    Recipe,
    capture_with_flags,
    departing_trace,
    move_to,
    sharing_model,
)


@dataclass(frozen=True)
class DataParallelRecipe(Recipe):
    """Replicas on ``devices`` (repeated entries: virtual devices), outputs on ``output_device``.

    ``batch_dim``: None (inferred) or the dim every input splits on; ``copy_replicas``: real
    replica copies on virtual devices too (the code path of distinct GPUs); ``context_parallel``:
    ``batch_dim`` is the sequence (``mesh={"cp": N}``, ``docs/context_parallel.md``).
    """

    devices: Devices = Devices((torch.device("cpu"),))
    output_device: torch.device = torch.device("cpu")
    batch_dim: int | None = None
    copy_replicas: bool = False
    context_parallel: bool = False  # batch_dim is the sequence dim; attention all-gathers keys/values

    serves_flags: ClassVar[bool] = True
    lowers_capture: ClassVar[bool] = True
    replicates_model: ClassVar[bool] = True
    splits_batch: ClassVar[bool] = True  # type: ignore[misc]

    def compile(self, model: nn.Module, example_inputs: Sequence[Any] | None) -> ParallelModule:
        if self.context_parallel and example_inputs is None:
            raise DpCompileError(
                "context parallel (mesh={'cp': N}) finds the sequence and attention's shapes from examples: pass "
                "example_inputs= or example_kwargs= (e.g. input_ids=, labels=)"
            )
        gm, flags, nones = capture_with_flags(model, self.leaf_modules, example_inputs)
        move_to(model, self.devices.primary)
        if example_inputs is not None:
            primary = self.devices.primary
            propagate_shapes(gm, [x.to(primary) if isinstance(x, torch.Tensor) else x for x in example_inputs], check=True)
        input_dims = infer_input_dims(gm, batch_dim=self.batch_dim, example_inputs=example_inputs)
        if self.context_parallel:
            input_dims = without_sequence_replicated(gm, input_dims, example_inputs)
        gm, records = run_passes(gm, passes.frontend_pipeline(self.frontend_options(input_dims)))
        self._check_random_over_copies(gm)
        warn_if_mostly_whole(self._attention_marked(gm, input_dims), input_dims, example_inputs, len(self.devices))
        captured = graph_module(gm, copy_graph(gm.graph), type(model).__name__)
        lowered = self.lower(gm, self.devices, input_dims, recompile=False)  # the module compiles the code
        pm = ParallelModule(
            lowered, lowered.graph, recipe=self, devices=self.devices, mode="data_parallel", input_dims=input_dims,
            output_device=self.output_device, captured=captured, records=records,
            **sharing_model(model, gm, flags, nones),  # forward is Python: traced again where a call departs
        )  # fmt: skip
        replicated = replicated_inputs(gm, input_dims, example_inputs, self.batch_dim)
        pm.call_signature = dataclasses.replace(pm.call_signature, replicated=replicated)
        return pm

    def complete_other_mode(self, pm: ParallelModule, merged: fx.GraphModule, examples: Sequence[Any] | None) -> Any:
        """FSDP in one process (``pm`` holds its parameters as pieces, so it is not built again): the program
        compiled again from ``merged``, over the modules ``pm`` holds, and its program and capture swapped in."""
        return swap_program(pm, self.compile(merged, examples), "captured")

    def _options(self, devices: Devices | None = None, input_dims: Mapping[str, int | None] | None = None):
        return passes.PipelineOptions(
            devices=devices or self.devices,
            input_dims=dict(input_dims or {}),
            output_device=self.output_device,
            copy_replicas=self.copy_replicas,
            write_back_inputs=True,
            exact_random=self.exact_random,
            context_parallel=self.context_parallel,
            context_options=self.context_options,
        )

    @property
    def sequence_copies(self) -> int:
        """The dp copies of a context-parallel program (``mesh={"dp": D, "cp": C}``); 1 without."""
        return len(self.dp_devices) if self.context_parallel and self.dp_devices else 1

    def frontend_options(self, input_dims: Mapping[str, int | None] | None = None) -> passes.PipelineOptions:
        """dp copies of a context-parallel program mark attention after the batch's split (in :meth:`lower`)."""
        options = self._options(input_dims=input_dims)
        return dataclasses.replace(options, context_parallel=False) if self.sequence_copies > 1 else options

    def _check_random_over_copies(self, gm: fx.GraphModule) -> None:
        """dp copies of a context-parallel program do not draw the single-device random values yet."""
        if self.sequence_copies > 1 and self.exact_random and (sites := passes.find_random_sites(gm)):
            raise DpCompileError(
                f"mesh={{'dp': {self.sequence_copies}, 'cp': {len(self.devices)}}} does not draw random ops' single-device "
                f"values yet ('{sites[0].source}' draws): pass exact_random=False (each device draws its own values, "
                "as plain data parallelism would), set the dropout to 0, or use mesh={'cp': N} alone"
            )

    def _attention_marked(self, gm: fx.GraphModule, input_dims: Mapping[str, int | None]) -> fx.GraphModule:
        """``gm`` as the sequence split sees it: for dp copies, a copy with attention marked (``gm``
        itself is marked after the batch's split, in :meth:`lower`)."""
        if self.sequence_copies == 1:
            return gm
        marked = graph_module(gm, copy_graph(gm.graph), "Marked")
        return passes.insert_sequence_exchange(marked, input_dims=dict(input_dims)).graph_module

    def lower(
        self, gm: fx.GraphModule, devices: Devices, input_dims: Mapping[str, int | None], *, recompile: bool = True
    ) -> fx.GraphModule:
        """A captured (and tidied) graph lowered to data-parallel code for ``devices`` (dp copies of a
        context-parallel program: the batch split into the copies first, each copy's sequence then
        split over ``devices``, the copies named last)."""
        options = self._options(devices, input_dims)
        copies = self.sequence_copies
        lowering = passes.data_parallel_pipeline(options) + passes.checkpoint_pipeline(self.checkpointed, self.checkpoint_save)
        if copies > 1:
            batch_dims = infer_input_dims(gm, batch_dim=0)
            lowering = passes.sequence_copies_pipeline(options, copies=copies, batch_dims=batch_dims) + lowering
            lowering += passes.dp_copies_pipeline(1, self.dp_devices)
        lowered, _ = run_passes(gm, lowering, recompile=recompile)
        return lowered

    def build_program(self, pm: ParallelModule, key: CallKey, args: tuple, kwargs: dict) -> fx.GraphModule | None:
        captured = departing_trace(self, pm, key, args, kwargs)  # None: the main trace
        if captured is None and key.devices == len(pm.devices) and not key.batched and not key.unbatched:
            return None
        owner, graph = (pm, pm.captured.graph) if captured is None else (captured, captured.graph)
        gm = graph_module(owner, copy_graph(graph), f"ParallelModule{key.devices}")
        # inputs the examples gave without a batch dim that this call gives it: split, not replicated
        batched = {name: dim for _, name, dim, _, _ in pm.call_signature.replicated if name in key.batched}
        unbatched = dict.fromkeys(key.unbatched)  # and inputs it gives without the batch dim: replicated
        recipe = self._for_fewer_devices() if key.devices < len(pm.devices) else self
        return recipe.lower(gm, pm.devices.prefix(key.devices), {**pm.input_dims, **batched, **unbatched})

    def _for_fewer_devices(self) -> DataParallelRecipe:
        """The recipe of a call on fewer devices than the program's (a sequence shorter than the ``cp``
        devices): the all-to-all asked for by name there runs where the heads divide the devices the
        call runs on, else the all-gather (``"auto"``'s choice, in ``explain``), instead of refusing a
        call the program's own device count serves."""
        if not self.context_parallel or self.context_exchange != "all-to-all":
            return self
        return dataclasses.replace(self, context_exchange="auto")

    def retarget(self, pm: ParallelModule, devices: Devices, output_device: torch.device) -> ParallelModule:
        """``pm``'s program generated again for other ``devices`` (a loaded program moved to
        this machine's GPUs): same captured program, same parameters."""
        recipe = dataclasses.replace(self, devices=devices, output_device=output_device)
        lowered = recipe.lower(graph_module(pm, copy_graph(pm.captured.graph), "Retargeted"), devices, pm.input_dims)
        return ParallelModule(
            pm,
            lowered.graph,
            recipe=recipe,
            devices=devices,
            mode=pm.mode,
            input_dims=pm.input_dims,
            output_device=output_device,
            plan=pm.plan,
            captured=pm.captured,
            records=pm.records,
            class_name=type(pm).__name__,
            share_all_of=pm,
        )


def without_sequence_replicated(
    gm: fx.GraphModule, input_dims: Mapping[str, int | None], example_inputs: Sequence[Any] | None
) -> dict[str, int | None]:
    """Context parallel: an input whose example has no sequence dim (a classifier's ``labels`` of
    shape ``(batch,)``) or whose dim 1 is a convolution's channels (a ViT's image: its sequence is
    made inside, ``passes.split_sequence_made_inside``) is the same on every device, not split."""
    out = dict(input_dims)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, example in zip(placeholders, example_inputs or ()):
        dim = out.get(node.target)
        if dim is not None and isinstance(example, torch.Tensor) and (example.dim() <= dim or _convolved(gm, node)):
            out[node.target] = None
    return out


def refuse_features_as_sequence(
    gm: fx.GraphModule, input_dims: Mapping[str, int | None], example_inputs: Sequence[Any] | None
) -> None:
    """Context parallel over tensor-parallel shards splits each input's dim 1 as the sequence: an
    input whose dim 1 is its last, read by a Linear (an MLP's ``(batch, features)``), has none, and
    each piece would hand the Linear part of its features. Refused by name before anything is built."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, example in zip(placeholders, example_inputs or ()):
        dim = input_dims.get(node.target)
        if dim is None or not isinstance(example, torch.Tensor) or example.dim() != dim + 1:
            continue
        reader = next((u for u in node.users if u.op == "call_module" and u.args[:1] == (node,)
                       and isinstance(gm.get_submodule(str(u.target)), nn.Linear)), None)  # fmt: skip
        if reader is not None:
            raise ArgumentError(
                f"context parallelism splits dim {dim} of each input as the sequence, but {node.target!r} "
                f"{tuple(example.shape)} has no sequence there: it is the features Linear {reader.target!r} reads. "
                "Use mesh={'tp': T} (or {'dp': D, 'tp': T}) for a model without a sequence dim"
            )


def _convolved(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` is read as a convolution module's input (its dim 1: channels)."""
    return any(
        user.op == "call_module" and user.args[:1] == (node,) and isinstance(gm.get_submodule(str(user.target)), nn.modules.conv._ConvNd)
        for user in node.users
    )


def replicated_inputs(
    gm: fx.GraphModule, input_dims: Mapping[str, int | None], example_inputs: Sequence[Any] | None, batch_dim: int | None
) -> tuple[tuple[int, str, int, int, int], ...]:
    """``(position, name, dim, size, rank)`` of each tensor input the examples made replicated (a
    mask of shape ``(1, 1, L, S)`` or ``(L, S)``): ``dim`` is the dim it would split on, ``size`` the
    example's there. A call that gives it another size there, or more dims, departs
    (:meth:`~dpcompile.program_cache.CallSignature.batched`)."""
    if example_inputs is None:
        return ()
    would_split = infer_input_dims(gm, batch_dim=batch_dim)
    out = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for position, (node, example) in enumerate(zip(placeholders, example_inputs)):
        name, dim = str(node.target), would_split.get(node.target)
        if input_dims.get(node.target) is None and dim is not None and isinstance(example, torch.Tensor) and example.dim() > dim:
            out.append((position, name, dim, int(example.shape[dim]), example.dim()))
    return tuple(out)


WHOLE_WARNING_THRESHOLD = 0.10  # warn when more than this share of forward FLOPs runs whole


def warn_if_mostly_whole(
    gm: fx.GraphModule, input_dims: Mapping[str, int | None], example_inputs: Sequence[Any] | None, n_devices: int
) -> float | None:
    """Warn (once per transform) when more than 10% of forward FLOPs would run whole, naming the
    first op responsible and ``register_batch_rule``; returns the split fraction.

    With ``example_inputs`` the FLOPs are counted on fake tensors; without them each op weighs
    the parameter elements it reads (:func:`~dpcompile.analysis.split_fraction.parameter_weights`),
    so a Linear or convolution that runs whole is still caught.
    """
    if n_devices < 2:
        return None
    placements = propagate(gm, input_dims)
    if not any(isinstance(p, Whole) and p.batch for p in placements.values()):
        return 1.0
    weights = None
    if example_inputs is not None:
        weights = node_flops_from_shapes(gm) or node_flops(gm, list(example_inputs))
    measure = "FLOPs" if weights else "parameter-weighted ops"
    weights = weights or parameter_weights(gm)
    whole = whole_ops(gm, placements, weights)
    fraction = split_fraction(weights, [w.node for w in whole])
    if fraction is None or 1.0 - fraction <= WHOLE_WARNING_THRESHOLD:
        return fraction
    first = next(w for w in whole)
    warnings.warn(
        f"dpcompile: {100 * (1 - fraction):.0f}% of forward {measure} would run whole, once on the gathered "
        f"batch, not split across the {n_devices} devices: it starts at '{first.node}' ({first.target}): "
        f"{first.reason}. Teach data parallelism that op with dpcompile.register_batch_rule(target, rule) "
        "(see docs/data_parallel.md); dpcompile.explain(pm, *inputs).whole lists every op that runs whole.",
        stacklevel=4,
    )
    return fraction
