"""A model that holds its own ``torch.Generator`` (a sampler, a noise layer) traces and runs.

fx stows such an object on the root as ``_opaque_obj0``; the program reads it from the
attribute that holds it instead, so it draws from the model's own generator.
"""

import torch
from torch import nn

import dpcompile


class Noise(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = torch.Generator().manual_seed(1)

    def forward(self, x):
        return x + torch.rand(x.shape, generator=self.g)


class NoisyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.noise = Noise()

    def forward(self, x):
        return self.noise(self.fc(x))


def _eager(model, x, seed):
    model.noise.g.manual_seed(seed)
    return model(x)


def test_data_parallel_draws_from_the_models_own_generator():
    model, x = NoisyMLP(), torch.randn(6, 8)
    expected = _eager(model, x, 3)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    assert "generator = noise_g" in pm.code and "_opaque_obj" not in pm.code
    assert pm.noise.g is model.noise.g  # shared, as the model's modules are
    torch.testing.assert_close(_eager(pm, x, 3), expected, rtol=0, atol=0)
    assert not torch.equal(pm(x), expected)  # the generator moved on, as the model's would


def test_tensor_parallel_and_pipeline_keep_the_generator_in_the_program():
    model, x = NoisyMLP(), torch.randn(6, 8)
    expected = _eager(model, x, 5)
    for options in ({"tensor_parallel": True}, {"pipeline": 2}):
        pm = dpcompile.transform(model, ["cpu"] * 2, **options)
        pm.noise.g.manual_seed(5)
        torch.testing.assert_close(pm(x), expected, rtol=1e-6, atol=1e-6)
