"""Channel and alpha dropouts, torch.normal(mean, std) and torch.multinomial draw the single-device
values in every one-process layout (``exact_random=True``): over 3 SGD steps from the same seed the
loss, the sampled classes, every gradient and ``torch.get_rng_state()`` after each step equal eager's,
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
        grads = full_gradients(pm) if sharded else {k: p.grad for k, p in pm.named_parameters()}
        for key, p in reference.named_parameters():
            torch.testing.assert_close(grads[key], p.grad, msg=lambda m, key=key: f"grad {key}: {m}")
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()


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
