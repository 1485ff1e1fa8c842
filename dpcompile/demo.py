"""The built-in model of ``dpcompile demo``: an LSTM block feeding an MLP.

>>> from dpcompile.demo import build
>>> model, (x,) = build()
>>> model(x).shape
torch.Size([8, 4])
"""

from __future__ import annotations

import torch
from torch import nn


class DemoModel(nn.Module):
    """Sequence classifier: ``LSTM(batch_first) -> last step -> Linear -> ReLU -> Linear``."""

    def __init__(self, features: int = 16, hidden: int = 32, classes: int = 4):
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.ReLU(), nn.Linear(4 * hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lstm.flatten_parameters()  # hoisted by dpcompile to the head of forward, once per device
        out, _ = self.lstm(x)
        return self.mlp(out[:, -1])


def build(batch: int = 8, steps: int = 5, features: int = 16) -> tuple[DemoModel, tuple[torch.Tensor]]:
    """The demo model (seeded) and an example batch ``x[batch, steps, features]``."""
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DemoModel(features)
    x = torch.randn(batch, steps, features, generator=generator)
    return model, (x,)


def demo_devices() -> list[str]:
    """Every GPU here, ``["cuda:0", "cuda:0"]`` (virtual) with one, else ``["cpu", "cpu"]``."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= 2:
        return [f"cuda:{k}" for k in range(count)]
    if count == 1:
        return ["cuda:0", "cuda:0"]
    return ["cpu", "cpu"]
