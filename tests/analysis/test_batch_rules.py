"""Batch rules, per op family: the placement a rule gives a tiny traced graph; the rule registry."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile.analysis.batch_dims import propagate
from dpcompile.analysis.batch_rules import BATCH_RULES, BatchRuleRegistry, RuleContext, rule_for
from dpcompile.analysis.batch_rules.modules import per_sample_dim0
from dpcompile.analysis.batch_rules.pointwise import pointwise
from dpcompile.analysis.placement import REPLICATED, BatchSize, Partial, Placement, Split, Tuple, Whole
from tests.helpers import captured, check_against_eager
from tests.models import CellLoop


class Fn(nn.Module):
    """A module whose forward is ``fn``: a graph of torch calls to read placements from."""

    def __init__(self, fn: Callable[..., Any], **attrs: nn.Module | torch.Tensor):
        super().__init__()
        self.fn = fn
        for name, attr in attrs.items():
            if isinstance(attr, nn.Module):
                self.add_module(name, attr)
            else:
                self.register_parameter(name, nn.Parameter(attr))

    def forward(self, x):
        return self.fn(self, x)


class Fn2(Fn):
    """``Fn`` of two inputs (a loss's input and target)."""

    def forward(self, x, t):
        return self.fn(self, x, t)


def placements(fn: Callable[..., Any], *inputs: Any, dims: dict[str, int | None] | None = None, **attrs: Any) -> dict[str, Placement]:
    """``{node name: placement}`` of ``fn``'s graph (``attrs``: its layers and parameters), shapes
    propagated, every input split on dim 0 unless ``dims`` says otherwise."""
    gm = captured((Fn2 if len(inputs) == 2 else Fn)(fn, **attrs), *inputs)
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    input_dims = {name: 0 for name in names} if dims is None else dims
    return {n.name: p for n, p in propagate(gm, input_dims).items()}


def result(fn: Callable[..., Any], *inputs: Any, **kwargs: Any) -> Placement:
    """The placement of the node ``fn`` returns (the last one computed)."""
    return list(placements(fn, *inputs, **kwargs).values())[-1]


X = torch.randn(4, 3, 6)
WHOLE = Whole(batch=True)


# ---------------------------------------------------------------------- pointwise
def test_pointwise_keeps_the_split_and_its_origin():
    """relu of an input split on dim 0 is split on dim 0, still traced to that input."""
    assert result(lambda m, x: torch.relu(x), X) == Split(0, origin="x")


def test_pointwise_broadcasts_a_replicated_operand():
    """x + b with b of shape (6,) stays split: b is the same for every sample."""
    assert result(lambda m, x: x + m.b, X, b=torch.randn(6)) == Split(0, origin="x")


def test_pointwise_runs_whole_when_a_replicated_operand_lines_up_with_the_batch():
    """x + w with w of the batch's own shape mixes samples with rows of w: it runs whole."""
    assert result(lambda m, x: x + m.b, X, b=torch.randn(4, 3, 6)) == WHOLE


def test_pointwise_method_to_dtype_stays_split_but_to_device_runs_whole():
    """x.to(float64) is element-wise; x.to('cpu') would move a chunk off its device."""
    assert isinstance(result(lambda m, x: x.to(torch.float64), X), Split)
    assert result(lambda m, x: x.to("cpu"), X) == WHOLE


# ---------------------------------------------------------------------- shape ops
@pytest.mark.parametrize(
    "fn, want",
    [
        (lambda m, x: x.view(-1, 18), Split(0)),
        (lambda m, x: x.reshape(x.size(0), -1), Split(0, origin="x")),
        (lambda m, x: x.permute(1, 0, 2), Split(1)),
        (lambda m, x: x.transpose(0, 2), Split(2)),
        (lambda m, x: x.unsqueeze(0), Split(1)),
        (lambda m, x: x.squeeze(0), WHOLE),
        (lambda m, x: x.flatten(1), Split(0, origin="x")),
        (lambda m, x: torch.cat([x, x], dim=2), Split(0)),
        (lambda m, x: torch.cat([x, x], dim=0), WHOLE),
        (lambda m, x: torch.stack([x, x], dim=0), Split(1)),
        (lambda m, x: x[:, :1].expand(-1, 2, 6), Split(0)),
        (lambda m, x: torch.zeros(x.size(0), 5), Split(0)),
    ],
    ids=["view", "reshape_size", "permute", "transpose", "unsqueeze", "squeeze_batch", "flatten", "cat", "cat_batch",
         "stack", "expand", "zeros_of_batch"],
)  # fmt: skip
def test_shape_rules_move_or_keep_the_batch_dim(fn, want):
    """Each view or shape op puts the batch where it lands, or runs whole where it is mixed."""
    assert result(fn, X) == want


def test_shape_chunk_along_a_feature_dim_gives_split_pieces():
    """x.chunk(2, dim=2) gives pieces split like x."""
    got = placements(lambda m, x: x.chunk(2, dim=2)[1], X)
    assert isinstance(got["chunk"], Tuple) and got["getitem"] == Split(0)


def test_shape_size_of_the_batch_dim_is_a_batch_size():
    """x.size(0) is the chunk's batch size; x.size(1) is the same on every device."""
    got = placements(lambda m, x: (x.size(0), x.size(1)), X)
    assert got["size"] == BatchSize() and got["size_1"] == REPLICATED


def test_shape_rank_of_a_chunk_is_the_whole_tensors():
    """x.dim() and x.ndimension() are the same on every device, as x.ndim is (they ran whole: a
    gather of the batch for torchvision's ``torch._assert(x.dim() == 3, ...)``)."""
    got = placements(lambda m, x: (x.dim() == 3, x.ndimension()), X)
    assert got["dim"] == REPLICATED and got["ndimension"] == REPLICATED and got["eq"] == REPLICATED


def _drop_path(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm's ``drop_path``: one keep-or-drop draw per sample, its mask shape joined with ``+``."""
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    return x * x.new_empty(shape).bernoulli_(0.5).div_(0.5)


@pytest.mark.parametrize(
    "fn, want",
    [
        (lambda m, x: (x.shape[0],) + (1,) * (x.ndim - 1), BatchSize(shape_of_dim=0)),
        (lambda m, x: (2,) + x.shape, BatchSize(shape_of_dim=1)),
        (lambda m, x: x.shape[:1] + (1,) * (x.ndim - 1), BatchSize(shape_of_dim=0)),
        (lambda m, x: (x.shape[0],) + x.shape, None),
        (lambda m, x: x.new_zeros((x.shape[0],) + (1,) * (x.ndim - 1)), Split(0)),
    ],
    ids=["literal_left", "literal_right", "shape_left", "two_batch_sizes", "new_zeros_of_joined"],
)  # fmt: skip
def test_shapes_joined_with_plus_keep_the_batch_size_where_it_sits(fn, want):
    """``(x.shape[0],) + (1,) * (x.ndim - 1)`` (timm's drop_path mask) holds the batch size at 0; a
    shape holding it twice is no batch shape (runs whole)."""
    got = result(fn, X)
    assert got == want if want is not None else not isinstance(got, (BatchSize, Split))


def test_timm_drop_path_runs_split_with_the_single_device_draws():
    """A drop-path block on 3 devices, odd batch: nothing runs whole, and outputs and gradients are
    the single-device values drawn from the same seed."""
    torch.manual_seed(0)
    model = Fn(lambda m, x: m.out(x + _drop_path(m, m.fc(x))), fc=nn.Linear(6, 6), out=nn.Linear(6, 2))
    reference, x = copy.deepcopy(model), torch.randn(5, 3, 6)
    pm = dpcompile.transform(model, ["cpu"] * 3, example_inputs=(x,))
    assert dpcompile.explain(pm, x).whole == []
    for seed in (1, 2):
        torch.manual_seed(seed)
        got = pm(x)
        torch.manual_seed(seed)
        want = reference(x)
        torch.testing.assert_close(got, want)
        got.square().sum().backward()
        want.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda msg, n=name: f"grad {n}: {msg}")


# ---------------------------------------------------------------------- indexing
@pytest.mark.parametrize(
    "fn, want",
    [
        (lambda m, x: x[:, 0], Split(0)),
        (lambda m, x: x[0], WHOLE),
        (lambda m, x: x[:, None], Split(0)),
        (lambda m, x: x.shape, BatchSize(shape_of_dim=0)),
        (lambda m, x: x.shape[1], REPLICATED),
        (lambda m, x: x.dtype, REPLICATED),
    ],
    ids=["feature", "sample", "new_axis", "shape", "shape_1", "dtype"],
)
def test_indexing_rules_follow_the_batch(fn, want):
    """Indexing a feature keeps the split; indexing a sample needs the whole batch; metadata is replicated."""
    assert result(fn, X) == want


def test_indexing_an_input_container_keeps_its_split():
    """An element of a dict input is split as the dict is."""
    assert result(lambda m, d: d["a"] * 2, {"a": X}) == Split(0, origin="x")


# ---------------------------------------------------------------------- reductions and losses
@pytest.mark.parametrize(
    "fn, want",
    [
        (lambda m, x: x.sum(), Partial("sum")),
        (lambda m, x: x.mean(dim=0), Partial("mean")),
        (lambda m, x: x.sum(dim=2), Split(0)),
        (lambda m, x: x.amax(dim=0), WHOLE),
        (lambda m, x: x.softmax(dim=-1), Split(0, origin="x")),
        (lambda m, x: x.softmax(dim=0), WHOLE),
        (lambda m, x: torch.cumsum(x, dim=1), Split(0, origin="x")),
    ],
    ids=["sum", "mean_batch", "sum_features", "amax_batch", "softmax", "softmax_batch", "cumsum"],
)
def test_reduction_rules_make_partials_over_the_batch(fn, want):
    """sum/mean over the batch become partial results; other reductions and softmax must avoid it."""
    assert result(fn, X) == want


@pytest.mark.parametrize(
    "reduction, want", [("mean", Partial("loss_mean")), ("sum", Partial("sum")), ("none", Split(0))]
)
def test_loss_rule_follows_the_reduction(reduction, want):
    """cross_entropy's reduction decides: a partial mean, a partial sum, or per-sample losses."""
    logits, target = torch.randn(4, 5), torch.randint(0, 5, (4,))
    assert result(lambda m, x, t: F.cross_entropy(x, t, reduction=reduction), logits, target) == want


def test_loss_module_rule_reads_the_module_settings():
    """nn.MSELoss(reduction='sum') as a module gives a partial sum."""
    got = result(lambda m, x, t: m.loss(x, t), torch.randn(4, 3), torch.randn(4, 3), loss=nn.MSELoss(reduction="sum"))
    assert got == Partial("sum")


# ---------------------------------------------------------------------- matrix ops
def test_matrix_rules_keep_the_batch_out_of_the_contraction():
    """x @ w and a Linear keep the batch split; a batched bmm of two split tensors too."""
    assert result(lambda m, x: x @ m.w, X, w=torch.randn(6, 2)) == Split(0)
    assert result(lambda m, x: m.fc(x), X, fc=nn.Linear(6, 2)) == Split(0, origin="x")
    assert result(lambda m, x: torch.bmm(x, x.transpose(1, 2)), X) == Split(0)


def test_matrix_rule_sums_partials_when_the_batch_is_contracted():
    """x.T @ x contracts over the batch: each device's product is a partial sum of the whole's;
    x @ x.T pairs every sample with every sample: it needs the whole batch."""
    x = torch.randn(4, 6)
    assert result(lambda m, x: x.t() @ x, x) == Partial("sum")
    assert result(lambda m, x: x @ x.t(), x) == WHOLE


# ---------------------------------------------------------------------- modules
def test_module_rules_for_layers_per_sample():
    """Conv, LayerNorm and Embedding work per sample: the split passes through."""
    assert result(lambda m, x: m.conv(x), torch.randn(4, 3, 8), conv=nn.Conv1d(3, 2, 3)) == Split(0, origin="x")
    assert result(lambda m, x: m.norm(x), X, norm=nn.LayerNorm(6)) == Split(0, origin="x")
    tokens = torch.randint(0, 10, (4, 5))
    assert result(lambda m, t: m.emb(t), tokens, emb=nn.Embedding(10, 3)) == Split(0, origin="x")


def test_module_rule_instance_norm_with_running_stats_runs_whole():
    """InstanceNorm tracking running statistics averages over the batch: whole; without, per sample."""
    x = torch.randn(4, 3, 8)
    assert result(lambda m, x: m.norm(x), x, norm=nn.InstanceNorm1d(3, track_running_stats=True)) == WHOLE
    assert result(lambda m, x: m.norm(x), x, norm=nn.InstanceNorm1d(3)) == Split(0, origin="x")


def test_module_rule_sequence_first_lstm_splits_dim_1():
    """An LSTM with batch_first=False takes its input split on dim 1; h and c are split on dim 1."""
    got = result(lambda m, x: m.rnn(x), torch.randn(5, 4, 3), dims={"x": 1}, rnn=nn.LSTM(3, 2))
    assert got == Tuple((Split(1, origin="x"), Tuple((Split(1), Split(1)))))


# ---------------------------------------------------------------------- numerics against eager
class ShapeOps(nn.Module):
    """Views, permutes, softmax, a matmul over the batch's own rows and a mean: every family at once."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)

    def forward(self, x):
        h = self.fc(x).view(x.size(0), 3, 2, 4).permute(0, 2, 1, 3)
        att = (h @ h.transpose(-2, -1)).softmax(dim=-1)
        y = (att @ h).flatten(1)
        return y, y.sum(dim=1).mean()


def test_batch_rules_match_eager_on_shape_ops():
    """A model of views, permutes, softmax and reductions, split over 2 devices, matches eager."""
    pm = check_against_eager(ShapeOps, ["cpu"] * 2, torch.randn(5, 3, 6))
    assert "fc_dev1" in pm.code


def test_batch_rules_match_eager_on_a_loss():
    """A cross-entropy loss computed per device and combined gives eager's loss and gradients."""

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 5)

        def forward(self, x, target):
            return F.cross_entropy(self.fc(x), target)

    check_against_eager(Loss, ["cpu"] * 2, torch.randn(7, 6), torch.randint(0, 5, (7,)))


# ---------------------------------------------------------------------- the registry
def test_registry_looks_rules_up_by_function_method_module_and_aten_op():
    """One register call per target kind; lookup finds each, an ATen overload through its packet."""
    registry = BatchRuleRegistry()
    registry.register(torch.special.erfcx, pointwise)
    registry.register("erfcx", pointwise)
    registry.register(nn.Conv1d, per_sample_dim0)
    registry.register(torch.ops.aten.erf, pointwise)
    assert registry.function_rule(torch.special.erfcx) is pointwise
    assert registry.methods["erfcx"] is pointwise
    assert registry.module_rule(nn.Conv1d(1, 1, 1)) is per_sample_dim0
    assert registry.function_rule(torch.ops.aten.erf.default) is pointwise
    assert registry.function_rule(torch.ops.aten.sin.default) is None


def test_registry_module_rules_cover_subclasses_unless_exact():
    """A rule for a module type covers its subclasses, unless registered with subclasses=False."""

    class MyConv(nn.Conv1d):
        pass

    class MyLoss(nn.MSELoss):
        pass

    registry = BatchRuleRegistry()
    registry.register(nn.Conv1d, per_sample_dim0)
    registry.register(nn.MSELoss, pointwise, subclasses=False)
    assert registry.module_rule(MyConv(1, 1, 1)) is per_sample_dim0
    assert registry.module_rule(nn.MSELoss()) is pointwise
    assert registry.module_rule(MyLoss()) is None


def test_registry_refuses_a_second_rule_unless_replacing():
    """Registering a target twice is an error; replace=True overrides."""
    registry = BatchRuleRegistry()
    registry.register(torch.relu, pointwise)
    with pytest.raises(ValueError, match="already has a batch rule; pass replace=True"):
        registry.register(torch.relu, per_sample_dim0)
    registry.register(torch.relu, per_sample_dim0, replace=True)
    assert registry.function_rule(torch.relu) is per_sample_dim0
    with pytest.raises(TypeError, match="cannot register a batch rule for 3"):
        registry.register(3, pointwise)


def test_rule_for_reads_the_shared_registry():
    """rule_for finds the built-in rules in BATCH_RULES: torch.relu is pointwise."""
    gm = captured(Fn(lambda m, x: torch.relu(x)))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    rule = rule_for(node, None)
    assert rule is BATCH_RULES.function_rule(torch.relu) is pointwise
    assert rule(RuleContext(node, {node.args[0]: Split(0)}, None)) == Split(0)


class LSTMCellLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(4, 6)
        self.fc = nn.Linear(6, 2)

    def forward(self, x, h0, c0):
        state = (h0, c0)
        for t in range(3):
            state = self.cell(x[:, t], state)
        return self.fc(state[0]), state[1]


@pytest.mark.parametrize("make, extra", [(CellLoop, 0), (LSTMCellLoop, 2)], ids=["gru_cell", "lstm_cell"])
def test_batch_rules_rnn_cells_run_per_device(make, extra):
    """RNN cells run on each device's chunk (input and state split on dim 0), matching eager."""
    states = [torch.randn(7, 6) for _ in range(extra)]
    pm = check_against_eager(make, ["cpu"] * 3, torch.randn(7, 3, 4), *states, transform_kwargs={"copy_replicas": True})
    assert "cell_2_dev2" in pm.code and "gather" not in pm.code.split("cell_2_dev2")[0]


def test_batch_rules_instance_norm_with_running_stats_updates_them_once():
    """InstanceNorm(track_running_stats=True) ends with eager's running statistics (one update, whole batch)."""
    check_against_eager(
        lambda: nn.Sequential(nn.Conv1d(3, 4, 3), nn.InstanceNorm1d(4, track_running_stats=True)),
        ["cpu"] * 3, torch.randn(7, 3, 8),
    )
