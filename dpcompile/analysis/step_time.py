"""A layout's predicted step time, from a :class:`~dpcompile.analysis.model_profile.ModelProfile`
cut into pipeline stages and the calibrated constants (:mod:`dpcompile.analysis.calibration`).

In one process (``calibration.ranks == 1``): the busiest device's FLOPs (3x forward for a training
step, plus forward again for recomputed blocks; a pipeline's ``(M + S - 1) / M`` for its bubble) at
the matmul FLOP/s, plus the bytes sent (data parallel: parameters replicated and gradients reduced;
tensor parallel: an all-reduce of each row layer's output; a pipeline: each boundary's values) at the
copy bytes/s, with no overlap.

Over a mesh of gloo processes (``calibration.ranks > 1``), each rank's step is what it computes, what
it dispatches and what it waits for, with no overlap:

- compute: its FLOPs (its share of the batch, ``1/tp`` of each layer) at one rank's FLOP/s and the
  bytes its ops write (3x forward's for a training step) at the copy bytes/s;
- dispatch: every forward op of its units once per micro-batch at ``op_seconds`` (its backward's
  included): tensor parallelism does not divide it, micro-batches multiply it;
- activation checkpointing: its blocks' forward FLOPs and writes once more, and each of their forward
  ops at the calibration's ``recompute_op_s`` (:func:`recompute_seconds`: the op dispatched again and
  checkpoint's hooks on what it saves, 2-3.5 times a training op's ``op_seconds``);
- collectives, each a gloo latency plus its ring bytes at the all-reduce bytes/s: data parallel, one
  all-reduce of the gradients (a call per 25 MiB bucket); tensor parallel, an all-reduce per pair of
  sharded layers (two distinct inputs: q, k, v read one), micro-batch and direction (forward of the
  row layer, backward of the column one); data or tensor parallel alone, one all-gather checking that
  the ranks call alike (a checkpointed block's forward all-reduces once more). Each comes after the ranks' computing, so its latency is the calibration's
  ``synced_collective_s`` (:func:`collective_seconds`): the peers' gloo threads woken and the peer
  still computing waited for (2.4 ms a call in a tensor-parallel step at load average 2, where back to back
  one took 0.15 ms); a pipeline stage, one transfer per boundary it
  sits at, micro-batch and direction (its values forward, their gradients backward): its bytes,
  and :data:`MESSAGES_ON_PATH` of a transfer's latency (:func:`message_seconds`: also reached after
  computing);
- a pipeline stage's schedule (``torch.distributed.pipelining``), per micro-batch, one action
  forward and one backward (:data:`SCHEDULE_ACTION_OPS` forward ops' dispatch each): its
  bookkeeping, the autograd call and the loss, beyond the stage's own ops;
- its weights, per micro-batch (training; :func:`weight_seconds`): its gradients' bytes at the calibration's
  ``microbatch_weight_s_per_byte`` (forward and backward read the weights again, backward writes their gradient
  and adds it to ``.grad``: what each micro-batch more costs beyond its FLOPs and ops, measured on an MLP block
  split in micro-batches); a calibration without it, :data:`PARAM_PASSES` of those bytes at the copy bytes/s;
- GPipe's order (``schedule`` not ``"1f1b"``, or fewer micro-batches than stages): a stage holds every
  micro-batch's saved values until its backward, where 1F1B's first stage holds ``min(M, S)``: the values of
  the micro-batches held beyond those are memory new to the rank each step (the allocator hands the peak
  back between steps), paged in at the calibration's ``page_in_bytes_per_s`` (every rank paging in at
  once: on a 2-core VM 0.35-1.8 GB/s each, where a cached copy runs at 13-40 GB/s);
- a pipeline runs ``M + S - 1`` slots (:func:`slot_seconds`); in each, the stages holding a
  micro-batch work side by side, and the CPUs run ``calibration.concurrency`` ranks at once
  (measured: fewer than the ranks where the cores are fewer or busy with other work): a slot takes
  its slowest stage's computing and dispatching, slowed by its busy ranks over that, plus its waits.
  The fill and drain slots run one stage alone at full speed, the steady ones all of them sharing
  the CPUs; data or tensor parallelism alone is one slot of every rank at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpcompile.analysis.calibration import Calibration
from dpcompile.analysis.model_profile import ModelProfile, Unit

__all__ = ["MESSAGES_ON_PATH", "PARAM_PASSES", "SCHEDULE_ACTION_OPS", "collective_seconds", "gpipe_held_bytes",
           "message_seconds", "page_in_seconds", "schedule_seconds", "slot_seconds", "step_seconds",
           "weight_seconds"]  # fmt: skip

#: the bytes of one element the cost model moves (float32)
ELEMENT_BYTES = 4
#: DistributedDataParallel's gradient bucket
DDP_BUCKET_BYTES = 25 * 2**20
#: what one action of a pipeline's schedule costs beyond its stage's ops (a forward or a backward of
#: one micro-batch: the schedule's bookkeeping, the autograd call, the loss), in the calibration's
#: ``op_seconds``: torch's GPipe over one-stage pipelines of an nn.Linear, its slope per micro-batch
#: less the Linear's own call, over 2 actions, is 1-10 ``op_seconds`` as calibrated before or after
#: the run, median 8.5 of 10 such figures (the 5 runs at load averages 6-14 in
#: benchmarks/results/pipeline_overhead.json, bench_pipeline_overhead.py)
SCHEDULE_ACTION_OPS = 8
#: the share of a transfer's latency (:func:`message_seconds`; fitted when it was a ping-pong's between threads,
#: which also pays the GIL's hand-over: benchmarks/bench_pipeline_overhead.py) a pipeline transfer puts on the step's path (the receiver is often
#: still busy when it arrives): torch's GPipe over 2 stages less over 1, per micro-batch and transfer,
#: is 0.09-0.24 of its mean before and after, median 0.15, over the same 5 runs
MESSAGES_ON_PATH = 0.15
#: what a micro-batch of a training step costs in its stage's weights, in passes over its gradients' bytes at the
#: calibration's copy bytes/s (forward and backward read the weights, backward writes their gradient and adds it to
#: ``.grad``): one eager stage of 4 blocks of 256 (8 MiB of weights), one thread, its CPU seconds per micro-batch more
#: (8 against 1) less those of a stage of 4 blocks of 64 (its dispatch), over the extra bytes at a clone's rate, is
#: 1.1-2.4 passes, median 1.7 (6 runs at load averages 15-22; 1.7-3.2 at 12.5 MiB, 0.6-1.9 at 4.5 MiB, lost in the
#: noise at 2 MiB: weights that stay in the core's cache cost less; benchmarks/bench_microbatch_weights.py). Used only
#: where the calibration lacks ``microbatch_weight_s_per_byte`` (an older one, :data:`~dpcompile.analysis.calibration.REFERENCE`):
#: on another host (a 2-core EPYC VM, load average 4) the same stage cost 16 passes at its clone's rate
PARAM_PASSES = 1.7
#: where the calibration lacks ``recompute_op_s``: what a forward op run again in backward costs, in
#: ``op_seconds`` (a training step's op, eager; calibrations read 2-3.5 on a 2-core VM)
RECOMPUTE_OPS = 2.5


def weight_seconds(c: Calibration, grad_bytes: float) -> float:
    """What one micro-batch of a training step costs a stage holding ``grad_bytes`` of gradients, in its
    weights, beyond its FLOPs and ops: at the calibration's ``microbatch_weight_s_per_byte`` (an MLP block run as
    one micro-batch and as four, per micro-batch more and weight byte), else :data:`PARAM_PASSES` passes at the
    copy bytes/s.

    Issue 34: the MLP pipeline of ``bench_planner_rank.py`` (8.4 MB of weights a stage) measured about 7 ms a
    step more per micro-batch where the model said 1.3; one thread of its stage costs 3.1-3.3 ms a micro-batch
    more, 2.7-2.8 of them beyond its dispatch, where 1.7 passes at the run's cached 26.7 GB/s said 0.54
    (``benchmarks/probe_microbatch_cost.py``)."""
    if c.microbatch_weight_s_per_byte:
        return grad_bytes * c.microbatch_weight_s_per_byte
    return PARAM_PASSES * grad_bytes / c.copy_bytes_per_s


def recompute_seconds(c: Calibration, blocks: Sequence[Unit]) -> float:
    """What activation checkpointing costs ``blocks`` a micro-batch beyond their forward's FLOPs and writes:
    each forward op run again in backward, at the calibration's ``recompute_op_s`` (its dispatch, the autograd
    graph recorded again, checkpoint's hooks on the tensors it saves; :data:`RECOMPUTE_OPS` ``op_seconds``
    where the calibration lacks it)."""
    return sum(u.ops for u in blocks) * (c.recompute_op_s or RECOMPUTE_OPS * c.op_seconds)


def schedule_seconds(c: Calibration, training: bool) -> float:
    """A pipeline stage's schedule work per micro-batch: an action forward (and one backward)."""
    return (2 if training else 1) * SCHEDULE_ACTION_OPS * c.op_seconds


def gpipe_held_bytes(units: Sequence[Unit], m: int, stages: int, checkpointing: float) -> float:
    """The saved values (over the whole batch) a stage of ``units`` holds under GPipe's order beyond what
    1F1B's first stage holds (``min(M, S)`` of its ``M`` micro-batches: the model charges 1F1B nothing for
    them, so GPipe with ``M <= S`` costs what 1F1B does, as measured: -3.6 to +2.2 ms apart over 5 models
    and 3 quiet runs). A recomputed block holds its input only."""
    held = sum(u.input_bytes if checkpointing and u.block else u.saved_bytes for u in units)
    return held * (m - min(m, stages)) / m


def page_in_seconds(c: Calibration, new_bytes: float) -> float:
    """Seconds a rank pages in ``new_bytes`` of memory new to it (every rank doing so at once); a
    calibration without the figure (an older one) at its copy bytes/s."""
    return new_bytes / (c.page_in_bytes_per_s or c.copy_bytes_per_s)


def message_seconds(c: Calibration) -> float:
    """A pipeline transfer's latency: like a collective, one the receiver reaches after computing
    (:func:`collective_seconds`). A ping-pong's (back to back, as calibrations measured it before) keeps
    both sides' threads awake: it read 0.015 ms and 2.6 ms in two calibrations at load averages 10 and
    16, where the pipelines' steps were alike."""
    return collective_seconds(c)


def collective_seconds(c: Calibration) -> float:
    """A data- or tensor-parallel collective's latency: one the ranks reach after computing (an older
    calibration without it: the back-to-back all-reduce's)."""
    return c.synced_collective_s or c.collective_latency_s


def batch_fraction(batch: int | None, d: int) -> float:
    """The share of the batch the busiest of ``d`` data-parallel devices runs."""
    if d <= 1:
        return 1.0
    return -(-batch // d) / batch if batch else 1.0 / d


def _work_flops(units: Sequence[Unit], training: bool, checkpointing: float) -> float:
    """A step's FLOPs; ``checkpointing``: the fraction of the blocks' forward run again (True: all)."""
    flops = sum(u.flops for u in units)
    if not training:
        return flops
    return 3 * flops + sum(u.flops for u in units if u.block) * float(checkpointing)


def _layer_outputs(units: Sequence[Unit]) -> int:
    return sum(w.output_elements for u in units for w in u.shardable)


def step_seconds(
    profile: ModelProfile, layout: dict[str, int], stages: Sequence[Sequence[Unit]], micro_batches: int,
    checkpointing: float, calibration: Calibration, schedule: str | None = None,
) -> float:  # fmt: skip
    """The predicted seconds of one step (see the module's docstring); ``checkpointing``: the fraction
    of the blocks' forward FLOPs recomputed; ``schedule``: a pipeline's (``"gpipe"``, ``"1f1b"``)."""
    if calibration.ranks > 1:
        return _mesh_seconds(profile, layout, stages, micro_batches, checkpointing, calibration, schedule)
    d, t, s_count, m = layout.get("dp", 1), layout.get("tp", 1), len(stages), micro_batches
    training = profile.training
    busiest, sent = 0.0, 0.0
    for s, units in enumerate(stages):
        work = _work_flops(units, training, checkpointing)
        busiest = max(busiest, work / t * batch_fraction(profile.batch, d))
        if t > 1:
            sent += 0.5 * _layer_outputs(units) * ELEMENT_BYTES * 2 * (t - 1) / t * (2 if training else 1)
        if s > 0:
            sent += units[0].input_bytes * (2 if training else 1)
    if d > 1:
        sent += (d - 1) / d * profile.total("param_bytes") * (3 if training else 1)  # replicate, all-reduce gradients
    bubble = (m + s_count - 1) / m if s_count > 1 else 1.0
    return busiest * bubble / calibration.flops_per_s + sent / calibration.copy_bytes_per_s


def slot_seconds(busy: Sequence[float], waits: Sequence[float], m: int, replicas: int, at_once: float) -> float:
    """The seconds of ``m + S - 1`` slots of a schedule of ``S`` stages (``busy[s]``, ``waits[s]``: one
    micro-batch's computing and dispatching, and waiting, on a rank of stage ``s``; ``replicas``:
    the ranks of each stage): in slot ``k`` stages ``k - M + 1 .. k`` hold a micro-batch, their ranks
    share CPUs that run ``at_once`` ranks at full speed, and the slot lasts as long as its slowest.

    Two stages, M = 4, one rank each, at_once 1.5: the first and last slots one stage alone
    (``busy + wait``), the 3 between both (``busy * 2 / 1.5 + wait``)."""
    total = 0.0
    for k in range(m + len(busy) - 1):
        working = range(max(0, k - m + 1), min(k, len(busy) - 1) + 1)
        slower = max(1.0, len(working) * replicas / at_once)
        total += max(busy[s] * slower + waits[s] for s in working)
    return total


def _mesh_seconds(
    profile: ModelProfile, layout: dict[str, int], stages: Sequence[Sequence[Unit]], m: int, checkpointing: float,
    c: Calibration, schedule: str | None,
) -> float:  # fmt: skip
    d, t, s_count = layout.get("dp", 1), layout.get("tp", 1), len(stages)
    # every forward before the backwards: GPipe, or 1F1B with fewer micro-batches than stages (torch's needs M >= S)
    gpipe_order = profile.training and s_count > 1 and m > 1 and (schedule != "1f1b" or m < s_count)
    training = profile.training
    bandwidth = c.collective_bytes_per_s or c.copy_bytes_per_s
    directions = 2 if training else 1
    at_once = c.concurrency or min(c.ranks, c.cores or c.ranks)  # ranks the CPUs run at the same time

    def collective(ring_bytes: float, calls: float) -> float:
        return calls * collective_seconds(c) + ring_bytes / bandwidth

    def messages(sent_bytes: float, count: float) -> float:
        return count * message_seconds(c) + sent_bytes / bandwidth

    busy, waits = [], []  # per stage and micro-batch: one rank's computing and dispatching, and its collectives
    for s, units in enumerate(stages):
        share = batch_fraction(profile.batch, d) / t
        again = float(checkpointing) if training else 0.0  # the share of the blocks' forward run once more
        blocks = [u for u in units if u.block]
        written = (sum(u.op_bytes for u in units) * (3 if training else 1) + again * sum(u.op_bytes for u in blocks)) * share
        compute = _work_flops(units, training, checkpointing) * share / c.flops_per_s + written / c.copy_bytes_per_s
        # a selective rule (``checkpointing`` a share) recomputes less, but its recompute still dispatches every op
        dispatch = sum(u.ops for u in units) * c.op_seconds + (recompute_seconds(c, blocks) if again else 0.0)
        weights = weight_seconds(c, sum(u.grad_bytes for u in units) / t) if training else 0.0
        if gpipe_order:  # the micro-batches held beyond 1F1B's first stage's: memory new to the rank each step
            compute += page_in_seconds(c, gpipe_held_bytes(units, m, s_count, checkpointing) * share)
        busy.append(compute / m + dispatch + weights + (schedule_seconds(c, training) if s_count > 1 else 0.0))
        wait = 0.0
        if t > 1:  # Megatron pairs: a column layer's input and the row layer after it, one all-reduce each way
            pairs = sum(u.linear_inputs for u in units) / 2
            ring = 0.5 * _layer_outputs(units) * ELEMENT_BYTES * 2 * (t - 1) / t * directions / m
            wait += collective(ring, pairs * directions)
            if again:  # a recomputed block runs its forward all-reduces again (a region holds its shards' collectives)
                ring = 0.5 * _layer_outputs(blocks) * ELEMENT_BYTES * 2 * (t - 1) / t / m
                wait += collective(ring, sum(u.linear_inputs for u in blocks) / 2)
        if s_count > 1:  # per boundary it sits at: forward its values, backward their gradients
            sides = [stages[k][0].input_bytes for k in (s, s + 1) if 0 < k < s_count]
            moved = sum(sides) * batch_fraction(profile.batch, d) / m
            wait += messages(moved * directions, len(sides) * directions * MESSAGES_ON_PATH)
        waits.append(wait)
    total = slot_seconds(busy, waits, m, d * t, at_once)
    if s_count == 1 and (d > 1 or t > 1):
        total += collective_seconds(c)  # the check that every rank calls forward alike: one all-gather
    if d > 1:
        grads = max(sum(u.grad_bytes for u in units) for units in stages) / t
        total += collective(2 * (d - 1) / d * grads, 1 + grads // DDP_BUCKET_BYTES)
    return total
