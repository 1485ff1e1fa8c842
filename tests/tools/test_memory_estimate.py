"""``explain(pm, x).memory_estimate`` is the planner's prediction for the layout that was built (the
one ``plan="auto"`` ranks it by), with the program count where the planner predicts none; the
planner's own fixes: a model input that needs no gradient, ``tp+sp`` that builds ``tp``; one-process FSDP
predicted and measured as its call runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile.analysis.layout_costs import LayoutSpec
from dpcompile.inspect.explanation import param_bytes, program_count
from dpcompile.inspect.nodes import copy_labels
from dpcompile.modules.fsdp_gather import GatherShards
from dpcompile.planner import Candidate, plan_layouts
from tests.integration.test_planner_accuracy import TinyEncoder

LABELS = ["cpu#0", "cpu#1"]
pytestmark = pytest.mark.filterwarnings("ignore:.*would run whole")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Residual(nn.Module):
    def __init__(self, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return F.mse_loss(self.head(h), y)


class WideInput(nn.Module):
    """A 256-wide input read by a 16-wide layer: the input's bytes are most of what a step holds."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(256, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x))))).sum()


def _predicted(make, args, spec: LayoutSpec) -> dict[str, dict[str, int]]:
    torch.manual_seed(0)
    planned = plan_layouts(make(), LABELS, dict.fromkeys(LABELS, 1 << 40), optimizer="sgd", training=True,
                           example_inputs=args, example_kwargs=None, device=torch.device("cpu"), specs=[spec])  # fmt: skip
    return planned.candidates[0].per_device


def _built(make, args, **keywords) -> nn.Module:
    torch.manual_seed(0)
    return dpcompile.transform(make(), ["cpu"] * 2, example_inputs=args, optimizer="sgd", **keywords)


@pytest.mark.parametrize("spec", [LayoutSpec((("tp", 2),)), LayoutSpec((("pp", 2),), "1f1b", 2)], ids=lambda s: s.name)
def test_memory_estimate_is_the_planners_prediction_of_the_layout_built(spec):
    """The old estimate was a second rule (a tensor-parallel program's activations whole on every device,
    every saved activation at once): here +10% / +76% of the measured peak for tp2, +25% / +59% for the
    1F1B pipeline, where the planner that chose the layout predicted -12% / -32% and -24% / -19% (a model
    this small is the planner's worst case: docs/memory.md has the table of real ones). It is now the
    planner's prediction of that layout, by kind; ``measure`` prints it beside the measured peak, whose
    held parameters are still the program's own."""
    args = (torch.randn(8, 16, 16), torch.randn(8, 16, 8))
    pm = _built(Residual, args, **Candidate(spec).keywords())
    measured = dpcompile.measure(pm, *args)
    assert measured.memory_estimate == _predicted(Residual, args, spec)
    assert measured.predicted_peak_bytes == {d: sum(k.values()) for d, k in measured.memory_estimate.items()}
    # SGD keeps no state: held is the parameters each device of the program holds, as explain counts them
    assert measured.held_bytes == dpcompile.explain(pm, *args).param_bytes


def test_a_layout_the_planner_does_not_predict_keeps_the_program_count():
    """A graph given to transform is cut into no units the planner profiles: its estimate is the count of
    the program (each replica whole, the device's share of the activations)."""
    x = torch.randn(8, 16)
    torch.manual_seed(0)
    graph = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    pm = dpcompile.transform(graph, ["cpu"] * 2, example_inputs=(x,), optimizer="sgd")
    report = dpcompile.explain(pm, x)
    assert report.memory_estimate == program_count(pm, report.param_bytes, (x,), {})


@pytest.mark.parametrize(("mesh", "d", "layers", "batch"), [({"pp": 2, "dp": 2}, 64, 4, 8), ({"dp": 2, "tp": 2}, 32, 2, 16)],
                         ids=["pp2xdp2", "dp2xtp2"])  # fmt: skip
def test_one_process_fsdp_over_dp_copies_is_predicted_per_stage_and_shard(mesh, d, layers, batch):
    """FSDP over dp copies of a pipeline or of tensor-parallel shards kept the program count: every
    device held the activations of the whole model and batch (here +86% to +201% of the measured peak;
    issue 34's MLP 290K against 134-142K). It is now the replicated layout's prediction with each device's
    pieces and their gradients, copy 0's devices holding their stage's or shard's gathers as forward
    returns, and a module's weight regathered in backward (``fsdp_memory.fsdp_over_copies``)."""
    args = (torch.randn(batch, 16, 16), torch.randn(batch, 16, 8))
    torch.manual_seed(0)
    pm = dpcompile.transform(Residual(d, layers), ["cpu"] * 4, example_inputs=args, optimizer="sgd", mesh=mesh,
                             data_parallel="fsdp")  # fmt: skip
    measured = dpcompile.measure(pm, *args)
    for label in copy_labels(pm)[0][1]:  # copy 1's devices: their pieces (copy 0's gather theirs)
        assert measured.memory_estimate[label]["parameters"] == measured.held_bytes[label] // 2  # SGD: and gradients
    for label, peak in measured.peak_bytes.items():
        assert abs(measured.predicted_peak_bytes[label] - peak) <= 0.10 * peak, (label, measured)


def test_one_process_fsdp_is_predicted_as_its_call_runs():
    """FSDP in one process gathers each parameter on the first device once a call, holds the gathers
    until the call returns and gathers what backward needs again. ``measure`` ran the program outside its
    call (every copy's gathers kept through backward) and the estimate was the program count (activations
    and gradients at once, no gathers): here 26% under on both devices, torchvision's ViT 11-12%. Now
    ``measure`` runs forward in the call's context and the estimate is data parallel's sweep with the
    pieces, the first device holding the gathers as forward returns."""
    args = (torch.randn(16, 16, 16), torch.randn(16, 16, 8))
    pm = _built(lambda: Residual(32), args, data_parallel="fsdp")
    measured = dpcompile.measure(pm, *args)
    pieces = param_bytes(pm)
    gathered = sum(p.numel() * p.element_size() for p in Residual(32).parameters())  # every parameter is in pieces
    assert sum(measured.memory_estimate["cpu#0"].values()) >= pieces["cpu#0"] + gathered
    assert measured.memory_estimate["cpu#1"]["parameters"] == pieces["cpu#1"] < gathered
    for d, peak in measured.peak_bytes.items():
        assert abs(measured.predicted_peak_bytes[d] - peak) <= 0.10 * peak, (d, measured)


def test_the_models_input_needs_no_gradient():
    """Backward makes no gradient for an input that does not require one: counted, the first unit's
    input gradient put the first device 71% over its measured peak (data parallel) and a pipeline's
    first stage 212% over."""
    args = (torch.randn(64, 256),)
    for spec in (LayoutSpec((("dp", 2),)), LayoutSpec((("pp", 2),), "gpipe", 1)):
        predicted = _predicted(WideInput, args, spec)
        measured = dpcompile.measure(_built(WideInput, args, **Candidate(spec).keywords()), *args).peak_bytes
        total = sum(predicted["cpu#0"].values())
        assert abs(total - measured["cpu#0"]) <= 0.15 * measured["cpu#0"], (spec.name, total, measured)


def test_sequence_parallel_that_builds_tensor_parallel_is_not_a_second_candidate():
    """An nn.MultiheadAttention's output projection runs on ``(seq, batch, ...)``: sequence parallel finds
    no one sequence and builds tp2 alone, so ``tp2+sp`` is rejected as the same program, not listed
    as a second candidate with tp2's prediction."""
    x = (torch.randn(4, 16, 32),)
    planned = plan_layouts(TinyEncoder(), LABELS, dict.fromkeys(LABELS, 1 << 40), optimizer="sgd", training=True,
                           example_inputs=x, example_kwargs=None, device=torch.device("cpu"))  # fmt: skip
    by_name = {c.spec.name: c for c in planned.candidates}
    assert by_name["tp2+sp"].rejected.startswith("builds tp2: no one sequence")
    assert not by_name["tp2+sp"].fits and by_name["tp2"].fits
    assert "tp2+sp" not in [c.spec.name for c in planned.fitting]


def test_dp_copies_of_tensor_parallel_shards_share_one_set_of_gradients():
    """dp copies built on virtual devices share one set of parameters, so of gradients, held through the
    step (``measure`` counts them held): predicted without them, every device of mlp_stack and GPT-2 in
    ``bench_memory_estimate.py`` was 17-32% under (now within 5%). This model is smaller: the first
    device of each copy is predicted within 5%, the second 12% and 17% under (the planner runs the ops
    tensor parallelism does not split on the first device only)."""
    args = (torch.randn(8, 32, 16), torch.randn(8, 32, 8))
    torch.manual_seed(0)
    pm = dpcompile.transform(Residual(d=64), ["cpu"] * 4, example_inputs=args, optimizer="sgd", mesh={"dp": 2, "tp": 2})
    measured = dpcompile.measure(pm, *args)
    for d, peak in measured.peak_bytes.items():
        assert abs(measured.predicted_peak_bytes[d] - peak) <= 0.20 * peak, (d, measured.predicted_peak_bytes, measured.peak_bytes)


def test_data_parallel_replicas_each_hold_the_gradients_they_share():
    """Replicas on virtual devices share the parameters: autograd sums the devices' gradients of one
    into one ``.grad``, which ``measure`` counted on the device whose gradient arrived second only. With
    every block checkpointed the peak is at the end of backward, where the gradients are: the prediction
    was 33% over the other device's measured peak on ``bench_memory_estimate.py``'s MLP stack (here 35%;
    now 3%, both devices). On real devices each holds its own; now each is counted with the sum."""
    args = (torch.randn(8, 16, 16), torch.randn(8, 16, 8))
    spec = LayoutSpec((("dp", 2),), checkpointing=True)
    measured = dpcompile.measure(_built(lambda: Residual(d=64, layers=4), args, **Candidate(spec).keywords()), *args)
    predicted = measured.predicted_peak_bytes
    for d, peak in measured.peak_bytes.items():
        assert abs(predicted[d] - peak) <= 0.10 * peak, (d, predicted, measured.peak_bytes)


class MatmulBlock(nn.Module):
    """GPT-2's Conv1D: ``x @ weight``, whose weight's gradient is a matmul's own output (a Linear's is a
    transpose, a view): autograd sums a second one into it in place."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Parameter(torch.randn(d, 2 * d) / d**0.5), nn.Parameter(torch.randn(2 * d, d) / d**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(x @ self.up) @ self.down


class MatmulStack(Residual):
    def __init__(self) -> None:
        super().__init__(d=64, layers=4)
        self.layers = nn.ModuleList(MatmulBlock(64) for _ in range(4))


def test_data_parallel_replicas_each_hold_a_gradient_summed_in_place():
    """As above where autograd sums the second device's gradient into the first's in place (GPT-2's
    Conv1D weights): the first device measured far under the prediction of ``bench_memory_estimate.py``'s
    GPT-2 (the prediction 38% over; here 51%; now 5% and 8%)."""
    args = (torch.randn(8, 16, 16), torch.randn(8, 16, 8))
    spec = LayoutSpec((("dp", 2),), checkpointing=True)
    measured = dpcompile.measure(_built(MatmulStack, args, **Candidate(spec).keywords()), *args)
    predicted = measured.predicted_peak_bytes
    for d, peak in measured.peak_bytes.items():
        assert abs(predicted[d] - peak) <= 0.10 * peak, (d, predicted, measured.peak_bytes)


def test_measure_runs_a_1f1b_step_of_fsdp_in_the_calls_context():
    """A 1F1B call runs its whole step, backward too, inside FSDP's call context (one gather a parameter a
    call, held until it returns). ``measure`` ran that step outside it: each read gathered again (every
    copy, every micro-batch) and what autograd saved of it was kept through backward (GPT-2's FSDP
    ``pp2xdp2 1f1b mb2`` predicted 16-35% under what it measured on three devices). Now each parameter is
    gathered once in the measured step, as in the timed call."""
    args = (torch.randn(4, 4, 16), torch.randn(4, 4, 8))
    torch.manual_seed(0)
    pm = dpcompile.transform(Residual(16), ["cpu"] * 4, example_inputs=args, optimizer="sgd", mesh={"pp": 2, "dp": 2},
                             data_parallel="fsdp", schedule="1f1b", micro_batches=2)  # fmt: skip
    from dpcompile.modules import fsdp_gather

    gathers = [m for m in pm.modules() if isinstance(m, GatherShards)]
    in_call = []  # (gather, the whole weight it returned), kept alive: a weight served again is the same tensor
    for gather in gathers:
        gather.register_forward_hook(lambda m, i, o: in_call.append((m, o)) if fsdp_gather._THIS_CALL is not None else None)
    dpcompile.measure(pm, *args)
    assert {m for m, _ in in_call} == set(gathers)  # every parameter read in the call's context
    # gathered once there a call (read again, the same whole weight): the measured step's and the timed one's
    assert len({id(whole) for _, whole in in_call}) == 2 * len(gathers)


class Encoder(nn.Module):
    """Its own parameter beside its layers: a pipeline's first stage runs ``encoder`` (the addition) and
    its first layer, the second stage the other layer."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(16, d) / 8)
        self.layers = nn.ModuleList(Block(d) for _ in range(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.pos
        for layer in self.layers:
            h = layer(h)
        return h


class EncoderNet(Residual):
    def __init__(self) -> None:
        super().__init__(d=32, layers=0)
        self.encoder = Encoder(32)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.encoder(self.inp(x))), y)


def test_fsdp_pieces_of_a_pipeline_lie_on_the_stage_of_their_module():
    """A parameter belongs to the stage of the longest module path holding it: stage 0 runs ``encoder``
    (its ``pos``), stage 1 ``encoder.layers.1``. The first path matched put stage 1's layer on stage 0's
    devices: its pieces there, gathered there, and counted there by ``explain`` and ``measure``
    (torchvision's ViT FSDP ``pp2xdp2``: each of the first stage's devices held 581K of pieces and their
    gradients, now 319K, of a stage of 314K of parameters)."""
    args = (torch.randn(8, 16, 16), torch.randn(8, 16, 8))
    torch.manual_seed(0)
    pm = dpcompile.transform(EncoderNet(), ["cpu:0", "cpu:1", "cpu:2", "cpu:3"], example_inputs=args, optimizer="sgd",
                             mesh={"pp": 2, "dp": 2}, data_parallel="fsdp")  # fmt: skip
    assert [stage.device for stage in pm.stages] == ["cpu:0", "cpu:2"]
    for path, gather in pm.named_modules():
        if isinstance(gather, GatherShards):
            expected = ("cpu:2", ("cpu:2", "cpu:3")) if path.startswith(("encoder.layers.1.", "head.")) else ("cpu:0", ("cpu:0", "cpu:1"))
            assert (gather.device, gather.piece_devices) == expected, path
    report = dpcompile.explain(pm, *args)
    stages = [stage["param_bytes"] for stage in report.pipeline["stages"]]  # the replicated program's stages
    held = report.param_bytes
    assert [held["cpu:0"] + held["cpu:1"], held["cpu:2"] + held["cpu:3"]] == stages


@pytest.mark.parametrize("keywords", [{"pipeline": 2}, {"data_parallel": "fsdp"}], ids=["pp2", "fsdp2"])
def test_a_loaded_program_is_predicted_as_the_original(tmp_path, keywords):
    """A program read back with ``dpcompile.load`` had no model for the planner to profile, nor the
    optimizer transform was told: its estimate was the program count without AdamW's state (here pp2
    13% and 20% under the original's estimate, fsdp2 27% and 30%; pp2xdp2 13-18% over). It is now
    the original's: its modules run the single-device graph the folder keeps, a unit's call at a time,
    and the folder keeps ``optimizer=`` and ``training=``."""
    args = (torch.randn(8, 16, 16), torch.randn(8, 16, 8))
    torch.manual_seed(0)
    pm = dpcompile.transform(Residual(32), ["cpu"] * 2, example_inputs=args, optimizer="adamw", **keywords)
    dpcompile.export(pm, tmp_path / "program")
    loaded = dpcompile.load(tmp_path / "program")
    report = dpcompile.explain(loaded, *args)
    assert report.memory_estimate == dpcompile.explain(pm, *args).memory_estimate
    assert report.memory_estimate_basis.startswith("the planner's prediction")


def test_a_loaded_program_of_tensor_parallel_shards_says_it_has_no_estimate(tmp_path):
    """A folder of tensor-parallel shards keeps no single-device model: its activations were counted as 0
    (here 74% and 55% under the original's estimate). Now it gives none, and says why."""
    args = (torch.randn(8, 16, 16), torch.randn(8, 16, 8))
    torch.manual_seed(0)
    pm = dpcompile.transform(Residual(32), ["cpu"] * 2, example_inputs=args, optimizer="sgd", tensor_parallel=True)
    dpcompile.export(pm, tmp_path / "program")
    report = dpcompile.explain(dpcompile.load(tmp_path / "program"), *args)
    assert report.memory_estimate == {}
    assert report.memory_estimate_basis.startswith("none: a program loaded (dpcompile.load) or unpickled that keeps no")
    assert dpcompile.explain(pm, *args).memory_estimate_basis.startswith("the planner's prediction")



def test_measure_of_1f1b_over_dp_copies_clones_no_gradient_it_preset():
    """``measure`` gives dp copies on virtual devices their one set of gradients as zeros before the step; a
    1F1B step whose loss count is found with the activations (a mean of an activation's elements) cloned
    every gradient it found, to divide its share after the step, all counted on one device: the MLP stack's
    ``pp2xdp2 1f1b mb2`` 42% over its prediction there, as no step after ``zero_grad()`` holds. Those zeros
    stand for no gradient now: both copies of a stage measure alike, within 10% of the prediction."""
    args = (torch.randn(4, 4, 16), torch.randn(4, 4, 8))
    torch.manual_seed(0)
    pm = dpcompile.transform(Residual(16), ["cpu"] * 4, example_inputs=args, optimizer="sgd", mesh={"pp": 2, "dp": 2},
                             schedule="1f1b", micro_batches=2)  # fmt: skip
    measured = dpcompile.measure(pm, *args)
    peaks = measured.peak_bytes
    for copy0, copy1 in (("cpu#0", "cpu#1"), ("cpu#2", "cpu#3")):  # the copies of each stage
        assert abs(peaks[copy1] - peaks[copy0]) <= 0.01 * peaks[copy0], peaks
    for label, peak in peaks.items():
        assert abs(measured.predicted_peak_bytes[label] - peak) <= 0.10 * peak, (label, measured)


class WideHead(Residual):
    """A head twice the blocks' width (torchvision's ViT's 1000 classes): the gradients a copy's backward makes
    are most of what its devices hold."""

    def __init__(self) -> None:
        super().__init__(64, 4)
        self.head = nn.Linear(64, 128)


def test_fsdp_gpipe_other_copies_hold_the_whole_gradients_they_make():
    """One backward runs every micro-batch of copy 1 before copy 0's, and each whole gradient copy 1 makes
    waits on its device to be summed with copy 0's: its devices sweep as a device that makes its own
    gradients, beside its pieces and theirs. Predicted with one module's gradient in passing, they were
    21% and 25% under here (torchvision's ViT's second copy 14-15%); now within 10%, as copy 0's were."""
    args = (torch.randn(8, 16, 16), torch.randn(8, 16, 128))
    torch.manual_seed(0)
    pm = dpcompile.transform(WideHead(), ["cpu"] * 4, example_inputs=args, optimizer="sgd", mesh={"pp": 2, "dp": 2},
                             data_parallel="fsdp", micro_batches=2)  # fmt: skip
    measured = dpcompile.measure(pm, *args)
    for label, peak in measured.peak_bytes.items():
        assert abs(measured.predicted_peak_bytes[label] - peak) <= 0.10 * peak, (label, measured)


def test_fsdp_1f1b_other_copies_hold_the_whole_gradients_they_make():
    """As under GPipe, on 1F1B stages: copy 1's part of a micro-batch's backward runs before copy 0's, its
    whole gradients waiting on its device; the first stage sweeps one micro-batch with the other held, the
    last one micro-batch alone (each micro-batch's backward sums them into the pieces: none held from the one
    before). Copy 1's devices were 28% and 23% under here (the MLP stack's 13% and 14%); now within 10%.
    (Copy 0's, predicted as before, are 12-16% under on a model this small, 4-10% on the MLP stack.)"""
    args = (torch.randn(8, 16, 16), torch.randn(8, 16, 8))
    torch.manual_seed(0)
    pm = dpcompile.transform(Residual(64, 4), ["cpu"] * 4, example_inputs=args, optimizer="sgd",
                             mesh={"pp": 2, "dp": 2}, data_parallel="fsdp", schedule="1f1b", micro_batches=2)  # fmt: skip
    measured = dpcompile.measure(pm, *args)
    for label in ("cpu#1", "cpu#3"):  # each stage's copy 1
        peak = measured.peak_bytes[label]
        assert abs(measured.predicted_peak_bytes[label] - peak) <= 0.10 * peak, (label, measured)
