"""FLOPs counted from recorded shapes equal FLOPs counted by running the graph on fake tensors."""

from __future__ import annotations

import torch
from torch import nn

import dpcompile
from dpcompile.analysis.split_fraction import node_flops, node_flops_from_shapes
from dpcompile.fx_utils import propagate_shapes


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.bn(self.conv(x)).relu().mean((2, 3))
        return torch.matmul(self.fc(y), torch.ones(4, 2)) + torch.nn.functional.linear(y, self.fc.weight).sum()


def _both(gm, inputs):
    assert propagate_shapes(gm, inputs)
    return node_flops_from_shapes(gm), node_flops(gm, inputs)


def test_flops_from_shapes_equal_a_fake_run_fx_capture():
    """Modules, torch functions and methods of an fx-captured model; batch norm statistics untouched."""
    model = _ConvNet().train()
    x = torch.randn(2, 3, 6, 6)
    pm = dpcompile.transform(model, ["cpu", "cpu"], example_inputs=(x,))
    running = model.bn.running_mean.clone()
    from_shapes, from_run = _both(pm.captured, [x])
    assert from_shapes == from_run and sum(from_shapes.values()) > 0
    torch.testing.assert_close(model.bn.running_mean, running, rtol=0, atol=0)


def test_flops_from_shapes_equal_a_fake_run_export_capture():
    """ATen ops with FLOP formulas (attention, matmuls) of an exported program."""

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).unbind(2)
            return nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            ).sum(1) @ torch.ones(8, 8)

    x = torch.randn(4, 5, 16)
    pm = dpcompile.transform(Attention(), ["cpu", "cpu"], frontend="export", example_inputs=(x,))
    from_shapes, from_run = _both(pm.captured, [x])
    assert from_shapes == from_run and sum(from_shapes.values()) > 0


class _Checkpointed(nn.Module):
    """``torch.utils.checkpoint.checkpoint(self.block, x)`` in forward: a call of a function that
    takes the BatchNorm block as an argument."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return self.fc(h.mean((2, 3)))


def test_transform_leaves_the_state_of_a_module_passed_to_a_function_untouched():
    """Counting the checkpoint node's FLOPs ran the block on fake tensors, and BatchNorm's
    ``num_batches_tracked += 1`` landed on the real buffer: one count ahead of eager from transform on."""
    model = _Checkpointed().train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    dpcompile.transform(model, ["cpu", "cpu"], example_inputs=(torch.randn(2, 3, 6, 6),))
    torch.testing.assert_close(model.state_dict(), state, rtol=0, atol=0)


def test_stage_weights_counted_from_shapes_equal_a_fake_run():
    """The FLOPs that weigh where a pipeline's stages are cut, counted from the shapes
    ``stage_weights`` propagates, equal a fake run's; batch norm statistics untouched."""
    from dpcompile.capture import capture_model
    from dpcompile.recipes.pipeline_stages import stage_weights

    model = _ConvNet().train()
    x = torch.randn(2, 3, 6, 6)
    running = model.bn.running_mean.clone()
    for gm in (torch.fx.symbolic_trace(model), capture_model(model, frontend="export", example_inputs=(x,))[0]):
        weights = stage_weights(gm, [x])
        assert weights == node_flops(gm, [x]) and sum(weights.values()) > 0
    torch.testing.assert_close(model.bn.running_mean, running, rtol=0, atol=0)
