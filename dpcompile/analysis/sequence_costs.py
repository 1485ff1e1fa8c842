"""The planner's prediction of the layouts that split the sequence: context parallel (``{"cp": C}``,
``{"dp": D, "cp": C}``) and tensor parallel with sequence parallel (``{"tp": T}``,
``sequence_parallel=True``), from the same :class:`~dpcompile.analysis.model_profile.ModelProfile`
as the others (:func:`predict_layout` hands every other layout to
:func:`~dpcompile.analysis.layout_costs.predict`).

Context parallel, on each device (its share ``f`` of the tokens: a ``ceil(seq / C)`` slice of its dp
copy's rows):

- the whole weights, their gradients and the optimizer's state (every device holds a replica);
- a backward sweep as data parallel's (unit by unit: the activations not yet consumed, ``f`` of
  what autograd saves, and the gradients already made), where a unit's attention holds the other
  shards' keys and values gathered (``(C-1)/C`` of the layer's, of its dp copy's rows: the last
  device's under a causal mask; measured +3% on it, 4 devices, 64 tokens). The replicas' gradients
  summed on the first device are not counted (measured 34% over the prediction there on 4 devices
  with real replicas, within it on 2); ``dp`` copies (built on virtual devices only) share one set of
  gradients, held through the step, besides those each device makes in backward before adding them;
- step time: ``f`` of the FLOPs outside attention, and of attention the last device's causal share
  (its queries against every earlier shard and its own half: ``(C - 1/2) / C**2``; ``1/C`` without
  ``is_causal``), 3x for a training step; sent: each attention's keys and values all-gathered in
  forward, again in backward, and their gradients reduce-scattered (``3 (C-1)/C`` of them), and
  data parallel's replication and gradient all-reduce over the ``D x C`` devices.

Sequence parallel: tensor parallel's weights, gradients and state per device, and ``1/T`` (a
``ceil`` slice of the sequence) of every saved activation on every device: the values between the
pairs are on sequence shards, the pairs' own inputs and outputs sharded as under tensor parallel;
held together at the end of forward (measured: the sweep frees too little to lower the peak). Step
time: tensor parallel's, plus one all-gather per pair in backward (each column layer gathers its
input's slice again), the all-reduce's bytes otherwise (a reduce-scatter and an all-gather). Where
the row layers' outputs differ on dim 1 (an ``nn.MultiheadAttention``'s output projection runs on
``(seq, batch, ...)``: torchvision's ViT) ``shard_sequence`` finds no one sequence and the program is
tensor parallel alone: tensor parallel's prediction (it was 18% under on the first device, 25% over
on the second).
"""

from __future__ import annotations

import math

from dpcompile.analysis.calibration import Calibration
from dpcompile.analysis.layout_costs import LayoutSpec, Prediction, batch_share, predict, unit_gradients
from dpcompile.analysis.model_profile import ModelProfile, Unit
from dpcompile.analysis.step_time import ELEMENT_BYTES

__all__ = ["NOT_PREDICTED", "no_one_sequence", "predict_layout", "splits_sequence"]

#: the start of the reason a layout that is built, but that this planner does not predict, is left out
NOT_PREDICTED = "the planner does not predict"


def splits_sequence(spec: LayoutSpec) -> bool:
    return spec.size("cp") > 1 or spec.sequence_parallel


def predict_layout(profile: ModelProfile, spec: LayoutSpec, calibration: Calibration) -> Prediction:
    """``spec``'s bytes per device by kind and step seconds: this module's for a layout splitting the
    sequence, :func:`~dpcompile.analysis.layout_costs.predict`'s for the others."""
    if not splits_sequence(spec):
        return predict(profile, spec, calibration)
    why = _not_predicted(profile, spec)
    if why:
        return Prediction([], 0.0, why)
    if spec.sequence_parallel:
        return _sequence_parallel(profile, spec, calibration)
    return _context_parallel(profile, spec, calibration)


def no_one_sequence(profile: ModelProfile) -> bool:
    """Whether the blocks' row layers disagree on dim 1 (``shard_sequence`` then finds no one sequence,
    and ``sequence_parallel=True`` builds tensor parallel alone)."""
    return len(set(profile.row_lengths)) > 1


def _not_predicted(profile: ModelProfile, spec: LayoutSpec) -> str | None:
    dims = {k for k, v in spec.layout if v > 1}
    if profile.sequence is None and spec.size("cp") > 1:
        return "no scaled_dot_product_attention found in the examples' forward: no sequence to split"
    if spec.size("cp") > 1 and not dims <= {"dp", "cp"} or spec.sequence_parallel and not dims <= {"tp"}:
        return f"{NOT_PREDICTED} {spec.name} yet (it predicts cp, dp x cp, and tp with sequence parallel)"
    if spec.checkpointing or spec.micro_batches > 1:
        return f"{NOT_PREDICTED} {spec.name} with checkpointing or micro-batches yet"
    parts = spec.size("cp") * spec.size("tp")
    if profile.sequence is not None and profile.sequence < parts:
        return f"a sequence of {profile.sequence} tokens cannot be split {parts} ways"
    return None


def _input_gradient(u: Unit) -> int:
    return u.input_bytes if u.input_needs_grad else 0


def _token_share(profile: ModelProfile, parts: int) -> float:
    """The busiest device's share of the tokens (``1/parts`` where no attention gave the length)."""
    seq = profile.sequence
    return math.ceil(seq / parts) / seq if seq else 1 / parts


def _context_parallel(profile: ModelProfile, spec: LayoutSpec, calibration: Calibration) -> Prediction:
    d, c = spec.size("dp"), spec.size("cp")
    rows = batch_share(profile.batch, d)
    share = rows * _token_share(profile, c)
    units = profile.units
    training = profile.training
    grads = [u.grad_bytes for u in units]
    moments = [(sum(grads), 0)]  # after backward: every gradient, no activation
    for k, u in enumerate(units):
        flowing = _input_gradient(u) + (_input_gradient(units[k + 1]) if k + 1 < len(units) else 0) if training else 0
        gathered = round(u.attention_kv_bytes * rows * (c - 1) / c)  # the other shards' keys and values
        acts = round((sum(x.saved_bytes for x in units[:k]) + u.saved_bytes + flowing) * share) + gathered
        moments.append((sum(grads[k:]), acts))
    gradients, activations = max(moments, key=sum)
    if d > 1 and training:  # the dp copies (virtual devices only) share one set of gradients, held through the step
        gradients += sum(grads)
    kinds = {"parameters": profile.total("param_bytes"), "gradients": gradients,
             "optimizer": profile.total("optimizer_bytes"), "activations": activations}  # fmt: skip
    return Prediction([dict(kinds) for _ in range(d * c)], _context_parallel_seconds(profile, d, c, calibration))


def _context_parallel_seconds(profile: ModelProfile, d: int, c: int, calibration: Calibration) -> float:
    rows = batch_share(profile.batch, d)
    attention = sum(u.attention_flops for u in profile.units)
    causal = all(u.attention_causal for u in profile.units if u.attention_flops)
    attention_share = (c - 0.5) / c**2 if causal else 1 / c
    flops = (profile.total("flops") - attention) * rows * _token_share(profile, c) + attention * rows * attention_share
    flops *= 3 if profile.training else 1
    kv = sum(u.attention_kv_bytes for u in profile.units) * rows
    sent = (c - 1) / c * kv * (3 if profile.training else 1)
    n = d * c
    sent += (n - 1) / n * profile.total("param_bytes") * (3 if profile.training else 1)
    return flops / calibration.flops_per_s + sent / calibration.copy_bytes_per_s


def _sequence_parallel(profile: ModelProfile, spec: LayoutSpec, calibration: Calibration) -> Prediction:
    t = spec.size("tp")
    tensor_parallel = predict(profile, LayoutSpec(spec.layout), calibration)
    if tensor_parallel.unbuildable or no_one_sequence(profile):  # nothing split on a sequence
        return tensor_parallel
    share = _token_share(profile, t)
    swept = [_swept(profile, t, rank > 0, share) for rank in range(min(t, 2))]
    per_device = [{**kinds, "gradients": swept[min(r, 1)][0], "activations": swept[min(r, 1)][1]}
                  for r, kinds in enumerate(tensor_parallel.per_device)]  # fmt: skip
    extra = sum(_column_inputs(u) for u in profile.units) * (t - 1) / t if profile.training else 0.0
    return Prediction(per_device, tensor_parallel.step_time + extra / calibration.copy_bytes_per_s)


def _swept(profile: ModelProfile, t: int, follower: bool, share: float) -> tuple[int, int]:
    """A tensor-parallel device's gradients and activations at the peak of a backward sweep whose values
    are on sequence shards (``share`` of the tokens), those between a column and a row layer on feature
    shards of every token (the same bytes): unit by unit, the saved values of the units up to it and the
    moments of its own backward (``Unit.backward_moments``: the gradients of its widest values, measured:
    the residual MLP's first device 13% under without), the gradients of the units after it and those
    its backward made."""
    units = profile.units
    grads = [unit_gradients(u, t, follower) for u in units]
    # at the end of forward (every saved value), after backward (every gradient)
    moments = [(0, round(profile.total("saved_bytes") * share)), (sum(grads) if profile.training else 0, 0)]
    for k, u in enumerate(units if profile.training else ()):
        mine = grads[k] / u.grad_bytes if u.grad_bytes else 0.0
        for a, g in u.backward_moments:
            held = sum(x.saved_bytes for x in units[: k + 1]) + a
            moments.append((sum(grads[k + 1 :]) + round(g * mine), round(held * share)))
    return max(moments, key=sum)


def _column_inputs(u: Unit) -> float:
    """The bytes a unit's column layers read (half its pairs' outputs: what backward gathers again)."""
    return 0.5 * sum(w.output_elements for w in u.shardable) * ELEMENT_BYTES
