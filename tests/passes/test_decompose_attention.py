"""``decompose_attention``: nn.MultiheadAttention self-attention written out, the rest kept."""

from __future__ import annotations

import torch
from torch import nn

from dpcompile.capture import capture
from passes.decompose_attention import decompose_attention


class SelfAttention(nn.Module):
    def __init__(self, batch_first: bool = True):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


def test_decompose_attention_matches_the_module_call():
    """The written-out program computes what the module does, batch first or not."""
    for batch_first in (True, False):
        model = SelfAttention(batch_first).eval()
        gm = capture(model)
        result = decompose_attention(gm)
        gm.recompile()
        assert result.modified and result.info["decomposed"] == ["attn"]
        assert "scaled_dot_product_attention" in gm.code and "in_proj_weight" in gm.code
        x = torch.randn(2, 5, 8)
        torch.testing.assert_close(gm(x), model(x), atol=1e-6, rtol=1e-5)


def test_decompose_attention_keeps_cross_attention_and_is_idempotent():
    """Cross-attention stays one call with the reason; a second run changes nothing."""

    class Cross(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2)

        def forward(self, x, y):
            return self.attn(x, y, y)[0]

    gm = capture(Cross())
    result = decompose_attention(gm)
    assert not result.modified and "not self-attention" in result.info["kept"]["attn"]
    gm = capture(SelfAttention())
    decompose_attention(gm)
    code = gm.recompile().src
    assert not decompose_attention(gm).modified and gm.recompile().src == code
