"""Odd torch.nn features a user may bring, against eager in float64 (the probe of session 19): a
parameter forward writes in place (``with torch.no_grad(): w.mul_(0.9)``, ``nn.Embedding(max_norm=)``),
under every one-process layout that keeps the model's parameters, and under ``data_parallel="fsdp"``."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import dpcompile
from tests.helpers import assert_steps_equal_eager, full_gradients


class ShrinksItsWeight(nn.Module):
    """Forward scales ``a.weight`` in place, untracked, before using it (a hand-rolled decay)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            self.a.weight.mul_(0.9)
        return self.b(torch.relu(self.a(x)))


class RenormedLookup(nn.Module):
    """``nn.Embedding(max_norm=1)`` renormalises the rows it looks up, in its weight, in forward."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(10, 8, max_norm=1.0), nn.Linear(8, 3)

    def forward(self, ids):
        return self.fc(torch.relu(self.emb(ids)))


def _inputs(cls):
    if cls is RenormedLookup:
        return (torch.tensor([[1, 2, 0], [3, 4, 4], [0, 0, 5], [6, 7, 8]]),)
    return (torch.randn(4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64),)


def _trains_like_eager(cls, devices, **options):
    torch.manual_seed(0)
    model = cls().double()
    eager, before = copy.deepcopy(model), copy.deepcopy(model.state_dict())
    args = _inputs(cls)
    pm = dpcompile.transform(model, devices, example_inputs=args, **options)
    for key, value in model.state_dict().items():  # shape propagation's fake run wrote nothing real
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=lambda m, key=key: f"{key} after transform: {m}")
    assert_steps_equal_eager(pm, eager, lambda step: args, lambda params: torch.optim.AdamW(params, lr=1e-2))
    assert list(pm.state_dict()) == list(eager.state_dict())
    return pm


@pytest.mark.parametrize("options", [{}, {"mesh": {"pp": 2}, "micro_batches": 2}], ids=["dp", "pp"])
def test_odd_transform_leaves_a_parameter_forward_writes_as_it_was(options):
    """transform with example_inputs= runs forward on fake tensors (shapes, FLOPs per stage); a write
    into a real parameter by a Python number ran for real there (the weight scaled by 0.9 once, twice
    in a pipeline) and the program then trained a model eager had not seen."""
    _trains_like_eager(ShrinksItsWeight, ["cpu"] * 2, **options)


@pytest.mark.parametrize("cls", [ShrinksItsWeight, RenormedLookup])
def test_odd_fsdp_keeps_a_parameter_forward_writes_whole(cls):
    """data_parallel="fsdp" in one process stored every parameter as pieces and gathered a whole copy
    per call: the write forward makes landed on that copy and was lost (the pieces never shrank or
    renormalised, and from the second step on outputs differed). Such a parameter stays whole."""
    pm = _trains_like_eager(cls, ["cpu"] * 2, mesh={"dp": 2}, data_parallel="fsdp")
    written = "a.weight" if cls is ShrinksItsWeight else "emb.weight"
    assert written in dict(pm.named_parameters())
    assert any(".parametrizations." in n for n, _ in pm.named_parameters())  # the others are pieces


class BranchesOnTraining(nn.Module):
    """``if self.training`` around ops: the program of each mode is another one."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h = h * 2 if self.training else h - 1
        return self.b(torch.relu(h))


def test_odd_program_pickled_in_eval_mode_runs_eval_after_loading():
    """torch.save of a program in eval mode (its main program traced in training): the loaded copy took
    that program for the eval one (its key read the modes the model was pickled in) and ran
    ``h * 2`` in eval; now each mode runs its own, in both orders."""
    torch.manual_seed(0)
    model = BranchesOnTraining().double()
    eager = copy.deepcopy(model)
    x = _inputs(ShrinksItsWeight)[0]
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,)).eval()
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert not loaded.training
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), eager.eval()(x))
        torch.testing.assert_close(loaded.train()(x), eager.train()(x))
        torch.testing.assert_close(loaded.eval()(x), eager.eval()(x))


def test_odd_uninitialised_lazy_module_is_refused_by_name_and_nothing_changes():
    """An uninitialised nn.LazyLinear / LazyConv2d crashed at the first call ('Cannot copy out of meta
    tensor'), in a pass under tensor parallelism, and gave NaN under data_parallel="fsdp"; it is refused
    before anything changes (the model stays lazy, the RNG untouched), and once called it transforms."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyConv2d(4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3)).double()
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rng = torch.get_rng_state()
    for options in ({}, {"mesh": {"dp": 2}, "data_parallel": "fsdp"}, {"tensor_parallel": True}):
        with pytest.raises(dpcompile.ArgumentError, match=r"lazy modules .*'0' \(LazyConv2d\), '3' \(LazyLinear\).*model\(x\)"):
            dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), **options)
    assert torch.equal(torch.get_rng_state(), rng)
    assert type(model[0]) is nn.LazyConv2d and model[0].has_uninitialized_params()
    model(x)
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), mesh={"dp": 2}, data_parallel="fsdp")
    torch.testing.assert_close(pm(x), eager(x))


def test_odd_channels_last_model_exports_and_loads(tmp_path):
    """dpcompile.export of a model converted to channels_last (its conv weights' strides NHWC) raised
    safetensors' 'non contiguous tensor' ValueError; its weights are written row-major and the loaded
    program gives the model's outputs and state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3)).double().to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,))
    dpcompile.export(pm, tmp_path / "ex")
    loaded = dpcompile.load(tmp_path / "ex")
    torch.testing.assert_close(loaded(x), model(x))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)


class SparseLookup(RenormedLookup):
    """``nn.Embedding(sparse=True)``: its weight's gradient is a sparse tensor."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8, sparse=True)


def test_odd_fsdp_keeps_a_sparse_embedding_whole():
    """data_parallel="fsdp" in one process crashed in backward on a sparse=True embedding ('aten::as_strided'
    on SparseCPU: the gather's backward); its weight stays whole, and a step of SGD equals eager's."""
    torch.manual_seed(0)
    model = SparseLookup().double()
    eager = copy.deepcopy(model)
    (ids,) = _inputs(RenormedLookup)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(ids,), mesh={"dp": 2}, data_parallel="fsdp")
    assert "emb.weight" in dict(pm.named_parameters())
    out, want = pm(ids), eager(ids)
    torch.testing.assert_close(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    grads = full_gradients(pm)
    for name, p in eager.named_parameters():
        got = grads[name].to_dense() if grads[name].is_sparse else grads[name]
        torch.testing.assert_close(got, p.grad.to_dense(), msg=lambda m, name=name: f"grad {name}: {m}")
    torch.optim.SGD(pm.parameters(), lr=0.1).step()
    torch.optim.SGD(eager.parameters(), lr=0.1).step()
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(pm.state_dict()[key], value, msg=lambda m, key=key: f"{key} after a step: {m}")


@pytest.mark.parametrize("options", [{"mesh": {"pp": 2}, "micro_batches": 2}, {"mesh": {"dp": 2, "tp": 2}}],
                         ids=["pp", "dpxtp"])  # fmt: skip
def test_odd_export_max_norm_lookup_renorms_before_each_micro_batch_reads(options):
    """The export frontend spells nn.Embedding(max_norm=)'s write as ``embedding_renorm_(detach(weight), ids)``:
    the order of the state's accesses did not see through the detach, so micro-batches (and dp copies) looked
    rows up before the renormalisation (outputs off by 0.3 at the first call); two AdamW steps now equal eager."""
    n = 4 if "dp" in options["mesh"] else 2
    _trains_like_eager(RenormedLookup, ["cpu"] * n, frontend="export", **options)


class SequenceFirstAttention(nn.Module):
    """nn.MultiheadAttention as built by default (batch_first=False) with a key_padding_mask: the
    input's batch is dim 1, the mask's dim 0."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2)

    def forward(self, x, pad):
        return self.attention(x, x, x, key_padding_mask=pad)[0]


def test_odd_sequence_first_attention_with_a_padding_mask():
    """fx follows each input to the module that reads it (x split on dim 1, the mask on dim 0) and
    equals eager; the export frontend, which splits every input on the one dim it found, refuses by
    name with that way out (it raised a bare ValueError), and the model is left as it was."""
    torch.manual_seed(0)
    model = SequenceFirstAttention().double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, pad = torch.randn(5, 4, 8, dtype=torch.float64), torch.zeros(4, 5, dtype=torch.bool)
    pad[:, -1] = True
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="fx", example_inputs=(x, pad))
    torch.testing.assert_close(pm(x, pad), model(x, pad))
    with pytest.raises(dpcompile.ArgumentError, match="frontend='fx', which follows each input"):
        dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x, pad))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


class InstanceNormed(nn.Module):
    """``nn.InstanceNorm2d(track_running_stats=True)``: forward updates its running statistics with a ``copy_``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.conv(x))).mean((2, 3)))


def test_odd_export_checkpointed_instance_norm_updates_its_running_stats_once():
    """The export frontend passes the norm's running statistics to the checkpointed region; checkpoint
    saved them and backward crashed ('modified by an inplace operation': instance_norm's ``copy_`` into
    them). They now reach the region unsaved: two AdamW steps and the running statistics equal eager."""
    torch.manual_seed(0)
    model = InstanceNormed().double()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), frontend="export", activation_checkpointing=["norm"])
    assert "checkpoint" in pm.code
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), lr=1e-2), torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for step in range(2):
        out, want = pm(x + step), eager(x + step)
        torch.testing.assert_close(out, want)
        out.square().sum().backward()
        want.square().sum().backward()
        for name, p in eager.named_parameters():
            torch.testing.assert_close(model.get_parameter(name).grad, p.grad, msg=lambda m, name=name: f"grad {name}: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(pm.state_dict()[key], value, msg=lambda m, key=key: f"{key} after 2 steps: {m}")


def doubled_input(module, args):
    """A forward pre-hook defined at module level: pickle saves it by name."""
    return (args[0] * 2,)


@pytest.mark.parametrize("options", [{}, {"mesh": {"pp": 2}, "micro_batches": 2}], ids=["dp", "pp"])
def test_odd_lambda_hook_under_torch_save_is_refused_by_name(options):
    """torch.save of a program whose model has a lambda hook raised pickle's bare AttributeError ("Can't
    pickle local object"); it is a DpCompileError naming the module, the hook and the ways out, and a hook
    defined at module level saves, loads and runs as eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).double()
    model[2].register_forward_hook(lambda module, args, out: out + 1)
    x = _inputs(ShrinksItsWeight)[0]
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), **options)
    with pytest.raises(dpcompile.DpCompileError, match=r"'2' \(Linear\) has a forward hook .*<lambda>.*Define the hook at module level"):
        torch.save(pm, io.BytesIO())
    model[2]._forward_hooks.clear()
    model[0].register_forward_pre_hook(doubled_input)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), **options)
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.load(buffer, weights_only=False)(x), model(x))


@pytest.mark.parametrize("options", [{}, {"tensor_parallel": True}, {"mesh": {"pp": 2}, "micro_batches": 2}],
                         ids=["dp", "tp", "pp"])  # fmt: skip
def test_odd_export_program_loaded_checks_its_arguments(options, tmp_path):
    """A program the export frontend captured fixes its arguments; its torch.save/torch.load copy and its
    dpcompile.export/load copy lost that check (its model watch is not saved) and a wrong call raised
    TypeCallFailed or a matmul error from inside the program. Each copy now raises the original's
    InputMismatch, word for word, after a right call too (the last call's shortcut skipped the check)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    x = _inputs(ShrinksItsWeight)[0]
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), frontend="export", **options)
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    dpcompile.export(pm, tmp_path / "ex")
    for loaded in (torch.load(buffer, weights_only=False), dpcompile.load(tmp_path / "ex")):
        torch.testing.assert_close(loaded(torch.cat([x, x])), model(torch.cat([x, x])))
        for wrong in [(x, x), (), (x[:, :5],)]:
            with pytest.raises(dpcompile.InputMismatch) as original:
                pm(*wrong)
            with pytest.raises(dpcompile.InputMismatch) as copied:
                loaded(*wrong)
            assert str(copied.value) == str(original.value)


class KeepsLabelledRows(nn.Module):
    """DeBERTa-v2's classification loss, reduced: the rows whose label is not negative, when there are any
    (the export frontend keeps the branch as ``aten._assert_scalar(u0 >= 1, ...)``)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x, labels):
        logits = self.fc(x)
        keep = (labels >= 0).nonzero().view(-1)
        if keep.size(0) > 0:
            return nn.functional.cross_entropy(logits[keep], labels[keep])
        return logits.sum() * 0


def test_odd_export_with_a_data_branch_assertion_loads_as_data(tmp_path):
    """``aten._assert_scalar`` is in the export vocabulary's frontend ops, but the table kept only ops that
    take or return a tensor (it takes a Scalar and a str), so the folder was written as a pickle that
    dpcompile.load read only with trust_code=True. It loads as data, equals eager, and still refuses the
    branch it does not hold."""
    import json

    torch.manual_seed(0)
    model = KeepsLabelledRows().double()
    x, labels = _inputs(ShrinksItsWeight)[0], torch.tensor([0, -1, 2, 1])
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x, labels), frontend="export")
    dpcompile.export(pm, tmp_path / "ex")
    assert json.loads((tmp_path / "ex" / "program.json").read_text())["trust_code"] is False
    loaded = dpcompile.load(tmp_path / "ex")
    torch.testing.assert_close(loaded(x, labels), model(x, labels))
    with pytest.raises(dpcompile.InputMismatch, match="branch of forward that the program does not have"):
        loaded(x, torch.full((4,), -1))


class ShufflesAndFolds(nn.Module):
    """nn.ChannelShuffle, nn.PixelShuffle, nn.Unfold then nn.Fold, per sample; the mean square is the loss."""

    def __init__(self):
        super().__init__()
        self.conv, self.shuffle, self.pixels = nn.Conv2d(4, 8, 1), nn.ChannelShuffle(2), nn.PixelShuffle(2)
        self.unfold, self.fold, self.mix = nn.Unfold(2, stride=2), nn.Fold((6, 6), 2, stride=2), nn.Linear(8, 8)

    def forward(self, x):
        h = self.pixels(self.shuffle(self.conv(x)))  # (N, 2, 6, 6)
        patches = self.mix(self.unfold(h).transpose(1, 2)).transpose(1, 2)
        return self.fold(patches).square().mean()


def test_odd_fx_shuffle_and_fold_modules_split_per_sample_under_1f1b():
    """The fx frontend keeps nn.ChannelShuffle, nn.PixelShuffle and nn.Fold as module calls, which had no
    batch rule (their functions had): they ran whole on the gathered batch, and 1F1B refused the model
    ('the 2 micro-batches meet at shuffle'). They split per sample: 1F1B's loss and gradients equal eager's."""
    x = torch.randn(4, 4, 3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    _assert_1f1b_like_eager(ShufflesAndFolds, (x,), "fx")


def _assert_1f1b_like_eager(make: type[nn.Module], inputs: tuple, frontend: str) -> None:
    """A float64 model's loss and every gradient under 1F1B on 2 devices (2 micro-batches) equal eager's."""
    torch.manual_seed(0)
    model = make().double()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=inputs, frontend=frontend, pipeline=2, micro_batches=2,
                             schedule="1f1b")  # fmt: skip
    loss, want = pm(*inputs), eager(*inputs)
    torch.testing.assert_close(loss, want)
    want.backward()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).grad, p.grad, msg=lambda m, name=name: f"grad {name}: {m}")


class WeightedBags(nn.Module):
    """nn.EmbeddingBag of 2-D indices (a bag per row) with per-sample weights; the mean square is the loss."""

    def __init__(self):
        super().__init__()
        self.bags, self.head = nn.EmbeddingBag(20, 8, mode="sum"), nn.Linear(8, 3)

    def forward(self, ids, weights):
        return self.head(self.bags(ids, per_sample_weights=weights)).square().mean()


def test_odd_fx_embedding_bag_of_rows_splits_per_sample_under_1f1b():
    """nn.EmbeddingBag given 2-D indices and no offsets makes one bag per row, but its module call had no
    batch rule (F.embedding_bag's, with offsets, is whole): it ran on the gathered batch and 1F1B refused
    the model. It splits as the rows (the weights too): 1F1B's loss and gradients equal eager's."""
    ids = torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(0))
    weights = torch.rand(4, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _assert_1f1b_like_eager(WeightedBags, (ids, weights), "fx")


class NearestCentres(nn.Module):
    """Distances from each sample to learned centres (``torch.cdist``); the mean square is the loss."""

    def __init__(self):
        super().__init__()
        self.centres, self.head = nn.Parameter(torch.randn(5, 8)), nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.cdist(x, self.centres)).square().mean()


def test_odd_export_cdist_splits_per_row_under_1f1b():
    """The export frontend keeps ``aten.cdist`` (not ``_cdist_forward``, whose rule splits per row): it ran
    whole on the gathered batch and 1F1B found no mean loss. It splits per row: the loss and gradients of
    1F1B equal eager's."""
    _assert_1f1b_like_eager(NearestCentres, (_inputs(ShrinksItsWeight)[0],), "export")


class FrequencyScaled(nn.Module):
    """An embedding and a bag of rows whose gradients are divided by each index's count in the batch."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8, scale_grad_by_freq=True, dtype=torch.float64)
        self.bags = nn.EmbeddingBag(10, 8, mode="sum", scale_grad_by_freq=True, dtype=torch.float64)
        self.head = nn.Linear(8, 2, dtype=torch.float64)

    def forward(self, ids):
        return self.head(self.embed(ids) + self.bags(ids)[:, None])


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_odd_scale_grad_by_freq_counts_over_the_whole_batch(frontend):
    """``scale_grad_by_freq=True`` divides each row's gradient by its index's count in the batch: split, each
    replica counted its own rows, and the table's gradient was off by up to 0.47, silently. Both run whole."""
    ids = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = FrequencyScaled()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend=frontend, example_inputs=(ids,))
    assert_steps_equal_eager(pm, eager, lambda step: ((ids + step) % 10,), lambda ps: torch.optim.AdamW(ps, lr=0.1))
