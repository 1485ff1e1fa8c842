"""What a layout would need per device and how long its step would take, predicted from one
:class:`~dpcompile.analysis.model_profile.ModelProfile` (no program built).

A :class:`LayoutSpec` is a layout of one process's devices (``{"dp": n}``, ``{"tp": n}``,
``{"pp": S}``, ``{"pp": S, "tp": T}``), a pipeline's schedule and micro-batches, and whether the
repeated blocks are recomputed in backward. :func:`predict` gives, per device, the bytes by kind and
the step's seconds:

- parameters, gradients, optimizer state: the units each device holds (a pipeline's stages are the
  units cut into contiguous runs of near-equal FLOPs, :func:`cut_units`, where the planner's build
  then cuts too), Linear / Embedding weights split ``tp`` ways
  where their sizes divide;
- activations: what autograd saves for backward; data parallel: the device's share of the batch; a
  pipeline stage: its units' share, all micro-batches under GPipe, ``min(M, S - s)`` of ``M`` under
  1F1B; checkpointed blocks keep their inputs, plus one block recomputed at a time; under tensor
  parallelism, what a block's column / row pairs make between the two layers is each device's
  share, the rest whole on the first device (it runs the ops the plan does not split);
- the peak is the largest of the moments of a backward sweep (:func:`_stage_memory`): activations
  are freed unit by unit as gradients appear, so it is less than the sum of the kinds; inside a unit,
  the moments of its own backward a fake backward of the profile found (``Unit.backward_moments``,
  :mod:`dpcompile.analysis.backward_sweep`): the gradients of its values (its widest ones' too), its
  saved values freed and its parameters' gradients made as they go;
- step time: :func:`dpcompile.analysis.step_time.step_seconds` (in one process, or over a mesh of
  gloo processes where the calibration is a mesh's).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dpcompile.analysis.calibration import Calibration
from dpcompile.analysis.memory import KINDS, format_bytes
from dpcompile.analysis.model_profile import ModelProfile, ShardableWeight, Unit
from dpcompile.analysis.save_choice import kept_width
from dpcompile.analysis.step_time import step_seconds

__all__ = ["LayoutSpec", "Prediction", "batch_share", "copies_gradients", "cut_units", "device_saved", "kept_levels",
           "names_cut", "predict", "stage_memory", "stage_starts", "unit_gradients"]


@dataclass(frozen=True)
class LayoutSpec:
    layout: tuple[tuple[str, int], ...]  # outermost first, as pm.layout
    schedule: str | None = None  # a pipeline's: "gpipe" | "1f1b"
    micro_batches: int = 1
    checkpointing: bool = False
    save_bytes: int | None = None  # checkpointed blocks keep (the "auto" rule) at most this per block and device
    row_bytes: float | None = None  # the bytes of one value per row (token) of a block on a device
    sequence_parallel: bool = False  # tp's values between the pairs on sequence shards

    def size(self, dim: str) -> int:
        return dict(self.layout).get(dim, 1)

    @property
    def name(self) -> str:
        dims = "x".join(f"{k}{v}" for k, v in self.layout) or "1 device"
        pipe = f" {self.schedule} mb{self.micro_batches}" if self.size("pp") > 1 else ""
        keep = f" keep<={format_bytes(self.save_bytes)}" if self.checkpointing and self.save_bytes is not None else ""
        sp = "+sp" if self.sequence_parallel else ""
        return f"{dims}{sp}{pipe}{' +ckpt' if self.checkpointing else ''}{keep}"

    def checkpoint_keyword(self) -> Any:
        """``activation_checkpointing=`` for this spec: False, True, or the blocks keeping ``save_bytes``."""
        if not self.checkpointing or self.save_bytes is None:
            return self.checkpointing
        return {"regions": True, "save": "auto", "budget_bytes": self.save_bytes, "row_bytes": self.row_bytes}


@dataclass(frozen=True)
class Prediction:
    per_device: list[dict[str, int]]  # one per device, in the layout's device order
    step_time: float
    unbuildable: str | None = None  # why this layout cannot be built for this model
    stage_starts: tuple[str, ...] = ()  # a pipeline's: where stages 1.. start, as predicted (see names_cut)

    @property
    def peak(self) -> int:
        return max((sum(k.values()) for k in self.per_device), default=0)


def cut_units(units: Sequence[Unit], stages: int, *, tensor_parallel: bool = False) -> list[list[Unit]] | None:
    """``units`` cut into ``stages`` contiguous runs minimising the largest run's FLOPs (parameter
    bytes break ties), each after the first starting at a unit whose module runs ops of its own (the
    graph has a node of it to cut before); None where no such cut exists. Stages of
    ``tensor_parallel`` shards exchange whole values: where the model has repeated blocks, each starts
    at a block or right after one (inside a block a column layer's shards may go to its row layer).

    The one cut of a pipeline: the planner predicts these stages and builds them (``pipeline=`` the
    module paths of :func:`stage_starts`, for plan="auto" and for a pipeline the user names with
    ``memory_per_device=``), so what it predicts is what the pass cuts (a pipeline of tensor-parallel
    shards of a model without repeated blocks excepted: its pass keeps a column and its row layer in
    one stage, :func:`names_cut`)."""
    n = len(units)
    if n < stages:
        return None
    beside_block = [u.block or (i > 0 and units[i - 1].block) for i, u in enumerate(units)]
    whole_only = tensor_parallel and any(beside_block)
    weight = [u.flops + 1e-9 * u.param_bytes for u in units]
    prefix = [0.0]
    for w in weight:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                if s > 1 and (not units[i].calls_ops or (whole_only and not beside_block[i])):
                    continue
                value = max(best[s - 1][i], prefix[j] - prefix[i])
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    if best[stages][n] == inf:
        return None
    bounds, j = [], n
    for s in range(stages, 0, -1):
        bounds.append((cut[s][j], j))
        j = cut[s][j]
    return [list(units[a:b]) for a, b in reversed(bounds)]


def names_cut(units: Sequence[Unit], tensor_parallel: bool) -> bool:
    """Whether a pipeline's build is given :func:`cut_units`' cut (``pipeline=`` its module paths): every
    pipeline but one of tensor-parallel shards of a model without repeated blocks (its pass cuts where no
    column layer's shards cross)."""
    return not tensor_parallel or any(u.block for u in units)


def stage_starts(stages: Sequence[Sequence[Unit]]) -> tuple[str, ...]:
    """The module paths where stages 1.. of :func:`cut_units` start: ``transform(pipeline=...)``'s
    keyword that builds that cut."""
    return tuple(stage[0].name for stage in stages[1:])


def _splits(w: ShardableWeight, t: int) -> bool:
    return t > 1 and (w.rows % t == 0 or (w.kind == "linear" and w.cols % t == 0))


def _head_share(u: Unit, w: ShardableWeight, t: int, follower: bool) -> float | None:
    """The share of ``w`` one device holds where ``w`` projects to or from ``u``'s attention heads and
    they do not divide by ``t``: whole heads, the first devices one more (timm's ViT-tiny, 3 heads over
    2 devices: 2 and 1, predicted as halves its second device was 15% over); None: an even split. An
    attention projection is told by its shape: ``width`` (heads x head width) columns and at most 3 x
    ``width`` rows (q, k, v fused), as an MLP's wider layers are not."""
    heads, width = u.attention_heads, u.attention_width
    if not heads or heads % t == 0 or w.kind != "linear" or w.cols != width or w.rows % width or w.rows > 3 * width:
        return None
    # where the fake run saw which columns the attentions read: those and their row layers (d, width) only (an
    # MLP's 96-wide up layer beside 3 heads of 16 is shaped as a fused projection: BERT's tp2 second device was
    # 24% over its prediction, its MLP values counted a third, not half)
    projections = u.attention_columns | {(cols, width) for _, cols in u.attention_columns}
    if u.attention_columns and (w.rows, w.cols) not in projections:
        return None
    rank = 1 if follower else 0
    return (heads // t + (1 if rank < heads % t else 0)) / heads


def _unit_state(u: Unit, t: int, follower: bool = False) -> tuple[int, int, int]:
    """A unit's parameter, gradient and optimizer bytes on each of ``t`` tensor-parallel devices.

    The replicated rest is counted held on every device (as ``explain`` counts it), but the ops
    that use it run once, on the first device: a ``follower`` (another) holds only its shards'
    gradients and optimizer state."""
    out = [u.param_bytes, u.grad_bytes, u.optimizer_bytes]
    split = [0, 0, 0]
    for w in u.shardable:
        if _splits(w, t):
            share = _head_share(u, w, t, follower)
            for i, size in enumerate((w.bytes, w.grad_bytes, w.optimizer_bytes)):
                mine = size // t if share is None else round(size * share)
                out[i] -= size - mine
                split[i] += mine
    if follower:
        return out[0], split[1], split[2]
    return out[0], out[1], out[2]


def unit_gradients(u: Unit, t: int, follower: bool) -> int:
    """A unit's gradient bytes on one of ``t`` tensor-parallel devices (:func:`_unit_state`)."""
    return _unit_state(u, t, follower)[1]


def device_saved(u: Unit, t: int, follower: bool) -> int:
    """The bytes of ``u``'s saved activations on one of ``t`` tensor-parallel devices: what its blocks'
    column / row pairs make between the two layers is sharded, each device saving its share (the
    first the larger); the rest runs whole on the first device, once (measured: counting every
    saved byte whole on the first device put it 23-56% over, and a follower's share of the split
    layers' inputs 20-37% under)."""
    if t <= 1:
        return u.saved_bytes
    sharded = u.sharded_saved_bytes if any(_splits(w, t) for w in u.shardable) else 0
    # a pair whose column layer projects to heads that do not divide: whole heads (timm's ViT-tiny, 3 over 2:
    # the first device saves 2 heads' values; as halves its tp2 first device was 2.7% under)
    shares = {column: _head_share(u, ShardableWeight(*column, "linear", 0, 0, 0, 0), t, follower)
              for column in u.pair_saved_bytes} if sharded else {}  # fmt: skip
    heads = sum(round(size * shares[column]) for column, size in u.pair_saved_bytes.items() if shares.get(column))
    even = sharded - sum(size for column, size in u.pair_saved_bytes.items() if shares.get(column))
    # the attentions' masks: each device makes and saves its own (BERT's tp2 second device 5% under without)
    masks = u.attention_mask_bytes if sharded else 0
    return heads + (even // t + masks if follower else u.saved_bytes - sharded + -(-even // t))


def _input_gradient(u: Unit) -> int:
    """The bytes of the gradient backward makes for ``u``'s input: none where the input needs none (the
    model's own input, which does not require grad)."""
    return u.input_bytes if u.input_needs_grad else 0


def _summed_out_of_place(u: Unit, t: int) -> int:
    """The bytes of the third tensor one out-of-place sum of two gradients makes in ``u``'s backward (see
    ``buffered`` in :func:`_stage_memory`): its largest Linear's gradient (its shard over ``t``
    tensor-parallel devices); 0 without a Linear (a convolution's, an embedding's, a norm's gradients are
    summed in place)."""
    linear = [w.grad_bytes // t if _splits(w, t) else w.grad_bytes for w in u.shardable if w.kind == "linear"]
    return max(linear, default=0)


def stage_memory(
    units: Sequence[Unit], t: int, *, checkpointing: bool, share: float, rest: float, training: bool, sweep: bool,
    accumulates: bool, follower: bool = False, kept_saves: Sequence[int] = (), buffered: bool = False,
    outputs: int = 0, one_after_another: bool = False, shared_gradients: int = 0, one_f_one_b: bool = False,
    steady: bool = False, micro_batches_add: bool = False, gradient_in: int = 0, in_step: bool = False,
) -> dict[str, int]:  # fmt: skip
    """Bytes by kind at the predicted peak of a stage's device (see :func:`predict`).

    ``share``: the fraction of one unit's saved bytes a backward sweep holds (a micro-batch's, the
    device's share of the batch); ``rest``: the fraction held besides, for the other micro-batches
    still in flight. The sweep runs backward unit by unit: at unit ``k``, the activations of units
    before it, unit ``k``'s own (all of them again where it is recomputed) and the gradients of
    units after ``k`` are held, with each moment of unit ``k``'s backward (:func:`_inside_backward`: the
    gradients of its values held less its saved values freed, and its parameters' gradients made so far;
    counting all of them from its start put a BERT pipeline's last stage 11% over, and leaving out the
    gradients of its widest values a residual MLP's second tensor-parallel device 12% under); after
    the sweep, every gradient. A stage of one
    micro-batch sweeps too (measured: a convolution stack's stages 30% under without). Without
    ``sweep`` (a stage of several micro-batches, whose program keeps each micro-batch's saved
    tensors until its backward is over: measured) every activation and every gradient at once.
    ``one_after_another``: GPipe's one backward over every micro-batch of a stage without BatchNorm runs
    them one after another, the last forward's first (autograd runs the newest nodes first): a sweep of
    one micro-batch's units, the others' activations held, then, every gradient made, the next one's
    sweep with the rest still held (measured: Mixer's stages 7-10% over counting every activation and
    gradient at once; the first micro-batch's activations are freed before the second sweep's peak).
    ``one_f_one_b``: a 1F1B stage of several micro-batches in flight sweeps one micro-batch's backward at a
    time as well, the others in flight held (``steady``: after each backward the next forward comes in, as
    many held again), and between a unit's layers the gradient of its widest saved value too (measured:
    counting every micro-batch's activations and every gradient at once, a first stage 8-16% over; the
    sweep without the widest value, a ReLU stack's 9-11% under).
    Where gradients ``accumulate`` (a
    second micro-batch, the replicas of data parallelism), a module's new gradient is made before it
    is added to the one held: the largest module's gradient more (its parameters' own, a Linear's
    weight and bias; measured: one at a time, not a whole block's). ``buffered``: the micro-batches' gradients
    meet in one backward (GPipe), where autograd sums a parameter's gradients before it makes ``.grad``:
    a Linear weight's first sum is out of place (its gradients are transposes of a matmul, views), a third
    tensor, the largest Linear's gradient more (measured: a GPipe stage of checkpointed blocks 6-8% under
    without); a convolution's, an embedding's or a norm's are summed in place (``measure`` counts them as a
    device does: its counting mode is off while autograd sums, ``dpcompile.inspect.measure_ledger``). ``outputs``: what a 1F1B step's last stage keeps of what forward returns for the caller
    (a causal LM's logits, every micro-batch's: measured, OPT's last stage 8% under without), gathered
    at the end and copied without a gradient path (twice, at the end). ``follower``: a tensor-parallel device other
    than the first (:func:`_unit_state`, :func:`device_saved`); a checkpointed block's input is kept on the first,
    with ``kept_saves[i]``, what the ``"auto"`` save rule keeps of unit ``i`` (the whole batch's bytes).
    ``micro_batches_add``: a later micro-batch's backward adds into the unit's gradients the first one made
    (all of them held); ``gradient_in``: the gradient of the stage's output, made on the next stage's
    device (on virtual devices it stays there); ``in_step``: GPipe's micro-batches meeting at a BatchNorm."""
    state = [_unit_state(u, t, follower) for u in units]
    params, optimizer = sum(x[0] for x in state), sum(x[2] for x in state)
    saved = [device_saved(u, t, follower) for u in units]
    extra = list(kept_saves) or [0] * len(units)
    kept = [(0 if follower else u.input_bytes + extra[i]) if checkpointing and u.block else saved[i]
            for i, u in enumerate(units)]  # fmt: skip
    held_rest = round(sum(kept) * rest)
    grads = [x[1] for x in state]
    # as unit k's backward runs: autograd adds each new gradient into the one held as soon as one module's
    # backward makes it; a sum of two of a parameter's gradients out of place makes a third tensor
    making = [(min(g, u.module_grad_bytes) if accumulates and training else 0)
              + (_summed_out_of_place(u, t) if buffered and training else 0) for g, u in zip(grads, units)]  # fmt: skip
    if shared_gradients:  # dp copies: one set held through the step (shared_gradients), each new one added into it
        grads = [0] * len(grads)
    moments = []  # during backward
    if not sweep:
        recompute = max((saved[i] - kept[i] for i in range(len(units))), default=0)
        moments.append((sum(grads) + max(making, default=0), round((sum(kept) + recompute) * share) + held_rest + outputs))
    for k in range(len(units) if sweep else 0):
        own = saved[k] if training else kept[k]
        last = k == len(units) - 1
        # 1F1B's micro-batches in flight, GPipe's in step and a recomputed block: their own rules (measured)
        own_rule = one_f_one_b or in_step or (checkpointing and units[k].block and buffered)
        inside = _inside_backward(units[k], None if last else units[k + 1], follower=follower, training=training,
                                  own_rule=own_rule, one_f_one_b=one_f_one_b, grads=grads[k], saved=saved[k],
                                  gradient_in=gradient_in if last else 0)  # fmt: skip
        for i, (flowing, made) in enumerate(inside):
            swept = round((sum(kept[:k]) + own + flowing) * share)
            if one_after_another and rest > 0:  # the first micro-batch's gradients are new: nothing to add them to
                moments.append((sum(grads[k + 1:]) + made, swept + held_rest + outputs))
                # the next micro-batch's sweep: every gradient, one micro-batch fewer held
                later = rest if steady else max(0.0, rest - share)  # 1F1B's steady state: the next forward came in
                moments.append((sum(grads) + making[k], swept + round(sum(kept) * later) + outputs))
            else:
                # a later micro-batch's backward adds each module's new gradient into the unit's held ones; the
                # replicas' gradients of a module are summed once the unit's are made (its last moment)
                held = sum(grads[k:]) + making[k] if micro_batches_add else (
                    sum(grads[k + 1:]) + made + (making[k] if i == len(inside) - 1 else 0))
                moments.append((held, swept + held_rest + outputs))
    # after backward (and at the optimizer step): every gradient, no activation but the outputs, gathered
    # and their copies without a gradient path
    moments.append((sum(grads), 2 * outputs))
    gradients, activations = max(moments, key=sum)
    return {"parameters": params, "gradients": gradients + shared_gradients, "optimizer": optimizer,
            "activations": activations}  # fmt: skip


def _inside_backward(u: Unit, after: Unit | None, *, follower: bool, training: bool, own_rule: bool,
                     one_f_one_b: bool, grads: int, saved: int, gradient_in: int) -> list[tuple[float, int]]:  # fmt: skip
    """The moments of ``u``'s backward on one device, as ``(value gradients held less saved values freed,
    over the batch; its parameters' gradients made)``: ``Unit.backward_moments``, its values' share as
    its saved values' (a tensor-parallel device's), its gradients' as its parameters', less
    ``gradient_in``, the gradient of its output where the next stage's device made it. With ``own_rule``
    and where the moments are unknown: the gradient of its output and of its input (1F1B: and of its
    widest value) beside all of its parameters' gradients."""
    if not training:
        return [(0, grads)]
    if u.backward_moments and not own_rule:
        values = saved / u.saved_bytes if u.saved_bytes else (0.0 if follower else 1.0)
        params = grads / u.grad_bytes if u.grad_bytes else 0.0
        return [(a * values - gradient_in, round(g * params)) for a, g in u.backward_moments]
    # backward through unit k also holds the gradient of its output and makes the one of its input
    flowing = 0 if follower else _input_gradient(u) + (_input_gradient(after) if after is not None else 0)
    if one_f_one_b and not follower:  # and, between its layers, its widest value's gradient
        flowing += u.largest_saved_bytes
    return [(flowing, grads)]


def copies_gradients(units: Sequence[Unit], t: int) -> int:
    """The gradients dp copies of a pipeline or of tensor-parallel shards share (built on virtual devices
    only: one set of parameters, so one set of gradients, held through the step, that each device's
    backward adds its new ones into, one module's at a time; ``measure`` counts them held, as ``explain``
    counts the parameters): a device's parameters' gradients, shards and replicated rest alike
    (measured: dp2xtp2 17-32% under without)."""
    return sum(u.grad_bytes - sum(w.grad_bytes - w.grad_bytes // t for w in u.shardable if _splits(w, t)) for u in units)


def batch_share(batch: int | None, d: int) -> float:
    """The share of the batch the busiest of ``d`` data-parallel devices runs."""
    if d <= 1:
        return 1.0
    return -(-batch // d) / batch if batch else 1.0 / d


def _kept_saves(units: Sequence[Unit], spec: LayoutSpec, share: float) -> tuple[list[int], float]:
    """What each unit keeps under ``spec.save_bytes`` (its bytes over the whole batch: the
    ``"auto"`` knapsack of ``passes.checkpoint_budget`` on the unit's options, the capacity a device's
    share of the rows), and the fraction of the blocks' forward FLOPs recomputed (1: all)."""
    if not spec.checkpointing:
        return [0] * len(units), 0.0
    if spec.save_bytes is None:
        return [0] * len(units), 1.0
    kept, spared = [], 0.0
    for u in units:
        if not (u.block and u.row_bytes and u.save_options):
            kept.append(0)
            continue
        width, flops = kept_width(u.save_options, spec.save_bytes / (u.row_bytes * share))
        kept.append(round(width * u.row_bytes))
        spared += flops * u.rows
    blocks = sum(u.flops for u in units if u.block) or 1
    return kept, max(0.0, 1.0 - spared / blocks)


def kept_levels(units: Sequence[Unit], share: float) -> list[int]:
    """The byte budgets per block and device at which the ``"auto"`` rule keeps something else, from
    the most kept down (each the bytes a block's choice then holds): the choices between keeping
    every option and keeping nothing."""
    levels: set[int] = set()
    for u in units:
        if not (u.block and u.row_bytes and u.save_options):
            continue
        sums = {0.0}
        for option in u.save_options:
            sums |= {w + option.width for w in sums}
        for w in sums:
            width, _ = kept_width(u.save_options, w)
            levels.add(math.ceil(width * u.row_bytes * share))
    return sorted(levels - {0}, reverse=True)


def split_batch_units(units: Sequence[Unit]) -> list[Unit]:
    """``units`` as a program of one process that splits the batch (data parallel, micro-batches) runs
    them: a training BatchNorm is ``runtime.batch_norm`` over the chunks, whose backward holds two more
    values of its input's size in passing (``Unit.split_batch_moments``)."""
    return [dataclasses.replace(u, backward_moments=u.split_batch_moments) if u.split_batch_moments else u
            for u in units]  # fmt: skip


def tied_gradients(units: Sequence[Unit]) -> int:
    """The gradients a pipeline stage's backward makes of weights tied to another stage's (GPT-2's and T5's
    lm_head to the embedding), held to the end of the step to be summed with the other stage's: counted
    with the embedding alone, GPT-2's and T5's last 1F1B stages were 3% and 5% under (at the tightest
    budget, over it)."""
    names = {u.name for u in units}
    return sum(size for u in units for owner, size in u.tied_grad_bytes.items() if owner not in names)


def held_outputs(profile: ModelProfile, calibration: Calibration) -> int:
    """The bytes of what forward returns (no loss, nothing saved for backward) that the caller holds
    through backward and the step (``out = pm(x); out.loss.backward()``), on the device the program
    gathers them to: the first of the last stage (in one process; measured: GPT-2's logits, gathered
    whole on data parallel's first device, put it 2.7% under, a Linear's output tensor parallel's 33%).
    Every moment of that device's sweep holds them, the one after backward too."""
    return profile.held_output_bytes if profile.training and calibration.ranks == 1 else 0


def row_output_partials(profile: ModelProfile, units: Sequence[Unit], t: int, share: float) -> tuple[int, int]:
    """Activations on the first and on another of ``t`` tensor-parallel devices as forward ends, where the
    model's output is a Linear's with fewer out_features than in_features, which the automatic plan splits
    by rows (the cheaper: its output all-reduced): every device holds its partial sum of the whole output
    beside its saved values, the first also the running sums of ``runtime.reduce_to_device`` (over three
    devices or more, two at once beside its own partial; measured: a lone Linear(64, 16)'s tp4 was 71% under
    on its first device, 34% on the others); (0, 0) elsewhere.

        partial = x_shard @ w_shard.T    # each device, the whole output's shape
        total = partial_0 + partial_1    # the first device, then total = total + partial_2, ..."""
    linear = [w for w in units[-1].shardable if w.kind == "linear"] if units else []
    out = profile.held_output_bytes
    w = linear[-1] if linear else None
    if w is None or t <= 1 or not out or w.rows >= w.cols or w.cols % t or out % w.output_elements:
        return 0, 0
    first = sum(device_saved(u, t, False) for u in units) * share + out * share * min(t, 3)
    other = sum(device_saved(u, t, True) for u in units) * share + out * share
    return round(first), round(other)


def predict(profile: ModelProfile, spec: LayoutSpec, calibration: Calibration) -> Prediction:
    """Bytes per device by kind and the step's seconds for ``spec`` (see the module's docstring)."""
    d, t, s_count = spec.size("dp"), spec.size("tp"), spec.size("pp")
    m = spec.micro_batches
    stages = cut_units(profile.units, s_count, tensor_parallel=t > 1) if s_count > 1 else [profile.units]
    if stages is None:
        return Prediction([], 0.0, f"{len(profile.units)} pieces (repeated blocks and what surrounds them) "
                                   f"cannot be cut into {s_count} stages")  # fmt: skip
    if t > 1 and not any(_splits(w, t) for u in profile.units for w in u.shardable):
        return Prediction([], 0.0, f"no Linear or Embedding of the model splits {t} ways")
    if m > 1 and (profile.batch is None or profile.batch < m):
        return Prediction([], 0.0, f"{m} micro-batches need a batch of at least {m} (the examples' is {profile.batch})")
    training = profile.training
    if spec.schedule == "1f1b" and training and not profile.returns_loss:
        return Prediction([], 0.0, "1F1B runs each micro-batch's backward from the model's own mean loss, and "
                                   "forward returns none")  # fmt: skip
    per_device: list[dict[str, int]] = []
    share = batch_share(profile.batch, d) / m
    kept_saves, recomputed = _kept_saves(profile.units, spec, share)
    at = 0
    for s, units in enumerate(stages):
        in_flight = (m if spec.schedule != "1f1b" else min(m, s_count - s)) if s_count > 1 else 1
        last_1f1b = training and spec.schedule == "1f1b" and s == s_count - 1  # its tail keeps the outputs
        # GPipe's micro-batches meet at each BatchNorm (the whole batch's statistics): their backwards go
        # in step, as one sweep of the whole batch (measured: else a stage of them 10-15% under)
        lockstep = spec.schedule != "1f1b" and m > 1 and any(u.batch_norm for u in units)
        sweeping, held = (share * m, 1) if lockstep else (share, in_flight)
        gpipe = spec.schedule != "1f1b" and m > 1 and s_count > 1
        # a 1F1B stage holding several micro-batches sweeps one micro-batch's backward at a time, the others
        # in flight held (measured: counting every one's activations at once put a first stage 8-11% over)
        one_f_one_b = training and spec.schedule == "1f1b" and m > 1 and held > 1
        # dp copies of a pipeline or of tp shards in one process (over a mesh each rank has its own gradients)
        copies = d > 1 and (t > 1 or s_count > 1) and training and calibration.ranks == 1
        # over a mesh a rank's BatchNorm is sync_batch_norm, autograd through its ops: not this rule
        swept = split_batch_units(units) if (d > 1 or m > 1) and calibration.ranks == 1 else units
        kinds = [stage_memory(swept, t, checkpointing=spec.checkpointing and training, share=sweeping,
                               rest=sweeping * (held - 1), training=training,
                               sweep=s_count == 1 or m == 1 or lockstep or gpipe or one_f_one_b,
                               one_after_another=(gpipe and not lockstep) or one_f_one_b, one_f_one_b=one_f_one_b,
                               steady=one_f_one_b and m > held,
                               accumulates=m > 1 or d > 1, micro_batches_add=m > 1, follower=rank > 0, kept_saves=kept_saves[at:at + len(units)],
                               buffered=training and m > 1 and spec.schedule != "1f1b",
                               outputs=profile.output_bytes if last_1f1b and rank == 0 else 0,
                               gradient_in=_input_gradient(stages[s + 1][0]) if s + 1 < s_count else 0, in_step=lockstep,
                               shared_gradients=copies_gradients(units, t) if copies else 0)
                 for rank in range(min(t, 2))]  # fmt: skip
        at += len(units)
        per_device += [dict(kinds[min(r % t, 1)]) for r in range(d * t)]  # tp innermost: rank r is tp rank r % t
        for kinds_r in per_device[-d * t:] if training else ():
            kinds_r["gradients"] += tied_gradients(units) // t
        if s == s_count - 1 and not last_1f1b:
            per_device[-d * t]["activations"] += held_outputs(profile, calibration)
        # forward's end with every saved value held: no block recomputed, one micro-batch
        whole = s == s_count - 1 and training and not spec.checkpointing and m == 1
        partials = row_output_partials(profile, units, t, share) if whole else (0, 0)
        for r, kinds_r in enumerate(per_device[-d * t:]):  # forward's end, before any gradient is made
            shared = copies_gradients(units, t) if copies else 0
            if partials[min(r % t, 1)] > kinds_r["activations"] + kinds_r["gradients"] - shared:
                kinds_r.update(activations=partials[min(r % t, 1)], gradients=shared)
    seconds = step_seconds(profile, dict(spec.layout), stages, m, recomputed, calibration, spec.schedule)
    assert all(set(k) == set(KINDS) for k in per_device)
    starts = stage_starts(stages) if s_count > 1 and names_cut(profile.units, t > 1) else ()
    return Prediction(per_device, seconds, stage_starts=starts)
