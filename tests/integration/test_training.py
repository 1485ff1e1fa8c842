"""Training through the generated module equals training the eager model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import dpcompile
from tests.models import CNN, MLP, ResNetish


@pytest.mark.parametrize(
    "make, shape, n_devices, real",
    [
        (MLP, (9, 8), 3, False),
        (lambda: CNN(batch_norm=False), (7, 3, 8, 8), 2, True),
        (ResNetish, (10, 4, 12), 4, False),
    ],
    ids=["mlp-3", "cnn-2-replicas", "resnet-4"],
)
def test_five_sgd_momentum_steps_match_eager(make, shape, n_devices, real):
    """Five SGD+momentum steps over model.parameters() leave the same weights as eager."""
    model = make()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * n_devices, copy_replicas=real)
    opt = torch.optim.SGD(pm.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for _step in range(5):
        x = torch.randn(*shape)
        for module, optimizer in ((pm, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            out = module(x)
            target = torch.zeros_like(out)
            F.mse_loss(out, target).backward()
            optimizer.step()
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
