"""A branch on a data-dependent size (DeBERTa's ``if label_index.size(0) > 0`` after ``nonzero``):
the export frontend takes the branch the example takes and checks it at every call."""

import copy
import re

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.errors import TraceError


class LabelledHead(nn.Module):
    """DebertaV2ForSequenceClassification's loss: only rows with a label (>= 0) count."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.classifier = nn.Linear(6, 3)

    def forward(self, x, labels):
        logits = self.classifier(self.body(x).relu())
        label_index = (labels >= 0).nonzero()
        if label_index.size(0) > 0:
            labeled = torch.gather(logits, 0, label_index.expand(label_index.size(0), logits.size(1)))
            picked = torch.gather(labels, 0, label_index.view(-1))
            loss = nn.functional.cross_entropy(labeled, picked)
        else:
            loss = torch.tensor(0).to(logits)
        return loss, logits


class ComparesToBatch(LabelledHead):
    """The same branch, but on the count against the batch size: a per-device check would read
    the device's batch, so it cannot be kept."""

    def forward(self, x, labels):
        logits = self.classifier(self.body(x).relu())
        label_index = (labels >= 0).nonzero()
        if label_index.size(0) == labels.size(0):
            return logits.sum()
        return logits.mean()



class RowsPerSample(LabelledHead):
    """The branch, and rows of whole samples viewed back (``view(-1, 2, 3)`` of ``(2B, 3)``, as
    DeBERTa's attention does): the batch analysis reads the example's (symbolic) batch size."""

    def forward(self, x, labels):
        rows = self.body(x).reshape(-1, 3).relu()
        logits = self.classifier(rows.view(-1, 2, 3).flatten(1))
        return self.forward_loss(logits, labels)

    def forward_loss(self, logits, labels):
        label_index = (labels >= 0).nonzero()
        if label_index.size(0) > 0:
            labeled = torch.gather(logits, 0, label_index.expand(label_index.size(0), logits.size(1)))
            picked = torch.gather(labels, 0, label_index.view(-1))
            return nn.functional.cross_entropy(labeled, picked), logits
        return torch.tensor(0).to(logits), logits


@pytest.mark.parametrize("cls", [LabelledHead, RowsPerSample])
def test_branch_on_a_data_dependent_count_is_decided_on_the_example_and_equals_eager(cls):
    torch.manual_seed(0)
    model = cls()
    eager = copy.deepcopy(model)
    labels = torch.tensor([0, -100, 2, 1])
    pm = dpcompile.transform(model, ["cpu"] * 3, example_inputs=(torch.randn(4, 6), labels), frontend="export")
    x, labels = torch.randn(7, 6, requires_grad=True), torch.tensor([0, -100, 2, 1, -100, -100, 2])
    x_eager = x.detach().clone().requires_grad_()
    loss, logits = pm(x, labels)
    expected_loss, expected_logits = eager(x_eager, labels)
    torch.testing.assert_close(logits, expected_logits)
    torch.testing.assert_close(loss, expected_loss)
    loss.backward()
    expected_loss.backward()
    torch.testing.assert_close(x.grad, x_eager.grad)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_call_taking_the_other_branch_stops_instead_of_computing_the_wrong_one():
    model = LabelledHead()
    pm = dpcompile.transform(
        model, ["cpu"] * 2, example_inputs=(torch.randn(4, 6), torch.tensor([0, 1, 2, 1])), frontend="export"
    )
    with pytest.raises(dpcompile.InputMismatch, match="captured with .*u0.* true, as the example made it") as refused:
        pm(torch.randn(4, 6), torch.full((4,), -100))
    assert isinstance(refused.value, RuntimeError)  # what torch's check raised before: code catching it still does


def test_branch_that_also_reads_the_batch_size_is_refused_with_the_line():
    """The line is named, and, a branch on ``labels`` (wav2vec2's CTC loss too), the way out: the loss outside."""
    with pytest.raises(TraceError, match=r"label_index.size\(0\) == labels.size\(0\).*data-dependent.*leave labels out"):
        dpcompile.transform(ComparesToBatch(), ["cpu"] * 2, example_inputs=(torch.randn(4, 6), torch.tensor([0, 1, 2, 1])),
                            frontend="export")  # fmt: skip


def test_shapes_propagate_through_nonzero_as_a_symbol():
    """Shape propagation on fake tensors gives nonzero's rows a symbol, so the ops before and
    after it keep their shapes (the batch rules read them)."""
    from dpcompile.fx_utils import propagate_shapes

    gm = torch.fx.symbolic_trace(lambda x: (x > 0).nonzero().float().sum() + x.sum())
    assert propagate_shapes(gm, [torch.randn(4, 3)])
    shapes = {n.name: n.meta["val"].shape for n in gm.graph.nodes if n.op == "call_method" or n.op == "call_function"}
    assert shapes["gt"] == (4, 3) and str(shapes["nonzero"][0]).startswith("u") and shapes["nonzero"][1] == 2


class LayerDrop(nn.Module):
    """transformers' LayerDrop (wav2vec2, HuBERT): in training each layer is skipped on a random draw."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])

    def forward(self, x):
        for layer in self.layers:
            if not (self.training and torch.rand([]) < 0.5):
                x = layer(x)
        return x


def test_branch_on_a_random_draw_is_refused_not_decided_on_the_example():
    """A branch on ``torch.rand([])`` was taken as the example drew it and checked for one layer
    only: a call skipping the other layer silently ran it (wav2vec2's logits off by 5e-3). Refused,
    naming the line; in eval the program runs, and a training call refuses."""
    torch.manual_seed(0)
    with pytest.raises(TraceError, match=r"branches on a random draw.*torch.rand.*layerdrop = 0"):
        dpcompile.transform(LayerDrop(), ["cpu"] * 2, example_inputs=(torch.randn(4, 6),), frontend="export")
    model, x = LayerDrop().eval(), torch.randn(4, 6)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), frontend="export")
    torch.testing.assert_close(pm(x), model(x))
    pm.train()
    with pytest.raises(dpcompile.DpCompileError, match="eval mode"):
        pm(x)


class ClampsWhereNotFinite(nn.Module):
    """DETR's encoder layer in training: the activations, through dropout, clamped where one is not finite."""

    def __init__(self):
        super().__init__()
        self.body, self.drop, self.head = nn.Linear(6, 6), nn.Dropout(0.3), nn.Linear(6, 2)

    def forward(self, x):
        h = self.drop(self.body(x))
        if self.training and not torch.isfinite(h).all():
            h = h.clamp(-1e4, 1e4)
        return self.head(h).pow(2).mean()


def _freed_memory_holding_nan() -> None:
    """Leave the allocator's free lists full of NaN-filled chunks of the sizes these models use: a
    value read from uninitialised memory is then not finite (a long-lived test worker's heap)."""
    chunks = [torch.full((n,), float("nan"), dtype=torch.float64) for n in (2, 6, 10, 12, 30, 36, 60) for _ in range(200)]
    del chunks


def test_propagated_parameters_hold_their_values():
    """torch 2.13's real-value propagation gave an ``nn.Parameter`` uninitialised values (it copies
    only a tensor whose type is exactly ``torch.Tensor``), so branches on ``nn.Linear``'s output were
    decided on garbage; while the frontend decides branches, a parameter's propagated value is its own."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dpcompile.capture.decided import decided_on_examples

    weight = nn.Parameter(torch.randn(6, 6, dtype=torch.float64))
    _freed_memory_holding_nan()
    with decided_on_examples():
        fake = FakeTensorMode().from_tensor(weight)
    assert torch.equal(fake.real_tensor, weight.detach())


def test_branch_on_linear_output_is_decided_on_the_weights_values():
    """The branch on ``isfinite`` of a Linear's output, with freed memory full of NaN: decided as the
    example takes it (the program has no clamp), not refused as a program failing its own example."""
    torch.manual_seed(0)
    model = ClampsWhereNotFinite().double()
    eager = copy.deepcopy(model)
    x = torch.randn(5, 6, dtype=torch.float64)
    _freed_memory_holding_nan()
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    assert "clamp" not in pm.code
    torch.manual_seed(3)
    got = pm(x)
    torch.manual_seed(3)
    torch.testing.assert_close(got, eager(x))


def test_branch_on_data_through_dropout_is_decided_not_refused_as_a_draw():
    """A branch on values that went through dropout (DETR, Conditional DETR) was refused as a branch on a
    random draw: it is decided on the example as any data branch; the loss and every gradient equal eager's
    from the same seed, and a call with an infinite value (the other branch) is refused by the check."""
    torch.manual_seed(0)
    model = ClampsWhereNotFinite().double()
    eager = copy.deepcopy(model)
    x = torch.randn(5, 6, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    torch.manual_seed(3)
    got = pm(x)
    torch.manual_seed(3)
    want = eager(x)
    torch.testing.assert_close(got, want)
    got.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")
    infinite = x.clone()
    infinite[0, 0] = float("inf")
    with pytest.raises(dpcompile.DpCompileError, match="takes a branch of forward that the program does not have"):
        pm(infinite)


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, gate):
        if gate.sum() > 0:
            return self.lin(x)
        return self.lin(x) * 2 - 1


class FourBranches(nn.Module):
    """Branches on values read from data in two layers and in forward: each is decided on the
    example, and each must stay checked (export simplifies a check it decides to ``True``)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = Gated(), Gated(), nn.Linear(8, 8)

    def forward(self, x):
        h = self.b(self.a(x, x), x[:, 0])
        if (x[:, 1] > 0).any():
            h = h + 1
        if x.max().item() > 1.0:
            h = h * 3
        return self.c(h)


def _branch_example():
    x = torch.full((4, 8), 0.1)
    x[:, 0], x[3, 7] = 0.2, 2.0
    return x


def _other_sides():
    """Inputs that take the other side of one branch each, and of all four."""
    sides = {name: _branch_example() for name in ("a", "b", "any", "max", "all")}
    sides["a"][:, 2:] = -1
    sides["b"][:, 0] = -0.2
    sides["any"][:, 1] = -0.1
    sides["max"][3, 7] = 0.5
    sides["all"][:, 2:], sides["all"][:, 0], sides["all"][:, 1], sides["all"][3, 7] = -1, -0.2, -0.1, 0.5
    return sides


# the line each side stops at, and the decision's symbol (layer a's and b's share a line)
_STOPS = {"a": ("if gate.sum() > 0:", "u0"), "b": ("if gate.sum() > 0:", "u1"), "any": ("if (x[:, 1] > 0).any():", "u2"),
          "max": ("if x.max().item() > 1.0:", "zuf0"), "all": ("if gate.sum() > 0:", "u0")}  # fmt: skip


@pytest.mark.parametrize("options", [{}, {"tensor_parallel": True}, {"pipeline": 2}], ids=["dp", "tp", "pp"])
def test_every_branch_on_data_stays_checked(options):
    torch.manual_seed(0)
    model = FourBranches()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(_branch_example(),), frontend="export", **options)
    same_sides = _branch_example() * 1.5
    torch.testing.assert_close(pm(same_sides), eager(same_sides))
    for side, x in _other_sides().items():
        line, symbol = _STOPS[side]
        with pytest.raises(dpcompile.InputMismatch, match=rf"program does not have \(forward's .*{re.escape(line)}.*captured with .*\b{symbol}\b"):
            pm(x)


class MaxBelow(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.max().item() > 1.0:
            return self.lin(x) * 3
        return self.lin(x)


def test_branch_export_keeps_no_check_of_is_refused_with_the_line():
    """``x.max().item() > 1.0`` decided false: torch.export records no runtime check of it."""
    with pytest.raises(TraceError, match=r"x.max\(\).item\(\) > 1.0.*kept no check"):
        dpcompile.transform(MaxBelow(), ["cpu"] * 2, example_inputs=(torch.full((4, 8), 0.1),), frontend="export")


def test_program_failing_its_own_example_is_refused_naming_the_branch():
    """Where torch's real-value propagation decides a branch otherwise than eager (it did on
    ``nn.Linear``'s output, reading a parameter's uninitialised values), the frontend runs the
    decided program on the examples and refuses it where one of its checks fails. Here the program
    decided on one example is checked on one taking the other branch."""
    from torch.export import export

    from dpcompile.capture.decided import check_decided_on_examples, decided_on_examples, name_branches

    model = MaxBelow()
    with decided_on_examples() as decisions:
        ep = export(model, (), {"x": torch.full((4, 8), 2.0)}, strict=False)
    name_branches(ep.graph_module, decisions, "MaxBelow")
    check_decided_on_examples(ep, {"x": torch.full((4, 8), 3.0)}, "MaxBelow")  # the same branch: passes
    with pytest.raises(TraceError, match=r"x.max\(\).item\(\) > 1.0.*decided that branch otherwise than the example"):
        check_decided_on_examples(ep, {"x": torch.full((4, 8), 0.5)}, "MaxBelow")


class ReturnsNumbers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        out = self.fc(x)
        return out, float(out.sum()), int((out > 0).sum())


def test_a_number_read_from_data_and_returned_is_refused():
    """``float(t)``/``int(t)`` returned: export kept the example's values, and the program returned the
    example's sum for another batch whose positive count matched (-0.91 for -1.67, silently). Refused by
    name, pointing at ``.item()``, which the program reads at each call."""
    torch.manual_seed(0)
    with pytest.raises(dpcompile.TraceError, match=r"returns a Python number read from a tensor.*t\.item\(\)"):
        dpcompile.transform(ReturnsNumbers(), ["cpu"] * 2, frontend="export", example_inputs=(torch.randn(3, 8),))


class BranchesAndReturnsAConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        out = self.fc(x)
        if (x > 0).nonzero().size(0) > 0:
            out = out * 2
        return out, 0.5


class BranchesAndReturnsATwiceReadNumber(BranchesAndReturnsAConstant):
    def forward(self, x):
        out = self.fc(x)
        if x.max().item() > -10.0:
            out = out * 2
        return out, float(out.sum()) * 2


def test_a_constant_returned_beside_a_decided_branch_runs():
    """``return out, 0.5`` after a branch decided on the example: the constant is not read from data, so the
    program runs (outputs as eager's for another batch); it was refused as a number read from a tensor."""
    torch.manual_seed(0)
    model = BranchesAndReturnsAConstant()
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(torch.randn(4, 8),))
    x = torch.randn(6, 8)
    out, number = pm(x)
    expected, expected_number = model(x)
    torch.testing.assert_close(out, expected)
    assert number == expected_number == 0.5 and type(number) is float


def test_a_number_computed_from_a_read_is_refused_naming_its_line():
    """``float(out.sum()) * 2`` returned beside a branch on a read: still the example's value, refused by line."""
    torch.manual_seed(0)
    with pytest.raises(dpcompile.TraceError, match=r"read from a tensor .* at .*float\(out.sum\(\)\) \* 2"):
        dpcompile.transform(
            BranchesAndReturnsATwiceReadNumber(), ["cpu"] * 2, frontend="export", example_inputs=(torch.randn(4, 8),)
        )
