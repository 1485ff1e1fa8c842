"""fx frontend: forward reading the mode of a module the program calls (``self.emb.training``, an
nn.Embedding's) keys the program by that mode, as it does by the modes of the modules it enters."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x, p):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(x.shape))


class DropsByTheEmbeddingsMode(nn.Module):
    """The second attention drops by the embedding's mode, the first by its own block's."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.blocks = nn.ModuleList([Attention(), Attention()])
        self.head = nn.Linear(8, 20)

    def forward(self, ids):
        x = self.blocks[0](self.emb(ids), 0.3 if self.blocks[0].training else 0.0)
        x = self.blocks[1](x, 0.3 if self.emb.training else 0.0)
        return self.head(x)


@pytest.mark.parametrize("layout", [{}, {"pipeline": 2}])
def test_a_called_module_switched_alone_runs_as_eager(layout):
    """``model.emb.train()`` on a model in eval: the program kept ``dropout_p=0.0`` read from the embedding's mode
    while traced (the guards key by the modes of the modules forward enters, not of an nn.Embedding it calls), so
    it ran without the dropout eager draws, silently. Now it runs a program traced for that mode: eager's output."""
    torch.manual_seed(0)
    model, ids = DropsByTheEmbeddingsMode().eval(), torch.randint(0, 20, (4, 6))
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="fx", example_inputs=(ids,), **layout)
    model.emb.train()
    eager.emb.train()
    torch.manual_seed(1)
    got = pm(ids)
    torch.manual_seed(1)
    want = eager(ids)
    torch.testing.assert_close(got, want)
    model.emb.eval()
    eager.emb.eval()
    torch.testing.assert_close(pm(ids), eager(ids))
