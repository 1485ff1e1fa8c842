"""The mesh calibration (``calibrate_mesh``): where it is cached, when the cache is reused and when it
is measured again; and the mesh step-time model's arithmetic on a hand-made profile. Nothing here
times anything: the measuring functions are replaced by fixed figures that count their calls."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dpcompile.analysis import calibration
from dpcompile.analysis.calibration import Calibration, reference_mesh
from dpcompile.analysis.model_profile import ModelProfile, ShardableWeight, Unit
from dpcompile.analysis.step_time import MESSAGES_ON_PATH, PARAM_PASSES, SCHEDULE_ACTION_OPS, step_seconds


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """The measuring functions replaced by fixed figures; ``runs`` counts the gloo measurements."""
    runs = []
    monkeypatch.setattr(calibration, "_matmul_flops_per_s", lambda device: 1e9)
    monkeypatch.setattr(calibration, "_copy_bytes_per_s", lambda device: 2e9)
    monkeypatch.setattr(calibration, "_rank_flops_per_s", lambda: 1e9)
    monkeypatch.setattr(calibration, "_rank_copy_bytes_per_s", lambda: 2e9)
    monkeypatch.setattr(calibration, "_op_seconds", lambda: 1e-5)
    monkeypatch.setattr(calibration, "_concurrency", lambda workers: 1.5)
    monkeypatch.setattr(calibration, "_gloo_all_reduce", lambda ranks: runs.append(ranks) or (1e-4, 5e8))
    monkeypatch.setattr(calibration, "_gloo_synced_seconds", lambda ranks: 3e-3)
    monkeypatch.setattr(calibration, "_page_in_bytes_per_s", lambda workers: 7e8)
    monkeypatch.setattr(calibration, "_microbatch_weight_seconds_per_byte", lambda: 4e-10)
    monkeypatch.setattr(calibration, "_recompute_op_seconds", lambda: 3e-5)
    monkeypatch.setattr(calibration, "available_cores", lambda: 2)
    monkeypatch.setenv("DPCOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DPCOMPILE_CALIBRATION", raising=False)
    return runs


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    version = torch.__version__.split("+")[0]
    monkeypatch.setenv("DPCOMPILE_CACHE_DIR", str(tmp_path / "a"))
    assert calibration.cache_path("gloo4") == tmp_path / "a" / f"calibration-gloo4-torch{version}.json"
    monkeypatch.delenv("DPCOMPILE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert calibration.cache_path("cpu") == tmp_path / "xdg" / "dpcompile" / f"calibration-cpu-torch{version}.json"


def test_mesh_calibration_is_measured_once_then_read_from_its_cache(measured, tmp_path):
    first = calibration.calibrate_mesh(2)
    expected = Calibration(1e9, 2e9, "cpu", "measured", ranks=2, cores=2, op_seconds=1e-5, collective_latency_s=1e-4,
                           collective_bytes_per_s=5e8, concurrency=1.5, synced_collective_s=3e-3,
                           page_in_bytes_per_s=7e8, microbatch_weight_s_per_byte=4e-10, recompute_op_s=3e-5)  # fmt: skip
    assert first == expected and measured == [2]
    path = calibration.cache_path("gloo2")
    assert path.parent == tmp_path and json.loads(path.read_text())["version"] == calibration.CACHE_VERSION
    again = calibration.calibrate_mesh(2)
    assert again.source == "cache" and again == Calibration(**{**expected.__dict__, "source": "cache"})
    assert measured == [2]  # reused, not measured again
    calibration.calibrate_mesh(4)  # another mesh size: its own file
    assert measured == [2, 4] and calibration.cache_path("gloo4").is_file()


def test_the_mesh_concurrency_is_the_median_of_three_readings_between_the_other_measures(measured, monkeypatch):
    """A burst of other work during one reading (1.1, where the ranks run at 1.8-1.9) is outvoted by the
    two taken before and after the other measures."""
    readings = iter([1.1, 1.9, 1.8])
    monkeypatch.setattr(calibration, "_concurrency", lambda workers: next(readings))
    assert calibration.calibrate_mesh(2).concurrency == 1.8


def test_mesh_calibration_is_measured_again_where_the_cache_no_longer_holds(measured, monkeypatch):
    calibration.calibrate_mesh(2)
    path = calibration.cache_path("gloo2")
    monkeypatch.setattr(calibration, "available_cores", lambda: 8)  # the ranks now share other cores
    assert calibration.calibrate_mesh(2).cores == 8 and measured == [2, 2]
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "version": calibration.CACHE_VERSION - 1}))  # an older format
    assert calibration.calibrate_mesh(2).source == "measured" and measured == [2, 2, 2]
    path.write_text("{not json")
    assert calibration.calibrate_mesh(2).source == "measured" and len(measured) == 4
    assert calibration.calibrate_mesh(2).source == "cache" and len(measured) == 4
    monkeypatch.setenv("DPCOMPILE_CALIBRATION", "fresh")
    assert calibration.calibrate_mesh(2).source == "measured" and len(measured) == 5


def test_mesh_calibration_off_uses_the_reference_and_touches_no_file(measured, monkeypatch, tmp_path):
    monkeypatch.setenv("DPCOMPILE_CALIBRATION", "off")
    assert calibration.calibrate_mesh(4) == reference_mesh(4) and measured == []
    assert not list(tmp_path.iterdir())


def test_a_one_process_cache_of_the_older_format_is_measured_again(measured):
    path = calibration.cache_path("cpu")
    path.write_text(json.dumps({"flops_per_s": 5.0, "copy_bytes_per_s": 6.0, "device": "cpu"}))  # no version
    assert calibration.calibrate("cpu").flops_per_s == 1e9


@pytest.mark.parametrize(
    "text",
    ["[]", "null", "[" * 100_000, '{"version": 2, "flops_per_s": NaN}', " " * (1 << 20)]
    + [json.dumps({**dict(version=2, flops_per_s=5.0, copy_bytes_per_s=6.0, device="cpu", ranks=1, cores=0,
                          op_seconds=0, collective_latency_s=0, collective_bytes_per_s=0, concurrency=0), **edit})
       for edit in ({"flops_per_s": "fast"}, {"flops_per_s": 0}, {"copy_bytes_per_s": -1.0}, {"ranks": 0},
                    {"op_seconds": 1e400}, {"device": 3})],
    ids=["list", "null", "deep", "nan", "large", "str", "zero", "negative", "no-ranks", "inf", "device"],
)  # fmt: skip
def test_an_edited_or_foreign_cache_file_is_measured_again_never_planned_with(measured, text):
    """Not an object, nested past the parser, too large, a figure of the wrong type or range (NaN,
    0 FLOP/s, inf): measured again (was an AttributeError, a RecursionError, or planning with it)."""
    path = calibration.cache_path("cpu")
    path.write_text(text)
    found = calibration.calibrate("cpu")
    assert found.source == "measured" and (found.flops_per_s, found.copy_bytes_per_s) == (1e9, 2e9)
    assert calibration.calibrate("cpu").source == "cache"  # and the good figures replaced it


def test_a_folder_at_the_cache_name_is_measured_around_leaving_no_staging_file(measured):
    """A folder where the cache file goes: measured each time, and (before) each process left its
    calibration-cpu-....<pid>.tmp beside it, the rename onto the folder having failed."""
    path = calibration.cache_path("cpu")
    path.mkdir()
    assert calibration.calibrate("cpu").source == "measured"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name] and path.is_dir()


# --------------------------------------------------------------------------- the mesh's step time
def _profile() -> ModelProfile:
    """Two blocks of 1e9 forward FLOPs and 10 ops each, one Linear each with 1000 output elements (a
    Megatron pair between them: two inputs read)."""
    weight = ShardableWeight(rows=8, cols=8, kind="linear", bytes=256, grad_bytes=256, optimizer_bytes=0,
                             output_elements=1000)  # fmt: skip
    units = [Unit(f"b{i}", block=True, param_bytes=256, grad_bytes=256, input_bytes=4000, flops=10**9, ops=10,
                  linear_inputs=1, shardable=[weight]) for i in range(2)]  # fmt: skip
    return ModelProfile(units, batch=8, training=True, optimizer="sgd")


MESH = Calibration(1e9, 1e9, ranks=2, cores=2, op_seconds=1e-3, collective_latency_s=1e-2, collective_bytes_per_s=1e6)


def test_mesh_step_time_of_data_parallel():
    p = _profile()
    # half the batch's 3 x 2e9 FLOPs at 1e9 FLOP/s, 20 ops at 1 ms, PARAM_PASSES over the 512 gradient bytes at the
    # copy's 1e9 bytes/s, one all-reduce of them, and the all-gather checking that the ranks call alike
    weights = PARAM_PASSES * 512 / 1e9
    assert step_seconds(p, {"dp": 2}, [p.units], 1, False, MESH) == pytest.approx(3.0 + 0.02 + weights + 0.01 + 512 / 1e6 + 0.01)
    for u in p.units:
        u.op_bytes = 10**6  # memory-bound ops: half the batch's 3 x 2e6 bytes written at the copy's 1e9 bytes/s
    assert step_seconds(p, {"dp": 2}, [p.units], 1, False, MESH) == pytest.approx(3.003 + 0.02 + weights + 0.01 + 512 / 1e6 + 0.01)


def test_mesh_step_time_of_tensor_parallel_and_oversubscription():
    p = _profile()
    # each rank half the FLOPs, every op, an all-reduce per Megatron pair (1 pair, forward and backward: 2 calls)
    # of half the outputs' bytes each way: 0.5 * 2000 elements * 4 bytes * 2 (n-1)/n * 2 directions = 8000 bytes;
    # the all-gather checking the inputs; PARAM_PASSES over its half of the gradients
    weights = PARAM_PASSES * 256 / 1e9
    expected = 3.0 + 0.02 + weights + 2 * 0.01 + 8000 / 1e6 + 0.01
    assert step_seconds(p, {"tp": 2}, [p.units], 1, False, MESH) == pytest.approx(expected)
    # the CPUs run one rank at a time (one core, or busy): both ranks' computing and dispatching in turns, then
    # one rank's collectives and the check
    crowded = Calibration(**{**MESH.__dict__, "concurrency": 1.0})
    assert step_seconds(p, {"tp": 2}, [p.units], 1, False, crowded) == pytest.approx(2 * (3.02 + weights) + 0.028 + 0.01)


def test_mesh_step_time_of_a_pipeline_counts_slots_and_per_micro_batch_dispatch():
    p = _profile()
    stages = [[p.units[0]], [p.units[1]]]
    # a stage's micro-batch: 3e9 / 4 FLOPs, its 10 ops and its schedule's 2 actions (SCHEDULE_ACTION_OPS each), one
    # transfer each way at its one boundary of 1000 bytes (the second stage's input, 4000 bytes over 4 micro-batches),
    # MESSAGES_ON_PATH of each transfer's latency on the path (MESH has none after computing: the all-reduce's, 1e-2); 4 + 2 - 1
    # slots of the slowest stage (tests/analysis/test_step_time.py varies each term)
    busy = 0.75 + 10 * 1e-3 + PARAM_PASSES * 256 / 1e9 + 2 * SCHEDULE_ACTION_OPS * 1e-3
    wait = 2 * MESSAGES_ON_PATH * 1e-2 + 2 * 1000 / 1e6
    assert step_seconds(p, {"pp": 2}, stages, 4, False, MESH) == pytest.approx(5 * (busy + wait))
    # one rank at a time: the fill and drain slots one stage alone, the 3 between both stages' work in turns; each
    # slot its transfers
    crowded = Calibration(**{**MESH.__dict__, "concurrency": 1.0})
    assert step_seconds(p, {"pp": 2}, stages, 4, False, crowded) == pytest.approx(2 * busy + 3 * 2 * busy + 5 * wait)


def test_mesh_calibration_without_loopback_gloo_uses_round_collective_figures(measured, monkeypatch):
    def no_gloo(ranks: int) -> tuple[float, float]:
        raise RuntimeError("no device for gloo")

    monkeypatch.setattr(calibration, "_gloo_all_reduce", no_gloo)
    found = calibration.calibrate_mesh(2)
    assert (found.collective_latency_s, found.collective_bytes_per_s, found.synced_collective_s) == (1e-4, 1e9, 1e-4)
    assert (found.flops_per_s, found.op_seconds, found.concurrency) == (1e9, 1e-5, 1.5)  # the rest still measured


def test_cached_mesh_reads_the_cache_and_never_measures(measured, monkeypatch):
    """``cached_mesh`` (what context parallel's exchange choice reads): the reference figures until
    ``calibrate_mesh`` has cached some, then those; with calibration off, the reference; nothing measured."""
    assert calibration.cached_mesh(2) == reference_mesh(2) and measured == []
    calibration.calibrate_mesh(2)
    assert calibration.cached_mesh(2).source == "cache" and calibration.cached_mesh(2).synced_collective_s == 3e-3
    assert calibration.cached_mesh(4) == reference_mesh(4) and measured == [2]  # no cache of 4 ranks
    monkeypatch.setenv("DPCOMPILE_CALIBRATION", "fresh")  # the cache as it is: measuring is calibrate_mesh's
    assert calibration.cached_mesh(2).source == "cache" and measured == [2]
    monkeypatch.setenv("DPCOMPILE_CALIBRATION", "off")
    assert calibration.cached_mesh(2) == reference_mesh(2) and measured == [2]


def test_measuring_leaves_the_callers_generator_as_it_was(measured, monkeypatch):
    """Every measure draws random tensors (here: each replaced one draws one): a calibration measured afresh
    leaves the global generator where it was, so a first plan and a cached one draw alike after it."""
    for name in ("_matmul_flops_per_s", "_copy_bytes_per_s"):
        monkeypatch.setattr(calibration, name, lambda device: torch.rand(()).item() + 1e9)
    for name in ("_rank_flops_per_s", "_microbatch_weight_seconds_per_byte", "_recompute_op_seconds"):
        monkeypatch.setattr(calibration, name, lambda: torch.rand(()).item() + 1e9)
    monkeypatch.setattr(calibration, "_gloo_synced_seconds", lambda ranks: torch.rand(()).item() + 1e-3)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    calibration.calibrate("cpu")
    calibration.calibrate_mesh(2)
    assert torch.equal(torch.rand(3), expected)


def test_the_latency_after_computing_is_measured_on_gloo_threads():
    """Measured for real (2 gloo groups on threads, 3 calls after a few matmuls each): a positive, finite
    number of seconds that counts each call, so at least the back-to-back floor of a microsecond."""
    seconds = calibration._gloo_synced_seconds(2, work_s=1e-4, calls=3)
    assert 1e-6 <= seconds < 60


def test_the_page_in_rate_is_measured_by_threads_at_once(monkeypatch):
    """Measured for real (2 threads, 1 round each, a 4 MiB tensor: small, so not always new memory as the
    40 MiB default is): a positive, finite rate, each thread filling one tensor made for it (``torch.empty``)."""
    made = []
    empty = torch.empty
    monkeypatch.setattr(calibration.torch, "empty", lambda *a, **k: made.append(a) or empty(*a, **k))
    rate = calibration._page_in_bytes_per_s(2, size=4 << 20, rounds=1)
    assert 0 < rate < float("inf") and made == [((4 << 20) // 4,)] * 2


def test_a_micro_batch_weight_cost_is_measured_on_a_block_split_in_micro_batches():
    """Measured for real (a 64-wide MLP block, 32 rows as one micro-batch and as two, one round): seconds per byte of
    its weights, positive and finite, far below a second a byte (each micro-batch costs its weights' bytes, not more
    than microseconds each); the global generator is left as it was."""
    state = torch.get_rng_state()
    seconds = calibration._microbatch_weight_seconds_per_byte(width=64, rows=32, count=2, rounds=1)
    assert 0 < seconds < 1e-6
    assert torch.equal(torch.get_rng_state(), state)  # its seeded weights and rows leave the caller's generator alone


def test_a_recomputed_op_is_measured_on_a_block_trained_plainly_and_checkpointed(monkeypatch):
    """Measured for real (a tiny transformer block, one round): seconds per forward op, positive and finite and
    at least a microsecond (a recompute dispatches each op again and runs checkpoint's hooks); the block runs
    under ``dpcompile.runtime.checkpoint`` without the undo (it writes nothing); the generator is left alone."""
    from dpcompile.runtime import recompute

    calls = []
    checkpoint = recompute.checkpoint
    monkeypatch.setattr(recompute, "checkpoint", lambda *a, **k: calls.append(k) or checkpoint(*a, **k))
    state = torch.get_rng_state()
    seconds = calibration._recompute_op_seconds(rounds=1)
    assert 1e-6 <= seconds < 1.0
    assert calls == [{"undo_writes": False}] * 2  # the warm-up and the round
    assert torch.equal(torch.get_rng_state(), state)


def test_the_concurrency_is_measured_on_processes_else_on_threads(monkeypatch):
    """Two busy-loop processes against one, for real (2 rounds of 5 ms): a figure between 1 and the 2 workers;
    where no process can be started, the threads' figure instead."""

    def no_threads(workers):
        raise AssertionError("processes could be started: the threads' figure is not asked for")

    with monkeypatch.context() as patched:
        patched.setattr(calibration, "_thread_concurrency", no_threads)
        assert 1.0 <= calibration._concurrency(2, window=0.02, rounds=2) <= 2.0
    assert calibration._concurrency(1) == 1.0

    def no_process(*args, **kwargs):
        raise OSError("no fork here")

    monkeypatch.setattr(calibration.subprocess, "Popen", no_process)
    monkeypatch.setattr(calibration, "_thread_concurrency", lambda workers: 1.25)
    assert calibration._concurrency(2) == 1.25


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_mesh_calibration_asked_for_where_gradients_are_off_still_trains_its_blocks(monkeypatch, tmp_path, mode):
    """``plan="auto"`` under ``torch.no_grad()`` or ``torch.inference_mode()`` measures a fresh calibration: the
    dispatch, micro-batch weight and recompute measures train small blocks for real (gradients on, real tensors)
    and give positive figures, where they raised before (gloo and the concurrency replaced: not under test)."""
    from functools import partial

    from dpcompile.analysis import calibration_steps

    monkeypatch.setattr(calibration, "_gloo_all_reduce", lambda ranks: (1e-4, 5e8))
    monkeypatch.setattr(calibration, "_gloo_synced_seconds", lambda ranks: 3e-3)
    monkeypatch.setattr(calibration, "_concurrency", lambda workers: 1.5)
    monkeypatch.setattr(calibration, "_page_in_bytes_per_s", lambda workers: 7e8)
    monkeypatch.setattr(calibration, "_microbatch_weight_seconds_per_byte",
                        partial(calibration_steps.microbatch_weight_seconds_per_byte, width=64, rows=32, count=2, rounds=1))  # fmt: skip
    monkeypatch.setattr(calibration, "_recompute_op_seconds", partial(calibration_steps.recompute_op_seconds, rounds=1))
    monkeypatch.setenv("DPCOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DPCOMPILE_CALIBRATION", raising=False)
    with mode():
        found = calibration.calibrate_mesh(2)
    assert found.op_seconds > 0 and found.microbatch_weight_s_per_byte > 0 and found.recompute_op_s > 0


def test_rank_zero_broadcasts_every_figure_a_rank_does_not_know_itself():
    """``_agree``'s figures are every field of Calibration but the device, the source and the rank count (the
    recompute figure was left out once: the other ranks planned with 0)."""
    numbers = {f.name for f in dataclasses.fields(Calibration)} - {"device", "source", "ranks"}
    assert set(calibration._NUMBERS) == numbers and "recompute_op_s" in numbers
