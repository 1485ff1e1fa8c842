"""PyTorch's OpInfo samples, split by their batch rules over 2 and 3 virtual devices (uneven
chunks), must equal the op run whole, as DTensor's test_dtensor_ops.py proves its op coverage.
The sweep over every op is ``PYTHONPATH=. python -m tests.analysis.opinfo_split`` (a few minutes);
here the ops of the core opset's families, one sample each. Each also asks the oracle whether a
split on the sample's dim 0 exists (the op on chunks of the rows, joined, equals the op); where one
does, the rule must split it, or the op must carry its reason in ``KNOWN_WHOLE``."""

from __future__ import annotations

import pytest

pytest.importorskip("expecttest")  # torch.testing._internal needs it (in the test extras)

from tests.analysis.opinfo_split import KNOWN_WHOLE, sweep  # noqa: E402

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
    missed = {op: reason for op, (_, reason) in tally.missed.items() if op not in KNOWN_WHOLE}
    assert missed == {}, f"rules kept splittable samples whole: {missed}"


@pytest.mark.slow
def test_opinfo_samples_split_by_their_rules_equal_the_whole_op():
    """Every sample with a float input of 3+ rows: split (or kept whole) by its rule, equal."""
    tally = sweep(1, ops=FAMILIES)
    assert tally.failed == [], "\n".join(tally.failed)
    assert tally.split >= 40, tally.line()  # 46 of 115 when written; the rest kept whole, also equal
    _no_silent_whole(tally)
    done, total = (sum(v[i] for v in tally.families.values()) for i in (0, 1))
    assert total >= 40 and done >= 0.9 * total, tally.split_line()


@pytest.mark.slow
def test_opinfo_samples_in_core_aten_split_by_the_table_equal_the_whole_op():
    """The same samples captured as core ATen ops (make_fx with the core decompositions, what
    torch.export gives): the table's ATen rules split them, equal to the op."""
    tally = sweep(1, ops=FAMILIES, aten=True)
    assert tally.failed == [], "\n".join(tally.failed)
    assert tally.split >= 50, tally.line()  # 70 of 123 when written
    _no_silent_whole(tally)
