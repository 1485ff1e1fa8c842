"""Third-party models for the tensor-parallel tests: small configs, random weights, no downloads.

``torchvision`` here is a CUDA build whose ``torchvision::nms`` ops are missing on a CPU
torch; :func:`import_vision` defines their schemas once so torchvision and timm import.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_defined = False


def import_vision() -> None:
    """Make ``import torchvision`` / ``import timm`` work on this CPU torch (once per process)."""
    global _defined
    if _defined:
        return
    for name in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:  # already defined (by another helper in this process)
            pass
    _defined = True


def conv1d():
    from transformers.pytorch_utils import Conv1D

    return Conv1D


class GPT2Attention(nn.Module):
    """GPT-2's attention as transformers writes it: a fused ``c_attn`` Conv1D split into q, k, v."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        Conv1D = conv1d()
        self.heads, self.head_dim, self.split_size = heads, d // heads, d
        self.c_attn = Conv1D(3 * d, d)
        self.c_proj = Conv1D(d, d)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split(self.split_size, dim=2)
        q = q.view(b, t, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, t, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return self.c_proj(y)


class GPT2MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        Conv1D = conv1d()
        self.c_fc = Conv1D(4 * d, d)
        self.c_proj = Conv1D(d, 4 * d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = GPT2Attention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = GPT2MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT2(nn.Module):
    """A GPT-2-style LM from transformers' Conv1D, with the LM head tied to the token embedding."""

    def __init__(self, vocab: int = 128, d: int = 32, heads: int = 4, layers: int = 2, positions: int = 16):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(positions, d)
        self.h = nn.ModuleList(GPT2Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class TinyGPT2WithLoss(TinyGPT2):
    """The LM computing its own loss: ``F.cross_entropy`` on the logits (vocab-parallel under TP)."""

    def forward(self, ids, labels):
        logits = super().forward(ids)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)


class FusedChunkAttention(nn.Module):
    """A fused qkv nn.Linear, chunked, with uneven heads (3 heads over 2 shards)."""

    def __init__(self, d: int = 12, heads: int = 3):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, t, d))
