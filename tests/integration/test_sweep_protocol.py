"""The model sweeps' protocol (``benchmarks/dp_models_sweep.py``'s ``run``): training is measured on
a program transformed in training mode, as a user who trains calls ``model.train()`` before
``transform``. An exported program keeps the mode it was exported in, so a model whose forward
reads ``self.training`` (Mamba's and XLNet's) and was transformed in eval mode is refused for
training with a ``DpCompileError``; the sweep must not count that refusal as the model's failure."""

from __future__ import annotations

import pytest
import torch
from torch import nn

sweep = pytest.importorskip("benchmarks.dp_models_sweep")  # imports timm, torchvision and transformers


class TrainsOtherwise(nn.Module):
    """Exported (fx cannot iterate a traced size), with another path in training."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        h = self.conv(x)
        h = torch.stack([h[:, i] for i in range(h.shape[1])], dim=1)  # fx cannot iterate h.shape[1]
        if self.training:
            h = h * 2
        return self.head(h.mean((2, 3)))


def test_the_sweep_trains_a_program_transformed_in_training_mode():
    result = sweep.run("trains_otherwise", TrainsOtherwise, "img")
    assert result["captured"] == "export"
    assert (result["split"], result["eval"], result["uneven"], result["train"]) == (1.0, "ok", "ok", "ok")
