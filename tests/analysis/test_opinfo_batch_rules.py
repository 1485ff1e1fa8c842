"""PyTorch's OpInfo samples, split by their batch rules over 2 and 3 virtual devices (uneven
chunks), must equal the op run whole, as DTensor's test_dtensor_ops.py proves its op coverage.
The sweep over every op is ``PYTHONPATH=. python -m tests.analysis.opinfo_split`` (a few minutes);
here the ops of the core opset's families, one sample each. Each also asks the oracle whether a
split on the sample's dim 0 exists (the op on chunks of the rows, joined, equals the op); where one
does, the rule must split it, or the op must carry its reason in ``KNOWN_WHOLE``."""

from __future__ import annotations

import pytest

pytest.importorskip("expecttest")  # torch.testing._internal needs it (in the test extras)

import torch  # noqa: E402
from torch.testing._internal.opinfo.core import SampleInput  # noqa: E402

from dpcompile.analysis.batch_rules import reasons  # noqa: E402
from tests.analysis.opinfo_split import (  # noqa: E402
    Tally,
    exit_status,
    family_of,
    run_sample_detail,
    splittable,
    sweep,
)

FAMILIES = {
    "abs", "add", "sub", "mul", "div.no_rounding_mode", "pow", "where", "clamp", "exp", "sigmoid", "tanh", "atan2",
    "sum", "mean", "amax", "argmax", "prod", "var", "any", "max.reduction_with_dim", "min.reduction_with_dim",
    "sort", "topk", "cumsum", "softmax", "log_softmax", "flip", "roll", "diagonal",
    "view", "reshape", "permute", "transpose", "unsqueeze", "squeeze", "expand", "repeat", "split", "chunk",
    "unbind", "cat", "stack", "select", "narrow", "slice", "tril", "triu",
    "gather", "scatter", "scatter_add", "index_select", "index_put", "slice_scatter", "select_scatter",
    "masked_scatter", "nonzero", "mm", "bmm", "addmm", "matmul", "cdist",
    "nn.functional.conv2d", "nn.functional.avg_pool2d", "nn.functional.max_pool2d", "nn.functional.layer_norm",
    "nn.functional.group_norm", "nn.functional.pad.constant", "nn.functional.embedding", "nn.functional.glu",
    "nn.functional.gelu", "nn.functional.linear", "nn.functional.interpolate.nearest",
    "tensor_split", "argsort", "norm", "linalg.vector_norm", "baddbmm", "einsum", "unfold", "reshape_as", "view_as",
    "fft.rfft", "fft.fft2", "special.ndtr", "hypot", "logit", "nansum", "narrow_copy", "transpose_copy",
}  # fmt: skip


def _no_silent_whole(tally) -> None:
    """Every op that kept a splittable sample whole carries its reason (a rule that always says
    'whole' fails here, by the op's name)."""
    assert tally.without_reason() == {}, f"rules kept splittable samples whole: {tally.without_reason()}"


@pytest.mark.slow
@pytest.mark.xdist_group("opinfo_samples")  # one worker makes FAMILIES' samples once for both sweeps (opinfo_split._MADE)
def test_opinfo_samples_split_by_their_rules_equal_the_whole_op():
    """Every sample with a float input of 3+ rows: split (or kept whole) by its rule, equal."""
    tally = sweep(1, ops=FAMILIES)
    assert tally.failed == [], "\n".join(tally.failed)
    assert tally.split >= 40, tally.line()  # 46 of 115 when written; the rest kept whole, also equal
    _no_silent_whole(tally)
    done, total = (sum(v[i] for v in tally.families.values()) for i in (0, 1))
    assert total >= 40 and done >= 0.9 * total, tally.split_line()


@pytest.mark.slow
@pytest.mark.xdist_group("opinfo_samples")
def test_opinfo_samples_in_core_aten_split_by_the_table_equal_the_whole_op():
    """The same samples captured as core ATen ops (make_fx with the core decompositions, what
    torch.export gives): the table's ATen rules split them, equal to the op."""
    tally = sweep(1, ops=FAMILIES, aten=True)
    assert tally.failed == [], "\n".join(tally.failed)
    assert tally.split >= 50, tally.line()  # 70 of 123 when written
    _no_silent_whole(tally)


# ops the new rule files cover (linalg on stacks, cumulative and order statistics, masked
# reductions, losses, products, reordering): one sample each, fast
NEW_RULES = {
    "cumprod", "cummax", "logcumsumexp", "quantile", "median", "var_mean", "take_along_dim", "linalg.det",
    "linalg.svd", "linalg.solve", "masked.sum", "masked.softmax", "nn.functional.gaussian_nll_loss",
    "nn.functional.poisson_nll_loss", "dot", "outer", "fliplr", "tile", "movedim", "atleast_2d", "frexp",
}  # fmt: skip


def test_the_new_rules_split_every_splittable_sample_of_a_slice_and_equal_the_op():
    torch.manual_seed(0)
    tally = sweep(1, ops=NEW_RULES)
    assert tally.failed == [], "\n".join(tally.failed)
    assert tally.without_reason() == {}, tally.without_reason()
    done, total = (sum(v[i] for v in tally.families.values()) for i in (0, 1))
    assert total >= 8 and done == total, (tally.split_line(), tally.missed)


def scale_rows(x: torch.Tensor) -> torch.Tensor:
    """A function no batch rule knows: per sample, so a split exists, but it runs whole."""
    return x * 2


def _tally_of(fn, sample, name: str) -> Tally:
    tally = Tally()
    outcome, reason = run_sample_detail(fn, sample, 2)
    assert outcome == "whole" and splittable(fn, sample)
    tally.count(family_of(fn), outcome, name, reason)
    return tally


def test_an_op_kept_whole_on_a_splittable_sample_without_a_written_reason_fails_by_name(capsys):
    tally = _tally_of(scale_rows, SampleInput(torch.randn(6, 3)), "scale_rows")
    assert tally.without_reason() == {"scale_rows": "no rule"}
    assert exit_status(tally) == 1


def test_a_written_reason_lets_the_proof_pass(monkeypatch):
    monkeypatch.setitem(reasons.WHOLE_REASONS, "scale_rows", "a test function, kept whole on purpose")
    tally = _tally_of(scale_rows, SampleInput(torch.randn(6, 3)), "scale_rows")
    assert tally.without_reason() == {} and exit_status(tally) == 0


def test_a_rule_runs_whole_along_the_batch_dim_and_the_table_says_why():
    """cumprod along dim 0 mixes rows: whole (the oracle finds no split, so no reason is needed);
    flipud's samples are splittable only when empty, and its reason is written."""
    x = torch.randn(6, 3)
    assert run_sample_detail(torch.cumprod, SampleInput(x, args=(0,)), 2)[0] == "whole"
    assert not splittable(torch.cumprod, SampleInput(x, args=(0,)))
    assert run_sample_detail(torch.cumprod, SampleInput(x, args=(1,)), 3)[0] == "split"
    assert "dim 0" in reasons.reason_for("flipud") and reasons.reason_for("index_reduce.amax")
