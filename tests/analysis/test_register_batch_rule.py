"""``dpcompile.register_batch_rule``: a wrapped third-party function taught "elementwise", "whole"
and a callable rule."""

from __future__ import annotations

import pytest
import torch

import dpcompile
from dpcompile.analysis.batch_rules import BATCH_RULES


def lib_gelu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x) * 1.5


def lib_pair_sum(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1) + bias


torch.fx.wrap("lib_gelu")
torch.fx.wrap("lib_pair_sum")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.bias = torch.nn.Parameter(torch.randn(8, 1))

    def forward(self, x):
        return lib_pair_sum(lib_gelu(self.fc(x)), self.bias)


@pytest.fixture
def clean():
    yield
    for target in (lib_gelu, lib_pair_sum):
        BATCH_RULES.functions.pop(target, None)


def _whole(pm, x):
    return [w["node"] for w in dpcompile.explain(pm, x).whole]


def test_register_batch_rule_elementwise_and_callable_split(clean):
    """Taught 'elementwise' and a vmap-style callable, both functions run per device, exactly."""
    model, x = Net(), torch.randn(6, 8)
    assert _whole(dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,)), x) == ["lib_gelu", "lib_pair_sum"]
    dpcompile.register_batch_rule(lib_gelu, "elementwise")
    dpcompile.register_batch_rule(lib_pair_sum, lambda in_dims: 1 if in_dims == [0, None] else "whole")
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,))
    assert _whole(pm, x) == []
    assert dpcompile.explain(pm, x).split_flop_fraction == 1.0
    torch.testing.assert_close(pm(x), model(x))
    pm(x).sum().backward()
    grad = model.fc.weight.grad.clone()
    model.zero_grad()
    model(x).sum().backward()
    torch.testing.assert_close(grad, model.fc.weight.grad)


def test_register_batch_rule_whole_and_errors(clean):
    """'whole' runs the call once with its reason; a second registration or a bad rule is an error."""
    dpcompile.register_batch_rule(lib_gelu, "whole")
    with pytest.raises(ValueError, match="already has a batch rule"):
        dpcompile.register_batch_rule(lib_gelu, "elementwise")
    with pytest.raises(ValueError, match="expected 'elementwise', 'whole'"):
        dpcompile.register_batch_rule(lib_pair_sum, "sometimes")
    model, x = Net(), torch.randn(6, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    report = dpcompile.explain(pm, x)
    assert report.whole[0]["node"] == "lib_gelu" and "registered as 'whole'" in report.whole[0]["reason"]
    torch.testing.assert_close(pm(x), model(x))


def test_a_rule_claiming_a_dim_the_output_lacks_is_refused_when_built(clean):
    """A rule saying dim 2 of a 2-D output (or a tuple for one tensor) fails at transform time,
    naming the rule and the op, not inside gather at call time."""
    from dpcompile.analysis.batch_rules.checks import BatchRuleError

    model, x = Net(), torch.randn(6, 8)
    dpcompile.register_batch_rule(lib_gelu, lambda in_dims: 2)
    with pytest.raises(BatchRuleError, match=r"batch rule .* for .*lib_gelu.* split on dim 2, but the output has 2 dims"):
        dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,))
    dpcompile.register_batch_rule(lib_gelu, lambda in_dims: (0, 0), replace=True)
    with pytest.raises(BatchRuleError, match="returns a tuple of 2 placements for one tensor"):
        dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,))
