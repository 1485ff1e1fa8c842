"""``split_sequence_made_inside``: the sequence split starts where a model makes its sequence (patches
and a CLS token, as a ViT), the image whole on every device; nothing changes where an input is split."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile import runtime
from dpcompile.fx_utils import propagate_shapes
from passes.sequence_seed import split_sequence_made_inside


class PatchAttention(nn.Module):
    """4x4 patches of an 8x8 image and a CLS token (5 tokens), position embeddings, one attention."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.patches = nn.Conv2d(3, d, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, 5, d))
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, 3)

    def forward(self, image):
        x = self.patches(image).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        return self.out(x + a)[:, 0]


def test_patches_and_cls_split_after_the_position_embeddings_equal_eager():
    """5 tokens over 3 devices (2, 2, 1): the image is whole, the split starts at the position
    embeddings' add; the class logits and every gradient equal eager."""
    torch.manual_seed(0)
    model = PatchAttention().double()
    eager = copy.deepcopy(model)
    image = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 3, mesh={"cp": 3}, example_inputs=(image,), frontend="export")
    assert "dpcompile_runtime_scatter(image" not in pm.code and pm.code.count("attention_regathered(") == 3, pm.code
    got, want = pm(image), eager(image)
    torch.testing.assert_close(got, want)
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"grad {name}: {m}")


def test_nothing_changes_where_an_input_is_split():
    """A text model's input carries the sequence: no seed is inserted."""
    from tests.integration.test_context_parallel import CausalSelfAttention

    gm = torch.fx.symbolic_trace(CausalSelfAttention())
    propagate_shapes(gm, [torch.randn(2, 7, 16)])
    result = split_sequence_made_inside(gm, input_dims={"x": 1})
    assert not result.modified
    assert not [n for n in gm.graph.nodes if n.target is runtime.sequence_split]
