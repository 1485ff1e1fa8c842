"""PyTorch's OpInfo samples, split by their batch rules over 2 and 3 virtual devices (uneven
chunks), must equal the op run whole, as DTensor's test_dtensor_ops.py proves its op coverage.
The sweep over every op is ``PYTHONPATH=. python -m tests.analysis.opinfo_split`` (a few minutes);
here the ops of the core opset's families, one sample each."""

from __future__ import annotations

import pytest

pytest.importorskip("expecttest")  # torch.testing._internal needs it (in the test extras)

from tests.analysis.opinfo_split import sweep  # noqa: E402

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
}  # fmt: skip


@pytest.mark.slow
def test_opinfo_samples_split_by_their_rules_equal_the_whole_op():
    """Every sample with a float input of 3+ rows: split (or kept whole) by its rule, equal."""
    tally = sweep(1, ops=FAMILIES)
    assert tally.failed == [], "\n".join(tally.failed)
    assert tally.split >= 40, tally.line()  # 46 of 115 when written; the rest kept whole, also equal


@pytest.mark.slow
def test_opinfo_samples_in_core_aten_split_by_the_table_equal_the_whole_op():
    """The same samples captured as core ATen ops (make_fx with the core decompositions, what
    torch.export gives): the table's ATen rules split them, equal to the op."""
    tally = sweep(1, ops=FAMILIES, aten=True)
    assert tally.failed == [], "\n".join(tally.failed)
    assert tally.split >= 50, tally.line()  # 70 of 123 when written
