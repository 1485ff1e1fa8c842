"""Data-parallel semantics that DataParallel gets wrong: exact losses, whole-batch BatchNorm,
seq-first RNNs, PackedSequence, inputs without a batch, and ops that cannot be split."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import dpcompile
from dpcompile import runtime
from tests.helpers import check_against_eager
from tests.models import CNN, Classifier, SeqEncoder


@pytest.mark.parametrize("batch, n_devices", [(9, 4), (3, 4), (8, 2)])
def test_cross_entropy_loss_is_the_single_device_value(batch, n_devices):
    """F.cross_entropy returns one 0-dim loss equal to eager's, uneven splits included."""
    pm = check_against_eager(Classifier, ["cpu"] * n_devices, torch.randn(batch, 8), torch.randint(0, 5, (batch,)))
    loss, _ = pm(torch.randn(batch, 8), torch.randint(0, 5, (batch,)))
    assert loss.dim() == 0


def test_cross_entropy_combines_partial_sums_instead_of_gathering_logits():
    """The loss is reduced from per-device partial sums: no gather feeds it."""
    pm = dpcompile.transform(Classifier(), ["cpu"] * 2)
    loss_node = next(n for n in pm.graph.nodes if n.name == "cross_entropy")
    assert loss_node.target is runtime.mean_of_partials
    assert all(arg.target is not runtime.gather for arg in loss_node.all_input_nodes)


class LossModel(nn.Module):
    def __init__(self, loss, target_kind):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.loss = loss
        self.target_kind = target_kind

    def forward(self, x, target):
        out = self.fc(x)
        if self.target_kind == "prob":
            out = torch.sigmoid(out)
        return self.loss(out, target)


def _loss_cases():
    weight = torch.tensor([1.0, 2.0, 0.5, 3.0])
    return [
        ("mse", lambda: nn.MSELoss(), "float"),
        ("mse_sum", lambda: nn.MSELoss(reduction="sum"), "float"),
        ("l1", lambda: nn.L1Loss(), "float"),
        ("smooth_l1", lambda: nn.SmoothL1Loss(beta=0.5), "float"),
        ("huber", lambda: nn.HuberLoss(delta=0.7), "float"),
        ("bce", lambda: nn.BCELoss(), "prob"),
        ("bce_logits", lambda: nn.BCEWithLogitsLoss(pos_weight=torch.ones(4) * 2), "prob01"),
        ("ce", lambda: nn.CrossEntropyLoss(), "class"),
        ("ce_weight_ignore", lambda: nn.CrossEntropyLoss(weight=weight, ignore_index=2), "class"),
        ("ce_smoothing", lambda: nn.CrossEntropyLoss(label_smoothing=0.1), "class"),
        ("ce_sum", lambda: nn.CrossEntropyLoss(reduction="sum"), "class"),
        ("nll", lambda: (lambda a, b: F.nll_loss(F.log_softmax(a, 1), b)), "class"),
        ("f_mse", lambda: F.mse_loss, "float"),
        ("f_bce_logits", lambda: (lambda a, b: F.binary_cross_entropy_with_logits(a, b, reduction="mean")), "prob01"),
        ("f_ce_none_mean", lambda: (lambda a, b: F.cross_entropy(a, b, reduction="none").mean()), "class"),
    ]


@pytest.mark.parametrize("name, make_loss, target_kind", _loss_cases(), ids=[c[0] for c in _loss_cases()])
def test_reducing_losses_match_eager_with_uneven_splits(name, make_loss, target_kind):
    """Each reducing loss (mean or sum) gives eager's value and gradients on 9 over 4."""
    batch = 9
    if target_kind == "class":
        target = torch.randint(0, 4, (batch,))
    elif target_kind in ("prob", "prob01"):
        target = torch.rand(batch, 4).round()
    else:
        target = torch.randn(batch, 4)

    def make():
        loss = make_loss()
        if isinstance(loss, nn.Module):
            return LossModel(loss, target_kind)
        return _FunctionalLoss(loss, target_kind)

    pm = check_against_eager(make, ["cpu"] * 4, torch.randn(batch, 6), target)
    assert not any(n.target is runtime.gather for n in pm.graph.nodes)


class _FunctionalLoss(nn.Module):
    def __init__(self, fn, target_kind):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.fn = fn
        self.target_kind = target_kind

    def forward(self, x, target):
        out = self.fc(x)
        if self.target_kind == "prob":
            out = torch.sigmoid(out)
        return self.fn(out, target)


class Reductions(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        y = self.fc(x)
        return y.mean(), y.sum(), y.sum(0), torch.mean(y, dim=0), y.mean(1), x / y.sum()


def test_batch_reductions_give_single_device_values():
    """mean/sum over the batch or the whole tensor equal eager, as do uses of them."""
    pm = check_against_eager(Reductions, ["cpu"] * 4, torch.randn(7, 5))
    out = pm(torch.randn(7, 5))
    assert out[0].dim() == 0 and out[2].shape == (3,) and out[4].shape == (7,)


def test_batchnorm_training_uses_whole_batch_statistics():
    """BatchNorm2d normalises with the whole batch's statistics; running stats update once."""
    check_against_eager(CNN, ["cpu"] * 4, torch.randn(9, 3, 8, 8))
    model = CNN()
    pm = dpcompile.transform(model, ["cpu"] * 3)
    pm(torch.randn(5, 3, 8, 8))
    assert int(model.bn1.num_batches_tracked) == 1


@pytest.mark.parametrize("bn, shape", [(nn.BatchNorm1d(4), (9, 4)), (nn.BatchNorm1d(4), (9, 4, 6)), (nn.BatchNorm3d(4), (5, 4, 3, 3, 3))])
def test_batchnorm_variants_match_eager(bn, shape):
    """BatchNorm1d (2-D and 3-D input) and BatchNorm3d match eager in training mode."""
    check_against_eager(lambda: copy.deepcopy(bn), ["cpu"] * 3, torch.randn(*shape))


def test_batchnorm_momentum_none_and_eval_mode_match_eager():
    """Cumulative averaging (momentum=None) and eval mode use the running statistics right."""
    check_against_eager(lambda: nn.BatchNorm1d(4, momentum=None), ["cpu"] * 2, torch.randn(7, 4))
    model = nn.BatchNorm1d(4)
    model.running_mean.fill_(0.3)
    model.eval()
    check_against_eager(lambda: copy.deepcopy(model), ["cpu"] * 2, torch.randn(7, 4))


def test_batchnorm_cnn_training_steps_match_eager():
    """Four SGD steps on a BatchNorm CNN: parameters and running statistics equal eager."""
    model = CNN()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _step in range(4):
        x, y = torch.randn(10, 3, 8, 8), torch.randint(0, 5, (10,))
        for module, optimizer in ((pm, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            F.cross_entropy(module(x), y).backward()
            optimizer.step()
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_seq_first_rnn_input_is_split_on_dim_1():
    """An input reaching an LSTM with batch_first=False is split along dim 1."""
    pm = check_against_eager(SeqEncoder, ["cpu"] * 3, torch.randint(0, 20, (6, 7)))
    assert pm.input_dims == {"tokens": 1}
    assert "dpcompile_runtime_scatter(tokens, ['cpu', 'cpu', 'cpu'], 1)" in pm.code


def test_batch_dim_override_wins():
    """batch_dim= forces the split dim of every input."""
    model = nn.Linear(4, 3)
    pm = dpcompile.transform(model, ["cpu"] * 2, batch_dim=1)
    assert pm.input_dims == {"input": 1}
    x = torch.randn(2, 6, 4)
    torch.testing.assert_close(pm(x), model(x))


def test_ambiguous_batch_dim_asks_for_batch_dim():
    """An input that two RNNs want split on different dims raises ValueError naming it."""

    class TwoRNNs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.GRU(4, 4, batch_first=True)
            self.b = nn.GRU(4, 4)

        def forward(self, x):
            return self.a(x)[0] + self.b(x)[0]

    with pytest.raises(ValueError, match="input 'x'.*batch_dim="):
        dpcompile.transform(TwoRNNs(), ["cpu"] * 2)


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x, mask):
        scores = self.q(x) @ x.transpose(1, 2)
        return torch.softmax(scores + mask, dim=-1)


def test_input_without_batch_is_replicated_with_example_inputs():
    """A (T, T) mask next to a (B, T, D) input is replicated, not split."""
    x, mask = torch.randn(6, 5, 8), torch.randn(5, 5)
    pm = check_against_eager(Masked, ["cpu"] * 3, x, mask, transform_kwargs={"example_inputs": (x, mask)})
    assert pm.input_dims == {"x": 0, "mask": None}
    assert "dpcompile_runtime_scatter(mask" not in pm.code


class Packed(nn.Module):
    def __init__(self, total_length=None):
        super().__init__()
        self.rnn = nn.LSTM(3, 5, batch_first=True)
        self.total_length = total_length

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, (h, c) = self.rnn(packed)
        padded, out_lengths = pad_packed_sequence(out, batch_first=True, total_length=self.total_length)
        return padded, out_lengths, h


@pytest.mark.parametrize("total_length", [None, 9])
def test_packed_sequence_matches_eager(total_length):
    """pack → LSTM → pad inside forward matches eager; lengths stay on the CPU."""
    lengths = torch.tensor([4, 7, 2, 5, 7, 1, 3])
    x = torch.randn(7, 7, 3)
    pm = check_against_eager(lambda: Packed(total_length), ["cpu"] * 3, x, lengths)
    padded, out_lengths, _ = pm(x, lengths)
    assert padded.shape[1] == (total_length or 7) and out_lengths.device.type == "cpu"
    assert "pack_padded_sequence(x_dev1, lengths_dev1" in pm.code


class PackedByAttribute(nn.Module):
    """Packing spelled through the module (``nn.utils.rnn.pack_padded_sequence``), not a global."""

    def __init__(self):
        super().__init__()
        self.rnn, self.out = nn.LSTM(3, 5, batch_first=True, dtype=torch.float64), nn.Linear(5, 2, dtype=torch.float64)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, (h, _) = self.rnn(packed)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return self.out(padded) + self.out(h[-1])[:, None]


def test_packed_sequence_spelled_through_the_module_splits_or_is_refused_by_name():
    """fx traced into ``nn.utils.rnn.pack_padded_sequence`` (fx wraps only globals) and failed on
    '__cuda_array_interface__ must be a dict'; it is kept as a call and split, as the global is.
    The export frontend, which cannot run an RNN on a PackedSequence, says so and names fx."""
    lengths, x = torch.tensor([4, 7, 2, 5, 7, 1]), torch.randn(6, 7, 3, dtype=torch.float64)
    pm = check_against_eager(PackedByAttribute, ["cpu"] * 2, x, lengths, transform_kwargs={"example_inputs": (x, lengths)})
    assert "pack_padded_sequence(x_dev1, lengths_dev1" in pm.code
    model = PackedByAttribute()
    with pytest.raises(dpcompile.TraceError, match="cannot run an RNN on a PackedSequence.*frontend='fx'"):
        dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x, lengths))


class Unsplittable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        gram = y @ y.T
        ranked = torch.sort(y, dim=0).values
        top = torch.topk(y, 2, dim=0).values
        return gram, ranked + 1, top


def test_ops_across_the_batch_run_after_a_gather():
    """x @ x.T, sort and top-k over the batch run once on the gathered batch, exactly."""
    pm = check_against_eager(Unsplittable, ["cpu"] * 3, torch.randn(7, 4))
    gathers = [n for n in pm.graph.nodes if n.target is runtime.gather]
    assert len(gathers) == 1 and gathers[0].name == "fc"


class SizesAndFactories(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 3)

    def forward(self, x):
        b = x.size(0)
        h = x.view(b, -1)
        z = x.new_zeros(b, 3) + self.fc(h)
        return z, x.shape[0], b * 2, h.flatten()


def test_batch_sizes_reshapes_and_factories_follow_the_chunks():
    """x.size(0) is the chunk's inside the program and the whole batch's when returned."""
    pm = check_against_eager(SizesAndFactories, ["cpu"] * 3, torch.randn(7, 3, 4))
    z, n, twice, flat = pm(torch.randn(7, 3, 4))
    assert (n, twice, z.shape, flat.shape) == (7, 14, (7, 3), (84,))
    assert "dpcompile_runtime_gather" not in pm.code.split("fc_dev2")[0]


class Shapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return (
            torch.cat([y, y * 2], dim=1),
            torch.stack([y, y], 0),
            y[:, 1:3],
            y.unsqueeze(1).expand(-1, 3, -1),
            y.chunk(2, dim=1)[1],
            y.permute(1, 0).transpose(0, 1),
        )


def test_shape_ops_keep_the_split():
    """cat/stack/slicing/expand/chunk/permute on split values stay split until the output."""
    pm = check_against_eager(Shapes, ["cpu"] * 3, torch.randn(7, 4))
    gathers = [n for n in pm.graph.nodes if n.target is runtime.gather]
    assert all(n.meta["dpcompile_comm"].io for n in gathers)
    assert len(gathers) == 6


class EncoderAndAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x, pad):
        y = self.enc(x, src_key_padding_mask=pad)
        return self.mha(y, y, y)


def test_transformer_layers_and_attention_run_per_device():
    """TransformerEncoderLayer and MultiheadAttention (with a padding mask) split on the batch."""
    pad = torch.zeros(5, 6, dtype=torch.bool)
    pad[:, -1] = True
    pm = check_against_eager(EncoderAndAttention, ["cpu"] * 2, torch.randn(5, 6, 8), pad, atol=1e-4)
    (gather,) = [n for n in pm.graph.nodes if n.target is runtime.gather]  # the returned (out, weights)
    assert gather.args[1] == (0, 0)


class SegmentationLike(nn.Module):
    """torchvision's FCN / DeepLab: an ``OrderedDict`` of outputs ("out", "aux")."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        result = collections.OrderedDict()
        result["out"] = self.head(torch.relu(self.body(x)))
        result["aux"] = self.body(x)
        return result


@pytest.mark.parametrize("layout", [{}, {"pipeline": 2}], ids=["dp", "pp"])
def test_an_ordered_dict_output_stays_one_through_export(layout, tmp_path):
    """fx wrote the returned OrderedDict as a dict literal: the program returned a plain dict."""
    model, x = SegmentationLike(), torch.randn(4, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), **layout)
    dpcompile.export(pm, tmp_path / "e")
    expected = model(x)
    for program in (pm, dpcompile.load(tmp_path / "e")):
        got = program(x)
        assert type(got) is collections.OrderedDict and list(got) == ["out", "aux"]
        torch.testing.assert_close(dict(got), dict(expected))


AuxOutputs = collections.namedtuple("AuxOutputs", ["logits", "aux_logits"])  # as Inception-v3's InceptionOutputs


class AuxLike(SegmentationLike):
    def forward(self, x):
        return AuxOutputs(self.head(torch.relu(self.body(x))), self.body(x))


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("cls", [SegmentationLike, AuxLike], ids=["ordered_dict", "namedtuple"])
def test_a_returned_structure_is_not_listed_as_running_whole(cls, frontend):
    """The call that builds the returned OrderedDict / namedtuple holds gathered outputs: it is no
    work left unsplit, so explain's ``whole`` is empty (it said "no batch rule for collections.OrderedDict")."""
    model, x = cls(), torch.randn(4, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), frontend=frontend)
    report = dpcompile.explain(pm, x)
    assert report.whole == [] and report.split_flop_fraction == 1.0
    got, expected = pm(x), model(x)
    assert type(got) is type(expected)
    torch.testing.assert_close(tuple(got.values() if isinstance(got, dict) else got),
                               tuple(expected.values() if isinstance(expected, dict) else expected))
