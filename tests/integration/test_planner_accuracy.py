"""The planner's predicted peak per device against what ``dpcompile.measure`` then measures, on
tiny models, for the layouts whose prediction was once wrong (``benchmarks/bench_planner.py`` runs the
same comparison over 21 real models)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from benchmarks.common import ResidualBlock
from dpcompile.analysis.layout_costs import LayoutSpec
from dpcompile.planner import Candidate, plan_layouts
from passes.split_stages import module_path_of

pytestmark = pytest.mark.filterwarnings("ignore:.*would run whole")
LABELS = ["cpu#0", "cpu#1"]


@pytest.fixture(autouse=True)
def _reference_constants(monkeypatch):
    monkeypatch.setenv("DPCOMPILE_CALIBRATION", "off")


class ConvNet(nn.Module):
    """Convolutions (tensor parallelism splits none of them) and a Linear head (it splits)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())  # fmt: skip
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def conv_stack(c: int = 16) -> nn.Sequential:
    """Convolutions and nothing repeated: its units are the Sequential's children."""
    return nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * c, 10))  # fmt: skip


class TinyLM(nn.Module):
    """Pre-norm MLP blocks between an embedding and a head; forward returns its own mean loss (1F1B)."""

    def __init__(self, vocab: int = 32, d: int = 32, act: type[nn.Module] = nn.GELU, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), act(), nn.Linear(4 * d, d)) for _ in range(layers)
        )
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class EncoderBlock(nn.Module):
    """A pre-norm transformer block of ``nn.MultiheadAttention`` (its projections split by heads, though
    it calls no Linear forward) and an MLP: two column / row pairs."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attention = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        x = x + self.attention(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TinyEncoder(nn.Module):
    def __init__(self, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.blocks = nn.Sequential(EncoderBlock(d, heads), EncoderBlock(d, heads))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(1))


class ConvStage(nn.Module):
    """``depth`` convolutions with ReLUs: a stage of a CNN (a ResNet layer, a MobileNet block)."""

    def __init__(self, a: int, b: int, depth: int = 2) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(a, b, 3, padding=1)] + [nn.Conv2d(b, b, 3, padding=1) for _ in range(depth - 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = torch.relu(conv(x))
        return x


def conv_stages(c: int = 8) -> nn.Sequential:
    """Three stages of convolutions. Its units are the first two stages and the third's convolutions (the
    repeated blocks: the largest ModuleList) with the ReLU after each; given ``pipeline=2`` the pass, cutting
    between ops by FLOPs, cut between the third stage's first convolution and its ReLU."""
    return nn.Sequential(ConvStage(3, c), ConvStage(c, c), ConvStage(c, 2 * c), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(2 * c, 10))  # fmt: skip


class NormedConvs(nn.Module):
    """Four convolutions, each with a BatchNorm (every micro-batch's statistics are the whole batch's)."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Conv2d(a, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
                                      for a in (3, c, c, c)))  # fmt: skip
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean((2, 3)))


def _tokens(batch: int = 8, seq: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 32, (batch, seq), generator=g), torch.randint(0, 32, (batch, seq), generator=g)


def _planned_and_built(make, args, spec: LayoutSpec) -> tuple[Candidate, nn.Module]:
    """``spec``'s candidate as the planner predicts it, and the program its keywords build."""
    torch.manual_seed(0)
    planned = plan_layouts(make(), LABELS, dict.fromkeys(LABELS, 1 << 40), optimizer="sgd", training=True,
                           example_inputs=args, example_kwargs=None, device=torch.device("cpu"), specs=[spec])  # fmt: skip
    torch.manual_seed(0)
    (candidate,) = planned.candidates
    return candidate, dpcompile.transform(make(), ["cpu"] * 2, example_inputs=args, optimizer="sgd", **candidate.keywords())


def _predicted_and_measured(make, args, spec: LayoutSpec) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    candidate, pm = _planned_and_built(make, args, spec)
    return candidate.per_device, dpcompile.measure(pm, *args).peak_bytes


def test_tensor_parallel_runs_what_it_does_not_split_on_the_first_device_only():
    """The convolutions' gradients and activations are the first device's alone: the second holds
    the replicated parameters (as ``explain`` counts them) and its half of the head's gradient. The
    first device's peak is during backward, before the first convolution's gradient is made, with
    the gradients of the activations flowing through it (they were not predicted: 6% under)."""
    predicted, measured = _predicted_and_measured(ConvNet, (torch.randn(8, 3, 4, 4),), LayoutSpec((("tp", 2),)))
    head = (64 * 10 + 10) * 4
    params = sum(p.numel() * 4 for p in ConvNet().parameters())
    assert predicted["cpu#1"]["parameters"] == params - head // 2
    assert predicted["cpu#1"]["gradients"] == head // 2
    first_conv = (3 * 64 * 9 + 64) * 4
    assert predicted["cpu#0"]["gradients"] == params - head // 2 - first_conv
    for d in LABELS:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.10 * measured[d], (d, total, measured[d])
    assert measured["cpu#1"] < 0.6 * measured["cpu#0"]


def test_a_pipeline_stage_adds_one_module_gradient_at_a_time():
    """From the second micro-batch on, each new gradient is added into the one held as soon as one
    module's backward makes it: one Linear's weight and bias more at the peak, not a whole unit's
    (the last stage was predicted 13% over). Each stage's gradients are measured on its own device."""
    predicted, measured = _predicted_and_measured(TinyLM, _tokens(), LayoutSpec((("pp", 2),), "1f1b", 4))
    linear = (32 * 128 + 128) * 4
    for d in LABELS:
        assert predicted[d]["gradients"] == predicted[d]["parameters"] + linear, d
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.10 * measured[d], (d, total, measured[d])


def test_a_one_f_one_b_micro_batch_holds_what_autograd_saved():
    """ReLU saves its output, so the Linear's output before it and the block's last Linear's output
    (added into the residual stream) are not needed in backward: a micro-batch in flight holds what
    autograd saved. The 1F1B step kept every value of a unit's forward until that forward was over
    (the last stage measured 27% over the prediction, as GPT-2's was 16% and Llama's first 15%)."""
    make = lambda: TinyLM(act=nn.ReLU, layers=6)  # noqa: E731 - each stage holds 3 blocks' values
    predicted, measured = _predicted_and_measured(make, _tokens(batch=4, seq=32), LayoutSpec((("pp", 2),), "1f1b", 2))
    for d in LABELS:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.10 * measured[d], (d, total, measured[d])


def test_a_one_f_one_b_first_stage_sweeps_one_micro_batch_with_the_next_held():
    """A 1F1B first stage of two micro-batches runs the first one's backward with the second one's
    activations held, then the second's with every gradient made; between a unit's layers its widest
    value's gradient is held too. It was predicted holding every activation and every gradient at once:
    16% over on this stage (measured within 5% now; the last stage, of one micro-batch, was not off)."""
    make = lambda: TinyLM(d=64, layers=4)  # noqa: E731
    predicted, measured = _predicted_and_measured(make, _tokens(batch=8, seq=16), LayoutSpec((("pp", 2),), "1f1b", 2))
    for d in LABELS:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.10 * measured[d], (d, total, measured[d])


def _assert_tensor_parallel_encoder_within_ten_percent(checkpointing: bool) -> None:
    spec = LayoutSpec((("tp", 2),), checkpointing=checkpointing)
    predicted, measured = _predicted_and_measured(TinyEncoder, (torch.randn(4, 16, 32),), spec)
    for d in LABELS:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.10 * measured[d], (d, total, measured[d])


def test_tensor_parallel_shards_what_a_column_row_pair_makes():
    """Between a block's column layer and its row layer (attention's input and output projections,
    the MLP's two Linears) each device makes and saves its shard of the values; the rest (layer
    norms, residual sums) runs once, on the first device. Counting every saved byte whole on the
    first device put it 51% over."""
    _assert_tensor_parallel_encoder_within_ten_percent(checkpointing=False)


def test_sequence_parallel_where_the_row_layers_disagree_on_the_sequence_is_tensor_parallel_alone():
    """An nn.MultiheadAttention's output projection runs on ``(seq, batch, ...)`` (dim 1: the batch)
    and the MLP's row layer on ``(batch, seq, ...)``: ``shard_sequence`` finds no one sequence, so the
    program is tensor parallel's (torchvision's ViT). Predicting every activation on sequence shards
    put the first device 18% under and the second 12% over."""
    spec = LayoutSpec((("tp", 2),), sequence_parallel=True)
    predicted, measured = _predicted_and_measured(TinyEncoder, (torch.randn(4, 16, 32),), spec)
    for d in LABELS:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.10 * measured[d], (d, total, measured[d])


def test_a_recomputed_tensor_parallel_block_is_measured_on_each_of_its_devices():
    """A checkpointed block runs again in backward inside the autograd node that asked for its
    values; ``measure`` counted the whole recompute on that node's device (the second here: the
    first device's prediction was 52% over what was measured there), not each op on its own."""
    _assert_tensor_parallel_encoder_within_ten_percent(checkpointing=True)


def test_a_stage_of_one_micro_batch_frees_its_activations_as_its_backward_goes():
    """With one micro-batch a stage's backward runs as one device's does: each unit's activations
    go as its gradients appear, beside the gradients flowing through it (the gradient of its output
    and the one of its input). Predicted as a stage holding every activation and every gradient at
    once, without those, both stages were 30% under."""
    predicted, measured = _predicted_and_measured(conv_stack, (torch.randn(8, 3, 8, 8),), LayoutSpec((("pp", 2),), "gpipe", 1))
    for d in LABELS:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.10 * measured[d], (d, total, measured[d])


def test_a_gpipe_stage_sums_each_weight_gradient_out_of_place_once():
    """A GPipe step runs one backward over every micro-batch: autograd sums a parameter's gradients
    before it makes ``.grad``, and the first sum adds two views (a Linear's weight gradient is the
    transpose of a matmul) into a third tensor. The stages peak there, one Linear's gradient more than
    the one predicted (each stage 13-14% under with wide Linears and few activations)."""
    make = lambda: TinyLM(d=32, layers=2)  # noqa: E731
    spec = LayoutSpec((("pp", 2),), "gpipe", 4, checkpointing=True)
    predicted, measured = _predicted_and_measured(make, _tokens(batch=4, seq=2), spec)
    for d in LABELS:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.10 * measured[d], (d, total, measured[d])


class TinyCausalLM(TinyLM):
    """Returns its logits beside its mean loss, as transformers' causal LMs do."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(h)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def test_a_one_f_one_b_last_stage_holds_the_logits_it_returns_once_gathered():
    """The 1F1B step keeps each micro-batch's logits for the caller, gathers them at the end and
    returns a copy without a gradient path: the last stage holds the logits through its backwards and
    twice at the end. It held each micro-batch's beside the gathered ones and their copy (3x the
    logits: the last stage 28% under what is now predicted), and the prediction counted none of them."""
    make = lambda: TinyCausalLM(vocab=256, d=16)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 256, (8, 8), generator=g), torch.randint(0, 256, (8, 8), generator=g)
    predicted, measured = _predicted_and_measured(make, (ids, labels), LayoutSpec((("pp", 2),), "1f1b", 4))
    for d in LABELS:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.10 * measured[d], (d, total, measured[d])


class FusedQkvBlock(nn.Module):
    """timm's ViT block: pre-norm, one fused q, k, v Linear read as heads, an MLP four times as wide."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.ln_2(x))))


class FusedQkvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(FusedQkvBlock(48, 3) for _ in range(2))
        self.head = nn.Linear(48, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x[:, 0])


def test_tensor_parallel_devices_save_their_whole_heads_values():
    """3 heads over 2 devices: the first saves 2 heads' q, k, v and attention values, the second 1, as
    their projections split (the model halved the values: -3.9% and +6.3% here; timm's ViT-tiny's first
    device 2.7% under, over bench_planner's tight budget). Each device now within 5% (+1.4%, -2.5%)."""
    x = torch.randn(8, 16, 48)
    torch.manual_seed(0)
    pm = dpcompile.transform(FusedQkvNet(), ["cpu"] * 2, example_inputs=(x,), optimizer="sgd", tensor_parallel=True)
    measured = dpcompile.measure(pm, x)
    for d, peak in measured.peak_bytes.items():
        assert abs(measured.predicted_peak_bytes[d] - peak) <= 0.05 * peak, (d, measured)


def test_tensor_parallel_splits_attention_by_whole_heads():
    """3 heads over 2 devices: the first holds 2 heads' projections, the second 1 (not halves, which
    put the second device 15% over what it measured)."""
    spec = LayoutSpec((("tp", 2),), checkpointing=True)
    make = lambda: TinyEncoder(d=48, heads=3)  # noqa: E731
    x = (torch.randn(4, 16, 48),)
    planned = plan_layouts(make(), LABELS, dict.fromkeys(LABELS, 1 << 40), optimizer="sgd", training=True,
                           example_inputs=x, example_kwargs=None, device=torch.device("cpu"), specs=[spec])  # fmt: skip
    predicted = planned.candidates[0].per_device
    torch.manual_seed(0)
    pm = dpcompile.transform(make(), ["cpu"] * 2, example_inputs=x, optimizer="sgd", **Candidate(spec).keywords())
    measured = dpcompile.measure(pm, *x)
    for d in LABELS:
        held = measured.memory_estimate[d]["parameters"]  # explain's count of what the device holds
        assert abs(predicted[d]["parameters"] - held) <= 0.01 * held, (d, predicted[d]["parameters"], held)
        total = sum(predicted[d].values())
        assert abs(total - measured.peak_bytes[d]) <= 0.10 * measured.peak_bytes[d], (d, total, measured.peak_bytes[d])


def test_the_planner_builds_a_pipeline_cut_where_it_predicts_the_cut():
    """The prediction cuts the model into stages at units; the pass, given ``pipeline=2``, cut between ops
    by FLOPs, one ReLU away: the first device was predicted 14% over, the second 17% under (MobileNet-V3,
    ResNet-18 and ConvNeXt's first stages up to 25% over). The planner's keywords now name the module
    where its second stage starts, and the pass cuts there."""
    candidate, pm = _planned_and_built(conv_stages, (torch.randn(8, 3, 8, 8),), LayoutSpec((("pp", 2),), "gpipe", 1))
    (start,) = candidate.stage_starts
    assert candidate.keywords()["pipeline"] == [start]
    first = {n.name: n for n in pm.captured.graph.nodes}[pm.stage_plan.starts[1]]
    assert module_path_of(first) == start == "2.convs.1"
    measured = dpcompile.measure(pm, torch.randn(8, 3, 8, 8)).peak_bytes
    for d in LABELS:
        total = sum(candidate.per_device[d].values())
        assert abs(total - measured[d]) <= 0.10 * measured[d], (d, total, measured[d])


def test_gpipe_micro_batches_meeting_at_batch_norm_sweep_backward_together():
    """A BatchNorm normalises every micro-batch by the whole batch's statistics, so GPipe's micro-batches
    meet at each one in backward as in forward: a stage's backward runs as one sweep of the whole batch
    (activations freed unit by unit as gradients appear), not one micro-batch after another with the
    others' activations held. Predicted so, both stages were 15% and 11% under (EfficientNet-B0's first
    stage with checkpointing 24-34%)."""
    predicted, measured = _predicted_and_measured(NormedConvs, (torch.randn(8, 3, 8, 8),), LayoutSpec((("pp", 2),), "gpipe", 4))
    for d in LABELS:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.10 * measured[d], (d, total, measured[d])


def wide_convs(c: int = 32) -> nn.Sequential:
    """1x1 convolutions, wide, on one pixel: a stage's peak is its gradients, as ConvNeXt's last stage's."""
    return nn.Sequential(nn.Conv2d(3, c, 1), nn.GELU(), nn.Conv2d(c, 4 * c, 1), nn.GELU(), nn.Conv2d(4 * c, c, 1), nn.GELU(),
                         nn.Conv2d(c, 4 * c, 1), nn.GELU(), nn.Conv2d(4 * c, c, 1), nn.Flatten(), nn.Linear(c, 10))  # fmt: skip


def test_a_gpipe_stage_sums_a_convolutions_gradients_in_place():
    """GPipe's micro-batches' gradients of a convolution meet in one backward, where autograd sums them in
    place (a Linear weight's first sum is out of place: its gradients are views); ``measure`` counts the
    step with its mode off while autograd sums, as a device runs it. Predicted with a third tensor of the
    largest convolution's gradient (as measure's mode once made it), both stages were 18-19% over."""
    predicted, measured = _predicted_and_measured(wide_convs, (torch.randn(4, 3, 1, 1),), LayoutSpec((("pp", 2),), "gpipe", 2))
    for d in LABELS:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.10 * measured[d], (d, total, measured[d])


class MixerBlock(nn.Module):
    """An MLP across the tokens, then one across the channels (timm's MLP-Mixer block)."""

    def __init__(self, tokens: int, d: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mix_tokens = nn.Sequential(nn.Linear(tokens, d // 2), nn.GELU(), nn.Linear(d // 2, tokens))
        self.mix_channels = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix_tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.mix_channels(self.norm2(x))


class Mixer(nn.Module):
    """8x8 patches of a 32x32 image (16 tokens), two Mixer blocks and a classifier."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, d, 8, stride=8)
        self.blocks = nn.Sequential(MixerBlock(16, d), MixerBlock(16, d))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.stem(x).flatten(2).transpose(1, 2))).mean(1))


def test_gpipe_runs_one_micro_batchs_backward_after_another():
    """GPipe's one backward over every micro-batch of a stage runs them one after another, the last
    forward's first: one micro-batch's activations are freed before the next one's gradients are added
    to those held. Predicted as every activation and every gradient at once, both stages were 12-16%
    over (timm's Mixer in the benchmark 7-10%)."""
    predicted, measured = _predicted_and_measured(Mixer, (torch.randn(8, 3, 32, 32),), LayoutSpec((("pp", 2),), "gpipe", 2))
    for d in LABELS:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.10 * measured[d], (d, total, measured[d])


def test_a_named_pipeline_with_a_budget_is_built_where_its_prediction_cuts_it():
    """``pipeline=2`` with ``memory_per_device=``: the budget is checked on the prediction's cut, and
    the pass now cuts there too (it cut by its own count of FLOPs, inside the third stage, whose first
    convolution the prediction gave to the first stage)."""
    x = torch.randn(8, 3, 8, 8)
    pm = dpcompile.transform(conv_stages(), ["cpu"] * 2, pipeline=2, memory_per_device="1GiB", example_inputs=(x,),
                             optimizer="sgd")  # fmt: skip
    (candidate,) = pm.candidates
    first = {n.name: n for n in pm.captured.graph.nodes}[pm.stage_plan.starts[1]]
    assert candidate.stage_starts == (module_path_of(first),) == ("2.convs.1",)


class ThreeBlocks(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(EncoderBlock(d, 2) for _ in range(3)))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(1))


def test_a_pipeline_of_tensor_parallel_shards_is_cut_at_the_predicted_block():
    """Stages of tensor-parallel shards start at a block (between blocks every value is whole): the
    prediction cuts three blocks and a head before the third block, and the pass cuts there (it cut by
    FLOPs inside the second block, after its attention, and the prediction named no cut)."""
    pm = dpcompile.transform(ThreeBlocks(), ["cpu"] * 4, pipeline=2, tensor_parallel=True, memory_per_device="1GiB",
                             example_inputs=(torch.randn(4, 8, 32),), optimizer="sgd")  # fmt: skip
    (candidate,) = pm.candidates
    assert candidate.stage_starts == ("blocks.2",)
    first, second = (stage.module_paths for stage in pm.stages)
    assert second[0].startswith("blocks.2.") and not any(p.startswith("blocks.2") for p in first)


class ConvNextBlock(nn.Module):
    """A depthwise convolution, a LayerNorm, a 1x1 convolution MLP and a layer scale (timm's ConvNeXt
    block with ``conv_mlp``)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.norm = nn.GroupNorm(1, c)
        self.fc1, self.fc2 = nn.Conv2d(c, 4 * c, 1), nn.Conv2d(4 * c, c, 1)
        self.gamma = nn.Parameter(torch.full((c, 1, 1), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.fc2(F.gelu(self.fc1(self.norm(self.conv_dw(x)))))


class Staged(nn.Module):
    """Blocks under ``stages``, a name ``fx.GraphModule`` has (the program calls them ``user:stages.0``...)."""

    def __init__(self, c: int = 32) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 2, stride=2)
        self.stages = nn.Sequential(*(ConvNextBlock(c) for _ in range(2)))
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


def test_a_checkpointed_block_under_an_aliased_name_is_recomputed_whole():
    """A block whose module path starts with a name the program aliases (timm's ConvNeXt: ``stages``) is
    one region, its convolutions in it: read as other modules' calls (``user:stages.0.fc1``), they cut it
    into four regions, their inputs and outputs kept for backward (here each device 4% over its
    prediction; ConvNeXt-atto's second stage under ``pp2 gpipe mb2 +ckpt`` 1.6%, over its budget)."""
    x = torch.randn(8, 3, 2, 2)  # one pixel after the stem: the gradients dominate, as in ConvNeXt's last stages
    spec = LayoutSpec((("pp", 2),), "gpipe", 2, checkpointing=True)
    candidate, pm = _planned_and_built(Staged, (x,), spec)
    regions = [n for n in pm.program_for_call(x).graph.nodes if n.op == "call_function" and "checkpoint" in str(n.target)]
    assert len(regions) == 2 * 2  # a region per block and micro-batch
    torch.manual_seed(0)
    eager, mine = x.clone().requires_grad_(), x.clone().requires_grad_()
    Staged()(eager).sum().backward()
    pm(mine).sum().backward()  # the blocks recomputed in backward, convolutions and all
    torch.testing.assert_close(mine.grad, eager.grad)
    measured = dpcompile.measure(pm, x).peak_bytes
    for d in LABELS:
        total = sum(candidate.per_device[d].values())
        assert abs(total - measured[d]) <= 0.10 * measured[d], (d, total, measured[d])


class PostNormBlock(nn.Module):
    """BERT's layer: attention, then a GELU MLP twice as wide, each added to its input and normed."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = self.ln_1(x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)))
        return self.ln_2(x + self.down(F.gelu(self.up(x))))


class TinyBert(nn.Module):
    """An embedding, two post-norm blocks, BERT's pooler (the first token's Linear and tanh) and a classifier."""

    def __init__(self, d: int = 32, heads: int = 2, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(PostNormBlock(d, heads) for _ in range(2))
        self.pooler, self.classifier = nn.Linear(d, d), nn.Linear(d, 2)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.classifier(torch.tanh(self.pooler(h[:, 0]))), labels)


def test_a_pipeline_last_stage_makes_its_blocks_gradients_one_module_at_a_time():
    """The last stage (a block and BERT's head) peaks as its block's backward starts: every activation
    still held, the gradients of the block's values flowing, but none of its parameters' gradients made
    yet (they come one module at a time, as its activations go). Counting the block's gradients whole
    from the start put this stage 16% over (BERT's last stage 11%, 13.5% under pp2 x tp2)."""
    g = torch.Generator().manual_seed(0)
    args = (torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 2, (8,), generator=g))
    predicted, measured = _predicted_and_measured(TinyBert, args, LayoutSpec((("pp", 2),), "gpipe", 2))
    for d in LABELS:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.10 * measured[d], (d, total, measured[d])


def test_tensor_parallel_holds_two_gradients_of_a_wide_value_in_backward():
    """A block's backward holds the gradient of its 4x-wide value twice (the down layer's, then the ReLU's,
    while the ReLU's saved output is still held), each device its shard: unpredicted, the second device
    was 12% under (bench_memory_estimate's MLP stack). The moments of each block's backward come from a
    fake backward of the profile run (``analysis.backward_sweep``)."""
    make = lambda: nn.Sequential(*(ResidualBlock(32) for _ in range(4)))  # noqa: E731
    predicted, measured = _predicted_and_measured(make, (torch.randn(8, 32, 32),), LayoutSpec((("tp", 2),)))
    for d in LABELS:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.10 * measured[d], (d, total, measured[d])


class ResidualNormedConvs(nn.Module):
    """Four residual conv-BatchNorm-ReLU blocks (repeated: checkpointing recomputes them) and a head."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
                                      for _ in range(4)))  # fmt: skip
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["whole", "recomputed"])
def test_data_parallel_batch_norm_backward_holds_its_formulas_values(checkpointing):
    """Data parallel's BatchNorm is ``runtime.batch_norm`` over the devices' chunks, whose backward makes
    ``(dy - mean_dy - centred * projection) * scale``: three values of its input's size at once where ATen's
    kernel, which the planner's fake run measures, makes one. Without the two, both devices were 12% under;
    with the blocks recomputed (their backward predicted by the recomputed block's own moments) 27% under."""
    spec = LayoutSpec((("dp", 2),), checkpointing=checkpointing)
    predicted, measured = _predicted_and_measured(ResidualNormedConvs, (torch.randn(8, 3, 16, 16),), spec)
    for d in LABELS:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.05 * measured[d], (d, total, measured[d])


def test_the_first_device_holds_the_outputs_forward_returns_through_backward():
    """The caller holds what forward returns (``out = pm(x)``) through backward, gathered whole on the
    first device: a Linear whose output tensor parallelism gathers was 33% under there."""
    predicted, measured = _predicted_and_measured(lambda: nn.Linear(256, 256), (torch.randn(64, 256),),
                                                  LayoutSpec((("tp", 2),)))  # fmt: skip
    for d in LABELS:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.05 * measured[d], (d, total, measured[d])


class ThreeHeadBlock(nn.Module):
    """Attention of 3 heads of 16 (q, k, v apart, a padding mask made in the block) and an MLP 96 wide:
    the MLP's up layer (96 x 48) is shaped as a fused projection of 2 of those heads' widths."""

    def __init__(self, d: int = 48, heads: int = 3) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (f(x).view(b, s, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        mask = torch.where(keep[:, None, None, :], 0.0, -1e4).expand(b, 1, s, s)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, d)
        x = x + self.o(a)
        return x + self.mlp(x)


class ThreeHeadEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ThreeHeadBlock(), ThreeHeadBlock()])

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, keep)
        return x.mean()


def test_tensor_parallel_splits_by_heads_only_the_projections_attention_reads():
    """3 heads over 2 devices: the q, k, v projections and the output projection split 2 and 1 heads, the
    MLP in halves, though its up layer is shaped as a fused projection (read so, the MLP's values were
    counted two thirds on the first device and a third on the second: +10% and -18%); each device makes its
    own attention mask. Now within 1%."""
    args = (torch.randn(8, 16, 48), torch.ones(8, 16, dtype=torch.bool))
    predicted, measured = _predicted_and_measured(ThreeHeadEncoder, args, LayoutSpec((("tp", 2),)))
    for d in LABELS:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.05 * measured[d], (d, total, measured[d])


def test_a_row_split_output_layer_holds_its_partial_sums_as_forward_ends():
    """A Linear with fewer outputs than inputs is split by rows (its output all-reduced): as forward ends
    every device holds its partial sum of the whole output, the first also two running sums of the
    reduction, more than backward holds (predicted from backward alone, over 4 devices: 71% under on the
    first, 34% on the others)."""
    labels, x = [f"cpu#{i}" for i in range(4)], torch.randn(32, 64)
    torch.manual_seed(0)
    planned = plan_layouts(nn.Linear(64, 16), labels, dict.fromkeys(labels, 1 << 40), optimizer="sgd", training=True,
                           example_inputs=(x,), example_kwargs=None, device=torch.device("cpu"),
                           specs=[LayoutSpec((("tp", 4),))])  # fmt: skip
    (candidate,) = planned.candidates
    pm = dpcompile.transform(nn.Linear(64, 16), ["cpu"] * 4, example_inputs=(x,), optimizer="sgd", **candidate.keywords())
    measured = dpcompile.measure(pm, x).peak_bytes
    for d in labels:
        total = sum(candidate.per_device[d].values())
        assert abs(total - measured[d]) <= 0.05 * measured[d], (d, total, measured[d])


class TiedLM(TinyLM):
    """TinyLM with its head's weight the embedding's (GPT-2's lm_head): a pipeline's last stage makes a
    gradient of it too, summed with the first stage's at the end of the step."""

    def __init__(self) -> None:
        super().__init__(vocab=512, d=32, layers=4)
        self.head.weight = self.embed.weight


def test_a_pipeline_stage_makes_the_gradient_of_a_weight_tied_to_another_stage():
    """Counted with the embedding's stage alone, the head's stage was 27% under its measured peak (GPipe,
    2 micro-batches; now -4.5%)."""
    spec = LayoutSpec((("pp", 2),), "gpipe", 2)
    predicted, measured = _predicted_and_measured(TiedLM, _tokens(8, 4), spec)
    for d in LABELS:
        total = sum(predicted[d].values())
        assert abs(total - measured[d]) <= 0.05 * measured[d], (d, total, measured[d])
