"""Placement of real multi-GPU data-parallel programs, checked on a CPU with fake CUDA tensors.

FakeTensorMode raises on any op that mixes devices, so a forward that runs to the end proves
every value sits where the generated code says it does.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dpcompile import runtime
from dpcompile.devices import parse_devices
from dpcompile.recipes import DataParallelRecipe
from tests.helpers import to_fake_cuda
from tests.models import CNN, Classifier


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 8, num_layers=2, bidirectional=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        self.lstm.flatten_parameters()
        h, _ = self.lstm(x)
        return self.out(h).sum(), h


def _fake_program(make, n_gpus, copy_replicas):
    mode = FakeTensorMode()
    model = to_fake_cuda(make(), mode)
    devices = parse_devices([f"cuda:{i}" for i in range(n_gpus)], check_available=False)
    pm = DataParallelRecipe(devices=devices, output_device=devices.primary, copy_replicas=copy_replicas).compile(model, None)
    return mode, pm


@pytest.mark.parametrize("n_gpus", [4, 8])
@pytest.mark.parametrize(
    "make, inputs",
    [
        (CNN, lambda: (torch.randn(11, 3, 8, 8),)),
        (Classifier, lambda: (torch.randn(9, 8), torch.randint(0, 5, (9,)))),
        (Tagger, lambda: (torch.randn(5, 10, 6),)),
    ],
    ids=["cnn-batchnorm", "cross-entropy", "lstm"],
)
def test_data_parallel_program_places_every_value_on_its_gpu(make, inputs, n_gpus):
    """Scatter, replicate, per-GPU compute, sync BatchNorm and reductions run on fake GPUs."""
    mode, pm = _fake_program(make, n_gpus, copy_replicas=False)
    code = pm.code
    assert code.count("dpcompile_runtime_replicate(") == 1
    assert f"'cuda:{n_gpus - 1}'" in code
    with mode, torch.no_grad():
        args = [x.to("cuda:0") for x in inputs()]
        out = pm(*args)
    leaves = out if isinstance(out, tuple) else (out,)
    assert all(t.device == torch.device("cuda:0") for t in leaves)


def test_fake_replicas_of_an_rnn_live_on_their_gpus():
    """Each GPU's replica of the LSTM holds its weights on that GPU, in one buffer."""
    mode, pm = _fake_program(Tagger, 4, copy_replicas=False)
    seen = []
    original = runtime.flatten_parameters

    def spy(rnn):
        seen.append({w.device for w in rnn._flat_weights})
        return original(rnn)

    for node in pm.graph.nodes:
        if node.target is runtime.flatten_parameters:
            node.target = spy
    pm.recompile()
    with mode, torch.no_grad():
        pm(torch.randn(5, 8, 6).to("cuda:0"))
    assert seen == [{torch.device(f"cuda:{k}")} for k in range(4)]
