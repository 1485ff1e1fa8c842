"""The sharding analysis: finding Linear layers, splitting sizes, layouts and the ops shards pass through."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpcompile.analysis.sharding import (
    REPLICATED,
    Sharded,
    aligned_split,
    analyze_sharding,
    check_divisible,
    check_plan,
    embedding_paths,
    find_linear_sites,
    is_shard_transparent,
    linear_paths,
    resolve_plan,
)
from dpcompile.analysis.sharding_rules import NeedsWhole, apply_rule
from tests.helpers import captured
from tests.models import MLP, Attention, NormAfterColumn, Shared, Tied


# ---------------------------------------------------------------------- finders
def test_find_linear_sites_reports_features_and_bias():
    """Each called Linear is found by path with its in/out features and bias."""
    sites = find_linear_sites(captured(MLP(8, 16, 4)))
    assert [(p, s.in_features, s.out_features, s.bias, s.blocker) for p, s in sites.items()] == [
        ("fc1", 8, 16, True, None),
        ("fc2", 16, 4, True, None),
    ]


def test_find_linear_sites_finds_a_root_linear_as_empty_path():
    """A model that is itself an nn.Linear traces to F.linear; its site path is ''."""
    sites = find_linear_sites(captured(nn.Linear(6, 3)))
    assert list(sites) == [""] and sites[""].out_features == 3


def test_find_linear_sites_blocks_a_shared_layer():
    """A Linear called twice gets a blocker saying so."""
    assert "called 2 times" in find_linear_sites(captured(Shared()))["fc"].blocker


def test_find_linear_sites_blocks_tied_weights():
    """A Linear whose weight is also read directly gets a blocker."""
    assert "tied" in find_linear_sites(captured(Tied()))["fc"].blocker


def test_aligned_split_balances_uneven_and_respects_granularity():
    """10 over 3 is (4, 3, 3); 12 over 2 in whole 4s is (8, 4); too few units raise."""
    assert aligned_split(10, 3) == (4, 3, 3)
    assert aligned_split(12, 2, 4) == (8, 4)
    with pytest.raises(ValueError, match="12 cannot be split into 4 shards of whole 4s"):
        aligned_split(12, 4, 4)


# ---------------------------------------------------------------------- analysis
def test_analyze_sharding_pairs_column_with_row_without_gathers():
    """An MLP planned column→row needs only f on the input and g after the row layer."""
    gm = captured(MLP(), torch.randn(4, 8))
    analysis = analyze_sharding(gm, styles={"fc1": "column", "fc2": "row"}, n=2)
    assert [(c.kind, c.backward) for c in analysis.comms] == [("identity", "all_reduce"), ("all_reduce", None)]
    assert analysis.pairs == {"fc2": frozenset({"fc1"})}
    assert analysis.row_sizes["fc2"] == analysis.column_sizes["fc1"] == (8, 8)


def test_analyze_sharding_gathers_before_layer_norm():
    """A LayerNorm needs the whole feature dim, so a column output is all-gathered before it."""
    gm = captured(NormAfterColumn(), torch.randn(4, 8))
    analysis = analyze_sharding(gm, styles={"fc1": "column", "fc2": "row"}, n=2)
    kinds = [c.kind for c in analysis.comms]
    assert "all_gather" in kinds and "split" in kinds
    assert "norm" in analysis.gathered["fc1"][0]


def test_is_shard_transparent_accepts_elementwise_and_rejects_norm():
    """relu is transparent, LayerNorm is not."""
    gm = captured(NormAfterColumn())
    modules = dict(gm.named_modules())
    by_name = {n.name: n for n in gm.graph.nodes}
    assert not is_shard_transparent(by_name["norm"], modules)
    assert is_shard_transparent(next(n for n in captured(MLP()).graph.nodes if n.name == "relu"), {})


# ---------------------------------------------------------------------- plans
def test_linear_paths_lists_every_linear_of_a_model():
    """Every nn.Linear by module path, called in forward or not."""
    assert linear_paths(NormAfterColumn()) == ["fc1", "fc2"]


def test_check_plan_rejects_a_module_that_is_not_a_linear():
    """Naming a LayerNorm is a ValueError listing the Linear layers."""
    with pytest.raises(ValueError, match="'norm', a LayerNorm, not an nn.Linear; its nn.Linear layers are: 'fc1', 'fc2'"):
        check_plan(NormAfterColumn(), {"norm": "column"})


def test_check_divisible_shows_the_arithmetic():
    """A row split needs at least one input feature per device; the reason says so with numbers."""
    site = find_linear_sites(captured(MLP(8, 16, 4)))["fc1"]
    assert check_divisible(site, "column", 16) is None
    assert check_divisible(site, "row", 16) == "in_features(8) of 'fc1' cannot be split over 16 devices"


def test_resolve_plan_keeps_a_too_narrow_layer_whole_when_not_strict():
    """strict=False keeps a layer that cannot split whole, with the arithmetic as the reason."""
    gm = captured(MLP(8, 4), torch.randn(2, 8))
    resolved = resolve_plan(gm, plan={"fc1": "column"}, n=8, strict=False)
    assert resolved.styles["fc1"] == "replicate"
    assert resolved.reasons["fc1"] == "out_features(4) of 'fc1' cannot be split over 8 devices"
    with pytest.raises(ValueError, match="cannot be split over 8 devices"):
        resolve_plan(gm, plan={"fc1": "column"}, n=8)


def test_resolve_plan_aligns_heads_to_whole_heads():
    """3 heads of 4 features over 2 devices: the column layers split at multiples of 4."""
    gm = captured(Attention(12, 3), torch.randn(2, 5, 12))
    resolved = resolve_plan(gm, plan={"q": "column", "k": "column", "v": "column", "out": "row"}, n=2)
    assert resolved.granularity == {"q": 4, "k": 4, "v": 4}
    assert resolved.analysis.column_sizes["q"] == (8, 4) and not resolved.analysis.problems


# ---------------------------------------------------------------------- layouts
def test_analyze_sharding_lays_out_every_value():
    """fc1's output is sharded on the last dim, relu keeps it, fc2's (row) output is replicated."""
    gm = captured(MLP(), torch.randn(4, 8))
    layouts = {n.name: layout for n, layout in analyze_sharding(gm, styles={"fc1": "column", "fc2": "row"}, n=2).layouts.items()}
    assert layouts["fc1"] == layouts["relu"] == Sharded(-1, (8, 8), frozenset({"fc1"}))
    assert layouts["x"] == layouts["fc2"] == REPLICATED


def test_sharding_rule_says_why_an_op_needs_the_whole_tensor():
    """A sum over the sharded dim has no sharding rule, and its batch rule makes a partial sum per
    shard: apply_rule raises NeedsWhole with that reason."""

    class SumAfterColumn(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 6)

        def forward(self, x):
            return self.fc(x).sum(-1)

    gm = captured(SumAfterColumn(), torch.randn(2, 4))
    analysis = analyze_sharding(gm, styles={"fc": "column"}, n=2)
    assert analysis.gathered == {"fc": ["sum_1 (sum)"]}
    node = next(n for n in gm.graph.nodes if n.name == "sum_1")

    class Layouts:
        def layout(self, value):
            return analysis.layouts.get(value, REPLICATED)

        def rewrite_view(self, node, position, sizes):  # pragma: no cover - views only
            raise AssertionError

    with pytest.raises(NeedsWhole, match=r"reduces over the sharded dim \(a partial sum per shard\)"):
        apply_rule(Layouts(), node, dict(gm.named_modules()))


# ---------------------------------------------------------------------- transformers' layers
def test_find_linear_sites_finds_conv1d_with_its_transposed_weight():
    """transformers' Conv1D (kept as a call) is a site with in/out read from its (in, out) weight."""
    from dpcompile.analysis.sharding import linear_like_leaves
    from dpcompile.capture import capture
    from tests.thirdparty_tp import GPT2MLP

    gm = capture(GPT2MLP(8), leaf_modules=linear_like_leaves())
    sites = find_linear_sites(gm)
    assert [(p, s.in_features, s.out_features, s.transposed) for p, s in sites.items()] == [
        ("c_fc", 8, 32, True),
        ("c_proj", 32, 8, True),
    ]


def test_find_linear_sites_ties_an_embedding_to_its_lm_head():
    """An LM head sharing the embedding's weight is tied to it (not blocked); both are sites."""
    from tests.thirdparty_tp import TinyGPT2

    sites = find_linear_sites(captured(TinyGPT2(layers=1), torch.randint(0, 128, (2, 4))))
    assert sites["lm_head"].tied_to == "wte" and sites["wte"].tied_to == "lm_head"
    assert sites["wte"].kind == "embedding" and sites["wte"].blocker is None
    assert check_divisible(sites["lm_head"], "row", 2) is not None  # a row split would untie them


def test_resolve_plan_shards_a_fused_qkv_per_section():
    """A fused qkv output split in three asks its layer to be sharded as 3 sections, each split."""
    from tests.thirdparty_tp import FusedChunkAttention

    gm = captured(FusedChunkAttention(d=8, heads=2), torch.randn(2, 3, 8))
    resolved = resolve_plan(gm, plan={"qkv": "column", "out": "row"}, n=2)
    assert resolved.styles == {"qkv": "column", "out": "row"}
    assert resolved.sections == {"qkv": 3} and resolved.analysis.column_sizes["qkv"] == (12, 12)
    assert not any(k == "gather" for k in resolved.analysis.needs.values())


def test_resolve_plan_given_the_layers_found_once_equals_finding_them():
    """``choose_plan`` resolves hundreds of trial plans of one graph with its layers found once
    (``sites=``, ``layer_paths=``): each resolution equals the one that finds them itself (styles,
    reasons, granularity, sections, needs, collectives), over 2 and 4 shards, tied and fused layers."""
    from dpcompile.planning import choose_plan
    from tests.thirdparty_tp import FusedChunkAttention, TinyGPT2

    for gm in (captured(TinyGPT2(layers=1), torch.randint(0, 128, (2, 4))),
               captured(FusedChunkAttention(d=8, heads=2), torch.randn(2, 3, 8))):  # fmt: skip
        sites = find_linear_sites(gm)
        layer_paths = [*linear_paths(gm), *embedding_paths(gm)]
        linears = [p for p, site in sites.items() if site.kind == "linear"]
        plans = [{p: style for p in linears} for style in ("column", "row")]
        plans += [{p: ("column", "row")[i % 2] for i, p in enumerate(linears)}, choose_plan(gm, 2)[0]]
        for plan in plans:
            for n in (2, 4):
                given = resolve_plan(gm, plan=plan, n=n, strict=False, sites=sites, layer_paths=layer_paths)
                found = resolve_plan(gm, plan=plan, n=n, strict=False)
                assert (given.styles, given.reasons, given.granularity, given.sections) == (
                    found.styles, found.reasons, found.granularity, found.sections)  # fmt: skip
                assert given.analysis.needs == found.analysis.needs and given.analysis.comms == found.analysis.comms
        assert sites.keys() == find_linear_sites(gm).keys() and len(plans[-1]) > 0


# ---------------------------------------------------------------------- rotary embeddings, GQA, casts
class _HeadsThen(nn.Module):
    """A column layer's output as (batch, heads, tokens, head_dim), sharded by heads, then ``op``."""

    def __init__(self, op):
        super().__init__()
        self.fc, self.op = nn.Linear(8, 8), op

    def forward(self, x):
        return self.op(self.fc(x).view(2, 3, 2, 4).transpose(1, 2))


@pytest.mark.parametrize(
    "op, layout",
    [
        (lambda y: y.unsqueeze(2), (-4, (1, 1))),
        (lambda y: y.unsqueeze(0), (-3, (1, 1))),
        (lambda y: y.unsqueeze(-1), (-4, (1, 1))),
        (lambda y: y[..., :2], (-3, (1, 1))),
        (lambda y: y[:, None], (-3, (1, 1))),
        (lambda y: y[:, :, 0], (-2, (1, 1))),
        (lambda y: torch.cat([-y[..., 2:], y[..., :2]], dim=-1), (-3, (1, 1))),
        (lambda y: y.repeat_interleave(2, dim=1), (-3, (2, 2))),
        (lambda y: y[:, :, None].expand(2, 2, 3, 3, 4), (-4, (1, 1))),
        (lambda y: y.to(torch.float64).type_as(y).contiguous().clone().detach(), (-3, (1, 1))),
        (lambda y: y[:, 0], None),  # indexes the sharded heads dim
        (lambda y: y[:, :1], None),  # slices it
        (lambda y: torch.cat([y, y], dim=1), None),  # concatenates along it
        (lambda y: y.to("cpu"), None),  # a move, not a cast
    ],
)
def test_shape_ops_and_casts_keep_a_head_sharded_value_sharded(op, layout):
    """Rotary embeddings (slices, cat, unsqueeze), GQA (expand, repeat_interleave) and casts keep
    the heads sharded, with the sharded dim where it moved; on the heads dim they need the whole value."""
    gm = captured(_HeadsThen(op), torch.randn(2, 3, 8))
    analysis = analyze_sharding(gm, styles={"fc": "column"}, n=2)
    last = list(gm.graph.nodes)[-2]
    got = analysis.layouts.get(last, REPLICATED)
    if layout is None:
        assert got == REPLICATED and any(c.kind == "all_gather" for c in analysis.comms)
    else:
        assert isinstance(got, Sharded) and (got.dim, got.sizes) == layout


class _TiedReadingEmbedding(nn.Module):
    """An LM head tied to an embedding whose weight forward also reads (its dtype): the embedding stays
    whole, so the head must too (a column head would own shards of its own: the tie broken)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)).to(self.embed.weight.dtype))


def test_a_head_tied_to_a_blocked_embedding_stays_whole_and_trains_like_eager():
    """Before, the head was split by columns beside the whole embedding: two parameters where the model
    has one, and the second AdamW step differed from eager."""
    import copy

    import dpcompile
    from tests.helpers import assert_steps_equal_eager

    torch.manual_seed(0)
    model = _TiedReadingEmbedding().double()
    eager = copy.deepcopy(model)
    ids = torch.randint(0, 16, (3, 4))
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(ids,))
    assert pm.plan == {"embed": "replicate", "head": "replicate"}, pm.plan_reasons
    assert "tied to the embedding 'embed'" in pm.plan_reasons["head"]
    assert_steps_equal_eager(pm, eager, lambda step: ((ids + step) % 16,), lambda ps: torch.optim.AdamW(ps, lr=1e-2))
