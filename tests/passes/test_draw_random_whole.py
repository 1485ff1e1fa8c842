"""``draw_random_whole``: the finder, the rewritten code, what stays per device, and the runtime's
exact draws against eager's (``dpcompile/runtime/random.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile import runtime
from dpcompile.analysis.random_ops import random_kind
from passes import draw_random_whole, find_random_sites


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        h = self.drop(torch.relu(self.fc1(x)))
        return self.fc2(F.dropout(h + torch.randn_like(h), 0.2, self.training))


class SampleWithReplacementNet(nn.Module):
    """``torch.multinomial`` with replacement: a uniform per sample, exact; ``torch.poisson``: as many
    draws as each rate needs, exact only where the first piece sees every piece's rates."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        probs = torch.softmax(self.fc(x), -1).detach()
        return torch.multinomial(probs, 3, replacement=True), torch.poisson(probs * 4)


def _program(exact_random=True, **kw):
    torch.manual_seed(0)
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, dpcompile.transform(model, ["cpu"] * 2, exact_random=exact_random, **kw)


def test_random_kind_names_each_random_op():
    """Module and functional dropout, randn_like: kinds; a Linear draws nothing."""
    gm = fx.symbolic_trace(Net())
    kinds = {n.name: random_kind(gm, n) for n in gm.graph.nodes}
    assert kinds["drop"] == "dropout_module"
    assert kinds["dropout"] == "dropout"
    assert kinds["randn_like"] == "like"
    assert kinds["fc1"] is None


def test_find_random_sites_groups_the_devices_of_each_site():
    """On the lowered data-parallel program each site holds its two per-device nodes, in program order."""
    _, pm = _program(exact_random=False)
    sites = find_random_sites(pm)
    assert [(s.source, s.kind, len(s.nodes)) for s in sites] == [
        ("drop", "dropout_module", 2), ("randn_like", "like", 2), ("dropout", "dropout", 2)
    ]


def test_draw_random_whole_code_slices_one_whole_draw():
    """pm.code draws through one record per call and names each device's rows."""
    _, pm = _program()
    code = pm.code
    assert "random_draws = dpcompile_runtime_random_draws(x_scatter, 0)" in code
    assert "dpcompile_runtime_exact_dropout_module(drop_module, random_draws, 'drop', relu_dev1, rows = (1, 0))" in code
    assert "dpcompile_runtime_exact_random_like(random_draws, 'randn_like', 'randn_like', drop_dev0, rows = (0, 0))" in code
    assert code.count("dpcompile_runtime_exact_") == 6


def test_draw_random_whole_again_changes_nothing():
    """A second run finds no random op left: modified=False."""
    _, pm = _program()
    assert not draw_random_whole(pm).modified


def test_exact_random_false_keeps_per_device_draws_and_says_so():
    """exact_random=False: the module calls stay, pm.code and explain say the draws are per device."""
    _, pm = _program(exact_random=False)
    assert "exact_dropout" not in pm.code
    assert pm.code.startswith("# random ops drop, randn_like, dropout draw per device")
    report = dpcompile.explain(pm, torch.randn(6, 8))
    assert report.random["per_device"] == ["drop", "randn_like", "dropout"] and report.random["exact"] == []
    assert "draw per device" in str(report)


def test_an_op_without_exact_rule_draws_per_device_and_is_named():
    """multinomial with replacement and poisson draw exactly on dp; in a pipeline poisson has no exact
    rule (micro-batch 1's rates come after micro-batch 0's draw): a per-device call, named in explain and pm.code."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    pm = dpcompile.transform(SampleWithReplacementNet(), ["cpu"] * 2)
    assert "exact_multinomial" in pm.code and "exact_poisson" in pm.code and "draw per device" not in pm.code, pm.code
    pm = dpcompile.transform(SampleWithReplacementNet(), ["cpu"] * 2, mesh={"pp": 2}, micro_batches=2, example_inputs=(x,))
    assert "torch.poisson(" in pm.code and "exact_poisson" not in pm.code
    assert pm.code.startswith("# random ops poisson draw per device")
    assert dpcompile.explain(pm, x).random["per_device"] == ["poisson"]


def test_channel_dropout_draws_exactly_and_is_not_named():
    """Dropout2d draws its whole channel mask once (runtime.exact_special_dropout_module): nothing per device."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Dropout2d(0.5))
    pm = dpcompile.transform(model, ["cpu"] * 2)
    assert "exact_special_dropout_module(_1_module, random_draws, '_1', 'dropout2d', _0_dev1, rows = (1, 0))" in pm.code, pm.code
    x = torch.randn(4, 3, 6, 6)
    assert dpcompile.explain(pm, x).random == {"exact": ["_1"], "per_device": [], "note": None}
    torch.manual_seed(1)
    got = pm(x)
    torch.manual_seed(1)
    torch.testing.assert_close(got, model(x))


def test_exact_random_eval_mode_matches_eager():
    """In eval mode dropout is the identity and randn_like still draws its whole tensor, as eager."""
    model, pm = _program()
    pm.eval()
    model.eval()
    x = torch.randn(6, 8)
    torch.manual_seed(3)
    with torch.no_grad():
        out = pm(x)
    after = torch.get_rng_state()
    torch.manual_seed(3)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(out, expected)
    assert torch.equal(after, torch.get_rng_state())


@pytest.mark.parametrize("kw", [{}, {"tensor_parallel": True}])
def test_verify_keeps_dropout_on_where_draws_are_exact(kw):
    """verify compares training runs with dropout on, and says so."""
    model, pm = _program(**kw)
    result = dpcompile.verify(pm, model, torch.randn(6, 8))
    assert result, str(result)
    assert any("stayed in training" in n for n in result.notes)


def test_random_kind_names_native_dropout_and_functionalized_fills():
    """``torch.native_dropout`` (the fx spelling) is dropout; ``y.normal_()`` and ``y[:, :2].uniform_()``,
    functionalized into writes, are fills: each a site that draws the single-device values."""
    from passes import functionalize_mutations

    class Fills(nn.Module):
        def forward(self, x):
            y, z = x * 2, x * 3
            y.normal_()
            z[:, :2].uniform_()
            return torch.native_dropout(x, 0.5, True)[0] + y + z

    gm = functionalize_mutations(fx.symbolic_trace(Fills())).graph_module
    kinds = sorted(k for k in (random_kind(gm, n) for n in gm.graph.nodes) if k)
    assert kinds == ["native_dropout", "written_fill", "written_fill"], gm.code


def test_verify_switches_dropout_off_where_draws_are_per_device():
    """exact_random=False: verify compares with dropout modules in eval, as before."""
    model, pm = _program(exact_random=False)
    result = dpcompile.verify(pm, model, torch.randn(6, 8))
    assert any("switched to eval" in n for n in result.notes)


def test_transform_refuses_a_non_bool_exact_random():
    """exact_random= takes True or False."""
    with pytest.raises(ValueError, match="exact_random='yes'"):
        dpcompile.transform(Net(), ["cpu"] * 2, exact_random="yes")


# ------------------------------------------------------------------ the runtime's draws
def _pieces(draws, fn, whole, sizes, dim=0, **kw):
    """``fn`` on each row piece of ``whole`` (split by ``sizes`` along ``dim``), concatenated."""
    parts = whole.split(sizes, dim)
    return torch.cat([fn(draws, "site", part, rows=(k, dim), **kw) for k, part in enumerate(parts)], dim)


@pytest.mark.parametrize("sdpa", [{"is_causal": True}, {}, {"scale": 0.7}])
def test_exact_attention_equals_sdpa_with_dropout(sdpa):
    """The math kernel written out draws and computes exactly what SDPA with dropout_p does on CPU."""
    q, k, v = (torch.randn(3, 2, 5, 4) for _ in range(3))
    torch.manual_seed(1)
    expected = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, **sdpa)
    after = torch.get_rng_state()
    torch.manual_seed(1)
    draws = runtime.random_draws([q[:2], q[2:]], 0)
    got = torch.cat([
        runtime.exact_attention(draws, "a", q[:2], k[:2], v[:2], dropout_p=0.2, rows=(0, 0), **sdpa),
        runtime.exact_attention(draws, "a", q[2:], k[2:], v[2:], dropout_p=0.2, rows=(1, 0), **sdpa),
    ])
    assert torch.equal(got, expected) and torch.equal(torch.get_rng_state(), after)


@pytest.mark.parametrize("op", ["native_dropout", "bernoulli", "normal_", "randint_like", "columns"])
def test_exact_draws_equal_the_whole_draw(op):
    """Each piece is its slice of the whole tensor eager draws, and the generator ends where eager's does."""
    x = torch.rand(5, 6)
    torch.manual_seed(2)
    if op == "native_dropout":
        expected = torch.ops.aten.native_dropout(x, 0.3, True)[0]
    elif op == "bernoulli":
        expected = torch.bernoulli(x)
    elif op == "normal_":
        expected = x.clone().normal_(0.0, 2.0)
    elif op == "randint_like":
        expected = torch.randint_like(x, 0, 7)
    else:
        expected = F.dropout(x, 0.4)
    after = torch.get_rng_state()
    torch.manual_seed(2)
    draws = runtime.random_draws([x[:3], x[3:]], 0)
    if op == "native_dropout":
        got = _pieces(draws, lambda d, s, p, **kw: runtime.exact_native_dropout(d, s, p, 0.3, True, **kw)[0], x, [3, 2])
    elif op == "bernoulli":
        got = _pieces(draws, runtime.exact_bernoulli, x, [3, 2])
    elif op == "normal_":
        got = _pieces(draws, lambda d, s, p, **kw: runtime.exact_fill_random(d, s, "normal_", p.clone(), 0.0, 2.0, **kw), x, [3, 2])
    elif op == "randint_like":
        got = _pieces(draws, lambda d, s, p, **kw: runtime.exact_random_like(d, s, "randint_like", p, 0, 7, **kw), x, [3, 2])
    else:
        parts = [runtime.exact_dropout(draws, "c", part, 0.4, True, cols=(k, -1, (2, 4))) for k, part in enumerate(x.split([2, 4], 1))]
        got = torch.cat(parts, 1)
    assert torch.equal(got, expected) and torch.equal(torch.get_rng_state(), after)


def test_exact_random_program_exports_and_loads(tmp_path):
    """dpcompile.export/load: the loaded program draws the single-device masks too."""
    model, pm = _program()
    dpcompile.export(pm, tmp_path / "out")
    loaded = dpcompile.load(tmp_path / "out")
    x = torch.randn(6, 8)
    torch.manual_seed(4)
    got = loaded(x)
    torch.manual_seed(4)
    torch.testing.assert_close(got, model(x))


def test_channel_dropout_program_exports_and_loads(tmp_path):
    """A Dropout2d program exported and loaded still draws the single-device channel mask."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Dropout2d(0.5))
    dpcompile.export(dpcompile.transform(model, ["cpu"] * 2), tmp_path / "out")
    loaded = dpcompile.load(tmp_path / "out")
    x = torch.randn(4, 3, 6, 6)
    torch.manual_seed(4)
    got = loaded(x)
    torch.manual_seed(4)
    torch.testing.assert_close(got, model(x))


def test_normal_of_a_size_over_ranks_stays_per_device_without_its_rows():
    """Over a mesh a rank's ``torch.normal(0., 1., (x.size(0), 4))`` is sized by its local batch, eager's
    by the global one: unstamped with rows it stays per device (named); in one process it is exact."""

    class Noise(nn.Module):
        def forward(self, x):
            return x + torch.normal(0.0, 1.0, (x.size(0), 4))

    gm = fx.symbolic_trace(Noise())
    assert draw_random_whole(gm).info["exact"] == ["normal"]
    gm = fx.symbolic_trace(Noise())
    assert draw_random_whole(gm, rank_batch=("x", 0, 2)).info["per_device"] == ["normal"]


class LaidOutDraws(nn.Module):
    """Random ops on a transposed and on a channels-last activation: an in-place fill draws in its
    tensor's memory order, ``torch.bernoulli(probs)`` in index order (eager's CPU kernels)."""

    def forward(self, x, img):
        outs = []
        for p in (x.transpose(1, 2), img):  # probabilities: the inputs, so that no op but the draws rounds
            outs += [torch.bernoulli(p), p.clone().bernoulli_(0.4), p.clone().normal_(), F.dropout(p, 0.5), torch.rand_like(p)]
        return tuple(outs)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_random_ops_on_transposed_and_channels_last_inputs_draw_eagers_values(frontend):
    """Data parallel on 2 devices draws, bit for bit, what eager draws from the same seed for every random op
    on a non-contiguous input (``x.clone().bernoulli_(p)`` and ``normal_`` drew in index order before)."""
    model = LaidOutDraws()
    x, img = torch.rand(5, 7, 4), torch.rand(5, 3, 4, 4).to(memory_format=torch.channels_last)
    examples = {"example_inputs": (x, img)} if frontend == "export" else {}
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend=frontend, **examples)
    torch.manual_seed(3)
    expected, after = model(x, img), torch.get_rng_state()
    torch.manual_seed(3)
    got = pm(x, img)
    assert all(torch.equal(a, b) for a, b in zip(got, expected)) and torch.equal(torch.get_rng_state(), after)
