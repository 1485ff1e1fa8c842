"""The mesh step-time model's pipeline terms (``dpcompile.analysis.step_time``): the schedule's work
per action, the point-to-point message latency of each transfer, the weights' passes per
micro-batch, GPipe's order against 1F1B's and the slots' sharing of the CPUs; and the latency of a
data- or tensor-parallel collective reached after computing; each varied alone on a hand-made profile with round
constants (exact expectations; nothing is timed)."""

from __future__ import annotations

import pytest

from dpcompile.analysis import step_time
from dpcompile.analysis.calibration import Calibration
from dpcompile.analysis.model_profile import ModelProfile, ShardableWeight, Unit
from dpcompile.analysis.step_time import (
    MESSAGES_ON_PATH,
    PARAM_PASSES,
    SCHEDULE_ACTION_OPS,
    slot_seconds,
    step_seconds,
)


def _profile(training: bool = True) -> ModelProfile:
    """Two blocks of 1e6 forward FLOPs and 10 ops each; the second's input is 8000 bytes."""
    units = [Unit(f"b{i}", block=True, param_bytes=256, grad_bytes=256, input_bytes=8000, flops=10**6, ops=10)
             for i in range(2)]  # fmt: skip
    return ModelProfile(units, batch=8, training=training, optimizer="sgd")


#: 1 GFLOP/s, 1 ms an op, 10 ms an all-reduce's latency, 1 MB/s, 2 ranks on 2 cores run at once
MESH = Calibration(1e9, 1e9, ranks=2, cores=2, op_seconds=1e-3, collective_latency_s=1e-2, collective_bytes_per_s=1e6,
                   concurrency=2.0)  # fmt: skip
#: a stage's weights per micro-batch of a training step: PARAM_PASSES over its unit's 256 gradient bytes at 1e9 bytes/s
WEIGHTS = PARAM_PASSES * 256 / 1e9


def _pipeline(p: ModelProfile, m: int, c: Calibration) -> float:
    return step_seconds(p, {"pp": 2}, [[p.units[0]], [p.units[1]]], m, False, c)


@pytest.mark.parametrize("m", [1, 4])
def test_a_pipeline_slot_holds_the_schedule_actions_and_half_of_each_message(m):
    """Per micro-batch a stage computes 3e6 / M FLOPs, dispatches its 10 ops and its schedule's 2 actions
    (forward, backward) of SCHEDULE_ACTION_OPS ops each, and waits for its boundary's 2 transfers (8000 bytes
    over M micro-batches each) with MESSAGES_ON_PATH of a message's latency each: 20 ms given, not the
    all-reduce's back-to-back 10 ms; M + 1 such slots."""
    with_message = Calibration(**{**MESH.__dict__, "synced_collective_s": 2e-2})
    busy = 3e6 / m / 1e9 + 10 * 1e-3 + WEIGHTS + 2 * SCHEDULE_ACTION_OPS * 1e-3
    wait = 2 * MESSAGES_ON_PATH * 2e-2 + 2 * 8000 / m / 1e6
    assert _pipeline(_profile(), m, with_message) == pytest.approx((m + 1) * (busy + wait))
    # without a latency after computing (a calibration of an older format): the back-to-back all-reduce's
    wait_older = 2 * MESSAGES_ON_PATH * 1e-2 + 2 * 8000 / m / 1e6
    assert _pipeline(_profile(), m, MESH) == pytest.approx((m + 1) * (busy + wait_older))


def test_forward_only_counts_one_action_and_one_transfer_a_micro_batch():
    """Without training: 1e6 / 4 FLOPs, 10 ops, one action, the forward transfer only (no gradient: no pass
    over the weights counted)."""
    busy = 1e6 / 4 / 1e9 + 10 * 1e-3 + SCHEDULE_ACTION_OPS * 1e-3
    wait = MESSAGES_ON_PATH * 1e-2 + 8000 / 4 / 1e6
    assert _pipeline(_profile(training=False), 4, MESH) == pytest.approx(5 * (busy + wait))


def test_the_pipeline_terms_leave_data_and_tensor_parallel_alone(monkeypatch):
    """No stage boundary, no schedule: the transfers' share of a latency and the action count change nothing there
    (and do change a pipeline's step)."""
    p = _profile()
    layouts = [({"dp": 2}, [p.units]), ({"tp": 2}, [p.units]), ({"pp": 2}, [[p.units[0]], [p.units[1]]])]
    before = [step_seconds(p, layout, stages, 1, False, MESH) for layout, stages in layouts]
    monkeypatch.setattr(step_time, "MESSAGES_ON_PATH", 5.0)
    monkeypatch.setattr(step_time, "SCHEDULE_ACTION_OPS", 100)
    after = [step_seconds(p, layout, stages, 1, False, MESH) for layout, stages in layouts]
    assert after[:2] == before[:2] and after[2] > before[2]


def test_each_added_micro_batch_costs_a_slot_of_fixed_work():
    """Compute divides over the micro-batches; the fixed work of a slot (ops, actions, latencies) does not:
    from M to M + 1 the step grows by that fixed work, less the bubble's shrinking compute."""
    c = Calibration(**{**MESH.__dict__, "synced_collective_s": 2e-2})
    fixed = 10 * 1e-3 + WEIGHTS + 2 * SCHEDULE_ACTION_OPS * 1e-3 + 2 * MESSAGES_ON_PATH * 2e-2
    per_m = {m: _pipeline(_profile(), m, c) for m in (4, 8)}
    # (M + 1) * (3e-3 / M + 16e-3 / M + fixed): the compute and the bytes shrink per slot, the fixed work does not
    assert per_m[8] - per_m[4] == pytest.approx(4 * fixed + (9 / 8 - 5 / 4) * (3e-3 + 16e-3))


def test_each_micro_batch_passes_over_its_stages_weights():
    """A stage's gradients' bytes, PARAM_PASSES times per micro-batch at the copy bytes/s: 1 MB of gradients at
    1e9 bytes/s is PARAM_PASSES ms more in each of the M + 1 slots; data parallel passes once over the whole model's."""
    p = _profile()
    before = {m: _pipeline(p, m, MESH) for m in (1, 4)}
    for u in p.units:
        u.grad_bytes += 10**6
    for m in (1, 4):
        assert _pipeline(p, m, MESH) - before[m] == pytest.approx((m + 1) * PARAM_PASSES * 1e-3)
    one_pass = PARAM_PASSES * 2 * (256 + 10**6) / 1e9
    dp = step_seconds(p, {"dp": 2}, [p.units], 1, False, MESH)
    # half the batch's 3e6 FLOPs, 20 ops, the weights; the all-reduce of the gradients (latency, ring bytes); the check
    grads = 2 * (256 + 10**6)
    assert dp == pytest.approx(3e-3 + 20e-3 + one_pass + 1e-2 + grads / 1e6 + 1e-2)


def test_a_pipeline_step_grows_with_micro_batches_where_the_weights_term_dominates():
    """Issue 34: two stages of 1e6 forward FLOPs (3 ms a training step at 1 GFLOP/s) and 1 MB of gradients each, no
    dispatch, schedule or latency; CPUs for both ranks. With the calibration's 1e-8 s a weight byte a micro-batch,
    each slot is ``3 ms / M + 10 ms`` and the step ``(M + 1)`` slots: 26, 34.5, 53.75, 93.375 ms at M = 1, 2, 4, 8,
    growing as the MLP pipeline measured. Without the figure (an older calibration): 1.7 passes at the copy's
    1e10 bytes/s, 0.17 ms a micro-batch, and the step falls from 6.34 ms at M = 1 to 4.6 at M = 4 (what the model
    predicted of the MLP)."""
    units = [Unit(f"b{i}", block=True, param_bytes=10**6, grad_bytes=10**6, flops=10**6) for i in range(2)]
    p = ModelProfile(units, batch=8, training=True, optimizer="sgd")
    older = Calibration(1e9, 1e10, ranks=2, cores=2, collective_bytes_per_s=1e9, concurrency=2.0)
    weighed = Calibration(**{**older.__dict__, "microbatch_weight_s_per_byte": 1e-8})
    steps = {m: _pipeline(p, m, weighed) for m in (1, 2, 4, 8)}
    assert steps == pytest.approx({1: 26e-3, 2: 34.5e-3, 4: 53.75e-3, 8: 93.375e-3})
    assert step_time.weight_seconds(weighed, 10**6) == pytest.approx(1e-2)  # the figure, whatever the copy rate
    before = {m: _pipeline(p, m, older) for m in (1, 2, 4, 8)}
    assert before == pytest.approx({m: (m + 1) * (3e-3 / m + PARAM_PASSES * 1e-4) for m in (1, 2, 4, 8)})
    assert before[1] > before[2] > before[4] < before[8]


def test_fill_and_drain_slots_run_alone_and_the_steady_ones_share_the_cpus():
    """Two stages, 4 micro-batches, CPUs running 1.5 ranks at once: the first slot stage 0 alone, the last
    stage 1 alone (full speed), the 3 between both at 2 / 1.5 of their time; each slot its slowest stage."""
    busy, waits = [3.0, 2.0], [0.5, 0.25]
    expected = (3.0 + 0.5) + 3 * (3.0 * 2 / 1.5 + 0.5) + (2.0 + 0.25)
    assert slot_seconds(busy, waits, 4, 1, 1.5) == pytest.approx(expected)
    # each stage on 2 ranks (data parallel within it): 2 ranks alone, 4 together
    assert slot_seconds(busy, waits, 4, 2, 1.5) == pytest.approx(
        (3.0 * 2 / 1.5 + 0.5) + 3 * (3.0 * 4 / 1.5 + 0.5) + (2.0 * 2 / 1.5 + 0.25))
    # CPUs for every rank: no slot slowed; 4 slots holding stage 0 (the slowest), the last stage 1 alone
    assert slot_seconds(busy, waits, 4, 1, 2.0) == pytest.approx(4 * 3.5 + 2.25)
    # one micro-batch: the stages one after the other, each alone
    assert slot_seconds(busy, waits, 1, 1, 1.5) == pytest.approx(3.5 + 2.25)
    # no pipeline: one slot of every rank at once
    assert slot_seconds([3.0], [0.5], 1, 2, 1.5) == pytest.approx(3.0 * 2 / 1.5 + 0.5)


def test_a_pipeline_step_is_its_slots_with_the_cpus_shared():
    """The mesh step of a 2-stage pipeline with CPUs running 1.5 ranks at once: the fill and drain slots at full
    speed, the steady ones slowed by 2 / 1.5 (not the larger of the schedule's path and all the work over 1.5)."""
    shared = Calibration(**{**MESH.__dict__, "concurrency": 1.5, "synced_collective_s": 2e-2})
    busy = 3e6 / 4 / 1e9 + 10 * 1e-3 + WEIGHTS + 2 * SCHEDULE_ACTION_OPS * 1e-3
    wait = 2 * MESSAGES_ON_PATH * 2e-2 + 2 * 8000 / 4 / 1e6
    assert _pipeline(_profile(), 4, shared) == pytest.approx(2 * (busy + wait) + 3 * (busy * 2 / 1.5 + wait))


def test_gpipe_order_pages_in_the_micro_batches_held_beyond_1f1b_first_stage():
    """Each stage saves 1e6 bytes for backward over the batch. In GPipe's order a stage holds all M micro-batches,
    1F1B's first stage min(M, S) = 2: of M = 4, half of the saved bytes are memory new to each rank, paged in at the
    calibration's page_in_bytes_per_s (2e8 here: 2.5 ms a stage, 0.625 ms in each of its 4 slots; every slot of the
    5 holds one at least); with M = 8, three quarters (3.75 ms, 0.47 ms a slot, 9 slots: 8 of them). With M <= S
    (2 micro-batches) GPipe costs what 1F1B does. 1F1B with fewer micro-batches than stages runs GPipe's order."""
    p = _profile()
    for u in p.units:
        u.saved_bytes = 10**6
    paging = Calibration(**{**MESH.__dict__, "page_in_bytes_per_s": 2e8})

    def step(schedule, m=4, c=paging):
        return step_seconds(p, {"pp": 2}, [[p.units[0]], [p.units[1]]], m, False, c, schedule)

    assert step("gpipe") - step("1f1b") == pytest.approx(5 * 0.5e6 / 2e8 / 4)
    assert step("gpipe", m=8) - step("1f1b", m=8) == pytest.approx(9 * 0.75e6 / 2e8 / 8)
    assert step("gpipe", m=2) == step("1f1b", m=2)  # M = S: what 1F1B's first stage holds too
    assert step(None) == step("gpipe")  # GPipe unless named 1F1B
    assert step("1f1b", m=1) == step("gpipe", m=1)  # one micro-batch: the same order
    # the term is the calibrated figure's: twice the rate, half the seconds
    faster = Calibration(**{**MESH.__dict__, "page_in_bytes_per_s": 4e8})
    assert step("gpipe", c=faster) - step("1f1b", c=faster) == pytest.approx((step("gpipe") - step("1f1b")) / 2)
    # a recomputed block holds its input only (8000 bytes each), half of it beyond 1F1B's first stage
    assert step_time.gpipe_held_bytes(p.units, 4, 2, True) == 2 * 8000 / 2
    # without training nothing is held for a backward
    p.training = False
    assert step("gpipe") == step("1f1b")


def test_data_and_tensor_parallel_collectives_cost_the_latency_after_computing():
    """Each data- or tensor-parallel collective comes after the ranks' computing: it costs the calibration's
    ``synced_collective_s`` (50 ms here), not the back-to-back 10 ms. Tensor parallel: the Megatron pair of the two
    blocks' Linears, forward and backward (2 calls) and the check that the ranks call alike (1); data parallel: the
    gradients' all-reduce (1) and the check (1); a pipeline's transfers, MESSAGES_ON_PATH of it each."""
    weight = ShardableWeight(rows=8, cols=8, kind="linear", bytes=256, grad_bytes=256, optimizer_bytes=0,
                             output_elements=1000)  # fmt: skip
    units = [Unit(f"b{i}", block=True, param_bytes=256, grad_bytes=256, input_bytes=8000, flops=10**6, ops=10,
                  linear_inputs=1, shardable=[weight]) for i in range(2)]  # fmt: skip
    p = ModelProfile(units, batch=8, training=True, optimizer="sgd")
    synced = Calibration(**{**MESH.__dict__, "synced_collective_s": 5e-2})
    # half of 3 x 2e6 FLOPs, 20 ops, PARAM_PASSES over half the 512 gradient bytes; an all-reduce each way of half
    # the 2000 output elements' 4 bytes, ring factor 2 (n-1)/n = 1: 8000 bytes at 1e6 bytes/s
    tp_work = 3e-3 + 20e-3 + PARAM_PASSES * 256 / 1e9 + 8000 / 1e6
    assert step_seconds(p, {"tp": 2}, [p.units], 1, False, synced) == pytest.approx(tp_work + 3 * 5e-2)
    assert step_seconds(p, {"tp": 2}, [p.units], 1, False, MESH) == pytest.approx(tp_work + 3 * 1e-2)  # older: 0
    # half the batch: 3e-3 s, 20 ops, PARAM_PASSES over the 512 gradient bytes; their all-reduce's ring bytes
    dp_work = 3e-3 + 20e-3 + PARAM_PASSES * 512 / 1e9 + 512 / 1e6
    assert step_seconds(p, {"dp": 2}, [p.units], 1, False, synced) == pytest.approx(dp_work + 2 * 5e-2)
    # 2 stages, 4 micro-batches: 5 slots, each with its stage's 2 transfers (forward, backward)
    assert _pipeline(p, 4, synced) - _pipeline(p, 4, MESH) == pytest.approx(5 * 2 * MESSAGES_ON_PATH * (5e-2 - 1e-2))


def test_a_checkpointed_block_costs_its_forward_again_and_each_op_at_the_recompute_figure():
    """Data parallel over 2 ranks (each half the batch): recomputing both blocks adds their forward FLOPs (2e6 / 2
    at 1 GFLOP/s) and each of their 20 forward ops at the calibration's ``recompute_op_s`` (5 ms); a calibration
    without the figure counts RECOMPUTE_OPS of its 1 ms ``op_seconds``."""
    p = _profile()

    def extra(c: Calibration) -> float:
        def step(checkpointing: bool) -> float:
            return step_seconds(p, {"dp": 2}, [p.units], 1, checkpointing, c)

        return step(True) - step(False)

    with_figure = Calibration(**{**MESH.__dict__, "recompute_op_s": 5e-3})
    assert extra(with_figure) == pytest.approx(1e6 / 1e9 + 20 * 5e-3)
    assert extra(MESH) == pytest.approx(1e6 / 1e9 + 20 * step_time.RECOMPUTE_OPS * 1e-3)


def test_a_selective_rule_recomputes_a_share_of_the_flops_but_dispatches_every_op_again():
    """Recomputing a tenth of the blocks' FLOPs (a rule keeping the matmuls): a tenth of their forward FLOPs again,
    but every one of their 20 forward ops runs through the recompute's dispatch at ``recompute_op_s``."""
    p = _profile()
    c = Calibration(**{**MESH.__dict__, "recompute_op_s": 5e-3})

    def step(checkpointing: float) -> float:
        return step_seconds(p, {"dp": 2}, [p.units], 1, checkpointing, c)

    assert step(0.1) - step(0.0) == pytest.approx(0.1 * 1e6 / 1e9 + 20 * 5e-3)


def test_a_checkpointed_tensor_parallel_block_runs_its_forward_all_reduce_again():
    """Tensor parallel over 2 ranks, both blocks recomputed: beyond their forward (half of 2e6 FLOPs, 20 ops at
    ``recompute_op_s``), the Megatron pair's forward all-reduce once more: one call at ``synced_collective_s`` and
    its 4000 ring bytes (half the 2000 output elements' 4 bytes, ring factor 1) at 1e6 bytes/s."""
    weight = ShardableWeight(rows=8, cols=8, kind="linear", bytes=256, grad_bytes=256, optimizer_bytes=0,
                             output_elements=1000)  # fmt: skip
    units = [Unit(f"b{i}", block=True, param_bytes=256, grad_bytes=256, input_bytes=8000, flops=10**6, ops=10,
                  linear_inputs=1, shardable=[weight]) for i in range(2)]  # fmt: skip
    p = ModelProfile(units, batch=8, training=True, optimizer="sgd")
    c = Calibration(**{**MESH.__dict__, "synced_collective_s": 5e-2, "recompute_op_s": 5e-3})

    def step(checkpointing: bool) -> float:
        return step_seconds(p, {"tp": 2}, [p.units], 1, checkpointing, c)

    assert step(True) - step(False) == pytest.approx(1e6 / 1e9 + 20 * 5e-3 + 5e-2 + 4000 / 1e6)
