"""plan="auto": every layout of the devices predicted, the fastest that fits built; the candidates
table; the no-fit error; the chosen program equals eager; the calibration cache."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.analysis import calibration
from dpcompile.analysis.memory import format_bytes
from dpcompile.errors import DpCompileError
from dpcompile.planner import enumerate_layouts, plan_layouts

pytestmark = pytest.mark.filterwarnings("ignore:.*would run whole")


@pytest.fixture(autouse=True)
def _reference_constants(monkeypatch):
    """The same cost-model constants on every machine, and no cache written under the user's home."""
    monkeypatch.setenv("DPCOMPILE_CALIBRATION", "off")


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, layers: int = 4, d: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, 8)

    def forward(self, x, y):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return nn.functional.mse_loss(self.head(h), y)


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return Stack().double()


X, Y = torch.randn(8, 16, 16, dtype=torch.float64), torch.randn(8, 16, 8, dtype=torch.float64)
LABELS = ["cpu#0", "cpu#1"]


def _planned(budget: int):
    return plan_layouts(_stack(), LABELS, dict.fromkeys(LABELS, budget), optimizer="adamw", training=True,
                        example_inputs=(X, Y), example_kwargs=None, device=torch.device("cpu"))  # fmt: skip


def _budget_between_data_parallel_and_the_least() -> tuple[int, int]:
    """A budget data parallel (and plain tensor parallel) do not fit, and the data-parallel peak."""
    planned = _planned(1 << 40)
    peak = {c.spec.name: c.peak for c in planned.candidates if c.per_device}
    assert min(peak.values()) < peak["tp2"] < peak["dp2"]
    return (min(peak.values()) + peak["tp2"]) // 2, peak["dp2"]


def test_planner_chooses_a_layout_that_fits_where_data_parallel_does_not():
    budget, dp_peak = _budget_between_data_parallel_and_the_least()
    pm = dpcompile.transform(_stack(), ["cpu"] * 2, example_inputs=(X, Y), memory_per_device=budget,
                             optimizer="adamw", plan="auto")  # fmt: skip
    assert pm.layout != {"dp": 2} and pm.strategy == "pipeline"
    chosen = [c for c in pm.candidates if c.rejected is None]
    assert len(chosen) == 1 and chosen[0].fits and chosen[0].peak <= budget < dp_peak
    assert pm.memory_plan.peak == chosen[0].peak
    fitting = [c for c in pm.candidates if c.fits]
    assert min(c.step_time for c in fitting) == chosen[0].step_time  # the fastest that fits
    by_name = {c.spec.name: c for c in pm.candidates}
    assert by_name["dp2"].rejected.startswith("does not fit")
    # the stages built where the prediction cuts them: before the module it starts the second at
    expected = {"pipeline": list(chosen[0].stage_starts), "micro_batches": chosen[0].spec.micro_batches,
                "schedule": chosen[0].spec.schedule}  # fmt: skip
    assert chosen[0].keywords().items() >= expected.items() and len(chosen[0].stage_starts) == 1
    assert pm.stage_plan.module_paths[1][0].startswith(chosen[0].stage_starts[0])


def test_candidates_table_lists_every_enumerated_layout_with_a_reason():
    budget, _ = _budget_between_data_parallel_and_the_least()
    pm = dpcompile.transform(_stack(), ["cpu"] * 2, example_inputs=(X, Y), memory_per_device=budget,
                             optimizer="adamw", plan="auto")  # fmt: skip
    report = dpcompile.explain(pm, X, Y)
    enumerated = enumerate_layouts(2, batch=8, blocks=True)
    assert len(enumerated) == 18  # dp, tp, pp x (gpipe 1, 2, 4, 8 + 1f1b 2, 4, 8), each with and without ckpt
    assert [(dict(s.layout), s.schedule, s.checkpointing) for s in enumerated] == [
        (c["layout"], c["schedule"], c["checkpointing"]) for c in report.candidates
    ]
    assert [c["rejected"] for c in report.candidates].count(None) == 1
    for c in report.candidates:
        assert c["rejected"] is None or c["rejected"].startswith(("does not fit", "fits, but"))
        assert c["predicted_peak_bytes"] == sum(c["predicted_peak_by_kind"].values()) > 0
        assert c["predicted_step_time"] > 0
    text = str(report)
    assert "Layouts considered" in text and "pp2 1f1b mb8" in text
    json.dumps(report.to_dict())


def test_a_budget_nothing_meets_names_the_smallest_predicted_peak():
    planned = _planned(1 << 40)
    least = min(c.peak for c in planned.candidates if c.per_device)
    model = _stack()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DpCompileError, match="no layout fits") as caught:
        dpcompile.transform(model, ["cpu"] * 2, example_inputs=(X, Y), memory_per_device=least - 1,
                            optimizer="adamw", plan="auto")  # fmt: skip
    assert f"the smallest predicted peak is {format_bytes(least)}" in str(caught.value)
    assert f"({least} bytes)" in str(caught.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # a failure changes nothing
    dpcompile.transform(_stack(), ["cpu"] * 2, example_inputs=(X, Y), memory_per_device=least,
                        optimizer="adamw", plan="auto")  # fmt: skip  # the suggested budget fits


@pytest.mark.parametrize("fraction", [0.5, 1.5], ids=["tight", "loose"])
def test_the_chosen_program_equals_eager(fraction):
    planned = _planned(1 << 40)
    peaks = sorted(c.peak for c in planned.candidates if c.per_device)
    dp = next(c.peak for c in planned.candidates if c.spec.name == "dp2")
    budget = int(dp * fraction) if fraction > 1 else int(peaks[0] * 1.02)
    model = _stack()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(X, Y), memory_per_device=budget,
                             optimizer="adamw", plan="auto")  # fmt: skip
    assert ("activation_checkpointing" in pm.strategies) == (fraction < 1)  # only checkpointing fits the tight one
    loss = pm(X, Y)
    loss.backward()
    expected = reference(X, Y)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_plan_auto_refuses_a_layout_given_and_needs_examples():
    with pytest.raises(ValueError, match="leave tensor_parallel=True out"):
        dpcompile.transform(_stack(), ["cpu"] * 2, example_inputs=(X, Y), memory_per_device="1GiB", plan="auto",
                            tensor_parallel=True)  # fmt: skip
    with pytest.raises(ValueError, match="example_inputs="):
        dpcompile.transform(_stack(), ["cpu"] * 2, memory_per_device="1GiB", plan="auto")


def test_calibration_is_cached_and_can_be_turned_off(monkeypatch, tmp_path):
    runs = []
    monkeypatch.setattr(calibration, "_matmul_flops_per_s", lambda device: runs.append(device) or 1e9)
    monkeypatch.setattr(calibration, "_copy_bytes_per_s", lambda device: 2e9)
    monkeypatch.setenv("DPCOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DPCOMPILE_CALIBRATION")
    first = calibration.calibrate("cpu")
    assert (first.source, first.flops_per_s, first.copy_bytes_per_s, len(runs)) == ("measured", 1e9, 2e9, 1)
    assert calibration.cache_path("cpu").parent == tmp_path and calibration.cache_path("cpu").is_file()
    again = calibration.calibrate("cpu")
    assert (again.source, again.flops_per_s, len(runs)) == ("cache", 1e9, 1)  # read back, not measured again
    monkeypatch.setenv("DPCOMPILE_CALIBRATION", "fresh")
    assert calibration.calibrate("cpu").source == "measured" and len(runs) == 2
    monkeypatch.setenv("DPCOMPILE_CALIBRATION", "off")
    monkeypatch.setenv("DPCOMPILE_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert calibration.calibrate("cpu") == calibration.REFERENCE and len(runs) == 2
    assert not (tmp_path / "elsewhere").exists()
    monkeypatch.delenv("DPCOMPILE_CALIBRATION")
    monkeypatch.setenv("DPCOMPILE_CACHE_DIR", str(tmp_path))
    planned = _planned(1 << 40)  # the planner's step times use the cached constants
    assert planned.calibration.source == "cache" and len(runs) == 2


def test_measure_counts_the_1f1b_step_itself():
    """A 1F1B pipeline is measured running 1F1B (each micro-batch's backward as soon as it can), which
    holds less on every device than its GPipe program; the step leaves the gradients as they were."""
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        model = _stack()
        pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(X, Y), pipeline=2, micro_batches=4,
                                 schedule=schedule)  # fmt: skip
        peaks[schedule] = dpcompile.measure(pm, X, Y).step_allocated_peak
        assert all(p.grad is None for p in model.parameters())
    assert all(0 < peaks["1f1b"][d] < peaks["gpipe"][d] for d in ("cpu#0", "cpu#1")), peaks


def test_identical_blocks_are_profiled_once_with_the_same_figures(monkeypatch):
    """Planning runs the first two of six identical blocks and repeats them: every unit's figures
    equal those of the run through all six, and the model keeps its six blocks."""
    from dpcompile.analysis import model_profile

    torch.manual_seed(0)
    model = Stack(layers=6).double()
    figures = []
    for profiled in (2, 100):
        monkeypatch.setattr(model_profile, "PROFILED_BLOCKS", profiled)
        profile = model_profile.profile_model(model, (X, Y), None, optimizer="adamw", training=True)
        figures.append([(u.name, u.block, u.param_bytes, u.grad_bytes, u.optimizer_bytes, u.saved_bytes,
                         u.input_bytes, u.flops, u.shardable) for u in profile.units])  # fmt: skip
    assert figures[0] == figures[1] and [f[0] for f in figures[0] if f[1]] == [f"layers.{i}" for i in range(6)]
    assert len(model.layers) == 6
    assert sum(f[2] for f in figures[0]) == sum(p.numel() * 8 for p in model.parameters())


class ConvNet(nn.Module):
    """No repeated blocks: its layers sit in two Sequentials (as SqueezeNet's and VGG's do)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(inplace=True), nn.Conv2d(8, 16, 3), nn.ReLU(inplace=True),
                                      nn.MaxPool2d(2), nn.Conv2d(16, 32, 3), nn.ReLU(inplace=True), nn.Conv2d(32, 32, 3))  # fmt: skip
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 2 * 2, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def test_a_model_without_repeated_blocks_is_cut_where_the_pipeline_cuts_it():
    """The planner's units are the Sequentials' layers, not ``features`` whole: its two stages hold the
    parameters the pipeline it then builds holds (it predicted ``features`` on one device, the
    classifier on the other: SqueezeNet's second stage measured 6 MB where 74 KB were predicted)."""
    from dpcompile.analysis.model_profile import profile_model

    torch.manual_seed(0)
    model, x = ConvNet(), torch.randn(4, 3, 16, 16)
    units = [u.name for u in profile_model(model, (x,), None, optimizer="sgd", training=True).units]
    assert units == ["pre", *(f"features.{i}" for i in range(8)), "classifier.0", "classifier.1"]
    planned = plan_layouts(model, LABELS, dict.fromkeys(LABELS, 1 << 40), optimizer="sgd", training=True,
                           example_inputs=(x,), example_kwargs=None, device=torch.device("cpu"))  # fmt: skip
    predicted = next(c for c in planned.candidates if c.spec.name == "pp2 gpipe mb1").per_device
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, example_inputs=(x,))
    built = dpcompile.explain(pm, x).memory_estimate
    assert {d: kinds["parameters"] for d, kinds in predicted.items()} == {d: kinds["parameters"] for d, kinds in built.items()}


class LabelledRows(nn.Module):
    """DeBERTa-v2's loss, reduced: the rows whose label is not negative, picked by a ``nonzero`` index
    (a count the fake run cannot know)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(d, d), nn.Linear(d, 4)

    def forward(self, x, labels):
        index = (labels >= 0).nonzero().view(-1)
        return self.head(torch.tanh(self.body(x))[index]).pow(2).mean()


class CountedRows(LabelledRows):
    """The count read back as a Python int (``.item()``): no fake run can size what follows."""

    def forward(self, x, labels):
        return self.head(torch.tanh(self.body(x))[: int((labels >= 0).sum().item())]).pow(2).mean()


def test_plan_auto_sizes_a_data_dependent_op_by_its_upper_bound_and_equals_eager():
    """The fake run gives ``nonzero`` its largest output (every element) instead of failing: the layout
    planned and built computes what the model does."""
    torch.manual_seed(0)
    model, x, labels = LabelledRows(), torch.randn(6, 8), torch.tensor([0, -1, 3, 2, -1, 1])
    pm = dpcompile.transform(model, ["cpu"] * 2, plan="auto", memory_per_device="1GiB", example_inputs=(x, labels))
    torch.testing.assert_close(pm(x, labels), model(x, labels))


def test_plan_auto_names_the_op_its_fake_run_cannot_run_and_the_way_out():
    """``.item()`` on a fake tensor: a DpCompileError naming the op and a hand-named layout, not the bare exception."""
    x, labels = torch.randn(6, 8), torch.tensor([0, -1, 3, 2, -1, 1])
    with pytest.raises(DpCompileError, match=r"(?s)failed at aten\._local_scalar_dense.*Name the layout yourself"):
        dpcompile.transform(CountedRows(), ["cpu"] * 2, plan="auto", memory_per_device="1GiB", example_inputs=(x, labels))


class Experts(nn.Module):
    """Mixtral's experts, reduced: float32 rows through ``_grouped_mm``, which CPU runs and whose fake
    kernel takes bfloat16 only."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, d, d))
        self.register_buffer("offs", torch.tensor([3, 6], dtype=torch.int32))

    def forward(self, x):
        return torch._grouped_mm(x, self.w, offs=self.offs)


def test_profile_sizes_a_float32_grouped_mm_in_its_own_dtype():
    """The fake run sizes the float32 ``_grouped_mm`` from bfloat16 copies: one op, its float32 output's bytes."""
    from dpcompile.analysis.model_profile import profile_model

    profile = profile_model(Experts(), (torch.randn(6, 8),), None, optimizer=None, training=False)
    assert [(u.ops, u.op_bytes) for u in profile.units] == [(1, 6 * 8 * 4)] and profile.output_bytes == 6 * 8 * 4


def test_plan_auto_without_a_budget_plans_for_the_hosts_memory_and_picks_the_fastest():
    """No ``memory_per_device=``: the budget is the host's available memory shared by the two virtual
    devices (said in ``pm.strategies`` and on every candidate), and the fastest predicted is built."""
    from dpcompile.analysis.device_memory import host_available_bytes

    pm = dpcompile.transform(_stack(), ["cpu"] * 2, example_inputs=(X, Y), optimizer="adamw", plan="auto")
    share = host_available_bytes() // 2
    assert pm.strategies["memory_per_device"].endswith("per device (no memory_per_device= given: the devices' own "
                                                      "memory; explain(pm, x) says whose)")  # fmt: skip
    assert all("cpu: the host's available memory" in c.budget_source for c in pm.candidates)
    assert all(c.fits for c in pm.candidates if c.per_device)  # a tiny model fits gigabytes
    chosen = next(c for c in pm.candidates if c.rejected is None)
    assert chosen.step_time == min(c.step_time for c in pm.candidates if c.per_device)
    report = dpcompile.explain(pm, X, Y)
    assert "Budget: no memory_per_device= given" in str(report)
    for c in report.candidates:
        assert c["budget"].startswith("no memory_per_device= given") and set(c["budget_bytes"]) == set(LABELS)
        assert all(abs(b - share) < share // 4 for b in c["budget_bytes"].values())  # read a moment apart


def test_plan_auto_without_a_budget_is_bounded_by_the_hosts_memory(monkeypatch):
    """With the host's memory at twice a budget data parallel does not fit, the choice is that budget's;
    below every prediction, the no-fit error names the devices' own memory and changes nothing."""
    from dpcompile.analysis import device_memory

    budget, _ = _budget_between_data_parallel_and_the_least()
    monkeypatch.setattr(device_memory, "host_available_bytes", lambda: 2 * budget)
    pm = dpcompile.transform(_stack(), ["cpu"] * 2, example_inputs=(X, Y), optimizer="adamw", plan="auto")
    named = dpcompile.transform(_stack(), ["cpu"] * 2, example_inputs=(X, Y), optimizer="adamw", plan="auto",
                                memory_per_device=budget)  # fmt: skip
    assert pm.layout == named.layout != {"dp": 2}
    assert [c.spec.name for c in pm.candidates if c.rejected is None] == [
        c.spec.name for c in named.candidates if c.rejected is None]  # fmt: skip
    assert pm.strategies["memory_per_device"].startswith(format_bytes(budget) + " per device")
    monkeypatch.setattr(device_memory, "host_available_bytes", lambda: 2000)
    model = _stack()
    before, rng = copy.deepcopy(model.state_dict()), torch.get_rng_state()
    with pytest.raises(DpCompileError, match=r"no layout fits 1000 B per device \(no memory_per_device= given"):
        dpcompile.transform(model, ["cpu"] * 2, example_inputs=(X, Y), optimizer="adamw", plan="auto")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


def test_the_no_fit_error_outlives_a_suggestion_that_fails_otherwise_and_puts_moved_weights_back(monkeypatch):
    """A layout built for the no-fit error's suggestion that fails with a torch error (CUDA out of memory,
    say) after moving the weights (onto distinct GPUs) leaves the no-fit error the answer, and the model's
    tensors where they were (the torch error escaped, the weights stayed moved)."""
    import dpcompile.api

    model = _stack()
    held = {name: t.data_ptr() for name, t in [*model.named_parameters(), *model.named_buffers()]}

    def moving_then_failing(m, devices, **options):
        for t in [*m.parameters(), *m.buffers()]:
            t.data = t.data.clone()  # as moving them to another device does
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(dpcompile.api, "transform", moving_then_failing)
    with pytest.raises(DpCompileError, match="no layout fits"):
        dpcompile.transform(model, ["cpu"] * 2, example_inputs=(X, Y), optimizer="adamw", plan="auto",
                            memory_per_device=1000)  # fmt: skip
    assert all(t.data_ptr() == held[name] for name, t in [*model.named_parameters(), *model.named_buffers()])


@pytest.mark.gpu
def test_plan_auto_without_a_budget_plans_for_each_gpus_free_memory():
    """Two virtual devices on one GPU share its free memory less the reserve; the chosen program equals eager."""
    from dpcompile.analysis.device_memory import cuda_reserve_bytes

    model = _stack().cuda()
    x, y = X.cuda(), Y.cuda()
    free, total = torch.cuda.mem_get_info(0)
    pm = dpcompile.transform(model, ["cuda:0"] * 2, example_inputs=(x, y), optimizer="adamw", plan="auto")
    share = pm.candidates[0].budgets["cuda:0#0"]
    assert all(c.budgets == {"cuda:0#0": share, "cuda:0#1": share} for c in pm.candidates)
    assert 0 < share <= (free - cuda_reserve_bytes(total)) // 2
    assert "cuda:0: free memory (torch.cuda.mem_get_info" in pm.candidates[0].budget_source
    torch.testing.assert_close(pm(x, y), model(x, y))


class BatchNormStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Conv2d(c, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
                                    for c in (3, 8))  # fmt: skip
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean((2, 3))).pow(2).mean()


def test_a_batch_norm_model_gets_no_1f1b_candidate_and_its_suggested_budget_builds():
    """BatchNorm in training normalises with the whole batch's statistics, which 1F1B's micro-batches
    never meet for: those layouts are "cannot be built" at planning, so the no-fit error's smallest
    peak is one that builds when passed back (it named 1F1B with 8 micro-batches, refused at build)."""
    torch.manual_seed(0)
    model, x = BatchNormStack(), torch.randn(8, 3, 8, 8)
    with pytest.raises(DpCompileError, match="no layout fits") as caught:
        dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), optimizer="adamw", plan="auto",
                            memory_per_device=1000)  # fmt: skip
    suggested = int(str(caught.value).split(" bytes)")[0].rsplit("(", 1)[1])
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), optimizer="adamw", plan="auto",
                             memory_per_device=suggested)  # fmt: skip
    assert next(c for c in pm.candidates if c.rejected is None).peak == suggested
    one_f_one_b = [c for c in pm.candidates if c.spec.schedule == "1f1b"]
    assert one_f_one_b and all("BatchNorm 'layers.0.1'" in c.rejected and not c.fits for c in one_f_one_b)


def test_plan_mesh_layouts_without_budgets_plans_for_this_hosts_share():
    """``plan_mesh_layouts(..., budgets=None)``: the host's available memory shared by the ranks."""
    from dpcompile.analysis.device_memory import UNGIVEN_BUDGET_WORDS, host_available_bytes
    from dpcompile.planned_mesh import mesh_candidates
    from dpcompile.planner import plan_mesh_layouts

    ranks = ["rank0", "rank1"]
    planned = plan_mesh_layouts(_stack(), ranks, None, optimizer="adamw", training=True, example_inputs=(X, Y),
                                example_kwargs=None, specs=mesh_candidates(2))  # fmt: skip
    share = host_available_bytes() // 2
    assert planned.fitting and all(c.budget_source.startswith(UNGIVEN_BUDGET_WORDS) for c in planned.candidates)
    assert all(set(c.budgets) == set(ranks) and abs(c.budgets["rank0"] - share) < share // 4 for c in planned.candidates)


class RunningMean(Stack):
    """Stack whose forward keeps an EMA of its input's mean in a buffer: 1F1B's micro-batches cannot
    go on alone (refused only when built)."""

    def __init__(self) -> None:
        super().__init__(layers=2)
        self.register_buffer("running", torch.zeros(16))

    def forward(self, x, y):
        self.running.mul_(0.9).add_(0.1 * x.detach().mean((0, 1)))
        return super().forward(x - self.running, y)


def test_the_no_fit_error_suggests_a_budget_whose_layout_builds_and_changes_nothing():
    """Nothing fits: the smallest predicted layouts are built (and dropped where they are refused) before
    one is suggested, so the suggestion builds when passed back; the model's buffers and parameters and
    the RNG are as before (it suggested 1F1B with 8 micro-batches, refused when built)."""
    torch.manual_seed(0)
    model = RunningMean().double()
    before, rng = copy.deepcopy(model.state_dict()), torch.get_rng_state()
    with pytest.raises(DpCompileError, match="no layout fits") as caught:
        dpcompile.transform(model, ["cpu"] * 2, example_inputs=(X, Y), optimizer="adamw", plan="auto",
                            memory_per_device=1000)  # fmt: skip
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and torch.equal(rng, torch.get_rng_state())
    suggested = int(str(caught.value).split(" bytes)")[0].rsplit("(", 1)[1])
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(X, Y), optimizer="adamw", plan="auto",
                             memory_per_device=suggested)  # fmt: skip
    assert next(c for c in pm.candidates if c.rejected is None).peak == suggested
