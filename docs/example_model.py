"""The models of docs/inspection_and_export.md (regenerate its outputs with make_inspection_doc.py)."""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.bn = nn.BatchNorm1d(64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        h = torch.relu(self.bn(self.fc1(x)))
        return self.fc2(h)


class MLP(nn.Module):
    def __init__(self, d: int = 512, hidden: int = 2048):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * torch.arange(x.size(1))


def make():
    """The factory form the command line takes: ``dpcompile inspect docs/example_model.py:make --devices 2``."""
    return Net(), (torch.randn(128, 32),)
