"""One-process FSDP over data parallelism (``data_parallel="fsdp"``, ``["cpu"] * n``): its bytes per device
at the peak of a step, from data parallel's prediction (:func:`dpcompile.analysis.layout_costs.predict`);
over dp copies of a pipeline or of tensor-parallel shards, from that replicated layout's
(:func:`fsdp_over_copies`).

The program (:mod:`dpcompile.modules.fsdp_one_process`) stores each parameter as one piece per device and
gathers it whole on each device that reads it; on virtual devices (what this models) that is the first
device alone, the copies sharing it (on distinct GPUs each copy gathers on its own, left out here); the
gathers are held until the call returns, and what autograd saves of them is gathered again in backward,
one at a time. So per device:

- its pieces (and the optimizer's state of them), through the step;
- the first device: backward as data parallel's (the moments of its sweep): each parameter's whole
  gradient is summed where it was gathered, its pieces' gradients views of it; and one moment more, as
  forward returns: every parameter it gathered, whole, beside every activation saved (its share of
  the batch). Measured so (torchvision's ViT -2.2%, the MLP stack -0.8%, GPT-2 -4.0%);
- another device: data parallel's sweep with no parameter's gradient held (each is summed on the first
  device), and beside it the largest module's weight regathered and its whole gradient (torchvision's
  ViT's 1000-class head, as its backward starts: +1.3%; an upper bound where the peak is elsewhere: a
  2-block MLP of width 32-128 +8% to +16%).

Before (data parallel's prediction)::

    {"parameters": P, "gradients": g, "activations": a}                 # every device

After::

    {"parameters": piece_0, "gradients": g, "activations": a}           # device 0, backward
    {"parameters": piece_0 + gathered, "activations": saved}            # device 0, as forward returns
    {"parameters": piece_r, "gradients": 2 * module, "activations": a'} # device r > 0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from dpcompile.analysis.layout_costs import (
    LayoutSpec,
    batch_share,
    copies_gradients,
    cut_units,
    device_saved,
    stage_memory,
)
from dpcompile.analysis.model_profile import ModelProfile

__all__ = ["fsdp_over_copies", "fsdp_one_process"]


def fsdp_one_process(
    profile: ModelProfile, spec: LayoutSpec, data_parallel: Sequence[Mapping[str, int]], pieces: Sequence[int],
    gathered: int,
) -> list[dict[str, int]]:  # fmt: skip
    """Bytes by kind per device (see the module's docstring): ``data_parallel``, data parallel's prediction
    of ``spec`` per device; ``pieces``, the parameter bytes each device stores; ``gathered``, the whole bytes
    of the parameters stored as pieces (those left whole on the first device, 0-dim or written in forward,
    are among its pieces and never gathered)."""
    whole = profile.total("param_bytes") or 1
    optimizer = profile.total("optimizer_bytes")
    share = batch_share(profile.batch, len(pieces))
    training = profile.training
    saved = round(profile.total("saved_bytes") * share) if training else 0
    # another device's sweep: its values' gradients beside its activations, no parameter's gradient held (each
    # is summed where it was gathered), but the module whose backward runs: its weight regathered, its gradient
    others = stage_memory([dataclasses.replace(u, grad_bytes=0) for u in profile.units], 1,
                          checkpointing=spec.checkpointing and training, share=share, rest=0.0, training=training,
                          sweep=True, accumulates=False)  # fmt: skip
    module = 2 * max((u.module_grad_bytes for u in profile.units), default=0) if training else 0
    out = []
    for r, (kinds, held) in enumerate(zip(data_parallel, pieces, strict=True)):
        state = round(optimizer * held / whole)
        if r == 0:  # backward as data parallel's; and as forward returns, the gathers held
            moments = [{**kinds, "parameters": held, "optimizer": state},
                       {"parameters": held + gathered, "gradients": 0, "optimizer": state, "activations": saved}]
        else:
            moments = [{"parameters": held, "gradients": others["gradients"] + module, "optimizer": state,
                        "activations": others["activations"]}]  # fmt: skip
        out.append(max(moments, key=lambda k: sum(k.values())))
    return out


def fsdp_over_copies(
    profile: ModelProfile, spec: LayoutSpec, replicated: Sequence[Mapping[str, int]], held: Sequence[Mapping[str, int]],
    gathered: Sequence[int], own_gradients: Sequence[Mapping[str, int]] | None = None,
) -> list[dict[str, int]]:  # fmt: skip
    """One-process FSDP over dp copies of a pipeline or of tensor-parallel shards (``{"pp": 2, "dp": 2}``,
    ``{"dp": 2, "tp": 2}``): bytes by kind per device, in the planner's order (pp, dp, tp), from the
    replicated layout's prediction ``replicated`` (:func:`dpcompile.analysis.layout_costs.predict`).

    Each device holds its pieces, their gradients and state (``held``: parameters, gradients, optimizer);
    a stage's or a shard's parameters are gathered whole on copy 0's device of it (``gathered``, 0
    elsewhere: the other copies read copy 0's, on virtual devices no copy) once a call and held until the
    call returns, and gathered again one at a time where backward needs them, on the device whose backward
    runs. So, per device::

        backward:  pieces + their gradients + the replicated sweep (its activations, the module
                   gradient it makes) + one module's weight regathered
        copy 0, as forward returns (GPipe: the call is forward): pieces + gradients + gathered
                   + every micro-batch's saved activations of the stage
        copy 0 of a 1F1B stage (its call runs backward too): the backward moment + gathered

    where the replicated prediction held the stage's whole gradients through the step (one set the
    copies share on virtual devices), FSDP holds the pieces' and makes each module's whole one in passing.

    Except on the devices of a pipeline stage's other copies (``own_gradients``: the layout's prediction where
    each copy makes its own gradients, as a rank over a mesh does): one backward runs every micro-batch of
    copy ``r > 0`` before copy 0's (autograd runs the newest nodes first), and each whole gradient it makes
    waits on its device to be summed with copy 0's (on distinct GPUs, in its replicas' broadcast until its
    stage's backward is over), so it sweeps as a device holding its own gradients, beside its pieces and
    theirs (torchvision's ViT's second copy -14%/-15% with one module's gradient in passing; now +3.7%/-0.0%).
    A 1F1B stage holding several micro-batches (the first) sweeps so too, one at a time, the others held; one
    holding one (the last) sweeps that micro-batch alone: each micro-batch's backward sums its whole gradients
    into the pieces, none held from the one before (the MLP stack's -13.6% -> -0.3%)::

        copy r > 0 of a stage: pieces + their gradients + the sweep of a copy making its own gradients
    """
    d, t, s_count = spec.size("dp"), spec.size("tp"), spec.size("pp")
    stages = cut_units(profile.units, s_count, tensor_parallel=t > 1) if s_count > 1 else [profile.units]
    training = profile.training
    share = batch_share(profile.batch, d)
    out = []
    pipeline = s_count > 1 and training and own_gradients is not None
    for i, (kinds, own, whole) in enumerate(zip(replicated, held, gathered, strict=True)):
        units = stages[i // (d * t)] if stages else profile.units
        follower = i % t > 0
        # GPipe, or a 1F1B stage holding several micro-batches (the first): the per-rank sweep (the others held)
        several = spec.schedule != "1f1b" or min(spec.micro_batches, s_count - i // (d * t)) > 1
        if pipeline and (i // t) % d > 0:  # another copy: its own whole gradients as it makes them
            if several:
                swept = own_gradients[i]  # type: ignore[index]
            else:  # 1F1B, one micro-batch in flight (the last stage): its sweep, none held from the one before
                last = i // (d * t) == s_count - 1
                swept = stage_memory(units, t, checkpointing=spec.checkpointing, share=share / spec.micro_batches,
                                     rest=0.0, training=True, sweep=True, accumulates=True, follower=follower,
                                     outputs=profile.output_bytes if last and not follower else 0)  # fmt: skip
            out.append({"parameters": own["parameters"], "gradients": swept["gradients"] + own["gradients"],
                        "optimizer": own["optimizer"], "activations": swept["activations"]})  # fmt: skip
            continue
        shared = copies_gradients(units, t) if training else 0
        module = max((u.module_grad_bytes for u in units), default=0) if training else 0
        regather = -(-module // t)
        backward = {"parameters": own["parameters"], "optimizer": own["optimizer"],
                    "gradients": max(0, kinds["gradients"] - shared) + own["gradients"] + regather,
                    "activations": kinds["activations"]}  # fmt: skip
        moments = [backward]
        if whole and spec.schedule == "1f1b" and training:
            moments = [{**backward, "parameters": own["parameters"] + whole}]
        elif whole:
            saved = round(sum(device_saved(u, t, follower) for u in units) * share) if training else kinds["activations"]
            moments.append({"parameters": own["parameters"] + whole, "gradients": own["gradients"],
                            "optimizer": own["optimizer"], "activations": saved})  # fmt: skip
        out.append(max(moments, key=lambda k: sum(k.values())))
    return out
