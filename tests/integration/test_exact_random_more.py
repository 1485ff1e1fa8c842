"""Channel and alpha dropouts, torch.normal (tensors; numbers and a size), torch.multinomial (with
and without replacement) and torch.poisson (dp, tp; per device in a pipeline, named by explain) draw
the single-device values in every one-process layout (``exact_random=True``): over 3 SGD steps from
the same seed the loss, the sampled classes, every gradient and ``torch.get_rng_state()`` after each step equal eager's,
on dp, tp, the pipeline (GPipe and 1F1B) and pp x tp; each op also on its own, split unevenly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from tests.helpers import full_gradients
from tests.integration.test_exact_random import LAYOUTS, _devices


class SpecialRandomNet(nn.Module):
    """Dropout2d after a conv, AlphaDropout between a column and a row layer, Dropout1d and
    FeatureAlphaDropout on channels, torch.normal noise around activations, a multinomial sample."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.drop2d = nn.Dropout2d(0.3)
        self.fc1 = nn.Linear(64, 32)
        self.alpha = nn.AlphaDropout(0.2)
        self.fc2 = nn.Linear(32, 24)
        self.drop1d = nn.Dropout1d(0.25)
        self.feature_alpha = nn.FeatureAlphaDropout(0.2)
        self.fc3 = nn.Linear(24, 5)

    def forward(self, x, labels):
        h = self.drop2d(torch.relu(self.conv(x)))
        h = self.fc2(self.alpha(torch.tanh(self.fc1(h.flatten(1)))))
        h = self.feature_alpha(self.drop1d(h.view(-1, 4, 6))).flatten(1)
        h = torch.normal(h, torch.full_like(h, 0.1).detach())
        logits = self.fc3(h)
        samples = torch.multinomial(F.softmax(logits.detach(), -1), 2)
        return F.cross_entropy(logits, labels), samples


def _gradients_equal_then_step(pm, reference, sharded, optimizers):
    """Every gradient of ``pm`` equals the eager reference's; then one step of each optimizer."""
    grads = full_gradients(pm) if sharded else {k: p.grad for k, p in pm.named_parameters()}
    for key, p in reference.named_parameters():
        torch.testing.assert_close(grads[key], p.grad, msg=lambda m, key=key: f"grad {key}: {m}")
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def _inputs(rows: int = 6):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 3, 4, 4, generator=g, dtype=torch.float64), torch.randint(0, 5, (rows,), generator=g)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_exact_random_more_ops_train_like_eager(layout):
    """Each op's values and the generator after each of 3 steps equal eager's, with every gradient."""
    torch.manual_seed(0)
    model = SpecialRandomNet().double().train()
    reference = copy.deepcopy(model)
    x, labels = _inputs()
    options = LAYOUTS[layout]
    pm = dpcompile.transform(model, _devices(options), example_inputs=(x, labels), **options)
    assert dpcompile.explain(pm, x, labels).random["per_device"] == [], pm.code
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    sharded = bool(getattr(pm, "param_shards", None))
    for step in range(3):
        torch.manual_seed(100 + step)
        loss, samples = pm(x, labels)
        loss.backward()
        state = torch.get_rng_state()
        torch.manual_seed(100 + step)
        want, want_samples = reference(x, labels)
        want.backward()
        assert torch.equal(state, torch.get_rng_state()), f"the generator after step {step} is not eager's"
        torch.testing.assert_close(loss, want)
        assert torch.equal(samples, want_samples), (samples, want_samples)
        _gradients_equal_then_step(pm, reference, sharded, (opt, ref_opt))


class FunctionalSpellings(nn.Module):
    """The functional spellings: F.dropout2d, F.alpha_dropout, F.feature_alpha_dropout."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(64, 5)

    def forward(self, x, labels):
        h = F.dropout2d(torch.relu(self.conv(x)), 0.3, self.training)
        h = F.feature_alpha_dropout(F.alpha_dropout(h, 0.2, self.training), 0.25, self.training)
        return F.cross_entropy(self.fc(h.flatten(1)), labels)


@pytest.mark.parametrize("layout", ["dp", "tp", "gpipe"])
def test_exact_random_functional_spellings_match_eager(layout):
    """The functional channel and alpha dropouts run split (dp) and draw exactly: the loss, the gradients
    and the generator are eager's."""
    torch.manual_seed(0)
    model = FunctionalSpellings().double().train()
    reference = copy.deepcopy(model)
    x, labels = _inputs(5)
    options = LAYOUTS[layout]
    pm = dpcompile.transform(model, _devices(options), example_inputs=(x, labels), **options)
    report = dpcompile.explain(pm, x, labels)
    assert report.random["per_device"] == [] and len(report.random["exact"]) == 3, report.random
    if layout == "dp":  # per sample now: they run split, not on the gathered batch
        assert report.whole == [], report.whole
    torch.manual_seed(3)
    loss = pm(x, labels)
    loss.backward()
    state = torch.get_rng_state()
    torch.manual_seed(3)
    want = reference(x, labels)
    want.backward()
    assert torch.equal(state, torch.get_rng_state())
    torch.testing.assert_close(loss, want)
    grads = full_gradients(pm) if getattr(pm, "param_shards", None) else {k: p.grad for k, p in pm.named_parameters()}
    for key, p in reference.named_parameters():
        torch.testing.assert_close(grads[key], p.grad, msg=lambda m, key=key: f"grad {key}: {m}")


class SamplingNet(nn.Module):
    """``torch.poisson`` counts of activations (their number of draws depends on each rate) and
    ``torch.multinomial`` with replacement, several samples per row."""

    def __init__(self, poisson: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 5)
        self.poisson = poisson

    def forward(self, x, labels):
        h = torch.tanh(self.fc1(x))
        rates = torch.exp(h.detach()) * 3
        counts = torch.poisson(rates) if self.poisson else rates
        logits = self.fc2(h + 0.01 * counts)
        samples = torch.multinomial(F.softmax(logits.detach(), -1), 3, replacement=True)
        return F.cross_entropy(logits, labels), samples, counts


class NormalNoiseNet(nn.Module):
    """``torch.normal(mean, std, size)`` with numbers, the size the batch's."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 5)

    def forward(self, x, labels):
        h = torch.tanh(self.fc1(x)) + torch.normal(0.0, 0.1, (x.size(0), 8), dtype=x.dtype)
        return F.cross_entropy(self.fc2(h), labels), h


def _check_draws_like_eager(model, layout, steps=3):
    torch.manual_seed(0)
    model = model.double().train()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, labels = torch.randn(6, 6, generator=g, dtype=torch.float64), torch.randint(0, 5, (6,), generator=g)
    options = LAYOUTS[layout]
    pm = dpcompile.transform(model, _devices(options), example_inputs=(x, labels), **options)
    report = dpcompile.explain(pm, x, labels).random
    assert report["per_device"] == [] and report["exact"], report
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    sharded = bool(getattr(pm, "param_shards", None))
    for step in range(steps):
        torch.manual_seed(100 + step)
        loss, *values = pm(x, labels)
        loss.backward()
        state = torch.get_rng_state()
        torch.manual_seed(100 + step)
        want, *want_values = reference(x, labels)
        want.backward()
        assert torch.equal(state, torch.get_rng_state()), f"the generator after step {step} is not eager's"
        for got, expected in zip(values, want_values):
            torch.testing.assert_close(got, expected)  # samples and counts: exactly (integers, whole numbers)
        torch.testing.assert_close(loss, want)
        _gradients_equal_then_step(pm, reference, sharded, (opt, ref_opt))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_exact_poisson_and_multinomial_with_replacement_train_like_eager(layout):
    """Multinomial samples with replacement are eager's, and so is the generator after each of 3 steps,
    in every one-process layout; Poisson counts too on dp and tp (split by rows, by columns)."""
    _check_draws_like_eager(SamplingNet(poisson=layout in ("dp", "tp")), layout)


@pytest.mark.parametrize("layout", ["gpipe", "1f1b"])
def test_poisson_in_a_pipeline_draws_per_device_and_explain_names_it(layout):
    """A micro-batch's Poisson draws depend on its rates, unknown to the first micro-batch: the site
    keeps per-device draws, and ``explain`` and ``pm.code`` say so."""
    model = SamplingNet().double()
    x, labels = torch.randn(6, 6, dtype=torch.float64), torch.randint(0, 5, (6,))
    options = LAYOUTS[layout]
    pm = dpcompile.transform(model, _devices(options), example_inputs=(x, labels), **options)
    report = dpcompile.explain(pm, x, labels).random
    assert report["per_device"] == ["poisson"] and report["exact"] == ["multinomial"], report
    assert "random ops poisson draw per device" in pm.code


@pytest.mark.parametrize("layout", ["dp", "tp", "gpipe"])
def test_exact_normal_with_numbers_and_size_trains_like_eager(layout):
    """``torch.normal(0.0, 0.1, (batch, 8))``: the noise and the generator are eager's. (1F1B refuses
    this model with or without exact draws: a factory of the batch's size has no batch rule.)"""
    _check_draws_like_eager(NormalNoiseNet(), layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(7, 300), (5,), (3, 4)])
def test_exact_multinomial_with_replacement_is_the_cpu_kernel(shape, dtype):
    """The runtime rule on its own, split in two by rows: each piece's samples are eager's slice and the
    generator ends where eager's does (float32 sums row by row in float32, as the kernel)."""
    from dpcompile.runtime import exact_multinomial, random_draws

    probs = torch.rand(shape, generator=torch.Generator().manual_seed(3), dtype=dtype) ** 3
    torch.manual_seed(9)
    want = torch.multinomial(probs, 6, replacement=True)
    state = torch.get_rng_state()
    torch.manual_seed(9)
    if len(shape) == 1:
        got = exact_multinomial(random_draws(), "s", probs, 6, True)
    else:
        half = (shape[0] + 1) // 2  # uneven: 4 and 3 rows, 2 and 1
        pieces = probs[:half], probs[half:]
        draws = random_draws(pieces, 0)
        got = torch.cat([exact_multinomial(draws, "s", p, 6, True, rows=(k, 0)) for k, p in enumerate(pieces)])
    assert torch.equal(got, want) and torch.equal(state, torch.get_rng_state())



class DepthDropped(nn.Module):
    """torchvision's stochastic depth (ConvNeXt's, EfficientNet's) on residual blocks, per row and per batch."""

    def __init__(self):
        super().__init__()
        from tests.thirdparty import import_torchvision

        ops = import_torchvision().ops
        self.fcs = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.drops = nn.ModuleList([ops.StochasticDepth(0.5, "row"), ops.StochasticDepth(0.5, "row"), ops.StochasticDepth(0.5, "batch")])

    def forward(self, x):
        for fc, drop in zip(self.fcs, self.drops):
            x = x + drop(torch.tanh(fc(x)))
        return x.pow(2).mean()


@pytest.mark.parametrize("layout", [{"pipeline": 2, "micro_batches": 3}, {"mesh": {"pp": 2, "dp": 2}, "micro_batches": 2}],
                         ids=["gpipe", "pp_dp"])  # fmt: skip
def test_stochastic_depth_in_a_pipeline_drops_what_eager_drops(layout):
    """Each row's keep-or-drop is the single-device draw (a pipeline drew per micro-batch, in its own
    order: other rows dropped, silently), and so is every gradient."""
    torch.manual_seed(0)
    reference = DepthDropped().double()
    model = copy.deepcopy(reference)
    devices = ["cpu"] * (4 if "mesh" in layout else 2)
    pm = dpcompile.transform(model, devices, **layout)
    assert "exact_stochastic_depth" in pm.code
    x = torch.randn(7, 8, dtype=torch.float64)
    for seed in (1, 2):
        torch.manual_seed(seed)
        loss = pm(x)
        torch.manual_seed(seed)
        expected = reference(x)
        torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


class TransposedDropoutNet(nn.Module):
    """Dropout on values laid out in another memory order than their shape's: ``batch_first``
    attention's output ((T, B, E) memory, as torchvision's ViT drops it), a permuted conv activation
    and a channels-last one. Eager's mask is drawn in that memory order. The attention drops too,
    inside the module's call (written out, so micro-batches and recompute draw its slices)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 1)
        self.attn = nn.MultiheadAttention(8, 2, dropout=0.3, batch_first=True)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.conv(x)
        tokens = h.permute(0, 2, 3, 1).flatten(1, 2)  # (B, 16, 8): a copy, contiguous
        a = self.drop(self.attn(tokens, tokens, tokens, need_weights=False)[0])
        return a.sum(1) + self.drop(h.permute(0, 2, 3, 1)).sum((1, 2)) + self.drop(h.contiguous(memory_format=torch.channels_last)).sum((2, 3))


ONE_ROW_PIECES = {"dp3": {"mesh": {"dp": 3}}, "recompute": {"mesh": {"dp": 2}, "activation_checkpointing": ["attn"]}}


@pytest.mark.parametrize("layout, rows", [("dp", 4), ("dp3", 3), ("tp", 4), ("gpipe", 4), ("recompute", 4)])
def test_exact_dropout_draws_in_the_memory_order_of_its_input(layout, rows):
    """The output and every gradient equal eager's, one-row pieces (3 rows on 3 devices) too."""
    torch.manual_seed(0)
    model = TransposedDropoutNet().double().train()
    reference = copy.deepcopy(model)
    x = _inputs(rows)[0]
    options = ONE_ROW_PIECES.get(layout) or LAYOUTS[layout]
    pm = dpcompile.transform(model, _devices(options), example_inputs=(x,), **options)
    torch.manual_seed(5)
    out = pm(x)
    torch.manual_seed(5)
    want = reference(x)
    torch.testing.assert_close(out, want)
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    grads = full_gradients(pm) if getattr(pm, "param_shards", None) else {k: p.grad for k, p in pm.named_parameters()}
    for key, p in reference.named_parameters():
        torch.testing.assert_close(grads[key], p.grad, msg=lambda m, key=key: f"grad {key}: {m}")


class MaskedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, dropout=0.3, batch_first=True)

    def forward(self, x, mask):
        return self.attn(x, x, x, key_padding_mask=mask, need_weights=False)[0]


def test_attention_dropping_inside_its_call_is_refused_in_a_pipeline():
    """An nn.MultiheadAttention that cannot be written out (a mask) draws inside its call: micro-batches
    would draw other values than eager, so the pipeline is refused by name; exact_random=False builds."""
    x, mask = torch.randn(4, 5, 8), torch.zeros(4, 5, dtype=torch.bool)
    with pytest.raises(dpcompile.DpCompileError, match=r"'attn' \(nn.MultiheadAttention, dropout=0.3\).*exact_random=False"):
        dpcompile.transform(MaskedAttention(), ["cpu"] * 2, pipeline=2, micro_batches=2, example_inputs=(x, mask))
    pm = dpcompile.transform(MaskedAttention(), ["cpu"] * 2, pipeline=2, micro_batches=2, example_inputs=(x, mask),
                             exact_random=False)  # fmt: skip
    assert pm(x, mask).shape == (4, 5, 8)


class MaskedEncoderDecoder(nn.Module):
    """Pegasus' shape, reduced: the encoder's attention mask indexed by an arange of the batch (as
    transformers builds it), so a pipeline's first micro-batch waits for every micro-batch's size
    there, while the decoder's embedding dropout and layer, which do not need the encoder, could run."""

    def __init__(self):
        super().__init__()
        self.enc_emb, self.dec_emb = nn.Embedding(16, 8), nn.Embedding(16, 8)
        self.enc_drop, self.enc, self.enc_drop2 = nn.Dropout(0.3), nn.Linear(8, 8), nn.Dropout(0.3)
        self.dec_drop, self.dec, self.out = nn.Dropout(0.3), nn.Linear(8, 8), nn.Linear(8, 16)

    def forward(self, ids, dec_ids, mask):
        h = self.enc_drop(self.enc_emb(ids))
        rows, cols = torch.arange(ids.shape[0])[:, None], torch.arange(ids.shape[1])[None, :]
        m = mask.to(torch.bool)[rows, cols][:, None, None, :]
        h = F.scaled_dot_product_attention(h[:, None], h[:, None], h[:, None], attn_mask=m)[:, 0]
        h = self.enc_drop2(self.enc(h))
        d = self.dec_drop(self.dec_emb(dec_ids))
        return self.out(self.dec(d) + h.mean(1, keepdim=True))


@pytest.mark.parametrize("layout", ["gpipe", "dp_tp"])
def test_a_later_site_with_its_users_draws_after_the_earlier_sites(layout):
    """The decoder's dropout draws after the encoder's, as eager draws them, though the lowered program
    ran its piece and the decoder layer using it first (they moved with it; a GPipe Pegasus with a
    padding mask drew the decoder's embedding dropout second: every value differed from eager's)."""
    torch.manual_seed(0)
    model = MaskedEncoderDecoder().double()
    mask = torch.ones(4, 5, dtype=torch.long)
    mask[1, -2:] = 0
    kw = {"ids": torch.randint(0, 16, (4, 5)), "dec_ids": torch.randint(0, 16, (4, 3)), "mask": mask}
    eager = copy.deepcopy(model)
    options = {"gpipe": {"pipeline": 2, "micro_batches": 2}, "dp_tp": {"mesh": {"dp": 2, "tp": 2}}}[layout]
    devices = ["cpu"] * (4 if layout == "dp_tp" else 2)
    pm = dpcompile.transform(model, devices, example_kwargs=kw, frontend="export", **options)
    torch.manual_seed(1)
    got = pm(**kw)
    torch.manual_seed(1)
    want = eager(**kw)
    torch.testing.assert_close(got, want)
    got.square().mean().backward()
    want.square().mean().backward()
    sharded = getattr(pm, "param_shards", None)
    grads = full_gradients(pm) if sharded else {name: p.grad for name, p in model.named_parameters()}
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


class _OptionalMaskThenDropout(nn.Module):
    """An optional input before the one that carries the batch (timm's ViT: ``forward(x, attn_mask=None)``)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(0.5)

    def forward(self, x, mask=None):
        if mask is not None:
            x = x * mask
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def test_exact_dropout_over_dp_tp_takes_the_rows_of_the_required_input():
    """mesh={"dp": 2, "tp": 2}: the dp copies scatter each input moved onto its device; the draws took
    their rows from the first scatter, the optional mask's (None), and every dropout failed ("needs the
    batch's split"). They are the required x's: the single-device draws, gradients and all."""
    torch.manual_seed(0)
    model = _OptionalMaskThenDropout().double()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 4, mesh={"dp": 2, "tp": 2})
    torch.manual_seed(1)
    out = pm(x)
    torch.manual_seed(1)
    expected = reference(x)
    torch.testing.assert_close(out, expected)
    (out * out).sum().backward()
    (expected * expected).sum().backward()
    grads = full_gradients(pm)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


class StackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(4, 6, num_layers=2, batch_first=True, dropout=0.3)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def test_rnn_dropout_between_layers_draws_per_device_and_explain_names_it():
    """A stacked RNN's ``dropout`` draws inside its kernel, where no exact rule reaches: each replica drew its
    own rows' mask, unlike eager's, and nothing said so (the program claimed exact draws). It is named as
    drawing per device, in ``explain`` and atop ``pm.code``; in eval it is eager's."""
    torch.manual_seed(0)
    model = StackedLSTM().double()
    x = torch.randn(6, 5, 4, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    assert dpcompile.explain(pm, x).random["per_device"] == ["rnn"]
    assert pm.code.startswith("# random ops rnn draw per device")
    model.eval()
    torch.testing.assert_close(pm(x), copy.deepcopy(model)(x))
