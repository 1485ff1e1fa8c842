"""``explain``: what a program runs, where, and what it moves between devices.

Placement and shapes per node, parameter bytes, activation and FLOPs estimates per device,
and per collective the elements each device sends (the one rule of
:mod:`dpcompile.analysis.cost`).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch.fx as fx
from torch import nn

from dpcompile import runtime
from dpcompile.analysis.context_exchange import CHOICE_META, EXCHANGE_NAMES, EXCHANGES
from dpcompile.analysis.cost import comm_elements, ring_elements
from dpcompile.analysis.memory import activation_bytes
from dpcompile.analysis.program_memory import fsdp_pieces, held_parameter_bytes, program_memory
from dpcompile.analysis.random_ops import per_device_note, random_draws_of
from dpcompile.analysis.split_fraction import split_fraction
from dpcompile.capture import capture_fx
from dpcompile.errors import DpCompileError
from dpcompile.fx_utils import bind_inputs
from dpcompile.inspect.attention_balance import attention_balance
from dpcompile.inspect.nodes import copy_labels, device_labels, device_list, slot_of, target_name, user_source
from dpcompile.inspect.predicted_memory import planner_memory, why_not_predicted
from dpcompile.inspect.recorder import Recorder, propagate
from dpcompile.inspect.report import CollectiveInfo, NodeInfo, Report
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.executors import executor_of
from dpcompile.modules.fsdp_one_process import stage_holding
from dpcompile.runtime import sequence_mesh
from dpcompile.runtime import tensor_parallel as tp_runtime
from dpcompile.runtime.kept import tensors_kept
from passes.checkpoint_activations import with_regions_recomputed
from passes.collectives import group_size
from passes.context_parallel import EXCHANGE, OTHER_EXCHANGES
from passes.name_dp_copies import COPY
from passes.sequence_parallel import SEQUENCE_MARK
from passes.split_stages import STAGE

__all__ = ["ALL_DEVICES", "explain", "held_count", "inspected_modules", "param_bytes"]

ALL_DEVICES = "*"  # the device of a collective, which spans the devices


def _program(pm: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[fx.GraphModule, int | None]:
    """The program that a call with these arguments runs, and the call's batch size."""
    if not isinstance(pm, ParallelModule):  # a hand-built program: it is what runs
        return pm, None
    return pm.program_for_call(*args, **kwargs), pm.batch_size(tuple(args), dict(kwargs))


# ---------------------------------------------------------------------------------- explain
def explain(pm: nn.Module, *args: Any, **kwargs: Any) -> Report:
    """Explain what ``pm(*args, **kwargs)`` runs, where, and what it moves between devices.

    Shapes come from fake tensors (no real compute); without arguments the report has no
    shapes, activation or communication figures, only placement and parameter bytes.

    >>> import torch, dpcompile
    >>> pm = dpcompile.transform(torch.nn.Linear(8, 4), ["cpu", "cpu"])
    >>> r = dpcompile.explain(pm, torch.randn(16, 8))
    >>> r.io_elements_forward  # the input scattered, the output gathered, each (N-1)/N*S
    96.0

    ``pm`` and the model it holds are left as they were, also where explain raises: every
    parameter and buffer slot holds the same object, every parameter the same grad.
    """
    with tensors_kept(*inspected_modules(pm)):
        return _explain(pm, args, kwargs)


def inspected_modules(pm: nn.Module) -> list[nn.Module]:
    """``pm`` and the models it keeps beside its own modules (the captured graph, the traced model)."""
    held = (getattr(pm, "captured", None), getattr(pm, "traced_model", None))
    return [pm, *(m for m in held if isinstance(m, nn.Module))]


def _explain(pm: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Report:
    labels = own_labels = device_labels(pm)
    copies = None
    if (found := copy_labels(pm)) is not None:  # dp copies of a pipeline or tensor-parallel program
        copies, labels = found
    n = len(labels)
    gm, batch = _program(pm, args, kwargs) if (args or kwargs) else (pm, None)
    if not isinstance(gm, fx.GraphModule):
        raise DpCompileError(
            f"explain needs a dpcompile.ParallelModule (a torch.fx.GraphModule), got {type(pm).__name__}"
        )
    recorder, how = (None, "none")
    if args or kwargs:
        recorder, how = propagate(gm, bind_inputs(gm, args, kwargs))
    active = labels if batch is None or batch >= n else labels[:batch]
    n_active = len(active)

    nodes: list[NodeInfo] = []
    collectives: list[CollectiveInfo] = []
    activation = dict.fromkeys(labels, 0)
    flops = dict.fromkeys(labels, 0)
    regathered: set[tuple[str, ...]] = set()  # the shard lists of keys and values already counted
    for node in gm.graph.nodes:
        slot = slot_of(node)
        comm = node.meta.get("dpcompile_comm")
        if node.op in ("placeholder", "output"):
            device = "-"
        elif comm is not None:
            device = ALL_DEVICES
        elif copies is not None and slot is not None and slot < len(own_labels):
            device = copies[node.meta.get(COPY) or 0][slot]
        elif slot is not None and slot < n:
            device = labels[slot]
        else:
            device = labels[0]
        summary = recorder.summaries.get(node.name) if recorder else None
        info = NodeInfo(
            name=node.name,
            op=node.op,
            target=target_name(node),
            device=device,
            shape=summary[0] if summary else None,
            dtype=summary[1] if summary else None,
            bytes=summary[2] if summary else 0,
            flops=recorder.flops.get(node.name, 0) if recorder else 0,
            pass_name=node.meta.get("dpcompile_pass"),
            source=user_source(node),
            comm=comm.kind if comm is not None else None,
        )
        nodes.append(info)
        counts_as_activation = node.op in ("call_function", "call_method", "call_module") and node.target not in (
            operator.getitem,
            runtime.replicate,
            getattr,
        )
        if counts_as_activation and info.bytes:
            if device in activation:
                activation[device] += info.bytes
            elif comm is not None and comm.kind in ("gather", "reduce"):
                activation[labels[0]] += info.bytes
            else:
                for label in active:
                    activation[label] += info.bytes // n_active
        if info.flops:
            flops[device if device in flops else labels[0]] += info.flops
        if comm is not None:
            collectives.append(_collective(node, comm, recorder, n_active))
        elif node.op == "call_function" and node.target in (runtime.attention_regathered, runtime.ring_attention,
                                                              runtime.balanced_attention):
            collectives.extend(_regathered(node, recorder, n_active, regathered))

    ddp = _ddp_collective(pm)
    if ddp is not None:
        collectives.append(ddp)
    forward = sum(c.forward or 0.0 for c in collectives if not c.io)
    backward = sum(c.backward or 0.0 for c in collectives if not c.io)
    io_forward = sum(c.forward or 0.0 for c in collectives if c.io)
    io_backward = sum(c.backward or 0.0 for c in collectives if c.io)
    params = param_bytes(pm)
    pipeline = _pipeline_report(pm, gm, recorder, own_labels, batch)
    if pipeline is not None and not getattr(pm, "stage_groups", None):  # one device per stage
        params = {own_labels[st["stage"]]: st["param_bytes"] for st in pipeline["stages"]}
    if copies is not None and fsdp_pieces(pm):  # FSDP: each copy holds its pieces at copy 0's places
        held = _fsdp_copy_bytes(pm, copies, own_labels, pipeline)
        params = {label: held[label] for label in labels}
    elif copies is not None:  # each copy holds copy 0's parameters on its own devices
        held = {copy[k]: params.get(label, 0) for copy in copies for k, label in enumerate(own_labels)}
        params = {label: held[label] for label in labels}
    splits_batch = getattr(getattr(pm, "recipe", None), "splits_batch", True)  # a hand-built program: as dp's
    fraction, whole = _split_flops(gm, recorder) if splits_batch else (None, [])
    basis: dict[str, str] = {}  # what memory_estimate is, set as it is made
    return Report(
        mode=str(getattr(pm, "mode", "unknown")),
        devices=labels,
        shapes=how,
        nodes=nodes,
        collectives=collectives,
        comm_elements_forward=forward,
        comm_elements_backward=backward,
        io_elements=io_forward + io_backward,
        io_elements_forward=io_forward,
        io_elements_backward=io_backward,
        param_bytes=params,
        activation_bytes=activation,
        flops=flops,
        imbalance={
            "param_bytes": _imbalance(params),
            "activation_bytes": _imbalance(activation),
            "flops": _imbalance(flops),
        },
        plan=dict(getattr(pm, "plan", {}) or {}),
        plan_reasons={k: str(v) for k, v in (getattr(pm, "plan_reasons", {}) or {}).items()},
        batch=batch,
        splits_batch=splits_batch,
        split_flop_fraction=fraction,
        whole=whole,
        pipeline=pipeline,
        memory_estimate=functools.partial(_estimate_kept, pm, params, args, kwargs,
                                          sequence_shares(gm, nodes, activation), labels, basis=basis),  # fmt: skip
        memory_estimate_basis=functools.partial(basis.get, "basis", ""),
        checkpoint_regions={
            n.name: n.meta["dpcompile_region"] for n in gm.graph.nodes if "dpcompile_region" in n.meta
        },
        random={**random_draws_of(gm), "note": per_device_note(gm)},
        context_parallel=_context_parallel(pm, gm, activation, recorder),
        sequence_parallel=sequence_parallel_report(pm, gm, nodes, activation),
        layout={
            name: f"{size}: {(getattr(pm, 'strategies', None) or {}).get(name, name)}"
            for name, size in (getattr(pm, "layout", None) or {}).items()
        },
        candidates=[c.to_dict() for c in getattr(pm, "candidates", None) or ()],
    )


def _activation_without_sequence(gm: fx.GraphModule, nodes: Sequence[NodeInfo],
                                 activation: Mapping[str, int]) -> dict[str, int]:  # fmt: skip
    """Each device's activation bytes were the values on sequence shards whole on the first device,
    as tensor parallel alone holds them."""
    labels = list(activation)
    without = dict(activation)
    marked = {n.name for n in gm.graph.nodes if n.meta.get(SEQUENCE_MARK)}
    for info in nodes:
        if info.name in marked and info.device in without and info.bytes:
            without[info.device] -= info.bytes
            without[labels[0]] += info.bytes
    return without


def sequence_parallel_report(pm: nn.Module, gm: fx.GraphModule, nodes: Sequence[NodeInfo],
                             activation: Mapping[str, int]) -> dict[str, Any] | None:  # fmt: skip
    """What sequence parallelism on ``tp`` does: its collectives, and each device's activation bytes
    with it and without it (the values on sequence shards held whole on the first device)."""
    if not any(n.meta.get(SEQUENCE_MARK) for n in gm.graph.nodes):
        return None
    scatters = (tp_runtime.reduce_scatter_to_devices, sequence_mesh.reduce_scatter, sequence_mesh.reduce_scatter_by_all_reduce)
    gathers = (tp_runtime.all_gather_to_devices, sequence_mesh.all_gather_sequence)
    by_all_reduce = any(n.target is sequence_mesh.reduce_scatter_by_all_reduce for n in gm.graph.nodes)
    return {
        "dimension": "tp", "sequence_dim": 1,
        "reduce_scatters": sorted({n.name for n in gm.graph.nodes if n.target in scatters}),
        "all_gathers": sorted({n.name for n in gm.graph.nodes if n.target in gathers}),
        "reduce_scatter": "all_reduce_then_slice" if by_all_reduce else "reduce_scatter",  # gloo: the fallback
        "activation_bytes": dict(activation),
        "activation_bytes_without": _activation_without_sequence(gm, nodes, activation),
    }  # fmt: skip


def sequence_shares(gm: fx.GraphModule, nodes: Sequence[NodeInfo], activation: Mapping[str, int]) -> dict[str, float] | None:
    """Sequence parallel: each device's activation bytes over tensor parallel's first device's (the
    whole count's share each holds); None for other programs."""
    if not any(n.meta.get(SEQUENCE_MARK) for n in gm.graph.nodes):
        return None
    without = _activation_without_sequence(gm, nodes, activation)
    first = without[next(iter(without))] or 1
    return {d: b / first for d, b in activation.items()}


def _context_parallel(pm: nn.Module, gm: fx.GraphModule, activation: Mapping[str, int],
                      recorder: Recorder | None = None) -> dict[str, Any] | None:  # fmt: skip
    """What the ``cp`` dimension does: the sequence split, the exchange chosen and the others, and
    causal load balancing (on or off, each device's attention share)."""
    size = (getattr(pm, "layout", None) or {}).get("cp", 1)
    if size < 2:
        return None
    exchanges = (runtime.gather_sequence, runtime.attention_regathered, runtime.ring_attention,
                 runtime.sequence_of_heads, runtime.balanced_attention)
    gathers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in exchanges]
    attention = sorted({str(n.meta.get("dpcompile_source", n.name)) for n in gathers})  # the user's attention calls
    calls = exchange_calls(gm)
    chosen = [e for e in EXCHANGES if any(c["exchange"] == e for c in calls)]
    return {
        "dimension": "cp", "size": size, "sequence_dim": getattr(pm.recipe, "batch_dim", 1),
        "exchange": " + ".join(EXCHANGE_NAMES[e] for e in chosen) if chosen else EXCHANGE,
        "not_chosen": [EXCHANGE_NAMES[e] for e in EXCHANGES if e not in chosen] if chosen else list(OTHER_EXCHANGES),
        "attention": attention, "calls": calls, "activation_bytes": dict(activation),
        "load_balance": attention_balance(gm, getattr(pm.recipe, "context_load_balance", "auto"), size,
                                          list(activation), recorder.summaries if recorder else None),
    }  # fmt: skip


def exchange_calls(gm: fx.GraphModule) -> list[dict[str, Any]]:
    """Each attention call's exchange choice (``passes/ring_exchange.py``): the exchange, every
    exchange's predicted bytes, messages, transient and time, and why each other lost."""
    calls: dict[str, Any] = {}
    for node in gm.graph.nodes:
        choice = node.meta.get(CHOICE_META)
        if choice is not None:
            calls.setdefault(str(node.meta.get("dpcompile_source", node.name)), choice)
    return [
        {"attention": name, "exchange": c.exchange, "why_not": dict(c.why_not),
         "costs": {e: {"bytes_moved": k.bytes_moved, "messages": k.messages, "transient_bytes": k.transient_bytes,
                       "seconds": k.seconds} for e, k in c.costs.items()}}
        for name, c in calls.items()
    ]  # fmt: skip


def _pipeline_report(
    pm: nn.Module, gm: fx.GraphModule, recorder: Recorder | None, labels: list[str], batch: int | None
) -> dict[str, Any] | None:
    """A pipeline's stages: forward FLOPs (of a run, else the planner's), parameter and activation
    bytes and the elements each sends on, per stage; their imbalance (max/mean FLOPs) and the
    bubble ``(S-1)/(M+S-1)`` of this call's micro-batches (GPipe's and 1F1B's: 1F1B holds fewer
    micro-batches, it does not wait less)."""
    if not executor_of(pm).runs_stages_in_one_process:  # pm.stages of other programs may be the model's own submodule
        return None
    stages = pm.stages
    n = len(stages)
    flops, activation, sent = [0] * n, [0] * n, [0] * n
    for node in gm.graph.nodes:
        s = node.meta.get(STAGE)
        if s is None or recorder is None:
            continue
        flops[s] += recorder.flops.get(node.name, 0)
        summary = recorder.summaries.get(node.name)
        comm = node.meta.get("dpcompile_comm")
        if comm is not None and comm.kind == "send":
            source = node.args[0]
            elements = sum(math.prod(shape) for shape in summary[0]) if summary else 0
            sent[source.meta.get(STAGE, s) if isinstance(source, fx.Node) else s] += elements
        elif summary and node.target not in (operator.getitem, getattr) and node.op != "get_attr":
            activation[s] += summary[2]
    measure = "flops"
    if recorder is None or not any(flops):
        flops = [st.flops for st in stages]
        measure = pm.stage_plan.measure
    micro = getattr(pm, "micro_batches", 1) if batch is None else min(batch, getattr(pm, "micro_batches", 1))
    per_copy = getattr(getattr(pm, "recipe", None), "dp_micro_batches", None)  # dp composed over the pipeline
    copies = -(-micro // per_copy) if per_copy else 1
    micro = min(micro, per_copy) if per_copy else micro
    mean = sum(flops) / n if sum(flops) else 0
    return {
        "schedule": getattr(pm, "schedule", "gpipe"),
        "micro_batches": micro,
        "dp_copies": copies,
        "bubble_fraction": (n - 1) / (micro + n - 1),
        "imbalance": round(max(flops) / mean, 4) if mean else 1.0,
        "measure": measure,
        "stages": [
            {"stage": st.index, "device": _stage_label(pm, st.index, labels), "module_paths": list(st.module_paths), "flops": int(flops[st.index]),
             "param_bytes": int(st.param_bytes), "activation_bytes": int(activation[st.index]),
             "sends_elements": int(sent[st.index])}
            for st in stages
        ],
    }  # fmt: skip


def _stage_label(pm: nn.Module, s: int, labels: list[str]) -> str:
    """Stage ``s``'s device, or its devices (``cpu#2,cpu#3``) where its layers are tensor parallel."""
    groups = getattr(pm, "stage_groups", None)
    if not groups:
        return labels[s]
    t = len(groups[0])
    return ",".join(labels[s * t : (s + 1) * t])


def _estimate_kept(pm: nn.Module, *rest: Any, basis: dict[str, str] | None = None) -> dict[str, dict[str, int]]:
    """:func:`memory_estimate`, made when the report's ``memory_estimate`` is first read (a fake run of
    the model, which most reports are not asked for), leaving ``pm`` and its model as they were."""
    with tensors_kept(*inspected_modules(pm)):
        return memory_estimate(pm, *rest, basis=basis)


def memory_estimate(
    pm: nn.Module, params: Mapping[str, int], args: Sequence[Any], kwargs: Mapping[str, Any],
    sequence_share: Mapping[str, float] | None = None, labels: Sequence[str] | None = None,
    basis: dict[str, str] | None = None,
) -> dict[str, dict[str, int]]:
    """Bytes per device by kind for ``pm`` as transform was told it trains (``optimizer=``,
    ``training=``), at each device's predicted peak of a step: the planner's prediction for the layout
    that was built (:func:`dpcompile.inspect.predicted_memory.planner_memory`, ``docs/planner.md``),
    else (no inputs, FSDP, a mesh, leaf modules, an explicit plan: see ``docs/memory.md``) the
    program count of :func:`program_count`; none (``{}``) for a program loaded from a folder that keeps no
    single-device model to count its activations on (tensor-parallel shards). ``basis["basis"]``: which."""
    options = getattr(pm, "memory_options", None) or {"optimizer": None, "training": pm.training}
    basis = {} if basis is None else basis
    if labels is not None:
        predicted = planner_memory(pm, labels, args, kwargs, optimizer=options["optimizer"],
                                   training=options["training"], params=params)  # fmt: skip
        if predicted is not None:
            basis["basis"] = "the planner's prediction of the layout built (docs/planner.md)"
            return predicted
    why = why_not_predicted(pm) or ("no inputs" if not (args or kwargs) else "the planner's fake run of these inputs failed")
    counted = getattr(pm, "captured", None) or getattr(pm, "traced_model", None)
    if (args or kwargs) and not isinstance(counted, nn.Module) and "profiled_model" not in pm.__dict__:
        basis["basis"] = (f"none: {why}, so its activations cannot be counted; explain the program transform built, "
                          "or transform the model again")  # fmt: skip
        return {}
    basis["basis"] = f"the program count ({why}: docs/memory.md)"
    return program_count(pm, params, args, kwargs, sequence_share)


def held_count(pm: nn.Module, params: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """What each device of ``pm`` holds through a step, by kind, as the program is: the parameters of
    :func:`param_bytes` (``params``), their gradients and optimizer state (no activations)."""
    options = getattr(pm, "memory_options", None) or {"optimizer": None, "training": pm.training}
    return program_memory(pm, params, optimizer=options["optimizer"], training=options["training"], activations=0,
                          share=1.0)  # fmt: skip


def program_count(
    pm: nn.Module, params: Mapping[str, int], args: Sequence[Any], kwargs: Mapping[str, Any],
    sequence_share: Mapping[str, float] | None = None,
) -> dict[str, dict[str, int]]:
    """The program count: the parameters each device holds (:func:`param_bytes`), as many bytes of
    gradients, the optimizer's state, and the activations of a fake run of the inputs (data
    parallel: this device's share of the batch; tensor parallel: counted whole); the one rule
    of :func:`dpcompile.analysis.program_memory.program_memory`, which round-3 memory plans apply too."""
    options = getattr(pm, "memory_options", None) or {"optimizer": None, "training": pm.training}
    optimizer, training = options["optimizer"], options["training"]
    activations, share = 0, 1.0
    model = getattr(pm, "captured", None) or getattr(pm, "traced_model", None)
    recipe = getattr(pm, "recipe", None)
    checkpointed = getattr(recipe, "checkpointed", ())
    if checkpointed and isinstance(model, nn.Module) and not isinstance(model, fx.GraphModule):
        try:  # a tensor-parallel program keeps the model, not its single-device graph
            model, _ = capture_fx(model, leaf_modules=recipe.leaf_modules, example_inputs=tuple(args))
        except Exception:  # noqa: BLE001 - then counted without the recompute
            pass
    if checkpointed and isinstance(model, fx.GraphModule):  # activations saved with the regions recomputed
        model = with_regions_recomputed(model, checkpointed, getattr(recipe, "checkpoint_save", "nothing"))
    if (args or kwargs) and isinstance(model, nn.Module):
        try:
            activations = activation_bytes(model, args, kwargs, training=training)
        except Exception:  # noqa: BLE001 - a figure, not a requirement
            activations = 0
        if getattr(recipe, "replicates_model", False) and len(params) > 1:  # data parallel: a share of the batch
            share = 1.0 / len(params)
    if sequence_share:
        return program_memory(pm, params, optimizer=optimizer, training=training, activations=activations,
                              share=sequence_share)  # fmt: skip
    return program_memory(pm, params, optimizer=optimizer, training=training, activations=activations, share=share)


def _split_flops(gm: fx.GraphModule, recorder: Recorder | None) -> tuple[float | None, list[dict[str, Any]]]:
    """A program that splits the batch: the share of forward FLOPs that runs split, and the ops that
    run whole (nodes the data-parallel pass stamped ``dpcompile_whole``, with its reason)."""
    flops = recorder.flops if recorder is not None else {}
    whole = []
    for node in gm.graph.nodes:
        reason = node.meta.get("dpcompile_whole")
        if reason is not None:
            whole.append(
                {"node": node.name, "target": target_name(node), "reason": reason,
                 "flops": flops.get(node.name) if recorder is not None else None, "source": user_source(node)}
            )  # fmt: skip
    if recorder is None:
        return None, whole
    return split_fraction(flops, [w["node"] for w in whole]), whole


def _collective(node: fx.Node, comm: Any, recorder: Recorder | None, n: int) -> CollectiveInfo:
    """A collective's row; an SPMD node's own process-group size replaces ``n`` (in ``comm_elements``)."""
    sizes = recorder.sizes.get(node.name) if recorder else None
    fwd, bwd = comm_elements(node, n, sizes) if sizes is not None else (None, None)
    return CollectiveInfo(
        name=node.name,
        kind=comm.kind,
        backward_kind=comm.backward,
        io=bool(comm.io),
        elements=sizes[0] if sizes else None,
        forward=fwd,
        backward=bwd,
        source=user_source(node),
    )


def _regathered(node: fx.Node, recorder: Recorder | None, n: int, seen: set[tuple[str, ...]]) -> list[CollectiveInfo]:
    """Context parallel's keys and values, all-gathered inside each device's attention call
    (``regather_keys_values``): one all-gather each, forward, and in backward a second all-gather
    and the gradients' reduce-scatter. A row per shard list, counted once over the devices."""
    rows = []
    ring = node.target is runtime.ring_attention  # blocks sent on round the ring; backward with their gradients
    for shards, kind in ((node.args[1], "keys"), (node.args[2], "values")):
        names = tuple(str(s) for s in shards)
        if names in seen:
            continue
        seen.add(names)
        summaries = [recorder.summaries.get(name) if recorder else None for name in names]
        size = sum(math.prod(s[0][0]) for s in summaries) if all(s and s[0] for s in summaries) else None
        forward = ring_elements("all_gather", size, n) if size is not None else None
        backward = 2 * forward if forward is not None else None  # all-gather and reduce-scatter alike
        if ring and size is not None:  # N-1 steps of a block and its gradient, then the gradient to its owner
            backward = size * (2 * (n - 1) + 1) / n
        source = node.meta.get("dpcompile_source", node.name)
        if ring:
            rows.append(CollectiveInfo(name=f"{source}_{kind}", kind="ring", backward_kind="ring, send", io=False,
                                       elements=size, forward=forward, backward=backward, source=user_source(node)))
            continue
        rows.append(CollectiveInfo(name=f"{source}_{kind}", kind="all_gather", backward_kind="all_gather, reduce_scatter",
                                   io=False, elements=size, forward=forward, backward=backward,
                                   source=user_source(node)))  # fmt: skip
    return rows


def _ddp_collective(pm: nn.Module) -> CollectiveInfo | None:
    """SPMD data parallel: DistributedDataParallel's gradient all-reduce, which runs in backward
    outside the generated code, over the parameters it does not ignore."""
    ddp = getattr(pm, "ddp", None)
    if ddp is None:
        return None
    ignored = set(getattr(ddp, "parameters_to_ignore", ()))
    size = sum(p.numel() for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ignored)
    n = group_size(pm.mesh, pm.dp_dim) or 1
    return CollectiveInfo(
        name="ddp_gradients",
        kind="ddp",
        backward_kind="all_reduce",
        io=False,
        elements=size,
        forward=0.0,
        backward=ring_elements("all_reduce", size, n),
    )


def param_bytes(pm: nn.Module) -> dict[str, int]:
    """Parameter bytes each device holds, keyed by ``Devices.labels()``.

    Data parallel: every replica holds a full copy. Tensor parallel: each shard's bytes on its
    slot (``pm.shard_param_slots``), replicated parameters on every device.
    """
    return held_parameter_bytes(pm, device_labels(pm), device_list(pm))


def _fsdp_copy_bytes(
    pm: nn.Module, copies: Sequence[Sequence[str]], own_labels: Sequence[str], pipeline: Mapping[str, Any] | None
) -> dict[str, int]:
    """FSDP over dp copies in one process: copy ``r`` holds piece ``r`` of each parameter where copy 0
    holds it (a stage of one device: by the stage's module paths; else by tensor-parallel slot)."""
    devices = device_list(pm)
    if pipeline is None or getattr(pm, "stage_groups", None):
        per_copy = [held_parameter_bytes(pm, own_labels, devices, copy=r) for r in range(len(copies))]
        return {copy[k]: per_copy[r].get(label, 0) for r, copy in enumerate(copies) for k, label in enumerate(own_labels)}
    stages = [(own_labels.index(st["device"]) if st["device"] in own_labels else st["stage"], st["module_paths"])
              for st in pipeline["stages"]]  # fmt: skip
    held = {label: 0 for copy in copies for label in copy}
    pieces = fsdp_pieces(pm)
    for name, p in pm.named_parameters():
        r, program_name = pieces.get(name, (0, name))
        found = stage_holding(program_name, [paths for _, paths in stages])
        k = 0 if found is None else stages[found][0]
        held[copies[r][k]] += p.numel() * p.element_size()
    return held


def _imbalance(values: Mapping[str, float]) -> float:
    """``max / mean`` over devices: 1.0 is balanced, 2.0 means one device does twice the mean."""
    numbers = list(values.values())
    if not numbers or sum(numbers) == 0:
        return 1.0
    return round(max(numbers) / (sum(numbers) / len(numbers)), 4)
